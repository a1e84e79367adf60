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

from util import device, figure, note, see, settings, span, span_at, spawn, table, timeline

# =========================================================================================
# 1. Attention on blocks: partial results and how to merge them
# =========================================================================================
# A rank's slice of the sequence is a list of *segments*: (local start, length, global start).
# Contiguous sharding gives one segment per rank; zig-zag gives two. Causal masking then only
# needs global positions, and a pair of segments is "full" (every key visible to every query),
# "diagonal/partial" (a mask is needed) or "empty" (no key visible: skipped, no FLOPs).


def merge_partials(out, lse, out_b, lse_b):
    """Combine two partial attentions over disjoint key sets into the attention over their union.

    Each partial is (out, lse): the softmax-weighted values over its keys and the log of its
    softmax denominator, log Σ exp(s). The union's denominator is the sum, so
    lse = log(e^lse + e^lse_b) and out = out·e^(lse−lse_new) + out_b·e^(lse_b−lse_new): the
    running max / log-sum-exp merge of online softmax (Milakov & Gimelshein 2018). Rows that see
    no key yet have lse = −inf and contribute nothing."""
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    return (out * torch.exp(lse - safe).unsqueeze(-1) + out_b * torch.exp(lse_b - safe).unsqueeze(-1),
            new)


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
            mask = _causal_mask(qs, ks, q.device) if kind == "partial" else None
            o_b, l_b = _block_forward(_seg(q, qs), _seg(k, ks), _seg(v, ks), scale, mask)
            a, n = qs[0], qs[1]
            o, l = merge_partials(out[:, :, a:a + n], lse[:, :, a:a + n], o_b, l_b)
            out[:, :, a:a + n], lse[:, :, a:a + n] = o, l
            if work is not None:
                work.append(qs[1] * ks[1])
    return out, lse


def segments_backward(q, k, v, dout, lse, delta, qsegs, ksegs, causal, scale, dq, dk, dv):
    """Add the gradients of q's segments over k's segments into dq, dk, dv (in place)."""
    for qs in qsegs:
        for ks in ksegs:
            kind = pair_kind(qs, ks, causal)
            if kind == "empty":
                continue
            mask = _causal_mask(qs, ks, q.device) if kind == "partial" else None
            a, n = qs[0], qs[1]
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
        segments_backward(q, k, v, dout, lse, delta, qsegs, ksegs, causal, scale, dq, dk, dv)
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


def _trace(label, start, end):
    if TRACE is not None:
        TRACE.append((label, start, end))


class _Transfer:
    """Send one tensor to the next rank and receive one of `shape` from the previous, async."""

    def __init__(self, send, recv_shape, group, n, r, tag, label):
        self.buf = torch.empty(recv_shape, dtype=send.dtype, device=send.device)
        self.send = send.contiguous()            # kept alive until the send completes
        self.ops = [dist.isend(self.send, _global(group, (r + 1) % n), group=group, tag=tag),
                    dist.irecv(self.buf, _global(group, (r - 1) % n), group=group, tag=tag)]
        self.label, self.start = label, time.perf_counter()

    def wait(self):
        for op in self.ops:
            op.wait()
        _trace(self.label, self.start, time.perf_counter())
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
            start = time.perf_counter()
            segments_forward(q_, kv[..., :d], kv[..., d:], segs[r], segs[src], causal, scale, out, lse, work)
            _trace("block compute", start, time.perf_counter())
            if nxt is not None:
                kv = nxt.wait()
        ctx.save_for_backward(q_, k_, v_, out, lse)
        ctx.meta = (causal, group, n, r, lengths, segs, scale, q.dtype)
        ctx.work = sum(work)
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
            segments_backward(q, kv[..., :d], kv[..., d:], dout, lse, delta, segs[r], segs[src], causal,
                              scale, dq, dkv[..., :d], dkv[..., d:])
            _trace("block compute", start, time.perf_counter())
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
        segments_backward(q, k, v, dout, lse, delta, qsegs, ksegs, causal, scale, dq, dk, dv)
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


def main():
    pass
