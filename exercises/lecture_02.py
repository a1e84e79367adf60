"""Lecture 02's exercises: collectives from send/recv, and bandwidth the nccl-tests way."""
import torch
import torch.distributed as dist

from exercises import COLLECTIVES, STORE, built_in, exercise, forbid, mutant

# what a ring built from send/recv may not lean on: a collective, the store, the course's answer, the inputs
SEND_RECV_ONLY = "it asks for a ring of point-to-point messages (dist.isend / dist.irecv)"
NOT_THE_ANSWER = ("exercises.solution", "exercises.lecture_02.rank_input")
NOT_A_MESSAGE = (*built_in(*COLLECTIVES), *STORE)


def rank_input(rank, shape, seed=0):
    """The tensor rank `rank` starts with (every rank can rebuild every other rank's)."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * seed + 1)
    return torch.randn(shape, generator=g, dtype=torch.float64)


# --- ring all-reduce -----------------------------------------------------------------------

RING_LENGTHS = (1, 2, 7, 13, 100)   # on 3 and 2 ranks: empty chunks, uneven chunks, even ones


def check_ring(rank, world_size, fn):
    from lectures.data_parallel import ring_all_reduce as course
    out = []
    for length in RING_LENGTHS:
        x = rank_input(rank, (length,), seed=length)
        expected = course(x.clone())
        got = fn(x.clone())
        out.append((f"buffer of {length} float64", expected, got))
    return out


def ring_all_reduce_volume(n):
    """What a rank of a ring all-reduce sends, in multiples of its buffer: 2(n - 1) chunks of 1/n."""
    return 2 * (n - 1) / n


def ring_all_reduce(x):
    """Reference: reduce-scatter then all-gather around the ring; chunks by tensor_split."""
    n, rank = dist.get_world_size(), dist.get_rank()
    if n == 1:
        return x
    chunks = x.view(-1).tensor_split(n)
    right, left = (rank + 1) % n, (rank - 1) % n

    def exchange(send, recv):
        ops = [dist.P2POp(dist.isend, send.contiguous(), right), dist.P2POp(dist.irecv, recv, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    for step in range(n - 1):                  # reduce-scatter: add what arrives from the left
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        exchange(chunks[send_i], incoming)
        chunks[recv_i].add_(incoming)
    for step in range(n - 1):                  # all-gather: pass the finished chunks on
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        incoming = torch.empty_like(chunks[recv_i])
        exchange(chunks[send_i], incoming)
        chunks[recv_i].copy_(incoming)
    return x


exercise(
    module=__name__, name="ring_all_reduce",
    title="a ring all-reduce from send/recv (reduce-scatter, then all-gather)",
    statement=(
        "**Exercise: ring all-reduce from send/recv.** Write `ring_all_reduce(x)`: every rank "
        "passes a 1-D float tensor `x`, and every rank gets back the sum over all ranks "
        "(you may work in place and return `x`). Use only point-to-point messages "
        "(`dist.isend`/`dist.irecv`, or `dist.batch_isend_irecv`), not `dist.all_reduce`. The "
        "algorithm is the lecture's (Patarasuk & Yuan 2009): cut `x` into n chunks with "
        "`x.tensor_split(n)` (sizes may differ by one, some may be empty); for n − 1 steps rank r "
        "sends chunk r − s to its right and adds the chunk r − s − 1 arriving from its left; then, "
        "for n − 1 more steps, the finished chunks travel once more around the ring, copied into "
        "place. The check runs it on 3 and on 2 ranks on float64 buffers of 1, 2, 7, 13 and 100 "
        "elements against the course's `ring_all_reduce`, and fails if your function calls a "
        "collective or the course's own ring, or sends what a ring does not: a message to a rank "
        "other than its right neighbour (or a receive from other than its left), more or fewer "
        "than the ring's 2(n − 1)/n of the buffer, or data through the store or a file."),
    stub=(
        "def ring_all_reduce(x):\n"
        "    \"\"\"Sum x over all ranks with 2(n-1) ring steps of send/recv; return the result.\"\"\"\n"
        "    n, rank = dist.get_world_size(), dist.get_rank()\n"
        "    raise NotImplementedError(\"hint: chunks = x.tensor_split(n); at step s send chunk \"\n"
        "                              \"(rank - s) % n right, add chunk (rank - s - 1) % n from the left\")\n"),
    harness=check_ring, solution=ring_all_reduce, ranks=(3, 2), ring=ring_all_reduce_volume,
    watch=forbid(SEND_RECV_ONLY, *NOT_A_MESSAGE, *NOT_THE_ANSWER, "exercises.lecture_02.ring_all_reduce",
                 "lectures.data_parallel.collectives.ring_all_reduce", "lectures.data_parallel.collectives.pipelined_ring_all_reduce",
                 "lectures.lecture_02_communication.ring_all_reduce"),
    wrong={"no all-gather phase": mutant(ring_all_reduce, ("chunks[recv_i].copy_(incoming)", "pass")),
           "chunks walked the wrong way (off by one rank)":
               mutant(ring_all_reduce, ("(rank - step) % n, (rank - step - 1)", "(rank + step) % n, (rank + step - 1)")),
           "averages instead of summing": mutant(ring_all_reduce, ("\n    return x\n", "\n    return x / n\n"))},
    hint="post the send and the receive of one step together (dist.batch_isend_irecv), or a "
         "blocking send can wait forever; with 3 ranks and 1 element, two chunks are empty",
    sizes="float64 buffers of 1, 2, 7, 13, 100 elements, send/recv only")


# --- all-gather ----------------------------------------------------------------------------

GATHER_SHAPES = ((5,), (3, 4), (1,))


def check_all_gather(rank, world_size, fn):
    out = []
    for k, shape in enumerate(GATHER_SHAPES):
        x = rank_input(rank, shape, seed=k)
        expected = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(expected, x)                      # PyTorch's own, for comparison
        got = fn(x.clone())
        got = list(got) if isinstance(got, (list, tuple)) else got
        out.append((f"tensor of shape {shape}", expected, got))
    return out


def all_gather_volume(n):
    """What a rank of a ring all-gather sends, in multiples of its input: n - 1 pieces."""
    return n - 1


def all_gather(x):
    """Reference: n - 1 ring steps, each forwarding the piece that arrived last."""
    n, rank = dist.get_world_size(), dist.get_rank()
    out = [None] * n
    out[rank] = x.clone()
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        out[recv_i] = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, out[send_i], right), dist.P2POp(dist.irecv, out[recv_i], left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


exercise(
    module=__name__, name="all_gather",
    title="all-gather from send/recv, around a ring",
    statement=(
        "**Exercise: all-gather from send/recv.** Write `all_gather(x)`: every rank passes a "
        "tensor of the same shape, and every rank gets back the list of all ranks' tensors, in "
        "rank order (`result[r]` is rank r's `x`). Use a ring: in each of n − 1 steps, send to "
        "the right the piece you received last (your own at first) and receive from the left, "
        "so every rank sends (n − 1)/n of the output, the bus-bandwidth factor of all-gather. "
        "The check runs 3 and 2 ranks on float64 tensors of shapes (5,), (3, 4) and (1,) "
        "against `dist.all_gather`, and fails if your function calls a collective or sends what "
        "the ring does not (a message to other than its right neighbour, more or less than n − 1 "
        "times its tensor, data through the store or a file)."),
    stub=(
        "def all_gather(x):\n"
        "    \"\"\"[x of rank 0, x of rank 1, ...] on every rank, with n - 1 ring steps of send/recv.\"\"\"\n"
        "    n, rank = dist.get_world_size(), dist.get_rank()\n"
        "    raise NotImplementedError(\"hint: out[rank] = x; at step s send out[(rank - s) % n] \"\n"
        "                              \"right and receive out[(rank - s - 1) % n] from the left\")\n"),
    harness=check_all_gather, solution=all_gather, ranks=(3, 2), ring=all_gather_volume,
    watch=forbid(SEND_RECV_ONLY, *NOT_A_MESSAGE, *NOT_THE_ANSWER, "exercises.lecture_02.all_gather"),
    wrong={"forwards its own tensor every step": mutant(all_gather, ("isend, out[send_i]", "isend, x")),
           "list rotated by one rank": mutant(all_gather, ("return out", "return out[1:] + out[:1]"))},
    hint="the piece to forward at step s is the one that arrived at step s - 1, from rank "
         "(rank - s) % n",
    sizes="float64, shapes (5,), (3, 4), (1,), send/recv only")


# --- bus bandwidth -------------------------------------------------------------------------

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce")


def check_bus_bandwidth(rank, world_size, fn):
    from lectures.data_parallel import bandwidths
    out = []
    for n in [(2, 3), (5, 8), (1, 16)][rank]:
        for name in COLLECTIVES:
            nbytes, seconds = 3 * 2 ** 20 + 7 * n, 1.7e-3 * n
            out.append((f"{name} of {nbytes} bytes in {seconds * 1e3:.2f} ms on {n} ranks",
                        list(bandwidths(name, nbytes, seconds, n)), list(fn(name, nbytes, seconds, n))))
    return out


def bus_bandwidth(collective, nbytes, seconds, n):
    """Reference: nccl-tests' algbw and busbw."""
    algbw = nbytes / seconds
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}[collective]
    return algbw, algbw * factor


exercise(
    module=__name__, name="bus_bandwidth",
    title="bus bandwidth from a timing, the nccl-tests way",
    statement=(
        "**Exercise: bus bandwidth from a timing.** Write `bus_bandwidth(collective, nbytes, "
        "seconds, n)` returning `(algbw, busbw)` in bytes/s for a buffer of `nbytes` moved in "
        "`seconds` on `n` ranks, as nccl-tests defines them (its PERFORMANCE.md): algbw = "
        "nbytes / seconds; busbw = algbw × a factor that makes it comparable with the link speed — "
        "2(n − 1)/n for all_reduce, (n − 1)/n for all_gather, reduce_scatter and all_to_all, 1 "
        "for broadcast and reduce. The check compares every collective on 2, 3, 5, 8, 1 and 16 "
        "ranks with the course's `bandwidths`, one rank per group of cases."),
    stub=(
        "def bus_bandwidth(collective, nbytes, seconds, n):\n"
        "    \"\"\"(algbw, busbw) in bytes/s; collective is 'all_reduce', 'all_gather', ...\"\"\"\n"
        "    raise NotImplementedError(\"hint: in a ring all-reduce every rank sends 2(n-1)/n of the buffer\")\n"),
    harness=check_bus_bandwidth, solution=bus_bandwidth,
    wrong={"all-reduce factor without the 2": mutant(bus_bandwidth, ('"all_reduce": 2 *', '"all_reduce":')),
           "divides by the factor": mutant(bus_bandwidth, ("algbw * factor", "(algbw / factor if factor else 0.0)"))},
    hint="busbw = algbw × factor; on one rank nothing moves (factor 0 for all_reduce)",
    sizes="6 collectives × n = 1, 2, 3, 5, 8, 16")
