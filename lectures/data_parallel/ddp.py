"""DDP from scratch: the gradient-synchronisation building blocks of lecture 03, in their own
module (the lecture shows their code with see()).

- `Collectives`: the collectives every implementation calls, counting the bytes a ring would send.
- `broadcast_parameters`: start equal.
- `AllReduceAfterBackward`, `OverlappedAllReduce`, `BucketedAllReduce` (with `plan_buckets`):
  three ways to average gradients, checked against one process in tests/test_lecture_03.py.
"""
import time

import torch
import torch.distributed as dist

from lectures.data_parallel.collectives import binomial_broadcast_sends
from util import span_at


# =========================================================================================
# 2. Collectives that count what they send
# =========================================================================================

class Collectives:
    """The collectives this lecture uses, counting the bytes this rank sends when each runs as
    a ring (NCCL's algorithm for large messages): all-reduce 2(N-1)/N of the tensor, reduce-scatter
    and all-gather (N-1)/N of the full tensor (`sent`). `sent_by_gloo` counts what gloo's own
    algorithms send instead: its reduce-scatter is a full all-reduce of the input followed by a
    copy of this rank's chunk (2(N-1)/N, twice the ring's), and its broadcast is a binomial tree
    (the root sends the whole tensor ⌈log₂N⌉ times, other ranks as many times as they have
    partners in the tree: `binomial_broadcast_sends`). With `trace`, async operations record when they
    were launched and when they completed, for timelines."""

    def __init__(self, world_size, trace=False):
        self.n, self.sent, self.calls, self.trace, self.events = world_size, 0, 0, trace, []
        self.sent_by_gloo = 0

    def _async(self, work, label, nbytes):
        self.calls += 1
        if self.trace and work is not None:
            start = time.perf_counter()
            work.get_future().then(lambda _: self.events.append((label, start, time.perf_counter())))
        return work

    def broadcast(self, t, src=0):
        root = dist.get_rank() == src and self.n > 1
        self.sent += t.numel() * t.element_size() if root else 0
        self.sent_by_gloo += binomial_broadcast_sends(dist.get_rank(), self.n, src) * t.numel() * t.element_size()
        self.calls += 1
        dist.broadcast(t, src)

    def all_reduce(self, t, async_op=False, label="all-reduce"):
        nbytes = t.numel() * t.element_size()
        self.sent += 2 * (self.n - 1) * nbytes // self.n
        self.sent_by_gloo += 2 * (self.n - 1) * nbytes // self.n
        return self._async(dist.all_reduce(t, async_op=async_op), label, nbytes)

    def reduce_scatter(self, out, full, async_op=False, label="reduce-scatter"):
        nbytes = full.numel() * full.element_size()
        self.sent += (self.n - 1) * nbytes // self.n
        self.sent_by_gloo += 2 * (self.n - 1) * nbytes // self.n     # an all-reduce, then a copy
        return self._async(dist.reduce_scatter_single(out, full, async_op=async_op), label, nbytes)

    def all_gather(self, full, shard, async_op=False, label="all-gather"):
        nbytes = full.numel() * full.element_size()
        self.sent += (self.n - 1) * nbytes // self.n
        self.sent_by_gloo += (self.n - 1) * nbytes // self.n
        return self._async(dist.all_gather_single(full, shard, async_op=async_op), label, nbytes)

    def record_spans(self):
        """Hand the async operations' measured lifetimes to the page's timeline."""
        for label, start, end in self.events:
            span_at(label, start, end)
        self.events.clear()


# =========================================================================================
# 3. DDP from scratch: broadcast once, all-reduce gradients every step
# =========================================================================================

def broadcast_parameters(model, comm):
    """Replicas must start equal: everyone takes rank 0's initial weights."""
    for p in model.parameters():
        comm.broadcast(p.data, src=0)


class AllReduceAfterBackward:
    """The naive gradient sync: wait for the whole backward, then one all-reduce per parameter.

    A parameter may get no gradient (a frozen embedding, a branch this batch did not take), and
    on some ranks only. Every rank must still issue the same all-reduces, so the ranks first
    agree, with one small all-reduce of flags, on which parameters got a gradient *anywhere*:
    those are all-reduced (a rank without one contributes zeros, which is its true gradient),
    the others keep `grad = None`, exactly as in one process (the optimizer skips them)."""

    def __init__(self, model, comm):
        self.params, self.comm, self.sync = list(model.parameters()), comm, True

    def finish(self):
        has = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32)
        dist.all_reduce(has)                       # bookkeeping: not counted as gradient traffic
        for p, anywhere in zip(self.params, has.tolist()):
            if not anywhere:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.comm.all_reduce(p.grad)
            p.grad.div_(self.comm.n)   # sum of per-rank mean gradients / N = mean over the batch


class OverlappedAllReduce:
    """Start each parameter's all-reduce the moment autograd has finished its gradient, while
    backward keeps computing the earlier layers; wait for all of them before the optimizer."""

    def __init__(self, model, comm):
        self.comm, self.sync, self.pending = comm, True, []
        self.count = len(list(model.parameters()))
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        if self.sync:                  # False on the micro-batches where we only accumulate
            p.grad.div_(self.comm.n)
            self.pending.append(self.comm.all_reduce(p.grad, async_op=True, label="all-reduce (async)"))

    def finish(self):
        for work in self.pending:
            work.wait()
        launched, self.pending = len(self.pending), []
        if launched != self.count:     # ranks may now disagree on which collectives ran
            raise RuntimeError(f"{self.count - launched} of {self.count} parameters got no gradient "
                               "in this backward, so their all-reduces never started; use "
                               "AllReduceAfterBackward (agrees on them first) or give every "
                               "parameter a gradient (PyTorch DDP: find_unused_parameters=True)")


def plan_buckets(params, bucket_mb):
    """Group parameters into buckets in the order backward produces their gradients (reverse
    of definition): a bucket closes as soon as it holds at least `bucket_mb` MB. A tensor is
    never split, so a tensor bigger than the limit is a bucket of its own, and a limit smaller
    than every tensor gives one bucket per parameter."""
    limit = bucket_mb * 2 ** 20
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class BucketedAllReduce:
    """Many small all-reduces pay the per-message latency many times. Pack gradients, in the
    order backward produces them (last layer first), into buckets of about `bucket_mb`, and
    all-reduce a bucket as soon as all its gradients are in. Buckets launch in order, so every
    rank issues the same collectives in the same order."""

    def __init__(self, model, comm, bucket_mb=1.0):
        self.comm, self.sync = comm, True
        self.buckets = plan_buckets(list(model.parameters()), bucket_mb)
        self.where = {}               # parameter -> (bucket index, offset in its flat buffer)
        self.flat = []
        for b, params in enumerate(self.buckets):
            offset = 0
            for p in params:
                self.where[p] = (b, offset)
                offset += p.numel()
            self.flat.append(torch.zeros(offset, dtype=params[0].dtype, device=params[0].device))
        self.ready = [0] * len(self.buckets)
        self.next, self.pending = 0, []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        if not self.sync:
            return
        b, offset = self.where[p]
        self.flat[b][offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        self.ready[b] += 1
        while self.next < len(self.buckets) and self.ready[self.next] == len(self.buckets[self.next]):
            flat = self.flat[self.next].div_(self.comm.n)
            self.pending.append(self.comm.all_reduce(flat, async_op=True, label="bucket all-reduce"))
            self.next += 1

    def finish(self):
        if self.next != len(self.buckets):
            raise RuntimeError("some parameters received no gradient: their bucket never launched")
        for work in self.pending:
            work.wait()
        for params, flat in zip(self.buckets, self.flat):
            offset = 0
            for p in params:      # the averaged bucket *becomes* the gradient: no copy back
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
        self.next = 0


GRAD_SYNCS = {"naive": AllReduceAfterBackward, "overlapped": OverlappedAllReduce,
              "bucketed": BucketedAllReduce}


def make_grad_sync(kind, model, comm, bucket_mb):
    if kind == "bucketed":
        return BucketedAllReduce(model, comm, bucket_mb)
    return GRAD_SYNCS[kind](model, comm)
