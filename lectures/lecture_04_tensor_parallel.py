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
    norm = functools.partial(SequenceParallelLayerNorm.from_full) if sp else _replicate
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


def dtensor_loss(model, tokens, targets):
    """Vocabulary-parallel loss the DTensor way: inside loss_parallel(), cross_entropy on logits
    sharded on the vocabulary never gathers them. Backward must run inside it too."""
    from torch.distributed.tensor.parallel import loss_parallel
    logits = model(tokens)
    with loss_parallel():
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_dtensor(rank, world_size, cfg, steps=3, batch_size=5, lr=3e-3, seed=0, sequence_parallel=False):
    """train_tp's run with parallelize_module instead of parallelize_gpt."""
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
             sequence_parallel=False, plan=None):
    """The same run, split over a tensor-parallel group of `tp` ranks (default: all of them).
    With tp < world_size the other groups train the same model independently: every group must
    equal the reference, which checks that nothing leaked across groups."""
    group = tp_group(world_size, tp or world_size)
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


def main():
    pass
