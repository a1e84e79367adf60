"""Tensor-parallel attention: Lecture 01's attention split by whole heads, with Q, K and V fused
into one column-parallel matmul (as Megatron-LM does) and the output projection row-parallel.
Under grouped-query attention the K/V heads are split when the tensor-parallel size divides
them, and otherwise replicated on the ranks whose query heads read them (as vLLM does), their
gradients summed over those ranks by `ShareKVHeads`. The linear layers it is built from are in
`lectures/tensor_parallel/layers.py`.
"""

import torch
from torch import nn

from lectures.model.gpt import causal_attention
from lectures.tensor_parallel.layers import (ColumnParallelLinearFunction, RowParallelLinear, _check_sequence_layout,
                                             _linear_init, _shard_of_full, _value)
from lectures.tensor_parallel.ops import _AgreedOnFirstCall, _all_gather, _all_reduce, _check_agreed, _size_rank


class ShareKVHeads(torch.autograd.Function):
    """Identity forward; backward, sums the K and V rows of each gradient over the ranks that hold
    the same (replicated) K/V head, so that every copy of a head gets the gradient of all the
    query heads that read it. One all-reduce over the tensor-parallel group of a buffer with a
    slot per K/V head (each rank fills its head's slot): the bytes of the whole K/V gradient,
    which for one K/V head (multi-query attention) is exactly the head's gradient."""

    @staticmethod
    def forward(ctx, layout, *params):
        ctx.layout = layout
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        lay = ctx.layout
        kv = slice(lay.q_rows, lay.q_rows + 2 * lay.kv_rows)
        mine = torch.cat([g[kv].reshape(-1) for g in grads])
        buf = mine.new_zeros(lay.kv_heads, mine.numel())
        buf[lay.kv_held[0]] = mine
        summed = _all_reduce(buf, lay.group)[lay.kv_held[0]]
        out, at = [], 0
        for g in grads:
            g = g.clone()
            n = g[kv].numel()
            g[kv] = summed[at:at + n].view_as(g[kv])
            at += n
            out.append(g)
        return (None, *out)


class TensorParallelAttention(_AgreedOnFirstCall, nn.Module):
    """Lecture 01's CausalSelfAttention split by heads, with Q, K and V FUSED into one
    column-parallel matmul, as in Megatron-LM: this rank's weight is [W_q; W_k; W_v] for its a/t
    query heads and the K/V heads they read. One matmul means one f: in backward the input
    gradient's all-reduce is started before the Q/K/V weight gradient is computed, and travels
    while it is (ColumnParallelLinearFunction). The output projection is row-parallel.

    K/V heads under grouped-query attention (a query heads, k K/V heads, t ranks):
    - t divides k ("split"): each rank holds k/t K/V heads, like the query heads.
    - k divides t ("replicated"): each rank's a/t query heads all read one K/V head; that head
      is held by the t/k ranks that need it (vLLM's replication of K/V heads), and its gradient
      is summed over them (ShareKVHeads).
    Other (a, k, t) would give a rank query heads of unequal groups: refused."""

    def __init__(self, n_heads, n_kv_heads, head_dim, d_model, group, bias=True, sequence_parallel=False,
                 device=None, dtype=None, _sync_replicated=True):
        super().__init__()
        n, r = _size_rank(group)
        _check_agreed({"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim, "d_model": d_model,
                       "bias": bias, "dtype": dtype or torch.get_default_dtype(),
                       "sequence_parallel": sequence_parallel}, group, "TensorParallelAttention")
        a, k, d = n_heads, n_kv_heads, head_dim
        if a % n:
            raise ValueError(f"TensorParallelAttention: tp={n} must divide the {a} attention heads")
        if k % n == 0:
            self.kv_layout, held = "split", list(range(r * k // n, (r + 1) * k // n))
        elif n % k == 0:
            self.kv_layout, held = "replicated", [r // (n // k)]
        else:
            raise ValueError(f"TensorParallelAttention: tp={n} must divide the {k} K/V heads or be a "
                             f"multiple of them (else a rank's {a // n} query heads read K/V heads "
                             "in unequal groups)")
        self.group, self.sequence_parallel, self.head_dim = group, sequence_parallel, d
        self.n_heads, self.kv_heads, self.tp = a, k, n
        self.q_heads_held = list(range(r * a // n, (r + 1) * a // n))
        self.kv_held = held
        self.q_rows, self.kv_rows = len(self.q_heads_held) * d, len(held) * d
        rows = self.q_rows + 2 * self.kv_rows
        # This rank's heads of the Q, K and V projections lecture 01's attention would draw with
        # this seed (q, k, v, each weight then bias, as its nn.Linears draw them), then o_proj
        rows_of = lambda heads: torch.cat([torch.arange(i * d, (i + 1) * d) for i in heads])
        q, kv = rows_of(self.q_heads_held), rows_of(held)
        init = _linear_init(d_model)
        draw = lambda shape: _shard_of_full(shape, None, group, init, device, dtype)
        (qw, qb), (kw, kb), (vw, vb) = [(draw((n_rows, d_model)), draw((n_rows,)) if bias else None)
                                        for n_rows in (a * d, k * d, k * d)]
        self.weight = nn.Parameter(torch.cat([qw[q], kw[kv], vw[kv]]))
        self.bias = nn.Parameter(torch.cat([qb[q], kb[kv], vb[kv]])) if bias else None
        if _sync_replicated and self.kv_layout == "replicated":
            self._share_kv_init()     # equal already under one seed; ranks seeded apart take the first holder's
        self.o_proj = RowParallelLinear(a * d, d_model, group, bias=bias, input_is_parallel=True,
                                        sequence_parallel=sequence_parallel, device=device, dtype=dtype,
                                        _sync_replicated=_sync_replicated)
        self.attend = causal_attention   # lecture 01's, as a fresh CausalSelfAttention has it

    @torch.no_grad()
    def _share_kv_init(self):
        """Give every copy of a replicated K/V head its first holder's fresh values: one all-reduce
        of a buffer with a slot per K/V head, which only the head's first holder fills."""
        if self.tp == 1:
            return
        _, r = _size_rank(self.group)
        first = r % (self.tp // self.kv_heads) == 0
        for p in (self.weight, self.bias):
            if p is None:
                continue
            kv = p[self.q_rows:]                               # [K rows; V rows] of one head
            buf = kv.new_zeros((self.kv_heads,) + tuple(kv.shape))
            if first:
                buf[self.kv_held[0]] = kv
            kv.copy_(_all_reduce(buf, self.group)[self.kv_held[0]])

    @classmethod
    def from_full(cls, attn, group, sequence_parallel=False):
        """This rank's heads of lecture 01's CausalSelfAttention (which is left untouched)."""
        if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
            raise TypeError(f"TensorParallelAttention.from_full needs lecture 01's CausalSelfAttention, "
                            f"got {type(attn).__name__}")
        w = attn.q_proj.weight
        layer = cls(attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.q_proj.in_features, group,
                    bias=attn.q_proj.bias is not None, sequence_parallel=sequence_parallel,
                    device=w.device, dtype=w.dtype, _sync_replicated=False)
        d = attn.head_dim
        q = torch.cat([torch.arange(i * d, (i + 1) * d) for i in layer.q_heads_held])
        kv = torch.cat([torch.arange(i * d, (i + 1) * d) for i in layer.kv_held])
        with torch.no_grad():
            layer.weight.copy_(torch.cat([attn.q_proj.weight[q], attn.k_proj.weight[kv], attn.v_proj.weight[kv]]))
            if layer.bias is not None:
                layer.bias.copy_(torch.cat([attn.q_proj.bias[q], attn.k_proj.bias[kv], attn.v_proj.bias[kv]]))
        layer.o_proj = RowParallelLinear.from_full(attn.o_proj, group, input_is_parallel=True,
                                                   sequence_parallel=sequence_parallel)
        layer.attend = attn.attend
        return layer

    def forward(self, x):
        self._agree_on_input(x, "TensorParallelAttention")
        _check_sequence_layout(x, self.sequence_parallel)
        w, b = self.weight, self.bias
        if self.kv_layout == "replicated" and self.tp > 1:
            w, b = (ShareKVHeads.apply(self, w, b) if b is not None else (ShareKVHeads.apply(self, w)[0], None))
        qkv = ColumnParallelLinearFunction.apply(x, w, b, self.group, self.sequence_parallel)
        bsz, s, _ = qkv.shape
        d, heads, kv_heads = self.head_dim, len(self.q_heads_held), len(self.kv_held)
        q, k, v = qkv.split([self.q_rows, self.kv_rows, self.kv_rows], dim=-1)
        q = q.reshape(bsz, s, heads, d).transpose(1, 2)
        k = k.reshape(bsz, s, kv_heads, d).transpose(1, 2)
        v = v.reshape(bsz, s, kv_heads, d).transpose(1, 2)
        if kv_heads != heads:   # grouped-query attention, as in lecture 01's CausalSelfAttention
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        y = self.attend(q, k, v)
        return self.o_proj(y.transpose(1, 2).reshape(bsz, s, heads * d))

    def full_tensors(self, grad=False):
        """The unsplit q_proj, k_proj and v_proj weights and biases, or their gradients
        (all-gathered; o_proj is a child with its own full_tensors)."""
        out = {}
        for name, p in (("weight", self.weight), ("bias", self.bias)):
            if p is None:
                continue
            every = _all_gather(_value(p, grad).unsqueeze(0), 0, self.group)   # (t, rows, ...)
            q = every[:, :self.q_rows].flatten(0, 1)
            k = every[:, self.q_rows:self.q_rows + self.kv_rows]
            v = every[:, self.q_rows + self.kv_rows:]
            if self.kv_layout == "replicated":   # one copy of each head: its first holder's
                k, v = k[::self.tp // self.kv_heads], v[::self.tp // self.kv_heads]
            out[f"q_proj.{name}"], out[f"k_proj.{name}"], out[f"v_proj.{name}"] = q, k.flatten(0, 1), v.flatten(0, 1)
        return out

    def extra_repr(self):
        return (f"query heads {self.q_heads_held} of {self.n_heads}, K/V heads {self.kv_held} of "
                f"{self.kv_heads} ({self.kv_layout}), fused [W_q; W_k; W_v] {tuple(self.weight.shape)}, "
                f"sequence_parallel={self.sequence_parallel}")
