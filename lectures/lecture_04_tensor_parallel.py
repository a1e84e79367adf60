"""Tensor and sequence parallelism: split every matrix of a layer across ranks

Each rank holds a slice of every weight matrix and computes its slice of every product; a few
collectives, written here as autograd functions with their forward *and* backward, put the
slices back together. The GPT of lecture 01 is split this way, checked against one process, and
then split again with PyTorch's DTensor sharding annotations.
"""
import contextlib
import copy
import fnmatch
import functools
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lectures.lecture_01_memory_and_precision import GPT, GPTConfig, batch, loss_fn
from util import device, figure, note, quiet, see, settings, span, span_at, spawn, table, timeline

SEQ_DIM = 1   # activations are (batch, seq, hidden): sequence parallelism splits dim 1

# =========================================================================================
# 1. The conjugate operators: collectives with a matching backward
# =========================================================================================
# Every operator takes the process group explicitly (as torch.distributed does) and never
# changes the tensor it was given. Megatron-LM (Shoeybi et al. 2019) calls the first pair f and
# g; sequence parallelism (Korthikanti et al. 2022) adds the all-gather / reduce-scatter pair.

_trace = False   # set by traced(): collectives record a span each, for the timeline demo


@contextlib.contextmanager
def traced():
    """Inside, every collective of this module records a span on this rank's timeline."""
    global _trace
    previous, _trace = _trace, True
    try:
        yield
    finally:
        _trace = previous


def _collective(label):
    """A span on this rank's timeline while traced() (collectives, and the compute they overlap)."""
    return span(label) if _trace else contextlib.nullcontext()


def _size_rank(group):
    return dist.get_world_size(group), dist.get_rank(group)


def _check_divisible(x, dim, n, what):
    if x.shape[dim] % n:
        raise ValueError(f"{what}: dimension {dim} of a {tuple(x.shape)} tensor does not split "
                         f"evenly over {n} ranks (pad it, or pick sizes divisible by {n})")


def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    out = x.contiguous().clone()          # a copy: the caller's tensor is never modified
    if dist.get_world_size(group) > 1:
        with _collective("all-reduce"):
            dist.all_reduce(out, op=op, group=group)
    return out


def _all_gather(x, dim, group):
    n, _ = _size_rank(group)
    if n == 1:
        return x
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((n * x0.shape[0], *x0.shape[1:]))
    with _collective("all-gather"):
        dist.all_gather_into_tensor(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x, dim, group):
    n, _ = _size_rank(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n, "reduce-scatter")
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // n, *x0.shape[1:]))
    with _collective("reduce-scatter"):
        dist.reduce_scatter_tensor(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def _split(x, dim, group):
    """This rank's contiguous slice of `x` along `dim` (no communication)."""
    n, r = _size_rank(group)
    _check_divisible(x, dim, n, "split")
    return x.chunk(n, dim)[r].contiguous()


class CopyToRegion(torch.autograd.Function):
    """Identity forward, all-reduce backward: Megatron's f, where a tensor enters a tensor-parallel region."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward, identity backward: Megatron's g, where partial sums leave a tensor-parallel region."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dim forward, keep this rank's slice backward (a column-parallel output made whole)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, grad.dim() - 1, ctx.group), None


class ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward, all-gather backward (a whole input fed to a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, grad.dim() - 1, ctx.group), None


class AllGatherSequence(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward: sequence parallelism's g, replacing f on entry."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward: sequence parallelism's g-bar, replacing g on exit."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class ScatterToSequence(torch.autograd.Function):
    """Keep this rank's slice of the sequence forward, all-gather backward: a replicated tensor enters a sequence-parallel region."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class GatherFromSequence(torch.autograd.Function):
    """All-gather along the sequence forward, keep this rank's slice backward: a sequence-parallel tensor made whole (to inspect it)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


def copy_to_region(x, group):
    return CopyToRegion.apply(x, group)


def reduce_from_region(x, group):
    return ReduceFromRegion.apply(x, group)


def gather_from_region(x, group):
    return GatherFromRegion.apply(x, group)


def scatter_to_region(x, group):
    return ScatterToRegion.apply(x, group)


def all_gather_sequence(x, group, dim=SEQ_DIM):
    return AllGatherSequence.apply(x, group, dim)


def reduce_scatter_sequence(x, group, dim=SEQ_DIM):
    return ReduceScatterSequence.apply(x, group, dim)


def scatter_to_sequence(x, group, dim=SEQ_DIM):
    return ScatterToSequence.apply(x, group, dim)


def gather_from_sequence(x, group, dim=SEQ_DIM):
    return GatherFromSequence.apply(x, group, dim)


# =========================================================================================
# 2. Parallel layers: column- and row-parallel linear, vocabulary-parallel embedding and loss
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


def _take(t, dim, group):
    """This rank's slice of a full parameter, detached (for from_full)."""
    return None if t is None else _split(t.detach(), dim, group)


class ColumnParallelLinearFunction(torch.autograd.Function):
    """f (or the sequence all-gather) fused with the matmul, so that backward can overlap:

        before:  dX = dY·W  ->  all-reduce(dX) ........ wait  ->  dW = dYᵀ·X
        now:     dX = dY·W  ->  all-reduce(dX) starts  ->  dW = dYᵀ·X  ->  wait

    The all-reduce (reduce-scatter under sequence parallelism) of the input gradient travels
    while the weight gradient is computed. Under sequence parallelism only this rank's slice of
    the input is saved, and backward all-gathers it again (Megatron-LM does the same): one more
    all-gather instead of a full-sequence activation kept for the whole step."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        ctx.group, ctx.sp, ctx.has_bias = group, sequence_parallel, bias is not None
        ctx.save_for_backward(x, weight)
        full = _all_gather(x, SEQ_DIM, group) if sequence_parallel else x
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group = ctx.group
        full = _all_gather(x, SEQ_DIM, group) if ctx.sp else x
        grad = grad.contiguous()
        grad_full_input = grad @ weight
        work, n = None, dist.get_world_size(group)
        if n > 1 and ctx.needs_input_grad[0]:
            if ctx.sp:
                _check_divisible(grad_full_input, SEQ_DIM, n, "reduce-scatter")
                src = grad_full_input.movedim(SEQ_DIM, 0).contiguous()
                grad_input = src.new_empty((src.shape[0] // n, *src.shape[1:]))
                start = time.perf_counter()
                work = dist.reduce_scatter_tensor(grad_input, src, group=group, async_op=True)
                label = "reduce-scatter (async)"
            else:
                grad_input = grad_full_input
                start = time.perf_counter()
                work = dist.all_reduce(grad_input, group=group, async_op=True)
                label = "all-reduce (async)"
        else:
            grad_input = grad_full_input
        # ... while it travels, the weight gradient
        with _collective("weight gradient (overlapped)"):
            grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ full.reshape(-1, full.shape[-1])
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        if work is not None:
            if _trace:   # the span ends when the collective completes, seen from gloo's thread
                done = []
                work.get_future().then(lambda _: done.append(time.perf_counter()))
            work.wait()
            if _trace:
                span_at(label, start, done[0] if done else time.perf_counter())
            if ctx.sp:
                grad_input = grad_input.movedim(0, SEQ_DIM).contiguous()
        return grad_input, grad_weight, grad_bias, None, None


class ColumnParallelLinear(nn.Module):
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
        n = dist.get_world_size(group)
        if out_features % n:
            raise ValueError(f"ColumnParallelLinear: {out_features} output features do not split "
                             f"over {n} ranks")
        self.group, self.gather_output = group, gather_output
        self.sequence_parallel, self.enter_region = sequence_parallel, enter_region
        self.in_features, self.out_features, self.full_out_features = in_features, out_features // n, out_features
        self.weight = nn.Parameter(torch.empty(out_features // n, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features // n, device=device, dtype=dtype)) if bias else None
        # A fresh layer's shards are initialised independently per rank; from_full() is how
        # to get a layer equal to a one-process nn.Linear.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1 / math.sqrt(in_features), 1 / math.sqrt(in_features))

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


class RowParallelLinear(nn.Module):
    """y = Σ_ranks x_r A_rᵀ + b with A's input columns split over the ranks: each rank multiplies
    its slice of the input features, and the partial sums are added by g (all-reduce), or with
    `sequence_parallel` reduce-scattered along the sequence.

    - `input_is_parallel`: the input is already this rank's slice of the features (a
      column-parallel layer's output); else the full input is split here.
    - The bias is added once, after the sum; under sequence parallelism each rank adds it to its
      slice of the sequence, so its gradient is partial and goes through f."""

    def __init__(self, in_features, out_features, group, bias=True, input_is_parallel=True,
                 sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        n = dist.get_world_size(group)
        if in_features % n:
            raise ValueError(f"RowParallelLinear: {in_features} input features do not split over {n} ranks")
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.in_features, self.full_in_features, self.out_features = in_features // n, in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // n, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1 / math.sqrt(in_features), 1 / math.sqrt(in_features))

    @classmethod
    def from_full(cls, linear, group, **options):
        """This rank's input columns of an ordinary nn.Linear (which is left untouched)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"RowParallelLinear.from_full needs an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device=w.device, dtype=w.dtype, **options)
        with torch.no_grad():
            layer.weight.copy_(_take(w, 1, group))
            if layer.bias is not None:
                layer.bias.copy_(linear.bias.detach())
        return layer

    def forward(self, x):
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


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding table split by token id: a rank looks up the tokens it owns, writes
    zeros for the others, and the ranks' partial rows are summed by g (or reduce-scattered along
    the sequence with `sequence_parallel`)."""

    def __init__(self, num_embeddings, embedding_dim, group, sequence_parallel=False, device=None, dtype=None):
        super().__init__()
        n, r = _size_rank(group)
        if num_embeddings % n:
            raise ValueError(f"VocabParallelEmbedding: vocabulary {num_embeddings} does not split over "
                             f"{n} ranks (Megatron pads the vocabulary to a multiple of the ranks)")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per = num_embeddings // n
        self.start, self.end = r * per, (r + 1) * per
        self.weight = nn.Parameter(torch.empty(per, embedding_dim, device=device, dtype=dtype))
        nn.init.normal_(self.weight)

    @classmethod
    def from_full(cls, embedding, group, **options):
        """This rank's rows of an ordinary nn.Embedding (which is left untouched)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding.from_full needs an nn.Embedding, got {type(embedding).__name__}")
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding does not support padding_idx or max_norm")
        w = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, device=w.device,
                    dtype=w.dtype, **options)
        with torch.no_grad():
            layer.weight.copy_(_take(w, 0, group))
        return layer

    def forward(self, tokens):
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial, self.group)
        return reduce_from_region(partial, self.group)

    def full_tensors(self, grad=False):
        return {"weight": _all_gather(_value(self.weight, grad), 0, self.group)}

    def extra_repr(self):
        return f"tokens [{self.start}, {self.end}) of {self.num_embeddings}, dim={self.embedding_dim}"


def vocab_parallel_cross_entropy(local_logits, targets, group):
    """Mean cross-entropy over all tokens when each rank holds only its vocabulary slice of the
    logits (..., v/tp): the full logits are never gathered. Per token it all-reduces three
    numbers' worth: the max (for stability), the sum of exponentials, and the target's logit.

        loss = log Σ_ranks Σ_local exp(z − m) − (z_target − m)

    g (all-reduce forward, identity backward) is the right conjugate for the sums because every
    rank then holds the same loss and back-propagates into its own slice."""
    n, r = _size_rank(group)
    per = local_logits.shape[-1]
    if targets.shape != local_logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match logits {tuple(local_logits.shape)}")
    if targets.numel() and (targets.min() < 0 or targets.max() >= per * n):
        raise ValueError(f"targets must lie in [0, {per * n}) (no ignore_index here)")
    z = local_logits.to(torch.promote_types(local_logits.dtype, torch.float32))  # at least fp32
    m = _all_reduce(z.detach().amax(dim=-1), group, op=dist.ReduceOp.MAX)   # constant: no gradient
    shifted = z - m.unsqueeze(-1)
    sum_exp = reduce_from_region(shifted.exp().sum(dim=-1), group)
    mine = (targets >= r * per) & (targets < (r + 1) * per)
    local_target = (targets - r * per).masked_fill(~mine, 0)
    picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine
    target_logit = reduce_from_region(picked, group)
    return (sum_exp.log() - target_logit).mean()


# =========================================================================================
# 3. Sequence-parallel pieces, and the K/V projection when tp does not divide the KV heads
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

    def __init__(self, num_embeddings, embedding_dim, group, device=None, dtype=None):
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.group = group

    @classmethod
    def from_full(cls, embedding, group):
        w = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, group, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            layer.weight.copy_(w)
        return layer

    def forward(self, positions):
        mine = _split(positions, positions.dim() - 1, self.group)
        return F.embedding(mine, copy_to_region(self.weight, self.group))


class ReplicatedKVLinear(nn.Module):
    """K or V projection when tp does not divide the KV heads (grouped-query attention with few
    KV heads): every rank keeps the whole layer and computes, for each of its query heads, the
    one KV head that query head reads. The weight passes through f, so the gradient of a KV head
    shared by several ranks is the sum of their contributions."""

    def __init__(self, linear, group, n_heads, n_kv_heads, head_dim):
        super().__init__()
        n, r = _size_rank(group)
        per = n_heads // n
        self.group, self.head_dim = group, head_dim
        self.weight = nn.Parameter(linear.weight.detach().clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        kv_of = [q // (n_heads // n_kv_heads) for q in range(r * per, (r + 1) * per)]
        rows = torch.cat([torch.arange(k * head_dim, (k + 1) * head_dim) for k in kv_of])
        self.register_buffer("rows", rows.to(linear.weight.device), persistent=False)
        self.in_features, self.out_features = linear.in_features, len(rows)
        self.kv_heads_read = kv_of

    def forward(self, x):
        w = copy_to_region(self.weight, self.group)[self.rows]
        b = None if self.bias is None else copy_to_region(self.bias, self.group)[self.rows]
        return F.linear(x, w, b)

    def full_tensors(self, grad=False):
        out = {"weight": _value(self.weight, grad).clone()}
        if self.bias is not None:
            out["bias"] = _value(self.bias, grad).clone()
        return out

    def extra_repr(self):
        return f"replicated, reads KV heads {self.kv_heads_read}"


# =========================================================================================
# 4. parallelize_gpt: a plan from module names to how each is split
# =========================================================================================
# Like torchtitan's parallelize functions, the model file (lecture 01) stays plain PyTorch and
# the parallelism is a plan applied afterwards: module-name patterns -> a style that builds the
# module's replacement (or hooks its input). Every module that owns parameters must be in the
# plan; one that is not is refused rather than silently left replicated.

def _replicate(module, group):
    """Keep the module whole on every rank (its gradients come out identical everywhere)."""
    return module


def _enter_region(module, group, sequence_parallel):
    """Apply f (or the sequence all-gather) once to the module's input: Q, K and V share it."""
    def hook(_module, args):
        x = args[0]
        x = all_gather_sequence(x, group) if sequence_parallel else copy_to_region(x, group)
        return (x, *args[1:])
    module.register_forward_pre_hook(hook)
    return module


def _kv_projection(linear, group, cfg):
    tp = dist.get_world_size(group)
    if cfg.kv_heads % tp == 0:   # enough KV heads: split them like the query heads
        return ColumnParallelLinear.from_full(linear, group, enter_region=False)
    return ReplicatedKVLinear(linear, group, cfg.n_heads, cfg.kv_heads, cfg.head_dim)


def gpt_plan(cfg, sequence_parallel=False):
    """The tensor-parallel plan for lecture 01's GPT, in the order it is applied (the token
    embedding before the LM head, so a tied head can share the embedding's slice)."""
    sp = sequence_parallel
    col, row = ColumnParallelLinear.from_full, RowParallelLinear.from_full
    norm = SequenceParallelLayerNorm.from_full if sp else _replicate
    return {
        "tok_emb": functools.partial(VocabParallelEmbedding.from_full, sequence_parallel=sp),
        "pos_emb": SequenceParallelPositions.from_full if sp else _replicate,
        "blocks.*.ln1": norm,
        "blocks.*.attn": functools.partial(_enter_region, sequence_parallel=sp),
        "blocks.*.attn.q_proj": functools.partial(col, enter_region=False),
        "blocks.*.attn.k_proj": functools.partial(_kv_projection, cfg=cfg),
        "blocks.*.attn.v_proj": functools.partial(_kv_projection, cfg=cfg),
        "blocks.*.attn.o_proj": functools.partial(row, input_is_parallel=True, sequence_parallel=sp),
        "blocks.*.ln2": norm,
        "blocks.*.mlp.fc_in": functools.partial(col, sequence_parallel=sp),
        "blocks.*.mlp.fc_out": functools.partial(row, input_is_parallel=True, sequence_parallel=sp),
        "ln_f": norm,
        # The LM head keeps its vocabulary slice of the logits: vocab_parallel_cross_entropy
        # reads them where they are, so the (b, s, v) logits never exist on one rank.
        "lm_head": functools.partial(col, sequence_parallel=sp, gather_output=False),
    }


def check_splittable(cfg, tp):
    """Refuse, with the reason, a GPT that tp ranks cannot split this way."""
    problems = []
    if cfg.n_heads % tp:
        problems.append(f"tp={tp} must divide the {cfg.n_heads} attention heads (each rank keeps whole heads)")
    # Any tp that divides the query heads works for the KV heads too: they are split when tp
    # divides them, else ReplicatedKVLinear serves each rank the KV heads its query heads read.
    if cfg.vocab_size % tp:
        problems.append(f"tp={tp} must divide the vocabulary of {cfg.vocab_size} (pad it to a multiple of tp)")
    if cfg.ff % tp:
        problems.append(f"tp={tp} must divide the MLP width {cfg.ff}")
    if problems:
        raise ValueError("parallelize_gpt cannot split this model: " + "; ".join(problems))


def parallelize_gpt(model, group, sequence_parallel=False, plan=None):
    """A tensor-parallel COPY of lecture 01's GPT on `group` (the model given is not modified):
    heads split across ranks (KV heads too, or replicated when tp does not divide them), the MLP
    column -> row, vocabulary-parallel embedding and LM head. Its forward returns this rank's
    vocabulary slice of the logits (b, s, v/tp); use `tp_loss` (vocab-parallel cross-entropy).
    With `sequence_parallel`, LayerNorms and the residual stream hold s/tp positions per rank, and
    the sequence length must be divisible by tp."""
    cfg, tp = model.cfg, dist.get_world_size(group)
    check_splittable(cfg, tp)
    tied = model.lm_head.weight is model.tok_emb.weight
    model = copy.deepcopy(model)   # never mutate what we were given
    plan = plan or gpt_plan(cfg, sequence_parallel)
    planned = set()
    for pattern, style in plan.items():
        for name, module in list(model.named_modules()):
            if not fnmatch.fnmatchcase(name, pattern):
                continue
            replacement = style(module, group)
            planned.add(name)
            if replacement is not module:
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, leaf, replacement)
            if name == "lm_head" and tied:   # same rows of the same table: share the slice
                replacement.weight = model.tok_emb.weight
    unplanned = [name for name, m in model.named_modules()
                 if name not in planned and any(True for _ in m.parameters(recurse=False))]
    if unplanned:
        raise ValueError(f"parallelize_gpt: no plan entry for {unplanned}; add one (or _replicate)")
    model.tp_group, model.sequence_parallel = group, sequence_parallel
    return model


def tp_loss(model, tokens, targets):
    """The mean next-token loss of a model from parallelize_gpt, without gathering the logits."""
    if model.sequence_parallel and tokens.shape[1] % dist.get_world_size(model.tp_group):
        raise ValueError(f"sequence parallelism needs tp={dist.get_world_size(model.tp_group)} to "
                         f"divide the sequence length {tokens.shape[1]}")
    return vocab_parallel_cross_entropy(model(tokens), targets, model.tp_group)


def full_parameters(model, grad=False):
    """{name: full tensor} of a model from parallelize_gpt, named like the unsplit GPT's
    parameters (slices all-gathered; every rank must call it). `grad=True`: the gradients."""
    out = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if hasattr(module, "full_tensors"):
            out.update({prefix + k: v for k, v in module.full_tensors(grad).items()})
        else:
            out.update({prefix + k: _value(p, grad).clone() for k, p in module.named_parameters(recurse=False)})
    return out


# =========================================================================================
# 5. The same split with PyTorch's DTensor: a plan of sharding annotations
# =========================================================================================

def dtensor_plan(sequence_parallel=False):
    """torch.distributed.tensor.parallel's plan for the GPT, module pattern -> ParallelStyle.
    Each style says how the module's weights are laid out (Colwise: Shard(0) of the weight,
    Rowwise: Shard(1)) and how its inputs and outputs are laid out on the mesh; DTensor derives
    the collectives (and their backward) from the layouts."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()     # how the residual stream is laid out
    plan = {
        # vocabulary-parallel embedding: rows of the table sharded, partial sums reduced
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "blocks.*.attn": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "blocks.*.attn.q_proj": ColwiseParallel(),
        "blocks.*.attn.k_proj": ColwiseParallel(),
        "blocks.*.attn.v_proj": ColwiseParallel(),
        "blocks.*.attn.o_proj": RowwiseParallel(output_layouts=residual),
        "blocks.*.mlp": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        "blocks.*.mlp.fc_in": ColwiseParallel(),
        "blocks.*.mlp.fc_out": RowwiseParallel(output_layouts=residual),
        # use_local_output=False: the logits stay a DTensor sharded on the vocabulary, which
        # loss_parallel() reads without gathering them
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan.update({
            # positions: rows sharded like the vocabulary, the sum reduce-scattered over the
            # sequence so it adds to the sequence-parallel token embedding
            "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "blocks.*.ln1": SequenceParallel(),
            "blocks.*.ln2": SequenceParallel(),
            "ln_f": SequenceParallel(),
        })
    return plan


def parallelize_gpt_dtensor(model, mesh, sequence_parallel=False):
    """A copy of the GPT split by torch's parallelize_module on a 1-D DeviceMesh."""
    from torch.distributed.tensor.parallel import parallelize_module
    cfg, tp = model.cfg, mesh.size()
    check_splittable(cfg, tp)
    if cfg.kv_heads % tp:
        raise ValueError(f"this DTensor plan splits KV heads too: tp={tp} must divide {cfg.kv_heads}")
    if cfg.tie_embeddings:
        raise ValueError("this DTensor plan does not tie the embedding (Rowwise) and head (Colwise) layouts")
    model = parallelize_module(copy.deepcopy(model), mesh, dtensor_plan(sequence_parallel))
    for block in model.blocks:
        # parallelize_module shards the weights but leaves nn.Linear's out_features at the full
        # width; the attention reads its local head count from it (torchtitan likewise sets
        # n_heads //= tp on each layer).
        for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
            proj.out_features //= tp
    return model


def train_dtensor(rank, world_size, cfg, steps=3, batch_size=5, lr=3e-3, seed=0, sequence_parallel=False):
    """train_tp's run with parallelize_module instead of parallelize_gpt. The loss is computed
    inside loss_parallel() (cross_entropy on logits sharded on the vocabulary never gathers
    them), and backward must run inside it too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    mesh = init_device_mesh(device().type, (world_size,), mesh_dim_names=("tp",))
    model = parallelize_gpt_dtensor(GPT(cfg).to(device()), mesh, sequence_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t
    out = {"losses": []}
    for step in range(steps):
        tokens, targets = (t.to(device()) for t in batch(cfg, batch_size, step, seed))
        logits = model(tokens)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        if step == 0:
            out["logits"] = full(logits.detach()).cpu()
            out["grads"] = {k: full(p.grad).detach().cpu() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(full(loss).item())
    out["params"] = {k: full(p.detach()).cpu() for k, p in model.named_parameters()}
    return out


# =========================================================================================
# 6. Rank functions: train the split GPT, and the single-process reference
# =========================================================================================

def tp_group(world_size, tp):
    """The tensor-parallel group of this rank: consecutive ranks (a node's GPUs) form a group.
    Every rank creates every group, in the same order, as torch.distributed requires."""
    if tp == world_size:
        return dist.group.WORLD
    mine = None
    for start in range(0, world_size, tp):
        g = dist.new_group(list(range(start, start + tp)))
        if dist.get_rank() in range(start, start + tp):
            mine = g
    return mine


def reference_loss(logits, targets):
    """Lecture 01's loss_fn, but a float64 model keeps float64 (loss_fn computes in float32),
    so the tests can compare to ~1e-12."""
    if logits.dtype == torch.float64:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss_fn(logits, targets)


def train_reference(cfg, steps=3, batch_size=5, lr=3e-3, seed=0):
    """One process, lecture 01's GPT and loss, torch.optim.AdamW: what the split model must equal.
    Returns the losses, the first step's logits and gradients, the parameters after `steps`."""
    model = GPT(cfg).to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = {"losses": []}
    for step in range(steps):
        tokens, targets = (t.to(device()) for t in batch(cfg, batch_size, step, seed))
        logits = model(tokens)
        loss = reference_loss(logits, targets)
        loss.backward()
        if step == 0:
            out["logits"] = logits.detach().cpu()
            out["grads"] = {k: p.grad.detach().cpu().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = {k: p.detach().cpu().clone() for k, p in model.named_parameters()}
    return out


def train_tp(rank, world_size, cfg, steps=3, batch_size=5, lr=3e-3, seed=0, tp=None,
             sequence_parallel=False, sync_layernorm_grads=True):
    """The same run, split over a tensor-parallel group of `tp` ranks (default: all of them).
    With tp < world_size the other groups train the same model independently: every group must
    equal the reference, which checks that nothing leaked across groups.
    `sync_layernorm_grads=False` (with sequence parallelism) leaves out the all-reduce of the
    LayerNorms' partial gradients: the demo of what goes wrong without it."""
    group = tp_group(world_size, tp or world_size)
    plan = None
    if not sync_layernorm_grads:
        plan = gpt_plan(cfg, sequence_parallel)
        for name in ("blocks.*.ln1", "blocks.*.ln2", "ln_f"):
            plan[name] = functools.partial(SequenceParallelLayerNorm.from_full, sync_grads=False)
    model = parallelize_gpt(GPT(cfg).to(device()), group, sequence_parallel=sequence_parallel, plan=plan)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = {"losses": []}
    for step in range(steps):
        tokens, targets = (t.to(device()) for t in batch(cfg, batch_size, step, seed))
        local_logits = model(tokens)
        loss = vocab_parallel_cross_entropy(local_logits, targets, group)
        loss.backward()
        if step == 0:
            out["logits"] = _all_gather(local_logits.detach(), local_logits.dim() - 1, group).cpu()
            out["grads"] = {k: v.cpu() for k, v in full_parameters(model, grad=True).items()}
            out["local_shapes"] = {k: tuple(p.shape) for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["params"] = {k: v.cpu() for k, v in full_parameters(model).items()}
    return out


# =========================================================================================
# 7. Rank functions of the demos
# =========================================================================================

def _collective_name(op):
    s = str(op).lower()
    for key, name in (("reduce_scatter", "reduce-scatter"), ("allgather", "all-gather"),
                      ("all_gather", "all-gather"), ("allreduce", "all-reduce"),
                      ("all_reduce", "all-reduce"), ("alltoall", "all-to-all"),
                      ("all_to_all", "all-to-all"), ("broadcast", "broadcast")):
        if key in s:
            return name
    return s


def count_collectives(fn):
    """(fn(), {collective: count}) as seen by torch's CommDebugMode, which intercepts both
    c10d calls (ours) and DTensor's functional collectives."""
    from torch.distributed.tensor.debug import CommDebugMode
    with CommDebugMode() as mode:
        result = fn()
    counts = {}
    for op, c in mode.get_comm_counts().items():
        name = _collective_name(op)
        counts[name] = counts.get(name, 0) + c
    return result, counts


def _seeded(seed):
    torch.manual_seed(seed)   # the same on every rank: the demos' full tensors agree
    return seed


def linear_demo(rank, world_size, b=3, s=5, h=8, h_out=12):
    """A column-parallel then a row-parallel layer against the unsplit nn.Linear pair: what each
    rank holds, and the largest difference in every output and gradient."""
    group, diff = dist.group.WORLD, lambda a, c: (a - c).abs().max().item()
    _seeded(0)
    a, c = nn.Linear(h, h_out).to(device()), nn.Linear(h_out, h).to(device())
    x = torch.randn(b, s, h, device=device())
    G = torch.randn(b, s, h, device=device())
    xr = x.clone().requires_grad_(True)
    ref = c(a(xr))
    (ref * G).sum().backward()
    col = ColumnParallelLinear.from_full(a, group)
    row = RowParallelLinear.from_full(c, group, input_is_parallel=True)
    xt = x.clone().requires_grad_(True)
    mid = col(xt)
    y = row(mid)
    (y * G).sum().backward()
    return {
        "shapes": {"x": tuple(x.shape), "column weight": tuple(col.weight.shape),
                   "column output (kept split)": tuple(mid.shape), "row weight": tuple(row.weight.shape),
                   "row output (summed)": tuple(y.shape)},
        "diffs": {"output": diff(y, ref), "input gradient": diff(xt.grad, xr.grad),
                  "column weight gradient": diff(col.full_tensors(grad=True)["weight"], a.weight.grad),
                  "row weight gradient": diff(row.full_tensors(grad=True)["weight"], c.weight.grad),
                  "biases' gradients": max(diff(col.full_tensors(grad=True)["bias"], a.bias.grad),
                                           diff(row.bias.grad, c.bias.grad))},
    }


def mlp_comms(rank, world_size, b=4, s=8, h=16, sequence_parallel=False):
    """The Megatron MLP, ours and DTensor's: collectives counted forward and backward, and the
    two outputs compared."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from util.measure import bytes_sent
    group, sp = dist.group.WORLD, sequence_parallel
    _seeded(1)
    full = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).to(device())
    x = torch.randn(b, s, h, device=device())
    G = torch.randn(b, s, h, device=device())
    xin = _split(x, 1, group) if sp else x
    Gin = _split(G, 1, group) if sp else G
    ours = nn.Sequential(ColumnParallelLinear.from_full(full[0], group, sequence_parallel=sp), nn.GELU(),
                         RowParallelLinear.from_full(full[2], group, sequence_parallel=sp))
    mesh = init_device_mesh(device().type, (world_size,))
    plan = ({"0": ColwiseParallel(input_layouts=Shard(1)), "2": RowwiseParallel(output_layouts=Shard(1))}
            if sp else {"0": ColwiseParallel(), "2": RowwiseParallel()})
    theirs = parallelize_module(copy.deepcopy(full), mesh, plan)
    out = {}
    for name, model in (("ours", ours), ("DTensor", theirs)):
        xx = xin.clone().requires_grad_(True)
        for _ in range(2):   # warm-up, so the bytes below are the steady state
            (model(xx) * Gin).sum().backward()
        with bytes_sent() as sent:
            y, fwd = count_collectives(lambda: model(xx))
            _, bwd = count_collectives(lambda: (y * Gin).sum().backward())
        out[name] = {"forward": fwd, "backward": bwd, "y": y.detach(), "bytes": sent.bytes}
    out["max |ours - DTensor|"] = (out["ours"]["y"] - out["DTensor"]["y"]).abs().max().item()
    return out


def attention_cases(rank, world_size, cases):
    """One training step of a one-layer GPT per (heads, KV heads) case: the logits and gradients
    (for comparing with one process) and what each rank keeps of Q and K."""
    out = []
    for cfg in cases:
        r = train_tp(rank, world_size, cfg, steps=1, batch_size=3)
        model = parallelize_gpt(GPT(cfg), dist.group.WORLD)
        attn = model.blocks[0].attn
        out.append({"logits": r["logits"], "grads": r["grads"],
                    "q heads": attn.q_proj.out_features // cfg.head_dim,
                    "kv heads": attn.k_proj.out_features // cfg.head_dim,
                    "kv kind": "split" if isinstance(attn.k_proj, ColumnParallelLinear) else
                               f"replicated, reads KV heads {attn.k_proj.kv_heads_read}"})
    return out


def refuse_split(rank, world_size, cfg):
    """parallelize_gpt's message for a model it cannot split."""
    try:
        parallelize_gpt(GPT(cfg), dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return None


def vocab_demo(rank, world_size, vocab=4096, b=4, s=32, h=32):
    """Vocabulary-parallel embedding, LM head and cross-entropy vs the unsplit ones: the loss, and
    the largest tensor this rank holds (saved for backward, or the logits) vs the full logits."""
    group = dist.group.WORLD
    _seeded(2)
    emb, head = nn.Embedding(vocab, h).to(device()), nn.Linear(h, vocab, bias=False).to(device())
    tokens = torch.randint(vocab, (b, s), device=device())
    targets = torch.randint(vocab, (b, s), device=device())
    ref = F.cross_entropy(head(emb(tokens)).flatten(0, 1), targets.flatten())
    ref.backward()
    pemb = VocabParallelEmbedding.from_full(emb, group)
    phead = ColumnParallelLinear.from_full(head, group)
    largest = [0]

    def pack(t):
        largest[0] = max(largest[0], t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = phead(pemb(tokens))
        loss = vocab_parallel_cross_entropy(logits, targets, group)
    loss.backward()
    largest[0] = max(largest[0], logits.numel() * logits.element_size())
    return {"loss": loss.item(), "ref": ref.item(),
            "grad diff": (pemb.full_tensors(grad=True)["weight"] - emb.weight.grad).abs().max().item(),
            "largest": largest[0], "full logits": b * s * vocab * logits.element_size(),
            "local logits": tuple(logits.shape)}


def _block_input(cfg, b, group, sp):
    _seeded(3)
    x = torch.randn(b, cfg.seq_len, cfg.d_model, device=device())
    G = torch.randn(b, cfg.seq_len, cfg.d_model, device=device())
    return (_split(x, 1, group), _split(G, 1, group)) if sp else (x, G)


def sp_traffic(rank, world_size, cfg, b=4):
    """One block's forward and backward with sequence parallelism off and on: the collectives
    (CommDebugMode) and the bytes this rank wrote (median of 5)."""
    import statistics
    from util.measure import bytes_sent
    group, out = dist.group.WORLD, {}
    for sp in (False, True):
        block = parallelize_gpt(GPT(cfg).to(device()), group, sequence_parallel=sp).blocks[0]
        x, G = _block_input(cfg, b, group, sp)
        x.requires_grad_(True)
        for _ in range(2):
            (block(x) * G).sum().backward()
        sizes = []
        for _ in range(5):
            with bytes_sent() as sent:
                (block(x) * G).sum().backward()
            sizes.append(sent.bytes)
        y, fwd = count_collectives(lambda: block(x))
        _, bwd = count_collectives(lambda: (y * G).sum().backward())
        out[sp] = {"forward": fwd, "backward": bwd, "bytes": statistics.median(sizes)}
    # The collectives alone, on one (b, s, h) activation: all-reduce vs reduce-scatter + all-gather
    x = torch.randn(b, cfg.seq_len, cfg.d_model, device=device())
    prims = {"all-reduce": lambda: _all_reduce(x, group),
             "reduce-scatter": lambda: _reduce_scatter(x, 1, group),
             "all-gather": lambda: _all_gather(_split(x, 1, group), 1, group)}
    out["activation bytes"] = x.numel() * x.element_size()
    for name, fn in prims.items():
        fn()
        sizes = []
        for _ in range(5):
            with bytes_sent() as sent:
                fn()
            sizes.append(sent.bytes)
        out[name] = statistics.median(sizes)
    return out


def saved_activation_bytes(block, x):
    """Bytes autograd saves for backward in block(x), each storage counted once, parameters
    excluded: the activation memory of one layer."""
    params = {p.data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
    return sum(seen.values()), y


def activation_memory(rank, world_size, cfg, b=4):
    """Activation bytes of one block on this rank, sequence parallelism off and on."""
    group, out = dist.group.WORLD, {}
    for sp in (False, True):
        block = parallelize_gpt(GPT(cfg).to(device()), group, sequence_parallel=sp).blocks[0]
        x, _ = _block_input(cfg, b, group, sp)
        out[sp] = saved_activation_bytes(block, x.requires_grad_(True))[0]
    return out


def traced_block(rank, world_size, cfg, b=8, sequence_parallel=False, steps=2):
    """A per-rank timeline of one block's forward and backward: compute spans around the
    collectives, which record their own spans (traced())."""
    group = dist.group.WORLD
    block = parallelize_gpt(GPT(cfg).to(device()), group, sequence_parallel=sequence_parallel).blocks[0]
    x, G = _block_input(cfg, b, group, sequence_parallel)
    x.requires_grad_(True)
    with quiet():
        (block(x) * G).sum().backward()   # warm-up
    with traced():
        for _ in range(steps):
            with span("forward"):
                y = block(x)
            with span("backward"):
                (y * G).sum().backward()


def _make_step(model, opt, cfg, batch_size, loss):
    tokens, targets = (t.to(device()) for t in batch(cfg, batch_size, 0))

    def step():
        loss(model, tokens, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def time_steps(rank, world_size, cfg, batch_size=16, kinds=("ours",), repeats=7):
    """Median training-step times (util.measure) of the kinds asked for, on the same ranks, with
    their repeats interleaved so that machine noise hits them alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from util.measure import measure_side_by_side
    steps = {}
    for kind in kinds:
        if kind == "one process":
            model = GPT(cfg).to(device())
            steps[kind] = _make_step(model, torch.optim.AdamW(model.parameters()), cfg, batch_size,
                                     lambda m, t, y: reference_loss(m(t), y))
        elif kind.startswith("ours"):
            model = parallelize_gpt(GPT(cfg).to(device()), dist.group.WORLD, sequence_parallel="SP" in kind)
            steps[kind] = _make_step(model, torch.optim.AdamW(model.parameters()), cfg, batch_size, tp_loss)
        else:
            mesh = init_device_mesh(device().type, (world_size,))
            model = parallelize_gpt_dtensor(GPT(cfg).to(device()), mesh, "SP" in kind)

            def dt_step(model=model, opt=torch.optim.AdamW(model.parameters())):
                from torch.distributed.tensor.parallel import loss_parallel
                tokens, targets = (t.to(device()) for t in batch(cfg, batch_size, 0))
                logits = model(tokens)
                with loss_parallel():
                    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            steps[kind] = dt_step
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # one core per rank, whatever the number of ranks
    try:
        with quiet():
            return measure_side_by_side(steps, warmup=2, repeats=repeats)
    finally:
        torch.set_num_threads(threads)


def redistribute_table(rank, world_size):
    """DTensor layouts on a 1-D mesh: for each (from, to), the collective CommDebugMode saw, the
    local shape, and whether the values are still the full tensor's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    mesh = init_device_mesh(device().type, (world_size,), mesh_dim_names=("tp",))
    full = torch.arange(4 * world_size * 2 * world_size, dtype=torch.float32,
                        device=device()).reshape(4 * world_size, 2 * world_size)
    rows = []
    cases = [(Shard(0), Replicate()), (Shard(0), Shard(1)), (Replicate(), Shard(0)),
             (Partial(), Replicate()), (Partial(), Shard(0))]
    for src, dst in cases:
        if isinstance(src, Partial):   # each rank holds full / N: the sum over ranks is `full`
            dt = DTensor.from_local(full / world_size, mesh, [src], run_check=False)
        else:
            dt = distribute_tensor(full, mesh, [src])
        moved, counts = count_collectives(lambda: dt.redistribute(mesh, [dst]))
        ok = torch.allclose(moved.full_tensor(), full)
        rows.append([str(src), str(dst), ", ".join(f"{k} ×{v}" for k, v in counts.items()) or "none",
                     str(tuple(dt.to_local().shape)), str(tuple(moved.to_local().shape)), ok])
    return rows


def compare_with_dtensor(rank, world_size, cfg, batch_size=4, steps=3, sequence_parallel=False):
    """Ours and DTensor's parallelize_module trained side by side from the same GPT; also the
    collectives of one step of each."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    out = {"ours": train_tp(rank, world_size, cfg, steps, batch_size, sequence_parallel=sequence_parallel),
           "DTensor": train_dtensor(rank, world_size, cfg, steps, batch_size, sequence_parallel=sequence_parallel)}
    tokens, targets = (t.to(device()) for t in batch(cfg, batch_size, 0))
    model = parallelize_gpt(GPT(cfg).to(device()), dist.group.WORLD, sequence_parallel=sequence_parallel)
    out["ours counts"] = count_collectives(lambda: tp_loss(model, tokens, targets).backward())[1]
    mesh = init_device_mesh(device().type, (world_size,))
    dmodel = parallelize_gpt_dtensor(GPT(cfg).to(device()), mesh, sequence_parallel)

    def dstep():
        logits = dmodel(tokens)
        with loss_parallel():
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    out["DTensor counts"] = count_collectives(dstep)[1]
    return out


# =========================================================================================
# 8. The lecture
# =========================================================================================

def demo_cfg():
    """Lecture 01's GPT as it trains there (quick: a shorter sequence)."""
    return GPTConfig(seq_len=16) if settings.quick else GPTConfig()


def tp_sizes():
    """The tensor-parallel sizes the demos show: 2 and 4 (quick: 2; the tests cover 4)."""
    return (2,) if settings.quick else (2, 4)


def max_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def fmt_counts(counts):
    return ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items())) or "none"


def intro():
    note("""
        # Tensor and sequence parallelism
        Data parallelism (lecture 03) copies the model and splits the batch; it stops helping when
        one layer no longer fits or is too slow on one device. Tensor parallelism splits the
        layer itself: every weight matrix is cut into slices, one per rank, and each rank
        computes its slice of every product. Megatron-LM (Shoeybi et al. 2019) showed that for a
        transformer the cuts can be placed so that a whole MLP or attention block needs a single
        all-reduce forward and a single one backward. Sequence parallelism (Korthikanti et al.
        2022) then splits what is left over (LayerNorms, residual stream) along the sequence.

        Every building block below is a few lines of PyTorch with its backward written out; each
        is checked against one process on real ranks (gloo on CPU, NCCL on GPUs), and the same
        split is then expressed with PyTorch's DTensor sharding annotations.
    """)
    see("https://arxiv.org/abs/1909.08053", "Shoeybi et al. 2019, Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism")
    see("https://arxiv.org/abs/2205.05198", "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models")


def conjugate_operators():
    note("""
        ## The conjugate operators f and g
        A tensor-parallel region starts where a replicated tensor is used by split weights and
        ends where split partial results are summed. Two operators mark the borders, each the
        other's transpose: **f** is the identity forward (every rank already has the input) and an
        all-reduce backward (each rank's slice of the weights contributes part of the input's
        gradient); **g** is an all-reduce forward (the partial sums are added) and the identity
        backward (the summed output's gradient is already on every rank). Each is an
        `autograd.Function` that takes its process group explicitly and never changes its input.
    """)
    see(CopyToRegion)
    see(ReduceFromRegion)
    note("Gathering or splitting the last dimension are a conjugate pair too, and so are the "
         "sequence-parallel all-gather and reduce-scatter (further down):")
    see(GatherFromRegion)
    see(ScatterToRegion)


def column_and_row():
    note("""
        ## Column- and row-parallel linear
        Write a linear layer as $Y = XA$ with $A$ of shape $h_{in} \\times h_{out}$. Split $A$ by
        **columns**, $A = [A_1, \\dots, A_N]$: rank $r$ computes $Y_r = XA_r$, its slice of the output
        features, and nothing needs adding (gather the slices only if someone needs all of $Y$).
        Split $A$ by **rows** and $X$ by columns to match: rank $r$ computes $X_r A_r$, a full-size
        *partial* result, and $Y = \\sum_r X_r A_r$ takes an all-reduce. A column-parallel layer
        followed by a row-parallel one needs no communication in between: the split output of the
        first is exactly the split input of the second. (`nn.Linear` stores $A^T$, so a column
        slice of $A$ is a slice of the weight's rows.)
    """)
    see(ColumnParallelLinear)
    see(RowParallelLinear)
    ref_shapes = None
    for n in tp_sizes():
        run = spawn(linear_demo, n, name=f"column then row-parallel linear, {n} ranks")
        r = run.returns[0]
        if ref_shapes is None:
            ref_shapes = {"x": r["shapes"]["x"]}
        table([[k, str(v)] for k, v in r["shapes"].items()] + [[f"max |ours − one process|: {k}", v] for k, v in r["diffs"].items()],
              header=["", f"{n} ranks (rank 0)"],
              caption=f"what each of {n} ranks holds, and the largest difference from nn.Linear in one process")
    note("""
        The differences are float32 rounding (the sums are added in another order). The input
        gradient is the interesting one: each rank's column slice contributes $dY_r A_r^T$, and
        f's all-reduce adds them.
    """)


def megatron_mlp():
    note("""
        ## The Megatron MLP: one all-reduce each way
        $\\mathrm{MLP}(X) = \\mathrm{GELU}(XA)B$ with $A$ column-parallel and $B$ row-parallel: the
        GELU is elementwise, so it runs on each rank's slice. Forward: f (nothing), two local
        matmuls, g (one all-reduce). Backward: g (nothing), two local matmuls, f (one all-reduce).
        Splitting $A$ by rows instead would need an all-reduce *before* the GELU, which does not
        commute with the sum. Counted below with PyTorch's `CommDebugMode`, for ours and for the
        same MLP split by DTensor's `ColwiseParallel`/`RowwiseParallel`:
    """)
    n = 2 if settings.quick or settings.world_size not in (2, 4) else settings.world_size
    rows = []
    for sp in (False, True):
        r = spawn(mlp_comms, n, sequence_parallel=sp,
                  name=f"Megatron MLP collectives, {'SP' if sp else 'no SP'}, {n} ranks").returns[0]
        for who in ("ours", "DTensor"):
            rows.append(["with SP" if sp else "without SP", who, fmt_counts(r[who]["forward"]),
                         fmt_counts(r[who]["backward"]), r[who]["bytes"]])
        rows.append(["with SP" if sp else "without SP", "max |ours − DTensor| (output)", r["max |ours - DTensor|"], "", ""])
    table(rows, header=["", "", "forward", "backward", "bytes this rank wrote (fwd + bwd)"],
          caption=f"collectives in one MLP forward and backward, {n} ranks (CommDebugMode; bytes from /proc/self/io)")
    note("""
        One all-reduce forward, one backward, for both. With sequence parallelism (below) each
        all-reduce becomes an all-gather on the way in and a reduce-scatter on the way out; ours
        also all-gathers the input a second time in backward, because it keeps only its slice of
        the input for the weight gradient (Megatron-LM does the same to save memory); DTensor keeps
        the gathered input instead. Our column-parallel backward also starts the input
        gradient's all-reduce before it computes the weight gradient, so the two overlap:
    """)
    see(ColumnParallelLinearFunction)


def attention_heads():
    note("""
        ## Attention: whole heads per rank
        Heads are independent until the output projection, so Q, K and V are column-parallel
        (each rank keeps $a/t$ whole heads), attention runs locally on those heads, and the output
        projection is row-parallel: again one all-reduce each way. This needs $t \\mid a$. With
        grouped-query attention there are fewer K/V heads ($a_{kv}$): when $t \\mid a_{kv}$ they
        are split like the queries; otherwise each rank keeps the K/V projection whole and
        computes just the K/V heads its query heads read, and f on those weights sums the
        gradient contributions of the ranks that share a head. Lecture 01's attention reads its
        head counts from the projection widths, so the same code runs on a rank's share.
    """)
    see(ReplicatedKVLinear)
    base = GPTConfig(n_layers=1, seq_len=8, d_model=32)
    cases = {2: [dict(n_heads=4), dict(n_heads=8, n_kv_heads=2), dict(n_heads=4, n_kv_heads=1)],
             4: [dict(n_heads=4), dict(n_heads=8, n_kv_heads=2), dict(n_heads=4, n_kv_heads=1)]}
    cases = {n: cases[n] for n in tp_sizes()}
    rows = []
    for n, overrides in cases.items():
        cfgs = [dataclasses_replace(base, **o) for o in overrides]
        got = spawn(attention_cases, n, cases=cfgs, name=f"attention heads split, {n} ranks").returns[0]
        for cfg, g in zip(cfgs, got):
            ref = train_reference(cfg, steps=1, batch_size=3)
            rows.append([n, cfg.n_heads, cfg.kv_heads, g["q heads"], g["kv heads"], g["kv kind"],
                         (g["logits"] - ref["logits"]).abs().max().item(), max_diff(g["grads"], ref["grads"])])
    table(rows, header=["tp", "heads", "KV heads", "Q heads per rank", "K/V heads computed per rank",
                        "K/V projection", "max |Δ logits|", "max |Δ gradient|"],
          caption="one step of a one-layer GPT against one process")
    n = tp_sizes()[-1]
    bad = dataclasses_replace(base, n_heads=n - 1, d_model=8 * (n - 1))
    msg = spawn(refuse_split, n, cfg=bad, name=f"attention heads: tp={n} does not divide {n - 1} head(s)").returns[0]
    note(f"With {n - 1} head(s) and {n} ranks there is no way to give each rank whole heads, and "
         f"`parallelize_gpt` says so: *{msg}*")


def dataclasses_replace(cfg, **changes):
    import dataclasses
    return dataclasses.replace(cfg, **changes)


def vocab_parallel():
    note("""
        ## Vocabulary-parallel embedding and cross-entropy
        The embedding table and the LM head are $v \\times h$, the largest matrices of a small
        model. Split the vocabulary: rank $r$ owns token ids $[rv/t, (r+1)v/t)$. The embedding
        looks up the tokens it owns, writes zeros for the rest, and g sums the ranks' rows. The
        LM head is column-parallel and keeps its slice of the logits; the loss is then computed
        from the slices: the max, the sum of exponentials and the target's logit are each
        all-reduced (one number per token each), and the $(b, s, v)$ logits never exist anywhere.
    """)
    see(VocabParallelEmbedding)
    see(vocab_parallel_cross_entropy)
    vocab = 1024 if settings.quick else 8192
    rows = []
    for n in tp_sizes():
        r = spawn(vocab_demo, n, vocab=vocab, name=f"vocab-parallel embedding and loss, {n} ranks").returns[0]
        rows.append([n, r["loss"], r["ref"], abs(r["loss"] - r["ref"]), r["grad diff"], str(r["local logits"]),
                     r["largest"], r["full logits"]])
    table(rows, header=["tp", "loss", "one process", "|Δ loss|", "max |Δ embedding grad|", "local logits",
                        "largest tensor a rank holds (bytes)", "full logits (bytes)"],
          caption=f"vocabulary {vocab}, batch 4 × 32 tokens, h = 32")
    note("The largest tensor a rank holds shrinks with tp: the logits it keeps are 1/tp of the full ones.")


def training():
    cfg, steps = demo_cfg(), (10 if settings.quick else 60)
    note(f"""
        ## A tensor-parallel GPT trains on lecture 01's task
        `parallelize_gpt` applies a plan, in the spirit of torchtitan: the model file stays plain
        PyTorch, and a dict from module names to how each is split is applied afterwards. It
        returns a copy, so the unsplit model stays available for comparison. Every module that
        owns parameters must be in the plan, or it refuses. Below, lecture 01's GPT
        ({cfg.n_layers} layers, h = {cfg.d_model}, {cfg.n_heads} heads, sequence {cfg.seq_len})
        trains for {steps} AdamW steps (batch 16) split over {" and ".join(map(str, tp_sizes()))} ranks, beside one process.
    """)
    see(gpt_plan)
    see(parallelize_gpt)
    ref = train_reference(cfg, steps=steps, batch_size=16)
    runs = {n: spawn(train_tp, n, cfg=cfg, steps=steps, batch_size=16, name=f"TP GPT trains, tp={n}").returns
            for n in tp_sizes()}
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(range(1, steps + 1), ref["losses"], lw=4, alpha=0.35, color="k", label="one process")
    for n, style in zip(tp_sizes(), ("-", "--")):
        ax.plot(range(1, steps + 1), runs[n][0]["losses"], style, label=f"tp={n}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    figure(fig, caption="training loss, tensor-parallel on top of one process")
    rows = []
    for n, r in runs.items():
        spread = max(max_diff(x["params"], r[0]["params"]) for x in r)
        rows.append([n, r[0]["losses"][-1], ref["losses"][-1], max_diff(r[0]["params"], ref["params"]), spread])
    table(rows, header=["tp", "final loss", "one process", "max |Δ parameter| vs one process",
                        "max |Δ| between ranks' gathered parameters"],
          caption=f"after {steps} steps (float32: the differences are rounding, amplified a little by Adam)")


def sequence_parallelism():
    cfg = demo_cfg()
    note("""
        ## Sequence parallelism
        Tensor parallelism leaves the LayerNorms, the residual adds (and dropout) replicated: every
        rank computes them on the whole $(b, s, h)$ activation and keeps the whole thing for
        backward. Korthikanti et al. split those along the sequence instead: each rank owns $s/t$
        positions there. Entering a tensor-parallel region then takes an **all-gather** along the
        sequence (backward: reduce-scatter), and leaving it a **reduce-scatter** (backward:
        all-gather). A ring all-reduce *is* a reduce-scatter followed by an all-gather, so the
        bytes are the same.
    """)
    see(AllGatherSequence)
    see(ReduceScatterSequence)
    n = 2
    r = spawn(sp_traffic, n, cfg=cfg, name=f"sequence parallelism: one block's collectives, {n} ranks").returns[0]
    table([["off" if not sp else "on", fmt_counts(r[sp]["forward"]), fmt_counts(r[sp]["backward"]), r[sp]["bytes"]]
           for sp in (False, True)],
          header=["SP", "forward", "backward", "bytes this rank wrote, fwd + bwd (median of 5)"],
          caption=f"one transformer block, {n} ranks, b = 4, s = {cfg.seq_len}, h = {cfg.d_model} (CommDebugMode; /proc/self/io)")
    ring = lambda k: (n - 1) / n * r["activation bytes"] * k
    table([["all-reduce", r["all-reduce"], ring(2)],
           ["reduce-scatter", r["reduce-scatter"], ring(1)],
           ["all-gather", r["all-gather"], ring(1)],
           ["reduce-scatter + all-gather", r["reduce-scatter"] + r["all-gather"], ring(2)]],
          header=["collective on one (b, s, h) activation", "bytes this rank wrote (measured)", "ring algorithm (formula)"],
          caption=f"{n} ranks, gloo on this machine, activation {r['activation bytes']} bytes")
    note(f"""
        In the ring algorithm (NCCL's), reduce-scatter + all-gather moves exactly the bytes of one
        all-reduce. gloo on CPU does not: its reduce-scatter wrote {r['reduce-scatter'] / r['all-reduce']:.2f}×
        the bytes of its all-reduce (it reduces everything, then keeps a slice), so here the block
        with SP wrote {r[True]['bytes'] / r[False]['bytes']:.2f}× the bytes of the block without. The
        rest of the extra is ours: the MLP's input all-gathered again in backward (the price of
        keeping only its slice) and six small all-reduces of the LayerNorm and row-parallel bias
        gradients, which under SP each rank computes from its positions only.
    """)
    note("""
        **Activation memory.** For one block, autograd saves (units of $bsh$ values, from counting
        what this code saves): the block input and the attention residual (LayerNorm inputs, 2),
        the two LayerNorm outputs read by the projections (2), Q, K, V (3), the attention output
        (1), the MLP's hidden layer before and after GELU (4 + 4). Tensor parallelism splits the
        last 12 but not the first 4: $4 + 12/t$. With sequence parallelism the LayerNorm inputs
        and the MLP input are slices, and only the all-gathered attention input (shared by Q, K,
        V) is whole: $1 + 15/t$. (Plus per-token LayerNorm statistics and the attention's
        log-sum-exp; CPU SDPA's flash kernel keeps no $s \\times s$ matrix, so the paper's
        $5as/h$ term is absent. The paper's Megatron with a fused QKV reaches $16/t$.)
    """)
    see(saved_activation_bytes)
    b = 4
    rows = []
    unit = b * cfg.seq_len * cfg.d_model * 4
    small = lambda t, sp: 4 * (4 * b * cfg.seq_len / (t if sp else 1) + b * cfg.n_heads * cfg.seq_len / t)
    one = saved_activation_bytes(GPT(cfg).blocks[0], torch.randn(b, cfg.seq_len, cfg.d_model, requires_grad=True))[0]
    rows.append([1, "—", one, unit * 16 + small(1, False), one / (unit * 16 + small(1, False))])
    for t in tp_sizes():
        m = spawn(activation_memory, t, cfg=cfg, b=b, name=f"sequence parallelism: activation bytes, {t} ranks").returns[0]
        for sp in (False, True):
            formula = unit * ((1 + 15 / t) if sp else (4 + 12 / t)) + small(t, sp)
            rows.append([t, "on" if sp else "off", m[sp], formula, m[sp] / formula])
    table(rows, header=["tp", "SP", "saved for backward, bytes per rank (measured)", "formula", "measured / formula"],
          caption=f"one block's activations, b = {b}, s = {cfg.seq_len}, h = {cfg.d_model}, float32")
    note("""
        **The LayerNorm gradients.** Under SP each rank's LayerNorm sees only its positions, so the
        gradient of its (replicated) weight and bias is a partial sum. They must be all-reduced —
        here, by passing the weights through f — or the replicas drift apart and none equals the
        one-process model:
    """)
    see(SequenceParallelLayerNorm)
    steps = 5
    ref = train_reference(cfg, steps=steps, batch_size=8)
    rows = []
    for sync in (True, False):
        rr = spawn(train_tp, 2, cfg=cfg, steps=steps, batch_size=8, sequence_parallel=True, sync_layernorm_grads=sync,
                   name=f"SP LayerNorm gradients {'all-reduced' if sync else 'not all-reduced'}").returns
        ln = [k for k in ref["params"] if ".ln" in k or k.startswith("ln_f")]
        rows.append(["all-reduced (f)" if sync else "left out", max_diff(rr[0]["params"], ref["params"]),
                     max((rr[0]["params"][k] - rr[1]["params"][k]).abs().max().item() for k in ln)])
    table(rows, header=["LayerNorm gradients", f"max |Δ parameter| vs one process after {steps} steps",
                        "max |rank 0 − rank 1| of the LayerNorm weights"],
          caption="sequence parallelism, 2 ranks")


def critical_path():
    from util.measure import machine, timing_ranks
    cfg = demo_cfg()
    note("""
        ## Communication on the critical path
        Data parallelism's all-reduce can hide behind the backward of earlier layers (lecture 03).
        Tensor parallelism's cannot, mostly: the next matmul needs the all-reduced activation.
        Only the input-gradient all-reduce of a column-parallel layer has work to hide behind (the
        weight gradient). The timeline of one block on 2 ranks shows it:
    """)
    run = spawn(traced_block, 2, cfg=cfg, b=8, name="TP block timeline, 2 ranks")
    figure(timeline(run.spans, title="one TP block: forward, backward and their collectives (2 steps)"),
           caption="per-rank spans measured on the ranks; the async all-reduce overlaps the weight-gradient matmul")
    ranks = timing_ranks(4)
    tps = [t for t in (1, 2, 4, 8) if t <= ranks]
    rows, times = [], {}
    for t in tps:
        kind = "one process" if t == 1 else "ours"
        times[t] = spawn(time_steps, t, cfg=cfg, batch_size=16, kinds=(kind,), repeats=3 if settings.quick else 9,
                         name=f"TP step time, tp={t}").returns[0][kind]
        rows.append([t, times[t].ms()])
    table(rows, header=["tp", "training step, median (IQR)"], caption=f"lecture 01's GPT, batch 16, {machine(ranks)}")
    ratio = times[tps[-1]].median / times[1].median
    why = ("slower: the model is tiny, so the collectives' fixed cost over TCP outweighs what "
           "splitting the matmuls saves" if ratio > 1 else
           f"faster, but short of the ideal 1/{tps[-1]}: every block waits for its collectives")
    note(f"""
        Each rank runs one thread, {machine(ranks)}: a step at tp={tps[-1]} takes
        {ratio:.2f}× the one-process time, {why}.

        On real hardware the question is bandwidth. Per layer, forward and backward, tensor
        parallelism all-reduces the $(b, s, h)$ activation 4 times (2 with SP as all-gather +
        reduce-scatter pairs, the same bytes); a ring all-reduce moves $2(t-1)/t$ of it per rank.
        For a GPT-3-sized layer in bf16 against the link speeds of lecture 02:
    """)
    rows = []
    for name, h, s_, t in (("GPT-3 175B layer", 12288, 2048, 8), ("Llama-2 70B-like layer", 8192, 4096, 8)):
        act = 1 * s_ * h * 2
        per_rank = 4 * 2 * (t - 1) / t * act
        flops = 72 * s_ * h * h / t                # fwd + bwd ≈ 3 × 24·b·s·h² per layer, split t ways
        compute = flops / 989e12                   # H100 SXM dense bf16 peak
        rows.append([name, f"h={h}, s={s_}, b=1, t={t}", per_rank / 1e6, compute * 1e3,
                     per_rank / 450e9 * 1e3, per_rank / 50e9 * 1e3])
    table(rows, header=["", "shape", "MB per rank per layer (fwd + bwd)", "compute ms at peak",
                        "NVLink 450 GB/s: ms", "InfiniBand NDR 50 GB/s: ms"],
          caption="computed, not measured: H100 peak 989 TFLOP/s bf16; link speeds per direction as in lecture 02")
    note("""
        Over NVLink the communication is a fraction of the compute; over InfiniBand it would be
        several times the compute, and nothing can hide it. Hence tensor parallelism stays inside
        a node (tp ≤ 8) and data/pipeline parallelism span nodes.
    """)


def dtensor_section():
    note("""
        ## Sharding annotations: DTensor
        GShard and GSPMD (Lepikhin et al. 2020; Xu et al. 2021) turned tensor parallelism into
        annotations: say how a few tensors are laid out over a mesh of devices, and the compiler
        propagates layouts and inserts the collectives. PyTorch's DTensor is the eager version: a
        tensor carries a `DeviceMesh` and a placement per mesh dimension — `Shard(d)`,
        `Replicate()`, or `Partial()` (each rank holds a summand) — and changing placement runs the
        collective that does it:
    """)
    see("https://arxiv.org/abs/2006.16668", "Lepikhin et al. 2020, GShard: Scaling Giant Models with Conditional Computation and Automatic Sharding")
    see("https://arxiv.org/abs/2105.04663", "Xu et al. 2021, GSPMD: General and Scalable Parallelization for ML Computation Graphs")
    see("https://pytorch.org/docs/stable/distributed.tensor.html", "PyTorch DTensor documentation")
    n = 2
    rows = spawn(redistribute_table, n, name=f"DTensor redistribute table, {n} ranks").returns[0]
    table(rows, header=["from", "to", "collective (CommDebugMode)", "local shape before", "after", "values equal the full tensor"],
          caption=f"a {4 * n}×{2 * n} tensor on a mesh of {n} ranks")
    note("""
        Shard → Replicate is an all-gather, Partial → Replicate an all-reduce, Partial → Shard a
        reduce-scatter, Replicate → Shard a local slice with no communication. Shard(0) → Shard(1)
        is an all-to-all on NCCL; gloo has none, and DTensor falls back to an all-gather and a
        slice (it says so in a warning), which is what the table shows on CPU.
    """)
    note("""
        `parallelize_module` applies a plan of such layouts to modules: `ColwiseParallel` shards a
        Linear's weight on dim 0, `RowwiseParallel` on dim 1, `SequenceParallel` runs a LayerNorm
        on sequence shards, `PrepareModuleInput` redistributes a module's input, and
        `loss_parallel()` computes cross-entropy on logits sharded on the vocabulary. The plan for
        the same GPT:
    """)
    see(dtensor_plan)
    cfg = GPTConfig(seq_len=8, d_model=32, n_heads=4, dtype="float64")
    rows = []
    for n, sp in ((2, False), (2 if settings.quick else 4, True)):
        r = spawn(compare_with_dtensor, n, cfg=cfg, sequence_parallel=sp,
                  name=f"ours vs DTensor parallelize_module, {n} ranks, {'SP' if sp else 'no SP'}").returns[0]
        rows.append([n, "on" if sp else "off", (r["ours"]["logits"] - r["DTensor"]["logits"]).abs().max().item(),
                     max_diff(r["ours"]["grads"], r["DTensor"]["grads"]),
                     max_diff(r["ours"]["params"], r["DTensor"]["params"]),
                     fmt_counts(r["ours counts"]), fmt_counts(r["DTensor counts"])])
    table(rows, header=["tp", "SP", "max |Δ logits|", "max |Δ gradient|", "max |Δ parameter| after 3 AdamW steps",
                        "ours: collectives per step", "DTensor: collectives per step"],
          caption="float64, the same GPT split both ways")
    note(f"""
        The two agree to rounding. Without SP the collectives per step are {"the same" if rows[0][5] == rows[0][6]
        else "different"}: {rows[0][5]} (ours) and {rows[0][6]} (DTensor). With SP they differ in where the work is done, not in what is computed: we
        all-gather the MLP input again in backward (keeping only a slice), and we all-reduce the
        partial gradients of the replicated LayerNorm weights and row-parallel biases during
        backward, through f; DTensor leaves those gradients as `Partial` placements, and the
        all-reduces happen later, when the optimizer step touches them (outside what is counted
        here). Ours is a few hundred lines you can read; DTensor's is a general layout algebra
        that derives the same collectives from the annotations.
    """)


def main():
    intro()
    conjugate_operators()       # the two operators everything else is built from
    column_and_row()            # the two ways to split one matrix
    megatron_mlp()              # composing them: one all-reduce per direction
    attention_heads()           # the same for attention, including GQA
    vocab_parallel()            # the biggest matrices: embedding, head and the loss
    training()                  # the whole GPT, split and trained, equal to one process
    sequence_parallelism()      # what TP leaves replicated, split along the sequence
    critical_path()             # why TP stays inside a node
    dtensor_section()           # the same thing as sharding annotations


def bench():
    """Our TP GPT step vs DTensor's parallelize_module step, same model and ranks, interleaved."""
    from util.measure import timing_ranks
    n = timing_ranks(2)
    t = spawn(time_steps, n, cfg=GPTConfig(), batch_size=16, kinds=("ours", "DTensor"), repeats=15,
              name="bench: ours vs DTensor TP").returns[0]
    return [f"lecture_04: TP GPT step (tp={n}) {t['ours'].median * 1e3:.1f} ms vs DTensor parallelize_module "
            f"{t['DTensor'].median * 1e3:.1f} ms: ratio {t['ours'].median / t['DTensor'].median:.2f} (target <= 1.1)"]
