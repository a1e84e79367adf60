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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from util import device, figure, note, see, settings, spawn, table
from util.measure import machine, measure, usable_cores

from lectures.gpt import (GPT, Block, CausalSelfAttention, GPTConfig, MLP, batch,  # noqa: F401
                          causal_attention, entropy_rate, loss_fn, markov_chain, param_count)

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
    fp32 | bf16 weights | bf16 + fp32 master. Also the fraction of the weights the optimizer
    updates (the fp32 master copy in the last variant) that the last step left unchanged: in
    bf16, an update smaller than half the spacing between neighbours rounds away."""
    if variant == "fp32":
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        step, updated = opt.step, list(model.parameters())
    elif variant == "bf16 weights":
        model = GPT(dataclasses.replace(cfg, dtype="bfloat16"))
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        step, updated = opt.step, list(model.parameters())
    elif variant == "bf16 + fp32 master":
        model = GPT(dataclasses.replace(cfg, dtype="bfloat16"))
        mw = MasterWeights(model, lr=lr)
        step, updated = mw.step, mw.master      # the weights the optimizer updates
    else:
        raise ValueError(f"unknown variant {variant!r}")
    curve, unchanged = [], 0.0
    for t in range(steps):
        tokens, targets = batch(cfg, batch_size, t)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        before = [p.detach().clone() for p in updated] if t == steps - 1 else None
        step()
        for p in model.parameters():
            p.grad = None
        if before is not None:
            same = sum((p == b).sum().item() for p, b in zip(updated, before))
            unchanged = same / sum(p.numel() for p in updated)
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


def row_errors(approx, exact):
    """Relative error of each output row (one token): ‖ĉ_i − c_i‖ / ‖c_i‖."""
    return (approx.double() - exact).norm(dim=1) / exact.norm(dim=1).clamp_min(1e-300)


def fp8_matmul_error(a, w, a_tile=None, w_tile=None, dtype=torch.float8_e4m3fn):
    """Median over output rows (tokens) of the relative error of an fp8 matmul simulated on the
    CPU: quantize both operands, dequantize, multiply in fp32 (as tensor cores accumulate).
    Per row, because a few huge rows would otherwise decide the whole norm."""
    exact = a.double() @ w.double()
    approx = dequantize_fp8(*quantize_fp8(a, a_tile, dtype)) @ dequantize_fp8(*quantize_fp8(w, w_tile, dtype))
    return row_errors(approx, exact).median().item()


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
    return row_errors(out, exact).median().item()


def outlier_matrices(m, k, n, outlier=1000.0, frac=0.01, seed=0):
    """Activations (m tokens × k) where a few tokens are `outlier` times larger than the rest
    (LLMs have such "massive activations"), and Gaussian weights (k×n) with a few large
    entries."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g)
    rows = torch.randperm(m, generator=g)[:max(1, int(frac * m))]
    a[rows] *= outlier
    w = torch.randn(k, n, generator=g) * 0.02
    w[torch.rand(k, n, generator=g) < 0.001] *= 50
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


# =========================================================================================
# 9. What the hardware does per second: matmul FLOP/s and copy bandwidth (the roofline)
# =========================================================================================

def matmul_rate(n, dtype=torch.float32, dev="cpu", repeats=7):
    """(FLOP/s, Timing) of an n×n by n×n matmul: 2n³ floating-point operations."""
    a, b = torch.randn(n, n, dtype=dtype, device=dev), torch.randn(n, n, dtype=dtype, device=dev)
    t = measure(lambda: a @ b, warmup=2, repeats=repeats)
    return 2 * n ** 3 / t.median, t


def copy_rate(nbytes, dev="cpu", repeats=7):
    """(bytes/s, Timing) of copying `nbytes` between two buffers: each byte is read and written."""
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=2, repeats=repeats)
    return 2 * nbytes / t.median, t


def elementwise_rate(n, op="add", dev="cpu", repeats=7):
    """(FLOP/s, Timing, FLOP per byte) of x + y (1 FLOP per 12 bytes moved in fp32) or
    GELU (counted as ~8 FLOP per 8 bytes moved)."""
    x, y = torch.randn(n, device=dev), torch.randn(n, device=dev)
    fn, flops, moved = {"add": (lambda: x + y, n, 12 * n), "gelu": (lambda: F.gelu(x), 8 * n, 8 * n)}[op]
    t = measure(fn, warmup=2, repeats=repeats)
    return flops / t.median, t, flops / moved


def same_on_every_rank(rank, world_size, cfg, batch_size=8, step=3):
    """Each rank builds batch `step` and the initial GPT by itself; an all-gather of their
    checksums shows whether every rank got the same (what lectures 03–07 rely on)."""
    tokens, _ = batch(cfg, batch_size, step)
    model = GPT(cfg)
    mine = torch.tensor([float(tokens.sum()), float(tokens[:, 0].sum()),
                         sum(p.detach().double().sum().item() for p in model.parameters())],
                        dtype=torch.float64, device=device())
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return {"identical": all(torch.equal(e, everyone[0]) for e in everyone),
            "checksums": [e.tolist() for e in everyone]}


# =========================================================================================
# 10. The lecture
# =========================================================================================

@contextlib.contextmanager
def threads(n):
    """Run a block with `n` intra-op threads. The demos use one: their tensors are small, and
    on a shared machine extra threads mostly wait for each other."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def fmt_bytes(n):
    for unit, k in [("GB", 1e9), ("MB", 1e6), ("kB", 1e3)]:
        if abs(n) >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} B"


def intro():
    note("""
        ## Memory and precision on one device
        Every later lecture splits something — the batch, the layers, the sequence, the
        optimizer state — across devices. What there is to split, and how many bytes each
        piece takes, is decided here on one device: a training step holds parameters,
        gradients, optimizer state, activations and temporaries, and the number format of each
        decides its size and what it can represent. Everything below is measured on this
        machine by the run that built this page, on the small GPT that lectures 04–07 train.
    """)


def the_model_and_task():
    cfg = GPTConfig()
    steps = 60 if settings.quick else 100
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    start = time.perf_counter()
    for t in range(steps):
        tokens, targets = batch(cfg, 16, t)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    floor = entropy_rate(cfg)
    note(f"""
        ## The model and the task
        A pre-LayerNorm GPT: token and learned position embeddings, L blocks of
        x + attention(LN(x)) then x + MLP(LN(x)), a final LayerNorm and a linear head.
        Q, K and V are separate projections (lecture 04 splits their heads across ranks, and
        grouped-query attention gives K and V fewer heads); the attention function is an
        attribute, `attn.attend`, that lectures 06 and 07 swap for distributed versions.
        The data: walks through a fixed random Markov chain over {cfg.vocab_size} tokens in
        which each token has a few likely successors. A model that learns the chain reaches its
        entropy rate, {floor:.3f} nats/token; guessing uniformly costs ln {cfg.vocab_size} =
        {math.log(cfg.vocab_size):.3f}. `batch(cfg, batch_size, step)` depends only on its
        arguments, so every rank of a later lecture builds the same global batch.
    """)
    see(GPTConfig)
    see(Block)
    see(batch)
    ranks = min(2, settings.world_size)        # two ranks show it; more only cost start-up time
    run = spawn(same_on_every_rank, ranks, cfg=cfg,
                name="batch and initial weights built on every rank")
    same = all(r["identical"] for r in run.returns)
    table([[r, *c] for r, c in enumerate(run.returns[0]["checksums"])],
          header=["rank", "sum of batch 3's tokens", "sum of its first column", "sum of the initial weights"],
          caption=f"{ranks} ranks each built batch 3 and GPT(cfg) alone: "
                  + ("identical on every rank" if same else "**ranks disagree**"))
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3))
    ax.plot(range(1, steps + 1), losses, label="training loss")
    ax.axhline(floor, color="gray", ls="--", label="entropy rate (best possible)")
    ax.axhline(math.log(cfg.vocab_size), color="gray", ls=":", label="uniform guess")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=8)
    figure(fig, caption=f"AdamW, lr 3e-3, batch 16 × {cfg.seq_len} tokens, {steps} steps in "
                        f"{seconds:.1f} s ({machine()}): from {losses[0]:.2f} to {losses[-1]:.2f}")


def anatomy_of_a_step():
    cfg = GPTConfig()
    rows = memory_timeline(cfg, batch_size=16, steps=3)
    note("""
        ## Anatomy of a step, measured
        PyTorch's `MemTracker` (in `torch.distributed._tools.mem_tracker`) intercepts every
        tensor allocation and files it under parameter, gradient, optimizer state, activation
        or temporary; it works on the CPU. We train three AdamW steps and read it after each
        phase of each step (calling `reset_mod_stats()` between iterations), and beside it our
        own accounting from the tensors themselves (parameter and gradient sizes, the optimizer
        state dict, and the bytes autograd saved for backward, de-duplicated by storage).
    """)
    see(memory_timeline)
    table([[r["step"], r["phase"]] + [r["tracker"].get(c, 0) for c in MEM_CATEGORIES] +
           [r["tracker"]["Total"], r["own"]["Parameter"], r["own"]["Gradient"], r["own"]["Optstate"],
            r["own"]["Activation"], r["peak"]] for r in rows],
          header=["step", "after", "params", "grads", "optimizer", "activations", "temporaries",
                  "MemTracker total", "own: params", "own: grads", "own: optimizer",
                  "own: saved for backward", "peak new bytes in phase"],
          caption=f"bytes, GPT {param_count(cfg):,} parameters, batch 16 × {cfg.seq_len}, fp32 AdamW")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(figsize=(8, 3.4))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for c in MEM_CATEGORIES:
        vals = np.array([r["tracker"].get(c, 0) for r in rows]) / 1e6
        ax.bar(x, vals, bottom=bottom, label=c)
        bottom += vals
    ax.set_xticks(x, [f"{r['step']}:{r['phase'][:4]}" for r in rows], rotation=60, fontsize=7)
    ax.set_ylabel("MB (MemTracker)")
    ax.legend(fontsize=7, ncol=5)
    figure(fig, caption="memory after each phase of the first three steps: the optimizer state "
                        "appears at step 1's optimizer step and stays; gradients live from backward "
                        "to zero_grad; activations from forward to backward")
    first, later = rows[2]["tracker"]["Total"], rows[6]["tracker"]["Total"]
    note(f"""
        Step 1 grows: AdamW allocates its two moments (m and v, {fmt_bytes(rows[2]['own']['Optstate'])}
        = 2 × the parameters' {fmt_bytes(rows[2]['own']['Parameter'])}) at its first
        `step()`. From then on the pattern repeats: after the optimizer step the total is
        {fmt_bytes(first)} at step 1 and {fmt_bytes(later)} at step 2. The activations
        saved for backward ({fmt_bytes(rows[0]['own']['Activation'])} by our count; MemTracker
        files {fmt_bytes(rows[0]['tracker']['Activation'])} under activations, including the
        logits and loss that are not saved for backward) are {rows[0]['own']['Activation'] / rows[0]['own']['Parameter']:.1f}×
        the parameters here: with a small model and a modest batch, activations already dominate.
    """)


def parameters_and_bytes():
    configs = [GPTConfig(), GPTConfig(n_kv_heads=2), GPTConfig(tie_embeddings=True),
               GPTConfig(d_model=96, n_heads=6, n_kv_heads=3, n_layers=3, d_ff=200, vocab_size=101, seq_len=17),
               GPTConfig(d_model=768, n_heads=12, n_layers=12, vocab_size=50257, seq_len=1024, tie_embeddings=True)]
    rows = []
    for c in configs:
        h, v, L = c.d_model, c.vocab_size, c.n_layers
        numel = sum(p.numel() for p in GPT(c).parameters()) if h < 512 else None
        rows.append([f"h={h} L={L} a={c.n_heads} kv={c.kv_heads} f={c.ff} v={v} s={c.seq_len}"
                     + (" tied" if c.tie_embeddings else ""),
                     h * v + L * (12 * h * h + 13 * h) + 2 * h, param_count(c), numel])
    note("""
        ## Parameters and bytes per parameter
        The usual estimate Ψ ≈ h·v + L·(12h² + 13h) + 2h counts an embedding, per layer 4h² + 4h
        for attention (Q, K, V, O with biases), 8h² + 5h for a 4h MLP, 4h for two LayerNorms,
        and a final LayerNorm. `param_count` is the exact count for this architecture — learned
        positions (s·h), an untied head (h·v), K and V narrower under grouped-query attention,
        any MLP width — and equals `sum(p.numel())` of the built model.
    """)
    see(param_count)
    table(rows, header=["config", "estimate h·v + L(12h²+13h) + 2h", "param_count", "sum(p.numel())"],
          caption="the last row is GPT-2 small (124M with tied embeddings); its numel is not built here")
    cfg = GPTConfig()
    tokens, targets = batch(cfg, 8, 0)
    fp32 = GPT(cfg)
    opt = torch.optim.AdamW(fp32.parameters(), lr=1e-3)
    loss_fn(fp32(tokens), targets).backward()
    opt.step()
    psi = param_count(cfg)
    fp32_held = held_by_training(fp32, opt)
    mixed = {}
    for acc in (False, True):
        model = GPT(dataclasses.replace(cfg, dtype="bfloat16"))
        mw = MasterWeights(model, lr=1e-3, fp32_accumulation=acc)
        loss_fn(model(tokens), targets).backward()
        if acc:
            mw.accumulate()
            loss_fn(model(tokens), targets).backward()   # the next micro-batch's bf16 gradients
        mw.step()
        loss_fn(model(tokens), targets).backward()       # gradients exist during the next step
        mixed[acc] = mw.held()
    rows = [["fp32 AdamW", "parameters", fp32_held["Parameter"] / psi],
            ["", "gradients", fp32_held["Gradient"] / psi],
            ["", "Adam m and v", fp32_held["Optstate"] / psi],
            ["", "**total**", sum(fp32_held.values()) / psi]]
    for acc in (False, True):
        label = "bf16 + fp32 master" + (", fp32 grad accumulation" if acc else "")
        for i, (k, b) in enumerate(mixed[acc].items()):
            rows.append([label if i == 0 else "", k, b / psi])
        rows.append(["", "**total**", sum(mixed[acc].values()) / psi])
    note("""
        Bytes per parameter, measured from the tensors a real setup holds after a step: fp32
        AdamW keeps 4 + 4 + 8 = 16. Mixed precision computes in bf16 but keeps an fp32 master
        copy for the update, because bf16 cannot represent small updates (below): 2 + 2 + 4 + 8
        = 16 again — mixed precision saves activation memory and time, not state — and 20 with
        an fp32 buffer that sums gradients over micro-batches. This 16Ψ is what ZeRO (lecture
        03) divides among ranks.
    """)
    see(MasterWeights)
    table(rows, header=["setup", "tensor", "bytes per parameter (measured)"],
          caption=f"Ψ = {psi:,}")


def activation_memory():
    cfg = GPTConfig()
    b = 2
    seqs = [16, 32, 64, 128] if settings.quick else [16, 32, 64, 128, 256, 512]
    measured = {"sdpa": [], "naive": []}
    for s in seqs:
        measured["sdpa"].append(block_activations(cfg, b, s, causal_attention).bytes)
        measured["naive"].append(block_activations(cfg, b, s, naive_causal_attention).bytes)
    reconciled = {k: [sum(reconciled_bytes(cfg, b, s, k).values()) for s in seqs] for k in measured}
    paper = [korthikanti_bytes(cfg, b, s) for s in seqs]
    note(f"""
        ## Activation memory against the formula
        Korthikanti et al. count what one transformer layer keeps for backward in 16-bit with
        dropout: s·b·h·(34 + 5·a·s/h) bytes. We measure what autograd really saves for one
        of our blocks: `torch.autograd.graph.saved_tensors_hooks` sees every tensor saved for
        backward; we count each storage once (q, k and v are views of separate projections,
        but the output of LN1 feeds all three and is saved once) and leave out the weights.
    """)
    see(SavedActivations)
    s0 = seqs[-1]
    saved = block_activations(cfg, b, s0, causal_attention)
    sbh = s0 * b * cfg.d_model
    table([[str(list(shape)), str(dtype).replace("torch.", ""), n, n / (sbh * 4)] for shape, dtype, n in saved.tensors],
          header=["shape", "dtype", "bytes", "in units of 4·s·b·h"],
          caption=f"what one block saves (fused attention), s = {s0}, b = {b}, h = {cfg.d_model}")
    terms = reconciled_bytes(cfg, b, s0, "sdpa")
    terms_naive = reconciled_bytes(cfg, b, s0, "naive")
    table([[k, v] for k, v in terms.items()] + [["**total (reconciled)**", sum(terms.values())],
                                                ["**measured**", saved.bytes]],
          header=["term", "bytes"], caption=f"reconciliation, fused attention, s = {s0}")
    see(reconciled_bytes)
    note(f"""
        Term by term: the paper's 34·s·b·h (2 bytes per element) counts 17 tensors of s·b·h
        elements; ours keeps 16 (the paper's two dropout masks, 1 byte each, do not exist
        without dropout: 34 − 2 = 32 = 2 × 16), at 4 bytes since we train in fp32. The
        s² term depends on the attention: the naive version keeps the fp32 probabilities
        ({fmt_bytes(terms_naive['softmax probabilities (a·s per token)'])} at s = {s0}) where the
        paper keeps softmax output, dropout mask and dropout output (5·a·s²·b bytes);
        the fused kernel PyTorch uses on this CPU (`scaled_dot_product_attention`) keeps only
        a log-sum-exp per query and head: no s² term at all — FlashAttention's idea, built
        below. Measured and reconciled agree to the byte at every s
        ({sum(m == r for m, r in zip(measured['sdpa'] + measured['naive'], reconciled['sdpa'] + reconciled['naive']))}
        of {2 * len(seqs)} sizes).
    """)
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.plot(seqs, [m / 1e6 for m in measured["naive"]], "o", label="measured, naive attention")
    ax.plot(seqs, [m / 1e6 for m in measured["sdpa"]], "s", label="measured, fused (SDPA)")
    ax.plot(seqs, [r / 1e6 for r in reconciled["naive"]], "-", color="C0", lw=1, label="reconciled, naive")
    ax.plot(seqs, [r / 1e6 for r in reconciled["sdpa"]], "-", color="C1", lw=1, label="reconciled, fused")
    ax.plot(seqs, [2 * p / 1e6 for p in paper], "--", color="gray", label="paper × 2 (fp32)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("MB saved per layer")
    ax.legend(fontsize=7)
    figure(fig, caption=f"activations saved by one block, b = {b}, h = {cfg.d_model}, a = {cfg.n_heads}: "
                        "linear in s with the fused kernel, quadratic once a·s/h outgrows the rest with naive attention")
    huge = GPTConfig(vocab_size=50304, seq_len=2048, d_model=8192, n_layers=2 if settings.quick else 4, n_heads=64)
    start = time.perf_counter()
    fake = fake_training_step(huge, batch_size=1)
    seconds = time.perf_counter() - start
    psi = param_count(huge)
    note(f"""
        The same tracker runs under `FakeTensorMode`, where tensors have shapes and dtypes but
        no storage. A GPT with h = {huge.d_model}, {huge.n_layers} layers and a vocabulary of
        {huge.vocab_size} has {psi / 1e9:.2f} billion parameters; one bf16 training step on one
        sequence of {huge.seq_len} tokens is traced in {seconds:.1f} s without allocating it
        (the optimizer here keeps its moments in bf16 too).
    """)
    table([[phase] + [r.get(c, 0) / 1e9 for c in MEM_CATEGORIES] + [r["Total"] / 1e9] for phase, r in fake.items()],
          header=["after", "params GB", "grads GB", "optimizer GB", "activations GB", "temporaries GB", "total GB"],
          caption=f"Ψ = {psi:,}: 2Ψ bytes = {2 * psi / 1e9:.1f} GB of bf16 parameters (MemTracker under FakeTensorMode)")


def recomputation():
    cfg = GPTConfig(n_layers=4)
    bsz = 16 if settings.quick else 32
    results, timings = {}, {}
    for mode in ("none", "selective", "full"):
        results[mode] = recomputation_step(cfg, bsz, mode)
        model = results[mode]["model"]
        tokens, targets = batch(cfg, bsz, 0)

        def step():
            loss_fn(model(tokens), targets).backward()
        timings[mode] = measure(step, warmup=1, repeats=5 if settings.quick else 9)
    ref = results["none"]["grads"]
    note("""
        ## Activation recomputation
        Keep fewer activations and recompute the rest during backward (Chen et al. 2016).
        `torch.utils.checkpoint` with `use_reentrant=False` keeps only a block's input and runs
        its forward again in backward ("full"); with `create_selective_checkpoint_contexts` a
        policy decides per operator: ours keeps the matmul and attention outputs and recomputes
        LayerNorms and GELU ("selective"). Saved-tensor hooks cannot see inside a checkpoint,
        so the bytes held between forward and backward are measured at the allocator
        (`LiveBytes`, a `TorchDispatchMode` that tracks every storage it sees created until it
        is freed).
    """)
    see(_save_matmuls)
    see(Recomputed)
    table([[m, r["held"], r["held"] / results["none"]["held"], r["peak"], timings[m].ms(),
            timings[m].median / timings["none"].median,
            max((r["grads"][k] - ref[k]).abs().max().item() for k in ref)] for m, r in results.items()],
          header=["recomputation", "bytes held after forward", "vs none", "peak bytes fwd+bwd",
                  "forward+backward", "time vs none", "max |Δ grad| vs none"],
          caption=f"GPT with {cfg.n_layers} layers, batch {bsz} × {cfg.seq_len}, {machine()}")
    t = {m: timings[m].median / timings["none"].median for m in timings}
    note(f"""
        Full recomputation holds {results['full']['held'] / results['none']['held']:.0%} of the
        bytes and costs {t['full']:.2f}× the time (one more forward per block); selective
        holds {results['selective']['held'] / results['none']['held']:.0%} and costs
        {t['selective']:.2f}×.
        {"On a model this small, selective recomputation is the slowest: its policy is a "
         "Python call for every operator, forward and again during recomputation, which "
         "costs more than the arithmetic it saves; at real sizes the matmuls dominate and "
         "selective costs a few percent. " if t['selective'] > t['full'] else ""}
        The gradients are identical because the recomputed forward does the same arithmetic.
    """)


def accumulation():
    cfg = GPTConfig()
    bsz = 16
    big, held_big = accumulated_gradients(cfg, bsz, 1)
    rows = [[1, bsz, held_big, 0.0]]
    for k in (2, 4, 8):
        g, held = accumulated_gradients(cfg, bsz, k)
        rows.append([k, bsz // k, held, max((g[n] - big[n]).abs().max().item() for n in big)])
    note("""
        ## Gradient accumulation
        k micro-batches of b/k sequences, each loss divided by k, backward after each: the
        gradients sum to the big batch's. Activations are held for one micro-batch at a time,
        so activation memory falls by k for the same global batch (global batch = micro-batch ×
        accumulation steps × data-parallel ranks, lecture 03).
    """)
    see(accumulated_gradients)
    table(rows, header=["micro-batches k", "sequences per micro-batch", "most bytes held after a forward",
                        "max |Δ grad| vs one batch"],
          caption="fp32; the differences are rounding (sums in another order)")


def number_formats():
    import matplotlib.pyplot as plt
    note("""
        ## Number formats: range against resolution
        A float is sign × 2^exponent × 1.mantissa. Exponent bits buy range, mantissa bits
        resolution: between 1 and 2 a format with m mantissa bits has 2^m values, so rounding
        there errs by at most 2^−(m+1) relative. `torch.finfo` gives the constants; we also
        round 200,001 evenly spaced values in [1, 2] to each format and measure.
    """)
    table([list(format_properties(n, d).values()) for n, d in FORMATS.items()],
          header=list(format_properties("fp32", torch.float32).keys()))
    exps = list(range(-12, 7)) if settings.quick else [e / 2 for e in range(-26, 14)]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for name, dtype in FORMATS.items():
        errs = relative_error_across_magnitudes(dtype, exps)
        ax.plot([10 ** e for e in exps], [max(e, 1e-9) for e in errs], marker=".", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("magnitude of the value")
    ax.set_ylabel("median relative rounding error")
    ax.legend(fontsize=7)
    figure(fig, caption="each format is accurate to ~eps/4 within its normal range; below it "
                        "(subnormals) the error grows until values flush to zero (error 1), above "
                        "it e4m3fn saturates at 448 and the others overflow; fp32 errors are "
                        "clipped at 1e-9 for the plot")
    cfg = GPTConfig()
    bsz = 16 if settings.quick else 32
    ref = fp32_gradients(cfg, bsz)
    scales = [None, 2.0 ** 8, 2.0 ** 16, 2.0 ** 24]
    rows = []
    for sc in scales:
        g, count, skipped = fp16_gradients(cfg, bsz, sc)
        rows.append(["none" if sc is None else f"2^{int(math.log2(sc))}", count["flushed to zero"] / count["elements"],
                     count["subnormal"] / count["elements"], gradient_error(g, ref),
                     "skip (inf found)" if skipped else "step"])
    note(f"""
        ### fp16 needs loss scaling
        fp16 has bf16's precision eight times over but a smallest normal of
        {torch.finfo(torch.float16).smallest_normal:.3g}: gradients, which are small, fall into the
        subnormals (fewer bits) or flush to zero. We store every gradient of the GPT in fp16 as
        it flows backward (each module's incoming gradient and each parameter's gradient are
        rounded) and count. Multiplying the loss by S moves them all up by S; `GradScaler`
        divides by S again in fp32 before the step and skips a step whose gradients overflowed
        (then halves S). Micikevicius et al. (2018) introduced exactly this.
    """)
    see(fp16_gradients)
    table(rows, header=["loss scale", "gradient elements flushed to 0", "subnormal", "‖g − g_fp32‖ / ‖g_fp32‖",
                        "GradScaler"], caption=f"the GPT's real gradients, batch {bsz} × {cfg.seq_len}")
    steps = 80 if settings.quick else 100
    lr = 3e-4
    curves = {v: train_curve(cfg, v, steps, lr, batch_size=8, log_every=2 if settings.quick else 5)
              for v in ("fp32", "bf16 weights", "bf16 + fp32 master")}
    note(f"""
        ### bf16 needs fp32 master weights
        bf16 keeps fp32's range (no loss scaling) with 8 bits of precision: a weight near 1 moves
        only by steps of {torch.finfo(torch.bfloat16).eps}, so an update smaller than half that
        rounds away. Adam's updates are about lr in size, so with lr = {lr} every weight larger
        than about lr·2^8 = {lr * 256:.3f} in magnitude cannot move at all when the weights are
        bf16 (all LayerNorm gains, for instance). Training the same GPT three ways:
    """)
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for v, (c, _) in curves.items():
        ax.plot(*zip(*c), label=v)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    figure(fig, caption=f"AdamW lr {lr}, batch 8: bf16 compute with an fp32 master copy follows fp32; "
                        "bf16 weights updated in place fall behind")
    table([[v, c[-1][1], c[-1][1] - curves["fp32"][0][-1][1], u] for v, (c, u) in curves.items()],
          header=["variant", f"loss after {steps} steps", "minus fp32's",
                  "weights the optimizer updates left unchanged by the last step"])


def fp8_scaling():
    m, k, n = (256, 512, 256) if settings.quick else (512, 1024, 512)
    rows = []
    for outlier in (1.0, 1e2, 1e3, 1e4, 1e5):
        a, w = outlier_matrices(m, k, n, outlier=outlier)
        row = [outlier]
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            row += [fp8_matmul_error(a, w, None, None, dtype), fp8_matmul_error(a, w, (1, 128), (128, 128), dtype)]
        row += [scaled_mm_error(a, w), scaled_mm_error(a, w, rowwise=True)]
        rows.append(row)
    note(f"""
        ## FP8 with scaling
        fp8 e4m3 has 3 mantissa bits and a range of ±448; to use it, each tensor is divided by
        a scale so its largest value lands near 448. One scale per tensor lets a single outlier
        push every other value down into the subnormals. DeepSeek-V3 trains in fp8 with one
        scale per 1×128 tile of activations and per 128×128 block of weights, so an outlier
        only costs its own tile. Simulated here: quantize, dequantize, multiply in fp32 (as the
        tensor cores accumulate); activations of {m} tokens × {k} in which 1% of the tokens are
        larger by the outlier factor, weights {k}×{n}; the error is the median over tokens of
        each output row's relative error. `torch._scaled_mm` (PyTorch's fp8 matmul, which runs
        on this CPU) with one scale per tensor, and one per row of activations and column of
        weights, for comparison.
    """)
    see(quantize_fp8)
    table(rows, header=["outlier ×", "e4m3 per-tensor", "e4m3 tiles", "e5m2 per-tensor", "e5m2 tiles",
                        "_scaled_mm per-tensor", "_scaled_mm row-wise"],
          caption="median over tokens i of ‖ĉ_i − c_i‖/‖c_i‖ against float64")
    note(f"""
        With outliers of {rows[-1][0]:g}×, tile scaling errs {rows[-1][2]:.3g} against
        {rows[-1][1]:.3g} per tensor (e4m3): one scale for everything pushed the ordinary
        tokens into e4m3's subnormals (below {torch.finfo(torch.float8_e4m3fn).smallest_normal}
        after scaling), while each 1×128 tile keeps its own range. Without outliers the two
        are within {abs(rows[0][2] / rows[0][1] - 1):.0%} of each other. e5m2 trades a
        mantissa bit for range: coarser everywhere, which suits gradients more than
        activations and weights (DeepSeek-V3 uses e4m3 for all of them, with these scales).
        Our per-tensor simulation and `_scaled_mm` agree ({rows[-1][1]:.4g} and
        {rows[-1][5] if rows[-1][5] is not None else float('nan'):.4g}).
    """)
    see("https://arxiv.org/abs/2412.19437", "DeepSeek-AI 2024, DeepSeek-V3 Technical Report")
    see("https://arxiv.org/abs/2209.05433", "Micikevicius et al. 2022, FP8 Formats for Deep Learning")


def flash_attention_idea():
    b, heads, d = 1, 4, 16
    g = torch.Generator().manual_seed(0)
    s = 200
    q, k, v = (torch.randn(2, 3, s, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    checks = []
    for causal in (False, True):
        for bs in (7, 64, 256):
            out = online_softmax_attention(q, k, v, bs, causal=causal)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            d_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
            g1 = torch.autograd.grad(out, (q, k, v), d_out)
            g2 = torch.autograd.grad(ref, (q, k, v), d_out)
            checks.append([causal, bs, (out - ref).abs().max().item(),
                           max((x - y).abs().max().item() for x, y in zip(g1, g2))])
    note("""
        ## FlashAttention's idea: attention in blocks with an online softmax
        softmax(QKᵀ)V needs, for each query, the maximum and the sum of exponentials over all
        keys. Computed over blocks of keys, a running result can absorb the next block: keep
        each block's output and log-sum-exp (lse); two partial results combine with weights
        exp(lse_a − lse) and exp(lse_b − lse), lse = log(e^lse_a + e^lse_b) — the running-max
        rescaling of Milakov & Gimelshein's online softmax, which FlashAttention (Dao et al.)
        runs in on-chip memory. Only a (queries × block) tile of scores ever exists. The
        backward recomputes each tile from the saved lse instead of storing the probabilities.
        `merge_attention` is the piece lecture 06's ring attention reuses: each rank's block
        of keys arrives, is attended, and merged.
    """)
    see(attention_with_lse)
    see(merge_attention)
    see(OnlineSoftmaxAttention)
    table(checks, header=["causal", "block size", "max |Δ out| vs SDPA", "max |Δ grad q, k, v| vs SDPA"],
          caption=f"float64, (2, 3, {s}, 16): block sizes that do not divide s = {s} included")
    seqs = [128, 256, 512] if settings.quick else [128, 256, 512, 1024]
    block = 64
    variants = {"naive (s × s scores)": naive_causal_attention,
                f"online softmax, block {block}": lambda q, k, v: online_softmax_attention(q, k, v, block, causal=True),
                "PyTorch SDPA (fused)": causal_attention}
    rows = []
    for s in seqs:
        xs = [torch.randn(b, heads, s, d, generator=g) for _ in range(3)]
        for name, fn in variants.items():
            t = measure(lambda: fn(*xs), warmup=1, repeats=5)
            rows.append([s, name, attention_peak_bytes(fn, b, heads, s, d),
                         attention_peak_bytes(fn, b, heads, s, d, backward=True), t.ms()])
    table(rows, header=["s", "attention", "peak bytes, forward", "peak bytes, forward + backward", "forward time"],
          caption=f"b = {b}, {heads} heads of {d}, causal; bytes allocated beyond q, k, v, measured "
                  f"with LiveBytes; {machine()}")
    note("""
        The naive version's bytes grow as s², the blocked one's as s·block: at the longest
        sequence it holds a fraction of the naive peak, in plain PyTorch. It is slower than
        PyTorch's fused kernel, which does the same in C++ with the tiles in cache.
    """)
    see("https://arxiv.org/abs/1805.02867", "Milakov & Gimelshein 2018, Online normalizer calculation for softmax")
    see("https://arxiv.org/abs/2205.14135", "Dao et al. 2022, FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness")
    see("https://arxiv.org/abs/2307.08691", "Dao 2023, FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning")


def roofline():
    import matplotlib.pyplot as plt
    sizes = [64, 128, 256, 512] if settings.quick else [64, 128, 256, 512, 1024]
    cores = usable_cores()
    mm_one = {n: matmul_rate(n) for n in sizes}          # the demos' setting: one thread
    nbytes = (16 if settings.quick else 64) * 2 ** 20
    with threads(cores):                                  # the machine: every usable core
        mm = {n: matmul_rate(n) for n in sizes}
        bw, bw_t = copy_rate(nbytes)
        add = elementwise_rate(nbytes // 4, "add")
        gelu = elementwise_rate(nbytes // 4, "gelu")
    peak = max(r for r, _ in mm.values())
    note(f"""
        ## Notes: kernels and the roofline
        A kernel is limited either by arithmetic or by moving bytes. The roofline (Williams et
        al. 2009) plots attainable FLOP/s against arithmetic intensity (FLOP per byte moved):
        min(peak FLOP/s, intensity × bandwidth). With {cores} thread(s), {machine()}: the best fp32
        matmul reaches {peak / 1e9:.1f} GFLOP/s and copying {fmt_bytes(nbytes)} moves
        {bw / 1e9:.1f} GB/s ({bw_t.ms()}), so the ridge is at
        {peak / bw:.1f} FLOP/byte. An n×n matmul does 2n³ FLOP on 12n² bytes (intensity n/6):
        large ones are compute bound; an element-wise add does 1 FLOP per 12 bytes and is
        bound by memory at any size.

        The GPU kernel techniques that the later lectures assume: **coalescing** (neighbouring
        threads read neighbouring addresses, so one memory transaction serves many),
        **tiling** (load a block of the operands into fast on-chip memory and reuse it many
        times: what raises a matmul's intensity, and what FlashAttention does for attention),
        and **fusion** (one kernel for a chain of element-wise operations, so the intermediate
        never goes to memory: the GELU below moves its bytes once).
    """)
    if not torch.cuda.is_available():
        note("No GPU on this machine: the GPU roofline measurement is skipped; on a GPU the "
             "same functions (`matmul_rate`, `copy_rate` with `dev='cuda'`) measure it.")
    else:
        gpu_peak = max(matmul_rate(n, torch.bfloat16, "cuda")[0] for n in (2048, 4096, 8192))
        gpu_bw, _ = copy_rate(512 * 2 ** 20, "cuda")
        note(f"GPU ({torch.cuda.get_device_name(0)}): bf16 matmul {gpu_peak / 1e12:.0f} TFLOP/s, "
             f"copy {gpu_bw / 1e9:.0f} GB/s, ridge {gpu_peak / gpu_bw:.0f} FLOP/byte.")
    table([[f"matmul {n}×{n}", n / 6, r / 1e9, t.ms(), mm_one[n][0] / 1e9] for n, (r, t) in mm.items()]
          + [["add", add[2], add[0] / 1e9, add[1].ms(), None], ["GELU", gelu[2], gelu[0] / 1e9, gelu[1].ms(), None]],
          header=["kernel", "FLOP per byte", f"GFLOP/s, {cores} thread(s)", "time", "GFLOP/s, 1 thread"],
          caption=f"fp32, {machine()}")
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    xs = [2 ** e for e in range(-5, 10)]
    ax.plot(xs, [min(peak, x * bw) / 1e9 for x in xs], color="gray", label="roofline (measured peak, bandwidth)")
    ax.plot([n / 6 for n in sizes], [r / 1e9 for r, _ in mm.values()], "o", label="matmul n×n")
    ax.plot([add[2]], [add[0] / 1e9], "s", label="add")
    ax.plot([gelu[2]], [gelu[0] / 1e9], "^", label="GELU")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=7)
    figure(fig, caption=f"roofline of this machine, {machine()}")
    see("https://doi.org/10.1145/1498765.1498785", "Williams, Waterman & Patterson 2009, Roofline: an insightful visual performance model")


def references():
    note("## Papers")
    for url, title in [
        ("https://arxiv.org/abs/2205.05198", "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models"),
        ("https://arxiv.org/abs/1604.06174", "Chen et al. 2016, Training Deep Nets with Sublinear Memory Cost"),
        ("https://arxiv.org/abs/1710.03740", "Micikevicius et al. 2018, Mixed Precision Training"),
        ("https://arxiv.org/abs/1905.12322", "Kalamkar et al. 2019, A Study of BFLOAT16 for Deep Learning Training"),
        ("https://arxiv.org/abs/1910.02054", "Rajbhandari et al. 2020, ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"),
    ]:
        see(url, title=title)


def main():
    torch.set_num_threads(1)   # small tensors, shared cores: extra threads mostly wait (roofline uses all)
    intro()                    # what this lecture measures, and why it comes first
    the_model_and_task()       # the GPT and data every later lecture trains
    anatomy_of_a_step()        # what a training step holds, phase by phase
    parameters_and_bytes()     # Ψ in closed form; 16 bytes per parameter
    activation_memory()        # the paper's formula against what autograd saves
    recomputation()            # trade compute for activation memory
    accumulation()             # trade steps for activation memory
    number_formats()           # range vs resolution; loss scaling; master weights
    fp8_scaling()              # fp8 needs fine-grained scales
    flash_attention_idea()     # attention without the s × s matrix (lecture 06 builds on it)
    roofline()                 # what this machine does per second
    references()


def bench():
    """Plain-PyTorch online-softmax attention vs PyTorch's fused SDPA, forward, causal."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 16, generator=g) for _ in range(3))
    ours = measure(lambda: online_softmax_attention(q, k, v, 128, causal=True), repeats=7)
    theirs = measure(lambda: causal_attention(q, k, v), repeats=7)
    return [f"lecture_01: online-softmax attention {ours.median * 1e3:.2f} ms vs SDPA "
            f"{theirs.median * 1e3:.2f} ms (s=1024): ratio {ours.median / theirs.median:.1f} "
            "(plain PyTorch vs a fused kernel; no target)"]
