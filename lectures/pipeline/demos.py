"""What each rank runs in lecture 05's demos, and the one-process references they are checked
against; the lecture launches them with spawn() and narrates what they return. Beside them, the
helpers that turn what the ranks return into numbers (bubbles, differences from one process), and
the cost of a chunk's action and the percentages the page and its appendix print."""
import statistics

import torch
import torch.distributed as dist

from lectures.model.gpt import GPT, GPTConfig, batch, loss_fn
from lectures.pipeline.executor import build_rank, gradients_by_name, measured_cost, split_gpt, stage_parameters
from lectures.pipeline.schedules import Action, Layout, make_schedule
from lectures.pipeline.simulate import simulate, theory_bubble
from util import device, quiet
from util import span as timed   # a timed block on a rank: its span (local names `span` are x-axis lengths)
from util.measure import measure, measure_side_by_side, spreads_overlap, value_range

# =========================================================================================
# 0. The unit of the cost model, and how the page prints a fraction
# =========================================================================================

def chunk_cost(v, F=1.0, B=1.0, W=1.0, send=0.0):
    """Costs of one action when a rank's layers are cut into v chunks: each takes 1/v as long. A
    message (`send`) carries the same activation whatever v, so its time is not divided."""
    return {"F": F / v, "B": B / v, "W": W / v, **({"send": send} if send else {})}


def pct(x):
    return "—" if x is None else f"{100 * x:.1f}%"


# =========================================================================================
# 1. Rank functions: train with a schedule; the single-process reference
# =========================================================================================

def microbatches(cfg, m, mb_size, step, seed=0):
    """The step's global batch (m·mb_size sequences, identical on every rank), in m pieces."""
    tokens, targets = batch(cfg, m * mb_size, step, seed)
    return list(tokens.chunk(m)), list(targets.chunk(m))


def train_pipeline(rank, world_size, cfg, schedule, m, mb_size, chunks=1, steps=1, lr=3e-3,
                   delay=None, checkpoint=False):
    """`steps` AdamW steps with a pipeline schedule. Returns the loss of every step (from the
    last stage's rank), the first step's gradients and the final parameters of this rank's
    stages (by full-model name), and what the last step measured."""
    executor, stages = build_rank(rank, world_size, cfg, schedule, m, mb_size, chunks, delay, checkpoint)
    opt = torch.optim.AdamW(stage_parameters(stages), lr=lr)
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
            "peak_saved_bytes": out["peak_saved_bytes"], "messages": out["messages"],
            "events": [(tuple(a), t0, t1) for a, t0, t1 in out["events"]]}   # the last step's spans


def train_schedules(rank, world_size, cfg, runs, mb_size, steps):
    """`train_pipeline` for every (name, m, v) in `runs`, in one process group."""
    return {(name, m, v): train_pipeline(rank, world_size, cfg, name, m, mb_size, chunks=v, steps=steps)
            for name, m, v in runs}


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


ALL = [("naive", 1), ("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1),
       ("zb-v", 2), ("dualpipev", 2)]   # (schedule, chunks per rank) in the order the page teaches them


ONE_PROCESS_NAME = {"lm_head.weight": "tok_emb.weight"}   # a tied LM head is the embedding, in one process


def differences(per, ref):
    """(max |Δ loss|, max |Δ gradient|, max |Δ parameter|) of one run's ranks against one
    process; a tied LM head's copy is compared with one process's embedding, the weight it is."""
    loss = next(r["losses"] for r in per if r["losses"][0] is not None)

    def worst(got, want):
        return max((got[k] - want[k if k in want else ONE_PROCESS_NAME[k]]).abs().max().item()
                   for k in set(got) | set(want))
    return (max(abs(a - b) for a, b in zip(loss, ref["losses"])),
            worst(merged(per, "grads"), ref["grads"]), worst(merged(per, "params"), ref["params"]))


def merged(returns, key):
    """Union over ranks of each rank's dict `key` (every parameter lives on one rank)."""
    out = {}
    for r in returns:
        out.update(r[key])
    return out


# =========================================================================================
# 2. Measuring schedules on real ranks
# =========================================================================================

SLEEP = {"F": 0.006, "B": 0.006, "W": 0.006}   # sleep mode: what each action also waits (s)


def measured_bubble(per_rank_events):
    """1 − busy / (ranks × makespan) from measured (action, start, end) spans of one step."""
    start = min(t0 for ev in per_rank_events for _, t0, _ in ev)
    end = max(t1 for ev in per_rank_events for _, _, t1 in ev)
    busy = sum(t1 - t0 for ev in per_rank_events for _, t0, t1 in ev)
    return 1 - busy / (len(per_rank_events) * (end - start))


def measure_schedules(rank, world_size, cfg, runs, mb_size, delay=None, repeats=5, warmup=1, track_memory=True):
    """Each run ({"name", "m", "v", "checkpoint"}) timed as whole steps, the runs taking turns
    (`measure_side_by_side`: a noisy machine's drift hits them all alike); every timed step's
    spans are kept so the page can compute its bubble. Returns, per run label: the step
    Timing, the spans of every timed step, peak saved bytes (and the output gradients held at
    that peak), messages sent and the costs the plan was timed with: the sleeps in sleep mode,
    else the F, B, W measured in one step first (`measured_cost`)."""
    steps, fns, plan_costs = {}, {}, {}
    for run in runs:
        executor, stages = build_rank(rank, world_size, cfg, run["name"], run["m"], mb_size, run.get("v", 1),
                                      delay=delay, checkpoint=run.get("checkpoint", False), track_memory=track_memory)
        inputs, targets = microbatches(cfg, run["m"], mb_size, 0)
        steps[run["label"]] = []
        if not delay:                       # real compute: time the plan with this run's own costs
            executor.plan_for(measured_cost(executor.step(inputs, targets)["events"]))
            for mod in stages.values():
                mod.zero_grad(set_to_none=True)

        def one_step(executor=executor, stages=stages, inputs=inputs, targets=targets, out=steps[run["label"]]):
            got = executor.step(inputs, targets)
            for mod in stages.values():
                mod.zero_grad(set_to_none=True)
            out.append(got)
        fns[run["label"]] = one_step
        plan_costs[run["label"]] = executor.plan_cost
    timings = measure_side_by_side(fns, warmup=warmup, repeats=repeats)
    results = {}
    for label, timing in timings.items():
        timed = steps[label][warmup:]
        results[label] = {
            "timing": timing, "events": [[(tuple(a), t0, t1) for a, t0, t1 in s["events"]] for s in timed],
            "peak_saved_bytes": timed[-1]["peak_saved_bytes"], "peak_held_grads": timed[-1]["peak_held_grads"],
            "messages": timed[-1]["messages"], "loss": timed[-1]["loss"], "plan_cost": plan_costs[label]}
    return results


# The step ratios: long sleeps, so that the fixed cost every action also pays here (Python, a
# gloo message, waking a sleeping rank on cores shared by more processes: 2 to 10 ms, measured on
# the page) is small against an action. Interleaved, ZB-V and DualPipeV run twice the actions,
# each half as long, and ZB-V three times 1F1B's: at 7 ms per action and 120 ms sleeps ZB-V's
# ratio came out 0.06 above the simulator's, at 200 ms about 0.035.
RATIO_SLEEP = 0.2


def ratio_cfg(p):
    """The smallest GPT that gives every one of 2p chunks a layer: a cost per action as small as
    the executor allows, so that the ratio measures the schedule (each micro-batch one sequence)."""
    return GPTConfig(n_layers=2 * p, d_model=8, n_heads=1, seq_len=4, vocab_size=16)
RATIO_RUNS = [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("dualpipev", 2)]


def step_ratios(returns, p=4, m=8, delay=RATIO_SLEEP, base="1f1b"):
    """{schedule: (measured, simulated)} step over `base`'s: measured as the median over rounds of
    each round's ratio (the runs take turns, so a round's steps share the machine's state), and
    simulated at the sleep costs (a chunk's action 1/v of it; no communication)."""
    timings = {label: r["timing"] for label, r in returns[0].items()}
    sims = {name: simulate(make_schedule(name, p, m, v), chunk_cost(v, delay, delay, delay)).makespan
            for name, v in RATIO_RUNS if name in timings}
    out = {}
    for name in sims:
        rounds = [a / b for a, b in zip(timings[name].samples, timings[base].samples)]
        out[name] = (statistics.median(rounds), sims[name] / sims[base])
    return out


def excess_per_action(returns, label, name, m, v, p, delay):
    """(measured step − simulated step at the sleep costs) over the actions a rank runs: what each
    action costs beyond its sleep on this machine (compute, Python, gloo, waking up), spread
    over a rank's list (s)."""
    sim = simulate(make_schedule(name, p, m, v), chunk_cost(v, delay, delay, delay)).makespan
    actions = max(len(acts) for acts in make_schedule(name, p, m, v))
    return (returns[0][label]["timing"].median - sim) / actions


def action_lengths(returns, label):
    """{kind: median length (s)} of the actions every rank measured in run `label`'s timed steps."""
    spans = {}
    for rows in gather_runs(returns, label):
        for row in rows:
            for a, t0, t1 in row:
                spans.setdefault(a.kind, []).append(t1 - t0)
    return {k: statistics.median(v) for k, v in spans.items()}


def between_actions(excess_z, excess_o, action_z, z, o):
    """ZB-H1's step against its list simulated at its measured action lengths, per action
    (`excess_*`, seconds; 1F1B's beside it): time lost between actions is given as a reason for a
    slower step only when ZB-H1 loses clearly more there (over 1.1× 1F1B's excess, and over 5% of
    its average action)."""
    if excess_z <= 0:
        return (f"its step took {-excess_z * 1e3:.1f} ms per action less than that list, so time between "
                "its actions did not slow it.")
    other = f"{abs(excess_o) * 1e3:.1f} ms per action {'longer' if excess_o >= 0 else 'shorter'}"
    said = (f"its step is {excess_z * 1e3:.1f} ms per action longer (1F1B's {other}): time lost between "
            "actions (messages, Python, cores shared). ")
    share = f"ZB-H1's excess is {excess_z / action_z:.1f}× its average action"
    if excess_z > 1.1 * max(excess_o, 0) and excess_z > 0.05 * action_z:     # clearly more, and not a trifle
        return said + f"It loses more there than 1F1B: {share}, so the slots W fills are not clean idle time as on a GPU."
    amount = ("less there than" if excess_z < 0.9 * excess_o else
              "about as much there as" if excess_z <= 1.1 * excess_o else "little there, but more than")
    why = ", so that is not what makes its step slower" if z.median > o.median and not spreads_overlap(z, o) else ""
    return said + f"It loses {amount} 1F1B ({share}){why}."


def overhead_per_action(returns, label, name, m, v, p):
    """(action lengths, the step's time per action beyond the simulator at those lengths): the
    measured median step minus the makespan of the list simulated with the measured median
    F, B (and W), over the actions of a rank's list: what each action costs between actions
    (waiting for a message, Python, sharing cores) that the schedule does not explain."""
    lengths = action_lengths(returns, label)
    cost = {"F": lengths["F"], "B": lengths["B"], "W": lengths.get("W", 0)}
    sched = make_schedule(name, p, m, v)
    sim = simulate(sched, cost if "W" in lengths else dict(cost, W=0)).makespan
    return lengths, (returns[0][label]["timing"].median - sim) / max(len(acts) for acts in sched)


def gather_runs(returns, label):
    """Per timed step: the per-rank event lists of run `label`, from every rank's return."""
    n_steps = len(returns[0][label]["events"])
    return [[[(Action(*a), t0, t1) for a, t0, t1 in r[label]["events"][k]] for r in returns]
            for k in range(n_steps)]


def measured_bubbles(returns, label):
    steps = gather_runs(returns, label)
    return [measured_bubble(rows) for rows in steps], steps


def median_step(steps, bubbles):
    """The timed step whose bubble is the median one (for drawing)."""
    order = sorted(range(len(bubbles)), key=bubbles.__getitem__)
    return steps[order[len(order) // 2]]


def bubble_row(returns, label, name, m, v, p):
    bubbles, _ = measured_bubbles(returns, label)
    sleep_cost = {"F": SLEEP["F"] / v, "B": SLEEP["B"] / v, "W": SLEEP["W"] / v}
    sim = simulate(make_schedule(name, p, m, v), sleep_cost)
    q = statistics.quantiles(bubbles, n=4, method="inclusive") if len(bubbles) > 1 else [bubbles[0]] * 3
    return {"theory": theory_bubble(name, p, m, v), "simulated": sim.bubble,
            "measured": statistics.median(bubbles), "iqr": (q[0], q[2]), "sim": sim}


def measured_pct(b):
    """A measured bubble and its interquartile range, '27.6% (25.1–29.0%)', never '75.9% (75.9%–75.9%)'."""
    return f"{pct(b['measured'])} ({value_range(100 * b['iqr'][0], 100 * b['iqr'][1], '%')})"


def units_against(mine, theirs, who):
    """'27 units, as many as ZB-H1' or '25.5 units against ZB-V's 27' (never 'N against N')."""
    return (f"{mine:g} units, as many as {who}" if abs(mine - theirs) < 1e-9
            else f"{mine:g} units against {who}'s {theirs:g}")


def measured_busy(returns, label):
    """The median over timed steps of the compute time summed over ranks (s)."""
    return statistics.median(sum(t1 - t0 for row in rows for _, t0, t1 in row) for rows in gather_runs(returns, label))


# =========================================================================================
# 3. Deadlock: both neighbours send first
# =========================================================================================

def both_send_first(rank, world_size, numel, batched=False):
    """Two stages exchange activations and gradients. With blocking sends posted first, each
    waits for the other to receive: a deadlock (gloo's send of a large tensor returns only once
    the peer has taken it). Posting the send and the receive together in one
    `batch_isend_irecv` lets both complete."""
    other = 1 - rank
    mine, theirs = torch.full((numel,), float(rank), device=device()), torch.empty(numel, device=device())
    if batched:
        with timed("batched"):
            ops = [dist.P2POp(dist.isend, mine, other), dist.P2POp(dist.irecv, theirs, other)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    else:
        with timed("send"):             # the span ends when the send does: at the timeout
            dist.send(mine, other)      # blocks until rank `other` receives ... which it never does
        dist.recv(theirs, other)
    return theirs[0].item()


def rank_spans(run, label):
    """{rank: (start, end)} of the span `label` each rank recorded; a rank that recorded none
    spans the whole demo."""
    got = {x["rank"]: (x["start"], x["end"]) for x in run.spans if x["label"] == label}
    return {r: got.get(r, (0.0, run.elapsed)) for r in range(run.world_size)}


# =========================================================================================
# 4. PyTorch's own: torch.distributed.pipelining
# =========================================================================================

PYTORCH_SCHEDULES = {   # PyTorch's class: (chunks per rank, our closest schedule, its chunks)
    "ScheduleGPipe": (1, "gpipe", 1),
    "Schedule1F1B": (1, "1f1b", 1),
    "ScheduleInterleaved1F1B": (2, "interleaved-1f1b", 2),
    "ScheduleInterleavedZeroBubble": (2, "zb-h1", 1),
    "ScheduleZBVZeroBubble": (2, "zb-v", 2),
    "ScheduleDualPipeV": (2, "dualpipev", 2),
}


def pytorch_pipeline(rank, world_size, cfg, schedule_class, chunks, m, mb_size, group=None):
    """A step function running PyTorch's `schedule_class` on our GPTStage pieces (V layout for
    the V schedules, looped otherwise), and this rank's {stage: module}."""
    from torch.distributed import pipelining
    style = "v" if schedule_class in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") else "looped"
    layout = Layout(world_size, chunks, style)
    _, stages = split_gpt(cfg, layout)
    mine = {layout.stage(rank, c): stages[layout.stage(rank, c)] for c in range(chunks)}
    pipe_stages = [pipelining.PipelineStage(mod, s, layout.stages, device(), group=group)
                   for s, mod in sorted(mine.items())]
    cls = getattr(pipelining, schedule_class)
    sched = (cls(pipe_stages[0], n_microbatches=m, loss_fn=loss_fn) if chunks == 1 else
             cls(pipe_stages, n_microbatches=m, loss_fn=loss_fn))
    has_first, has_last = 0 in mine, layout.stages - 1 in mine

    def step(tokens, targets):
        losses = []
        args = (tokens.to(device()),) if has_first else ()
        kwargs = {"target": targets.to(device()), "losses": losses} if has_last else {}
        sched.step(*args, **kwargs)
        return sum(l.item() for l in losses) / m if has_last else None
    return step, mine


def compare_with_pytorch(rank, world_size, cfg, m, mb_size, classes, repeats=5, warmup=2):
    """PyTorch's schedules `classes` and our closest ones on the same model and batch: loss,
    this rank's gradients (by full-model name) and the step time, measured in the same
    processes."""
    tokens, targets = batch(cfg, m * mb_size, 0)
    inputs, target_list = list(tokens.chunk(m)), list(targets.chunk(m))
    steps = {}
    for cls in classes:
        chunks, ours, our_chunks = PYTORCH_SCHEDULES[cls]
        if "ours: " + ours not in steps:
            executor, mine = build_rank(rank, world_size, cfg, ours, m, mb_size, our_chunks, track_memory=False)
            steps["ours: " + ours] = (lambda ex=executor: ex.step(inputs, target_list)["loss"], mine)
        fn, mine = pytorch_pipeline(rank, world_size, cfg, cls, chunks, m, mb_size)
        steps["PyTorch " + cls] = (lambda f=fn: f(tokens, targets), mine)
    losses, grads = {}, {}
    for label, (fn, mine) in steps.items():
        with quiet():
            losses[label] = fn()
        grads[label] = gradients_by_name(mine)
        for mod in mine.values():
            mod.zero_grad(set_to_none=True)
    with quiet():   # ours and PyTorch's take turns, so drift does not favour either
        times = measure_side_by_side({label: fn for label, (fn, _) in steps.items()},
                                     warmup=warmup, repeats=repeats)
    return {"losses": losses, "grads": grads, "times": times}
