"""Number formats and mixed precision: range against resolution, fp32 down to fp8.

- Rounding to a format (`round_to`) and what it costs (`format_properties`,
  `relative_error_across_magnitudes`).
- fp16 gradients and loss scaling with `torch.amp.GradScaler` (Micikevicius et al. 2018,
  "Mixed Precision Training").
- bf16 compute with an fp32 master copy of the weights (`MasterWeights`; Kalamkar et al. 2019,
  "A Study of BFLOAT16 for Deep Learning Training").
- fp8 with one scale per tensor or one per tile, as DeepSeek-V3 trains (DeepSeek-AI 2024,
  "DeepSeek-V3 Technical Report"; formats: Micikevicius et al. 2022, "FP8 Formats for Deep
  Learning"), simulated on the CPU and checked against PyTorch's `torch._scaled_mm`.
"""
import dataclasses
import math

import torch
from torch import nn

from lectures.model.gpt import GPT, batch, loss_fn


FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "fp8 e4m3fn": torch.float8_e4m3fn, "fp8 e5m2": torch.float8_e5m2}


def round_to(x, dtype):
    """x rounded to `dtype` (round to nearest even) and back to fp32. fp8 e4m3fn has no
    infinity, and PyTorch's cast to it saturates: anything past ±448, ±inf included, becomes
    ±448 (NaN stays NaN). The other formats overflow to ±inf."""
    return x.to(dtype).to(torch.float32)


def overflow_table(values=(1e3, 1e6, float("inf"), float("nan"))):
    """What each format makes of values beyond its range: {format: [rounded values]}."""
    x = torch.tensor(values, dtype=torch.float32)
    return {name: round_to(x, dtype).tolist() for name, dtype in FORMATS.items()}


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def values_between(lo, hi, dtype):
    """How many values of `dtype` lie in [lo, hi] (0 < lo < hi, both representable): positive
    floats of one format are ordered like their bit patterns read as integers, so it is the
    difference of the two bit patterns, plus one. Exact for every format, fp32's 2²³ + 1
    included (a sample of values would find at most as many values as it has samples)."""
    if not 0 < lo < hi:
        raise ValueError(f"values_between needs 0 < lo < hi, got {lo} and {hi}")
    ends = torch.tensor([lo, hi], dtype=torch.float64).to(dtype)
    if ends.double().tolist() != [lo, hi]:
        raise ValueError(f"{lo} and {hi} must both be representable in {dtype}")
    bits = ends.view(_SAME_SIZE_INT[dtype.itemsize]).long()
    return int(bits[1] - bits[0]) + 1


def format_properties(name, dtype, n=200_001):
    """What finfo says, the number of values in [1, 2] (from the bit patterns), and what
    rounding `n` evenly spaced values in [1, 2] measures: the largest relative error is half
    the spacing between neighbours there (eps/2)."""
    fi = torch.finfo(dtype)
    x = torch.linspace(1, 2, n, dtype=torch.float64)
    err = ((round_to(x.float(), dtype).double() - x).abs() / x).max().item()
    bits = dtype.itemsize * 8
    return {"format": name, "bits": bits, "max": fi.max, "smallest normal": fi.smallest_normal,
            "eps (spacing at 1)": fi.eps, "values in [1, 2]": values_between(1.0, 2.0, dtype),
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


def per_tensor_error(grads, reference):
    """{name: ‖g − g_ref‖ / ‖g_ref‖} for each parameter's gradient (inf where g is not finite or
    the reference is zero). The error over all parameters together is dominated by the largest
    gradients; what fp16 loses is the smallest, and this shows it tensor by tensor."""
    out = {}
    for k, ref in reference.items():
        num, den = (grads[k].double() - ref.double()).norm(), ref.double().norm()
        err = (num / den).item() if den > 0 else float("inf")
        out[k] = err if math.isfinite(err) else float("inf")
    return out


def gradient_rms(grads):
    """{name: root-mean-square of the gradient}: how small each tensor's gradients are."""
    return {k: g.double().pow(2).mean().sqrt().item() for k, g in grads.items()}


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


def freeze_threshold(lr, dtype=torch.bfloat16):
    """The smallest |w| from which an update of size `lr` rounds away in `dtype`.

    w + u rounds back to w when |u| < ulp(w)/2, where ulp(w), the spacing of the format's
    values at w, is 2^⌊log2|w|⌋ · eps. So every w with 2^⌊log2|w|⌋ · eps/2 > lr is frozen: the
    answer is the smallest power of two 2^e with 2^e · eps/2 > lr (strictly: at equality the
    update is a tie, rounded to even)."""
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr}")
    eps = torch.finfo(dtype).eps
    return 2.0 ** (math.floor(math.log2(2 * lr / eps)) + 1)


def frozen_fraction(params, lr, dtype=torch.bfloat16):
    """Share of the elements of `params` with |w| at or above `freeze_threshold(lr, dtype)`."""
    params = list(params)
    t = freeze_threshold(lr, dtype)
    return sum((p.detach().abs() >= t).sum().item() for p in params) / sum(p.numel() for p in params)


def train_curve(cfg, variant, steps, lr, batch_size=16, log_every=5):
    """Loss every `log_every` steps of AdamW training, for `variant` in
    fp32 | bf16 weights | bf16 + fp32 master | autocast bf16. Also the fraction of the weights
    the optimizer updates (the fp32 master copy in the third variant) that the last step left
    unchanged: in bf16, an update smaller than half the spacing between neighbours rounds away.

    "autocast bf16" is PyTorch's own mixed precision: the parameters stay fp32 (they are the
    master weights) and `torch.autocast` casts them to bf16 for each matmul of the forward,
    so the gradients and the update are fp32 too."""
    autocast = False
    if variant == "fp32":
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        step, updated = opt.step, list(model.parameters())
    elif variant == "autocast bf16":
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        step, updated, autocast = opt.step, list(model.parameters()), True
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
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens)
        loss = loss_fn(logits, targets)      # the loss in fp32 (loss_fn casts the logits)
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


def quantize_fp8(x, tile=None, dtype=torch.float8_e4m3fn, power_of_two=False):
    """x (2-D) to fp8 with scales chosen so each group's largest |value| maps to the format's
    max. `tile=None`: one scale for the whole tensor; `tile=(r, c)`: one per r×c tile
    (DeepSeek-V3: 1×128 for activations, 128×128 for weights; MXFP8: 1×32 blocks along the
    reduction dimension of both operands). `power_of_two`: the scale is a power of two, as an
    8-bit exponent-only (e8m0) scale must be, rounded up so that no value exceeds the max:
    NVIDIA's MXFP8 training recipe (Mishra et al. 2025). The OCP MX specification's rule is
    2^(floor(log2 amax) − emax), emax being the element format's largest exponent (8 for
    e4m3), which rounds down and lets the largest values of a block saturate; the recipe found
    it diverged.
    Returns (fp8 values, scales), scales shaped (rows/r, cols/c)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8 takes a matrix, got shape {tuple(x.shape)}")
    m, n = x.shape
    r, c = tile or (m, n)
    if m % r or n % c:
        raise ValueError(f"tile {r}×{c} does not divide the {m}×{n} matrix")
    tiles = x.float().reshape(m // r, r, n // c, c)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-30)
    scale = amax / torch.finfo(dtype).max
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
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


def fp8_matmul_error(a, w, a_tile=None, w_tile=None, dtype=torch.float8_e4m3fn, power_of_two=False,
                     channels=None):
    """Median over output rows (tokens) of the relative error of an fp8 matmul simulated on the
    CPU: quantize both operands, dequantize, multiply with an fp32 sum (what DeepSeek-V3's
    kernels reach by promoting partial sums to fp32, see `accumulate`). Per row, because a few
    huge rows would otherwise decide the whole norm. `channels` (a boolean mask over a's
    columns): measure only the part of the product those channels carry, after quantizing
    the whole tensors, so that a few huge channels cannot hide what happened to the others."""
    qa = dequantize_fp8(*quantize_fp8(a, a_tile, dtype, power_of_two))
    qw = dequantize_fp8(*quantize_fp8(w, w_tile, dtype, power_of_two))
    if channels is not None:
        a, w, qa, qw = a[:, channels], w[channels], qa[:, channels], qw[channels]
    return row_errors(qa @ qw, a.double() @ w.double()).median().item()


def keep_bits(x, bits, rounding="truncate"):
    """x (float64) with only `bits` significant bits, the rest cut off (`truncate`: toward
    zero) or rounded to the nearest (`nearest`)."""
    cut = {"truncate": torch.trunc, "nearest": torch.round}[rounding]
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(cut(mantissa * 2.0 ** bits) / 2.0 ** bits, exponent)


def accumulate(a, b, bits=14, promote_every=None, group=1, rounding="truncate"):
    """a (m×k) @ b (k×n) with the running sum over k kept to `bits` significant bits: a model
    of an fp8 tensor core's accumulator, which DeepSeek-V3 (§3.3.2) measured to retain around
    14 bits on H800 GPUs, against fp32's 24. The hardware's rounding is not documented, so it
    is a parameter: every `group` products are summed exactly, then added to the running sum,
    whose result is cut to `bits` (`rounding`: "truncate" toward zero or "nearest"). With
    `promote_every` = N_C, every N_C products the partial sum is added into an fp32
    accumulator and restarted, DeepSeek-V3's fix (N_C = 128). The products themselves are
    exact (fp8 × fp8 fits in float64). Loops over k: for small matrices."""
    if promote_every is not None and promote_every < 1:
        raise ValueError(f"promote_every must be a positive number of products, got {promote_every}")
    if group < 1 or (promote_every and promote_every % group):
        raise ValueError(f"group must be a positive divisor of promote_every, got {group} and {promote_every}")
    a, b = a.double(), b.double()
    total = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    partial = torch.zeros_like(total)
    for i in range(0, a.shape[1], group):
        partial = keep_bits(partial + a[:, i:i + group] @ b[i:i + group, :], bits, rounding)
        if promote_every and (i + group) % promote_every == 0:
            total, partial = (total + partial).float().double(), torch.zeros_like(partial)
    return (total + partial).float().double() if promote_every else partial


def accumulation_error(k, bits=14, promote_every=None, group=1, rounding="truncate", m=32, n=32, seed=0,
                       worst=False):
    """Median (or, with `worst`, largest) over rows of the relative error that the
    accumulator alone adds to an e4m3 matmul of a (m×k) by (k×n): both operands are e4m3
    values already, compared with their exact product."""
    g = torch.Generator().manual_seed(seed)
    a = round_to(torch.randn(m, k, generator=g), torch.float8_e4m3fn)
    b = round_to(torch.randn(k, n, generator=g), torch.float8_e4m3fn)
    errors = row_errors(accumulate(a, b, bits, promote_every, group, rounding), a.double() @ b.double())
    return (errors.max() if worst else errors.median()).item()


def scaling_over_steps(amax_per_step, history=16, dtype=torch.float8_e4m3fn, numel=4096, seed=0):
    """Per step, the relative error of casting a tensor whose largest |value| is
    `amax_per_step[t]` to fp8 with *current* scaling (the scale from this tensor's own amax)
    and with *delayed* scaling (from the largest amax of the previous `history` steps, as
    Transformer Engine's delayed scaling does, so no amax has to be computed before the cast).
    When the amax jumps, the delayed scale is too small and e4m3's cast saturates the
    largest values, silently. Returns [(current error, delayed error, share saturated)]."""
    g = torch.Generator().manual_seed(seed)
    fmax = torch.finfo(dtype).max
    seen, out = [], []
    for amax in amax_per_step:
        x = torch.randn(numel, generator=g)
        x = x / x.abs().max() * amax
        current = amax / fmax
        delayed = max(seen[-history:]) / fmax if seen else current
        errs = []
        for scale in (current, delayed):
            back = round_to(x / scale, dtype) * scale
            errs.append(((back - x).norm() / x.norm()).item())
        out.append((errs[0], errs[1], ((x / delayed).abs() > fmax).float().mean().item()))
        seen.append(amax)
    return out


def scaled_mm_error(a, w, rowwise=False, channels=None):
    """The same with PyTorch's fp8 matmul `torch._scaled_mm` (e4m3, tensor-wise or row-wise
    scales: a per row of a, one per column of w). `channels` as in `fp8_matmul_error`: the
    other channels are zeroed after quantizing (fp8 zero is exact). None if this build cannot
    run it."""
    if rowwise:
        qa, sa = quantize_fp8(a, (1, a.shape[1]))
        qw, sw = quantize_fp8(w.t().contiguous(), (1, w.shape[0]))
        sa, sw, out_dtype = sa.float(), sw.float().t(), torch.bfloat16
    else:
        (qa, sa), (qw, sw) = quantize_fp8(a), quantize_fp8(w.t().contiguous())
        sa, sw, out_dtype = sa.reshape(()), sw.reshape(()), torch.float32
    if channels is not None:
        qa.view(torch.uint8)[:, ~channels] = 0
        a, w = a[:, channels], w[channels]
    try:
        out = torch._scaled_mm(qa, qw.t(), sa, sw, out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError):
        return None
    return row_errors(out, a.double() @ w.double()).median().item()


def outlier_matrices(m, k, n, outlier=1000.0, frac=0.01, channel_frac=0.002, seed=0):
    """Activations (m tokens × k channels) with outliers of both kinds LLMs show, `outlier`
    times larger than the rest: whole tokens (a fraction `frac`; Sun et al. 2024's "massive
    activations" sit on a few tokens) and whole channels (a fraction `channel_frac`, at least
    one; Dettmers et al. 2022's outlier features are a few fixed channels across all tokens).
    Where they cross, the value is `outlier` times larger, not its square. Gaussian weights
    (k×n) with a few large entries."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g)
    factor = torch.ones(m, k)
    factor[torch.randperm(m, generator=g)[:max(1, int(frac * m))]] = outlier
    factor[:, ~ordinary_channels(k, channel_frac, seed)] = outlier
    w = torch.randn(k, n, generator=g) * 0.02
    w[torch.rand(k, n, generator=g) < 0.001] *= 50
    return a * factor, w


def ordinary_channels(k, channel_frac=0.002, seed=0):
    """Boolean mask over k channels: those that `outlier_matrices` with the same arguments
    leaves ordinary."""
    g = torch.Generator().manual_seed(seed + 1)
    keep = torch.ones(k, dtype=torch.bool)
    keep[torch.randperm(k, generator=g)[:max(1, int(channel_frac * k))]] = False
    return keep
