"""Putting the parallelisms together on one (dp, pp, cp, tp) mesh, experts (ep) inside dp
(lecture 07's building blocks).

- `mesh`: ranks on the grid, one group per axis; `trainer`: the GPT trained under any layout.
- `estimator`: per-rank memory from formulas; `step_time`: seconds per step from a cost model;
  `search`: every layout ranked, and the rule of thumb; `calculator`: the page's calculator data.
- `pytorch`: the same layouts from PyTorch's own pieces.
- `published`: published runs (Megatron-LM's Table 1, torchtitan, DeepSeek-V3) through the model:
  one fitted per GPU type, the others predicted.
- `demos`, `deep_dives`, `figures`, `at_scale`: what lecture 07's demos run on each rank (and the
  analysis of what they return), its appendix page's sections, its page's drawings, and its
  sections on published runs across scale and on experts.

The building blocks below are the package's public names; import them from here,
`from lectures.layout import Layout, estimate_memory, search`,
and the page code (`demos`, `figures`, `deep_dives`) from its own module.
"""
from lectures.layout.mesh import (MESH_AXES, mesh_coords, mesh_rank, axis_groups, replica_groups, expert_groups,
                                  Mesh, make_mesh, torch_mesh)
from lectures.layout.estimator import (ModelShape, Layout, PRECISION_BYTES, stage_layers, rank_layers, held_chunks,
                                       in_flight, stage_params, activation_bytes, estimate_memory, rank_blocks,
                                       block_params, check_split)
from lectures.layout.step_time import (Hardware, axis_link, p2p_link, all_reduce_time, gather_time, p2p_time,
                                       flops_per_token, matmul_params, dp_parts, dp_traffic, chunk_backward,
                                       after_the_pipeline, step_time, mfu, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B,
                                       LLAMA3_405B_PUBLISHED_PARAMS, H100_PEAK_BF16, H100_MEMORY, NVLINK_BW, IB_BW,
                                       FA2_H100, NVLINK_ACHIEVED, IB_ACHIEVED, ATTENTION, NVLINK, IB, ASSUMED,
                                       h100_cluster, a100_cluster, h800_cluster, H100_HBM, A100_PEAK_BF16,
                                       A100_HBM, HBM, SMS, TILE, all_to_all_time, memory_bound_time, optimizer_time,
                                       block_gemms, rank_gemms, wave_efficiency, gemm_efficiency, collective_bytes, kept_gathered, zero3_bytes, step_bytes)
from lectures.layout.search import (valid_layouts, search, decision_procedure, LLAMA3_TABLE4, GEMM, table4_row,
                                    reproduce_table4, attention_rate_needed, causal_discounted, near_ties)
from lectures.layout.calculator import presets, calculator_data
from lectures.layout.trainer import (GroupCollectives, Run, build_model, reference_run, max_param_diff, LayoutTrainer,
                                     train_layout)
from lectures.layout.pytorch import pytorch_tp_plan, pytorch_layout

__all__ = [
    "MESH_AXES", "mesh_coords", "mesh_rank", "axis_groups", "replica_groups", "expert_groups", "Mesh", "make_mesh",
    "torch_mesh",
    "ModelShape", "Layout", "PRECISION_BYTES", "stage_layers", "rank_layers", "held_chunks", "in_flight",
    "stage_params", "activation_bytes", "estimate_memory", "rank_blocks", "block_params", "check_split",
    "Hardware", "axis_link", "p2p_link", "all_reduce_time", "gather_time", "p2p_time", "flops_per_token", "matmul_params",
    "dp_parts", "dp_traffic", "chunk_backward", "after_the_pipeline", "step_time", "mfu", "LLAMA3_8B", "LLAMA3_70B", "LLAMA3_405B", "LLAMA3_405B_PUBLISHED_PARAMS",
    "H100_PEAK_BF16", "H100_MEMORY", "NVLINK_BW", "IB_BW", "FA2_H100", "NVLINK_ACHIEVED", "IB_ACHIEVED",
    "ATTENTION", "NVLINK", "IB", "ASSUMED", "h100_cluster", "a100_cluster", "h800_cluster", "H100_HBM",
    "A100_PEAK_BF16", "A100_HBM", "HBM", "SMS", "TILE", "all_to_all_time", "memory_bound_time", "optimizer_time",
    "block_gemms", "rank_gemms", "wave_efficiency", "gemm_efficiency", "collective_bytes",
    "kept_gathered", "zero3_bytes",
    "step_bytes",
    "valid_layouts", "search", "decision_procedure", "LLAMA3_TABLE4", "GEMM", "table4_row", "reproduce_table4",
    "attention_rate_needed", "causal_discounted", "near_ties",
    "presets", "calculator_data",
    "GroupCollectives", "Run", "build_model", "reference_run", "max_param_diff", "LayoutTrainer", "train_layout",
    "pytorch_tp_plan", "pytorch_layout",
]
from lectures.layout.published import (MEGATRON_TABLE1, megatron_run, megatron_shape, predict_run, fit_fraction,
                                       a100_validation, a100_runs, torchtitan_run, TORCHTITAN_A100, DEEPSEEK_V3,
                                       DEEPSEEK_V3_RUN, DEEPSEEK_V3_PUBLISHED, KORTHIKANTI_175B, KORTHIKANTI_TP,
                                       selective_per_token_bytes, MPT_H100, MPT_A100, mpt_shape, mpt_run,
                                       mpt_validation, hidden_tp_cluster, table4_with_hidden_tp)

__all__ += ["MPT_H100", "MPT_A100", "mpt_shape", "mpt_run", "mpt_validation", "hidden_tp_cluster",
            "table4_with_hidden_tp", "MEGATRON_TABLE1", "megatron_run", "megatron_shape", "predict_run", "fit_fraction", "a100_validation",
            "a100_runs", "torchtitan_run", "TORCHTITAN_A100", "DEEPSEEK_V3", "DEEPSEEK_V3_RUN", "DEEPSEEK_V3_PUBLISHED",
            "KORTHIKANTI_175B", "KORTHIKANTI_TP", "selective_per_token_bytes"]

# Lecture 08: where each rank's tensors sit in the global model, and the global gradient norm
from lectures.layout.shards import Piece, local_pieces, flat_boxes, global_grad_norm, clip_grads_

__all__ += ["Piece", "local_pieces", "flat_boxes", "global_grad_norm", "clip_grads_"]
