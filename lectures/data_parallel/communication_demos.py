"""What each rank runs in lecture 02's demos, and the one-process references they are checked
against; the lecture launches them with spawn() and narrates what they return."""
import time

import torch
import torch.distributed as dist

from util import device, span, span_at
from util.measure import Timing, measure, measure_side_by_side, value_range

from lectures.data_parallel.collectives import pipelined_ring_all_reduce, ring_all_reduce
from lectures.data_parallel.overlap import agreed_wait, measured_against_model, release_core


# Timings this page takes once and reuses: the built-in all-reduce in the race against our rings,
# and the all-reduce sweep that both the bandwidth section and the α–β fit read, keyed by
# (ranks, quick, size) so a notebook that changes a knob measures afresh.
MEASURED = {}


# =========================================================================================
# 1. The hardware hierarchy
# =========================================================================================

def copy_time(nbytes, repeats):
    """A `Timing` of copying an `nbytes` buffer in this process's memory."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return measure(lambda: dst.copy_(src), warmup=1, repeats=repeats)


# =========================================================================================
# 2. The collectives, each on real ranks
# =========================================================================================
# Rank r starts with values 10*r + i, so a value says where it came from: 23 is element 3 of
# rank 2. `chunk` elements per rank-sized piece; the figures use 2, the tests other sizes.

def rank_data(rank, length):
    return torch.arange(length, dtype=torch.float32) + 10 * rank


def _cpu(t):
    return None if t is None else t.detach().to("cpu").clone()


def demo_broadcast(rank, world_size, chunk=2):
    x = rank_data(rank, chunk * world_size).to(device())
    before = _cpu(x)
    dist.broadcast(x, src=0)            # everyone ends with rank 0's tensor
    return {"before": before, "after": _cpu(x)}


def demo_scatter(rank, world_size, chunk=2):
    pieces = list(rank_data(0, chunk * world_size).to(device()).chunk(world_size)) if rank == 0 else None
    out = torch.zeros(chunk, device=device())
    before = torch.cat(pieces).cpu() if rank == 0 else None
    dist.scatter(out, scatter_list=pieces, src=0)   # piece r goes to rank r
    return {"before": before, "after": _cpu(out)}


def demo_gather(rank, world_size, chunk=2):
    x = rank_data(rank, chunk).to(device())
    slots = [torch.zeros_like(x) for _ in range(world_size)] if rank == 0 else None
    dist.gather(x, gather_list=slots, dst=0)        # only rank 0 receives
    return {"before": _cpu(x), "after": torch.cat(slots).cpu() if rank == 0 else None}


def demo_reduce(rank, world_size, chunk=2):
    x = rank_data(rank, chunk * world_size).to(device())
    before = _cpu(x)
    dist.reduce(x, dst=0)   # rank 0 gets the sum; other ranks' buffers are scratch space
    return {"before": before, "after": _cpu(x)}


def demo_all_gather(rank, world_size, chunk=2):
    x = rank_data(rank, chunk).to(device())
    out = torch.zeros(chunk * world_size, device=device())
    dist.all_gather_single(out, x)
    return {"before": _cpu(x), "after": _cpu(out)}


def demo_reduce_scatter(rank, world_size, chunk=2):
    x = rank_data(rank, chunk * world_size).to(device())
    out = torch.zeros(chunk, device=device())
    dist.reduce_scatter_single(out, x)  # rank r gets the sum of everyone's piece r
    return {"before": _cpu(x), "after": _cpu(out)}


def demo_all_reduce(rank, world_size, chunk=2):
    x = rank_data(rank, chunk * world_size).to(device())
    before = _cpu(x)
    dist.all_reduce(x)
    return {"before": before, "after": _cpu(x)}


def demo_all_to_all(rank, world_size, chunk=2):
    x = rank_data(rank, chunk * world_size).to(device())
    out = torch.zeros_like(x)
    dist.all_to_all_single(out, x)      # piece j of rank i becomes piece i of rank j
    return {"before": _cpu(x), "after": _cpu(out)}


def demo_send_recv(rank, world_size, chunk=2):
    """Everyone passes its tensor to the right neighbour on a ring."""
    x = rank_data(rank, chunk).to(device())
    got = torch.zeros_like(x)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    # Posting both sides at once avoids the deadlock of "everyone sends first, nobody receives".
    ops = [dist.P2POp(dist.isend, x, right), dist.P2POp(dist.irecv, got, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return {"before": _cpu(x), "after": _cpu(got)}


# name, rank function, what the collective does, which results are sums
COLLECTIVES = [
    ("broadcast", demo_broadcast, "rank 0's tensor is copied to every rank", "none"),
    ("scatter", demo_scatter, "rank 0 splits its tensor; piece r goes to rank r", "none"),
    ("gather", demo_gather, "every rank's tensor is collected, in rank order, on rank 0", "none"),
    ("reduce", demo_reduce, "the element-wise sum lands on rank 0 only", "dst"),
    ("all-gather", demo_all_gather, "every rank gets everyone's tensors, in rank order", "none"),
    ("reduce-scatter", demo_reduce_scatter, "rank r gets the sum of everyone's piece r", "all"),
    ("all-reduce", demo_all_reduce, "every rank gets the element-wise sum", "all"),
    ("all-to-all", demo_all_to_all, "piece j of rank i becomes piece i of rank j (a transpose)", "none"),
    ("send/recv", demo_send_recv, "each rank sends to its right neighbour, receives from its left", "none"),
]


# =========================================================================================
# 3. All-reduce = reduce-scatter + all-gather
# =========================================================================================

def all_reduce_in_two_halves(rank, world_size, chunk=2):
    """The tensors after each half of an all-reduce: reduce-scatter, then all-gather."""
    x = rank_data(rank, chunk * world_size).to(device())
    piece = torch.zeros(chunk, device=device())
    dist.reduce_scatter_single(piece, x)        # rank r: the sum of everyone's piece r
    full = torch.zeros_like(x)
    dist.all_gather_single(full, piece)         # everyone: every rank's finished piece
    return {"before": _cpu(x), "scattered": _cpu(piece), "gathered": _cpu(full)}


def all_reduce_two_ways(rank, world_size, length, integer):
    """All-reduce directly, and as reduce-scatter then all-gather; returns both results."""
    g = torch.Generator().manual_seed(rank)
    x = (torch.randint(-100, 100, (length,), generator=g).float() if integer
         else torch.randn(length, generator=g)).to(device())
    direct = x.clone()
    dist.all_reduce(direct)
    piece = torch.empty(length // world_size, device=device())
    dist.reduce_scatter_single(piece, x)    # each rank owns the full sum of one piece ...
    composed = torch.empty_like(x)
    dist.all_gather_single(composed, piece)    # ... and then everyone collects all pieces
    return {"input": _cpu(x), "direct": _cpu(direct), "composed": _cpu(composed)}


# =========================================================================================
# 4. Ring all-reduce from send and receive
# =========================================================================================

def ring_trace(rank, world_size):
    """Run the ring on one element per chunk, rank r contributing 2**r, recording each step."""
    x = torch.full((world_size,), 2.0 ** rank, device=device())
    steps = [("start", 0, None, _cpu(x))]
    ring_all_reduce(x, on_step=lambda phase, step, i: steps.append((phase, step, i, _cpu(x))))
    return steps


def ring_vs_builtin(rank, world_size, lengths):
    """For each length: (input, ring, pipelined ring, dist.all_reduce) results on this rank."""
    out = []
    for length in lengths:
        g = torch.Generator().manual_seed(1000 * rank + length)
        x = torch.randn(length, generator=g).to(device())
        ours, pipelined, theirs = x.clone(), x.clone(), x.clone()
        ring_all_reduce(ours)
        pipelined_ring_all_reduce(pipelined)
        dist.all_reduce(theirs)
        out.append((_cpu(x), _cpu(ours), _cpu(pipelined), _cpu(theirs)))
    return out


def _sync():
    if device().type == "cuda":
        torch.cuda.synchronize()


RING_VARIANTS = {"ring": ring_all_reduce, "pipelined ring": pipelined_ring_all_reduce,
                 "dist.all_reduce": dist.all_reduce}


def race_ring(rank, world_size, sizes, warmup, iters):
    """A `Timing` of each RING_VARIANTS entry per size (bytes). The variants take turns, one
    timed call each, rotating the order, so that all of them see the same (noisy, shared)
    machine; `measure` lines the ranks up with a barrier and keeps the slowest rank."""
    out = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=device())  # zeros: repeated sums never overflow
        for fn in RING_VARIANTS.values():
            for _ in range(warmup):
                fn(x)
        samples = {name: [] for name in RING_VARIANTS}
        order = list(RING_VARIANTS)
        for _ in range(iters):
            for name in order:
                samples[name] += measure(lambda: RING_VARIANTS[name](x), warmup=0, repeats=1).samples
            order = order[1:] + order[:1]   # rotate, so no variant always runs right after another
        out.append([Timing(samples[name]) for name in RING_VARIANTS])
    return out


def us(t):
    """A Timing as 'median (q1–q3)' in microseconds, for tables."""
    return f"{t.median * 1e6:,.0f} ({value_range(t.q1 * 1e6, t.q3 * 1e6, decimals=0)})"


# =========================================================================================
# 7. Hangs and timeouts
# =========================================================================================

def skip_a_collective(rank, world_size):
    """The last rank forgets an all-reduce; the others wait for it until their timeout."""
    x = torch.ones(1, device=device())
    if rank == world_size - 1:
        return "left early"             # a bug: e.g. an `if` that only this rank took
    t0 = time.perf_counter()
    try:
        dist.all_reduce(x)              # blocks until every rank joins... which never happens
    finally:
        print(f"waited {time.perf_counter() - t0:.1f} s in all_reduce")
    return "unreachable"


# =========================================================================================
# 8. Overlap
# =========================================================================================

def async_overlap(rank, world_size, numel, matmul_n, matmuls, reps):
    """All-reduce a gradient-sized buffer, and compute, first one after the other, then with
    the all-reduce started asynchronously before the compute. Returns three `Timing`s (compute
    alone, sequential, overlapped) and records the spans of one extra traced repetition."""
    grad = torch.zeros(numel, device=device())
    a = torch.randn(matmul_n, matmul_n, device=device()) / matmul_n ** 0.5

    def compute():
        y = a
        for _ in range(matmuls):
            y = a @ y
        _sync()

    def sequential():
        compute()
        dist.all_reduce(grad)
        _sync()

    def overlapped():
        work = dist.all_reduce(grad, async_op=True)     # returns at once with a handle
        compute()
        work.wait()                                     # before anyone reads grad
        _sync()

    alone = measure(compute, warmup=2, repeats=reps)
    comm = measure(lambda: (dist.all_reduce(grad), _sync()), warmup=2, repeats=reps)
    seq = measure(sequential, warmup=1, repeats=reps)
    ovl = measure(overlapped, warmup=1, repeats=reps)
    traced_repetition(grad, compute, "compute")
    return {"compute": alone, "all-reduce": comm, "sequential": seq, "overlapped": ovl}


def traced_repetition(grad, compute, label):
    """One repetition with every span recorded, for the figure: `compute` then the all-reduce,
    then the two again with the all-reduce in flight (its bar ends at its completion callback)."""
    dist.barrier()
    with span(label):
        compute()
    with span("all-reduce"):
        dist.all_reduce(grad)
        _sync()
    dist.barrier()
    t0, done = time.perf_counter(), []
    work = dist.all_reduce(grad, async_op=True)
    work.get_future().then(lambda _: done.append(time.perf_counter()))
    with span(f"{label}, all-reduce in flight"):
        compute()
    work.wait()
    span_at("async all-reduce", t0, done[0] if done else time.perf_counter())


def released_overlap(rank, world_size, numel, reps, min_wait=0.01):
    """async_overlap's experiment with the compute replaced by a timed wait (`release_core`) as long
    as the all-reduce alone takes (at least `min_wait`, long against the clock's overheads): the
    core is free for gloo's threads while the rank 'computes', as a GPU's SMs leave NCCL alone.
    Returns the timings read against the model max(compute, all-reduce), and records one traced
    repetition."""
    grad = torch.zeros(numel, device=device())
    comm = lambda: (dist.all_reduce(grad), _sync())
    wait = agreed_wait(measure(comm, warmup=2, repeats=reps).median, 1, min_wait)
    compute = lambda: release_core(wait)

    def sequential():
        compute()
        comm()

    def overlapped():
        work = dist.all_reduce(grad, async_op=True)
        compute()
        work.wait()
        _sync()

    t = measure_side_by_side({"compute": compute, "comm": comm, "sequential": sequential,
                              "overlapped": overlapped}, warmup=1, repeats=reps)
    traced_repetition(grad, compute, "compute stand-in (core released)")
    return measured_against_model(t, 1, "independent")


def streams_overlap(rank, world_size, n, copy_bytes, reps):
    """GPU only: a matmul on the default stream and a host-to-device copy on a side stream."""
    dev = device()
    a = torch.randn(n, n, device=dev)
    host = torch.ones(copy_bytes // 4, pin_memory=True)   # pinned: the copy engine can DMA it
    dst = torch.empty(host.shape, device=dev)
    side = torch.cuda.Stream()

    def sequential():
        a @ a
        dst.copy_(host, non_blocking=True)

    def overlapped():
        with torch.cuda.stream(side):
            dst.copy_(host, non_blocking=True)
        a @ a
        torch.cuda.current_stream().wait_stream(side)

    return {name: measure(fn, warmup=1, repeats=reps) for name, fn in
            [("matmul", lambda: a @ a), ("copy", lambda: dst.copy_(host, non_blocking=True)),
             ("sequential", sequential), ("overlapped", overlapped)]}
