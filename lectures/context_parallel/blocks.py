"""Attention on blocks of a sharded sequence: the per-block math every context-parallel variant
shares (ring, all-gather and Ulysses attention in `lectures/context_parallel/ring.py` and
`lectures/context_parallel/variants.py`).

A rank's slice of the sequence is a list of *segments*: (local start, length, global start).
Contiguous sharding gives one segment per rank; zig-zag gives two (`lectures/context_parallel/sharding.py`).
Causal masking then only needs global positions, and a pair of segments is "full" (every key
visible to every query), "partial" (a mask is needed) or "empty" (no key visible: skipped, no
FLOPs). Partials over disjoint key sets combine with the online-softmax merge of Milakov &
Gimelshein 2018 (`merge_partials`: `merge_attention` of `lectures/model/attention.py`, lecture 01's):
lse = log(e^lse_a + e^lse_b), out = out_a·e^(lse_a−lse) + out_b·e^(lse_b−lse).
The backward of one block, given the final lse, is FlashAttention-2's (Dao 2023).
"""
import math

import torch

from lectures.model.attention import merge_attention as merge_partials
from lectures.context_parallel.sharding import LAYOUTS, dtype_code


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


def visible_entries(qseg, kseg, causal):
    """How many (query, key) score entries of this pair the mask keeps: the work a kernel that
    skips masked entries does (a causal diagonal block is about half of a full one)."""
    kind = pair_kind(qseg, kseg, causal)
    (_, qn, q0), (_, kn, k0) = qseg, kseg
    if kind == "empty":
        return 0
    if kind == "full":
        return qn * kn
    return sum(min(max(p - k0 + 1, 0), kn) for p in range(q0, q0 + qn))


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
    pairs; `work` (a list) gets the number of visible score entries of each pair computed."""
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
                work.append(visible_entries(qs, ks, causal))
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
    """q is (batch, heads, local_seq, head_dim); k and v the same, except that under grouped-query
    attention they may have fewer heads (kv_heads dividing heads): they travel between ranks with
    their own heads and are repeated only where a block is computed (`expand_kv`)."""
    ok = (q.dim() == 4 and k.shape == v.shape and k.dim() == 4 and k.shape[0] == q.shape[0]
          and k.shape[2:] == q.shape[2:] and k.shape[1] >= 1 and q.shape[1] % k.shape[1] == 0)
    if not ok:
        raise ValueError("q must be (batch, heads, local_seq, head_dim) and k, v (batch, kv_heads, local_seq, "
                         "head_dim) with the same shape, kv_heads dividing heads (grouped-query attention); "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    return q.shape[1] // k.shape[1]


def attention_signature(q, k, causal, layout):
    """What every rank of a context-parallel group must agree on: everything but the sequence
    length (integers, for `sequence_layout.agreed_lengths`)."""
    return {"batch size": q.shape[0], "heads": q.shape[1], "K/V heads": k.shape[1], "head dim": q.shape[3],
            "dtype": dtype_code(q.dtype), "causal": int(bool(causal)),
            "layout": LAYOUTS.index(layout) if layout in LAYOUTS else -1}


def expand_kv(t, groups):
    """Grouped-query attention: K/V head j serves query heads j·g … j·g + g − 1 (lecture 01's
    `repeat_interleave`). Done after a transfer, so the wire carries kv_heads, not heads."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def fold_kv(grad, groups):
    """The backward of `expand_kv`: sum the gradients of the g query heads that shared a K/V head."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


class SegmentAttention(torch.autograd.Function):
    """Attention of local queries over keys laid out as segments, with a hand-written backward
    (the same block math as the ring, on one process). K/V may have fewer heads (GQA)."""

    @staticmethod
    def forward(ctx, q, k, v, qsegs, ksegs, causal):
        groups = q.shape[1] // k.shape[1]
        acc = acc_dtype(q.dtype)
        q_, k_, v_ = (t.detach().to(acc) for t in (q, k, v))
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, lse = segments_forward(q_, expand_kv(k_, groups), expand_kv(v_, groups), qsegs, ksegs, causal, scale)
        ctx.save_for_backward(q_, k_, v_, out, lse)
        ctx.meta = (qsegs, ksegs, causal, scale, q.dtype, groups)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        qsegs, ksegs, causal, scale, dtype, groups = ctx.meta
        k, v = expand_kv(k, groups), expand_kv(v, groups)
        dout = dout.to(q.dtype)
        delta = (dout * out).sum(-1)      # D = rowsum(dO ∘ O): computed here, at the start of backward
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        segments_backward(q, k, v, dout, out, lse, delta, qsegs, ksegs, causal, scale, dq, dk, dv)
        return dq.to(dtype), fold_kv(dk, groups).to(dtype), fold_kv(dv, groups).to(dtype), None, None, None


def full_attention(q, k, v, causal=False):
    """The single-process reference: every query against every key (our block math, one block)."""
    check_qkv(q, k, v)
    seg = [(0, q.shape[2], 0)]
    return SegmentAttention.apply(q, k, v, seg, seg, causal)

