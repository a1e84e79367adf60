"""Context parallelism and expert parallelism: split the sequence, split the experts

Long sequences: every rank holds a slice of the sequence for the whole model, and only attention
needs the other ranks' keys and values — passed around a ring (ring attention), gathered at once,
or swapped for a split of the heads (DeepSpeed-Ulysses). Mixtures of experts: a router sends each
token to a few expert MLPs, and the experts live on different ranks (expert parallelism), with
tokens dispatched and combined by all-to-all. Every version is checked against one process.
"""
import functools
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lectures.lecture_01_memory_and_precision import merge_attention as merge_partials
from util import device, figure, note, see, settings, span_at, spawn, table, timeline

# =========================================================================================
# 1. Attention on blocks: partial results and how to merge them
# =========================================================================================
# A rank's slice of the sequence is a list of *segments*: (local start, length, global start).
# Contiguous sharding gives one segment per rank; zig-zag gives two. Causal masking then only
# needs global positions, and a pair of segments is "full" (every key visible to every query),
# "diagonal/partial" (a mask is needed) or "empty" (no key visible: skipped, no FLOPs).
# Partials over disjoint key sets combine with lecture 01's online-softmax merge, `merge_partials`:
# lse = log(e^lse_a + e^lse_b), out = out_a·e^(lse_a−lse) + out_b·e^(lse_b−lse).


def pair_kind(qseg, kseg, causal):
    """'full', 'partial' or 'empty': which keys of segment kseg the queries of qseg may see."""
    (_, qn, q0), (_, kn, k0) = qseg, kseg
    if qn == 0 or kn == 0:
        return "empty"
    if not causal or k0 + kn - 1 <= q0:
        return "full"
    if k0 > q0 + qn - 1:
        return "empty"
    return "partial"


def _causal_mask(qseg, kseg, dev):
    (_, qn, q0), (_, kn, k0) = qseg, kseg
    return (torch.arange(k0, k0 + kn, device=dev)[None, :] <= torch.arange(q0, q0 + qn, device=dev)[:, None])


def _block_forward(q, k, v, scale, mask):
    """softmax(q kᵀ·scale) v on one block, with its log-sum-exp; mask: True = visible."""
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    out = (p @ v) / torch.where(l > 0, l, torch.ones_like(l))
    return out, (m + torch.log(l)).squeeze(-1)


def _block_backward(q, k, v, dout, lse, delta, scale, mask):
    """Gradients of one block given the *final* lse and delta = rowsum(dout·out) (FlashAttention-2's
    backward: P = exp(S − lse), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − delta), dQ = dS K, dK = dSᵀ Q)."""
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, dv


def _seg(t, seg):
    return t[:, :, seg[0]:seg[0] + seg[1]]


FUSED = True  # blocks use PyTorch's fused CPU flash-attention kernel where the mask allows


def _fused(q, qs, ks, kind):
    """Can PyTorch's CPU flash kernel (which returns the lse we need) compute this block? Yes for
    unmasked blocks and for square diagonal ones (its causal mask is top-left aligned)."""
    return FUSED and q.device.type == "cpu" and (kind == "full" or (qs[1] == ks[1] and qs[2] == ks[2]))


def segments_forward(q, k, v, qsegs, ksegs, causal, scale, out=None, lse=None, work=None):
    """Attention of q's segments over k's segments, merged into (out, lse) if given. Skips empty
    pairs; `work` (a list) gets the number of score entries computed per pair."""
    if out is None:
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    for qs in qsegs:
        for ks in ksegs:
            kind = pair_kind(qs, ks, causal)
            if kind == "empty":
                continue
            if _fused(q, qs, ks, kind):
                o_b, l_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    *(_seg(t, sg).contiguous() for t, sg in ((q, qs), (k, ks), (v, ks))), 0.0,
                    kind == "partial", scale=scale)
            else:
                mask = _causal_mask(qs, ks, q.device) if kind == "partial" else None
                o_b, l_b = _block_forward(_seg(q, qs), _seg(k, ks), _seg(v, ks), scale, mask)
            a, n = qs[0], qs[1]
            o, l = merge_partials(out[:, :, a:a + n], lse[:, :, a:a + n], o_b, l_b)
            out[:, :, a:a + n], lse[:, :, a:a + n] = o, l
            if work is not None:
                work.append(qs[1] * ks[1])
    return out, lse


def segments_backward(q, k, v, dout, out, lse, delta, qsegs, ksegs, causal, scale, dq, dk, dv):
    """Add the gradients of q's segments over k's segments into dq, dk, dv (in place)."""
    for qs in qsegs:
        for ks in ksegs:
            kind = pair_kind(qs, ks, causal)
            if kind == "empty":
                continue
            a, n = qs[0], qs[1]
            if _fused(q, qs, ks, kind):    # the kernel recomputes delta from the (final) out
                g_q, g_k, g_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    dout[:, :, a:a + n].contiguous(), *(_seg(t, sg).contiguous() for t, sg in ((q, qs), (k, ks), (v, ks))),
                    out[:, :, a:a + n].contiguous(), lse[:, :, a:a + n].contiguous(), 0.0, kind == "partial", scale=scale)
            else:
                mask = _causal_mask(qs, ks, q.device) if kind == "partial" else None
                g_q, g_k, g_v = _block_backward(_seg(q, qs), _seg(k, ks), _seg(v, ks), dout[:, :, a:a + n],
                                                lse[:, :, a:a + n], delta[:, :, a:a + n], scale, mask)
            dq[:, :, a:a + n] += g_q
            dk[:, :, ks[0]:ks[0] + ks[1]] += g_k
            dv[:, :, ks[0]:ks[0] + ks[1]] += g_v


def _acc_dtype(dtype):
    """Partial results are accumulated in float32 at least (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_qkv(q, k, v):
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError("q, k, v must all be (batch, heads, local_seq, head_dim) with the same shape; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (repeat grouped "
                         "K/V heads before calling, as lecture 01's CausalSelfAttention does)")


class SegmentAttention(torch.autograd.Function):
    """Attention of local queries over keys laid out as segments, with a hand-written backward
    (the same block math as the ring, on one process)."""

    @staticmethod
    def forward(ctx, q, k, v, qsegs, ksegs, causal):
        acc = _acc_dtype(q.dtype)
        q_, k_, v_ = (t.detach().to(acc) for t in (q, k, v))
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, lse = segments_forward(q_, k_, v_, qsegs, ksegs, causal, scale)
        ctx.save_for_backward(q_, k_, v_, out, lse)
        ctx.meta = (qsegs, ksegs, causal, scale, q.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        qsegs, ksegs, causal, scale, dtype = ctx.meta
        dout = dout.to(q.dtype)
        delta = (dout * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        segments_backward(q, k, v, dout, out, lse, delta, qsegs, ksegs, causal, scale, dq, dk, dv)
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None


def full_attention(q, k, v, causal=False):
    """The single-process reference: every query against every key (our block math, one block)."""
    _check_qkv(q, k, v)
    seg = [(0, q.shape[2], 0)]
    return SegmentAttention.apply(q, k, v, seg, seg, causal)


# =========================================================================================
# 2. Sharding the sequence: contiguous chunks and zig-zag
# =========================================================================================

def split_sizes(total, parts):
    """Sizes of torch.tensor_split(range(total), parts): the first total % parts get one more."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _starts(sizes):
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def zigzag_chunks(rank, world_size):
    """The two chunks (of 2n) that rank r holds under zig-zag: r and 2n−1−r (one early, one late)."""
    return rank, 2 * world_size - 1 - rank


def zigzag_shard(x, rank, world_size, dim):
    """This rank's zig-zag slice of the full sequence x along `dim`: chunks r and 2n−1−r of 2n."""
    chunks = torch.tensor_split(x, 2 * world_size, dim=dim)
    a, b = zigzag_chunks(rank, world_size)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def zigzag_unshard(shards, dim):
    """The full sequence from every rank's zig-zag shard (a list, in rank order)."""
    n = len(shards)
    total = sum(s.shape[dim] for s in shards)
    sizes = split_sizes(total, 2 * n)
    chunks = [None] * (2 * n)
    for r, s in enumerate(shards):
        a, b = zigzag_chunks(r, n)
        chunks[a], chunks[b] = torch.split(s, [sizes[a], sizes[b]], dim=dim)
    return torch.cat(chunks, dim=dim)


def contiguous_shard(x, rank, world_size, dim):
    """This rank's contiguous slice along `dim` (torch.tensor_split's sizes)."""
    return torch.tensor_split(x, world_size, dim=dim)[rank]


def shard_sequence(x, rank, world_size, dim, layout="contiguous"):
    """x's slice for `rank` under `layout` ('contiguous' or 'zigzag')."""
    if layout == "zigzag":
        return zigzag_shard(x, rank, world_size, dim)
    if layout == "contiguous":
        return contiguous_shard(x, rank, world_size, dim)
    raise ValueError(f"layout must be 'contiguous' or 'zigzag', not {layout!r}")


def unshard_sequence(shards, dim, layout="contiguous"):
    return zigzag_unshard(shards, dim) if layout == "zigzag" else torch.cat(shards, dim=dim)


def layout_segments(lengths, layout):
    """Every rank's segments [(local start, length, global start), ...] given every rank's local
    length: contiguous ranks follow each other; zig-zag ranks hold chunks r and 2n−1−r of 2n."""
    n = len(lengths)
    if layout == "contiguous":
        return [[(0, l, g)] for l, g in zip(lengths, _starts(lengths))]
    if layout != "zigzag":
        raise ValueError(f"layout must be 'contiguous' or 'zigzag', not {layout!r}")
    total = sum(lengths)
    sizes = split_sizes(total, 2 * n)
    starts = _starts(sizes)
    segs = []
    for r in range(n):
        a, b = zigzag_chunks(r, n)
        if sizes[a] + sizes[b] != lengths[r]:
            raise ValueError(f"zig-zag layout: rank {r} holds {lengths[r]} positions, but chunks {a} and "
                             f"{b} of a {total}-long sequence have {sizes[a]} + {sizes[b]}; shard with "
                             "zigzag_shard")
        segs.append([(0, sizes[a], starts[a]), (sizes[a], sizes[b], starts[b])])
    return segs


def sequence_positions(seq_len, rank, world_size, layout="contiguous"):
    """The global positions of this rank's tokens (for GPT.forward(tokens, positions=...))."""
    return shard_sequence(torch.arange(seq_len), rank, world_size, 0, layout)


def _group_info(group):
    group = group or dist.group.WORLD
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return group, n, r


def _global(group, r):
    return dist.get_global_rank(group, r) if group is not dist.group.WORLD else r


def _gather_lengths(local_len, group, n, dev):
    t = torch.tensor([local_len], dtype=torch.int64, device=dev)
    out = [torch.zeros_like(t) for _ in range(n)]
    dist.all_gather(out, t, group=group)
    return [int(x.item()) for x in out]


# =========================================================================================
# 3. Ring attention: K/V blocks travel around the ring (Liu et al. 2023)
# =========================================================================================

TRACE = None  # set to a list to record (label, start, end) of ring compute and transfers


def _trace(label, start, end, work=0):
    if TRACE is not None:
        TRACE.append((label, start, end, work))


class _Transfer:
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
        group, n, r = _group_info(group)
        acc = _acc_dtype(q.dtype)
        q_, k_, v_ = (t.detach().to(acc) for t in (q, k, v))
        scale = 1.0 / math.sqrt(q.shape[-1])
        lengths = _gather_lengths(q.shape[2], group, n, q.device)
        segs = layout_segments(lengths, layout)
        b, h, _, d = q.shape
        out = torch.zeros_like(q_)
        lse = torch.full(q_.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.cat([k_, v_], dim=-1)
        work = []
        for step in range(n):
            src = (r - step) % n
            nxt = _Transfer(kv, (b, h, lengths[(r - step - 1) % n], 2 * d), group, n, r, 0,
                            "K/V transfer") if step < n - 1 else None
            start, before = time.perf_counter(), len(work)
            segments_forward(q_, kv[..., :d], kv[..., d:], segs[r], segs[src], causal, scale, out, lse, work)
            _trace("block compute", start, time.perf_counter(), sum(work[before:]))
            if nxt is not None:
                kv = nxt.wait()
        ctx.save_for_backward(q_, k_, v_, out, lse)
        ctx.meta = (causal, group, n, r, lengths, segs, scale, q.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, group, n, r, lengths, segs, scale, dtype = ctx.meta
        dout = dout.to(q.dtype).contiguous()
        delta = (dout * out).sum(-1)
        b, h, _, d = q.shape
        dq = torch.zeros_like(q)
        kv = torch.cat([k, v], dim=-1)
        grad_in = None            # the dK/dV accumulator of the block we hold, arriving from r−1
        for step in range(n):
            src = (r - step) % n
            nxt = _Transfer(kv, (b, h, lengths[(r - step - 1) % n], 2 * d), group, n, r, 0,
                            "K/V transfer") if step < n - 1 else None
            start = time.perf_counter()
            dkv = torch.zeros(b, h, lengths[src], 2 * d, dtype=q.dtype, device=q.device)
            work = sum(qs[1] * ks[1] for qs in segs[r] for ks in segs[src] if pair_kind(qs, ks, causal) != "empty")
            segments_backward(q, kv[..., :d], kv[..., d:], dout, out, lse, delta, segs[r], segs[src], causal,
                              scale, dq, dkv[..., :d], dkv[..., d:])
            _trace("block compute (backward)", start, time.perf_counter(), work)
            if grad_in is not None:
                dkv += grad_in.wait()
            # Pass the accumulator on; after n hops it is back with the block's owner.
            grad_in = _Transfer(dkv, (b, h, lengths[(r - step - 1) % n], 2 * d), group, n, r, 1,
                                "dK/dV transfer")
            if nxt is not None:
                kv = nxt.wait()
        dkv = grad_in.wait()
        return dq.to(dtype), dkv[..., :d].to(dtype), dkv[..., d:].to(dtype), None, None, None


def ring_attention(q, k, v, causal=False, group=None, layout="contiguous"):
    """Attention over the whole sequence from local shards (batch, heads, local_seq, head_dim)
    held in `layout` ('contiguous' or 'zigzag') across `group`; returns the local output shard.
    A drop-in for lecture 01's `CausalSelfAttention.attend` with causal=True."""
    _check_qkv(q, k, v)
    return RingAttention.apply(q, k, v, causal, group, layout)


# =========================================================================================
# 4. All-gather attention and Ulysses (all-to-all: sequence shards <-> head shards)
# =========================================================================================

def _all_gather_padded(x, lengths, group, n):
    """All-gather along dim 2 with uneven lengths (gloo gathers equal sizes: pad to the longest)."""
    m = max(lengths)
    pad = F.pad(x, (0, 0, 0, m - x.shape[2])).contiguous()
    parts = [torch.empty_like(pad) for _ in range(n)]
    dist.all_gather(parts, pad, group=group)
    return torch.cat([p[:, :, :l] for p, l in zip(parts, lengths)], dim=2)


class AllGatherAttention(torch.autograd.Function):
    """Forward: gather every rank's K/V (the whole sequence's keys on every rank), attend locally.
    Backward: the full dK/dV computed here are reduce-scattered back to their owners."""

    @staticmethod
    def forward(ctx, q, k, v, causal, group, layout):
        group, n, r = _group_info(group)
        acc = _acc_dtype(q.dtype)
        q_, k_, v_ = (t.detach().to(acc) for t in (q, k, v))
        d = q.shape[-1]
        lengths = _gather_lengths(q.shape[2], group, n, q.device)
        segs = layout_segments(lengths, layout)
        kv = _all_gather_padded(torch.cat([k_, v_], -1), lengths, group, n)
        starts = _starts(lengths)
        ksegs = [(starts[j] + a, l, g) for j in range(n) for a, l, g in segs[j]]
        scale = 1.0 / math.sqrt(d)
        kf, vf = kv[..., :d], kv[..., d:]
        out, lse = segments_forward(q_, kf, vf, segs[r], ksegs, causal, scale)
        ctx.save_for_backward(q_, kf, vf, out, lse)
        ctx.meta = (causal, group, n, r, lengths, segs[r], ksegs, scale, q.dtype)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, group, n, r, lengths, qsegs, ksegs, scale, dtype = ctx.meta
        dout = dout.to(q.dtype)
        delta = (dout * out).sum(-1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        segments_backward(q, k, v, dout, out, lse, delta, qsegs, ksegs, causal, scale, dq, dk, dv)
        m = max(lengths)
        full = torch.cat([F.pad(t, (0, 0, 0, m - t.shape[2]))
                          for t in torch.split(torch.cat([dk, dv], -1), lengths, dim=2)], dim=2)
        mine = torch.empty_like(full[:, :, :m]).contiguous()
        # reduce_scatter_tensor splits dim 0: put the rank blocks first.
        full = full.view(*full.shape[:2], n, m, -1).permute(2, 0, 1, 3, 4).contiguous()
        mine = mine.unsqueeze(0)
        dist.reduce_scatter_tensor(mine, full, group=group)
        mine = mine[0, :, :, :lengths[r]]
        d = q.shape[-1]
        return dq.to(dtype), mine[..., :d].to(dtype), mine[..., d:].to(dtype), None, None, None


def allgather_attention(q, k, v, causal=False, group=None, layout="contiguous"):
    """Like ring_attention, but every rank gathers all K/V first (simpler; the full K/V in memory)."""
    _check_qkv(q, k, v)
    return AllGatherAttention.apply(q, k, v, causal, group, layout)


def _all_to_all(x, out_splits, in_splits, group):
    """all_to_all_single on a flat tensor with uneven splits (element counts)."""
    out = torch.empty(sum(out_splits), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous().view(-1), out_splits, in_splits, group=group)
    return out


class SeqToHeads(torch.autograd.Function):
    """(b, h, s_local, d) sequence shard -> (b, h/n, S, d) head shard, ranks' slices in rank order;
    backward is the inverse all-to-all (heads -> sequence)."""

    @staticmethod
    def forward(ctx, x, lengths, group):
        n = len(lengths)
        ctx.meta = (lengths, group, x.shape)
        return _seq_to_heads(x, lengths, group, n)

    @staticmethod
    def backward(ctx, g):
        lengths, group, shape = ctx.meta
        return _heads_to_seq(g, lengths, group, len(lengths), dist.get_rank(group)), None, None


class HeadsToSeq(torch.autograd.Function):
    """The inverse of SeqToHeads; its backward is SeqToHeads' all-to-all."""

    @staticmethod
    def forward(ctx, x, lengths, group):
        ctx.meta = (lengths, group)
        return _heads_to_seq(x, lengths, group, len(lengths), dist.get_rank(group))

    @staticmethod
    def backward(ctx, g):
        lengths, group = ctx.meta
        return _seq_to_heads(g, lengths, group, len(lengths)), None, None


def _seq_to_heads(x, lengths, group, n):
    b, h, s, d = x.shape
    hn = h // n
    # Heads first: rank j gets heads [j·h/n, (j+1)·h/n) of every one of our s positions.
    send = x.transpose(0, 1).contiguous()                       # (h, b, s, d)
    got = _all_to_all(send, [hn * b * l * d for l in lengths], [hn * b * s * d] * n, group)
    parts = [p.view(hn, b, l, d) for p, l in zip(torch.split(got, [hn * b * l * d for l in lengths]), lengths)]
    return torch.cat(parts, dim=2).transpose(0, 1)              # (b, h/n, S, d)


def _heads_to_seq(y, lengths, group, n, r):
    b, hn, S, d = y.shape
    send = y.transpose(0, 1).contiguous()                       # (h/n, b, S, d)
    pieces = [p.contiguous() for p in torch.split(send, lengths, dim=2)]  # rank j's positions
    s = lengths[r]
    got = _all_to_all(torch.cat([p.view(-1) for p in pieces]), [hn * b * s * d] * n,
                      [hn * b * l * d for l in lengths], group)
    return got.view(n * hn, b, s, d).transpose(0, 1)            # (b, h, s, d)


def ulysses_attention(q, k, v, causal=False, group=None, layout="contiguous"):
    """DeepSpeed-Ulysses (Jacobs et al. 2023): all-to-all from sequence shards to head shards, full
    attention on h/n heads, all-to-all back. Needs heads divisible by the ranks."""
    _check_qkv(q, k, v)
    group, n, r = _group_info(group)
    if q.shape[1] % n:
        raise ValueError(f"Ulysses splits the heads over the ranks: {q.shape[1]} heads cannot be split "
                         f"evenly over {n} ranks (it needs ranks <= heads and heads % ranks == 0)")
    lengths = _gather_lengths(q.shape[2], group, n, q.device)
    segs = layout_segments(lengths, layout)
    starts = _starts(lengths)
    allsegs = [(starts[j] + a, l, g) for j in range(n) for a, l, g in segs[j]]
    qh, kh, vh = (SeqToHeads.apply(t, lengths, group) for t in (q, k, v))
    yh = SegmentAttention.apply(qh, kh, vh, allsegs, allsegs, causal)
    return HeadsToSeq.apply(yh, lengths, group)


ATTENTION = {"ring": ring_attention, "all-gather": allgather_attention, "ulysses": ulysses_attention}


def attention_inputs(seq_len, heads, head_dim=8, batch=2, dtype="float64", seed=0):
    """q, k, v and an upstream gradient for the whole sequence, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq_len, head_dim, generator=g, dtype=getattr(torch, dtype))
            for _ in range(4)]


def reference_attention(q, k, v, dout, causal):
    """PyTorch's scaled_dot_product_attention on the whole sequence, and its gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def attention_shards(rank, world_size, cases, seq_len, heads, head_dim=8, batch=2, dtype="float64"):
    """Run each (variant, layout, causal) in `cases` on this rank's shard; returns the local
    output and the local gradients of q, k, v (to be unsharded and compared with one process)."""
    q, k, v, dout = (t.to(device()) for t in attention_inputs(seq_len, heads, head_dim, batch, dtype))
    results = {}
    for variant, layout, causal in cases:
        ql, kl, vl = (shard_sequence(t, rank, world_size, 2, layout).requires_grad_() for t in (q, k, v))
        out = ATTENTION[variant](ql, kl, vl, causal=causal, layout=layout)
        out.backward(shard_sequence(dout, rank, world_size, 2, layout))
        results[variant, layout, causal] = [t.detach().cpu() for t in (out, ql.grad, kl.grad, vl.grad)]
    return results


# --- PyTorch's own context parallelism, with a CPU shim --------------------------------------

def install_cpu_context_parallel_shim():
    """SHIM (torch 2.13, CPU only): PyTorch's `context_parallel` registers ring handlers for the
    CUDA SDPA kernels only; on CPU, SDPA dispatches to `_scaled_dot_product_flash_attention_for_cpu`
    and fails with "does not have a sharding strategy registered". This registers a handler for
    that op and its backward that calls PyTorch's own `_templated_ring_attention(_backward)`.
    Private names: kept in this one tested function so a torch upgrade breaks here, loudly."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    if fwd in cp.custom_ops:
        return

    def wrap(local, like):                      # a local shard -> DTensor sharded on dim 2
        shape = list(local.shape)
        shape[2] *= like.device_mesh.size()
        meta = TensorMeta(torch.Size(shape), torch.empty(shape, device="meta").stride(), local.dtype)
        return DTensor(local, DTensorSpec(like.device_mesh, like.placements, tensor_meta=meta),
                       requires_grad=False)

    def handler(op, args, kwargs):
        spec = (args[0] if op is fwd else args[1])._spec
        a = [x.to_local() if isinstance(x, DTensor) else x for x in args]
        kw = dict(kwargs)
        group = spec.device_mesh.get_group()
        if op is fwd:
            q, k, v, *rest = a
            dropout_p, causal = (rest + [kw.pop("dropout_p", 0.0), kw.pop("is_causal", False)])[:2] \
                if len(rest) < 2 else rest[:2]
            out, lse = cp._templated_ring_attention(group, 2, fwd, q, k, v, is_causal=causal,
                                                    dropout_p=dropout_p, **kw)
            return wrap(out, spec), wrap(lse, spec)
        g, q, k, v, out, lse, dropout_p, causal = a[:8]
        grads = cp._templated_ring_attention_backward(group, 2, bwd, g, "grad_out", q, k, v, out, lse,
                                                      causal, dropout_p=dropout_p, **kw)
        return tuple(wrap(x, spec) for x in grads[:3])

    cp.custom_ops[fwd] = cp.custom_ops[bwd] = handler


def pytorch_context_parallel_attention(rank, world_size, seq_len, heads, head_dim=8, batch=2,
                                       dtype="float64", causal=True):
    """PyTorch's `context_parallel` around plain F.scaled_dot_product_attention (its head-tail
    layout, i.e. zig-zag, for causal); returns this rank's output and gradients in our zig-zag
    order, to compare with one process exactly as our own variants are."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    if device().type == "cpu":
        install_cpu_context_parallel_shim()
    mesh = init_device_mesh(device().type, (world_size,), mesh_dim_names=("cp",))
    q, k, v, dout = (t.to(device()) for t in attention_inputs(seq_len, heads, head_dim, batch, dtype))
    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
        ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)
        out.backward(dout)
    return [t.detach().cpu() for t in (out, ql.grad, kl.grad, vl.grad)]


def attention_in_subgroups(rank, world_size, seq_len, heads, layout="zigzag"):
    """Ring attention on two independent rings at once (ranks split in halves), as a context-
    parallel group inside a larger job would run; returns the local output and gradients."""
    half = world_size // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world_size)))]
    group, cp_rank = groups[rank // half], rank % half
    q, k, v, dout = attention_inputs(seq_len, heads, seed=rank // half)
    ql, kl, vl = (shard_sequence(t, cp_rank, half, 2, layout).requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, causal=True, group=group, layout=layout)
    out.backward(shard_sequence(dout, cp_rank, half, 2, layout))
    return [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)]


# =========================================================================================
# 5. A context-parallel GPT: lecture 01's model with the attention swapped
# =========================================================================================

def gpt_config(dtype="float32", seq_len=32):
    from lectures.lecture_01_memory_and_precision import GPTConfig
    return GPTConfig(seq_len=seq_len, dtype=dtype)


def context_parallel_gpt(model, group=None, attention="ring", layout="zigzag"):
    """Make every attention layer of `model` attend across the context-parallel `group`: the rest
    of the model is per-token and runs unchanged on this rank's positions."""
    fn = {"ring": functools.partial(ring_attention, layout=layout),
          "all-gather": functools.partial(allgather_attention, layout=layout),
          "ulysses": functools.partial(ulysses_attention, layout=layout)}[attention]
    for block in model.blocks:
        block.attn.attend = functools.partial(fn, causal=True, group=group)
    return model


def cp_gpt_gradients(rank, world_size, attention="ring", layout="zigzag", batch_size=4, dtype="float64"):
    """One forward/backward of lecture 01's GPT with the sequence split over the ranks. Each rank's
    loss is its tokens' share of the mean; gradients are summed over ranks (the parameters are
    replicated, as in data parallelism). Returns the loss, local logits and the summed gradients."""
    from lectures.lecture_01_memory_and_precision import GPT, batch
    cfg = gpt_config(dtype)
    model = context_parallel_gpt(GPT(cfg).to(device()), attention=attention, layout=layout)
    tokens, targets = batch(cfg, batch_size, step=0)
    pos = sequence_positions(cfg.seq_len, rank, world_size, layout).to(device())
    logits = model(tokens.to(device())[:, pos], positions=pos)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.to(device())[:, pos].reshape(-1),
                           reduction="sum") / targets.numel()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = p.grad.cpu()
    return {"loss": total.item(), "logits": logits.detach().cpu(), "positions": pos.cpu(), "grads": grads}


def reference_gpt_gradients(batch_size=4, dtype="float64"):
    from lectures.lecture_01_memory_and_precision import GPT, batch
    cfg = gpt_config(dtype)
    model = GPT(cfg)
    tokens, targets = batch(cfg, batch_size, step=0)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    loss.backward()
    return {"loss": loss.item(), "logits": logits.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()}}


# =========================================================================================
# 6. Mixture of experts: router, top-k gating, capacity, the balance loss
# =========================================================================================

class Expert(nn.Module):
    """One expert: the GPT's MLP (d_model -> d_ff -> d_model, GELU)."""

    def __init__(self, d_model, d_ff):
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x)))


def route(router, x, top_k):
    """Router probabilities (T, E), the top-k experts of every token (T, k) and their gates.
    Top-1 (Switch) gates by the expert's probability, so the router learns through it; top-k > 1
    renormalises the k probabilities to sum to one (GShard's top-2, Mixtral)."""
    probs = torch.softmax(router(x).to(_acc_dtype(x.dtype)), dim=-1).to(x.dtype)  # fp32 at least
    top, idx = probs.topk(top_k, dim=-1)
    gates = top if top_k == 1 else top / top.sum(-1, keepdim=True)
    return probs, idx, gates


def capacity(capacity_factor, tokens, top_k, n_experts):
    """Expert capacity: C = ⌈factor · T · k / E⌉ slots per expert; None = no limit."""
    return tokens * top_k if capacity_factor is None else math.ceil(capacity_factor * tokens * top_k / n_experts)


def slot_counts(idx, n_experts):
    """(k, E): how many tokens chose expert e as their i-th choice."""
    return F.one_hot(idx, n_experts).sum(0) if idx.numel() else \
        torch.zeros(idx.shape[1], n_experts, dtype=torch.int64, device=idx.device)


def positions_in_expert(idx, n_experts, base):
    """The queue position of every (token, choice) at its expert: all first choices before any
    second choice (GShard's priority), tokens in order; `base` (k, E) = slots taken before ours."""
    onehot = F.one_hot(idx, n_experts)                              # (T, k, E)
    before = onehot.cumsum(0) - onehot                              # earlier tokens, same choice
    return (before + base.unsqueeze(0)).gather(2, idx.unsqueeze(-1)).squeeze(-1)  # (T, k)


def balance_loss(probs_sum, first_choice_counts, tokens, n_experts):
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eq. 4): E · Σ_e f_e · P_e, with f_e
    the fraction of tokens whose first choice is e (no gradient) and P_e the mean router
    probability of e. Equals 1 under perfectly uniform routing; GShard's m_e·c_e is the same form."""
    f = first_choice_counts.to(probs_sum.dtype) / tokens
    return n_experts * (f * probs_sum / tokens).sum()


class MoE(nn.Module):
    """A mixture-of-experts MLP: tokens (..., d_model) -> (..., d_model). Each token goes to its
    top-k experts; an expert takes at most C tokens (capacity), the rest of its queue is dropped
    (that choice contributes nothing; the residual connection carries the token). After forward,
    `aux_loss` holds the balance loss and `stats` the routing counts."""

    def __init__(self, d_model, d_ff, n_experts, top_k=1, capacity_factor=1.25):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.d_model, self.n_experts, self.top_k, self.capacity_factor = d_model, n_experts, top_k, capacity_factor
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(n_experts))
        self.aux_loss, self.stats = None, None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T, E = x.shape[0], self.n_experts
        probs, idx, gates = route(self.router, x, self.top_k)
        counts = slot_counts(idx, E)
        base = torch.cat([torch.zeros_like(counts[:1]), counts.cumsum(0)[:-1]])   # earlier choices
        pos = positions_in_expert(idx, E, base)
        cap = capacity(self.capacity_factor, T, self.top_k, E)
        keep = pos < cap
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            t, i = torch.nonzero((idx == e) & keep, as_tuple=True)   # (an idle expert runs on 0 rows:
            out = out.index_add(0, t, gates[t, i].unsqueeze(-1) * expert(x[t]))  # zero, not None, grads)
        self.aux_loss = balance_loss(probs.sum(0), counts[0], T, E)
        self.stats = {"tokens_per_expert": counts.sum(0).tolist(), "kept_per_expert":
                      [int(((idx == e) & keep).sum()) for e in range(E)], "dropped": int((~keep).sum()),
                      "assignments": T * self.top_k, "capacity": cap, "keep": keep.detach()}
        return out.view(shape)


# =========================================================================================
# 7. Expert parallelism: experts on different ranks, tokens dispatched by all-to-all
# =========================================================================================

class AllToAll(torch.autograd.Function):
    """Rows of x go to the ranks in `send` counts; `recv` counts come back. Backward sends the
    gradients home: the same all-to-all with the counts swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.meta = (send, recv, group)
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        send, recv, group = ctx.meta
        return AllToAll.apply(g, recv, send, group), None, None, None


def expert_owners(n_experts, world_size):
    """Rank r owns experts [start_r, start_r + count_r): contiguous, as even as possible."""
    counts = split_sizes(n_experts, world_size)
    return counts, _starts(counts)


class ExpertParallelMoE(nn.Module):
    """The same layer with its experts spread over `group`: every rank keeps the router and its
    own experts, routes its own tokens, and the layer equals `MoE` applied to all ranks' tokens
    together (in rank order) — the same outputs, gradients and dropped tokens.

    Per forward: (1) all-gather the (k, E) choice counts, so every rank knows the global queue
    positions and drops exactly what one process would; (2) all-to-all the per-expert counts of
    the tokens each rank will send (the receivers size their buffers); (3) all-to-all the token
    rows, uneven splits; (4) run the local experts; (5) all-to-all the results back and combine
    them, weighted by the gates. `aux_loss` is this rank's share of the balance loss (the shares
    sum to the whole)."""

    def __init__(self, router, experts, n_experts, top_k, capacity_factor, group):
        super().__init__()
        self.group, self.n_experts, self.top_k, self.capacity_factor = group, n_experts, top_k, capacity_factor
        self.router, self.experts = router, experts
        self.aux_loss, self.stats = None, None

    @classmethod
    def from_full(cls, moe, group=None):
        """This rank's part of `moe`: a copy of the router and of the experts it owns."""
        import copy
        group, n, r = _group_info(group)
        counts, starts = expert_owners(moe.n_experts, n)
        mine = nn.ModuleList(copy.deepcopy(moe.experts[e]) for e in range(starts[r], starts[r] + counts[r]))
        return cls(copy.deepcopy(moe.router), mine, moe.n_experts, moe.top_k, moe.capacity_factor, group)

    def forward(self, x):
        group, n, r = _group_info(self.group)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        E, k = self.n_experts, self.top_k
        owners, first = expert_owners(E, n)
        probs, idx, gates = route(self.router, x, k)
        counts = slot_counts(idx, E)
        every = [torch.empty_like(counts) for _ in range(n)]
        dist.all_gather(every, counts, group=group)                   # (1) everyone's choices
        every = torch.stack(every)                                     # (n, k, E)
        total = int(every[:, 0].sum())
        per_slot = every.sum(0)                                        # (k, E)
        base = torch.cat([torch.zeros_like(per_slot[:1]), per_slot.cumsum(0)[:-1]]) + every[:r].sum(0)
        pos = positions_in_expert(idx, E, base)
        cap = capacity(self.capacity_factor, total, k, E)
        keep = pos < cap
        # Kept (token, choice) pairs ordered by expert, so by destination rank, then by position.
        t, i = torch.nonzero(keep, as_tuple=True)
        e = idx[t, i]
        order = torch.argsort(e * (cap + 1) + pos[t, i], stable=True)
        t, i, e = t[order], i[order], e[order]
        per_expert = torch.bincount(e, minlength=E)                    # rows for each expert
        got = torch.empty(n * len(self.experts), dtype=torch.int64, device=x.device)
        dist.all_to_all_single(got, per_expert, [len(self.experts)] * n, owners, group=group)  # (2)
        got = got.view(n, len(self.experts))
        send = [int(per_expert[a:a + c].sum()) for a, c in zip(first, owners)]
        recv = got.sum(1).tolist()
        rows = AllToAll.apply(x[t], send, recv, group)                 # (3) dispatch
        local = torch.arange(len(self.experts), device=x.device).repeat(n).repeat_interleave(got.view(-1))
        perm = torch.argsort(local, stable=True)                       # (4) group rows by expert
        grouped = rows[perm]
        outs = [expert(part) for expert, part in zip(self.experts, torch.split(grouped, got.sum(0).tolist()))]
        y = torch.cat(outs)[torch.argsort(perm)] if outs else rows
        back = AllToAll.apply(y, recv, send, group)                    # (5) combine
        out = torch.zeros_like(x).index_add(0, t, gates[t, i].unsqueeze(-1) * back)
        self.aux_loss = balance_loss(probs.sum(0), per_slot[0], total, E)
        self.stats = {"tokens_per_expert": per_slot.sum(0).tolist(), "dropped_here": int((~keep).sum()),
                      "dropped": int(sum(max(0, c - cap) for c in per_slot.sum(0).tolist())) if k == 1 else None,
                      "rows_sent": send, "rows_received": recv, "capacity": cap, "keep": keep.detach()}
        return out.view(shape)


def moe_layer(d_model=16, d_ff=24, n_experts=6, top_k=2, capacity_factor=1.0, seed=0, dtype="float64"):
    torch.manual_seed(seed)
    return MoE(d_model, d_ff, n_experts, top_k, capacity_factor).to(getattr(torch, dtype))


def moe_inputs(world_size, tokens_per_rank, d_model, seed=0, dtype="float64"):
    """Every rank's tokens (a list, rank order) and a fixed upstream weight for the loss."""
    g = torch.Generator().manual_seed(100 + seed)
    xs = [torch.randn(n, d_model, generator=g, dtype=getattr(torch, dtype)) for n in tokens_per_rank]
    ws = [torch.randn(n, d_model, generator=g, dtype=getattr(torch, dtype)) for n in tokens_per_rank]
    return xs, ws


AUX_WEIGHT = 0.1


def moe_reference(layer_kw, tokens_per_rank, seed=0):
    """One process, all ranks' tokens together: outputs, gradients, which choices were dropped."""
    moe = moe_layer(**layer_kw)
    xs, ws = moe_inputs(len(tokens_per_rank), tokens_per_rank, moe.d_model, seed)
    x = torch.cat(xs).requires_grad_()
    out = moe(x)
    loss = (out * torch.cat(ws)).sum() + AUX_WEIGHT * moe.aux_loss
    loss.backward()
    return {"out": out.detach(), "x_grad": x.grad, "aux": moe.aux_loss.item(), "keep": moe.stats["keep"],
            "stats": moe.stats, "grads": {n: p.grad for n, p in moe.named_parameters()}}


def expert_parallel_check(rank, world_size, layer_kw, tokens_per_rank, seed=0):
    """The expert-parallel layer on this rank's tokens; returns what moe_reference returns, local."""
    moe = moe_layer(**layer_kw)
    ep = ExpertParallelMoE.from_full(moe).to(device())
    xs, ws = moe_inputs(world_size, tokens_per_rank, moe.d_model, seed)
    x = xs[rank].to(device()).requires_grad_()
    out = ep(x)
    loss = (out * ws[rank].to(device())).sum() + AUX_WEIGHT * ep.aux_loss
    loss.backward()
    aux = ep.aux_loss.detach().clone()
    dist.all_reduce(aux)
    dist.all_reduce(ep.router.weight.grad)               # the router is replicated: sum its gradients
    counts, starts = expert_owners(moe.n_experts, world_size)
    grads = {"router.weight": ep.router.weight.grad.cpu()}
    for j, expert in enumerate(ep.experts):
        for name, p in expert.named_parameters():
            grads[f"experts.{starts[rank] + j}.{name}"] = p.grad.cpu()
    return {"out": out.detach().cpu(), "x_grad": x.grad.cpu(), "aux": aux.item(),
            "keep": ep.stats["keep"].cpu(), "stats": {k: v for k, v in ep.stats.items() if k != "keep"},
            "grads": grads}


# =========================================================================================
# 8. Rank functions for the measurements
# =========================================================================================

def saved_bytes(fn, params=()):
    """Run fn() and return (its result, bytes of the distinct tensors autograd saved for backward),
    measured with a saved-tensors hook: the activation memory a training step holds. Tensors that
    share storage with `params` (weights saved by Linear layers) are not activations: left out."""
    seen, weights = {}, {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def activation_memory(rank, world_size, seq_lens, layout="zigzag", batch_size=2):
    """Bytes a context-parallel GPT step keeps for backward on this rank, for each sequence length.
    One rank = the whole sequence (ring attention on a group of one is plain block attention)."""
    from lectures.lecture_01_memory_and_precision import GPT
    rows = {}
    for S in seq_lens:
        cfg = gpt_config("float32", seq_len=S)
        model = context_parallel_gpt(GPT(cfg).to(device()), layout=layout)
        tokens = torch.randint(cfg.vocab_size, (batch_size, S), generator=torch.Generator().manual_seed(S))
        pos = sequence_positions(S, rank, world_size, layout).to(device())
        _, held = saved_bytes(lambda: model(tokens.to(device())[:, pos], positions=pos), model.parameters())
        rows[S] = held
    return rows


def _inputs(seq_len, heads, head_dim, rank, world_size, layout, dtype="float32", batch=1):
    full = attention_inputs(seq_len, heads, head_dim, batch, dtype)
    return [shard_sequence(t, rank, world_size, 2, layout).to(device()).contiguous() for t in full]


def fwd_bwd(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fn(q, k, v).backward(dout)


def ring_trace(rank, world_size, seq_len, heads, head_dim, layout="contiguous", causal=False, repeats=5):
    """Ring attention forward+backward with its compute blocks, waits and transfers traced: the last
    repetition goes on the timeline; medians over the repetitions are returned, per rank."""
    global TRACE
    q, k, v, dout = _inputs(seq_len, heads, head_dim, rank, world_size, layout)
    fn = functools.partial(ring_attention, causal=causal, layout=layout)
    fwd_bwd(fn, q, k, v, dout)                                       # warm-up
    per = []
    for i in range(repeats):
        dist.barrier()
        TRACE = []
        t0 = time.perf_counter()
        fwd_bwd(fn, q, k, v, dout)
        wall = time.perf_counter() - t0
        events, TRACE = TRACE, None
        total = lambda pred: sum(e - s for label, s, e, _ in events if pred(label))
        per.append({"wall": wall, "compute": total(lambda l: l.startswith("block compute")),
                    "waiting": total(lambda l: l == "waiting"),
                    "work": sum(w for label, _, _, w in events if label.startswith("block compute"))})
    for label, start, end, _ in events:
        span_at(label, start, end)
    med = lambda key: sorted(p[key] for p in per)[len(per) // 2]
    return {key: med(key) for key in per[0]}


def transfer_alone(rank, world_size, seq_len, heads, head_dim):
    """One K/V block sent around the ring with nothing else to do: what the transfers cost alone."""
    from util.measure import measure
    group, n, r = _group_info(None)
    kv = torch.randn(1, heads, seq_len // world_size, 2 * head_dim, device=device())
    t = measure(lambda: _Transfer(kv, kv.shape, group, n, r, 0, "alone").wait(), warmup=2, repeats=9)
    return t


def compare_variants(rank, world_size, seq_len, heads, head_dim, variants, causal=True, repeats=7):
    """For each attention variant on the same shapes: forward+backward time (slowest rank), the bytes
    this rank sent, and the bytes autograd saved for backward on this rank."""
    from util.measure import bytes_sent, measure
    out = {}
    for name in variants:
        layout = "zigzag" if causal and name != "ulysses" else "contiguous"
        q, k, v, dout = _inputs(seq_len, heads, head_dim, rank, world_size, layout)
        fn = functools.partial(ATTENTION[name], causal=causal, layout=layout)
        fwd_bwd(fn, q, k, v, dout)
        dist.barrier()
        with bytes_sent() as sent:
            _, held = saved_bytes(lambda: fn(*(t.detach().requires_grad_() for t in (q, k, v))))
        dist.barrier()
        with bytes_sent() as sent_all:
            fwd_bwd(fn, q, k, v, dout)
        timing = measure(lambda: fwd_bwd(fn, q, k, v, dout), warmup=1, repeats=repeats)
        out[name] = {"time": timing, "held": held, "sent_forward": sent.bytes, "sent": sent_all.bytes,
                     "shard_bytes": q.numel() * q.element_size()}
    return out


def ulysses_refusal(rank, world_size, heads):
    """Ulysses with fewer heads than ranks: the error it gives."""
    q = torch.randn(1, heads, 4, 8, device=device())
    try:
        ulysses_attention(q, q, q)
    except ValueError as e:
        return str(e)
    return None


def pytorch_vs_ours(rank, world_size, seq_len, heads, head_dim, repeats=7):
    """PyTorch's context_parallel (ring, head-tail layout) vs our zig-zag ring, same shapes, float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from util.measure import measure_side_by_side
    if device().type == "cpu":
        install_cpu_context_parallel_shim()
    mesh = init_device_mesh(device().type, (world_size,), mesh_dim_names=("cp",))
    full = [t.to(device()) for t in attention_inputs(seq_len, heads, head_dim, 1, "float32")]
    q, k, v, dout = (t.clone() for t in full)
    mine = [zigzag_shard(t, rank, world_size, 2) for t in full]
    run_theirs = lambda: fwd_bwd(functools.partial(F.scaled_dot_product_attention, is_causal=True), q, k, v, dout)
    run_ours = lambda: fwd_bwd(functools.partial(ring_attention, causal=True, layout="zigzag"), *mine)
    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers={q, k, v, dout}):
        # the two take turns, so drift on a busy machine hits both alike
        t = measure_side_by_side({"theirs": run_theirs, "ours": run_ours}, warmup=2, repeats=repeats)
        ql = q.detach().requires_grad_()
        their_out = F.scaled_dot_product_attention(ql, k, v, is_causal=True).detach()
    our_out = ring_attention(*mine[:3], causal=True, layout="zigzag")
    return {"theirs": t["theirs"], "ours": t["ours"], "same_layout": bool(torch.equal(q, mine[0])),
            "max_diff": (their_out - our_out).abs().max().item()}


def pytorch_cp_demo(rank, world_size, check_len, seq_len, heads, head_dim):
    """Both PyTorch comparisons in one run: equality with one process, then speed against ours."""
    return {"check": pytorch_context_parallel_attention(rank, world_size, check_len, 4),
            "timing": pytorch_vs_ours(rank, world_size, seq_len, heads, head_dim)}


def moe_gpt(cfg, n_experts, top_k, capacity_factor):
    """Lecture 01's GPT with every MLP replaced by a mixture of experts of the same width."""
    from lectures.lecture_01_memory_and_precision import GPT
    model = GPT(cfg)
    torch.manual_seed(cfg.seed)
    for block in model.blocks:
        block.mlp = MoE(cfg.d_model, cfg.ff, n_experts, top_k, capacity_factor).to(cfg.torch_dtype)
    return model


def train_moe_gpt(rank, world_size, aux_weights, steps, n_experts=4, top_k=1, capacity_factor=1.25,
                  batch_size=16, lr=3e-3):
    """Rank r trains its own copy with balance-loss weight aux_weights[r] (independent runs side by
    side, no communication). Returns per-step loss, expert load and dropped fraction."""
    from lectures.lecture_01_memory_and_precision import batch, loss_fn
    cfg = gpt_config("float32")
    model = moe_gpt(cfg, n_experts, top_k, capacity_factor).to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    alpha = aux_weights[rank]
    log = {"loss": [], "aux": [], "max_load": [], "dropped": [], "tokens_per_expert": None}
    for step in range(steps):
        tokens, targets = batch(cfg, batch_size, step)
        loss = loss_fn(model(tokens.to(device())), targets.to(device()))
        moes = [b.mlp for b in model.blocks]
        aux = sum(m.aux_loss for m in moes) / len(moes)
        (loss + alpha * aux).backward()
        opt.step()
        opt.zero_grad()
        counts = torch.tensor([m.stats["tokens_per_expert"] for m in moes], dtype=torch.float64)
        log["loss"].append(loss.item())
        log["aux"].append(aux.item())
        log["max_load"].append((counts.max(1).values / counts.mean(1)).mean().item())
        log["dropped"].append(sum(m.stats["dropped"] for m in moes) / sum(m.stats["assignments"] for m in moes))
        if step == 0:
            log["first_tokens_per_expert"] = [m.stats["tokens_per_expert"] for m in moes]
    log["tokens_per_expert"] = [m.stats["tokens_per_expert"] for m in moes]
    return log


def expert_parallel_traffic(rank, world_size, tokens, d_model, d_ff, n_experts, top_k, capacity_factor,
                            repeats=5):
    """The expert-parallel layer on `tokens` tokens per rank: equality with the one-process layer on
    all ranks' tokens, the bytes this rank sent in one forward+backward, rows sent and received, time."""
    from util.measure import bytes_sent, measure
    kw = dict(d_model=d_model, d_ff=d_ff, n_experts=n_experts, top_k=top_k, capacity_factor=capacity_factor,
              dtype="float32")
    check = expert_parallel_check(rank, world_size, dict(kw, dtype="float64"), [tokens] * world_size)
    moe = moe_layer(**kw)
    ep = ExpertParallelMoE.from_full(moe).to(device())
    xs, ws = moe_inputs(world_size, [tokens] * world_size, d_model, dtype="float32")
    x, w = xs[rank].to(device()), ws[rank].to(device())

    def step():
        xx = x.detach().requires_grad_()
        ((ep(xx) * w).sum() + AUX_WEIGHT * ep.aux_loss).backward()
    step()
    dist.barrier()
    with bytes_sent() as sent:
        step()
    stats = {k: v for k, v in ep.stats.items() if k != "keep"}
    t = measure(step, warmup=1, repeats=repeats)
    return {"check": check, "sent": sent.bytes, "stats": stats, "time": t}


# =========================================================================================
# The lecture
# =========================================================================================

def attention_sizes():
    """Shapes for the timings: (sequence, heads, head dim)."""
    return (512, 4, 32) if settings.quick else (1024, 4, 32)


def intro():
    note("""
        # Context parallelism and expert parallelism
        Two ways to split a transformer that the earlier lectures did not cover. **Context
        parallelism** (CP) splits the *sequence*: every rank holds all the weights and a slice of
        the tokens, for the whole model, so activation memory per rank falls as 1/n and sequences
        longer than one device's memory become trainable. **Expert parallelism** (EP) splits a
        mixture-of-experts layer's experts across ranks and moves the tokens to them.

        Both are built here from `send`/`recv` and `all_to_all_single`, as `torch.autograd.Function`s
        with hand-written backward passes, and every one is compared with one process: the same
        outputs and the same gradients. The model is lecture 01's GPT.
    """)


def what_needs_other_ranks():
    from lectures.lecture_01_memory_and_precision import GPT
    note("""
        ## Only attention needs the other ranks
        Split a sequence of s tokens over n ranks. Embeddings, LayerNorms, the MLPs, the LM head
        and the loss act on each token by itself: rank r computes them for its tokens alone, with
        its copy of the weights (each token embeds at its *global* position, which lecture 01's
        `GPT.embed(tokens, positions)` allows). Attention is the exception: a query at position i
        needs the keys and values of every position j ≤ i, and most of those live on other ranks.
        So context parallelism replaces one function, `CausalSelfAttention.attend`, and the
        weights' gradients are summed over the ranks, as in data parallelism.
    """)
    see(context_parallel_gpt)
    see(sequence_positions)
    ref = reference_gpt_gradients()
    rows = []
    for n, attention, layout in [(2, "ring", "zigzag"), (4, "ring", "contiguous"), (4, "ulysses", "zigzag")]:
        r = spawn(cp_gpt_gradients, n, attention=attention, layout=layout,
                  name=f"context-parallel GPT, {attention} attention, {layout}, {n} ranks").returns
        logit_diff = max((x["logits"] - ref["logits"][:, x["positions"]]).abs().max().item() for x in r)
        grad_diff = max((r[0]["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items())
        rows.append([n, attention, layout, r[0]["loss"], logit_diff, grad_diff])
    table(rows, header=["ranks", "attention", "layout", "loss", "max |Δ logits|", "max |Δ gradient|"],
          caption=f"lecture 01's GPT (float64) with the sequence split over the ranks, against one process "
                  f"(loss {ref['loss']:.10f})")
    lens = [64, 128, 256] if settings.quick else [64, 128, 256, 512]
    one = spawn(activation_memory, 1, seq_lens=lens, name="activation memory, whole sequence").returns[0]
    per = {n: spawn(activation_memory, n, seq_lens=lens, name=f"activation memory, CP over {n} ranks").returns
           for n in (2, 4)}
    table([[S, one[S] / 2**20] + [max(x[S] for x in per[n]) / 2**20 for n in (2, 4)] +
           [one[S] / max(x[S] for x in per[4])] for S in lens],
          header=["sequence length", "1 rank (MiB)", "CP=2, per rank", "CP=4, per rank", "1 rank / CP=4"],
          caption="activation bytes the GPT (batch 2, float32) keeps for backward per rank (weights "
                  "excluded), measured with a saved-tensors hook; attention here never stores the s×s "
                  "score matrix (backward recomputes it block by block, as FlashAttention does), so the "
                  "activations scale as s/n")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(lens, [one[S] / 2**20 for S in lens], "o-", label="1 rank")
    for n in (2, 4):
        ax.plot(lens, [max(x[S] for x in per[n]) / 2**20 for S in lens], "o-", label=f"CP = {n}, per rank")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("activations kept for backward (MiB)")
    ax.legend()
    figure(fig, caption="activation memory per rank falls as 1/n: the point of context parallelism")


def ring_attention_section():
    note(r"""
        ## Ring attention
        Ring attention (Liu et al. 2023) never gathers the whole sequence. At step t, rank r attends
        with its queries to the K/V block of rank r−t, while it already sends that block on to
        rank r+1 and receives the next one from r−1: after n steps every query has seen every
        block, and the transfer of the next block hides under the compute of the current one.

        The partial results combine exactly, because softmax over a union of key sets can be
        assembled from its parts: keep, for every query row, the output `o` and the log-sum-exp
        $\ell = \log\sum_j e^{s_j}$ of its block; two partials merge as
        $\ell = \log(e^{\ell_1} + e^{\ell_2})$ and $o = o_1 e^{\ell_1-\ell} + o_2 e^{\ell_2-\ell}$ —
        the online softmax of Milakov & Gimelshein, the heart of FlashAttention, and lecture 01's
        `merge_attention`, which this lecture imports.
    """)
    see("https://arxiv.org/abs/2310.01889", "Liu, Zaharia, Abbeel 2023: Ring Attention with Blockwise Transformers for Near-Infinite Context")
    see("https://arxiv.org/abs/1805.02867", "Milakov & Gimelshein 2018: Online normalizer calculation for softmax")
    see(merge_partials)
    note(r"""
        Backward needs, for each block, dQ (which stays with the queries) and dK, dV (which belong
        to the block's owner). With the final ℓ and $D = \mathrm{rowsum}(dO \circ O)$ saved from
        forward, each block's gradients follow without the other blocks (FlashAttention-2's
        backward). So the K/V blocks go around the ring once more, and each block's dK/dV
        accumulator travels one hop behind it, picking up every rank's contribution, and arrives
        home after n hops. Autograd never sees the communication: the backward is written out.
    """)
    see("https://arxiv.org/abs/2307.08691", "Dao 2023: FlashAttention-2 (the block backward)")
    see(_block_backward)
    see(RingAttention)
    rows = []
    S, h = (24, 4) if settings.quick else (37, 4)
    cases = [("ring", layout, causal) for layout in ("contiguous", "zigzag") for causal in (False, True)]
    q, k, v, dout = attention_inputs(S, h)
    for n in (2, 4):
        r = spawn(attention_shards, n, cases=cases, seq_len=S, heads=h, name=f"ring attention vs one process, {n} ranks").returns
        for case in cases:
            ref = reference_attention(q, k, v, dout, case[2])
            diffs = [(unshard_sequence([x[case][i] for x in r], 2, case[1]) - ref[i]).abs().max().item() for i in range(4)]
            rows.append([n, case[1], "causal" if case[2] else "full"] + diffs)
    table(rows, header=["ranks", "layout", "mask", "max |Δ output|", "|Δ dQ|", "|Δ dK|", "|Δ dV|"],
          caption=f"ring attention against PyTorch's scaled_dot_product_attention on the whole sequence "
                  f"(float64, s = {S}: no layout splits it evenly)")
    from util.measure import machine, timing_ranks
    n = timing_ranks(4)
    S, h, d = attention_sizes()
    run = spawn(ring_trace, n, seq_len=S, heads=h, head_dim=d, name=f"ring attention timeline, {n} ranks")
    alone = spawn(transfer_alone, n, seq_len=S, heads=h, head_dim=d, name=f"K/V block transfer alone, {n} ranks").returns[0]
    figure(timeline(run.spans, title=f"ring attention forward + backward, s = {S}, {h} heads, head dim {d}"),
           caption="measured spans per rank: block compute, the K/V (and dK/dV) transfers from posting to "
                   "when `wait` saw them done, and the time actually spent waiting")
    st = run.returns
    comp = max(x["compute"] for x in st)
    wait = max(x["waiting"] for x in st)
    wall = max(x["wall"] for x in st)
    transfers = (n - 1) + (n - 1) + n      # K/V forward, K/V backward, dK/dV backward
    note(f"""
        Medians of {len(st)} ranks' repetitions, {machine(n)}: one forward+backward takes
        {wall * 1e3:.1f} ms, of which {comp * 1e3:.1f} ms is block compute and {wait * 1e3:.2f} ms is
        waiting for transfers. One K/V block sent around the ring *alone* takes {alone.ms()}, so the
        {transfers} transfers of a step would cost about {transfers * alone.median * 1e3:.1f} ms if
        they were not overlapped; the waits show how much of that was not hidden. On GPUs NCCL
        moves the data on its own engines; on this CPU gloo's threads compete with the compute for
        the same cores, so hiding is less perfect.
    """)


def ring_work(lengths, layout, causal):
    """Score entries each rank computes in the ring (the planner the implementation uses)."""
    segs = layout_segments(lengths, layout)
    return [sum(qs[1] * ks[1] for src in range(len(lengths)) for qs in segs[r] for ks in segs[src]
                if pair_kind(qs, ks, causal) != "empty") for r in range(len(lengths))]


def load_balance_section():
    import matplotlib.pyplot as plt
    from util.measure import machine, timing_ranks
    note("""
        ## Causal masking unbalances the ring; zig-zag fixes it
        With causal attention, a query sees only earlier keys. Split the sequence into contiguous
        chunks and rank 0's queries need only its own block, while the last rank's need all n:
        rank 0 idles most of the ring, and the step lasts as long as the busiest rank. Cut the
        sequence into 2n chunks instead and give rank r chunks r and 2n−1−r, one early and one
        late (the "zig-zag" or head-tail layout of Llama 3 and ring-flash-attention): every rank
        now does the same work.
    """)
    see(zigzag_shard)
    see(layout_segments)
    see(pair_kind)
    n = timing_ranks(4)
    S, h, d = attention_sizes()
    rows, measured = [], {}
    for layout in ("contiguous", "zigzag"):
        counted = ring_work(split_sizes(S, n) if layout == "contiguous" else
                            [len(sequence_positions(S, r, n, layout)) for r in range(n)], layout, True)
        st = spawn(ring_trace, n, seq_len=S, heads=h, head_dim=d, layout=layout, causal=True,
                   name=f"causal ring, {layout}, {n} ranks").returns
        measured[layout] = (counted, st)
        for r in range(n):
            flops = 14 * d * h * st[r]["work"] // 2      # fwd 4·d, bwd 10·d per score entry (work counts both passes)
            rows.append([layout, r, counted[r], st[r]["work"] // 2, flops / 1e6, st[r]["compute"] * 1e3])
    table(rows, header=["layout", "rank", "score entries (planner)", "score entries (counted in the run)",
                        "MFLOP fwd+bwd", "compute time (ms)"],
          caption=f"causal ring attention, s = {S}, {h} heads, head dim {d}; {machine(n)}")
    ratio = lambda xs: max(xs) / max(min(xs), 1e-12)
    summary = [[layout, ratio(c), ratio([x["compute"] for x in st]), max(x["wall"] for x in st) * 1e3]
               for layout, (c, st) in measured.items()]
    table(summary, header=["layout", "max/min work (counted)", "max/min compute time (measured)", "step time (ms)"],
          caption="the imbalance, counted and measured")
    note(f"""
        The counts are exact: with contiguous chunks the busiest rank computes {summary[0][1]:.2f}× the
        score entries of the idlest, with zig-zag {summary[1][1]:.2f}×. Measured ({machine(n)}), the
        compute times differ by {summary[0][2]:.2f}× and {summary[1][2]:.2f}×, and the zig-zag step took
        {summary[1][3] / summary[0][3]:.2f}× the contiguous one's. Times on a shared CPU are noisier
        than counts; the gap grows with the number of ranks (contiguous: the last rank does n blocks
        while rank 0 does one).
    """)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, (layout, (c, st)) in zip(axes, measured.items()):
        ax.bar([r - 0.2 for r in range(n)], [x / max(c) for x in c], width=0.4, label="work counted")
        ax.bar([r + 0.2 for r in range(n)], [x["compute"] / max(y["compute"] for y in st) for x in st],
               width=0.4, label="compute time measured")
        ax.set_title(layout)
        ax.set_xlabel("rank")
        ax.set_xticks(range(n))
    axes[0].set_ylabel("relative to the busiest rank")
    axes[0].legend()
    figure(fig, caption="per-rank work of causal ring attention: contiguous chunks vs zig-zag")
    note("""
        The zig-zag layout is a different order of the tokens, nothing more: the model embeds each
        token at its true position and the loss is a sum over tokens, so training is unchanged
        (the GPT check above ran with zig-zag).
    """)


def allgather_section():
    from util.measure import machine, timing_ranks
    note("""
        ## The all-gather variant: simpler, more memory
        Instead of a ring, every rank can all-gather all keys and values first and then attend
        locally (backward: reduce-scatter dK, dV to their owners). Two collectives, no ring
        bookkeeping — Llama 3 trained long context this way — but every rank holds the whole
        sequence's K/V during attention and for backward, where the ring holds its own block plus
        one in flight.
    """)
    see("https://arxiv.org/abs/2407.21783", "Llama Team 2024: The Llama 3 Herd of Models (all-gather context parallelism, §3.3.2)")
    see(AllGatherAttention)
    n = timing_ranks(4)
    S, h, d = attention_sizes()
    r = spawn(compare_variants, n, seq_len=S, heads=h, head_dim=d, variants=["ring", "all-gather"],
              name=f"ring vs all-gather, {n} ranks").returns
    table([[name, r[0][name]["time"].ms(), max(x[name]["held"] for x in r) / 2**20,
            r[0][name]["shard_bytes"] / 2**20] for name in ("ring", "all-gather")],
          header=["variant", "forward+backward", "held for backward per rank (MiB)", "one q shard (MiB)"],
          caption=f"causal attention, s = {S}, {h} heads, head dim {d}, float32, zig-zag; {machine(n)}. "
                  "Held bytes measured with a saved-tensors hook")


def ulysses_section():
    from util.measure import machine, timing_ranks
    note("""
        ## Ulysses: trade the sequence split for a head split
        DeepSpeed-Ulysses (Jacobs et al. 2023) notices that attention heads are independent. One
        all-to-all turns each rank's (all heads, s/n positions) into (h/n heads, all s positions);
        each rank then runs ordinary attention on its heads, and a second all-to-all turns the
        output back. Per rank it sends 3 + 1 tensors of (n−1)/n of its shard in forward — a volume
        that does not grow with n — where the ring sends its K/V shard n−1 times. The limit: the
        heads must split over the ranks, so CP degree ≤ heads (fewer still with grouped-query
        attention's K/V heads).
    """)
    see("https://arxiv.org/abs/2309.14509", "Jacobs et al. 2023: DeepSpeed Ulysses")
    see(SeqToHeads)
    see(ulysses_attention)
    n = timing_ranks(4)
    S, h, d = attention_sizes()
    rows, shards = [], {}
    for ranks in sorted({2, 4, n}):
        r = spawn(compare_variants, ranks, seq_len=S, heads=h, head_dim=d, variants=["ring", "ulysses", "all-gather"],
                  repeats=3, name=f"bytes: ring vs Ulysses vs all-gather, {ranks} ranks").returns
        shard = shards[ranks] = r[0]["ring"]["shard_bytes"]
        for name in ("ring", "ulysses", "all-gather"):
            model = {"ring": (2 * (ranks - 1) + 2 * (ranks - 1) + 2 * ranks) * shard,
                     "ulysses": 2 * 4 * (ranks - 1) / ranks * shard,
                     "all-gather": (2 * (ranks - 1) + 2 * (ranks - 1)) * shard}[name]
            rows.append([ranks, name, r[0][name]["sent_forward"] / 2**20, r[0][name]["sent"] / 2**20, model / 2**20,
                         r[0][name]["time"].ms() + ("" if ranks <= n else " (oversubscribed)")])
    table(rows, header=["ranks", "variant", "sent in forward (MiB, measured)", "forward+backward (MiB, measured)",
                        "forward+backward (model)", "time"],
          caption=f"bytes rank 0 wrote to its sockets (/proc/self/io), s = {S}, {h} heads, head dim {d}, float32; "
                  f"model: ring 2(n−1) K/V forward + 2(n−1) K/V and 2n dK/dV backward shards; Ulysses 4 all-to-alls "
                  f"each way of (n−1)/n shard; all-gather and reduce-scatter as rings. {machine(n)}")
    extra = [(row[0], (row[3] - row[2]) / (2 * (row[0] - 1) * shards[row[0]] / 2**20)) for row in rows if row[1] == "all-gather"]
    note(f"""
        The ring and Ulysses send what the model says, plus small headers. The all-gather
        variant's backward sent {", ".join(f"{x:.1f}× ({n} ranks)" for n, x in extra)} the bytes a
        ring reduce-scatter of dK/dV needs: gloo's reduce-scatter on CPU sends more than the ring
        bound (NCCL's is a ring). Ulysses' volume per rank falls as n grows, the ring's grows:
        at large n that is Ulysses' advantage, and its head limit is the price.
    """)
    msg = spawn(ulysses_refusal, 4, heads=2, name="Ulysses with 2 heads on 4 ranks").returns[0]
    note(f"With 2 heads on 4 ranks Ulysses refuses: *{msg}*")


def pytorch_context_parallel():
    from util.measure import machine, timing_ranks
    note("""
        ## PyTorch's own: `context_parallel`
        `torch.distributed.tensor.experimental.context_parallel(mesh, buffers=..., buffer_seq_dims=...)`
        shards the given tensors along the sequence (head-tail order for causal attention: the
        same zig-zag) and patches `F.scaled_dot_product_attention` to run a ring. In torch 2.13 its
        handlers cover the CUDA kernels only; on CPU it fails with "aten._scaled_dot_product_flash_
        attention_for_cpu.default does not have a sharding strategy registered". The shim below
        registers that op (and its backward) with PyTorch's own ring functions; on a GPU it is not
        used. It is tested against one process like our variants.
    """)
    see(install_cpu_context_parallel_shim)
    n = timing_ranks(4)
    S, h, d = attention_sizes()
    Sc = 24
    q, k, v, dout = attention_inputs(Sc, 4)
    ref = reference_attention(q, k, v, dout, True)
    r = spawn(pytorch_cp_demo, n, check_len=Sc, seq_len=S, heads=h, head_dim=d,
              name=f"PyTorch context_parallel vs one process and vs our ring, {n} ranks").returns
    diffs = [(zigzag_unshard([x["check"][i] for x in r], 2) - ref[i]).abs().max().item() for i in range(4)]
    t = r[0]["timing"]
    table([["max |Δ| vs one process (float64, s=24): output, dQ, dK, dV", ", ".join(f"{x:.1e}" for x in diffs)],
           ["PyTorch's layout equals our zig-zag", t["same_layout"]],
           ["max |Δ| PyTorch vs ours (float32 outputs)", t["max_diff"]],
           ["PyTorch context_parallel, forward+backward", t["theirs"].ms()],
           ["our ring (zig-zag), forward+backward", t["ours"].ms()],
           ["ours / PyTorch", t["ours"].median / t["theirs"].median]],
          header=["what", "value"], caption=f"causal attention, s = {S}, {h} heads, head dim {d}; {machine(n)}; "
                                            "the two alternate, repetition by repetition. PyTorch merges partials in "
                                            "float32 (`convert_to_f32`), hence ~1e-7 in float64")
    ratio = t["ours"].median / t["theirs"].median
    verdict = ("that extra bookkeeping shows" if ratio > 1.05 else
               "about the same, so at this size the kernel's work dominates both" if ratio >= 0.95 else
               "PyTorch's path around the kernel (context_parallel's dispatch, and on CPU this "
               "lecture's shim) costs more than our calls at this size; we did not time its parts")
    note(f"""
        Both run the same fused CPU kernel on the blocks, so they differ in bookkeeping, not in
        arithmetic. Ours calls the kernel once per pair of segments (up to four per step under
        zig-zag, where PyTorch halves the query or key block instead: one call) and merges the
        partials with a few tensor operations per pair, in Python. Here ours takes
        {ratio:.2f}× PyTorch's time: {verdict}.
    """)


def mixture_of_experts():
    import matplotlib.pyplot as plt
    note(r"""
        ## Mixture of experts: router, capacity, balance loss
        A mixture-of-experts layer replaces the MLP by E expert MLPs and a router, a linear layer
        giving each token a probability for each expert. A token goes to its top-k experts (Switch
        Transformer: k = 1; GShard: k = 2) and its output is their gate-weighted sum, so the
        parameters grow E-fold while the compute per token grows k-fold.

        Experts run on fixed-size buffers, so each takes at most C = ⌈capacity factor · T · k / E⌉
        of the T tokens; the rest of its queue is **dropped** (that choice contributes nothing and
        the residual connection carries the token on). First choices queue before second choices.
        Left alone, routers collapse onto a few experts; the **auxiliary balance loss** of the
        Switch Transformer, $E \sum_e f_e P_e$ with $f_e$ the fraction of tokens whose first choice
        is e and $P_e$ the mean router probability of e, is 1 when routing is uniform and grows as
        it concentrates; only $P$ carries a gradient.
    """)
    see("https://arxiv.org/abs/2101.03961", "Fedus, Zoph, Shazeer 2021: Switch Transformers")
    see("https://arxiv.org/abs/2006.16668", "Lepikhin et al. 2020: GShard")
    see(route)
    see(balance_loss)
    see(MoE)
    torch.manual_seed(0)
    moe = moe_layer(d_model=32, d_ff=64, n_experts=8, top_k=2, capacity_factor=None, dtype="float32")
    x = torch.randn(512, 32)
    rows = []
    for cf in (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, None):
        moe.capacity_factor = cf
        with torch.no_grad():
            moe(x)
        st = moe.stats
        rows.append(["no limit" if cf is None else cf, st["capacity"], st["dropped"], st["dropped"] / st["assignments"]])
    counts = st["tokens_per_expert"]
    table(rows, header=["capacity factor", "capacity C (slots per expert)", "dropped choices", "fraction dropped"],
          caption="an untrained top-2 router over 8 experts, 512 tokens: dropped choices vs capacity factor")
    steps = 40 if settings.quick else 200
    weights = [0.0, 0.1]
    r = spawn(train_moe_gpt, 2, aux_weights=weights, steps=steps, batch_size=8,
              name="MoE GPT training: rank 0 without, rank 1 with the balance loss").returns
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    axes[0].bar(range(8), counts)
    axes[0].set_xlabel("expert")
    axes[0].set_ylabel("tokens routed (both choices)")
    axes[0].set_title("untrained router, 512 tokens")
    for w, log in zip(weights, r):
        axes[1].plot(log["max_load"], label=f"balance weight {w}")
        axes[2].plot(log["loss"], label=f"balance weight {w}")
    axes[1].axhline(1, color="gray", lw=0.5)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("busiest expert / mean load")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("training loss")
    axes[1].legend()
    figure(fig, caption=f"lecture 01's GPT with 4-expert top-1 MoE MLPs (capacity factor 1.25), {steps} steps "
                        "of AdamW; each setting trained on its own rank, side by side")
    tail = max(1, steps // 10)
    mean = lambda xs: sum(xs[-tail:]) / tail
    table([[w, mean(log["loss"]), mean(log["aux"]), mean(log["max_load"]), mean(log["dropped"]),
            str(log["tokens_per_expert"])] for w, log in zip(weights, r)],
          header=["balance weight α", "loss", "balance loss", "busiest / mean load", "dropped fraction",
                  "tokens per expert (last step, per layer)"],
          caption=f"means over the last {tail} steps")


def expert_parallelism():
    from util.measure import machine, timing_ranks
    note("""
        ## Expert parallelism: all-to-all dispatch and combine
        Put E/n experts on each of n ranks; each rank routes its own tokens. Two rounds of
        `all_to_all_single` move the tokens: *dispatch* sends each kept (token, choice) row to the
        rank owning that expert, the experts run, and *combine* sends the results back, to be
        weighted by the gates. The splits are uneven and change every step, so the ranks first
        exchange how many rows each will send (a small all-to-all of counts) to size the buffers.
        Here the choice counts are also all-gathered first, so every rank knows the global queue
        positions and drops exactly the tokens one process would; the layer then equals the
        one-process `MoE` on all ranks' tokens: outputs, gradients, dropped tokens.
    """)
    see(AllToAll)
    see(ExpertParallelMoE)
    tokens, d_model, d_ff, E, k = (256, 64, 128, 8, 2) if settings.quick else (1024, 64, 256, 8, 2)
    rows, imbalance = [], []
    for n in (2, 4):
        r = spawn(expert_parallel_traffic, n, tokens=tokens, d_model=d_model, d_ff=d_ff, n_experts=E, top_k=k,
                  capacity_factor=1.25, name=f"expert parallelism, {n} ranks").returns
        ref = moe_reference(dict(d_model=d_model, d_ff=d_ff, n_experts=E, top_k=k, capacity_factor=1.25),
                            [tokens] * n)
        out = torch.cat([x["check"]["out"] for x in r])
        same_drops = torch.equal(torch.cat([x["check"]["keep"] for x in r]), ref["keep"])
        for rank, x in enumerate(r):
            st = x["stats"]
            remote = sum(c for j, c in enumerate(st["rows_sent"]) if j != rank)       # dispatch out
            returned = sum(c for j, c in enumerate(st["rows_received"]) if j != rank)  # combine out
            rows.append([n, rank, st["rows_sent"], st["rows_received"], sum(st["rows_received"]), x["sent"] / 2**10,
                         2 * (remote + returned) * d_model * 4 / 2**10])
        recv = [sum(x["stats"]["rows_received"]) for x in r]
        imbalance.append([n, (out - ref["out"]).abs().max().item(), same_drops, max(recv) / (sum(recv) / n),
                          r[0]["time"].ms() + ("" if n <= timing_ranks(4) else " (oversubscribed)")])
    table(rows, header=["ranks", "rank", "rows sent to each rank", "rows received from each", "expert rows on this rank",
                        "KiB sent fwd+bwd (measured)", "KiB model: remote rows × 2 passes × 2 all-to-alls"],
          caption=f"{tokens} tokens per rank, d_model {d_model}, {E} experts, top-{k}, capacity factor 1.25, float32")
    table(imbalance, header=["ranks", "max |Δ output| vs one process (float64)", "same tokens dropped",
                             "busiest rank's rows / mean", "layer forward+backward"],
          caption=f"equality and imbalance; {machine(timing_ranks(4))}")
    note("""
        Measured bytes include the backward pass, which repeats both all-to-alls in reverse, and
        the small count exchanges. The busiest rank sets the pace: the balance loss that evens
        out experts also evens out the ranks.

        **Why DeepSeek-V3 limits each token to 4 nodes.** With hundreds of fine-grained experts
        and top-8 routing, a token's experts could sit on up to 8 different nodes, and every copy
        crosses the slow inter-node network (InfiniBand) both ways. DeepSeek-V3 first picks at
        most 4 nodes per token (by the best expert scores on each node), then the experts within
        them, so each token crosses IB at most 4 times and is forwarded to its experts over the
        fast intra-node NVLink — bounding the all-to-all traffic that dominates EP's cost.
    """)
    see("https://arxiv.org/abs/2412.19437", "DeepSeek-AI 2024: DeepSeek-V3 Technical Report (node-limited routing)")


def main():
    intro()                      # what the two splits are
    what_needs_other_ranks()     # CP touches only attention; memory per rank ~ s/n
    ring_attention_section()     # the ring, its merge, its backward, the overlap measured
    load_balance_section()       # causal masking unbalances contiguous chunks; zig-zag
    allgather_section()          # the simpler variant and what it costs in memory
    ulysses_section()            # all-to-all to head shards: bytes compared, its limit
    pytorch_context_parallel()   # PyTorch's own ring, with a small CPU shim
    mixture_of_experts()         # router, capacity, balance loss, in training
    expert_parallelism()         # experts across ranks, tokens by all-to-all


def bench():
    """Ring vs all-gather vs Ulysses (fwd+bwd) side by side; zig-zag's work balance vs contiguous."""
    from util.measure import timing_ranks
    n = timing_ranks(4)
    S, h, d = 1024, 8, 32
    r = spawn(compare_variants, n, seq_len=S, heads=h, head_dim=d, variants=["ring", "all-gather", "ulysses"],
              name="bench: ring vs all-gather vs Ulysses").returns[0]
    t = {k: v["time"].median for k, v in r.items()}
    balance = {}
    for layout in ("contiguous", "zigzag"):
        st = spawn(ring_trace, n, seq_len=S, heads=h, head_dim=d, layout=layout, causal=True,
                   name=f"bench: causal ring, {layout}").returns
        c = [x["compute"] for x in st]
        work = ring_work([len(sequence_positions(S, r, n, layout)) for r in range(n)], layout, True)
        balance[layout] = (max(c) / min(c), max(x["wall"] for x in st), max(work) / min(work))
    return [f"lecture_06: ring {t['ring'] * 1e3:.1f} ms vs all-gather {t['all-gather'] * 1e3:.1f} ms: ratio "
            f"{t['ring'] / t['all-gather']:.2f}; vs Ulysses {t['ulysses'] * 1e3:.1f} ms: ratio {t['ring'] / t['ulysses']:.2f} "
            f"(causal fwd+bwd, s={S}, {n} ranks)",
            f"lecture_06: causal ring max/min work per rank counted: contiguous {balance['contiguous'][2]:.2f}, zig-zag "
            f"{balance['zigzag'][2]:.2f}; measured compute: contiguous {balance['contiguous'][0]:.2f}, zig-zag "
            f"{balance['zigzag'][0]:.2f}; step {balance['contiguous'][1] * 1e3:.1f} ms vs {balance['zigzag'][1] * 1e3:.1f} ms "
            f"(zig-zag / contiguous {balance['zigzag'][1] / balance['contiguous'][1]:.2f})"]
