"""Attention by blocks of keys with an online softmax: the idea of FlashAttention.

softmax(QKᵀ)V needs, per query, the maximum and the sum of exponentials over all keys. Computed
over blocks of keys, each block gives a partial output and a log-sum-exp (lse); two partial
results merge exactly (`merge_attention`: the running-max rescaling of Milakov & Gimelshein 2018,
"Online normalizer calculation for softmax"). FlashAttention (Dao et al. 2022; the backward of
FlashAttention-2, Dao 2023) runs this in on-chip memory and recomputes each score tile in the
backward from the saved lse instead of storing the s × s probabilities.

Here in plain PyTorch: `attention_with_lse` (one block, with position offsets so a rank holding a
slice of the sequence masks correctly), `merge_attention` (lecture 06's ring attention merges each
arriving block with it), and `online_softmax_attention` (the blocked forward and the
FlashAttention-2 backward as one autograd Function), equal to `F.scaled_dot_product_attention` in
values and gradients; and `naive_causal_attention`, the paper's formula with the s × s matrices, to
compare against.
"""
import torch


def naive_causal_attention(q, k, v):
    """Attention as written in the paper: the (s × s) scores and probabilities are materialized
    (and the probabilities saved for backward)."""
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v


def attention_with_lse(q, k, v, causal=False, q_offset=0, k_offset=0, scale=None):
    """softmax(q kᵀ·scale) v for one block of keys, and the log-sum-exp of each query's scores
    (b, heads, s_q). Positions are q_offset + i and k_offset + j, so a rank holding a slice of
    the sequence masks correctly (causal: key j visible to query i iff k_offset+j <= q_offset+i).
    A query that sees no key here gets output 0 and lse −inf, which `merge_attention` ignores.
    Plain tensor operations: autograd differentiates it."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)   # softmax statistics in fp32 at least
    scores = (q.to(acc) @ k.to(acc).transpose(-2, -1)) * scale   # fp32 scores, as backward recomputes them
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
