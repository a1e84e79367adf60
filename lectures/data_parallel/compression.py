"""Talking less: the building blocks of lecture 03's last section, in their own module.

- `quantize_int8` and `average_update`: average each rank's update with a random mask (shared
  seed: only values travel) and/or 8-bit stochastic quantization (Konečný et al. 2016).
- `PowerSGD`: rank-r compression of gradient matrices with error feedback and warm start
  (Vogels et al. 2019), written out so it can be compared with PyTorch's own DDP hook,
  `torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`.
- `NesterovOuter`: the outer optimizer of DiLoCo (Douillard et al. 2023): the averaged change of
  the local models is treated as a gradient and applied with Nesterov momentum.

Each takes a `comm` object with `all_reduce`, `all_gather(full, shard)` and a world size `n`
(lecture 03's `Collectives`, which also counts the bytes).
"""
import torch
import torch.distributed as dist


def quantize_int8(t, generator):
    """Uniform 8-bit quantization with stochastic rounding (unbiased: E[q] = t)."""
    lo, hi = t.min(), t.max()
    scale = (hi - lo).clamp_min(1e-12) / 255
    q = ((t - lo) / scale + torch.rand(t.shape, generator=generator, dtype=t.dtype)).floor()
    return q.clamp_(0, 255).to(torch.uint8), torch.stack([lo, scale])


def average_update(delta, comm, compress, round_index):
    """Average every rank's update `delta` (a flat vector), sending as few bytes as we dare.
    Returns (the average, what this rank's compressed update amounted to).

    mask: all ranks keep the same random quarter of the coordinates (same seed), so only the
    values travel, not their positions. int8: each rank quantizes its values and *all-gathers*
    them (with two floats: offset and scale). 8-bit numbers cannot be summed on the way
    round a ring without overflowing or being re-quantized at every hop, so they are gathered
    and summed after decoding, and an all-gather's traffic grows with N: each rank sends
    (N−1)·S/4 bytes where an fp32 all-reduce sends 2(N−1)/N·S < 2S. Past N = 8 ranks the
    "compressed" update costs more than the uncompressed all-reduce."""
    n = comm.n
    average, mine = torch.zeros_like(delta), torch.zeros_like(delta)
    keep = slice(None)
    if "mask" in compress:
        g = torch.Generator().manual_seed(round_index)
        keep = torch.randperm(delta.numel(), generator=g)[:delta.numel() // 4]
    values = delta[keep].contiguous()
    if "int8" in compress:
        g = torch.Generator().manual_seed(round_index * 1000 + dist.get_rank())
        q, meta = quantize_int8(values, g)
        all_q = torch.empty(n * q.numel(), dtype=torch.uint8, device=q.device)
        all_meta = torch.empty(n * 2, dtype=meta.dtype, device=q.device)
        comm.all_gather(all_q, q)
        comm.all_gather(all_meta, meta)
        decoded = all_q.view(n, -1).to(delta.dtype) * all_meta.view(n, 2)[:, 1:2] + all_meta.view(n, 2)[:, 0:1]
        mine[keep] = q.to(delta.dtype) * meta[1] + meta[0]
        average[keep] = decoded.mean(0)
    else:
        mine[keep] = values
        summed = values.clone()
        comm.all_reduce(summed)
        average[keep] = summed / n
    return average, mine


def should_compress(rows, cols, rank, min_rate=2.0):
    """PowerSGD pays off only when (rows + cols)·rank·min_rate < rows·cols (PyTorch's rule)."""
    return (rows + cols) * rank * min_rate < rows * cols


def orthonormalize(p):
    """Orthonormal columns spanning p's columns (reduced QR; Gram–Schmidt in PyTorch's hook)."""
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


class PowerSGD:
    """Rank-`rank` gradient compression for data parallelism (Vogels et al. 2019).

    For each gradient viewed as a matrix M (rows = dim 0), with this rank's error e added:
        P = (M + e) Q;  all-reduce P;  orthonormalize P
        Q = (M + e)ᵀ P; all-reduce Q; divide by N
        M̂ = P Qᵀ (the same on every rank);  e ← (M + e) − M̂      (error feedback)
    Q is kept for the next step (warm start), so one power iteration per step tracks the
    gradient's top singular directions. Each matrix sends rank·(rows + cols) numbers instead of
    rows·cols; vectors (biases) and matrices too small to gain `min_rate` are all-reduced as
    they are. The first `start_iter` steps are plain all-reduces, as in PyTorch's hook.

    Error feedback (Seide et al. 2014; Karimireddy et al. 2019) is what keeps a biased
    compressor from stalling training: what one step left out is added to the next."""

    def __init__(self, params, comm, rank=1, start_iter=2, min_rate=2.0, seed=0):
        self.params, self.comm, self.rank = list(params), comm, rank
        self.start_iter, self.min_rate, self.step_count = start_iter, min_rate, 0
        self.error, self.q = {}, {}
        g = torch.Generator().manual_seed(seed)
        for p in self.params:
            if p.dim() >= 2 and should_compress(p.shape[0], p[0].numel(), rank, min_rate):
                q = torch.randn(p[0].numel(), rank, generator=g, dtype=p.dtype)
                self.q[p] = orthonormalize(q).to(p.device)
                self.error[p] = torch.zeros(p.shape[0], p[0].numel(), dtype=p.dtype, device=p.device)

    def sync(self):
        """Replace every parameter's gradient by the (approximate) mean over ranks."""
        self.step_count += 1
        n = self.comm.n
        for p in self.params:
            if p.grad is None:
                raise RuntimeError("PowerSGD: a parameter got no gradient")
            if p not in self.q or self.step_count <= self.start_iter:
                self.comm.all_reduce(p.grad)
                p.grad.div_(n)
                continue
            m = p.grad.reshape(p.shape[0], -1) + self.error[p]
            pm = m @ self.q[p]
            self.comm.all_reduce(pm)
            pm = orthonormalize(pm)
            q = m.t() @ pm
            self.comm.all_reduce(q)
            q.div_(n)
            approx = pm @ q.t()
            self.error[p] = m - approx
            self.q[p] = q
            p.grad.copy_(approx.view_as(p.grad))


class NesterovOuter:
    """DiLoCo's outer step: after H local steps, the averaged change Δ of the models is an
    'outer gradient' −Δ, applied to the shared weights with Nesterov momentum:
        v ← μ v + (−Δ);   θ ← θ − lr · (−Δ + μ v)
    With lr = 1 and μ = 0 this is plain averaging (θ ← θ + Δ)."""

    def __init__(self, like, lr=0.7, momentum=0.9):
        self.lr, self.mu, self.v = lr, momentum, torch.zeros_like(like)

    def step(self, synced, average_delta):
        g = -average_delta
        self.v.mul_(self.mu).add_(g)
        return synced - self.lr * (g + self.mu * self.v)
