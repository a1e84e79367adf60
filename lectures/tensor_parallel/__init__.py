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
"""
