"""Lecture 08's exercises: a gradient norm over shards counted once, the boxes a flat shard
covers in a global matrix, and the samples a resumed run reads first."""
import math

import torch
import torch.distributed as dist

from exercises import exercise, mutant
from util import exercise as engine


def _tensor(seed, shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


# --- a global gradient norm over shards ---------------------------------------------------------

NORM_CASES = (((5, 3), (7,), (2, 2)), ((11,),), ((3, 4), (1,)))   # shapes of each rank's shards


def check_norm(rank, world_size, fn):
    out = []
    for k, shapes in enumerate(NORM_CASES):
        shards = [_tensor(1000 * k + 10 * rank + i, s) for i, s in enumerate(shapes)]   # differ per rank
        replicated = [_tensor(7000 + k, (4,)), _tensor(7100 + k, (2, 3))]              # equal everywhere
        everything = [_tensor(1000 * k + 10 * r + i, s) for r in range(world_size) for i, s in enumerate(shapes)]
        expected = math.sqrt(sum(float(t.pow(2).sum()) for t in everything + replicated))
        got = fn(shards, replicated)
        out.append((f"case {k}: {len(shapes)} shard tensors per rank on {world_size} ranks, 2 replicated: the norm",
                    expected, float(got)))
        out.append((f"case {k}: collectives called", 1,
                    sum(1 for name, _ in engine.calls_of(fn) if name == "dist.all_reduce")))
    return out


def global_norm(shards, replicated):
    """Reference: every rank adds the squares of its own shards; one all-reduce sums them; the
    replicated tensors are counted once (not once per rank)."""
    local = sum((t.double().pow(2).sum() for t in shards), torch.zeros((), dtype=torch.float64))
    dist.all_reduce(local)
    local += sum((t.double().pow(2).sum() for t in replicated), torch.zeros((), dtype=torch.float64))
    return math.sqrt(local.item())


exercise(
    module=__name__, name="global_norm",
    title="the global gradient norm over shards, each element counted once",
    statement=(
        "**Exercise: a gradient norm over shards.** To clip by the global norm (as "
        "`torch.nn.utils.clip_grad_norm_` does in one process) a sharded run must add up the "
        "squares of every gradient element exactly once. Each rank holds `shards` (tensors no other "
        "rank holds: its slices) and `replicated` (tensors every rank holds identically, like the "
        "LayerNorm weights under tensor parallelism). Write `global_norm(shards, replicated)` "
        "returning the 2-norm of all of them — every rank's shards, the replicated tensors once — "
        "the same on every rank, with ONE `dist.all_reduce`. The check runs 3 cases on 3 real ranks "
        "against the norm of every tensor in one place, and counts your all-reduces."),
    stub=(
        "def global_norm(shards, replicated):\n"
        "    \"\"\"The 2-norm of every rank's shards and of the replicated tensors (counted once).\"\"\"\n"
        "    raise NotImplementedError(\"hint: all-reduce the sum of squares of the shards only, then add \"\n"
        "                              \"the replicated squares, then sqrt\")\n"),
    harness=check_norm, solution=global_norm,
    watch={"torch.distributed.all_reduce": None},
    wrong={"replicated counted on every rank": mutant(
               global_norm, ("    local = sum((t.double().pow(2).sum() for t in shards), ",
                             "    local = sum((t.double().pow(2).sum() for t in shards + replicated), ")),
           "no all-reduce: this rank's norm": mutant(global_norm, ("    dist.all_reduce(local)\n", "")),
           "sum of per-rank norms": mutant(global_norm, ("    dist.all_reduce(local)\n",
                                                         "    local = local.sqrt()\n    dist.all_reduce(local)\n"
                                                         "    local = local ** 2\n"))},
    hint="a tensor every rank holds would be counted world_size times if it went into the all-reduce",
    sizes="float64; 3 cases of 1-3 shard tensors per rank and 2 replicated tensors")


# --- the boxes a flat shard covers ---------------------------------------------------------------

BOX_CASES = (((10, 7), (5, 6), 0, 30), ((10, 7), (5, 6), 3, 4), ((10, 7), (5, 6), 5, 19),
             ((0, 0), (4, 4), 4, 12), ((2, 3), (3, 5), 6, 15), ((0, 8), (1, 9), 2, 7), ((4, 0), (6, 2), 1, 12))


def box_cases():
    from lectures.layout.shards import Piece, flat_boxes
    cases = []
    for offset, shape, start, stop in BOX_CASES:
        piece = Piece("w", (0, shape[0]), offset, shape)
        expected = [[list(o), list(s)] for o, s, _, _ in flat_boxes(piece, start, stop)]
        cases.append((f"elements [{start}, {stop}) of a {shape} box at {offset}: [[offset, shape], ...]",
                      (offset, shape, start, stop), expected))
    return {"cases": [cases[r::3] for r in range(3)]}


def _lists(x):
    return [_lists(v) for v in x] if isinstance(x, (list, tuple)) else x


def run_cases(rank, world_size, fn, cases):
    """This rank's share of the cases: (label, expected, what the function returned, as lists)."""
    return [(label, expected, _lists(fn(*args))) for label, args, expected in cases[rank % len(cases)]]


def flat_range_boxes(offset, shape, start, stop):
    """Reference: a partial first row, the whole rows, a partial last row."""
    cols, out = shape[1], []
    while start < stop:
        r, c = divmod(start, cols)
        if c or stop - start < cols:
            end = min(stop, (r + 1) * cols)
            out.append(((offset[0] + r, offset[1] + c), (1, end - start)))
        else:
            end = start + (stop - start) // cols * cols
            out.append(((offset[0] + r, offset[1]), ((end - start) // cols, cols)))
        start = end
    return out


exercise(
    module=__name__, name="flat_range_boxes",
    title="the boxes of a global matrix that a flat ZeRO shard covers",
    statement=(
        "**Exercise: a shard's boxes in the global tensor.** ZeRO flattens each tensor and gives "
        "rank r the elements [r·s, (r+1)·s); a checkpoint that other layouts can read must say "
        "where those elements lie in the *global* matrix, as boxes (offset, shape). The tensor here "
        "is the box of `shape` (rows, cols) at `offset` in the global matrix; its elements are "
        "counted row-major. Write `flat_range_boxes(offset, shape, start, stop)` returning the list "
        "of `((row, col), (rows, cols))` boxes that elements [start, stop) cover, in order: a "
        "partial first row if `start` is not at a row's beginning, then as many whole rows as fit "
        "in ONE box, then a partial last row. The check runs 7 ranges against the course's "
        "`flat_boxes` (the function its checkpoints use), on real ranks."),
    stub=(
        "def flat_range_boxes(offset, shape, start, stop):\n"
        "    \"\"\"[((row, col), (rows, cols)), ...] covering elements [start, stop) of the box.\"\"\"\n"
        "    raise NotImplementedError(\"hint: r, c = divmod(start, shape[1]); add offset to both\")\n"),
    harness=run_cases, prepare=box_cases, solution=flat_range_boxes,
    wrong={"forgets the column offset": mutant(flat_range_boxes, ("(offset[0] + r, offset[1] + c)", "(offset[0] + r, c)")),
           "one box per row": mutant(flat_range_boxes, ("        if c or stop - start < cols:",
                                                        "        if True:")),
           "forgets the row offset": mutant(flat_range_boxes, ("out.append(((offset[0] + r, offset[1]),",
                                                               "out.append(((r, offset[1]),"))},
    hint="the whole rows in the middle are one box of (rows, cols); a range inside one row is (1, n)",
    sizes="7 ranges in boxes of 4x4 to 6x2, at offsets inside a larger matrix")


# --- the first samples after a resume -----------------------------------------------------------

RESUME_CASES = ((2, 8, 0, 2), (2, 8, 1, 2), (0, 8, 0, 4), (5, 12, 2, 3), (3, 6, 0, 1), (7, 16, 3, 4))


def resume_cases():
    cases = []
    for step, global_batch, dp_rank, dp in RESUME_CASES:
        rows = global_batch // dp
        first = step * global_batch + dp_rank * rows
        cases.append((f"resumed at step {step}, global batch {global_batch}, dp rank {dp_rank} of {dp}: sample indices",
                      (step, global_batch, dp_rank, dp), list(range(first, first + rows))))
    return {"cases": [cases[r::3] for r in range(3)]}


def first_samples(step, global_batch, dp_rank, dp):
    """Reference: the data position is global (samples seen = step · global batch), and the new
    layout's dp rank takes its contiguous rows of the next global batch."""
    rows = global_batch // dp
    first = step * global_batch + dp_rank * rows
    return list(range(first, first + rows))


exercise(
    module=__name__, name="first_samples",
    title="the samples a resumed run reads first, under a new data-parallel size",
    statement=(
        "**Exercise: resume without re-reading data.** The sample stream is numbered 0, 1, 2, ... "
        "and each step reads the next `global_batch` samples; data-parallel rank d of dp takes the "
        "d-th contiguous block of `global_batch / dp` of them (as lecture 07's trainer cuts its "
        "batch). A checkpoint written after `step` steps stores that global position — not each "
        "rank's, since the run may resume with another dp. Write `first_samples(step, global_batch, "
        "dp_rank, dp)` returning the list of sample indices this rank reads in the first step after "
        "resuming. The check runs 6 cases (dp from 1 to 4, resumed at steps 0 to 7) on real ranks."),
    stub=(
        "def first_samples(step, global_batch, dp_rank, dp):\n"
        "    \"\"\"The sample indices dp rank `dp_rank` of `dp` reads at the first step after resuming.\"\"\"\n"
        "    raise NotImplementedError(\"hint: step * global_batch samples are already seen\")\n"),
    harness=run_cases, prepare=resume_cases, solution=first_samples,
    wrong={"starts the data again": mutant(first_samples, ("first = step * global_batch + ", "first = ")),
           "each rank's own position, not the global one": mutant(first_samples, ("first = step * global_batch + dp_rank * rows",
                                                                                  "first = (step + dp_rank) * rows")),
           "skips one step too many": mutant(first_samples, ("first = step * global_batch", "first = (step + 1) * global_batch"))},
    hint="a rank's block starts at step·global_batch + dp_rank·(global_batch/dp)",
    sizes="6 cases: dp 1-4, global batch 6-16, resumed at steps 0-7")
