"""Context parallelism, and expert parallelism beside it (lecture 06's building blocks).

- `sharding`: contiguous and zig-zag shards of a sequence, and the segments each rank holds.
- `blocks`: attention on segments, the block math every variant shares.
- `ring`: ring attention; `variants`: all-gather attention, Ulysses, the GPT swap and PyTorch's own.
- `moe`: mixture of experts and expert parallelism (tokens travel by all-to-all, as Ulysses' heads do).
- `demos`, `deep_dives`, `figures`: what lecture 06's demos run on each rank (and the one-process
  references), its appendix page's sections, and its page's drawings.
"""
