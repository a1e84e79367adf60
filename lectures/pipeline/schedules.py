"""Pipeline schedules as data: one ordered list of actions per rank, built from the papers.

A schedule is a `Schedule` (one list of `Action`s per rank: F forward, B backward or its input
half, W the weight-gradient half) on a `Layout` (which rank and chunk hold each stage). The
builders transcribe the published schedules:

- naive model parallelism and GPipe (Huang et al. 2019, https://arxiv.org/abs/1811.06965),
  breadth-first with chunks > 1 (Lamy-Poirier 2023, https://arxiv.org/abs/2211.05953);
- 1F1B (PipeDream-Flush, Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training", https://arxiv.org/abs/2006.09503; PipeDream itself, Harlap et al. 2018, is the
  asynchronous schedule it flushes) and interleaved 1F1B (Narayanan et al. 2021,
  "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  https://arxiv.org/abs/2104.04473);
- zero bubble ZB-H1 (transcribed) and ZB-H2 (Qi et al. 2023, "Zero Bubble Pipeline
  Parallelism", https://arxiv.org/abs/2401.10241; ZB-H2 built by a small greedy list scheduler
  under the paper's memory bound) and ZB-V (Qi et al. 2023, sec. 6, and 2024, "Pipeline
  Parallelism with Controllable Memory", https://arxiv.org/abs/2405.15362), transcribed from the
  phases of the paper's hand-made list as PyTorch's ScheduleZBVZeroBubble runs it;
- DualPipeV (DeepSeek-AI 2025, https://github.com/deepseek-ai/DualPipe; the "cut-in-half" V
  of DualPipe is Sea AI Lab's), from its eight phases.

Checking and simulating them is `lectures/pipeline/simulate.py`. Lecture 05 shows the code;
tests/test_lecture_05.py checks every schedule at several sizes.
"""
import collections
import math
import typing


class Action(typing.NamedTuple):
    """One unit of work on one rank. kind: "F" forward, "B" backward (the whole backward when
    the schedule does not split it, else only the input gradient), "W" the weight gradient.
    chunk: which of the rank's model chunks (0 when a rank holds one stage)."""
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self):
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


class Layout(typing.NamedTuple):
    """Where the `ranks × chunks` stages live.

    looped (interleaved 1F1B, and every one-chunk schedule): chunk c of rank r is stage c·p + r,
        so micro-batches loop through the ranks v times: 0,1,…,p−1,0,1,…
    v (DualPipeV, and ZBV; two chunks): chunk 0 of rank r is stage r, chunk 1 is stage 2p−1−r: the
        data goes down the ranks and comes back up, so rank 0 holds the first and the last
        stage and rank p−1 hands its activations to itself at the turn."""
    ranks: int
    chunks: int = 1
    style: str = "looped"

    @property
    def stages(self):
        return self.ranks * self.chunks

    def stage(self, rank, chunk):
        if self.style == "v":
            return rank if chunk == 0 else 2 * self.ranks - 1 - rank
        return chunk * self.ranks + rank

    def place(self, stage):
        """(rank, chunk) holding `stage`."""
        if self.style == "v":
            return (stage, 0) if stage < self.ranks else (2 * self.ranks - 1 - stage, 1)
        return stage % self.ranks, stage // self.ranks


class Schedule(list):
    """A list with one list of `Action`s per rank, plus what built it (name, layout, m) and, for
    DualPipeV, `pairs`: per rank, {index of a pair's first action: its number of actions} for
    the forward-and-backward pairs a GPU overlaps (None elsewhere)."""

    def __init__(self, per_rank, name, layout, microbatches, pairs=None):
        super().__init__(per_rank)
        self.name, self.layout, self.microbatches, self.pairs = name, layout, microbatches, pairs

    @property
    def split_backward(self):
        return any(a.kind == "W" for acts in self for a in acts)


SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev")
V_SHAPED = ("zb-v", "dualpipev")


# Micro-batches a rank may hold between a forward and the W that releases its activations, for
# the schedules built by `_greedy`; ZB-H1 and ZB-V are transcribed instead.
ZERO_BUBBLE = {
    "zb-h2": lambda p: 2 * p - 1,   # Qi et al. 2023, sec. 3.1: ZB-H2's peak, 2p − 1 micro-batches
}


def make_schedule(name, stages, microbatches, chunks=1):
    """The action lists of schedule `name` for `stages` pipeline ranks, `microbatches` micro-
    batches and `chunks` model chunks per rank (layouts: see `Layout`). Returns a `Schedule`.

    naive, gpipe (all-forward-all-backward) and 1f1b accept any number of chunks (looped layout;
    1f1b with chunks > 1 is interleaved 1F1B, gpipe with chunks > 1 is breadth-first); zb-h1 and
    zb-h2 use one chunk per rank; zb-v and dualpipev two, in the V layout."""
    p, m, v = stages, microbatches, chunks
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, microbatches and chunks must be >= 1 (got {p}, {m}, {v})")
    if name in V_SHAPED and v != 2:
        raise ValueError(f"{name} puts exactly two chunks on every rank in a V (chunks=2), got {v}")
    if name in ("zb-h1", "zb-h2") and v != 1:
        raise ValueError(f"{name} uses one chunk per rank; for two per rank use 'zb-v' or 'dualpipev'")
    layout = Layout(p, v, "v" if name in V_SHAPED else "looped")
    if name == "naive":
        per_rank = [_naive(layout, m, r) for r in range(p)]
    elif name == "gpipe":
        per_rank = [_all_forward_all_backward(layout, m, r) for r in range(p)]
    elif name in ("1f1b", "interleaved-1f1b"):
        per_rank = [_one_forward_one_backward(layout, m, r) for r in range(p)]
    elif name == "zb-h1":
        per_rank = [_zb_h1(p, m, r) for r in range(p)]
    elif name == "zb-v":
        per_rank = [_zb_v(p, m, r) for r in range(p)]
    elif name == "dualpipev":
        per_rank, pairs = _dualpipev(p, m)
        return Schedule(per_rank, name, layout, m, pairs)
    else:
        per_rank = _greedy(layout, m, ZERO_BUBBLE[name](p))
    return Schedule(per_rank, name, layout, m)


def _naive(layout, m, r):
    """One micro-batch at a time through the whole model, forward then backward."""
    out = []
    for i in range(m):
        out += [Action("F", i, c) for c in range(layout.chunks)]
        out += [Action("B", i, c) for c in reversed(range(layout.chunks))]
    return out


def _all_forward_all_backward(layout, m, r):
    """GPipe: every forward (chunk by chunk: breadth-first), then every backward."""
    return ([Action("F", i, c) for c in range(layout.chunks) for i in range(m)]
            + [Action("B", i, c) for c in reversed(range(layout.chunks)) for i in range(m)])


def _one_forward_one_backward(layout, m, r):
    """1F1B (PipeDream-Flush), and with chunks > 1 interleaved 1F1B (Narayanan et al. 2021):
    a warm-up of forwards, then alternate one forward and one backward, then the remaining
    backwards. Micro-batches go in groups, chunk by chunk (depth-first), so a rank can start
    chunk 1 of the first micro-batch while the others are still in chunk 0.

    Megatron's groups have p micro-batches and need m to be a multiple of p. For other m we
    make max(1, m // p) groups, sizes differing by at most one and the larger ones first (as
    PyTorch's ScheduleInterleaved1F1B does when it can): a short last group of fewer than p
    micro-batches would leave the last rank's chunk 1 waiting for a forward that the first
    rank has not been allowed to run yet: (p, m, v) = (6, 8, 2) deadlocked that way."""
    p, v = layout.ranks, layout.chunks
    sizes = group_sizes(p, m) if v > 1 else [m]
    forwards, backwards, start = [], [], 0
    for n in sizes:
        group = range(start, start + n)
        start += n
        forwards += [Action("F", i, c) for c in range(v) for i in group]
        backwards += [Action("B", i, c) for c in reversed(range(v)) for i in group]
    # Megatron's warm-up: the forwards that must run before the first backward can arrive.
    warmup = min(len(forwards), (p - r - 1) * (2 if v > 1 else 1) + (v - 1) * sizes[0])
    out = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        out += [f, b]
    return out + backwards[len(forwards) - warmup:]


def group_sizes(p, m):
    """Interleaved 1F1B's micro-batch groups: max(1, m // p) of them, larger ones first."""
    groups = max(1, m // p)
    base, extra = divmod(m, groups)
    return [base + 1] * extra + [base] * (groups - extra)


def _zb_h1(p, m, r):
    """ZB-H1 (Qi et al. 2023, sec. 3.1, fig. 3), rank r: 1F1B's order of F and B, with each W run
    right after a B but r micro-batches late (rank r runs its first r backwards without their W;
    PyTorch's ScheduleInterleavedZeroBubble with one chunk, "ZB1P", does the same). Every rank
    then holds at most p micro-batches between F and W, 1F1B's peak, and with F = B = W the
    makespan is 3m + (p − 1) instead of 1F1B's 3m + 3(p − 1): bubble (p − 1)(F + B − W)."""
    warmup = min(p - r, m)
    out = [Action("F", i) for i in range(warmup)]
    for k in range(m):
        out.append(Action("B", k))
        if k >= r:
            out.append(Action("W", k - r))
        if warmup + k < m:
            out.append(Action("F", warmup + k))
    return out + [Action("W", i) for i in range(max(0, m - r), m)]


def _zb_v(p, m, r):
    """ZB-V (Qi et al. 2023, sec. 6; 2024), rank r, in the phases of the paper's hand-made list
    (the order PyTorch's ScheduleZBVZeroBubble runs). Chunk 0 is stage r, chunk 1 stage 2p−1−r.
    The list is laid out for n = max(m, 2p − 1) micro-batches, the fewest that fill the V, and
    the actions of micro-batches ≥ m are then dropped. Every rank holds at most 2p half-size
    chunks (1F1B's p micro-batches), and with F = B = W its only idle time is the V's head."""
    n, out = max(m, 2 * p - 1), []
    count = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}

    def act(kind, c, index=None):
        i = count[kind, c] if index is None else index
        count[kind, c] += 1
        out.append(Action(kind, i, c))

    for _ in range(2 * (p - r) - 1):      # warm-up 1: chunk 0 forwards down the V's first arm
        act("F", 0)
    for _ in range(r):                    # warm-up 2: the first chunk-1 forwards, alternating
        act("F", 1), act("F", 0)
    for _ in range(p - r):                # warm-up 3: the turn; chunk 1's B and W at once
        act("F", 1), act("B", 1), act("W", 1)
    while count["F", 1] < count["F", 0] or count["F", 0] < n:   # steady: F B W per chunk
        if count["F", 0] < n:
            act("F", 0)
        act("B", 0), act("W", 0)
        act("F", 1), act("B", 1), act("W", 1)
    w0, w1 = count["B", 0], count["B", 1]  # cool-down: Bs first, the Ws fill the drain
    for _ in range(r):
        act("B", 0), act("B", 1)
    for _ in range(p - r):
        act("B", 0), act("W", 0, w0)
        w0 += 1
    out += [Action("W", i, 1) for i in range(w1, count["B", 1])]
    out += [Action("W", i, 0) for i in range(w0, count["B", 0])]
    return [a for a in out if a.microbatch < m]


def _greedy(layout, m, limit):
    """Build action lists by simulating the pipeline with unit costs (a chunk's action 1/v).
    Whenever a rank is free it takes, in this order: a ready B (oldest micro-batch first, the
    deeper stage on a tie); a ready F (deeper chunk first) if it holds fewer than `limit`
    (micro-batch, chunk)s between their F and their W; a waiting W; else it idles until
    something ends. Ws are what a rank runs when it would otherwise wait, and the limit is the
    memory bound: a rank at its limit must run a W before the next F. Orders made this way
    are dependency-correct by construction (ZB-H2, Qi et al. 2023)."""
    p, S, v = layout.ranks, layout.stages, layout.chunks
    done, ends = {}, []
    clock = [0.0] * p
    next_f = [[0] * v for _ in range(p)]
    waiting_b = [[] for _ in range(p)]          # (microbatch, chunk) forwarded, B not yet run
    waiting_w = [collections.deque() for _ in range(p)]
    held = [0] * p                              # between F and W
    out = [[] for _ in range(p)]
    total, blocked = 3 * S * m, set()      # blocked: ranks with nothing to do until something ends
    while sum(map(len, out)) < total:
        free = [rr for rr in range(p) if len(out[rr]) < 3 * v * m and rr not in blocked]
        if not free:
            raise RuntimeError(f"greedy schedule stuck (limit {limit} too small?)")
        r = min(free, key=lambda rr: (clock[rr], rr))
        t = clock[r]
        choice = None
        ready_b = [(i, c) for i, c in waiting_b[r]
                   if layout.stage(r, c) == S - 1 or done.get(("B", layout.stage(r, c) + 1, i), math.inf) <= t]
        if ready_b:
            i, c = min(ready_b, key=lambda ic: (ic[0], -layout.stage(r, ic[1])))
            waiting_b[r].remove((i, c))
            waiting_w[r].append(Action("W", i, c))
            choice = Action("B", i, c)
        elif held[r] < limit:
            for c in sorted(range(v), key=lambda c: -layout.stage(r, c)):
                i, s = next_f[r][c], layout.stage(r, c)
                if i < m and (s == 0 or done.get(("F", s - 1, i), math.inf) <= t):
                    next_f[r][c] += 1
                    waiting_b[r].append((i, c))
                    held[r] += 1
                    choice = Action("F", i, c)
                    break
        if choice is None and waiting_w[r]:
            choice = waiting_w[r].popleft()
            held[r] -= 1
        if choice is None:            # idle until something ends or another rank moves on
            later = [e for e in ends if e > t] + [clock[q] for q in range(p) if clock[q] > t]
            if later:
                clock[r] = min(later)
            else:
                blocked.add(r)
            continue
        blocked.clear()
        clock[r] = t + 1 / v
        done[(choice.kind, layout.stage(r, choice.chunk), choice.microbatch)] = clock[r]
        ends.append(clock[r])
        out[r].append(choice)
    return out


def _dualpipev(p, m):
    """DualPipeV (DeepSeek-AI 2025, the V-shaped 'cut-in-half' DualPipe), transcribed from the
    eight phases of its reference schedule. Each forward/backward pair of two different chunks
    ("F0 B1", "F1 B0") is what the GPU version overlaps with the other pair's communication; a
    backward that is not zero-bubble is its B immediately followed by its W. Returns the lists
    and, per rank, the pairs ({index of the pair's F: its actions}): those of phases 4 and 5,
    but the last rank's first, which the reference runs without overlap."""
    if m < 2 * p:
        raise ValueError(f"dualpipev needs at least 2·stages = {2 * p} micro-batches, got {m}")
    per_rank, pairs = [], []
    for r in range(p):
        acts, next_f, next_b, deferred = [], [0, 0], [0, 0], collections.deque()
        overlapped = {}

        def pair(f, b):                # F of chunk f with the whole backward of chunk b: one unit
            start = len(acts)
            F(f), B(b)
            overlapped[start] = len(acts) - start

        def F(c):
            acts.append(Action("F", next_f[c], c))
            next_f[c] += 1

        def B(c, zero_bubble=False):
            i = next_b[c]
            next_b[c] += 1
            acts.append(Action("B", i, c))
            (deferred.append if zero_bubble else acts.append)(Action("W", i, c))

        def W():
            acts.append(deferred.popleft())

        for _ in range(2 * (p - r - 1)):       # 1: forwards of chunk 0 fill the V's first arm
            F(0)
        for _ in range(r + 1):                 # 2: alternate chunk 0 and chunk 1 forwards
            F(0), F(1)
        for _ in range(p - r - 1):             # 3: B1 W1 F1, zero bubble
            B(1, True), W(), F(1)
        for i in range(m - 2 * p + r + 1):     # 4: steady state, F0 B1 | F1 B0 pairs
            if i == 0 and r == p - 1:           # the reference does not overlap this one
                F(0), B(1)
            else:
                pair(0, 1)
            pair(1, 0)
        for _ in range(p - r - 1):             # 5: B1 | F1 B0
            B(1), pair(1, 0)
        zb = False
        for i in range(r + 1):                 # 6: B1 B0, the second half with W postponed
            zb = zb or (i == (r + 1) // 2 and r % 2 == 1)
            B(1, zb)
            zb = zb or (i == (r + 1) // 2 and r % 2 == 0)
            B(0, zb)
        for _ in range(p - r - 1):             # 7: W B0
            W(), B(0, True)
        for _ in range(r + 1):                 # 8: the remaining Ws
            W()
        assert not deferred
        per_rank.append(acts)
        pairs.append(overlapped)
    return per_rank, pairs
