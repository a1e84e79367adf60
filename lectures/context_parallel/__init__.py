"""Context parallelism, and expert parallelism beside it (lecture 06's building blocks).

- `sharding`: contiguous and zig-zag shards of a sequence, and the segments each rank holds.
- `blocks`: attention on segments, the block math every variant shares.
- `ring`: ring attention; `variants`: all-gather attention, Ulysses, the GPT swap and PyTorch's own.
- `moe`: mixture of experts and expert parallelism (tokens travel by all-to-all, as Ulysses' heads do).
- `demos`, `deep_dives`, `figures`: what lecture 06's demos run on each rank (and the one-process
  references), its appendix page's sections, and its page's drawings.

The building blocks below are the package's public names; import them from here,
`from lectures.context_parallel import ring_attention, zigzag_shard`,
and the page code (`demos`, `figures`, `deep_dives`) from its own module.
"""
from lectures.context_parallel.sharding import (zigzag_chunks, zigzag_shard, zigzag_unshard, contiguous_shard,
                                                shard_sequence, unshard_sequence, layout_segments, sequence_positions,
                                                striped_positions, causal_work)
from lectures.context_parallel.blocks import SegmentAttention, full_attention
from lectures.context_parallel.ring import RingTransfer, RingAttention, ring_attention
from lectures.context_parallel.variants import (AllGatherAttention, allgather_attention, SeqToHeads, HeadsToSeq,
                                                ulysses_attention, ATTENTION, context_parallel_gpt)
from lectures.context_parallel.moe import (Expert, route, route_logits, z_loss, capacity, slot_counts,
                                           positions_in_expert, balance_loss, MoE, AllToAll, expert_owners,
                                           ExpertParallelMoE, RankCapacityMoE, moe_gpt)

__all__ = [
    "zigzag_chunks", "zigzag_shard", "zigzag_unshard", "contiguous_shard", "shard_sequence", "unshard_sequence",
    "layout_segments", "sequence_positions", "striped_positions", "causal_work",
    "SegmentAttention", "full_attention",
    "RingTransfer", "RingAttention", "ring_attention",
    "AllGatherAttention", "allgather_attention", "SeqToHeads", "HeadsToSeq", "ulysses_attention", "ATTENTION",
    "context_parallel_gpt",
    "Expert", "route", "route_logits", "z_loss", "capacity", "slot_counts", "positions_in_expert", "balance_loss",
    "MoE", "AllToAll", "expert_owners", "ExpertParallelMoE", "RankCapacityMoE", "moe_gpt",
]
