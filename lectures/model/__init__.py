"""The model every lecture trains, and what one device spends on it (lecture 01's building blocks).

- `gpt`: the small GPT and its task; `attention`: FlashAttention's online softmax by blocks.
- `memory`: the two memory meters; `training_memory`: a step's memory phase by phase;
  `activations`: what a block saves for backward, recomputation and accumulation.
- `precision`: number formats fp32 → fp8 and mixed precision; `roofline`: this machine's FLOP/s
  and bandwidths.
- `demos`, `deep_dives`, `figures`: what lecture 01's demos run, its appendix page's sections,
  and its page's drawings.
"""
