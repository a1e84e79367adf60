"""Lecture 01's exercises: counting parameters, the online softmax, bytes per parameter."""
import math
from types import MappingProxyType

import torch

from exercises import exercise, mutant

# --- the parameter count of a GPT config ---------------------------------------------------

# The check's cases are read-only (tuples, mapping proxies): a student's function runs beside them.
CONFIGS = tuple(tuple(MappingProxyType(kw) for kw in group) for group in (
    # one group per rank: GQA, tied embeddings, odd widths, a one-layer model
    [dict(vocab_size=64, seq_len=32, d_model=64, n_layers=2, n_heads=4),
     dict(vocab_size=97, seq_len=17, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2)],
    [dict(vocab_size=50, seq_len=8, d_model=32, n_layers=1, n_heads=2, tie_embeddings=True),
     dict(vocab_size=101, seq_len=33, d_model=36, n_layers=5, n_heads=3, d_ff=37)],
    [dict(vocab_size=7, seq_len=5, d_model=12, n_layers=4, n_heads=4, n_kv_heads=1, d_ff=9,
          tie_embeddings=True),
     dict(vocab_size=1000, seq_len=64, d_model=80, n_layers=2, n_heads=8, n_kv_heads=4)],
))


def check_param_count(rank, world_size, fn):
    from lectures.model import GPT, GPTConfig, param_count
    out = []
    for kw in CONFIGS[rank]:
        cfg = GPTConfig(**kw)
        counted = sum(p.numel() for p in GPT(cfg).parameters())
        assert counted == param_count(cfg)
        out.append((f"GPTConfig({', '.join(f'{k}={v}' for k, v in kw.items())})", counted, fn(cfg)))
    return out


def gpt_param_count(cfg):
    """Reference: the closed form of lectures/model/gpt.py's param_count."""
    h, v, f = cfg.d_model, cfg.vocab_size, cfg.ff
    h_kv = cfg.kv_heads * cfg.head_dim
    per_layer = 2 * (h * h + h) + 2 * (h * h_kv + h_kv) + (2 * h * f + f + h) + 4 * h
    head = 0 if cfg.tie_embeddings else h * v
    return h * v + cfg.seq_len * h + cfg.n_layers * per_layer + 2 * h + head


exercise(
    module=__name__, name="gpt_param_count",
    title="the parameter count Ψ of a GPT config, in closed form",
    statement=(
        "**Exercise: the parameter count of a GPT config.** Write `gpt_param_count(cfg)` for the "
        "lecture's GPT (`lectures/model/gpt.py`): token embedding v·h, learned positions s·h; per block "
        "two LayerNorms (weight and bias), Q and O projections h×h with biases, K and V "
        "projections h×h_kv with biases (h_kv = `cfg.kv_heads × cfg.head_dim`: grouped-query "
        "attention), an MLP h→f→h with biases (f = `cfg.ff`); a final LayerNorm; and an LM head "
        "h×v without bias unless `cfg.tie_embeddings`. The syllabus' Ψ ≈ h·v + L(12h² + 13h) is "
        "the special case f = 4h, full attention, tied head, no positions — the check uses "
        "configs where it is not. It compares with `sum(p.numel() for p in GPT(cfg).parameters())`, "
        "two configs per rank on 3 ranks."),
    stub=(
        "def gpt_param_count(cfg):\n"
        "    \"\"\"The number of parameters of GPT(cfg), without building it.\"\"\"\n"
        "    h, v, f = cfg.d_model, cfg.vocab_size, cfg.ff\n"
        "    raise NotImplementedError(\"hint: count one block (Q, K, V, O, the MLP, two LayerNorms), \"\n"
        "                              \"times n_layers, plus embeddings, positions, final norm, head\")\n"),
    harness=check_param_count, solution=gpt_param_count,
    wrong={"K and V as wide as Q (ignores GQA)": mutant(gpt_param_count, ("cfg.kv_heads * cfg.head_dim", "h")),
           "ignores tie_embeddings": mutant(gpt_param_count, ("0 if cfg.tie_embeddings else h * v", "h * v")),
           "the syllabus' approximation": mutant(gpt_param_count,
                                                 ("cfg.seq_len * h + cfg.n_layers * per_layer + 2 * h + head",
                                                  "cfg.n_layers * (12 * h * h + 13 * h) + 2 * h"))},
    hint="K and V are h × (kv_heads · head_dim); a tied head adds nothing; positions add seq_len · h",
    sizes="6 configs: GQA, tied heads, odd widths")


# --- the online-softmax update of one block -------------------------------------------------

BLOCKS = ((3, 1, 5, 2), (11,), (1, 1, 1, 1, 1, 6))   # key blocks per rank: uneven, one, many


def check_online_softmax(rank, world_size, fn):
    from lectures.model import attention_with_lse
    out = []
    g = torch.Generator().manual_seed(rank)
    for scale in (1.0, 300.0):               # 300: exp() of raw scores overflows float64
        q = torch.randn(1, 1, 4, 3, generator=g, dtype=torch.float64)
        k = torch.randn(1, 1, 11, 3, generator=g, dtype=torch.float64) * scale
        v = torch.randn(1, 1, 11, 5, generator=g, dtype=torch.float64)
        expected, lse = attention_with_lse(q, k, v, scale=1.0)
        scores = (q @ k.transpose(-2, -1))[0, 0]
        m = torch.full((4,), float("-inf"), dtype=torch.float64)
        l, acc = torch.zeros(4, dtype=torch.float64), torch.zeros(4, 5, dtype=torch.float64)
        start = 0
        for size in BLOCKS[rank]:
            m, l, acc = fn(m, l, acc, scores[:, start:start + size], v[0, 0, start:start + size])
            start += size
        out.append((f"keys in blocks of {list(BLOCKS[rank])}, scores up to {scores.abs().max():.0f}",
                    [expected[0, 0], lse[0, 0]], [acc / l[:, None], m + torch.log(l)]))
    return out


def online_softmax_update(m, l, acc, scores, v):
    """Reference: FlashAttention's running max, running sum and rescaled accumulator."""
    m_new = torch.maximum(m, scores.amax(dim=-1))
    correction = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * correction + p.sum(-1), acc * correction[:, None] + p @ v


exercise(
    module=__name__, name="online_softmax_update",
    title="the online-softmax update of one attention block (FlashAttention)",
    statement=(
        "**Exercise: the online-softmax update.** FlashAttention (Dao et al. 2022; Milakov & "
        "Gimelshein 2018) visits the keys block by block and keeps, per query, a running max m, "
        "a running sum l = Σ exp(s − m) and an unnormalised output acc = Σ exp(s − m)·v. Write "
        "`online_softmax_update(m, l, acc, scores, v)` for one block: `scores` (queries × block) "
        "are this block's q·kᵀ (already scaled), `v` (block × d) its values; return the new "
        "`(m, l, acc)`. When the max grows from m to m′, everything summed so far must be "
        "rescaled by exp(m − m′). The check starts from m = −∞, l = 0, acc = 0, feeds the keys "
        "in uneven blocks (3 ranks, a different split on each), and compares acc / l and "
        "m + log l with the course's `attention_with_lse` — also with scores in the hundreds, "
        "where exp(score) overflows float64."),
    stub=(
        "def online_softmax_update(m, l, acc, scores, v):\n"
        "    \"\"\"One block: running max m (q,), running sum l (q,), accumulator acc (q, d).\"\"\"\n"
        "    raise NotImplementedError(\"hint: m_new = max(m, scores.amax(-1)); rescale l and acc \"\n"
        "                              \"by exp(m - m_new), then add this block with exp(scores - m_new)\")\n"),
    harness=check_online_softmax, solution=online_softmax_update,
    wrong={"forgets to rescale the accumulator": mutant(online_softmax_update, ("acc * correction[:, None]", "acc")),
           "no running max (overflows)": mutant(online_softmax_update,
                                                ("torch.maximum(m, scores.amax(dim=-1))", "torch.zeros_like(m)")),
           "rescales by exp(m_new - m)": mutant(online_softmax_update,
                                                ("exp(m - m_new)", "exp(m_new - m).nan_to_num(posinf=0.0)"))},
    hint="both l and acc were summed relative to the old max: multiply both by exp(m - m_new)",
    sizes="float64, 11 keys in blocks of [3, 1, 5, 2], [11], [1×5, 6]; scores up to ~1000")


# --- bytes per parameter of a precision recipe ----------------------------------------------

RECIPES = ("fp32", "bf16", "fp64")   # one per rank


def check_bytes(rank, world_size, fn):
    from lectures.layout import PRECISION_BYTES
    name = RECIPES[rank]
    expected = {k: PRECISION_BYTES[name][k] for k in ("weights", "grads", "optimizer")}
    got = fn(name)
    out = [(f"recipe {name!r}", expected, got)]
    if isinstance(got, dict):
        psi = 7_000_000_001
        out.append((f"recipe {name!r}, total for Ψ = {psi:,} with AdamW", psi * sum(expected.values()),
                    psi * sum(v for v in got.values() if isinstance(v, (int, float)))))
    return out


def bytes_per_parameter(recipe):
    """Reference: AdamW's bytes per parameter (gradients accumulated in fp32 under bf16)."""
    return {"fp32": {"weights": 4, "grads": 4, "optimizer": 8},
            "bf16": {"weights": 2, "grads": 4, "optimizer": 12},
            "fp64": {"weights": 8, "grads": 8, "optimizer": 16}}[recipe]


exercise(
    module=__name__, name="bytes_per_parameter",
    title="bytes per parameter of a precision recipe (AdamW, mixed precision)",
    statement=(
        "**Exercise: bytes per parameter.** Write `bytes_per_parameter(recipe)` returning "
        "`{\"weights\": ..., \"grads\": ..., \"optimizer\": ...}`, the bytes each parameter costs "
        "when training with AdamW under `recipe`: `\"fp32\"` (fp32 weights and gradients, two "
        "fp32 moments, no extra copy), `\"bf16\"` (mixed precision as Megatron-LM and Llama 3 train: "
        "bf16 weights, gradients accumulated in fp32 across micro-batches, and the optimizer keeps an "
        "fp32 master copy of the weights plus the two fp32 moments, K = 12 as in the ZeRO paper, "
        "Rajbhandari et al. 2020 §3.1, whose own count has bf16 gradients), `\"fp64\"` (everything in "
        "float64, the course's exact runs). The check runs one recipe per rank (3 ranks) against "
        "the course's `PRECISION_BYTES` (lectures/layout/estimator.py), and the total for a 7B model."),
    stub=(
        "def bytes_per_parameter(recipe):\n"
        "    \"\"\"{'weights', 'grads', 'optimizer'} bytes per parameter under AdamW.\"\"\"\n"
        "    raise NotImplementedError(\"hint: the mixed-precision optimizer holds fp32 master \"\n"
        "                              \"weights + two fp32 moments\")\n"),
    harness=check_bytes, solution=bytes_per_parameter,
    wrong={"mixed precision without the fp32 master copy":
               mutant(bytes_per_parameter, ('"grads": 4, "optimizer": 12', '"grads": 4, "optimizer": 8')),
           "a master copy in plain fp32 too":
               mutant(bytes_per_parameter, ('"grads": 4, "optimizer": 8', '"grads": 4, "optimizer": 12')),
           "bf16 gradients (the ZeRO paper's count, not fp32 accumulation)":
               mutant(bytes_per_parameter, ('"grads": 4, "optimizer": 12', '"grads": 2, "optimizer": 12'))},
    hint="18 bytes per parameter in total for mixed precision (2 + 4 + 12); 16 for fp32 (4 + 4 + 8)",
    sizes="fp32, bf16, fp64, one per rank")
