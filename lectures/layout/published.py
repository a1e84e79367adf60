"""Published training runs through lecture 07's step-time model: calibrated on one run per GPU
type, predicted on the others, each error shown (tests/test_lecture_07.py holds them to ±10%).

- `MEGATRON_TABLE1`: Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", https://arxiv.org/abs/2104.04473), Table 1: GPT models from 1.7B to
  1T parameters on up to 3,072 A100 80 GB GPUs (Selene: DGX A100 nodes, 8 × 200 Gb/s HDR), sequence
  2,048, vocabulary 51,200, activation recomputation, teraFLOP/s per GPU counted with the
  paper's own formula (`megatron_flops_per_token`, which includes the recomputed forward).
- `DEEPSEEK_V3`: the MoE model of DeepSeek-V3's report (DeepSeek-AI 2024,
  https://arxiv.org/abs/2412.19437) and its published run (`DEEPSEEK_V3_RUN`).
- `published_fit`, `predict_run`, `fit_fraction`: the calibration and the predictions.
"""
import dataclasses
import functools

from lectures.layout.estimator import Layout, ModelShape, estimate_memory
from lectures.layout.search import GEMM, reach, reproduce_table4
from lectures.layout.step_time import (H100_HBM, H100_MEMORY, LLAMA3_405B, LLAMA3_70B, LLAMA3_8B, a100_cluster,
                                       h100_cluster, step_time)
from lectures.model.gpu_evidence import TORCHTITAN_FSDP_SCALING

# (parameters in billions, heads, hidden, layers, tp, pp, GPUs, global batch, teraFLOP/s per GPU)
MEGATRON_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
MEGATRON_SOURCE = "Narayanan et al. 2021, Table 1 (A100 80 GB), https://arxiv.org/abs/2104.04473"
# The A100 fraction is fitted on the middle row by size (76.1B), the others are predicted.
A100_FIT_ROW = 5


def megatron_shape(row):
    """The GPT of a Table 1 row: GPT-3's architecture (LayerNorm, GELU MLP of 4h, biases,
    learned positions, tied embedding), s = 2048, V = 51,200."""
    billions, heads, hidden, layers = row[:4]
    return ModelShape(f"GPT {billions}B", layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                      ffn=4 * hidden, vocab=51200, seq=2048, tied=True)


# Korthikanti et al. 2022 (https://arxiv.org/abs/2205.05198), Table 3: GPT-3 175B, 96 heads,
# h = 12,288, 96 layers, s = 2,048, run at tp = 8 — the model of its activation-memory counts.
KORTHIKANTI_175B = dataclasses.replace(megatron_shape((175, 96, 12288, 96)), name="GPT-3 175B")
KORTHIKANTI_TP = 8


def selective_per_token_bytes(tp, hidden):
    """Korthikanti et al. 2022, Table 2: with sequence parallelism and their selective
    recomputation a block keeps 34·s·b·h/t bytes at 16 bits, of which 2·s·b·h/t are the two
    dropout masks (a byte per element): bytes per token, and those of the masks."""
    return 34 * hidden / tp, 2 * hidden / tp


def megatron_flops_per_token(model):
    """The paper's count per token, with activation recomputation (its Appendix):
    96·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    l, h, s, v = model.layers, model.hidden, model.seq, model.vocab
    return 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def megatron_run(row):
    """A Table 1 row as a published run: its mesh, batch and measured seconds per step."""
    billions, heads, hidden, layers, tp, pp, gpus, batch, tflops = row
    model = megatron_shape(row)
    seconds = batch * model.seq * megatron_flops_per_token(model) / (tflops * 1e12 * gpus)
    return {"name": f"GPT {billions}B on {gpus} A100s", "model": model, "gpus": gpus,
            "mesh": {"dp": gpus // (tp * pp), "pp": pp, "cp": 1, "tp": tp}, "batch": batch,
            "seconds": seconds, "source": MEGATRON_SOURCE, "gpu": "A100",
            # Megatron-LM 2021: full recomputation, no distributed optimizer, no sequence
            # parallelism, attention without FlashAttention (the scores go through HBM)
            "knobs": dict(recompute=("full",), zero=(0,), sp=(False,)), "flash": False,
            "measured": f"{tflops} TFLOP/s per GPU"}


def run_layouts(run, micro_batch_sizes=(1, 2, 4, 8), virtual_stages=(1, 2, 3, 4, 6, 8)):
    """What a published run leaves open on its mesh: micro-batch size and interleaving (and
    what `run["knobs"]` allows of ZeRO, recomputation, sequence parallelism), in bf16."""
    mesh, model, k = run["mesh"], run["model"], run["knobs"]
    per_dp = run["batch"] // mesh["dp"]
    for mb in k.get("micro_batch", micro_batch_sizes):
        m = per_dp // mb
        if per_dp % mb:
            continue
        for v in virtual_stages:
            if (mesh["pp"] == 1 and v > 1) or mesh["pp"] * v > model.layers or (mesh["pp"] > 1 and m < mesh["pp"]):
                continue
            for zero in k.get("zero", (0, 1)):
                for rc in k.get("recompute", ("none", "selective", "full")):
                    for sp in k.get("sp", (False, True)):
                        if (zero and mesh["dp"] * mesh["cp"] == 1) or (sp and mesh["tp"] == 1):
                            continue
                        yield Layout(**mesh, zero=zero, micro_batch=mb, micro_batches=m,
                                     recompute=rc, precision="bf16", sp=sp, virtual_stages=v)


def run_hardware(run, hw):
    """The cluster as the run's software used it: without FlashAttention, attention's matrix
    products run at the GEMM rate and its scores go through HBM; `ep_overlap` as the run claims."""
    hw = dataclasses.replace(hw, ep_overlap=run.get("ep_overlap", hw.ep_overlap))
    return hw if run["flash"] else dataclasses.replace(hw, attention=None, scores_in_hbm=True)


def predict_run(run, hw):
    """The fastest layout the model finds on the run's mesh that fits, its predicted seconds
    per step and the error of the predicted throughput against the published one."""
    hw = run_hardware(run, hw)
    best = None
    for lay in run_layouts(run):
        # a run pinned to its published layout fitted as it ran: the estimator is not asked
        if not run.get("pinned") and estimate_memory(run["model"], lay)["total"] > hw.memory:
            continue
        t = step_time(run["model"], lay, hw)
        if best is None or t["total"] < best["time"]["total"]:
            best = {"layout": lay, "time": t}
    if best is not None:
        best["error"] = run["seconds"] / best["time"]["total"] - 1
        best["run"] = run
    return best


def fit_fraction(run, make_hw, lo=0.3, hi=1.0, steps=30):
    """The sustained GEMM fraction of peak at which the model predicts `run`'s step time."""
    def predicted(fraction):
        got = predict_run(run, make_hw(**{GEMM: fraction}))
        return None if got is None else run["seconds"] / got["time"]["total"]
    return reach(predicted, 1.0, lo, hi, steps)


# torchtitan's Llama 3 numbers (pytorch/torchtitan, docs/performance.md, "Llama 3 performance
# numbers", commit 0413364): FSDP2 (ZeRO-3) on 64 A100 80 GB, local batch 1, sequence 8,192,
# FlashAttention through SDPA; tokens per second per GPU. 8B with torchtitan's "selective op"
# checkpointing (not the course's selective set: charged here as the course's), 70B with full.
TORCHTITAN_SOURCE = "torchtitan, docs/performance.md (Llama 3 on 64 A100 80 GB, FSDP2), https://github.com/pytorch/torchtitan"
TORCHTITAN_A100 = [(LLAMA3_8B, "selective", 2973), (LLAMA3_70B, "full", 331)]


def torchtitan_run(model, recompute, tokens_per_gpu):
    return {"name": f"{model.name} on 64 A100s (torchtitan)", "model": model, "gpus": 64,
            "mesh": {"dp": 64, "pp": 1, "cp": 1, "tp": 1}, "batch": 64,
            "seconds": 64 * model.seq / (tokens_per_gpu * 64), "source": TORCHTITAN_SOURCE, "gpu": "A100",
            "knobs": dict(zero=(3,), sp=(False,), recompute=(recompute,)), "flash": True,
            "measured": f"{tokens_per_gpu:,} tokens/s per GPU"}


def torchtitan_h100_run(gpus, tokens_per_gpu, local_batch=2):
    """torchtitan's Llama 3.1 8B with FSDP2 on H100s, eager (no torch.compile), as lecture 03 draws
    it (lectures/model/gpu_evidence.py, TORCHTITAN_FSDP_SCALING): local batch 2 in one micro-batch,
    sequence 8,192, selective activation checkpointing (charged as the course's selective set)."""
    return {"name": f"Llama 3.1 8B on {gpus} H100s (torchtitan)", "model": LLAMA3_8B, "gpus": gpus,
            "mesh": {"dp": gpus, "pp": 1, "cp": 1, "tp": 1}, "batch": local_batch * gpus,
            "seconds": local_batch * LLAMA3_8B.seq / tokens_per_gpu, "source": TORCHTITAN_FSDP_SCALING.url,
            "gpu": "H100", "flash": True, "measured": f"{tokens_per_gpu:,} tokens/s per GPU", "pinned": True,
            "knobs": dict(zero=(3,), sp=(False,), recompute=("selective",), micro_batch=(local_batch,))}


# torchtitan's H100s (its benchmarks page, llama3_h100_202412_torchtitan.md): Grand Teton hosts of
# 8 H100s with 96 GB of HBM2e at 2.4 TB/s each, 400 Gb/s RDMA per GPU (as the DGX H100 cluster's),
# run at the default 500 W power limit. Table 4's H100s ran at 700 W with 80 GB of HBM3.
GRAND_TETON_MEMORY, GRAND_TETON_HBM, GRAND_TETON_WATTS = 96 * 2 ** 30, 2.4e12, 500
TORCHTITAN_8B_MEMORY = 82.4 * 2 ** 30      # what the eager FSDP run held per GPU on 8 H100s (Table 1)


def grand_teton(h100):
    """`h100` (the DGX H100 cluster, Table 4's GEMM fraction) with torchtitan's memory and its
    bandwidth. The 500 W power limit is not modelled: the GEMM fraction is the 700 W fit's."""
    return dataclasses.replace(h100, name="Grand Teton H100s (96 GB HBM2e, 500 W)",
                               memory=h100.memory / H100_MEMORY * GRAND_TETON_MEMORY,
                               hbm=h100.hbm / H100_HBM * GRAND_TETON_HBM)


def h100_validation(h100):
    """torchtitan's eager FSDP runs of Llama 3.1 8B on 8 and 128 H100s, predicted on their own
    hardware (`grand_teton(h100)`) with Table 4's fitted GEMM fraction: nothing is fitted on them."""
    hw = grand_teton(h100)
    runs = [torchtitan_h100_run(int(gpus.split()[0]), tps) for gpus, tps in TORCHTITAN_FSDP_SCALING.series["FSDP"]]
    return [predict_run(r, hw) for r in runs]


# MosaicML's MPT training benchmarks (mosaicml/llm-foundry, scripts/train/benchmarking/README.md,
# commit 061f2c7): GPT-style models with biases, LayerNorm, a GELU MLP of 4h, learned positions
# and a tied embedding, vocabulary 50,368 (the tables' parameter counts are these shapes', tested),
# trained by one software stack on both GPUs: FSDP's FULL_SHARD (ZeRO-3), FlashAttention, bf16,
# on MosaicML's cloud. The rows at sequence 2,048, one per model size: 8 GPUs where published (the
# 3B on H100s at 16), the 70B at 64. Tokens per second in all, as published.
MPT_SOURCE = "MosaicML, MPT training benchmarks (llm-foundry, scripts/train/benchmarking/README.md)"
MPT_URL = "https://github.com/mosaicml/llm-foundry/tree/main/scripts/train/benchmarking"
MPT_SHAPES = {"760M": (1536, 24, 12), "1B": (2048, 24, 16), "3B": (2560, 32, 20), "7B": (4096, 32, 32),
              "13B": (5120, 40, 40), "30B": (7168, 48, 64), "70B": (8192, 80, 64)}     # width, blocks, heads
MPT_PARAMS = {"760M": 760470528, "1B": 1315950592, "3B": 2651837440, "7B": 6658859008,
              "13B": 12853954560, "30B": 29975214080, "70B": 64862437376}             # the tables' NumParams
# (size, GPUs, micro-batch, global batch, tokens/s in all, activation checkpointing)
MPT_H100 = [("760M", 8, 24, 384, 505177, False), ("1B", 8, 14, 112, 363645, False), ("3B", 16, 10, 480, 386285, False),
            ("7B", 8, 6, 48, 85144, False), ("13B", 8, 2, 16, 38336, False), ("30B", 8, 3, 504, 16022, True),
            ("70B", 64, 8, 2048, 66523, True)]
MPT_A100 = [("760M", 8, 24, 384, 259472, False), ("1B", 8, 14, 448, 164109, False), ("3B", 8, 10, 160, 86491, False),
            ("7B", 8, 6, 96, 37130, False), ("13B", 8, 2, 48, 18097, False), ("30B", 8, 3, 504, 7330, True),
            ("70B", 64, 8, 2048, 26274, True)]


def mpt_shape(size):
    width, blocks, heads = MPT_SHAPES[size]
    return ModelShape(f"MPT {size}", layers=blocks, hidden=width, heads=heads, kv_heads=heads, ffn=4 * width,
                      vocab=50368, seq=2048, tied=True)


def mpt_run(row, gpu):
    """A row of MosaicML's table as a published run, on its published layout (it fitted as it ran)."""
    size, gpus, micro_batch, batch, tokens, checkpointing = row
    model = mpt_shape(size)
    return {"name": f"MPT {size} on {gpus} {gpu}s", "model": model, "gpus": gpus,
            "mesh": {"dp": gpus, "pp": 1, "cp": 1, "tp": 1}, "batch": batch, "seconds": batch * model.seq / tokens,
            "source": MPT_SOURCE, "gpu": gpu, "flash": True, "pinned": True,
            "measured": f"{tokens / gpus:,.0f} tokens/s per GPU",
            "knobs": dict(zero=(3,), sp=(False,), recompute=("full" if checkpointing else "none",),
                          micro_batch=(micro_batch,))}


def mpt_validation(h100, a100):
    """MosaicML's runs, predicted on each GPU with that GPU's one fit (`h100`: Table 4's, `a100`:
    Megatron-LM's 76.1B): nothing is fitted on them. ([H100 rows], [A100 rows])."""
    return ([predict_run(mpt_run(r, "H100"), h100) for r in MPT_H100],
            [predict_run(mpt_run(r, "A100"), a100) for r in MPT_A100])


def hidden_tp_cluster(**changed):
    """The H100 cluster with every tensor-parallel collective hidden under the compute beside it
    (the most any overlap could hide; asynchronous TP, lecture 04, hides part) where the stated
    model leaves them exposed."""
    return dataclasses.replace(h100_cluster(**changed), tp_overlap=1.0)


@functools.cache
def table4_with_hidden_tp():
    """Table 4 fitted and predicted again on `hidden_tp_cluster`: (fraction, rows), as
    `reproduce_table4` returns them (made once: the sensitivity and MosaicML's section read it)."""
    return reproduce_table4(LLAMA3_405B, hidden_tp_cluster)


def a100_runs():
    return [megatron_run(r) for r in MEGATRON_TABLE1] + [torchtitan_run(*r) for r in TORCHTITAN_A100]


def a100_validation(make_hw=a100_cluster, fit_row=A100_FIT_ROW):
    """(fitted fraction, [prediction of every A100 run]) with the GEMM fraction fitted on one
    run (Table 1's middle row), every other run predicted with it."""
    runs = a100_runs()
    frac = fit_fraction(runs[fit_row], make_hw)
    hw = make_hw(**{GEMM: frac})
    return frac, [dict(predict_run(r, hw), fitted=i == fit_row) for i, r in enumerate(runs)]


# DeepSeek-V3 (report §4.2, Table 1): 61 blocks of width 7,168 and 128 heads; the first 3 dense
# (SwiGLU of 18,432, from the released config), the other 58 with 1 shared and 256 routed experts of
# width 2,048, 8 per token; vocabulary 129,280, sequences of 4,096. Its attention (MLA: low-rank
# Q and K/V projections, 192-dim query/key heads, 128-dim values) is modelled as plain multi-head
# attention of 128 heads of 56: 4h² = 206M parameters a block against MLA's 187M. 671B in all
# (the 14B multi-token-prediction module left out), 37B active per token.
DEEPSEEK_V3 = ModelShape("DeepSeek-V3", layers=61, hidden=7168, heads=128, kv_heads=128, ffn=18432,
                         vocab=129280, seq=4096, mlp_matrices=3, bias=False, norm_params=1,
                         learned_positions=False, experts=256, top_k=8, shared_experts=1, expert_ffn=2048,
                         dense_layers=3, route_nodes=4)
DEEPSEEK_V3_PUBLISHED = {"params": 671e9, "active": 37e9}
# The run (§3.1-3.2): 2,048 H800s, PP16, EP64 over 8 nodes, ZeRO-1 data parallelism, no TP;
# "180K H800 GPU hours" per trillion tokens (§1) = 1e12 / (180e3 · 3600) ≈ 1,543 tokens/s per GPU;
# batch 15,360 sequences for most of training (§4.2).
DEEPSEEK_V3_RUN = {"name": "DeepSeek-V3 on 2,048 H800s", "model": DEEPSEEK_V3, "gpus": 2048,
                   "mesh": {"dp": 128, "pp": 16, "cp": 1, "tp": 1, "ep": 64}, "batch": 15360,
                   "seconds": 15360 * 4096 / (1e12 / (180e3 * 3600) * 2048),
                   "source": "DeepSeek-AI 2024, DeepSeek-V3 Technical Report, §1 and §3, https://arxiv.org/abs/2412.19437",
                   "gpu": "H800", "knobs": dict(zero=(1,), sp=(False,)), "flash": True,
                   # DualPipe (§3.2.1): "both all-to-all and PP communication can be fully hidden"
                   "ep_overlap": 1.0,
                   "measured": "180K H800 GPU-hours per trillion tokens"}
