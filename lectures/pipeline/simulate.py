"""Pipeline schedules checked and simulated: `check_schedule` verifies that a list of actions
per rank (`lectures/pipeline/schedules.py`) is complete; `simulate` runs it against a cost model and
reports the bubble, or a deadlock; `consecutive_steps` and `steady_step` run several training
steps back to back; `theory_bubble` gives the textbook formulas, `qi_bubble` Qi et al.'s and
`dualpipev_readme_bubble` DeepSeek's; `held` counts the micro-batches a rank holds; `message_order`
lists what each pair of ranks exchanges, in the order the sender produces it (NCCL matches a
pair's messages in posting order); `message_slots` gives each message a time on one clock that
both its ends post it at, `p2p_deadlock` runs the ranks' posting programs under NCCL's rules and
`one_stream_makespan` times them.
"""
import collections
import math
import numbers
import typing

from lectures.pipeline.schedules import SCHEDULES


def dependencies(action, stage, layout):
    """What `action` (on `stage`) waits for: keys (kind, stage, microbatch) of other actions.
    F needs the previous stage's F; B needs its own F and the next stage's B; W its own B."""
    i = action.microbatch
    if action.kind == "F":
        return [("F", stage - 1, i)] if stage > 0 else []
    if action.kind == "B":
        return [("F", stage, i)] + ([("B", stage + 1, i)] if stage < layout.stages - 1 else [])
    return [("B", stage, i)]


def check_schedule(schedule, layout=None, microbatches=None):
    """Raise ValueError unless every rank runs F and B (and W for all or none) exactly once per
    (stage it holds, micro-batch), with no unknown kinds or chunks."""
    layout = layout or schedule.layout
    m = microbatches or schedule.microbatches
    split = any(a.kind == "W" for acts in schedule for a in acts)
    if len(schedule) != layout.ranks:
        raise ValueError(f"{len(schedule)} action lists for {layout.ranks} ranks")
    kinds = "FBW" if split else "FB"
    for r, acts in enumerate(schedule):
        seen = collections.Counter((a.kind, a.microbatch, a.chunk) for a in acts)
        want = {(k, i, c) for k in kinds for i in range(m) for c in range(layout.chunks)}
        extra = [a for a in seen if a not in want or seen[a] > 1]
        missing = want - set(seen)
        if extra or missing:
            raise ValueError(f"rank {r}: unexpected or repeated {sorted(extra)[:5]}, "
                             f"missing {sorted(missing)[:5]}")


def held(schedule):
    """Per rank, the most (micro-batch, chunk)s held at once: between F and the action that
    releases their activations (W when the backward is split, else B)."""
    release = "W" if schedule.split_backward else "B"
    peaks = []
    for acts in schedule:
        now = peak = 0
        for a in acts:
            now += (a.kind == "F") - (a.kind == release)
            peak = max(peak, now)
        peaks.append(peak)
    return peaks


def message_order(schedule, layout=None):
    """{(sender, receiver): [(kind, stage, microbatch), ...]}: the messages between each pair of
    ranks in the order the sender's list produces them ("act" for stage s: F's output going to
    stage s; "grad": B's input gradient going to stage s). A receiver that posts its receives in
    this order is matched correctly by NCCL, which pairs a pair's sends and receives in posting
    order and ignores tags."""
    layout = layout or schedule.layout
    order = collections.defaultdict(list)
    for r, acts in enumerate(schedule):
        for a in acts:
            s = layout.stage(r, a.chunk)
            if a.kind == "F" and s < layout.stages - 1:
                key = ("act", s + 1, a.microbatch)
            elif a.kind == "B" and s > 0:
                key = ("grad", s - 1, a.microbatch)
            else:
                continue
            dest = layout.place(key[1])[0]
            if dest != r:
                order[r, dest].append(key)
    return dict(order)


def check_costs(cost, pair=None):
    """Raise ValueError unless `cost` gives F and B (W and send default to 0) and every cost, and
    `pair` when given, is a finite number of at least 0: a negative or NaN time has no meaning,
    and would come back as a bubble outside 0-100% or a NaN makespan."""
    missing = [k for k in ("F", "B") if k not in cost]
    if missing:
        raise ValueError(f"cost needs F and B (W and send default to 0); {', '.join(missing)} missing from {cost}")
    given = dict(cost, **({} if pair is None else {"pair": pair}))
    for name, x in given.items():
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x < 0:
            raise ValueError(f"cost {name} must be a finite number of at least 0, not {x!r}")


class Simulation(typing.NamedTuple):
    timeline: list      # per rank: [(Action, start, end)] in execution order
    makespan: float
    busy: list          # per rank: the time spent computing
    bubble: float       # 1 − Σ busy / (ranks × makespan)


def simulate(schedule, cost, layout=None, pair=None):
    """Run the action lists against a cost model: `cost` maps "F", "B", "W" to compute times
    and "send" to the time a message takes between two ranks. A rank runs its list in order;
    an action starts when the rank is free and its inputs have arrived. In a schedule without
    W, a B is the whole backward and costs B + W. Raises ValueError on a deadlock.

    `pair`: the time of an overlapped forward-and-backward pair (DualPipe's F&B). When given, the
    schedule's `pairs` (DualPipeV's) run as one unit each, as on a GPU that overlaps them: the
    unit starts once all its inputs are there, and what its actions produce leaves when it ends.
    Every cost must be finite and at least 0 (`check_costs`)."""
    check_costs(cost, pair)
    layout = layout or schedule.layout
    split = any(a.kind == "W" for acts in schedule for a in acts)
    dur = {"F": cost["F"], "B": cost["B"] + (0 if split else cost.get("W", 0)), "W": cost.get("W", 0)}
    send = cost.get("send", 0)
    units = getattr(schedule, "pairs", None) if pair is not None else None
    steps = [_units(acts, r, layout, units[r] if units else None) for r, acts in enumerate(schedule)]
    pos, clock = [0] * layout.ranks, [0.0] * layout.ranks
    finish, timeline = {}, [[] for _ in range(layout.ranks)]
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(steps):
            while pos[r] < len(row):
                group, keys, deps = row[pos[r]]
                if any(d not in finish for d in deps):
                    break
                ready = [finish[d] + (send if layout.place(d[1])[0] != r else 0) for d in deps]
                start = max([clock[r]] + ready)
                length = pair if len(group) > 1 else dur[group[0].kind]
                total = sum(dur[a.kind] for a in group)
                t = start
                for a in group:            # a pair's actions share its time in the drawing
                    step = length * (dur[a.kind] / total if total else 1 / len(group))
                    timeline[r].append((a, t, t + step))
                    t += step
                clock[r] = start + length
                for k in keys:
                    finish[k] = clock[r]
                pos[r] += 1
                progress = True
    stuck = [(r, str(row[pos[r]][0][0])) for r, row in enumerate(steps) if pos[r] < len(row)]
    if stuck:
        raise ValueError(f"deadlock: every rank waits, next actions {stuck}")
    makespan = max(clock)
    busy = [sum(e - s for _, s, e in row) for row in timeline]
    return Simulation(timeline, makespan, busy, 1 - sum(busy) / (layout.ranks * makespan) if makespan else 0.0)


def _units(acts, rank, layout, pairs=None):
    """A rank's list as the units it runs, in order: (actions, their keys, what they wait for),
    worked out once rather than each time the simulation tries the unit. `pairs` ({position:
    length}) joins an overlapped forward-and-backward into one unit."""
    out, n = [], 0
    while n < len(acts):
        group = acts[n:n + (pairs.get(n, 1) if pairs else 1)]
        keys = [(a.kind, layout.stage(rank, a.chunk), a.microbatch) for a in group]
        deps = [d for a, k in zip(group, keys) for d in dependencies(a, k[1], layout) if d not in keys]
        out.append((group, keys, deps))
        n += len(group)
    return out


def consecutive_steps(schedule, steps=2):
    """The lists of `steps` training steps run back to back, with nothing between them: each rank
    starts the next step's actions as soon as its own are done, as when the optimizer step does
    not synchronise the ranks (Qi et al.'s post-validation). Step k's micro-batch i is numbered
    k·m + i, so the dependencies stay within a step."""
    m = schedule.microbatches
    per_rank = [[a._replace(microbatch=k * m + a.microbatch) for k in range(steps) for a in acts]
                for acts in schedule]
    pairs = schedule.pairs and [{k * len(acts) + n: size for k in range(steps) for n, size in units.items()}
                                for acts, units in zip(schedule, schedule.pairs)]
    return type(schedule)(per_rank, f"{schedule.name} × {steps}", schedule.layout, steps * m, pairs)


def steady_step(schedule, cost):
    """What one more step adds to the makespan once the steps run back to back: the time of a
    step in the steady state (two steps' makespan minus one's)."""
    one = simulate(schedule, cost).makespan
    return simulate(consecutive_steps(schedule, 2), cost).makespan - one


def qi_bubble(name, p, F, B, W):
    """The idle time per rank and step in Qi et al. 2024, Table 2, for 1F1B, ZB-H1 and ZB-H2
    (ZB-H2's across steps, once the optimizer step no longer synchronises): (p−1)(F+B+W),
    (p−1)(F+B−W) and (p−1)(F+B−2W), with F, B, W a stage's forward, input-gradient and
    weight-gradient times. ZB-H2's assumes 2W <= F + B (it cannot be negative)."""
    bracket = {"1f1b": F + B + W, "zb-h1": F + B - W, "zb-h2": F + B - 2 * W}
    if name not in bracket:
        raise ValueError(f"Qi et al.'s Table 2 covers 1f1b, zb-h1 and zb-h2, not {name!r}")
    if name == "zb-h2" and 2 * W > F + B:
        raise ValueError(f"(p-1)(F+B-2W) assumes 2W <= F + B; got F={F}, B={B}, W={W}")
    return (p - 1) * bracket[name]


def theory_bubble(name, p, m, v=1):
    """The textbook bubble fraction under F = B, W = 0, no communication: (p−1)/(m+p−1) for
    AFAB and 1F1B; interleaving divides the bubble time by v: (p−1)/(v·m+p−1); naive keeps one
    stage busy at a time: 1 − 1/p. None where the schedule has no closed form here."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1 for x in (p, m, v)):
        raise ValueError(f"need whole numbers p, m and v of at least 1 (as make_schedule); got p={p}, m={m}, v={v}")
    if name == "naive":
        return 1 - 1 / p
    if name in ("gpipe", "1f1b") and v == 1:
        return (p - 1) / (m + p - 1)
    if name in ("interleaved-1f1b", "1f1b") and m >= p:   # Megatron's m a multiple of p, and our groups
        return (p - 1) / (v * m + p - 1)
    return None


def dualpipev_readme_bubble(p, F, B, W, FB=None):
    """DualPipeV's bubble as DeepSeek's DualPipe README states it, (S/2 − 1)(F&B + B − 3W), with
    S = 2p stages on p devices: F, B, W a chunk's forward, full backward and weight backward,
    F&B an overlapped forward-and-backward pair (F + B when nothing overlaps, as on a CPU)."""
    if p < 1 or min(F, B, W) < 0 or W > B:
        raise ValueError(f"need p >= 1 and 0 <= W <= B, F >= 0; got p={p}, F={F}, B={B}, W={W}")
    FB = F + B if FB is None else FB
    return (p - 1) * (FB + B - 3 * W)


UNIT_COSTS = {"F": 1, "B": 1, "W": 1}     # integers: every time on this clock is exact


def plan_clock(cost=None):
    """The costs a communication plan is timed with, on an integer clock: `cost` ({"F", "B", "W"},
    optionally "send": the times the run will have, given or measured) scaled so that the
    dearest is 1000 and rounded, F and B at least 1 (a message leaves when its action ends, so
    that action must take time). Integers keep every sum exact, so equal times on two ranks
    are equal slots; None gives unit costs (F = B = W = 1)."""
    if cost is None:
        return dict(UNIT_COSTS)
    check_costs(cost)
    given = {k: cost.get(k, 0) for k in ("F", "B", "W", "send")}
    top = max(given.values())
    if top <= 0:
        return dict(UNIT_COSTS)
    clock = {k: round(1000 * v / top) for k, v in given.items()}
    clock["F"], clock["B"] = max(1, clock["F"]), max(1, clock["B"])
    return clock if clock["send"] else {k: v for k, v in clock.items() if k != "send"}


def message_slots(schedule, layout=None, cost=None, sim=None):
    """{(kind, stage, microbatch): slot} for every message between two ranks: the time its data
    is ready when the actions take what `cost` says (`plan_clock`: the run's own costs; unit
    costs if None). Both ends post the message in their batch of that slot, and every rank
    posts its batches in slot order; so the batches of one slot meet across all ranks once
    every earlier slot is done, which is what NCCL needs (see p2p_deadlock), and a message is
    posted when its data is ready on the clock the run keeps, not behind a batch whose
    partner is still computing. `sim`: that simulation, when the caller has it already."""
    layout = layout or schedule.layout
    sim = sim or simulate(schedule, plan_clock(cost), layout)
    slots = {}
    for r, row in enumerate(sim.timeline):
        for a, _, end in row:
            s = layout.stage(r, a.chunk)
            key = (("act", s + 1, a.microbatch) if a.kind == "F" and s < layout.stages - 1 else
                   ("grad", s - 1, a.microbatch) if a.kind == "B" and s > 0 else None)
            if key and layout.place(key[1])[0] != r:
                slots[key] = end
    return slots


def one_stream_makespan(schedule, cost, plans):
    """The makespan of the ranks' posting programs `plans` (`executor.communication_plan`) under
    NCCL's one stream per rank, timed; None if they do not finish. A batch starts once the
    rank's compute before its posting point is done and its stream is free; it is done when
    every message of it has both ends' batches started (messages are free); an action starts
    when the rank is free and the batch holding its input is done. At unit costs with unit
    plans it is `simulate`'s makespan; with plans timed at other costs than the run's, a
    message ready early waits behind a batch whose partner is still computing."""
    layout, split = schedule.layout, schedule.split_backward
    dur = {"F": cost["F"], "B": cost["B"] + (0 if split else cost.get("W", 0)), "W": cost.get("W", 0)}
    p = layout.ranks
    pc, clock, stream_free = [0] * p, [0.0] * p, [0.0] * p
    start_of, done_at, batch_of = {}, {}, {}
    serial = 0
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(plans[r]):
                what, arg = plans[r][pc[r]]
                if what == "post":
                    serial += 1
                    start = max(clock[r], stream_free[r])
                    keys = [(op, peer, key) for op, peer, key in arg]
                    for _, _, key in keys:
                        batch_of[r, key] = serial
                    start_of[serial] = (r, start, keys)
                elif what == "wait":
                    b = batch_of[r, arg]
                    if b not in done_at:
                        if not _finish(b, start_of, batch_of, done_at, stream_free):
                            break
                    clock[r] = max(clock[r], done_at[b])
                else:
                    clock[r] += dur[schedule[r][arg].kind]
                pc[r] += 1
                progress = True
    if any(pc[r] < len(plans[r]) for r in range(p)):
        return None
    return max(clock)


def _finish(b, start_of, batch_of, done_at, stream_free):
    """Batch b is done when every message of it has both ends started (sends are free)."""
    r, start, keys = start_of[b]
    ends = []
    for op, peer, key in keys:
        other = batch_of.get((peer, key))
        if other is None:
            return False
        ends.append(start_of[other][1])
    done_at[b] = max([start] + ends)
    stream_free[r] = done_at[b]
    return True


def p2p_deadlock(programs):
    """Run every rank's posting program under NCCL's rules; None if all finish, else what is stuck.

    `programs[r]` is a list of ("post", [(op, peer, key), ...]) with op "send" or "recv" (one
    batch_isend_irecv), and ("wait", key): the rank's host waits until the batch holding `key`
    is done. At the end a rank waits for all its batches. The rules: a rank's batches run one
    after another, in posting order, on one stream; the ops of one batch run together; between
    two ranks the k-th send posted matches the k-th receive posted (tags are ignored); a send
    completes only when its matching receive runs (no buffering), and a batch is done when all
    its ops are."""
    n = len(programs)
    pc, streams, batch_of, done = [0] * n, [collections.deque() for _ in range(n)], {}, set()
    sent, recvd = collections.Counter(), collections.Counter()
    serial = 0
    progress = True
    while progress:
        progress = False
        for r in range(n):                      # each host runs until it must wait
            while pc[r] < len(programs[r]):
                what, arg = programs[r][pc[r]]
                if what == "wait":
                    if batch_of[r, arg] not in done:
                        break
                elif what == "post":
                    serial += 1
                    ops = []
                    for op, peer, key in arg:
                        pair = (r, peer) if op == "send" else (peer, r)
                        count = sent if op == "send" else recvd
                        ops.append({"op": op, "pair": pair, "k": count[pair], "done": False})
                        count[pair] += 1
                        batch_of[r, key] = serial
                    streams[r].append((serial, ops))
                pc[r] += 1
                progress = True
        for r in range(n):                      # the batches at the heads of the streams meet
            if not streams[r]:
                continue
            for op in streams[r][0][1]:
                if op["done"] or op["op"] != "send":
                    continue
                peer = op["pair"][1]
                if streams[peer]:
                    for other in streams[peer][0][1]:
                        if other["op"] == "recv" and other["pair"] == op["pair"] and other["k"] == op["k"]:
                            op["done"] = other["done"] = progress = True
        for r in range(n):
            while streams[r] and all(op["done"] for op in streams[r][0][1]):
                done.add(streams[r].popleft()[0])
                progress = True
    stuck = [(r, programs[r][pc[r]] if pc[r] < len(programs[r]) else "end",
              [(op["op"], op["pair"], op["k"]) for op in streams[r][0][1] if not op["done"]] if streams[r] else [])
             for r in range(n) if pc[r] < len(programs[r]) or streams[r]]
    return stuck or None
