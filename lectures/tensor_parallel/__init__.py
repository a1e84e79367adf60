"""Tensor and sequence parallelism (lecture 04's building blocks).

- `ops`: the conjugate operators (Megatron-LM's f and g, and sequence parallelism's pair).
- `layers`: column- and row-parallel linear, the sequence-parallel LayerNorm and positions.
- `attention`: attention split by heads; `vocab`: the vocabulary-parallel embedding and loss.
- `gpt`: the plan that applies them to the GPT (ours, and PyTorch's DTensor).
- `rng`: dropout masks that agree where activations are replicated.
- `async_tp`: the sequence-parallel collectives hidden behind the matmuls they feed.
- `demos`: what each rank runs in lecture 04's demos, and the one-process references.
- `deep_dives`: lecture 04's appendix page (dropout and random numbers; async TP).
- `figures`: the drawings of lecture 04's pages.

The building blocks below are the package's public names; import them from here,
`from lectures.tensor_parallel import ColumnParallelLinear, parallelize_gpt`,
and the page code (`demos`, `figures`, `deep_dives`) from its own module.
"""
from lectures.tensor_parallel.ops import (SEQ_DIM, CopyToRegion, ReduceFromRegion, GatherFromRegion, ScatterToRegion,
                                          AllGatherSequence, ReduceScatterSequence, ScatterToSequence,
                                          GatherFromSequence, copy_to_region, reduce_from_region, gather_from_region,
                                          scatter_to_region, all_gather_sequence, reduce_scatter_sequence,
                                          scatter_to_sequence, gather_from_sequence)
from lectures.tensor_parallel.layers import (ColumnParallelLinearFunction, ColumnParallelLinear, RowParallelLinear,
                                             SequenceParallelLayerNorm, SequenceParallelPositions)
from lectures.tensor_parallel.attention import ShareKVHeads, TensorParallelAttention
from lectures.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy
from lectures.tensor_parallel.gpt import (tp_group, gpt_plan, check_splittable, parallelize_gpt, tp_loss,
                                          full_parameters, dtensor_plan, parallelize_gpt_dtensor)
from lectures.tensor_parallel.rng import MaskKey, keep_mask, dropout, TPRandom
from lectures.tensor_parallel.async_tp import (Traffic, all_gather_matmul, matmul_reduce_scatter, AllGatherMatmul,
                                               MatmulReduceScatter, SequenceParallelMLP)

__all__ = [
    "SEQ_DIM", "CopyToRegion", "ReduceFromRegion", "GatherFromRegion", "ScatterToRegion", "AllGatherSequence",
    "ReduceScatterSequence", "ScatterToSequence", "GatherFromSequence", "copy_to_region", "reduce_from_region",
    "gather_from_region", "scatter_to_region", "all_gather_sequence", "reduce_scatter_sequence",
    "scatter_to_sequence", "gather_from_sequence",
    "ColumnParallelLinearFunction", "ColumnParallelLinear", "RowParallelLinear", "SequenceParallelLayerNorm",
    "SequenceParallelPositions",
    "ShareKVHeads", "TensorParallelAttention",
    "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "tp_group", "gpt_plan", "check_splittable", "parallelize_gpt", "tp_loss", "full_parameters", "dtensor_plan",
    "parallelize_gpt_dtensor",
    "MaskKey", "keep_mask", "dropout", "TPRandom",
    "Traffic", "all_gather_matmul", "matmul_reduce_scatter", "AllGatherMatmul", "MatmulReduceScatter",
    "SequenceParallelMLP",
]
