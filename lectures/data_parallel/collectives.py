"""Collectives by hand, and their cost: the building blocks of lecture 02, in their own module
(the lecture shows their code with see()).

- `ring_all_reduce`: all-reduce from send and receive on a ring, 2(n-1) neighbour exchanges,
  the bandwidth-optimal algorithm of Patarasuk & Yuan (2009); `pipelined_ring_all_reduce`
  cuts every chunk into slices so that adding one overlaps moving the next, as NCCL does.
  Both are checked against `dist.all_reduce` in tests/test_lecture_02.py.
- `bus_bandwidth_factor`, `bandwidths`: algorithm and bus bandwidth as nccl-tests defines them
  (nccl-tests, doc/PERFORMANCE.md).
- `fit_alpha_beta`, `crossover_bytes`: the α–β (latency–bandwidth) cost model t = α + S/β,
  fitted to measurements, and Hockney's n_1/2, the size at which both terms are equal.
- `collective_op`, `sweep`, `SWEPT`: time collectives on nccl-tests-style buffers, one call at a
  time (a rank function: spawn it, or call it on every rank of a process group).
- `wire_bytes`, `optimal_bytes`: the bytes each rank really writes to its sockets for one call
  of each collective (a rank function), beside what a bandwidth-optimal algorithm sends. On
  gloo, reduce-scatter writes as much as an all-reduce: gloo's reduce-scatter is a
  clone, a full all-reduce and a copy of the rank's chunk; broadcast is a binomial tree
  (`binomial_broadcast_sends`), so the root writes ⌈log₂ n⌉ times the buffer.
"""
import numpy as np
import torch
import torch.distributed as dist

from util import device, progress
from util.measure import bytes_sent, measure


# =========================================================================================
# Ring all-reduce from send and receive
# =========================================================================================

def _start_exchange(send, to, recv, source):
    """Start receiving one buffer from the left and sending one to the right; returns the
    work handles. The two are issued as one group (`batch_isend_irecv`), which NCCL needs to
    avoid deadlock between neighbours sending to each other, and the receive comes first so
    that arriving bytes can land straight in their final place (measurably faster with gloo).
    Empty buffers (tensors shorter than the world size) are skipped by both sides alike."""
    ops = []
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, source))
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, to))
    return dist.batch_isend_irecv(ops) if ops else []


def _exchange(send, to, recv, source):
    for work in _start_exchange(send, to, recv, source):
        work.wait()


def ring_all_reduce(x, on_step=None):
    """Sum `x` over all ranks, in place, with 2(n-1) neighbour exchanges on a ring.

    The buffer is cut into n chunks (sizes may differ by one; some may be empty).
    Reduce-scatter phase: at step s rank r sends chunk r-s to the right and adds the chunk
    r-s-1 arriving from the left into its own copy; after n-1 steps rank r holds the full sum
    of chunk r+1. All-gather phase: the finished chunks travel once more around the ring,
    each received straight into place. Every rank sends 2(n-1)/n of the buffer in total.
    `on_step(phase, step, chunk_index)` is called after each step (for drawing).
    """
    n, rank = dist.get_world_size(), dist.get_rank()
    buffer = _ring_buffer(x)                # checked before any message is posted
    if n == 1:
        return x
    chunks = buffer.tensor_split(n)         # views: adding into them updates the buffer
    right, left = (rank + 1) % n, (rank - 1) % n
    inbox = torch.empty_like(chunks[0])     # chunk 0 is the largest
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        incoming = inbox[:chunks[recv_i].numel()]
        _exchange(chunks[send_i], right, incoming, left)
        chunks[recv_i].add_(incoming)
        if on_step:
            on_step("reduce-scatter", step + 1, recv_i)
    for step in range(n - 1):
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        _exchange(chunks[send_i], right, chunks[recv_i], left)
        if on_step:
            on_step("all-gather", step + 1, recv_i)
    return _write_back(x, buffer)


def _ring_buffer(x):
    """The flat, contiguous buffer the ring works in, after checking `x` locally.

    Everything that can go wrong on one rank alone is checked here, *before* the first message:
    a rank that fails after posting a receive leaves that receive behind, and it swallows the
    next message a neighbour sends (the following collective then hangs until the timeout).
    A non-contiguous input (`t[::2]`, a transposed matrix) is not an error: the ring runs on a
    contiguous copy, written back at the end."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"ring all-reduce needs a tensor, got {type(x).__name__}")
    if x.is_sparse or x.dtype == torch.bool:
        raise TypeError(f"ring all-reduce sums dense numeric tensors, got {x.dtype} "
                        f"({'sparse' if x.is_sparse else 'dense'})")
    return x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)


def _write_back(x, buffer):
    """Copy the result into `x` when the ring had to work on a contiguous copy."""
    if buffer.data_ptr() != x.data_ptr() or not x.is_contiguous():
        x.copy_(buffer.view_as(x))
    return x


def pipelined_ring_all_reduce(x, slices=4):
    """The same ring, with every chunk cut into `slices` slices that move one at a time.

    In `ring_all_reduce` the link idles while a rank adds a whole chunk. Here the exchange of
    slice t is started *before* slice t-1 is added, so adding and moving overlap (two inboxes
    take turns). A slice is sent on only `slices` exchanges after it arrived, by which time it
    has been added. NCCL pipelines its rings the same way.
    """
    n, rank = dist.get_world_size(), dist.get_rank()
    buffer = _ring_buffer(x)                # checked before any message is posted
    if n == 1:
        return x
    slices = max(2, int(slices))            # with one slice there is nothing to overlap
    chunks = [c.tensor_split(slices) for c in buffer.tensor_split(n)]
    right, left = (rank + 1) % n, (rank - 1) % n
    inboxes = [torch.empty_like(chunks[0][0]) for _ in range(2)]   # slice 0 of chunk 0 is largest
    plan = [((rank - s) % n, (rank - s - 1) % n, True) for s in range(n - 1)]      # reduce-scatter
    plan += [((rank + 1 - s) % n, (rank - s) % n, False) for s in range(n - 1)]    # all-gather
    pending, tick = None, 0
    for send_i, recv_i, reduce in plan:
        for k in range(slices):
            target = chunks[recv_i][k]
            box = inboxes[tick % 2][:target.numel()] if reduce else target
            works = _start_exchange(chunks[send_i][k], right, box, left)
            if pending:
                _finish(*pending)           # add the previous slice while this one moves
            pending, tick = (works, box, target if reduce else None), tick + 1
    _finish(*pending)
    return _write_back(x, buffer)


def _finish(works, box, target):
    for work in works:
        work.wait()
    if target is not None:
        target.add_(box)


# =========================================================================================
# Bandwidth, the nccl-tests way
# =========================================================================================

def bus_bandwidth_factor(collective, n):
    """nccl-tests' correction from algorithm bandwidth to bus bandwidth on `n` ranks.

    busbw = algbw * factor makes the number comparable with the speed of the slowest link:
    in a ring all-reduce each rank sends and receives 2(n-1)/n of the buffer, in all-gather,
    reduce-scatter and all-to-all (n-1)/n of it, in broadcast and reduce the whole buffer once.
    """
    if n < 1:
        raise ValueError(f"need at least one rank, got {n}")
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "broadcast": 1.0,
        "reduce": 1.0,
    }
    if collective not in factors:
        raise ValueError(f"unknown collective {collective!r}; known: {sorted(factors)}")
    return factors[collective]


def bandwidths(collective, nbytes, seconds, n):
    """(algbw, busbw) in bytes/s for moving an `nbytes` buffer in `seconds` on `n` ranks."""
    algbw = nbytes / seconds
    return algbw, algbw * bus_bandwidth_factor(collective, n)


def collective_op(name, nbytes, world_size):
    """A no-argument callable running collective `name` on an nccl-tests-style buffer of
    `nbytes`: the all-reduce/broadcast buffer, the all-gather *output*, the reduce-scatter
    *input*, the all-to-all buffer (rounded down to whole elements per rank)."""
    n = max(world_size, nbytes // 4 // world_size * world_size)
    dev = device()
    if name == "all_reduce":
        x = torch.zeros(n, device=dev)
        return lambda: dist.all_reduce(x)
    if name == "broadcast":
        x = torch.zeros(n, device=dev)
        return lambda: dist.broadcast(x, src=0)
    if name == "all_gather":
        x, out = torch.zeros(n // world_size, device=dev), torch.empty(n, device=dev)
        return lambda: dist.all_gather_single(out, x)
    if name == "reduce_scatter":
        x, out = torch.zeros(n, device=dev), torch.empty(n // world_size, device=dev)
        return lambda: dist.reduce_scatter_single(out, x)
    if name == "all_to_all":
        x, out = torch.zeros(n, device=dev), torch.empty(n, device=dev)
        return lambda: dist.all_to_all_single(out, x)
    raise ValueError(f"unknown collective {name!r}")


SWEPT = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]


def sweep(rank, world_size, collectives, sizes, warmup, iters):
    """A `Timing` per collective and size: `warmup` untimed calls, then `iters` calls each
    timed alone after a barrier, keeping the slowest rank (the same on every rank).
    `sizes` is one list for all collectives, or a dict giving each collective its own list."""
    out = []
    for name in collectives:
        row = []
        for nbytes in progress(sizes[name] if isinstance(sizes, dict) else sizes, desc=name):
            row.append(measure(collective_op(name, nbytes, world_size), warmup=warmup, repeats=iters))
        out.append(row)
    return out


def binomial_broadcast_sends(rank, n, root=0):
    """How many times `rank` sends the whole buffer in gloo's broadcast of one buffer over `n`
    ranks: a binomial tree. In round k = 0, 1, ... every rank that already holds the buffer
    (position v < 2^k counted from the root) sends it to position v + 2^k, if that exists. The
    root sends ⌈log₂ n⌉ times, rank 1 in as many rounds as it has partners, the last half of the
    ranks never (measured, 4 ranks, 1 MB: 2,097,344 / 1,048,720 / 48 / 48 bytes written)."""
    if not 0 <= rank < n or not 0 <= root < n:
        raise ValueError(f"rank {rank} and root {root} must lie in [0, {n})")
    v, sends, k = (rank - root) % n, 0, 0
    while 2 ** k < n:
        sends += v < 2 ** k and v + 2 ** k < n
        k += 1
    return sends


def optimal_bytes(collective, nbytes, n):
    """Bytes each rank sends in a bandwidth-optimal implementation (NCCL's ring for large
    messages): the nccl-tests factor times the buffer (for broadcast: at most the buffer)."""
    return nbytes * bus_bandwidth_factor(collective, n)


def wire_bytes(rank, world_size, collectives, nbytes):
    """For each collective, the bytes this rank wrote to its sockets during one call on an
    nccl-tests-style buffer of `nbytes` (after one untimed call and a barrier), or None where
    the kernel does not count them. The count is the real transport: payload, headers, and
    whatever algorithm the backend chose."""
    out = {}
    for name in collectives:
        op = collective_op(name, nbytes, world_size)
        op()                                        # connections and buffers set up
        dist.barrier()
        with bytes_sent() as sent:
            op()
        dist.barrier()
        out[name] = sent.bytes
    return out


# =========================================================================================
# The α–β model
# =========================================================================================

def fit_alpha_beta(sizes, times):
    """Fit time(s) = alpha + s / beta (alpha in seconds, beta in bytes/s) to measurements.

    Message sizes span many orders of magnitude, so a plain least-squares fit would listen
    only to the largest messages. We minimise the *relative* error Σ((α + s/β)/t − 1)² instead,
    which weighs a 4 KB message as much as a 64 MB one, with both parameters non-negative (a
    negative latency is noise, not physics). In the unknowns (α, 1/β) this is a two-variable
    non-negative least-squares problem, solved exactly: the unconstrained minimiser if it is
    non-negative, otherwise the better of the two boundary minimisers, each in closed form
    (α = 0: 1/β = Σ(s/t)/Σ(s/t)²; 1/β = 0: α = Σ(1/t)/Σ(1/t²)). beta is infinite when the
    times do not grow with size.
    """
    s = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if s.shape != t.shape or s.size < 2:
        raise ValueError("need at least two (size, time) pairs of equal length")
    if np.any(t <= 0):
        raise ValueError("times must be positive")
    a_col, b_col = 1 / t, s / t                      # columns of the design; target: all ones

    def error(alpha, inv_beta):
        return float(np.sum((alpha * a_col + inv_beta * b_col - 1) ** 2))

    candidates = []
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.stack([a_col, b_col], axis=1), np.ones_like(t),
                                            rcond=None)
    if alpha >= 0 and inv_beta >= 0:
        candidates.append((alpha, inv_beta))
    else:
        candidates.append((0.0, max(0.0, b_col.sum() / np.sum(b_col ** 2))))   # pure bandwidth
        candidates.append((max(0.0, a_col.sum() / np.sum(a_col ** 2)), 0.0))   # pure latency
    alpha, inv_beta = min(candidates, key=lambda c: error(*c))
    return float(alpha), (float("inf") if inv_beta == 0 else float(1 / inv_beta))


def crossover_bytes(alpha, beta):
    """The message size at which the latency term equals the bandwidth term (alpha * beta).

    Below it a message costs mostly latency, above it mostly bandwidth; at exactly this size
    the achieved bandwidth is half of beta (Hockney's n_1/2)."""
    return alpha * beta
