"""Memory and precision on one device

Before any communication: what a training step holds in memory, how number formats trade range
for resolution, and why both decide everything the later lectures do. This lecture also defines
the small GPT and the learnable synthetic task that lectures 04–07 train.
"""
import contextlib
import dataclasses
import functools
import math
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from util import figure, note, quiet, see, settings, table
from util.measure import errorbar, machine, measure

# =========================================================================================
# 1. The model every later lecture trains: a small GPT
# =========================================================================================


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A pre-LayerNorm decoder. The defaults train in seconds on a CPU."""
    vocab_size: int = 64
    seq_len: int = 32          # the longest sequence (learned positions)
    d_model: int = 64          # h
    n_layers: int = 2          # L
    n_heads: int = 4           # a
    n_kv_heads: int = None     # grouped-query attention: heads that share K/V; None = n_heads
    d_ff: int = None           # MLP width; None = 4·h
    tie_embeddings: bool = False  # the LM head reuses the token embedding
    dtype: str = "float32"
    seed: int = 0              # the initial weights depend on this alone

    def __post_init__(self):
        kv = self.n_kv_heads or self.n_heads
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={kv}")

    @property
    def head_dim(self):
        return self.d_model // self.n_heads

    @property
    def kv_heads(self):
        return self.n_kv_heads or self.n_heads

    @property
    def ff(self):
        return self.d_ff or 4 * self.d_model

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)


def causal_attention(q, k, v):
    """softmax(q kᵀ/√d + causal mask) v on (batch, heads, seq, head_dim) tensors. Later lectures
    swap this for a distributed version by setting `CausalSelfAttention.attend`."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(nn.Module):
    """Separate Q, K, V projections (so tensor parallelism can split heads, and K/V heads
    separately under grouped-query attention), then the output projection."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model)
        self.attend = causal_attention

    def forward(self, x):
        b, s, _ = x.shape
        # Head counts come from the weights, so a layer whose heads were split across ranks
        # (lecture 04) runs this same code on its share.
        heads = self.q_proj.out_features // self.head_dim
        kv_heads = self.k_proj.out_features // self.head_dim
        q = self.q_proj(x).view(b, s, heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, kv_heads, self.head_dim).transpose(1, 2)
        if kv_heads != heads:  # grouped-query attention: each K/V head serves heads/kv_heads queries
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        y = self.attend(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.ff)
        self.fc_out = nn.Linear(cfg.ff, cfg.d_model)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    """x + attn(LN(x)), then x + mlp(LN(x)): the pre-LayerNorm residual block."""

    def __init__(self, cfg):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab). Initial weights depend on cfg.seed only."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):  # a private seed: the caller's RNG is untouched
            torch.manual_seed(cfg.seed)
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
            if cfg.tie_embeddings:
                self.lm_head.weight = self.tok_emb.weight
            self._init_weights()
        if cfg.torch_dtype != torch.get_default_dtype():  # a no-op .to() would fail under FakeTensorMode
            self.to(cfg.torch_dtype)

    def _init_weights(self):
        # GPT-2's scheme: N(0, 0.02) everywhere, residual outputs scaled by 1/√(2L) so the
        # residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.zeros_(p) if not name.endswith(("ln1.weight", "ln2.weight", "ln_f.weight")) \
                    else nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("o_proj.weight", "fc_out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def embed(self, tokens, positions=None):
        """Token plus position embeddings. `positions` (default 0..s−1) lets a rank that holds a
        slice of the sequence (context parallelism) embed it at its true positions."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok_emb(tokens) + self.pos_emb(positions)

    def head(self, x):
        return self.lm_head(self.ln_f(x))

    def forward(self, tokens, positions=None):
        x = self.embed(tokens, positions)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def param_count(cfg):
    """Ψ in closed form for this architecture; equals sum(p.numel()) (tested).

    The syllabus' Ψ ≈ h·v + L·(12h² + 13h) + 2h assumes 4h MLPs and full multi-head attention;
    per layer here: Q and O are h² + h each, K and V are h·h_kv + h_kv each (h_kv = kv heads ×
    head dim), the MLP 2·h·f + f + h, two LayerNorms 4h. Plus learned positions s·h, the final
    LayerNorm 2h, and an untied LM head h·v."""
    h, v, f = cfg.d_model, cfg.vocab_size, cfg.ff
    h_kv = cfg.kv_heads * cfg.head_dim
    per_layer = 2 * (h * h + h) + 2 * (h * h_kv + h_kv) + (2 * h * f + f + h) + 4 * h
    return h * v + cfg.seq_len * h + cfg.n_layers * per_layer + 2 * h + (0 if cfg.tie_embeddings else h * v)


# =========================================================================================
# 2. The task: sequences from a fixed random Markov chain
# =========================================================================================

def markov_chain(vocab_size, seed=0, branching=4):
    """A transition matrix where each token has `branching` likely successors: a model that
    learns it gets well below the uniform loss ln(vocab)."""
    g = torch.Generator().manual_seed(10_000 + seed)
    logits = torch.randn(vocab_size, vocab_size, generator=g)
    top = logits.topk(branching, dim=1).indices
    probs = torch.full((vocab_size, vocab_size), 1e-3)
    probs.scatter_(1, top, torch.rand(vocab_size, branching, generator=g) + 0.5)
    return probs / probs.sum(dim=1, keepdim=True)


def entropy_rate(cfg, seed=0):
    """The loss a perfect model reaches (nats/token), from the chain's stationary distribution."""
    p = markov_chain(cfg.vocab_size, seed).double()
    pi = torch.full((cfg.vocab_size,), 1.0 / cfg.vocab_size, dtype=torch.float64)
    for _ in range(500):
        pi = pi @ p
    return float(-(pi[:, None] * p * p.log()).sum())


def batch(cfg, batch_size, step, seed=0):
    """(tokens, targets), each (batch_size, seq_len) int64: `batch_size` sequences walked
    through the chain, targets shifted by one. Depends only on (cfg, batch_size, step, seed),
    so every rank builds the same global batch and takes its slice."""
    p = markov_chain(cfg.vocab_size, seed)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    walk = torch.empty(batch_size, cfg.seq_len + 1, dtype=torch.long)
    walk[:, 0] = torch.randint(cfg.vocab_size, (batch_size,), generator=g)
    for t in range(cfg.seq_len):
        walk[:, t + 1] = torch.multinomial(p[walk[:, t]], 1, generator=g).squeeze(1)
    return walk[:, :-1].contiguous(), walk[:, 1:].contiguous()


def loss_fn(logits, targets):
    """Mean next-token cross-entropy (nats)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))




# =========================================================================================
# 3. Measuring memory: what is alive, and what autograd keeps for the backward pass
# =========================================================================================

class LiveBytes:
    """Bytes of tensor storage allocated inside the `with` block that are still alive (`.now`)
    and the most that were alive at once (`.peak`). Counts each storage once, however many views
    share it; tensors that existed before the block (parameters) are not counted. A
    TorchDispatchMode sees every operator's outputs, on any device, GPU or CPU alike."""

    def __init__(self):
        self.now = self.peak = 0
        self._live = {}

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten
        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        tracker._add(t.untyped_storage())
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def _add(self, st):
        key, n = st.data_ptr(), st.nbytes()
        if n and key not in self._live:
            self._live[key] = n
            self.now += n
            self.peak = max(self.peak, self.now)
            weakref.finalize(st, self._free, key)

    def _free(self, key):
        self.now -= self._live.pop(key, 0)

    def reset_peak(self):
        self.peak = self.now

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


class SavedActivations:
    """Everything autograd saves for the backward pass inside the `with` block, de-duplicated by
    storage (q, k and v as views of one buffer count once) and without the parameters (a Linear
    saves its weight, but the weight is not an activation). `.bytes`, and `.tensors`: one
    (shape, dtype, bytes) per storage, in the order first saved."""

    def __init__(self, exclude=()):
        self._exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self._seen = set()
        self.tensors = []

    def _pack(self, t):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self._exclude and key not in self._seen and st.nbytes():
            self._seen.add(key)
            self.tensors.append((tuple(t.shape), t.dtype, st.nbytes()))
        return t

    @property
    def bytes(self):
        return sum(b for _, _, b in self.tensors)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def by_category(tracker):
    """MemTracker's current bytes on the CPU (or first) device, keyed by plain category names."""
    snap = tracker.get_tracker_snapshot("current")
    per_dev = next(iter(snap.values()))
    return {(k if isinstance(k, str) else k.value): v for k, v in per_dev.items()}


MEM_CATEGORIES = ["Parameter", "Gradient", "Optstate", "Activation", "Temp"]


def held_by_training(model, opt):
    """Our own accounting, from the tensors themselves: parameters, gradients, optimizer state."""
    params = list(model.parameters())
    return {"Parameter": sum(p.nbytes for p in params),
            "Gradient": sum(p.grad.nbytes for p in params if p.grad is not None),
            "Optstate": sum(v.nbytes for s in opt.state.values() for v in s.values()
                            if torch.is_tensor(v) and v.dim() > 0)}


def memory_timeline(cfg, batch_size, steps=3, lr=3e-3):
    """Train `steps` AdamW steps under PyTorch's MemTracker and sample it after every phase of
    each step; beside it, our own sums over the tensors, the bytes autograd saved, and the
    most bytes alive at once in each phase (LiveBytes). Returns one row per phase."""
    from torch.distributed._tools.mem_tracker import MemTracker
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    rows = []
    with tracker, LiveBytes() as live:
        for step in range(1, steps + 1):
            tokens, targets = batch(cfg, batch_size, step)
            live.reset_peak()
            with SavedActivations(exclude=model.parameters()) as saved:
                loss = loss_fn(model(tokens), targets)
            rows.append(dict(step=step, phase="forward", tracker=by_category(tracker),
                             own=dict(held_by_training(model, opt), Activation=saved.bytes),
                             peak=live.peak))
            for phase, act in [("backward", loss.backward), ("optimizer step", opt.step),
                               ("zero_grad", opt.zero_grad)]:
                live.reset_peak()
                act()
                rows.append(dict(step=step, phase=phase, tracker=by_category(tracker),
                                 own=dict(held_by_training(model, opt), Activation=0), peak=live.peak))
            del loss
            tracker.reset_mod_stats()      # per-module peaks start afresh each iteration
    return rows


def fake_training_step(cfg, batch_size, dtype=torch.bfloat16):
    """One forward, backward and AdamW step of `cfg` under FakeTensorMode: tensors have shapes
    and dtypes but no storage, so MemTracker counts the bytes a real run would need without this
    machine holding them. Parameters in `dtype` with an fp32 master copy is the mixed-precision
    layout; here for simplicity parameters are `dtype` and AdamW keeps its state in `dtype`
    too, so the optimizer row reads 2 × 2 bytes per parameter."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    previous = torch.get_default_dtype()
    rows = {}
    with FakeTensorMode():
        torch.set_default_dtype(dtype)
        try:
            model = GPT(dataclasses.replace(cfg, dtype=str(dtype).split(".")[-1]))
        finally:
            torch.set_default_dtype(previous)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len))
            loss = loss_fn(model(tokens), tokens)
            rows["after forward"] = by_category(tracker)
            loss.backward()
            rows["after backward"] = by_category(tracker)
            opt.step()
            rows["after optimizer step"] = by_category(tracker)
    return rows


# =========================================================================================
# 4. Activation memory: measured per layer, the paper's formula, and ours reconciled
# =========================================================================================

def naive_causal_attention(q, k, v):
    """Attention as written in the paper: the (s × s) scores and probabilities are materialized
    (and the probabilities saved for backward)."""
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v


def block_activations(cfg, batch_size, seq, attend=causal_attention):
    """What autograd saves for one transformer block on a (batch, seq, h) input."""
    block = Block(cfg).to(cfg.torch_dtype)
    block.attn.attend = attend
    x = torch.randn(batch_size, seq, cfg.d_model, dtype=cfg.torch_dtype, requires_grad=True)
    with SavedActivations(exclude=block.parameters()) as saved:
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


# =========================================================================================
# 5. Recomputation and gradient accumulation
# =========================================================================================

def _save_matmuls(ctx, op, *args, **kwargs):
    """Selective recomputation policy: keep matmul outputs (expensive to redo), recompute the
    cheap element-wise work and LayerNorms (Korthikanti et al. keep the matmuls and recompute
    the attention core; the same trade, one rule)."""
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
    checkpoint hides its saved tensors from saved-tensor hooks, not from the allocator),
    the peak, and the gradients."""
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


# =========================================================================================
# 6. Number formats, loss scaling, master weights
# =========================================================================================

FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "fp8 e4m3fn": torch.float8_e4m3fn, "fp8 e5m2": torch.float8_e5m2}


def round_to(x, dtype):
    """x rounded to `dtype` (round to nearest even) and back to fp32. fp8 e4m3fn has no
    infinity: values past its 448 saturate to ±448 here rather than becoming NaN."""
    if dtype == torch.float8_e4m3fn:
        m = torch.finfo(dtype).max
        x = x.clamp(-m, m)
    return x.to(dtype).to(torch.float32)


def format_properties(name, dtype, n=200_001):
    """What finfo says, and what rounding `n` evenly spaced values in [1, 2] measures: the
    largest relative error is half the spacing between neighbours there (eps/2)."""
    fi = torch.finfo(dtype)
    x = torch.linspace(1, 2, n, dtype=torch.float64)
    err = ((round_to(x.float(), dtype).double() - x).abs() / x).max().item()
    distinct = round_to(x.float(), dtype).unique().numel()
    bits = dtype.itemsize * 8
    return {"format": name, "bits": bits, "max": fi.max, "smallest normal": fi.smallest_normal,
            "eps (spacing at 1)": fi.eps, "values in [1, 2]": distinct,
            "max rel. error in [1, 2] (measured)": err}


def relative_error_across_magnitudes(dtype, exponents, per_decade=200, seed=0):
    """Median relative rounding error of random values at each magnitude 10^e; 1.0 means the
    value flushed to zero, a NaN/inf counts as 1 too."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for e in exponents:
        x = (10.0 ** e) * (1 + torch.rand(per_decade, generator=g, dtype=torch.float64) * 9)
        r = round_to(x.float(), dtype).double()
        rel = ((r - x).abs() / x).nan_to_num(1.0, 1.0, 1.0).clamp(max=1.0)
        out.append(rel.median().item())
    return out


def fp16_gradients(cfg, batch_size, scale=None):
    """The GPT's gradients when every gradient is *stored* in fp16: each module's incoming
    gradient and each parameter's gradient are rounded to fp16 (the arithmetic stays fp32: on
    this CPU fp16 matmuls are far slower, and the loss of information is in the storage).
    With `scale`, a real `torch.amp.GradScaler` multiplies the loss by it before backward, then
    divides the gradients by it (`unscale_`) and refuses the step if any became inf/NaN.
    Returns gradients, counts of activation-gradient elements (total, flushed to zero,
    subnormal) and whether the scaler would skip this step."""
    f16 = torch.finfo(torch.float16)
    model = GPT(cfg)
    tokens, targets = batch(cfg, batch_size, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, growth_interval=10**6,
                                  enabled=scale is not None)
    count = {"elements": 0, "flushed to zero": 0, "subnormal": 0}

    def to_fp16(module, grad_output):
        g = grad_output[0]
        r = round_to(g, torch.float16)
        count["elements"] += g.numel()
        count["flushed to zero"] += ((r == 0) & (g != 0)).sum().item()
        count["subnormal"] += ((r != 0) & (r.abs() < f16.smallest_normal)).sum().item()
        return (r,)

    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.LayerNorm)):
            m.register_full_backward_pre_hook(to_fp16)
    for p in model.parameters():
        p.register_hook(lambda g: round_to(g, torch.float16))
    scaler.scale(loss_fn(model(tokens), targets)).backward()
    scaler.unscale_(opt)                 # grads /= scale, in fp32, and look for inf/NaN
    scaler.step(opt)                     # lr = 0: nothing moves; skipped if inf/NaN found
    before = scaler.get_scale() if scale else None
    scaler.update()
    skipped = scale is not None and scaler.get_scale() < before
    return {n: p.grad for n, p in model.named_parameters()}, count, skipped


def fp32_gradients(cfg, batch_size):
    model = GPT(cfg)
    tokens, targets = batch(cfg, batch_size, 0)
    loss_fn(model(tokens), targets).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def gradient_error(grads, reference):
    """‖g − g_ref‖ / ‖g_ref‖ over all parameters together (inf/NaN count as total loss)."""
    num = sum((grads[k].double() - reference[k].double()).pow(2).sum() for k in reference)
    den = sum(reference[k].double().pow(2).sum() for k in reference)
    err = (num / den).sqrt().item()
    return err if math.isfinite(err) else float("inf")


class MasterWeights:
    """Mixed precision by hand: the model computes in bf16 (parameters and gradients bf16), the
    optimizer updates an fp32 master copy and writes it back rounded to bf16. With
    `fp32_accumulation`, gradients are summed over micro-batches in an fp32 buffer."""

    def __init__(self, model, lr, fp32_accumulation=False, weight_decay=0.01):
        self.model = model
        self.params = list(model.parameters())
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay)
        self.acc = [torch.zeros_like(m) for m in self.master] if fp32_accumulation else None

    def accumulate(self):
        """After a micro-batch's backward: move bf16 gradients into the fp32 buffer."""
        if self.acc is None:
            raise RuntimeError("MasterWeights(fp32_accumulation=False) has no accumulation buffer")
        for a, p in zip(self.acc, self.params):
            a.add_(p.grad.float())
            p.grad = None

    def step(self):
        for i, (m, p) in enumerate(zip(self.master, self.params)):
            m.grad = self.acc[i].clone() if self.acc is not None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                p.copy_(m)                 # round the fp32 master to the bf16 compute copy
                m.grad = None
        if self.acc is not None:
            for a in self.acc:
                a.zero_()

    def held(self):
        """Bytes by role, from the tensors this setup holds."""
        state = [v for s in self.opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        out = {"bf16 parameters": sum(p.nbytes for p in self.params),
               "bf16 gradients": sum(p.grad.nbytes for p in self.params if p.grad is not None),
               "fp32 master parameters": sum(m.nbytes for m in self.master),
               "fp32 Adam m and v": sum(v.nbytes for v in state)}
        if self.acc is not None:
            out["fp32 gradient accumulation"] = sum(a.nbytes for a in self.acc)
        return out


def train_curve(cfg, variant, steps, lr, batch_size=16, log_every=5):
    """Loss every `log_every` steps of AdamW training, for `variant` in
    fp32 | bf16 weights | bf16 + fp32 master. Also the fraction of weight elements the last
    step left unchanged (an update smaller than half a bf16 spacing rounds away)."""
    if variant == "fp32":
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        step = opt.step
    elif variant == "bf16 weights":
        model = GPT(dataclasses.replace(cfg, dtype="bfloat16"))
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        step = opt.step
    elif variant == "bf16 + fp32 master":
        model = GPT(dataclasses.replace(cfg, dtype="bfloat16"))
        step = MasterWeights(model, lr=lr).step
    else:
        raise ValueError(f"unknown variant {variant!r}")
    curve, unchanged = [], 0.0
    for t in range(steps):
        tokens, targets = batch(cfg, batch_size, t)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()] if t == steps - 1 else None
        step()
        for p in model.parameters():
            p.grad = None
        if before is not None:
            same = sum((p == b).sum().item() for p, b in zip(model.parameters(), before))
            unchanged = same / sum(p.numel() for p in model.parameters())
        if t % log_every == 0 or t == steps - 1:
            curve.append((t, loss.item()))
    return curve, unchanged


# =========================================================================================
# 7. FP8 with scaling: one scale per tensor, or one per tile (DeepSeek-V3)
# =========================================================================================

def quantize_fp8(x, tile=None, dtype=torch.float8_e4m3fn):
    """x (2-D) to fp8 with scales chosen so each group's largest |value| maps to the format's
    max. `tile=None`: one scale for the whole tensor; `tile=(r, c)`: one per r×c tile
    (DeepSeek-V3: 1×128 for activations, 128×128 for weights). Returns (fp8 values, scales),
    scales shaped (rows/r, cols/c)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8 takes a matrix, got shape {tuple(x.shape)}")
    m, n = x.shape
    r, c = tile or (m, n)
    if m % r or n % c:
        raise ValueError(f"tile {r}×{c} does not divide the {m}×{n} matrix")
    tiles = x.float().reshape(m // r, r, n // c, c)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12)
    scale = amax / torch.finfo(dtype).max
    q = (tiles / scale).to(dtype).reshape(m, n)
    return q, scale.reshape(m // r, n // c)


def dequantize_fp8(q, scale):
    m, n = q.shape
    gr, gc = scale.shape
    tiles = q.float().reshape(gr, m // gr, gc, n // gc)
    return (tiles * scale.reshape(gr, 1, gc, 1)).reshape(m, n)


def fp8_matmul_error(a, w, a_tile=None, w_tile=None, dtype=torch.float8_e4m3fn):
    """Relative error ‖Q(a)·Q(w) − a·w‖ / ‖a·w‖ of an fp8 matmul simulated on the CPU:
    quantize both operands, dequantize, multiply in fp32 (as the tensor core accumulates)."""
    exact = a.double() @ w.double()
    approx = dequantize_fp8(*quantize_fp8(a, a_tile, dtype)) @ dequantize_fp8(*quantize_fp8(w, w_tile, dtype))
    return ((approx.double() - exact).norm() / exact.norm()).item()


def scaled_mm_error(a, w, rowwise=False):
    """The same with PyTorch's fp8 matmul `torch._scaled_mm` (e4m3, tensor-wise or row-wise
    scales: a per row of a, one per column of w). None if this build cannot run it."""
    exact = a.double() @ w.double()
    try:
        if rowwise:
            qa, sa = quantize_fp8(a, (1, a.shape[1]))
            qw, sw = quantize_fp8(w.t().contiguous(), (1, w.shape[0]))
            out = torch._scaled_mm(qa, qw.t(), sa.float(), sw.float().t(), out_dtype=torch.bfloat16)
        else:
            qa, sa = quantize_fp8(a)
            qw, sw = quantize_fp8(w.t().contiguous())
            out = torch._scaled_mm(qa, qw.t(), sa.reshape(()), sw.reshape(()), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return None
    return ((out.double() - exact).norm() / exact.norm()).item()


def outlier_matrices(m, k, n, outlier=1000.0, frac=0.001, seed=0):
    """Activations (m×k) with a few huge entries, as LLM activations have, and Gaussian weights
    (k×n) with a few large ones."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g)
    hit = torch.rand(m, k, generator=g) < frac
    a[hit] *= outlier
    w = torch.randn(k, n, generator=g) * 0.02
    w[torch.rand(k, n, generator=g) < frac] *= 50
    return a, w


# =========================================================================================
# 8. FlashAttention's idea: attention by key/value blocks with an online softmax
# =========================================================================================

def attention_with_lse(q, k, v, causal=False, q_offset=0, k_offset=0, scale=None):
    """softmax(q kᵀ·scale) v for one block of keys, and the log-sum-exp of each query's scores
    (b, heads, s_q). Positions are q_offset + i and k_offset + j, so a rank holding a slice of
    the sequence masks correctly (causal: key j visible to query i iff k_offset+j <= q_offset+i).
    A query that sees no key here gets output 0 and lse −inf, which `merge_attention` ignores.
    Plain tensor operations: autograd differentiates it."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)   # softmax statistics in fp32 at least
    scores = (q @ k.transpose(-2, -1)).to(acc) * scale
    if causal:
        qi = torch.arange(q.shape[-2], device=q.device)[:, None] + q_offset
        kj = torch.arange(k.shape[-2], device=q.device)[None, :] + k_offset
        scores = scores.masked_fill(kj > qi, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(scores - safe[..., None])          # exp(−inf) = 0 for masked keys
    return (p.to(v.dtype) @ v), lse


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Combine attention over two disjoint sets of keys: with m = max(lse_a, lse_b), the
    weights are exp(lse − m) — the running-max rescaling of the online softmax. Returns
    (out, lse) over the union. Safe when a side saw no keys (lse −inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a - safe)[..., None]
    wb = torch.exp(lse_b - safe)[..., None]
    return (out_a * wa + out_b * wb).to(out_a.dtype), lse


def _blocked_forward(q, k, v, block_size, causal, scale):
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
    for start in range(0, k.shape[-2], block_size):
        if causal and start > q.shape[-2] - 1:
            break                                   # every later key is in every query's future
        o_b, l_b = attention_with_lse(q, k[..., start:start + block_size, :], v[..., start:start + block_size, :],
                                      causal=causal, k_offset=start, scale=scale)
        out, lse = merge_attention(out, lse, o_b, l_b)
    return out.to(q.dtype), lse


class OnlineSoftmaxAttention(torch.autograd.Function):
    """Forward: keys and values in blocks, a running (out, lse) merged block by block; only a
    (s_q × block) score tile exists at a time. Backward (FlashAttention-2's): recompute each
    tile's probabilities from the saved lse, P = exp(S − lse); dV += Pᵀ dO; dP = dO Vᵀ;
    dS = P ∘ (dP − rowsum(dO ∘ O)); dQ += dS K·scale; dK += dSᵀ Q·scale. Saves only q, k, v,
    out and lse: O(s), not O(s²)."""

    @staticmethod
    def forward(ctx, q, k, v, block_size, causal, scale):
        with torch.no_grad():
            out, lse = _blocked_forward(q, k, v, block_size, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.block_size, ctx.causal, ctx.scale = block_size, causal, scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        bs, scale = ctx.block_size, ctx.scale
        acc = lse.dtype
        d_out = d_out.contiguous()
        delta = (d_out.to(acc) * out.to(acc)).sum(-1, keepdim=True)     # rowsum(dO ∘ O)
        safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None]
        dq, dk, dv = torch.zeros_like(q, dtype=acc), torch.zeros_like(k, dtype=acc), \
            torch.zeros_like(v, dtype=acc)
        qi = torch.arange(q.shape[-2], device=q.device)[:, None]
        for start in range(0, k.shape[-2], bs):
            if ctx.causal and start > q.shape[-2] - 1:
                break
            kb, vb = k[..., start:start + bs, :].to(acc), v[..., start:start + bs, :].to(acc)
            s = (q.to(acc) @ kb.transpose(-2, -1)) * scale
            if ctx.causal:
                kj = torch.arange(kb.shape[-2], device=q.device)[None, :] + start
                s = s.masked_fill(kj > qi, float("-inf"))
            p = torch.exp(s - safe)
            dv[..., start:start + bs, :] += p.transpose(-2, -1) @ d_out.to(acc)
            ds = p * (d_out.to(acc) @ vb.transpose(-2, -1) - delta)
            dq += (ds @ kb) * scale
            dk[..., start:start + bs, :] += (ds.transpose(-2, -1) @ q.to(acc)) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def online_softmax_attention(q, k, v, block_size, causal=False, scale=None):
    """Attention on (batch, heads, seq, head_dim) tensors computed `block_size` keys at a time
    with an online softmax; equals F.scaled_dot_product_attention in values and gradients
    (tested, including block sizes that do not divide the sequence). Causal needs equal query
    and key lengths (queries and keys at the same positions)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError("causal online_softmax_attention needs as many queries as keys; "
                         "use attention_with_lse with offsets for a slice of the sequence")
    if k.shape[-2] != v.shape[-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return OnlineSoftmaxAttention.apply(q, k, v, int(block_size), bool(causal), float(scale))


def attention_peak_bytes(attend, b, heads, s, d, backward=False, seed=0):
    """Most bytes alive at once while `attend(q, k, v)` runs (and its backward, if asked),
    beyond the inputs, measured with LiveBytes."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, heads, s, d, generator=g, requires_grad=backward) for _ in range(3))
    with LiveBytes() as live:
        out = attend(q, k, v)
        if backward:
            out.sum().backward()
    return live.peak
