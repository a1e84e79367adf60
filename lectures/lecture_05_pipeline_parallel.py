"""Pipeline parallelism: split the layers, keep every stage busy

Each rank holds a contiguous slice of the layers (a *stage*) and passes activations forward and
gradients backward to its neighbours. A step is cut into micro-batches so that stages can work
at the same time; *how* the micro-batches are ordered on every rank — the schedule — decides how
much time the ranks sit idle (the bubble) and how many activations each holds. Here every
schedule is plain data (one list of actions per rank), checked by a simulator, run by one
executor on real ranks, and compared with PyTorch's own `torch.distributed.pipelining`.
"""
import collections
import math
import statistics
import time
import typing

import torch
import torch.distributed as dist
from torch import nn

from lectures.lecture_01_memory_and_precision import GPT, GPTConfig, batch, loss_fn
from util import device, figure, note, quiet, see, settings, span_at, spawn, table
from util.measure import machine, measure, usable_cores

# =========================================================================================
# 1. Schedules as data: one ordered list of actions per rank
# =========================================================================================


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
    """A list with one list of `Action`s per rank, plus what built it (name, layout, m)."""

    def __init__(self, per_rank, name, layout, microbatches):
        super().__init__(per_rank)
        self.name, self.layout, self.microbatches = name, layout, microbatches

    @property
    def split_backward(self):
        return any(a.kind == "W" for acts in self for a in acts)


SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "dualpipev")
V_SHAPED = ("dualpipev",)


# (micro-batches a rank may hold between F and B, Ws it may postpone), as functions of (p, rank)
ZERO_BUBBLE = {
    "zb-h1": (lambda p, r: p - r, lambda p, r: p - r - 1),         # 1F1B's memory
    "zb-h2": (lambda p, r: 2 * (p - r) - 1, lambda p, r: 2 * p),   # more warm-up, Ws at the end
}


def make_schedule(name, stages, microbatches, chunks=1):
    """The action lists of schedule `name` for `stages` pipeline ranks, `microbatches` micro-
    batches and `chunks` model chunks per rank (layouts: see `Layout`). Returns a `Schedule`.

    naive, gpipe (all-forward-all-backward) and 1f1b accept any number of chunks (looped layout;
    1f1b with chunks > 1 is interleaved 1F1B, gpipe with chunks > 1 is breadth-first); zb-h1 and
    zb-h2 use one chunk per rank; dualpipev two, in the V layout."""
    p, m, v = stages, microbatches, chunks
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, microbatches and chunks must be >= 1 (got {p}, {m}, {v})")
    if name in V_SHAPED and v != 2:
        raise ValueError(f"{name} puts exactly two chunks on every rank in a V (chunks=2), got {v}")
    if name in ("zb-h1", "zb-h2") and v != 1:
        raise ValueError(f"{name} uses one chunk per rank; for two per rank use 'dualpipev'")
    layout = Layout(p, v, "v" if name in V_SHAPED else "looped")
    if name == "naive":
        per_rank = [_naive(layout, m, r) for r in range(p)]
    elif name == "gpipe":
        per_rank = [_all_forward_all_backward(layout, m, r) for r in range(p)]
    elif name in ("1f1b", "interleaved-1f1b"):
        per_rank = [_one_forward_one_backward(layout, m, r) for r in range(p)]
    elif name == "dualpipev":
        per_rank = _dualpipev(p, m)
    else:
        # Zero-bubble schedules: B before F before W, never more micro-batches held than the
        # limit (1F1B's for H1 and ZBV, about twice that for H2), W fills whatever gap is left.
        limit, postpone = ZERO_BUBBLE[name]
        per_rank = _greedy(layout, m, [limit(p, r) for r in range(p)], [postpone(p, r) for r in range(p)])
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
    backwards. Micro-batches go in groups of p, chunk by chunk (depth-first), so a rank can
    start chunk 1 of the first micro-batch while the others are still in chunk 0."""
    p, v = layout.ranks, layout.chunks
    forwards, backwards = [], []
    for g in range(0, m, p):
        group = range(g, min(g + p, m))
        forwards += [Action("F", i, c) for c in range(v) for i in group]
        backwards += [Action("B", i, c) for c in reversed(range(v)) for i in group]
    # Megatron's warm-up: the forwards that must run before the first backward can arrive.
    warmup = min(len(forwards), (p - r - 1) * (2 if v > 1 else 1) + (v - 1) * p)
    out = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        out += [f, b]
    return out + backwards[len(forwards) - warmup:]


def _greedy(layout, m, limit, postpone, eager_w=False, unit=1.0):
    """Build action lists by simulating the pipeline with unit costs. Whenever a rank is free it
    takes, in this order: a ready B (oldest micro-batch first); a W if more than
    `postpone[rank]` are waiting; a ready F if fewer than `limit[rank]` micro-batches are
    between their F and their B; any waiting W. Postponed Ws fill the gaps in which a rank
    would otherwise wait. Orders made this way are dependency-correct by construction."""
    p, S = layout.ranks, layout.stages
    done, ends = {}, []
    clock = [0.0] * p
    next_f = [[0] * layout.chunks for _ in range(p)]
    waiting_b = [[] for _ in range(p)]          # (microbatch, chunk) forwarded, B not yet run
    waiting_w = [collections.deque() for _ in range(p)]
    out = [[] for _ in range(p)]
    total, idle = 3 * S * m, 0
    while sum(map(len, out)) < total:
        r = min((rr for rr in range(p) if len(out[rr]) < 3 * layout.chunks * m), key=lambda rr: clock[rr])
        t = clock[r]
        choice = None
        ready_b = [(i, c) for i, c in waiting_b[r]
                   if layout.stage(r, c) == S - 1 or done.get(("B", layout.stage(r, c) + 1, i), math.inf) <= t]
        if ready_b:
            i, c = min(ready_b, key=lambda ic: (ic[0], -layout.stage(r, ic[1])))
            waiting_b[r].remove((i, c))
            waiting_w[r].append(Action("W", i, c))
            choice = Action("B", i, c)
        elif len(waiting_w[r]) > postpone[r]:
            choice = waiting_w[r].popleft()
        else:
            # deeper chunks first; only chunk 0 admits new micro-batches, up to the limit
            for c in sorted(range(layout.chunks), key=lambda c: -layout.stage(r, c)):
                i, s = next_f[r][c], layout.stage(r, c)
                if c == 0 and len(waiting_b[r]) >= limit[r]:
                    continue
                if i < m and (s == 0 or done.get(("F", s - 1, i), math.inf) <= t):
                    next_f[r][c] += 1
                    waiting_b[r].append((i, c))
                    choice = Action("F", i, c)
                    break
        if choice is None and waiting_w[r] and (eager_w or all(i >= m for i in next_f[r])):
            choice = waiting_w[r].popleft()
        if choice is None:            # idle until something ends or another rank moves on
            later = [e for e in ends if e > t] + [clock[q] for q in range(p) if clock[q] > t]
            clock[r] = min(later) if later else t + unit
            idle += 1
            if idle > 10 * p:
                raise RuntimeError(f"greedy schedule stuck on rank {r} (limit {limit[r]} too small?)")
            continue
        idle = 0
        clock[r] = t + unit
        done[(choice.kind, layout.stage(r, choice.chunk), choice.microbatch)] = clock[r]
        ends.append(clock[r])
        out[r].append(choice)
    return out


def _dualpipev(p, m):
    """DualPipeV (DeepSeek-AI 2025, the V-shaped 'cut-in-half' DualPipe), transcribed from the
    eight phases of its reference schedule. Each forward/backward pair of two different chunks
    ("F0 B1", "F1 B0") is what the GPU version overlaps with the other pair's communication; a
    backward that is not zero-bubble is its B immediately followed by its W."""
    if m < 2 * p:
        raise ValueError(f"dualpipev needs at least 2·stages = {2 * p} micro-batches, got {m}")
    per_rank = []
    for r in range(p):
        acts, next_f, next_b, deferred = [], [0, 0], [0, 0], collections.deque()

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
        for _ in range(m - 2 * p + r + 1):     # 4: steady state, F0 B1 | F1 B0 pairs
            F(0), B(1), F(1), B(0)
        for _ in range(p - r - 1):             # 5: B1 | F1 B0
            B(1), F(1), B(0)
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
    return per_rank


# =========================================================================================
# 2. Checking and simulating a schedule
# =========================================================================================

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


# =========================================================================================
# 3. The model, cut into stages by layers
# =========================================================================================

class GPTStage(nn.Module):
    """A contiguous slice of lecture 01's GPT: the embeddings if it is the first stage, some
    blocks, the final LayerNorm and LM head if it is the last. It shares (does not copy) the
    full model's modules, so gradients land on the full model's parameters."""

    def __init__(self, model, stage, n_stages):
        super().__init__()
        L = len(model.blocks)
        bounds = [k * L // n_stages for k in range(n_stages + 1)]   # sizes differ by at most one
        self.first, self.last = stage == 0, stage == n_stages - 1
        self.block_ids = list(range(bounds[stage], bounds[stage + 1]))
        if self.first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleList(model.blocks[j] for j in self.block_ids)
        if self.last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x):
        if self.first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x

    def global_name(self, local):
        """'blocks.1.attn.q_proj.weight' here -> the full model's 'blocks.5.attn.q_proj.weight'."""
        if local.startswith("blocks."):
            _, j, rest = local.split(".", 2)
            return f"blocks.{self.block_ids[int(j)]}.{rest}"
        return local


def split_gpt(cfg, layout):
    """{stage: GPTStage} for the stages of every rank, by layers, from one seeded full model."""
    if cfg.tie_embeddings and layout.stages > 1:
        raise ValueError("tied embeddings put one parameter on the first and the last stage; "
                         "untie them (GPTConfig(tie_embeddings=False)) for pipelining")
    model = GPT(cfg).to(device())
    return model, {s: GPTStage(model, s, layout.stages) for s in range(layout.stages)}


# =========================================================================================
# 4. One executor for every schedule
# =========================================================================================

def param_leaves(module):
    """The modules that own parameters directly (Linear, LayerNorm, Embedding, ...)."""
    return [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]


class SavedBytes:
    """Bytes autograd saves for backward (distinct storages, parameters excluded): what one
    micro-batch held between its forward and its backward costs, measured, not estimated."""

    def __init__(self, params):
        self.now, self.peak = 0, 0
        self.params = {p.untyped_storage().data_ptr() for p in params}

    def hooks(self, counter):
        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.params:
                counter[storage.data_ptr()] = storage.nbytes()
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def hold(self, nbytes):
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def free(self, nbytes):
        self.now -= nbytes


class PipelineExecutor:
    """Runs one rank's action list. Plug in `modules` ({chunk: nn.Module}: the stage each
    chunk holds; the first takes the micro-batch's inputs, the last's output goes to
    `loss_fn(output, target)`), the `layout`, this rank's index in `group` and the shape and
    dtype of what crosses a stage boundary.

    Sends never block: each is an `isend` posted in one `batch_isend_irecv` together with the
    receive the next action needs, and waited for at the end of the step. The only waits are
    for inputs, so any schedule the simulator can finish runs without deadlock.

    `delay` ({"F": s, "B": s, "W": s}) adds a fixed sleep to each action: sleep mode, for more
    ranks than cores. `checkpoint` re-runs each stage's forward during its backward instead of
    keeping its activations."""

    def __init__(self, schedule, modules, rank, boundary_shape, *, group=None, loss_fn=loss_fn,
                 dtype=torch.float32, delay=None, checkpoint=False, layout=None):
        self.actions = schedule[rank]
        self.layout = layout or schedule.layout
        self.split = any(a.kind == "W" for acts in schedule for a in acts)
        self.modules, self.rank, self.group = modules, rank, group
        self.shape, self.dtype, self.loss_fn = tuple(boundary_shape), dtype, loss_fn
        self.delay, self.checkpoint = delay or {}, checkpoint
        if self.split and checkpoint:
            raise ValueError("checkpointing with a split backward is not supported here")
        self.leaves = {c: param_leaves(mod) for c, mod in modules.items()}
        self.messages = 0

    def _peer(self, stage):
        r = self.layout.place(stage)[0]
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _tag(self, kind, stage, mb):
        return (0 if kind == "act" else 1) + 2 * (stage + self.layout.stages * mb)

    def _incoming(self, a):
        """(key, source stage) of the message action `a` needs, or None (none, or local)."""
        s = self.layout.stage(self.rank, a.chunk)
        if a.kind == "F" and s > 0 and self.layout.place(s - 1)[0] != self.rank:
            return ("act", s, a.microbatch), s - 1
        if a.kind == "B" and s < self.layout.stages - 1 and self.layout.place(s + 1)[0] != self.rank:
            return ("grad", s, a.microbatch), s + 1
        return None

    def _post_recv(self, a, ops):
        need = self._incoming(a)
        if need and need[0] not in self.inbox:
            buf = torch.empty(self.shape, dtype=self.dtype, device=device())
            self.inbox[need[0]] = [buf, None]
            ops.append((dist.P2POp(dist.irecv, buf, self._peer(need[1]), self.group, self._tag(*need[0])), need[0]))

    def _take(self, key):
        """The tensor for `key`: local hand-over, or the posted receive, waited for."""
        if key in self.local:
            return self.local.pop(key)
        buf, work = self.inbox.pop(key)
        if work is not None:
            work.wait()
        return buf

    def _launch(self, ops):
        if ops:
            works = dist.batch_isend_irecv([op for op, _ in ops])
            for (op, key), work in zip(ops, works):
                if key is None:
                    self.sending.append((work, op.tensor))
                else:
                    self.inbox[key][1] = work

    def step(self, inputs, targets, record=False):
        """Run the action list once on micro-batches `inputs[i]`, `targets[i]`. Gradients
        accumulate into the modules' parameters (each micro-batch's loss is divided by m, so
        they are those of the mean loss). Returns the summed loss on the last stage's rank (else
        None), the measured (action, start, end) list, and the peak bytes saved for backward."""
        m = len(inputs)
        S = self.layout.stages
        self.local, self.inbox, self.sending, state = {}, {}, [], {}
        memory = SavedBytes(p for mod in self.modules.values() for p in mod.parameters())
        events, loss_sum = [], None
        self.messages = 0
        first = self.actions[0] if self.actions else None
        ops = []
        if first is not None:
            self._post_recv(first, ops)
            self._launch(ops)
        for n, a in enumerate(self.actions):
            s = self.layout.stage(self.rank, a.chunk)
            key_in = self._incoming(a)
            t0 = time.perf_counter()
            ops = []
            if a.kind == "F":
                if s == 0:
                    x = inputs[a.microbatch].to(device())
                else:
                    x = self._take(key_in[0] if key_in else ("act", s, a.microbatch)).requires_grad_()
                counter = {}
                with memory.hooks(counter):
                    ys = self._forward(a.chunk, x)
                out = ys.pop("out")
                if s == S - 1:
                    loss = self.loss_fn(out, targets[a.microbatch].to(device()))
                    loss_sum = (loss_sum or 0.0) + loss.item()
                    out = loss / m
                else:
                    self._send("act", s + 1, a.microbatch, out.detach(), ops)
                nbytes = sum(counter.values())
                memory.hold(nbytes)
                state[a.microbatch, a.chunk] = {"x": x, "out": out, "leaves": ys, "bytes": nbytes}
            elif a.kind == "B":
                st = state[a.microbatch, a.chunk]
                g = None if s == S - 1 else self._take(key_in[0] if key_in else ("grad", s, a.microbatch))
                dx = self._backward(st, g)
                if s > 0:
                    self._send("grad", s - 1, a.microbatch, dx, ops)
                if not self.split:
                    memory.free(st["bytes"])
                    del state[a.microbatch, a.chunk]
            else:
                st = state.pop((a.microbatch, a.chunk))
                for module, y, dy in st["weight_work"]:
                    torch.autograd.backward(y, dy, inputs=list(module.parameters(recurse=False)))
                memory.free(st["bytes"])
            if a.kind in self.delay:
                time.sleep(self.delay[a.kind])
            if n + 1 < len(self.actions):
                self._post_recv(self.actions[n + 1], ops)
            self._launch(ops)
            t1 = time.perf_counter()
            events.append((a, t0, t1))
            if record:
                span_at(a.kind, t0, t1)
        for work, _ in self.sending:
            work.wait()
        return {"loss": None if loss_sum is None else loss_sum / m, "events": events, "peak_saved_bytes": memory.peak,
                "messages": self.messages}

    def _forward(self, chunk, x):
        """The stage's forward; in split mode the outputs of every parameter-owning module are
        kept, so that W can later turn their gradients into weight gradients."""
        module = self.modules[chunk]
        if self.checkpoint:
            from torch.utils.checkpoint import checkpoint
            return {"out": checkpoint(module, x, use_reentrant=False)}
        if not self.split:
            return {"out": module(x)}
        seen = []
        handles = [leaf.register_forward_hook(lambda mod, inp, y: seen.append((mod, y)))
                   for leaf in self.leaves[chunk]]
        try:
            out = module(x)
        finally:
            for h in handles:
                h.remove()
        return {"out": out, "seen": seen}

    def _backward(self, st, g):
        """B. Unsplit: the whole backward; the input's gradient is x.grad. Split (zero bubble):
        ask autograd only for the gradients of the input and of every parameter-owning module's
        output — the weight-gradient products are not computed — and keep the latter for W,
        which multiplies them into weight gradients one module at a time."""
        x, out = st["x"], st["out"]
        if not self.split:
            torch.autograd.backward(out, g)
            return x.grad if x.requires_grad else None
        seen = st["leaves"]["seen"]
        wrt = ([x] if x.requires_grad else []) + [y for _, y in seen]
        grads = torch.autograd.grad(out, wrt, g, retain_graph=True, allow_unused=True)
        dx = grads[0] if x.requires_grad else None
        dys = grads[1:] if x.requires_grad else grads
        st["weight_work"] = [(mod, y, dy) for (mod, y), dy in zip(seen, dys) if dy is not None]
        return dx

    def _send(self, kind, stage, mb, tensor, ops):
        dest = self.layout.place(stage)[0]
        if dest == self.rank:                                # the V's turn: a local hand-over
            self.local[(kind, stage, mb)] = tensor.detach()
            return
        self.messages += 1
        ops.append((dist.P2POp(dist.isend, tensor.contiguous(), self._peer(stage), self.group,
                               self._tag(kind, stage, mb)), None))


def gradients_by_name(stage_modules):
    """{full-model parameter name: gradient} over the given {stage: GPTStage}."""
    out = {}
    for module in stage_modules.values():
        for local, p in module.named_parameters():
            if p.grad is not None:
                out[module.global_name(local)] = p.grad.detach().cpu().clone()
    return out


# =========================================================================================
# 5. Rank functions: train with a schedule; the single-process reference
# =========================================================================================

def microbatches(cfg, m, mb_size, step, seed=0):
    """The step's global batch (m·mb_size sequences, identical on every rank), in m pieces."""
    tokens, targets = batch(cfg, m * mb_size, step, seed)
    return list(tokens.chunk(m)), list(targets.chunk(m))


def build_rank(rank, world_size, cfg, schedule, m, mb_size, chunks=1, delay=None, checkpoint=False, group=None):
    """This rank's executor and stages for schedule `schedule` (a name or a Schedule)."""
    sched = schedule if isinstance(schedule, Schedule) else make_schedule(schedule, world_size, m, chunks)
    check_schedule(sched)
    _, stages = split_gpt(cfg, sched.layout)
    mine = {c: stages[sched.layout.stage(rank, c)] for c in range(sched.layout.chunks)}
    executor = PipelineExecutor(sched, mine, rank, (mb_size, cfg.seq_len, cfg.d_model), group=group,
                                dtype=cfg.torch_dtype, delay=delay, checkpoint=checkpoint)
    return executor, {sched.layout.stage(rank, c): mod for c, mod in mine.items()}


def train_pipeline(rank, world_size, cfg, schedule, m, mb_size, chunks=1, steps=1, lr=3e-3,
                   delay=None, checkpoint=False):
    """`steps` AdamW steps with a pipeline schedule. Returns the loss of every step (from the
    last stage's rank), the first step's gradients and the final parameters of this rank's
    stages (by full-model name), and what the last step measured."""
    executor, stages = build_rank(rank, world_size, cfg, schedule, m, mb_size, chunks, delay, checkpoint)
    params = [p for mod in stages.values() for p in mod.parameters()]
    opt = torch.optim.AdamW(params, lr=lr)
    losses, grads = [], None
    for step in range(steps):
        inputs, targets = microbatches(cfg, m, mb_size, step)
        out = executor.step(inputs, targets)
        losses.append(out["loss"])
        if grads is None:
            grads = gradients_by_name(stages)
        opt.step()
        opt.zero_grad()
    final = {}
    for mod in stages.values():
        for local, p in mod.named_parameters():
            final[mod.global_name(local)] = p.detach().cpu().clone()
    return {"losses": losses, "grads": grads, "params": final, "stages": sorted(stages),
            "peak_saved_bytes": out["peak_saved_bytes"], "messages": out["messages"]}


def reference_train(cfg, m, mb_size, steps=1, lr=3e-3):
    """One process, the whole batch at once: what every schedule must equal."""
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], None
    for step in range(steps):
        tokens, targets = batch(cfg, m * mb_size, step)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
