"""The conjugate operators of tensor and sequence parallelism: collectives with a matching backward.

Megatron-LM (Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053) marks the borders of a
tensor-parallel region with two operators, each the other's transpose: f (identity forward,
all-reduce backward) where a replicated tensor enters, g (all-reduce forward, identity backward)
where partial sums leave. Sequence parallelism (Korthikanti et al. 2022,
https://arxiv.org/abs/2205.05198) replaces them with an all-gather / reduce-scatter pair along the
sequence. Each operator is a tiny `torch.autograd.Function` (lecture 04 shows them with see());
the layers built from them are in `lectures/tensor_parallel/layers.py` and `lectures/tensor_parallel/attention.py`.

Every operator takes the process group explicitly (as torch.distributed does) and never changes
the tensor it was given. Inside `traced()`, every collective records a span on this rank's
timeline.
"""
import contextlib
import time

import torch
import torch.distributed as dist

from util import span, span_at

SEQ_DIM = 1   # activations are (batch, seq, hidden): sequence parallelism splits dim 1

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
    """(ranks in `group`, this rank's place in it); refuses a group this rank is not in (where
    torch.distributed would answer -1 and a collective would silently do nothing)."""
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the process group it "
                         "was given: pass the tensor-parallel group this rank belongs to (every "
                         "rank of a group calls its layers; the other ranks use their own group)")
    return dist.get_world_size(group), rank


_check_shards = True   # shard_checks(False) turns the cross-rank shape check off (see below)


@contextlib.contextmanager
def shard_checks(enabled):
    """Turn on or off the check that every rank's sequence shard has the same shape and dtype.
    gloo and NCCL need equal sizes: unequal shards abort a process inside gloo (or hang NCCL).
    The check is one all-gather of 10 numbers before each sequence-parallel collective; demos
    that count or time the collectives Megatron's schedule needs turn it off."""
    global _check_shards
    previous, _check_shards = _check_shards, enabled
    try:
        yield
    finally:
        _check_shards = previous


_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _check_same_shard(x, group, what):
    """Raise on every rank, before the collective, if the ranks' tensors differ in shape or dtype."""
    n, _ = _size_rank(group)
    if n == 1 or not _check_shards:
        return
    if x.dim() > 8:
        raise ValueError(f"{what}: at most 8 dimensions, got {x.dim()}")
    code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else 99
    mine = torch.tensor([x.dim(), code, *x.shape, *[0] * (8 - x.dim())], dtype=torch.int64, device=x.device)
    every = mine.new_empty(n * mine.numel())
    dist.all_gather_single(every, mine, group=group)
    every = every.view(n, -1).tolist()
    if any(row != every[0] for row in every):
        shapes = [f"rank {r}: {tuple(row[2:2 + row[0]])} {_DTYPES[row[1]] if row[1] < len(_DTYPES) else 'other dtype'}"
                  for r, row in enumerate(every)]
        raise ValueError(f"{what}: the ranks' shards differ ({'; '.join(shapes)}); every rank of a "
                         "sequence-parallel group must hold the same number of positions, in the same dtype")


def _code(value):
    """A fact as an int: a dtype by its place in _DTYPES (99: another), a bool or an int as itself."""
    if isinstance(value, torch.dtype):
        return _DTYPES.index(value) if value in _DTYPES else 99
    return int(value)


def _check_agreed(facts, group, what):
    """Raise on every rank if the ranks' `facts` ({name: int, bool or dtype}, at most 16) differ.
    Ranks that build different layers (another head count, dtype or width) or feed them
    differently shaped inputs would otherwise abort inside gloo (unequal sizes), hang NCCL, or
    run silently when the sizes happen to match. One all-gather of a fixed-size vector, so the
    check cannot itself abort, and a host synchronisation: layers run it once when built and
    on every call (`shard_checks(False)` skips it)."""
    n, _ = _size_rank(group)
    if n == 1 or not _check_shards:
        return
    if len(facts) > 16:
        raise ValueError(f"{what}: at most 16 facts to agree on, got {len(facts)}")
    names = list(facts)
    on_gpu = dist.get_backend(group) == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    mine = torch.tensor([_code(facts[k]) for k in names] + [0] * (16 - len(names)), dtype=torch.int64, device=dev)
    every = mine.new_empty(n * 16)
    dist.all_gather_single(every, mine, group=group)
    every = every.view(n, 16).tolist()
    differ = [k for i, k in enumerate(names) if any(row[i] != every[0][i] for row in every)]
    if differ:
        show = lambda i, v: (str(_DTYPES[v]) if v < len(_DTYPES) else "another dtype") \
            if isinstance(facts[names[i]], torch.dtype) else str(v)
        ranks = "; ".join(f"rank {r}: " + ", ".join(f"{k}={show(names.index(k), row[names.index(k)])}"
                                                    for k in differ) for r, row in enumerate(every))
        raise ValueError(f"{what}: the ranks of the tensor-parallel group disagree ({ranks}); every rank "
                         "must build the same layer and call it with inputs of the same shape and dtype")


class _AgreedOnFirstCall:
    """Mixin for a tensor-parallel module: `_agree_on_input(x)` checks, on every call, that every
    rank's input has the same dtype and shape. A check on the first call only would let a later
    call with another shape on one rank (a ragged last batch, an evaluation at another length)
    abort the process inside gloo; the price is one small all-gather per call, a host sync under
    NCCL, which `shard_checks(False)` skips where shapes are known to agree (timed steps)."""

    def _agree_on_input(self, x, what):
        facts = {"input dtype": x.dtype, "input dims": x.dim()}
        facts.update({f"input size {i}": size for i, size in enumerate(x.shape[:8])})
        _check_agreed(facts, self.group, what)


def _check_divisible(x, dim, n, what):
    if x.shape[dim] % n:
        raise ValueError(f"{what}: dimension {dim} of a {tuple(x.shape)} tensor does not split "
                         f"evenly over {n} ranks (pad it, or pick sizes divisible by {n})")


# =========================================================================================
# The collectives, on a copy: the caller's tensor is never modified
# =========================================================================================

def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    """The sum (or `op`) of x over the ranks, in a new tensor."""
    n, _ = _size_rank(group)
    out = x.contiguous().clone()          # a copy: the caller's tensor is never modified
    if n > 1:
        with _collective("all-reduce"):
            dist.all_reduce(out, op=op, group=group)
    return out


def _all_gather(x, dim, group):
    """The ranks' tensors concatenated along `dim`, in rank order."""
    n, _ = _size_rank(group)
    if n == 1:
        return x
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((n * x0.shape[0], *x0.shape[1:]))
    with _collective("all-gather"):
        dist.all_gather_single(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x, dim, group):
    """This rank's slice along `dim` of the sum over the ranks."""
    n, _ = _size_rank(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n, "reduce-scatter")
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // n, *x0.shape[1:]))
    with _collective("reduce-scatter"):
        dist.reduce_scatter_single(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def _split(x, dim, group):
    """This rank's contiguous slice of `x` along `dim` (no communication)."""
    n, r = _size_rank(group)
    _check_divisible(x, dim, n, "split")
    return x.chunk(n, dim)[r].contiguous()


class _Pending:
    """An async collective in flight; wait() returns its result. While traced(), its span runs
    from the launch to the moment it completed, as seen from gloo's thread (not to the wait)."""

    def __init__(self, work, label, start, result):
        self.work, self.label, self.start, self.result = work, label, start, result

    def wait(self):
        done = []
        if _trace:
            try:
                self.work.get_future().then(lambda _: done.append(time.perf_counter()))
            except RuntimeError:      # gloo's all_gather_single has no future: its span ends at the wait
                pass
        self.work.wait()
        if _trace:
            span_at(self.label, self.start, done[0] if done else time.perf_counter())
        return self.result()


def _all_reduce_async_(x, group):
    """Start summing x over the ranks IN PLACE (x must be a buffer the caller owns); returns a _Pending."""
    start = time.perf_counter()
    work = dist.all_reduce(x, group=group, async_op=True)
    return _Pending(work, "all-reduce (async)", start, lambda: x)


def _all_gather_async(x, dim, group):
    """Start an all-gather of x along `dim`; returns a _Pending whose wait() gives the gathered tensor."""
    n = dist.get_world_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((n * x0.shape[0], *x0.shape[1:]))
    start = time.perf_counter()
    work = dist.all_gather_single(out, x0, group=group, async_op=True)
    return _Pending(work, "all-gather (async)", start, lambda: out.movedim(0, dim).contiguous())


def _reduce_scatter_async(x, dim, group):
    """Start a reduce-scatter of x along `dim`; returns a _Pending whose wait() gives this rank's slice."""
    n = dist.get_world_size(group)
    _check_divisible(x, dim, n, "reduce-scatter")
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // n, *x0.shape[1:]))
    start = time.perf_counter()
    work = dist.reduce_scatter_single(out, x0, group=group, async_op=True)
    return _Pending(work, "reduce-scatter (async)", start, lambda: out.movedim(0, dim).contiguous())


# =========================================================================================
# Tensor parallelism: f and g, and the gather / split pair of the last dimension
# =========================================================================================

class CopyToRegion(torch.autograd.Function):
    """Identity forward, all-reduce backward: Megatron's f, where a tensor enters a tensor-parallel region."""

    @staticmethod
    def forward(ctx, x, group):
        _size_rank(group)   # refuse a group without this rank now, not in backward
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


# =========================================================================================
# Sequence parallelism: the all-gather / reduce-scatter pair along the sequence
# =========================================================================================

class AllGatherSequence(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward: sequence parallelism's g, replacing f on entry."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        _check_same_shard(x, group, "all_gather_sequence")
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward: sequence parallelism's g-bar, replacing g on exit."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        _check_same_shard(x, group, "reduce_scatter_sequence")
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


# =========================================================================================
# The operators as functions
# =========================================================================================

def copy_to_region(x, group):
    """Megatron's f: identity forward, all-reduce backward."""
    return CopyToRegion.apply(x, group)


def reduce_from_region(x, group):
    """Megatron's g: all-reduce forward, identity backward."""
    return ReduceFromRegion.apply(x, group)


def gather_from_region(x, group):
    """All-gather the last dim forward, keep this rank's slice backward."""
    return GatherFromRegion.apply(x, group)


def scatter_to_region(x, group):
    """Keep this rank's slice of the last dim forward, all-gather backward."""
    return ScatterToRegion.apply(x, group)


def all_gather_sequence(x, group, dim=SEQ_DIM):
    """Sequence parallelism's g (in place of f): all-gather the sequence forward, reduce-scatter backward."""
    return AllGatherSequence.apply(x, group, dim)


def reduce_scatter_sequence(x, group, dim=SEQ_DIM):
    """Sequence parallelism's g-bar (in place of g): reduce-scatter the sequence forward, all-gather backward."""
    return ReduceScatterSequence.apply(x, group, dim)


def scatter_to_sequence(x, group, dim=SEQ_DIM):
    """Keep this rank's slice of the sequence forward, all-gather backward."""
    return ScatterToSequence.apply(x, group, dim)


def gather_from_sequence(x, group, dim=SEQ_DIM):
    """All-gather the sequence forward, keep this rank's slice backward."""
    return GatherFromSequence.apply(x, group, dim)
