"""Attention on blocks of a sharded sequence: the per-block math every context-parallel variant
shares (ring, all-gather and Ulysses attention in `lectures/ring_attention.py` and
`lectures/context_parallel.py`).

A rank's slice of the sequence is a list of *segments*: (local start, length, global start).
Contiguous sharding gives one segment per rank; zig-zag gives two (`lectures/sequence_layout.py`).
Causal masking then only needs global positions, and a pair of segments is "full" (every key
visible to every query), "partial" (a mask is needed) or "empty" (no key visible: skipped, no
FLOPs). Partials over disjoint key sets combine with the online-softmax merge of Milakov &
Gimelshein 2018 (`merge_partials`: `merge_attention` of `lectures/attention.py`, lecture 01's):
lse = log(e^lse_a + e^lse_b), out = out_a·e^(lse_a−lse) + out_b·e^(lse_b−lse).
The backward of one block, given the final lse, is FlashAttention-2's (Dao 2023).
"""
import math

import torch

from lectures.attention import merge_attention as merge_partials


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


def acc_dtype(dtype):
    """Partial results are accumulated in float32 at least (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_qkv(q, k, v):
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError("q, k, v must all be (batch, heads, local_seq, head_dim) with the same shape; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (repeat grouped "
                         "K/V heads before calling, as lecture 01's CausalSelfAttention does)")


class SegmentAttention(torch.autograd.Function):
    """Attention of local queries over keys laid out as segments, with a hand-written backward
    (the same block math as the ring, on one process)."""

    @staticmethod
    def forward(ctx, q, k, v, qsegs, ksegs, causal):
        acc = acc_dtype(q.dtype)
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
    check_qkv(q, k, v)
    seg = [(0, q.shape[2], 0)]
    return SegmentAttention.apply(q, k, v, seg, seg, causal)

