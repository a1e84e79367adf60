"""Context parallelism besides the ring, and how a model uses it.

- All-gather attention (Llama Team 2024, "The Llama 3 Herd of Models", §3.3.2): every rank
  gathers all keys and values, attends locally, and reduce-scatters dK, dV back to their owners.
  Two collectives, no ring bookkeeping; the whole sequence's K/V held on every rank.
- DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all turns sequence shards into head shards,
  each rank runs full attention on h/n heads, and a second all-to-all turns the output back.
- `ATTENTION` names the three variants (the ring is in `lectures/context_parallel/ring.py`), and
  `context_parallel_gpt` swaps one of them into every attention layer of lecture 01's GPT.
- `install_cpu_context_parallel_shim` lets PyTorch's own `context_parallel` run on CPU.
"""
import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lectures.context_parallel.blocks import (SegmentAttention, acc_dtype, attention_signature, check_qkv, expand_kv,
                                              fold_kv, segments_backward, segments_forward)
from lectures.context_parallel.ring import ring_attention
from lectures.context_parallel.sharding import agreed_lengths, group_info, layout_segments, offsets


# --- All-gather attention ---------------------------------------------------------------------

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
        group, n, r = group_info(group)
        acc = acc_dtype(q.dtype)
        q_, k_, v_ = (t.detach().to(acc) for t in (q, k, v))
        d, groups = q.shape[-1], q.shape[1] // k.shape[1]
        lengths = agreed_lengths(q.shape[2], attention_signature(q, k, causal, layout), group, n, q.device)
        segs = layout_segments(lengths, layout)
        # K/V are gathered with their own (GQA: fewer) heads, and repeated after the transfer.
        kv = expand_kv(_all_gather_padded(torch.cat([k_, v_], -1), lengths, group, n), groups)
        starts = offsets(lengths)
        ksegs = [(starts[j] + a, l, g) for j in range(n) for a, l, g in segs[j]]
        scale = 1.0 / math.sqrt(d)
        kf, vf = kv[..., :d], kv[..., d:]
        out, lse = segments_forward(q_, kf, vf, segs[r], ksegs, causal, scale)
        ctx.save_for_backward(q_, kf, vf, out, lse)
        ctx.meta = (causal, group, n, r, lengths, segs[r], ksegs, scale, q.dtype, groups)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, group, n, r, lengths, qsegs, ksegs, scale, dtype, groups = ctx.meta
        dout = dout.to(q.dtype)
        delta = (dout * out).sum(-1)    # D = rowsum(dO ∘ O), at the start of backward
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        segments_backward(q, k, v, dout, out, lse, delta, qsegs, ksegs, causal, scale, dq, dk, dv)
        dk, dv = fold_kv(dk, groups), fold_kv(dv, groups)      # back to kv_heads before they travel
        m = max(lengths)
        full = torch.cat([F.pad(t, (0, 0, 0, m - t.shape[2]))
                          for t in torch.split(torch.cat([dk, dv], -1), lengths, dim=2)], dim=2)
        mine = torch.empty_like(full[:, :, :m]).contiguous()
        # reduce_scatter_single splits dim 0: put the rank blocks first.
        full = full.view(*full.shape[:2], n, m, -1).permute(2, 0, 1, 3, 4).contiguous()
        mine = mine.unsqueeze(0)
        dist.reduce_scatter_single(mine, full, group=group)
        mine = mine[0, :, :, :lengths[r]]
        d = q.shape[-1]
        return dq.to(dtype), mine[..., :d].to(dtype), mine[..., d:].to(dtype), None, None, None


def allgather_attention(q, k, v, causal=False, group=None, layout="contiguous"):
    """Like ring_attention, but every rank gathers all K/V first (simpler; the full K/V in memory)."""
    check_qkv(q, k, v)
    return AllGatherAttention.apply(q, k, v, causal, group, layout)


# --- Ulysses: all-to-all between sequence shards and head shards ----------------------------

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
    attention on h/n heads, all-to-all back. Needs heads divisible by the ranks (and, under
    grouped-query attention, the K/V heads too: each rank's query heads keep their K/V heads)."""
    check_qkv(q, k, v)
    group, n, r = group_info(group)
    # agreed first, so that a refusal below happens on every rank alike (none left waiting)
    lengths = agreed_lengths(q.shape[2], attention_signature(q, k, causal, layout), group, n, q.device)
    if q.shape[1] % n or k.shape[1] % n:
        raise ValueError(f"Ulysses splits the heads over the ranks: {q.shape[1]} query heads and {k.shape[1]} "
                         f"K/V heads cannot both be split evenly over {n} ranks (it needs ranks <= K/V heads "
                         "and both head counts divisible by the ranks)")
    segs = layout_segments(lengths, layout)
    starts = offsets(lengths)
    allsegs = [(starts[j] + a, l, g) for j in range(n) for a, l, g in segs[j]]
    qh, kh, vh = (SeqToHeads.apply(t, lengths, group) for t in (q, k, v))
    yh = SegmentAttention.apply(qh, kh, vh, allsegs, allsegs, causal)
    return HeadsToSeq.apply(yh, lengths, group)


ATTENTION = {"ring": ring_attention, "all-gather": allgather_attention, "ulysses": ulysses_attention}


def context_parallel_gpt(model, group=None, attention="ring", layout="zigzag"):
    """Make every attention layer of `model` attend across the context-parallel `group`: the rest
    of the model is per-token and runs unchanged on this rank's positions."""
    fn = {"ring": ring_attention, "all-gather": allgather_attention, "ulysses": ulysses_attention}[attention]
    for block in model.blocks:
        groups = block.attn.n_heads // block.attn.n_kv_heads
        block.attn.attend = functools.partial(_attend_kv_heads, fn=fn, groups=groups, group=group, layout=layout)
    return model


def _attend_kv_heads(q, k, v, fn, groups, group, layout):
    """Lecture 01's attention repeats grouped K/V heads before calling `attend`; take one of each
    group back (a strided view of the same values; autograd sums the copies' gradients), so that
    only kv_heads travel between ranks and the repeat happens after the transfer."""
    return fn(q, k[:, ::groups], v[:, ::groups], causal=True, group=group, layout=layout)


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
