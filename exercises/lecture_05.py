"""Lecture 05's exercises: 1F1B's and GPipe's action lists, the bubble of a measured timeline."""
import random

import torch
import torch.distributed as dist

from exercises import exercise, mutant

SCHEDULE_CASES = ((3, 1), (3, 2), (3, 5), (3, 8), (4, 7), (5, 3))   # (stages, micro-batches)


def _schedule_check(name):
    def harness(rank, world_size, fn):
        from lectures.pipeline import make_schedule
        out = []
        for p, m in SCHEDULE_CASES:
            for stage in range(rank, p, world_size):         # this rank, and stage + 3 when p > 3
                expected = [(a.kind, a.microbatch) for a in make_schedule(name, p, m)[stage]]
                got = fn(p, m, stage)
                got = [tuple(a) for a in got] if isinstance(got, (list, tuple)) else got
                out.append((f"{p} stages, {m} micro-batches, stage {stage}", expected, got))
        return out
    harness.__name__ = harness.__qualname__ = f"check_{name.replace('-', '_')}"
    return harness


check_1f1b = _schedule_check("1f1b")
check_gpipe = _schedule_check("gpipe")


def one_f_one_b(stages, microbatches, stage):
    """Reference: warm-up forwards, then one forward one backward, then the cool-down."""
    warmup = min(stages - stage - 1, microbatches)
    actions = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(microbatches - warmup, microbatches)]


exercise(
    module=__name__, name="one_f_one_b",
    title="1F1B's action list for one pipeline stage",
    statement=(
        "**Exercise: 1F1B's action list.** In 1F1B (PipeDream-Flush; Narayanan et al. 2021, §2.2) "
        "stage r of p first runs a warm-up of min(p − r − 1, m) forwards, then alternates one "
        "forward and one backward until the forwards run out, then runs the remaining backwards. "
        "Write `one_f_one_b(stages, microbatches, stage)` returning that stage's list of "
        "`(kind, microbatch)` pairs, kind `\"F\"` or `\"B\"`, e.g. `[(\"F\", 0), (\"F\", 1), "
        "(\"B\", 0), ...]`. The check compares with the course's `make_schedule(\"1f1b\", p, m)`, "
        "each of 3 ranks asking for its own stage: 3 stages with 1, 2, 5, 8 micro-batches, 4 "
        "stages with 7, 5 stages with 3 (fewer micro-batches than stages)."),
    stub=(
        "def one_f_one_b(stages, microbatches, stage):\n"
        "    \"\"\"[(\"F\" or \"B\", micro-batch), ...] that `stage` runs under 1F1B.\"\"\"\n"
        "    raise NotImplementedError(\"hint: warm-up = min(stages - stage - 1, microbatches) forwards, \"\n"
        "                              \"then F, B pairs, then the backwards left\")\n"),
    harness=check_1f1b, solution=one_f_one_b,
    wrong={"warm-up one too long (p - r)": mutant(one_f_one_b, ("stages - stage - 1", "stages - stage")),
           "forgets the cool-down backwards":
               mutant(one_f_one_b, ("range(microbatches - warmup, microbatches)", "range(0)")),
           "alternates B then F": mutant(one_f_one_b, ('("F", warmup + i), ("B", i)', '("B", i), ("F", warmup + i)'))},
    hint="the last stage has no warm-up: it runs F0 then B0 at once",
    sizes="(stages, micro-batches) = (3, 1), (3, 2), (3, 5), (3, 8), (4, 7), (5, 3)")


def gpipe(stages, microbatches, stage):
    """Reference: every forward, then every backward, in micro-batch order."""
    return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]


exercise(
    module=__name__, name="gpipe",
    title="GPipe's action list for one pipeline stage",
    statement=(
        "**Exercise: GPipe's action list.** GPipe (Huang et al. 2019) runs all m forwards of a "
        "batch through the pipeline, then all m backwards — the course's executor takes the "
        "backwards in micro-batch order, oldest first, like the forwards. Write "
        "`gpipe(stages, microbatches, stage)` returning the stage's `(kind, microbatch)` list. "
        "Then compare it with your `one_f_one_b`: the bubble is the same, (p − 1)/(m + p − 1); "
        "what changes is how many micro-batches' activations a stage holds. The check compares "
        "with `make_schedule(\"gpipe\", p, m)` on the same cases as 1F1B."),
    stub=(
        "def gpipe(stages, microbatches, stage):\n"
        "    \"\"\"[(\"F\" or \"B\", micro-batch), ...] that `stage` runs under GPipe.\"\"\"\n"
        "    raise NotImplementedError(\"hint: all forwards, then all backwards\")\n"),
    harness=check_gpipe, solution=gpipe,
    wrong={"backwards in reverse order":
               mutant(gpipe, ('("B", i) for i in range(microbatches)', '("B", i) for i in reversed(range(microbatches))')),
           "1F1B instead": one_f_one_b},
    hint="the course's GPipe runs B0, B1, ... in the order the forwards ran",
    sizes="the 1F1B cases")


# --- the bubble of a measured timeline ------------------------------------------------------------

def _timeline(p, m, seed):
    """Per-rank (action, start, end) spans of a 1F1B step with uneven, jittered costs."""
    from lectures.pipeline import make_schedule, simulate
    g = torch.Generator().manual_seed(seed)
    sched = make_schedule("1f1b", p, m)
    sim = simulate(sched, {"F": 1.0, "B": 2.0, "W": 0.0})
    out = []
    for r in range(p):
        spans = []
        for action, start, end in sim.timeline[r]:
            jitter = float(torch.rand(1, generator=g)) * 0.1
            spans.append((str(action), 10.0 + start * 1e-3 + jitter * 1e-3, 10.0 + end * 1e-3))
        out.append(spans)
    return out


def check_bubble(rank, world_size, fn):
    from lectures.pipeline.demos import measured_bubble
    out = []
    for m, seed in [(4, 0), (1, 1), (9, 2)]:
        timeline = _timeline(world_size, m, seed)
        expected = measured_bubble(timeline)
        mine = list(timeline[rank])
        random.Random(seed + rank).shuffle(mine)       # the statement promises no order
        got = fn(mine)
        out.append((f"1F1B on {world_size} stages, {m} micro-batches, events in no particular order: "
                    "the bubble fraction", expected, got))
    return out


def bubble(events):
    """Reference: 1 - busy / (ranks × makespan), the span and busy time agreed by all-reduce."""
    t = torch.tensor([min(s for _, s, _ in events), -max(e for _, _, e in events),
                      sum(e - s for _, s, e in events)], dtype=torch.float64)
    first = t[:2].clone()
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    busy = t[2:].clone()
    dist.all_reduce(busy)
    makespan = -first[1] - first[0]
    return 1 - busy.item() / (dist.get_world_size() * makespan.item())


def bubble_local(events):
    start, end = min(s for _, s, _ in events), max(e for _, _, e in events)
    return 1 - sum(e - s for _, s, e in events) / (end - start)


def bubble_mean_of_ranks(events):
    start, end = min(s for _, s, _ in events), max(e for _, _, e in events)
    mine = torch.tensor([1 - sum(e - s for _, s, e in events) / (end - start)], dtype=torch.float64)
    dist.all_reduce(mine)
    return mine.item() / dist.get_world_size()


exercise(
    module=__name__, name="bubble",
    title="the bubble of a measured pipeline timeline, agreed by all ranks",
    statement=(
        "**Exercise: the bubble of a timeline.** Each rank of a pipeline knows only its own "
        "measured spans: `events` is this rank's list of `(action, start, end)` in seconds (one "
        "clock for all ranks). The bubble is the idle fraction of the whole step, "
        "1 − Σ busy / (p × makespan), where the makespan runs from the earliest start on any rank "
        "to the latest end on any rank and Σ busy sums every rank's span lengths. Write "
        "`bubble(events)` returning it — the same number on every rank — using all-reduces "
        "(`ReduceOp.MIN`, `MAX`, `SUM`). The check runs 1F1B timelines with uneven, jittered "
        "costs on 3 and 2 ranks (1, 4 and 9 micro-batches), each rank's events in no particular "
        "order, against lecture 05's `measured_bubble`."),
    stub=(
        "def bubble(events):\n"
        "    \"\"\"The pipeline's idle fraction, from this rank's (action, start, end) spans.\"\"\"\n"
        "    raise NotImplementedError(\"hint: all-reduce the earliest start (MIN), latest end (MAX) \"\n"
        "                              \"and busy time (SUM); 1 - busy / (world_size * makespan)\")\n"),
    harness=check_bubble, solution=bubble, ranks=(3, 2),
    wrong={"this rank's idle fraction only": bubble_local,
           "forgets the p in p × makespan": mutant(bubble, ("dist.get_world_size() * ", "")),
           "mean of the ranks' own bubbles": bubble_mean_of_ranks},
    hint="the makespan is the whole pipeline's (earliest start anywhere to latest end anywhere), "
         "not this rank's",
    sizes="3 and 2 ranks, 1F1B with 1, 4, 9 micro-batches, jittered costs, unsorted events")
