"""Asynchronous tensor parallelism: the sequence-parallel all-gather and reduce-scatter hidden
behind the matmuls they feed, by cutting each matmul into one piece per rank.

Under sequence parallelism (`lectures/tensor_parallel/ops.py`) a column-parallel layer all-gathers its input
along the sequence and only then multiplies; a row-parallel layer multiplies and only then
reduce-scatters. The matmul waits for the collective, or the collective for the matmul.
Wang et al. 2022 ("Overlap Communication with Dependent Computation via Decomposition in Large
Deep Learning Models", ASPLOS 2023, https://doi.org/10.1145/3567955.3567959) decompose each pair
into t steps on a ring of t ranks: at each step a rank multiplies the sequence chunk it holds
while the next chunk (or a partial sum) travels to its neighbour, point to point. The bytes are
those of a ring all-gather / reduce-scatter, (t−1)/t of the tensor per rank, in t−1 transfers;
the matmul is the same, in t pieces of s/t positions. PyTorch's version of the same idea is
`torch.ops.symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter`, which the compiler
substitutes under `torch._inductor.config._micro_pipeline_tp` (CUDA only; lecture 04 says more).

Weights are in `nn.Linear`'s layout (out, in): a layer computes x·weightᵀ. Activations are
(batch, seq, hidden) with the sequence at `tp_ops.SEQ_DIM`. Inside `tp_ops.traced()` every
partial matmul and transfer records a span; inside `counting()` every send is counted.
"""
import contextlib
import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lectures.tensor_parallel import ops as tp_ops
from lectures.tensor_parallel.ops import (SEQ_DIM, _check_divisible, _check_same_shard, _collective, _size_rank,
                                          all_gather_sequence, copy_to_region, reduce_scatter_sequence)
from util import span_at


@dataclasses.dataclass
class Traffic:
    """What this rank's decomposed ops did: point-to-point sends, their bytes, and the rows
    (batch × positions) of each partial matmul."""
    sends: int = 0
    bytes: int = 0
    matmul_rows: list = dataclasses.field(default_factory=list)
    events: list = dataclasses.field(default_factory=list)   # "post", "matmul", "wait", in order


_traffic = None   # a Traffic while counting()
_overlap = True   # False inside without_overlap()


@contextlib.contextmanager
def counting():
    """Count this rank's sends and partial matmuls inside the block; yields the Traffic."""
    global _traffic
    previous, _traffic = _traffic, Traffic()
    try:
        yield _traffic
    finally:
        _traffic = previous


@contextlib.contextmanager
def without_overlap():
    """Inside the block every ring transfer is waited for as soon as it is posted: the same
    sends, bytes and partial matmuls, with nothing beside the transfers. A measurement's
    control: it separates what the overlap wins from what the ring's point-to-point sends
    win or lose against the plain collectives."""
    global _overlap
    previous, _overlap = _overlap, False
    try:
        yield
    finally:
        _overlap = previous


def _check_no_autograd(x, weight, what):
    """The bare rings are forward only: autograd would see the received chunks as constants and
    drop the other ranks' terms from the gradients, silently. Training goes through
    AllGatherMatmul / MatmulReduceScatter (column_parallel / row_parallel), whose forward calls
    the ring with gradients off."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        raise RuntimeError(f"{what} is the forward ring only and has no backward; to train, use "
                           "column_parallel/row_parallel (AllGatherMatmul/MatmulReduceScatter), "
                           "or call it under torch.no_grad()")


def _check(x, weight, what):
    if x.dim() != 3:
        raise ValueError(f"{what}: activations are (batch, seq, hidden), split along dim {SEQ_DIM}; "
                         f"got a {x.dim()}-D tensor of shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"{what}: a weight of shape {tuple(weight.shape)} (nn.Linear's (out, in)) "
                         f"cannot multiply inputs with {x.shape[-1]} features")
    if weight.dtype != x.dtype:   # refused before the ring starts, not halfway through it
        raise ValueError(f"{what}: input is {x.dtype} but the weight is {weight.dtype}")


def _count_partial(x):
    if _traffic is not None:
        _traffic.matmul_rows.append(x.shape[0] * x.shape[1])
        _traffic.events.append("matmul")


def _partial_matmul(x, weight):
    """One of the t pieces: this chunk of positions times the weight."""
    _count_partial(x)
    with _collective("partial matmul"):
        return F.linear(x, weight)


class _RingStep:
    """Send one tensor to the next rank of the ring and receive one from the previous, async.
    The two go in one batch_isend_irecv: NCCL must see them together (with 2 ranks the next and
    the previous rank are the same one), and the receive is posted first so that gloo can land
    the bytes straight in their buffer."""

    def __init__(self, send, recv, group, t, r):
        send = send.contiguous()
        self.send, self.recv = send, recv            # kept alive until the transfer is done
        prev, nxt = dist.get_global_rank(group, (r - 1) % t), dist.get_global_rank(group, (r + 1) % t)
        posting = time.perf_counter()
        self.works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, prev, group),
                                             dist.P2POp(dist.isend, send, nxt, group)])
        self.start = time.perf_counter()   # posting can take the rank's time too: its own span
        if tp_ops._trace:
            span_at("posting a transfer", posting, self.start)
        if _traffic is not None:
            _traffic.sends += 1
            _traffic.bytes += send.numel() * send.element_size()
            _traffic.events.append("post")
        if not _overlap:
            self._finish()

    def _finish(self):
        # a gloo point-to-point Work must be waited for once: a second wait() on a receive
        # waits for another message and times out
        if self.works and _traffic is not None:
            _traffic.events.append("wait")
        for work in self.works:
            work.wait()
        self.works = []

    def wait(self):
        waited = time.perf_counter()
        self._finish()
        if tp_ops._trace:   # gloo's point-to-point work has no completion callback: "done" is when wait() returned
            end = time.perf_counter()
            span_at("transfer (posted → done)", self.start, end)
            span_at("waiting for the transfer", waited, end)
        return self.recv


def ring_all_gather(x_shard, group, each):
    """Pass every rank's shard around the ring of `group`: `each(owner, chunk)` runs on every
    chunk, this rank's own first, while the next chunk travels (rank r−k's at step k)."""
    t, r = _size_rank(group)
    _check_same_shard(x_shard, group, "ring_all_gather")
    held = x_shard.contiguous()
    for k in range(t):
        step = _RingStep(held, torch.empty_like(held), group, t, r) if k < t - 1 else None
        each((r - k) % t, held)                      # while the next chunk travels
        if step is not None:
            held = step.wait()


def all_gather_matmul(x_shard, weight, group, return_gathered=False):
    """all_gather(x_shard along the sequence) · weightᵀ, as t partial matmuls: at step k this
    rank multiplies the chunk of rank r−k while passing it on to r+1 and receiving r−k−1's.
    With `return_gathered`, also the gathered input."""
    _check(x_shard, weight, "all_gather_matmul")
    _check_no_autograd(x_shard, weight, "all_gather_matmul")
    t, _ = _size_rank(group)
    chunks, outs = [None] * t, [None] * t

    def multiply(owner, chunk):
        chunks[owner], outs[owner] = chunk, _partial_matmul(chunk, weight)

    ring_all_gather(x_shard, group, multiply)
    y = torch.cat(outs, SEQ_DIM)
    return (y, torch.cat(chunks, SEQ_DIM)) if return_gathered else y


def all_gather_weight_grad(grad, x_shard, group):
    """dYᵀ·all_gather(x_shard), the weight gradient of a column-parallel layer that kept only
    its slice of the input: the slices travel around the ring again, and each one's share
    dY[chunk]ᵀ·X[chunk] is added while the next travels. The same bytes as the forward's
    all-gather, and no full-sequence input held from forward to backward."""
    t, _ = _size_rank(group)
    pieces = grad.chunk(t, SEQ_DIM)
    total = grad.new_zeros(grad.shape[-1], x_shard.shape[-1])

    def add(owner, chunk):
        _count_partial(chunk)
        with _collective("partial weight gradient"):
            total.addmm_(pieces[owner].flatten(0, 1).t(), chunk.flatten(0, 1))

    ring_all_gather(x_shard, group, add)
    return total


def matmul_reduce_scatter(x, weight, group):
    """reduce_scatter(x · weightᵀ along the sequence), as t partial matmuls: at step k this rank
    computes its term of chunk r−k−1, adds the running sum that arrived from r−1, and sends it
    on to r+1 while the next term is computed. After t steps it holds the sum of chunk r."""
    _check(x, weight, "matmul_reduce_scatter")
    _check_no_autograd(x, weight, "matmul_reduce_scatter")
    t, r = _size_rank(group)
    _check_divisible(x, SEQ_DIM, t, "matmul_reduce_scatter")
    # what travels is a partial sum (b, s/t, out): its shape must agree on every rank, weight included
    _check_same_shard(x.new_empty(1).expand(*x.shape[:-1], weight.shape[0]), group, "matmul_reduce_scatter")
    pieces, step = x.chunk(t, SEQ_DIM), None
    for k in range(t):
        partial = _partial_matmul(pieces[(r - k - 1) % t], weight)   # while the last sum travels
        if step is not None:
            partial = partial + step.wait()
        if k < t - 1:
            step = _RingStep(partial, torch.empty_like(partial), group, t, r)
    return partial


class AllGatherMatmul(torch.autograd.Function):
    """Column-parallel layer under SP, decomposed. Forward: all_gather_matmul; only this rank's
    slice of the input is kept for backward, as the plain `ColumnParallelLinear` keeps it (and
    Megatron-LM), so async TP keeps sequence parallelism's activation saving. Backward: the input
    gradient dY·W is a decomposed matmul_reduce_scatter; the weight gradient dYᵀ·X re-gathers
    the input in a second ring, each chunk's share computed while the next travels; the bias
    gradient sums dY."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        y = all_gather_matmul(x_shard, weight, group)
        ctx.save_for_backward(x_shard, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = matmul_reduce_scatter(grad, weight.t(), ctx.group) if ctx.needs_input_grad[0] else None
        with _collective("weight gradient"):
            grad_w = all_gather_weight_grad(grad, x_shard, ctx.group)
            grad_b = grad.sum((0, 1)) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class MatmulReduceScatter(torch.autograd.Function):
    """Row-parallel layer under SP, decomposed (no bias: it is added after the sum). Forward:
    matmul_reduce_scatter. Backward: the input gradient dY·W needs the whole sequence of dY, so it
    is a decomposed all_gather_matmul of dY; the weight gradient dYᵀ·X uses the gathered dY."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return matmul_reduce_scatter(x, weight, group)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x, grad_full = all_gather_matmul(grad, weight.t(), ctx.group, return_gathered=True)
        with _collective("weight gradient"):
            grad_w = grad_full.flatten(0, 1).t() @ x.flatten(0, 1)
        return grad_x, grad_w, None


def column_parallel(x_shard, weight, bias, group, decomposed=True):
    """A column-parallel layer under SP: x_shard (b, s/t, in) -> (b, s, out/t)."""
    if decomposed:
        return AllGatherMatmul.apply(x_shard, weight, bias, group)
    _check(x_shard, weight, "column_parallel")
    full = all_gather_sequence(x_shard, group)            # blocks: the matmul needs all of it
    with _collective("matmul"):
        return F.linear(full, weight, bias)


def row_parallel(x, weight, bias, group, decomposed=True):
    """A row-parallel layer under SP: x (b, s, in/t) -> (b, s/t, out). The replicated bias is added
    once, to this rank's positions, so its gradient is partial: f (copy_to_region) all-reduces it."""
    _check(x, weight, "row_parallel")
    if decomposed:
        y = MatmulReduceScatter.apply(x, weight, group)
    else:
        with _collective("matmul"):
            partial = F.linear(x, weight)
        y = reduce_scatter_sequence(partial, group)       # blocks: the next layer needs the sum
    return y if bias is None else y + copy_to_region(bias, group)


class SequenceParallelMLP(nn.Module):
    """fc_in column-parallel, GELU, fc_out row-parallel, with sequence parallelism on both sides:
    (b, s/t, h) in, (b, s/t, h) out. `decomposed` picks the ring (async TP) or the plain
    all-gather + matmul / matmul + reduce-scatter; the two compute the same thing."""

    def __init__(self, fc_in, fc_out, group, decomposed=True):
        super().__init__()
        t, _ = _size_rank(group)
        if fc_in.out_features % t:
            raise ValueError(f"SequenceParallelMLP: {fc_in.out_features} hidden features do not split over {t} ranks")
        self.group, self.decomposed = group, decomposed
        take = lambda p, dim: nn.Parameter(tp_ops._split(p.detach(), dim, group).clone())
        self.w_in, self.w_out = take(fc_in.weight, 0), take(fc_out.weight, 1)
        self.b_in = take(fc_in.bias, 0) if fc_in.bias is not None else None
        self.b_out = nn.Parameter(fc_out.bias.detach().clone()) if fc_out.bias is not None else None

    def forward(self, x_shard):
        h = column_parallel(x_shard, self.w_in, self.b_in, self.group, self.decomposed)
        return row_parallel(F.gelu(h), self.w_out, self.b_out, self.group, self.decomposed)
