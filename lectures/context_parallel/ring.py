"""Ring attention (Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"): every rank keeps its slice of the sequence, and the K/V blocks travel
around the ring of ranks while each rank attends to the block it holds.

Forward: at step t rank r attends to the K/V block of rank r−t while sending it on to r+1 and
receiving r−t−1's; the partials merge by log-sum-exp (`lectures/context_parallel/blocks.py`). Backward
(FlashAttention-2's block backward, Dao 2023): the K/V blocks go around once more, and each
block's dK/dV accumulator travels with it, one hop behind, back to its owner. Autograd never sees
the communication: the backward is written out.

`tracing()` records when each block computed and each transfer was posted, completed and waited
for, so a lecture can draw the overlap on a timeline.
"""
import contextlib
import math
import time

import torch
import torch.distributed as dist

from lectures.data_parallel.overlap import release_core
from lectures.context_parallel.blocks import (SegmentAttention, acc_dtype, attention_signature, check_qkv, expand_kv,
                                              fold_kv, segments_backward, segments_forward, visible_entries)
from lectures.context_parallel.sharding import agreed_lengths, group_info, layout_segments

TRACE = None  # a list while `tracing()` is on: (label, start, end, work) of ring compute and transfers
RELEASED = {"wait": 0.0, "overlap": True}   # set by `released()`: a measurement's stand-in and control


@contextlib.contextmanager
def tracing():
    """Record the ring's compute blocks, transfers and waits inside the block; yields the list."""
    global TRACE
    TRACE = []
    try:
        yield TRACE
    finally:
        TRACE = None


@contextlib.contextmanager
def released(block_wait=0.0, overlap=True):
    """For measuring what the overlap buys (lecture 06): inside the block each block's compute in
    the forward is followed by a timed wait of `block_wait` s that releases the core
    (`lectures.data_parallel.release_core`), and with `overlap=False` each K/V transfer is waited
    for as soon as it is posted (the same bytes, with nothing beside them)."""
    previous = dict(RELEASED)
    RELEASED.update(wait=block_wait, overlap=overlap)
    try:
        yield
    finally:
        RELEASED.update(previous)


def _trace(label, start, end, work=0):
    if TRACE is not None:
        TRACE.append((label, start, end, work))


def ring_source(rank, step, world_size):
    """Whose K/V block `rank` holds at `step` of the ring: its own at step 0, then r−1's, r−2's, …
    (each step every rank passes what it holds to r+1). The schedule the forward and backward follow."""
    return (rank - step) % world_size


def _global(group, r):
    return dist.get_global_rank(group, r) if group is not dist.group.WORLD else r


class RingTransfer:
    """Send one tensor to the next rank and receive one of `shape` from the previous, async."""

    def __init__(self, send, recv_shape, group, n, r, tag, label):
        self.buf = torch.empty(recv_shape, dtype=send.dtype, device=send.device)
        self.send = send.contiguous()            # kept alive until the send completes
        # One batch: NCCL must see the send and the receive together (two ranks sending to each
        # other with separate calls would each wait for a receive queued behind its own send).
        self.ops = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, self.send, _global(group, (r + 1) % n), group=group, tag=tag),
            dist.P2POp(dist.irecv, self.buf, _global(group, (r - 1) % n), group=group, tag=tag)])
        self.label, self.start = label, time.perf_counter()

    def wait(self):
        waiting = time.perf_counter()
        for op in self.ops:
            op.wait()
        end = time.perf_counter()
        _trace(self.label, self.start, end)        # posted -> seen complete (at the latest)
        _trace("waiting", waiting, end)            # the part not hidden under compute
        return self.buf


class RingAttention(torch.autograd.Function):
    """Forward: at step t rank r attends to the K/V block of rank r−t while sending it on to r+1
    and receiving r−t−1's; partials merged by log-sum-exp. Backward: the K/V blocks go around
    again, and each block's dK/dV accumulator travels with it, one hop behind, back to its owner."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group, layout):
        group, n, r = group_info(group)
        acc = acc_dtype(q.dtype)
        q_, k_, v_ = (t.detach().to(acc) for t in (q, k, v))
        scale = 1.0 / math.sqrt(q.shape[-1])
        # One all_gather: every rank's length, and the ranks' agreement on shapes, dtype, mask, layout
        lengths = agreed_lengths(q.shape[2], attention_signature(q, k, causal, layout), group, n, q.device)
        segs = layout_segments(lengths, layout)
        b, h, _, d = q.shape
        hk, groups = k.shape[1], h // k.shape[1]          # grouped-query attention: hk K/V heads travel
        out = torch.zeros_like(q_)
        lse = torch.full(q_.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.cat([k_, v_], dim=-1)
        work = []
        for step in range(n):
            src = ring_source(r, step, n)
            nxt = RingTransfer(kv, (b, hk, lengths[(r - step - 1) % n], 2 * d), group, n, r, 0,
                            "K/V transfer") if step < n - 1 else None
            arrived = nxt.wait() if nxt is not None and not RELEASED["overlap"] else None
            start, before = time.perf_counter(), len(work)
            kv_h = expand_kv(kv, groups)                    # repeated after the transfer, not before
            segments_forward(q_, kv_h[..., :d], kv_h[..., d:], segs[r], segs[src], causal, scale, out, lse, work)
            release_core(RELEASED["wait"])
            _trace("block compute", start, time.perf_counter(), sum(work[before:]))
            if nxt is not None:
                kv = nxt.wait() if arrived is None else arrived
        ctx.save_for_backward(q_, k_, v_, out, lse)
        ctx.meta = (causal, group, n, r, lengths, segs, scale, q.dtype, groups)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, group, n, r, lengths, segs, scale, dtype, groups = ctx.meta
        dout = dout.to(q.dtype).contiguous()
        delta = (dout * out).sum(-1)    # D = rowsum(dO ∘ O): computed at the start of backward, not saved
        b, h, _, d = q.shape
        hk = k.shape[1]
        dq = torch.zeros_like(q)
        kv = torch.cat([k, v], dim=-1)
        grad_in = None            # the dK/dV accumulator of the block we hold, arriving from r−1
        for step in range(n):
            src = ring_source(r, step, n)
            nxt = RingTransfer(kv, (b, hk, lengths[(r - step - 1) % n], 2 * d), group, n, r, 0,
                            "K/V transfer") if step < n - 1 else None
            start = time.perf_counter()
            dkv_h = torch.zeros(b, h, lengths[src], 2 * d, dtype=q.dtype, device=q.device)
            work = sum(visible_entries(qs, ks, causal) for qs in segs[r] for ks in segs[src])
            kv_h = expand_kv(kv, groups)
            segments_backward(q, kv_h[..., :d], kv_h[..., d:], dout, out, lse, delta, segs[r], segs[src], causal,
                              scale, dq, dkv_h[..., :d], dkv_h[..., d:])
            dkv = fold_kv(dkv_h, groups)                    # summed over the query heads before it travels
            _trace("block compute (backward)", start, time.perf_counter(), work)
            if grad_in is not None:
                dkv += grad_in.wait()
            # Pass the accumulator on; after n hops it is back with the block's owner.
            grad_in = RingTransfer(dkv, (b, hk, lengths[(r - step - 1) % n], 2 * d), group, n, r, 1,
                                "dK/dV transfer")
            if nxt is not None:
                kv = nxt.wait()
        dkv = grad_in.wait()
        return dq.to(dtype), dkv[..., :d].to(dtype), dkv[..., d:].to(dtype), None, None, None


def ring_attention(q, k, v, causal=False, group=None, layout="contiguous"):
    """Attention over the whole sequence from local shards (batch, heads, local_seq, head_dim)
    held in `layout` ('contiguous' or 'zigzag') across `group`; returns the local output shard.
    A drop-in for lecture 01's `CausalSelfAttention.attend` with causal=True. K/V may have fewer
    heads than q (grouped-query attention): they travel with their own heads. On a group of one
    rank it is plain attention (a ring of one has nobody to send to)."""
    check_qkv(q, k, v)
    _, n, _ = group_info(group)
    if n == 1:
        segs = layout_segments([q.shape[2]], layout)[0]
        return SegmentAttention.apply(q, k, v, segs, segs, causal)
    return RingAttention.apply(q, k, v, causal, group, layout)
