"""Pipeline schedules checked and simulated: `check_schedule` verifies that a list of actions
per rank (`lectures/schedules.py`) is complete; `simulate` runs it against a cost model and
reports the bubble, or a deadlock; `theory_bubble` gives the textbook formulas and
`dualpipev_readme_bubble` DeepSeek's; `held` counts the micro-batches a rank holds; `message_order`
lists what each pair of ranks exchanges, in the order the sender produces it (NCCL matches a
pair's messages in posting order); `message_slots` gives each message a time on one clock that
both its ends post it at, and `p2p_deadlock` runs the ranks' posting programs under NCCL's rules.
"""
import collections
import typing

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


class Simulation(typing.NamedTuple):
    timeline: list      # per rank: [(Action, start, end)] in execution order
    makespan: float
    busy: list          # per rank: the time spent computing
    bubble: float       # 1 − Σ busy / (ranks × makespan)


def simulate(schedule, cost, layout=None):
    """Run the action lists against a cost model: `cost` maps "F", "B", "W" to compute times
    and "send" to the time a message takes between two ranks. A rank runs its list in order;
    an action starts when the rank is free and its inputs have arrived. In a schedule without
    W, a B is the whole backward and costs B + W. Raises ValueError on a deadlock."""
    layout = layout or schedule.layout
    split = any(a.kind == "W" for acts in schedule for a in acts)
    dur = {"F": cost["F"], "B": cost["B"] + (0 if split else cost.get("W", 0)), "W": cost.get("W", 0)}
    send = cost.get("send", 0)
    pos, clock = [0] * layout.ranks, [0.0] * layout.ranks
    finish, timeline = {}, [[] for _ in range(layout.ranks)]
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(schedule):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                s = layout.stage(r, a.chunk)
                deps = dependencies(a, s, layout)
                if any(d not in finish for d in deps):
                    break
                ready = [finish[d] + (send if layout.place(d[1])[0] != r else 0) for d in deps]
                start = max([clock[r]] + ready)
                clock[r] = start + dur[a.kind]
                finish[(a.kind, s, a.microbatch)] = clock[r]
                timeline[r].append((a, start, clock[r]))
                pos[r] += 1
                progress = True
    stuck = [(r, str(acts[pos[r]])) for r, acts in enumerate(schedule) if pos[r] < len(acts)]
    if stuck:
        raise ValueError(f"deadlock: every rank waits, next actions {stuck}")
    makespan = max(clock)
    busy = [sum(e - s for _, s, e in row) for row in timeline]
    return Simulation(timeline, makespan, busy, 1 - sum(busy) / (layout.ranks * makespan) if makespan else 0.0)


def theory_bubble(name, p, m, v=1):
    """The textbook bubble fraction under F = B, W = 0, no communication: (p−1)/(m+p−1) for
    AFAB and 1F1B; interleaving divides the bubble time by v: (p−1)/(v·m+p−1); naive keeps one
    stage busy at a time: 1 − 1/p. None where the schedule has no closed form here."""
    if name == "naive":
        return 1 - 1 / p
    if name in ("gpipe", "1f1b") and v == 1:
        return (p - 1) / (m + p - 1)
    if name in ("interleaved-1f1b", "1f1b") and m % p == 0:   # Megatron's setting: m a multiple of p
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


def message_slots(schedule, layout=None):
    """{(kind, stage, microbatch): slot} for every message between two ranks: the time its data
    is ready when every action costs one unit (a whole backward two) and sends are free. Both
    ends post the message in their batch of that slot, and every rank posts its batches in slot
    order; so the batches of one slot meet across all ranks once every earlier slot is done,
    which is what NCCL needs (see p2p_deadlock)."""
    layout = layout or schedule.layout
    sim = simulate(schedule, UNIT_COSTS, layout)
    slots = {}
    for r, row in enumerate(sim.timeline):
        for a, _, end in row:
            s = layout.stage(r, a.chunk)
            key = (("act", s + 1, a.microbatch) if a.kind == "F" and s < layout.stages - 1 else
                   ("grad", s - 1, a.microbatch) if a.kind == "B" and s > 0 else None)
            if key and layout.place(key[1])[0] != r:
                slots[key] = end
    return slots


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
