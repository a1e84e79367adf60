"""Activation memory: what one transformer block saves for backward, the formula of Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") reconciled with it
term by term, and the two ways to hold less of it: recomputation (Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost"; and a selective policy of our own, not Korthikanti et al.'s) and gradient
accumulation over micro-batches.

The bytes are measured with the course's two meters (lectures.model.memory): `SavedBytes` for what
autograd keeps, `LiveBytes` where a checkpoint hides its saved tensors from saved-tensor hooks.
"""
import functools

import torch
from torch import nn

from lectures.model.gpt import GPT, Block, batch, causal_attention, loss_fn
from lectures.model.memory import LiveBytes, SavedBytes


def block_activations(cfg, batch_size, seq, attend=causal_attention):
    """What autograd saves for one transformer block on a (batch, seq, h) input: the
    `SavedBytes` meter (`.total` bytes, `.tensors` one (shape, dtype, bytes) per storage)."""
    block = Block(cfg).to(cfg.torch_dtype)
    block.attn.attend = attend
    x = torch.randn(batch_size, seq, cfg.d_model, dtype=cfg.torch_dtype, requires_grad=True)
    with SavedBytes(exclude=block.parameters()) as saved:
        block(x).sum()
    return saved


def korthikanti_bytes(cfg, batch_size, seq):
    """Korthikanti et al. (2022): bytes of activations per layer in 16-bit with dropout,
    s·b·h·(34 + 5·a·s/h)."""
    s, b, h, a = seq, batch_size, cfg.d_model, cfg.n_heads
    return s * b * h * (34 + 5 * a * s / h)


def reconciled_bytes(cfg, batch_size, seq, attention="sdpa"):
    """The same count for *this* block, term by term. Elements saved per token (× s·b):
    LN1 input h, LN1 output h (the input of Q, K, V), q h, k and v h_kv each, attention output
    h (the input of O), LN2 input h, LN2 output h (the input of fc_in), GELU input f, GELU
    output f (the input of fc_out). That is the paper's 34 without its two sbh dropout masks
    (32 = 2 bytes × 16 elements) — and 4 bytes each, we train in fp32. Small extras: each
    LayerNorm keeps a mean and 1/std per token (fp32). Attention: the fused kernel keeps one
    log-sum-exp per (head, token) instead of the paper's 5·a·s² bytes (softmax output, dropout
    mask and dropout output); the naive version keeps the fp32 probabilities a·s² and a bool
    causal mask s²."""
    s, b, h, a, f = seq, batch_size, cfg.d_model, cfg.n_heads, cfg.ff
    e = cfg.torch_dtype.itemsize
    h_kv = cfg.kv_heads * cfg.head_dim if attention == "sdpa" else h  # naive sees repeated K, V
    terms = {"LN inputs (2·h)": 2 * h * s * b * e,
             "LN outputs = inputs of QKV and fc_in (2·h)": 2 * h * s * b * e,
             "q, k, v (h + 2·h_kv)": (h + 2 * h_kv) * s * b * e,
             "attention output = input of O (h)": h * s * b * e,
             "GELU input and output (2·f)": 2 * f * s * b * e,
             "LayerNorm mean and 1/std (2 × 2 per token)": 4 * s * b * 4}
    if attention == "sdpa":
        terms["log-sum-exp (a per token)"] = a * s * b * 4
    else:
        terms["softmax probabilities (a·s per token)"] = a * s * s * b * e
        terms["causal mask (s², bool)"] = s * s
    return terms


def _save_matmuls(ctx, op, *args, **kwargs):
    """Our selective recomputation policy: keep matmul and attention outputs (expensive to redo),
    recompute the cheap element-wise work and LayerNorms. Korthikanti et al.'s selective
    recomputation is a different rule: it recomputes the attention core (scores, softmax,
    dropout: the 5·a·s²·b term) and keeps the rest; fused attention keeps no s² tensor."""
    from torch.utils.checkpoint import CheckpointPolicy
    keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default}
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


class Recomputed(nn.Module):
    """Wrap a block: `mode` "none" stores everything, "full" keeps only the block's input and
    re-runs its forward in backward, "selective" keeps what `_save_matmuls` says."""

    def __init__(self, block, mode):
        super().__init__()
        if mode not in ("none", "full", "selective"):
            raise ValueError(f"recomputation mode must be none, full or selective, not {mode!r}")
        self.block, self.mode = block, mode

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
        if self.mode == "none" or not torch.is_grad_enabled():
            return self.block(x)
        if self.mode == "full":
            return checkpoint(self.block, x, use_reentrant=False)
        return checkpoint(self.block, x, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls))


def with_recomputation(cfg, mode):
    """GPT(cfg) with every block wrapped; the same weights for every mode."""
    model = GPT(cfg)
    model.blocks = nn.ModuleList(Recomputed(b, mode) for b in model.blocks)
    return model


def recomputation_step(cfg, batch_size, mode):
    """One forward + backward: the bytes held between them (measured with LiveBytes: the
    checkpoint hides its saved tensors from saved-tensor hooks, not from a dispatch mode that
    sees every operator's outputs), the peak, and the gradients."""
    model = with_recomputation(cfg, mode)
    tokens, targets = batch(cfg, batch_size, 0)
    with LiveBytes() as live:
        loss = loss_fn(model(tokens), targets)
        held = live.now
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"held": held, "peak": live.peak, "grads": grads, "model": model}


def accumulated_gradients(cfg, batch_size, micro_batches, step=0):
    """Gradients of the mean loss over `batch_size` sequences, computed in `micro_batches`
    slices: each slice's loss is divided by the number of slices, so the sum is the big batch's
    mean (equal-size slices). Also the most activation bytes held at once."""
    if batch_size % micro_batches:
        raise ValueError(f"batch {batch_size} does not split into {micro_batches} equal micro-batches")
    model = GPT(cfg)
    tokens, targets = batch(cfg, batch_size, step)
    held = 0
    for x, y in zip(tokens.chunk(micro_batches), targets.chunk(micro_batches)):
        with LiveBytes() as live:
            loss = loss_fn(model(x), y) / micro_batches
            held = max(held, live.now)
            loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, held


def _cross_entropy_sum(hidden, targets, weight, bias):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))   # the softmax in fp32 at least
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


def chunked_cross_entropy(hidden, head, targets, chunk_rows):
    """Mean cross-entropy of `head(hidden)` against `targets`, `chunk_rows` tokens at a time,
    each chunk under a checkpoint: only one chunk's logits and fp32 log-softmax exist at once,
    in the forward and again when the backward recomputes them. The forward keeps only
    `hidden`. Equal to `F.cross_entropy(head(hidden), targets)` (tested)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    from torch.utils.checkpoint import checkpoint
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    if h.shape[0] != y.shape[0]:
        raise ValueError(f"{h.shape[0]} hidden rows but {y.shape[0]} targets")
    total = 0
    for start in range(0, h.shape[0], chunk_rows):
        total = total + checkpoint(_cross_entropy_sum, h[start:start + chunk_rows], y[start:start + chunk_rows],
                                   head.weight, head.bias, use_reentrant=False)
    return total / h.shape[0]


def loss_memory(cfg, batch_size, chunk_rows=None, seed=0):
    """One forward + backward of GPT(cfg) on random tokens, the loss computed whole or with
    `chunked_cross_entropy`: bytes held after the forward and the peak (LiveBytes), the bytes
    the whole loss saves for its fp32 log-softmax (one (tokens × vocabulary) tensor), and the
    gradients."""
    model = GPT(cfg)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(cfg.vocab_size, (batch_size, cfg.seq_len), generator=g)
    targets = torch.randint(cfg.vocab_size, (batch_size, cfg.seq_len), generator=g)
    with LiveBytes() as live:
        x = model.embed(tokens)
        for block in model.blocks:
            x = block(x)
        if chunk_rows is None:
            loss = loss_fn(model.head(x), targets)
        else:
            loss = chunked_cross_entropy(model.ln_f(x), model.lm_head, targets, chunk_rows)
        held = live.now
        loss.backward()
    return {"held": held, "peak": live.peak, "loss": loss.item(),
            "log_softmax": batch_size * cfg.seq_len * cfg.vocab_size * 4,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
