"""The model every lecture trains, and what one device spends on it (lecture 01's building blocks).

- `gpt`: the small GPT and its task; `attention`: FlashAttention's online softmax by blocks.
- `memory`: the two memory meters; `training_memory`: a step's memory phase by phase;
  `activations`: what a block saves for backward, recomputation and accumulation.
- `precision`: number formats fp32 → fp8 and mixed precision; `roofline`: this machine's FLOP/s
  and bandwidths.
- `demos`, `deep_dives`, `figures`: what lecture 01's demos run, its appendix page's sections,
  and its page's drawings.

The building blocks below are the package's public names; import them from here,
`from lectures.model import GPT, GPTConfig, SavedBytes`,
and the page code (`demos`, `figures`, `deep_dives`) from its own module.
"""
from lectures.model.gpt import (GPTConfig, causal_attention, CausalSelfAttention, MLP, Block, GPT, param_count,
                                markov_chain, entropy_rate, batch, loss_fn)
from lectures.model.memory import LiveBytes, SavedBytes, saved_bytes
from lectures.model.attention import (naive_causal_attention, attention_with_lse, merge_attention,
                                      OnlineSoftmaxAttention, online_softmax_attention)
from lectures.model.activations import (block_activations, korthikanti_bytes, reconciled_bytes, Recomputed,
                                        with_recomputation, recomputation_step, accumulated_gradients,
                                        chunked_cross_entropy, loss_memory)
from lectures.model.training_memory import (by_category, MEM_CATEGORIES, held_by_training, CastWeightCopies,
                                            memory_timeline, fake_training_step)
from lectures.model.precision import (FORMATS, round_to, overflow_table, values_between, format_properties,
                                      relative_error_across_magnitudes, fp16_gradients, fp32_gradients, gradient_error,
                                      per_tensor_error, gradient_rms, MasterWeights, freeze_threshold, frozen_fraction,
                                      train_curve, quantize_fp8, dequantize_fp8, fp8_matmul_error, keep_bits,
                                      accumulate, accumulation_error, scaling_over_steps, scaled_mm_error,
                                      outlier_matrices, ordinary_channels)
from lectures.model.roofline import (threads, matmul_rate, largest_cache_bytes, copy_bytes_beyond_cache, copy_rate,
                                     elementwise_rate, bandwidths)

__all__ = [
    "GPTConfig", "causal_attention", "CausalSelfAttention", "MLP", "Block", "GPT", "param_count", "markov_chain",
    "entropy_rate", "batch", "loss_fn",
    "LiveBytes", "SavedBytes", "saved_bytes",
    "naive_causal_attention", "attention_with_lse", "merge_attention", "OnlineSoftmaxAttention",
    "online_softmax_attention",
    "block_activations", "korthikanti_bytes", "reconciled_bytes", "Recomputed", "with_recomputation",
    "recomputation_step", "accumulated_gradients", "chunked_cross_entropy", "loss_memory",
    "by_category", "MEM_CATEGORIES", "held_by_training", "CastWeightCopies", "memory_timeline",
    "fake_training_step",
    "FORMATS", "round_to", "overflow_table", "values_between", "format_properties",
    "relative_error_across_magnitudes", "fp16_gradients", "fp32_gradients", "gradient_error", "per_tensor_error",
    "gradient_rms", "MasterWeights", "freeze_threshold", "frozen_fraction", "train_curve", "quantize_fp8",
    "dequantize_fp8", "fp8_matmul_error", "keep_bits", "accumulate", "accumulation_error", "scaling_over_steps",
    "scaled_mm_error", "outlier_matrices", "ordinary_channels",
    "threads", "matmul_rate", "largest_cache_bytes", "copy_bytes_beyond_cache", "copy_rate", "elementwise_rate",
    "bandwidths",
]
