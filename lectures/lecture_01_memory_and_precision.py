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
