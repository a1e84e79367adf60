"""Tensor-parallel layers: column- and row-parallel linear, the sequence-parallel LayerNorm and
positions. The attention built from them is in `lectures/tensor_parallel/attention.py`.

Megatron-LM (Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053) splits a Linear's weight by
output rows (column-parallel: each rank computes its slice of the output features) or by input
columns (row-parallel: each rank computes a partial sum), so that a column-parallel layer feeding
a row-parallel one needs one all-reduce forward and one backward. Sequence parallelism
(Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198) splits what stays replicated
(LayerNorms, positions) along the sequence. Each layer has `from_full(layer, group)` (this rank's
share of an ordinary layer, which is left untouched) and `full_tensors()` (the unsplit weights or
gradients, for checks). A layer built fresh draws its shards on each rank and broadcasts what is
replicated (a row-parallel bias, positions, K/V heads held by several ranks) from the group's
first rank, so that the copies agree; every rank of the group must construct it. The operators
they are built from are in `lectures/tensor_parallel/ops.py`, the vocabulary-parallel embedding and loss in
`lectures/tensor_parallel/vocab.py`, and the plan that applies them all to the GPT in `lectures/tensor_parallel/gpt.py`.
"""
import math

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lectures.tensor_parallel.ops import (SEQ_DIM, _AgreedOnFirstCall, _all_gather, _all_gather_async, _check_agreed, _check_same_shard,
                                          _all_reduce_async_, _collective, _reduce_scatter_async, _size_rank, _split,
                                          copy_to_region, gather_from_region, reduce_from_region,
                                          reduce_scatter_sequence, scatter_to_region)


# =========================================================================================
# Column- and row-parallel linear
# =========================================================================================

def _value(p, grad):
    """A parameter's value, or its gradient (zeros if backward never reached it)."""
    if not grad:
        return p.detach()
    return p.grad.detach() if p.grad is not None else torch.zeros_like(p)


def _check_sequence_layout(x, sequence_parallel):
    if sequence_parallel and x.dim() != 3:
        raise ValueError(f"sequence parallelism splits dim {SEQ_DIM} of (batch, seq, hidden) "
                         f"activations; got a {x.dim()}-D tensor of shape {tuple(x.shape)}")


def _replicate_(t, group):
    """Overwrite `t` with the group's first rank's values (a broadcast), so that a parameter every
    rank holds a copy of starts equal on all of them. A fresh layer draws its values on each rank
    from that rank's random stream; without this its replicated parameters would differ across
    the ranks and the layer would silently compute with several different models."""
    n, _ = _size_rank(group)
    if t is not None and n > 1:
        with torch.no_grad():
            dist.broadcast(t.data, group=group, group_src=0)


def _take(t, dim, group):
    """This rank's slice of a full parameter, detached (for from_full)."""
    return None if t is None else _split(t.detach(), dim, group)


def _shard_of_full(full_shape, dim, group, init, device=None, dtype=None):
    """This rank's slice along `dim` (None: all of it) of ONE full tensor drawn with `init` (Megatron's CPU
    initialisation). The launcher seeds every rank alike, so each rank draws the same full tensor
    and keeps a different slice: together they hold one layer, the one nn.Linear (or nn.Embedding)
    would draw with that seed. Drawing only the shard would give every rank the same numbers, and
    a fresh tensor-parallel layer 1/t of its width. Costs one full tensor, briefly, per rank."""
    full = torch.empty(full_shape, device=device, dtype=dtype)
    init(full)
    return full if dim is None else _take(full, dim, group).clone()


def _linear_init(fan_in):
    """nn.Linear's initialisation, U(±1/√fan_in) for the weight and the bias alike."""
    bound = 1 / math.sqrt(fan_in)
    return lambda t: nn.init.uniform_(t, -bound, bound)


class ColumnParallelLinearFunction(torch.autograd.Function):
    """f (or the sequence all-gather) fused with the matmul, so that backward can overlap:

        before:  dX = dY·W  ->  all-reduce(dX) ........ wait  ->  dW = dYᵀ·X
        now:     dX = dY·W  ->  all-reduce(dX) starts  ->  dW = dYᵀ·X  ->  wait

    The all-reduce (reduce-scatter under sequence parallelism) of the input gradient travels
    while the weight gradient is computed. Under sequence parallelism only this rank's slice of
    the input is saved, and backward all-gathers it again (Megatron-LM does the same): one more
    all-gather instead of a full-sequence activation kept for the whole step. That re-gather is
    needed only by the weight gradient, so it travels while the input gradient is computed:

        SP:      all-gather(X) starts  ->  dX = dY·W  ->  wait  ->  reduce-scatter(dX) starts
                 ->  dW = dYᵀ·X  ->  wait"""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        ctx.group, ctx.sp, ctx.has_bias = group, sequence_parallel, bias is not None
        ctx.save_for_backward(x, weight)
        if sequence_parallel:
            _check_same_shard(x, group, "sequence-parallel column-parallel input")
        full = _all_gather(x, SEQ_DIM, group) if sequence_parallel else x
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gathering = _all_gather_async(x, SEQ_DIM, ctx.group) if ctx.sp and dist.get_world_size(ctx.group) > 1 else None
        grad = grad.contiguous()
        with _collective("input gradient (overlapped)") if gathering else contextlib.nullcontext():
            grad_input = grad @ weight
        full = gathering.wait() if gathering else x
        # Start summing the input gradient over the ranks (f's all-reduce, or the reduce-scatter
        # of the sequence all-gather) ...
        pending = None
        if dist.get_world_size(ctx.group) > 1 and ctx.needs_input_grad[0]:
            pending = (_reduce_scatter_async(grad_input, SEQ_DIM, ctx.group) if ctx.sp
                       else _all_reduce_async_(grad_input, ctx.group))   # grad_input is ours: in place
        # ... while it travels, the weight gradient
        with _collective("weight gradient (overlapped)"):
            grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ full.reshape(-1, full.shape[-1])
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        if pending is not None:
            grad_input = pending.wait()
        return grad_input, grad_weight, grad_bias, None, None


class ColumnParallelLinear(_AgreedOnFirstCall, nn.Module):
    """y = x Aᵀ + b with A's output rows (the columns of the math's XA) split over the ranks:
    this rank computes its slice of the output features and nothing needs summing.

    - `gather_output`: all-gather the slices into the full output (else each rank keeps its slice,
      which is what a following row-parallel layer wants).
    - `sequence_parallel`: the input arrives split along the sequence and is all-gathered on
      entry (its gradient reduce-scattered) instead of passing through f.
    - `enter_region=False`: the caller has already applied f (or the all-gather) once for
      several layers reading the same input, e.g. Q, K and V."""

    def __init__(self, in_features, out_features, group, bias=True, gather_output=False,
                 sequence_parallel=False, enter_region=True, device=None, dtype=None):
        super().__init__()
        n, _ = _size_rank(group)
        _check_agreed({"in_features": in_features, "out_features": out_features, "bias": bias,
                       "dtype": dtype or torch.get_default_dtype(), "sequence_parallel": sequence_parallel,
                       "gather_output": gather_output, "enter_region": enter_region}, group, "ColumnParallelLinear")
        if out_features % n:
            raise ValueError(f"ColumnParallelLinear: {out_features} output features do not split "
                             f"over {n} ranks")
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel, self.enter_region = sequence_parallel, enter_region
        self.in_features, self.out_features, self.full_out_features = in_features, out_features // n, out_features
        # This rank's rows of the nn.Linear(in_features, out_features) this seed would draw
        # (weight first, then bias, as nn.Linear draws them); from_full() slices a given one.
        init = _linear_init(in_features)
        self.weight = nn.Parameter(_shard_of_full((out_features, in_features), 0, group, init, device, dtype))
        self.bias = nn.Parameter(_shard_of_full((out_features,), 0, group, init, device, dtype)) if bias else None

    @classmethod
    def from_full(cls, linear, group, **options):
        """This rank's rows of an ordinary nn.Linear (which is left untouched)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"ColumnParallelLinear.from_full needs an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=w.device, dtype=w.dtype, **options)
        with torch.no_grad():
            layer.weight.copy_(_take(w, 0, group))
            if layer.bias is not None:
                layer.bias.copy_(_take(linear.bias, 0, group))
        return layer

    def forward(self, x):
        self._agree_on_input(x, "ColumnParallelLinear")
        _check_sequence_layout(x, self.sequence_parallel and self.enter_region)
        if self.enter_region:
            y = ColumnParallelLinearFunction.apply(x, self.weight, self.bias, self.group, self.sequence_parallel)
        else:
            y = F.linear(x, self.weight, self.bias)
        return gather_from_region(y, self.group) if self.gather_output else y

    def full_tensors(self, grad=False):
        """The unsplit weight and bias, or their gradients (all-gathered; for checks)."""
        out = {"weight": _all_gather(_value(self.weight, grad), 0, self.group)}
        if self.bias is not None:
            out["bias"] = _all_gather(_value(self.bias, grad), 0, self.group)
        return out

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features} of {self.full_out_features}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_AgreedOnFirstCall, nn.Module):
    """y = Σ_ranks x_r A_rᵀ + b with A's input columns split over the ranks: each rank multiplies
    its slice of the input features, and the partial sums are added by g (all-reduce), or with
    `sequence_parallel` reduce-scattered along the sequence.

    - `input_is_parallel`: the input is already this rank's slice of the features (a
      column-parallel layer's output); else the full input is split here.
    - The bias is added once, after the sum; under sequence parallelism each rank adds it to its
      slice of the sequence, so its gradient is partial and goes through f."""

    def __init__(self, in_features, out_features, group, bias=True, input_is_parallel=True,
                 sequence_parallel=False, device=None, dtype=None, _sync_replicated=True):
        super().__init__()
        n, _ = _size_rank(group)
        _check_agreed({"in_features": in_features, "out_features": out_features, "bias": bias,
                       "dtype": dtype or torch.get_default_dtype(), "sequence_parallel": sequence_parallel,
                       "input_is_parallel": input_is_parallel}, group, "RowParallelLinear")
        if in_features % n:
            raise ValueError(f"RowParallelLinear: {in_features} input features do not split over {n} ranks")
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.in_features, self.full_in_features, self.out_features = in_features // n, in_features, out_features
        # This rank's input columns of the nn.Linear(in_features, out_features) this seed would
        # draw: U(±1/√in_features), the full fan-in (kaiming_uniform_ on the shard would take
        # in_features / n and draw √n too wide).
        init = _linear_init(in_features)
        self.weight = nn.Parameter(_shard_of_full((out_features, in_features), 1, group, init, device, dtype))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(_shard_of_full((out_features,), None, group, init, device, dtype))
            if _sync_replicated:      # replicated: equal already under one seed; ranks seeded apart take rank 0's
                _replicate_(self.bias, group)

    @classmethod
    def from_full(cls, linear, group, **options):
        """This rank's input columns of an ordinary nn.Linear (which is left untouched)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"RowParallelLinear.from_full needs an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=w.device, dtype=w.dtype, _sync_replicated=False, **options)
        with torch.no_grad():
            layer.weight.copy_(_take(w, 1, group))
            if layer.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        return layer

    def forward(self, x):
        self._agree_on_input(x, "RowParallelLinear")
        _check_sequence_layout(x, self.sequence_parallel)
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group)
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(partial, self.group)
            return y if self.bias is None else y + copy_to_region(self.bias, self.group)
        y = reduce_from_region(partial, self.group)
        return y if self.bias is None else y + self.bias

    def full_tensors(self, grad=False):
        out = {"weight": _all_gather(_value(self.weight, grad), 1, self.group)}
        if self.bias is not None:
            out["bias"] = _value(self.bias, grad).clone()
        return out

    def extra_repr(self):
        return (f"in={self.in_features} of {self.full_in_features}, out={self.out_features}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


# =========================================================================================
# Sequence-parallel pieces, and the K/V projection when tp does not divide the KV heads
# =========================================================================================

class SequenceParallelLayerNorm(nn.LayerNorm):
    """LayerNorm on this rank's slice of the sequence. Its weight and bias are replicated but
    see only this slice, so their gradients are partial: they pass through f, whose backward
    all-reduces them (`sync_grads=False` leaves that out, to show what goes wrong)."""

    def __init__(self, normalized_shape, group, eps=1e-5, sync_grads=True, device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, device=device, dtype=dtype)
        self.group, self.sync_grads = group, sync_grads

    @classmethod
    def from_full(cls, ln, group, **options):
        if not isinstance(ln, nn.LayerNorm) or not ln.elementwise_affine or ln.bias is None:
            raise TypeError("SequenceParallelLayerNorm.from_full needs an affine nn.LayerNorm with a bias")
        layer = cls(ln.normalized_shape, group, eps=ln.eps, device=ln.weight.device, dtype=ln.weight.dtype, **options)
        with torch.no_grad():
            layer.weight.copy_(ln.weight)
            layer.bias.copy_(ln.bias)
        return layer

    def forward(self, x):
        w, b = self.weight, self.bias
        if self.sync_grads:
            w, b = copy_to_region(w, self.group), copy_to_region(b, self.group)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class SequenceParallelPositions(nn.Embedding):
    """A replicated position table read only at this rank's slice of the positions, so that it
    adds to a sequence-parallel token embedding; its gradient is partial and goes through f."""

    def __init__(self, num_embeddings, embedding_dim, group, device=None, dtype=None, _sync_replicated=True):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.group = group
        _size_rank(group)
        if _sync_replicated:          # replicated: every rank takes rank 0's draw
            _replicate_(self.weight, group)

    @classmethod
    def from_full(cls, embedding, group):
        w = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, device=w.device, dtype=w.dtype,
                    _sync_replicated=False)
        with torch.no_grad():
            layer.weight.copy_(w)
        return layer

    def forward(self, positions):
        mine = _split(positions, positions.dim() - 1, self.group)
        return F.embedding(mine, copy_to_region(self.weight, self.group))
