"""Pipeline parallelism: split the layers, keep every stage busy

Each rank holds a contiguous slice of the layers (a *stage*) and passes activations forward and
gradients backward to its neighbours. A step is cut into micro-batches so that stages can work
at the same time; *how* the micro-batches are ordered on every rank — the schedule — decides how
much time the ranks sit idle (the bubble) and how many activations each holds. Here every
schedule is plain data (one list of actions per rank), checked by a simulator, run by one
executor on real ranks, and compared with PyTorch's own `torch.distributed.pipelining`.
"""
import statistics

from exercises import listing as notebook_exercises
from lectures.model.gpt import GPTConfig
from lectures.pipeline.demos import (ALL, PYTORCH_SCHEDULES, SLEEP, both_send_first, bubble_row, chunk_cost,
                                     compare_with_pytorch, differences, measure_schedules, measured_bubbles,
                                     measured_busy, measured_pct, median_step, pct, rank_spans, reference_train,
                                     train_schedules, units_against)
from lectures.pipeline.demos import measured_bubble, merged, train_pipeline  # noqa: F401  (re-exported)
from lectures.pipeline.explorer import explorer_data
from lectures.pipeline.executor import PipelineExecutor
from lectures.pipeline.executor import GPTStage, param_leaves  # noqa: F401  (re-exported)
from lectures.pipeline.simulate import (check_schedule, consecutive_steps, dualpipev_readme_bubble, held, message_order,
                                        qi_bubble, simulate, steady_step, theory_bubble)
from lectures.pipeline.simulate import Simulation, dependencies  # noqa: F401  (re-exported)
from lectures.pipeline.schedules import Layout, make_schedule
from lectures.pipeline.schedules import V_SHAPED, ZERO_BUBBLE, Schedule  # noqa: F401  (re-exported)
from lectures.pipeline.figures import (draw_rows, legend_patches, side_by_side, layouts_figure, executor_figure,
                                       deadlock_figure)
from util import cheat, deep_dive, figure, note, published, see, settings, spawn, table, widget
from util import try_it_yourself
from util.measure import compare, machine, spreads_overlap, value_range


# =========================================================================================
# 1. Drawing
# =========================================================================================

def held_over_time(sim, layout):
    """Per rank, [(time, stage-micro-batches held)] along a simulated timeline: +1/v at each F,
    −1/v at the action that releases it (W when split, else B)."""
    split = any(a.kind == "W" for row in sim.timeline for a, _, _ in row)
    release = "W" if split else "B"
    out = []
    for row in sim.timeline:
        now, pts = 0.0, [(0.0, 0.0)]
        for a, start, end in row:
            if a.kind == "F":
                now += 1 / layout.chunks
                pts.append((start, now))
            elif a.kind == release:
                now -= 1 / layout.chunks
                pts.append((end, now))
        merged = []                  # one point per instant: a release and the next F at the same time
        for t, y in pts:
            if merged and merged[-1][0] == t:
                merged[-1] = (t, y)
            else:
                merged.append((t, y))
        out.append(merged)
    return out


# =========================================================================================
# 2. The lecture
# =========================================================================================

def sleep_cfg(p):
    return GPTConfig(n_layers=max(8, 2 * p), d_model=32, n_heads=2, seq_len=16)


def compute_cfg():
    return GPTConfig(n_layers=8, d_model=64, n_heads=4, seq_len=32)


def sleep_ranks():
    """Sleep mode runs the build's world size (4 by default): sleeping ranks share cores fine."""
    return max(2, settings.world_size)


def bubble_picture(p=4, m=8):
    """The bubble in one picture: one batch through p stages (naive), then the same batch as m
    micro-batches (GPipe), simulated with F = 1 and an unsplit backward of 2 per batch."""
    import matplotlib.pyplot as plt
    runs = []
    for name, mm in (("naive", 1), ("gpipe", m)):
        sim = simulate(make_schedule(name, p, mm), {"F": 1 / mm, "B": 1 / mm, "W": 1 / mm})
        runs.append((name, mm, sim))
    span = max(sim.makespan for _, _, sim in runs)
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 4.6), sharex=True)
    for ax, (name, mm, sim) in zip(axes, runs):
        what = "one batch" if mm == 1 else f"the batch as {mm} micro-batches (GPipe)"
        draw_rows(ax, sim.timeline, f"{what}: {pct(sim.bubble)} idle", unit="time (one batch's forward = 1)",
                  scale=1, span=span, fontsize=12)
        ax.axvspan(0, sim.makespan, color="#e8e8e8", zorder=0)   # grey up to the step's end: the bubble
        ax.label_outer()
    from matplotlib.patches import Patch
    fig.legend(handles=legend_patches(chunks=False)[:2] + [Patch(color="#e8e8e8", label="idle: the bubble")],
               loc="lower center", ncol=3, frameon=False, fontsize=12)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    figure(fig, caption=f"{p} stages on {p} ranks, simulated. Top: one batch keeps one rank busy at a time. "
                        f"Bottom: cut into {m} micro-batches, the stages work at once and the grey "
                        "(the bubble) shrinks to the fill at the start and the drain at the end.")


def intro():
    note("# Pipeline parallelism")
    bubble_picture()
    note("""
        When the model no longer fits on one device, or data parallelism has run out of batch,
        cut the model by layers: rank $r$ holds stage $r$, sends its activations to rank $r+1$
        and receives gradients back. One batch through such a pipeline keeps one stage busy at
        a time (the picture, top). Cut the batch into $m$ micro-batches and the stages work at
        once (bottom); what stays idle is the *bubble*. The order in which each rank runs its
        forwards and backwards — the schedule — decides the bubble, the activations each rank
        holds, and the number of messages.

        Here a schedule is data: one ordered list of actions per rank (F: a micro-batch's
        forward through a stage, B: its backward, W: its weight-gradient half when the backward
        is split). A simulator runs the lists against a cost model; one executor runs any list
        on real ranks with lecture 01's GPT cut by layers (the first stage also holds the
        embeddings, the last the final LayerNorm and the LM head), and every schedule's loss
        and gradients equal one process's.

        **What you will learn.** What the bubble is and how each schedule shrinks it — GPipe,
        1F1B, interleaved 1F1B, the zero-bubble family (ZB-H1, ZB-H2, ZB-V) and DualPipeV — with
        each paper's numbers (bubble, micro-batches held) beside the simulator's and the
        ranks' measurements; what each rank holds over a step; why the executor batches its
        sends; PyTorch's `torch.distributed.pipelining` on the same model. The deep dives (tied
        embeddings across the pipeline, every list with W free, the lists at the F, B and W Qi
        et al. measured, DualPipeV's bubble formula, NCCL's posting order) sit in the appendix.

        **What you need.** Lecture 01 (what a forward saves for backward; recomputation) and
        lecture 02 (point-to-point `isend`/`irecv`, what blocks and what does not); PyTorch's
        autograd (`torch.autograd.backward` with an output gradient, `torch.autograd.grad`).
    """)


def schedules_as_data():
    p, m = 4, 8
    import matplotlib.pyplot as plt
    sched = make_schedule("1f1b", p, m)
    sim = simulate(sched, chunk_cost(1))
    fig, ax = plt.subplots(figsize=(7.5, 2.6))
    draw_rows(ax, sim.timeline, f"1F1B, {p} ranks, {m} micro-batches: bubble {pct(sim.bubble)}",
              unit="time (F = 1, unsplit B = 2)", scale=1, fontsize=12)
    fig.legend(handles=legend_patches(chunks=False)[:2], loc="lower center", ncol=2, frameon=False, fontsize=12)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    note("## Schedules as data")
    figure(fig, caption=f"The action lists below, simulated: each bar is one action, its number the micro-batch.")
    note(f"""
        A schedule is one list of actions per rank; here are 1F1B's for {p} ranks and {m}
        micro-batches. A forward `F3` needs stage $s-1$'s `F3`; a backward `B3` needs the
        stage's own `F3` and stage $s+1$'s `B3`; a `W3` needs the stage's `B3`. `F3.1` is
        micro-batch 3 on the rank's second chunk (chunk 1). Those rules are all a checker needs:
        `check_schedule` verifies that every (stage, micro-batch) appears once per kind,
        `simulate` runs the lists (the picture above) and reports a deadlock if every rank waits.
    """)
    table([[f"rank {r}", " ".join(map(str, acts))] for r, acts in enumerate(sched)],
          header=["rank", "1F1B actions, in order"])
    see(make_schedule, "make_schedule: every schedule of this lecture as action lists")
    see(Layout, "Layout: where each chunk's stage lives (looped or V)")
    see(simulate, "simulate: the list scheduler that checks and times a schedule")


def schedules_table(p=4, m=8):
    """Every schedule simulated with F = B and W free, then W = B: the theory beside both."""
    note(f"""
        ## Deep dive: every schedule with W free and with W = B
        The textbook bubbles assume a free weight gradient. Here every list of the page ({p} ranks,
        {m} micro-batches) on the simulator with W = 0 and with W = B, beside that theory.
    """)
    rows, free_w = [], {}
    for name, v in ALL:
        sch = make_schedule(name, p, m, v)
        check_schedule(sch)
        a, b = simulate(sch, chunk_cost(v, W=0)), simulate(sch, chunk_cost(v))
        free_w[name] = a.bubble
        rows.append([name, v, pct(theory_bubble(name, p, m, v)), pct(a.bubble), pct(b.bubble),
                     f"{b.makespan:g}", f"{max(held(sch)) / v:g}"])
    table(rows, header=["schedule", "chunks v", "theory (F=B, W=0)", "simulated, F=B, W=0",
                        "simulated, F=B=W", "makespan, F=B=W", "most micro-batches held"],
          caption=f"{p} ranks, {m} micro-batches; a chunk's action costs 1/v. {free_w_words(free_w)} "
                  "Once W costs as much as B, postponed Ws fill the "
                  "idle slots. Held: micro-batches between F and the release of their activations "
                  "(W when split, else B), the most on any rank, a chunk counting 1/v.")


def explorer(p=4, m=8):
    note("""
        Try it: the explorer below simulates these same action lists in the page (a JavaScript
        port of `simulate`, checked against it by the tests) for other sizes and costs. Make W
        cheap or dear, add a send cost, raise m, and watch the bubble and what each rank holds.
    """)
    widget("schedule-explorer", explorer_data(initial=("1f1b", p, m, 1)),
           caption="Every rank's timeline on one time axis, the bubble measured on it beside the paper's "
                   "formula at your costs (or why there is no closed form for that list), and the "
                   "activations each rank holds over the step.")


def free_w_words(free_w):
    """What the split-backward lists do when W is free (W = 0), against 1F1B, from the simulated
    bubbles {name: bubble}: the same, or better or worse by how many points."""
    chunks = dict(ALL)
    base = free_w["1f1b"]
    split = [n for n in ("zb-h1", "zb-h2", "zb-v", "dualpipev") if n in free_w]
    worse = [n for n in split if free_w[n] > base + 1e-9]
    better = [n for n in split if free_w[n] < base - 1e-9]
    same = [n for n in split if n not in worse and n not in better]
    parts = []
    if same:
        parts.append(f"With W = 0 splitting the backward gains nothing: {', '.join(same)} "
                     f"{'has' if len(same) == 1 else 'have'} 1F1B's {pct(base)}")
    if better:
        parts.append("; ".join(f"{n} is shorter ({pct(free_w[n])} against 1F1B's {pct(base)})"
                               + (f", from its {chunks[n]} chunks per rank" if chunks[n] > 1 else "")
                               for n in better))
    if worse:
        parts.append("; ".join(f"{n}'s list, built for F = B = W, loses "
                               f"{100 * (free_w[n] - base):.1f} points when W is free "
                               f"({pct(free_w[n])} against 1F1B's {pct(base)})" for n in worse))
    return "; ".join(parts) + "."


MEMORY_NAMES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("dualpipev", 2)]


def memory_figure(p, m, names=MEMORY_NAMES, caption=None):
    """Micro-batches each rank holds over a simulated step, for the schedules that differ."""
    import matplotlib.pyplot as plt
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5, 2.0 * rows + 0.7), sharex=True, sharey=True, squeeze=False)
    colours = plt.cm.viridis([i / max(1, p - 1) * 0.85 for i in range(p)])
    for ax, (name, v) in zip(axes.flat, names):
        sch = make_schedule(name, p, m, v)
        sim = simulate(sch, chunk_cost(v))
        for r, pts in enumerate(held_over_time(sim, sch.layout)):
            xs, ys = zip(*pts)
            ax.step(xs, ys, where="post", color=colours[r], lw=1.6, label=f"rank {r}")
        ax.set_title(f"{name}: most {max(held(sch)) / v:g}", fontsize=11, loc="left")
        ax.tick_params(labelsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("held", fontsize=11)
    for ax in axes[-1]:
        ax.set_xlabel("time (F = B = W = 1)", fontsize=10)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=p, frameon=False, fontsize=11)
    fig.tight_layout(rect=(0, 0.7 / (2.0 * rows + 0.7), 1, 1))
    figure(fig, caption=caption or f"Activations each rank holds during one step ({p} ranks, {m} micro-batches, "
                        "simulated from the action lists the ranks run): a micro-batch counts from its F "
                        "until the action that releases its activations (B, or W when the backward is "
                        "split); a chunk counts 1/v. GPipe climbs to m; 1F1B holds p − r on rank r; "
                        "ZB-H1 holds p on every rank (its postponed Ws keep activations longer), ZB-H2 "
                        "2p − 1, ZB-V p in half-size chunks.")


def executor_matches():
    n = settings.world_size
    cfg = GPTConfig(n_layers=2 * n, d_model=32, n_heads=2, seq_len=16, dtype="float64")
    mb_size, steps = 2, 2
    runs = [(name, 2 * n + 1 if name == "dualpipev" else n + 1, v) for name, v in ALL]
    run = spawn(train_schedules, n, cfg=cfg, runs=runs, mb_size=mb_size, steps=steps,
                name=f"every schedule vs one process, {n} ranks")
    rows, ok = [], True
    refs = {m: reference_train(cfg, m, mb_size, steps) for m in {m for _, m, _ in runs}}  # one per batch size
    for name, m, v in runs:
        ld, gd, pd = differences([r[name, m, v] for r in run.returns], refs[m])
        ok &= gd < 1e-9 and pd < 1e-9 and ld < 1e-6   # the loss itself is computed in float32
        rows.append([name, m, v, f"{ld:.1e}", f"{gd:.1e}", f"{pd:.1e}"])
    note("## One executor for every schedule")
    fig, length = executor_figure(run.returns, runs)
    (a, la), (b, lb) = length.items()
    figure(fig, caption=f"What one executor ran on each of the {n} ranks in the last of {steps} training "
                        f"steps, measured: {a[0]}'s list (left, {la * 1e3:.0f} ms) and {b[0]}'s "
                        f"(right, {lb * 1e3:.0f} ms: two chunks in a V, hatched the second, the backward "
                        f"split into B and W). Real compute, {n} ranks sharing {usable_cores_here()} cores. "
                        + ("Both, like every schedule below, end with one process's gradients."
                           if ok else "**Some schedule below differs from one process.**"))
    note(f"""
        `PipelineExecutor` runs one rank's list. Before an action it waits for that action's
        input (a message, or a local hand-over at the turn of a V). Its messages go out in
        `batch_isend_irecv` batches that both ends post at the same slot of one shared clock
        (`communication_plan`), every rank in slot order: any schedule the simulator can finish
        cannot deadlock, and each pair of ranks posts its messages in the same order at both
        ends, which NCCL needs (a deep dive shows why). The split backward asks autograd
        only for the gradients of the stage input and of each parameter-owning module's output
        (`torch.autograd.grad` skips the weight-gradient products it was not asked for); W
        later turns those into weight gradients one module at a time.

        The check: {steps} AdamW steps of lecture 01's GPT ({cfg.n_layers} layers) on {n} ranks
        with every schedule, against one process on the whole batch.
    """)
    table(rows, header=["schedule", "m", "chunks v", "max |Δ loss|", "max |Δ gradient|",
                        f"max |Δ parameter| after {steps} steps"],
          caption="Differences from one process (float64 model; lecture 01's loss is computed in "
                  "float32). " + ("All gradients and parameters within 1e-9, losses within 1e-6." if ok
                                  else "**Some differ by more than that.**"))
    see(PipelineExecutor, "PipelineExecutor: one rank's actions on real ranks")
    with deep_dive("Tied embeddings across the pipeline",
                   "the embedding on the first stage and the LM head on the last are one weight: what that costs"):
        tied_embeddings(n)


def tied_embeddings(n):
    """Deep dive: a GPT with tied embeddings on the pipeline, against one process with them, and
    what the tie costs a step."""
    cfg = GPTConfig(n_layers=2 * n, d_model=32, n_heads=2, seq_len=16, dtype="float64", tie_embeddings=True)
    mb_size, steps = 2, 2
    runs = [("1f1b", n + 1, 1), ("zb-v", n + 1, 2)]
    run = spawn(train_schedules, n, cfg=cfg, runs=runs, mb_size=mb_size, steps=steps,
                name=f"tied embeddings vs one process, {n} ranks")
    ref = reference_train(cfg, n + 1, mb_size, steps)
    rows = [[name, v, *(f"{d:.1e}" for d in differences([r[name, m, v] for r in run.returns], ref))]
            for name, m, v in runs]
    size = cfg.torch_dtype.itemsize
    note(f"""
        ## Deep dive: tied embeddings across the pipeline
        With tied embeddings the first stage's token embedding and the last stage's LM head are
        one weight, but in a pipeline they sit on different ranks. As Megatron-LM does, each of
        the two ranks keeps a copy, made equal at the start (the executor's first step gives the
        last stage's copy the first stage's values), and after each step's backward the two
        copies' gradients are summed across those two ranks, so both take the same optimizer
        step: one all-reduce per step of a vocab × hidden
        gradient, here {cfg.vocab_size} × {cfg.d_model} × {size} bytes =
        {cfg.vocab_size * cfg.d_model * size / 2**10:g} KiB between rank 0 and rank {n - 1}. The V
        layouts (ZB-V, DualPipeV) put the first and the last stage on rank 0, so there the sum is
        autograd's own, inside one parameter, and nothing crosses the network — and an
        optimizer must be given that parameter once (`stage_parameters`), or it steps it twice.
    """)
    table(rows, header=["schedule", "chunks v", "max |Δ loss|", "max |Δ gradient|",
                        f"max |Δ parameter| after {steps} steps"],
          caption=f"Lecture 01's GPT with tied embeddings ({cfg.n_layers} layers, float64) on {n} ranks against "
                  "one process with tied embeddings; the LM head's copy is compared with the embedding.")
    see(PipelineExecutor._sum_tied, "PipelineExecutor._sum_tied: the tied embedding's gradient, summed")


def sleep_runs(ms):
    runs = [{"label": "naive", "name": "naive", "m": 4}]
    for name in ("gpipe", "1f1b"):
        runs += [{"label": f"{name} m={m}", "name": name, "m": m} for m in ms]
    runs += [{"label": "interleaved-1f1b", "name": "interleaved-1f1b", "m": 8, "v": 2},
             {"label": "zb-h1", "name": "zb-h1", "m": 8}, {"label": "zb-h2", "name": "zb-h2", "m": 8},
             {"label": "zb-v", "name": "zb-v", "m": 8, "v": 2},
             {"label": "dualpipev", "name": "dualpipev", "m": 8, "v": 2}]
    return runs


def run_sleep_mode():
    """One spawn, every schedule in sleep mode on `sleep_ranks()` ranks; returns its Run."""
    ms = [2, 8] if settings.quick else [1, 2, 4, 8]
    runs = sleep_runs(ms)
    p = sleep_ranks()
    return ms, runs, spawn(measure_schedules, p, cfg=sleep_cfg(p), runs=runs, mb_size=2,
                           delay=SLEEP, repeats=5 if settings.quick else 7,
                           name=f"every schedule in sleep mode, {p} ranks")


def measured_schedules():
    """One sleep-mode spawn runs every schedule; the sections below read it in teaching order:
    naive, GPipe, 1F1B, interleaved, zero bubble, then all of them side by side."""
    p = sleep_ranks()
    ms, _, run = run_sleep_mode()
    R = run.returns
    naive_measured(R, p, sleep_mode(p))                 # the one place that says how sleep mode measures
    mode = SLEEP_REF
    mem = gpipe_measured(R, p, ms, mode)
    one_f_one_b_memory(mem, ms, p)
    interleaved_measured(R, p)
    zero_bubble_measured(R, p)
    with deep_dive("DualPipeV's bubble formula against our list",
                   "the README's (S/2−1)(F&B+B−3W) against DualPipeV run pair by pair and as its reference runs it"):
        dualpipev_formula(p)
    every_schedule_measured(R, p, mode)                 # all of them side by side, with the explorer
    return R


SLEEP_REF = "Sleep mode, as described under “Naive model parallelism”"


def sleep_mode(p):
    """The sentence that says how sleep mode was measured (captions and notes start with it)."""
    return (f"**Sleep mode**: each action also waits a fixed {SLEEP['F'] * 1e3:.0f} ms "
            f"(F, B and W alike, an unsplit backward {(SLEEP['B'] + SLEEP['W']) * 1e3:.0f} ms, a chunk's "
            f"action that share of it), so the timeline shows the schedule rather than the "
            f"ranks time-slicing; {machine(p)}")


def naive_measured(R, p, mode):
    note("## Naive model parallelism")
    b = bubble_row(R, "naive", "naive", 4, 1, p)
    bubbles, steps = measured_bubbles(R, "naive")
    figure(side_by_side([("naive, m=4", b["sim"].timeline, median_step(steps, bubbles), "s")]),
           caption=f"Naive: simulated (left) and measured (right, sleep mode). Measured bubble "
                   f"{pct(b['measured'])} (theory {pct(b['theory'])}).")
    note(f"""
        Naive model parallelism runs one micro-batch through all stages, forward then
        backward, before the next: exactly one rank works at any time, and the bubble is
        $1 - 1/p$ = {pct(1 - 1 / p)}. {mode}.
    """)


def gpipe_measured(R, p, ms, mode):
    """GPipe's bubble and memory against m (1F1B's beside it); returns the peaks {(name, m): bytes}."""
    note("## GPipe: all forwards, then all backwards")
    idea = f"""
        With $m$ micro-batches the first stage can start micro-batch 2 while stage 2 works on
        micro-batch 1 (Huang et al. 2019). Every rank is idle for $p-1$ slots at the start and
        at the end, so the bubble is $\\frac{{p-1}}{{m+p-1}}$: it shrinks as $m$ grows. The price:
        a rank holds the activations of all $m$ micro-batches until their backward.
    """
    rows, mem, bub = [], {}, {}
    for name in ("gpipe", "1f1b"):
        for m in ms:
            b = bub[name, m] = bubble_row(R, f"{name} m={m}", name, m, 1, p)
            peak = max(r[f"{name} m={m}"]["peak_saved_bytes"] for r in R)
            mem[name, m] = peak
            rows.append([name, m, pct(b["theory"]), pct(b["simulated"]),
                         measured_pct(b),
                         f"{peak / 2**10:.0f} KiB", R[0][f"{name} m={m}"]["timing"].ms()])
    import matplotlib
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.6))
    xs = list(ms)
    for name, style in (("gpipe", "o-"), ("1f1b", "s--")):
        a1.plot(xs, [bubble_row(R, f"{name} m={m}", name, m, 1, p)["measured"] for m in xs], style, label=f"{name} measured")
        a2.plot(xs, [mem[name, m] / 2**10 for m in xs], style, label=name)
    a1.plot(xs, [(p - 1) / (m + p - 1) for m in xs], "k:", label="(p−1)/(m+p−1)")
    for ax, ylabel, title in ((a1, "bubble fraction", "bubble"), (a2, "KiB", "peak activations held")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(m) for m in xs])      # the m measured, as plain numbers
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("micro-batches m (log scale)", fontsize=11)
        ax.set_ylabel(ylabel, fontsize=11)
        ax.set_title(title, fontsize=12, loc="left")
        ax.tick_params(labelsize=11)
        ax.legend(fontsize=11)
    a1.set_ylim(bottom=0)
    a2.set_ylim(bottom=0)
    fig.tight_layout()
    figure(fig, caption=f"Bubble and activation memory against m ({mode}).")
    note(idea)
    table(rows, header=["schedule", "m", "theory", "simulated", "measured (IQR)",
                        "peak activations held (rank max)", "step time"],
          caption=f"{mode}. Activations: bytes autograd saved for backward, measured with "
                  "saved-tensor hooks, the most any rank held at once.")
    top = max(ms)
    cheat("GPipe/1F1B bubble", "bubble fraction $\\frac{p-1}{m+p-1}$", round(100 * bub["gpipe", top]["measured"], 1), "%",
          what=f"GPipe, p = {p}, m = {top}, sleep mode, measured (theory {pct(bub['gpipe', top]['theory'])})")
    return mem


def one_f_one_b_memory(mem, ms, p):
    top = max(ms)
    note("## 1F1B: the same bubble, bounded memory")
    memory_figure(p, top, names=[("gpipe", 1), ("1f1b", 1)],
                  caption=f"Micro-batches each rank holds over one simulated step ({p} ranks, {top} micro-batches): "
                          "GPipe climbs to m on every rank, 1F1B stops at p − r on rank r.")
    note(f"""
        1F1B (PipeDream-Flush, from Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel
        DNN Training", the paper of PipeDream-2BW) starts the backward of micro-batch 0 as
        soon as it can and then alternates one forward with one backward. Rank $r$ holds at
        most $p - r$ micro-batches, whatever $m$: at m = {top} the measured peak is
        **{mem['1f1b', top] / 2**10:.0f} KiB** against GPipe's **{mem['gpipe', top] / 2**10:.0f} KiB**
        (ratio {mem['gpipe', top] / mem['1f1b', top]:.1f}; $m/p$ = {top / p:g}), and the same
        bubble in theory (the table above has both measured). So $m$ can grow to shrink the
        bubble without running out of memory.
    """)
    cheat("1F1B activation memory", "rank $r$ holds $p-r$ micro-batches (GPipe: $m$); GPipe / 1F1B peak $= m/p$",
          round(mem['gpipe', top] / mem['1f1b', top], 2), "×",
          what=f"GPipe's measured peak over 1F1B's, p = {p}, m = {top} (m/p = {top / p:g})")


def interleaved_measured(R, p):
    v = 2
    inter = bubble_row(R, "interleaved-1f1b", "interleaved-1f1b", 8, v, p)
    one = bubble_row(R, "1f1b m=8", "1f1b", 8, 1, p)
    msgs = {k: sum(r[k]["messages"] for r in R) for k in ("1f1b m=8", "interleaved-1f1b")}
    note("## Interleaved 1F1B: v chunks per rank")
    layouts_figure(p)
    note(f"""
        Give each rank $v$ smaller chunks, looped: rank $r$ holds stages $r, r+p, \\dots$
        (Narayanan et al. 2021). A micro-batch passes through every rank $v$ times, each visit
        $1/v$ as long, so the fill and drain shrink $v$-fold: bubble/ideal $= \\frac{{p-1}}{{v\\,m}}$,
        a bubble fraction of $\\frac{{p-1}}{{v m + p - 1}}$ = {pct(inter['theory'])} here
        (m = 8, v = {v}), measured **{pct(inter['measured'])}** against 1F1B's {pct(one['measured'])}.
        The cost is messages: a micro-batch crosses $vp - 1$ stage boundaries instead of
        $p - 1$, each way. Counted in this step: **{msgs['interleaved-1f1b']}** messages against
        **{msgs['1f1b m=8']}** ({msgs['interleaved-1f1b'] / msgs['1f1b m=8']:.2f}×; $(vp-1)/(p-1)$ =
        {(v * p - 1) / (p - 1):.2f}). Megatron-LM's interleaved schedule required $m$ to be a
        multiple of $p$ (micro-batches go in groups of $p$, chunk after chunk: depth-first), as
        Narayanan et al. (2021) describe it; Megatron-Core has since relaxed this with a
        configurable group size (`microbatch_group_size_per_vp_stage`). For other $m$ our lists use
        $\\lfloor m/p \\rfloor$ groups of at least $p$, the larger first (`group_sizes`); a short
        last group deadlocks — (p, m, v) = (6, 8, 2) did, before — and a test builds and
        simulates every size up to p = 8. {interleaved_memory_words(p, v)} Lamy-Poirier (2023) compares this depth-first
        order with breadth-first (all micro-batches through chunk 0 first: `gpipe` with
        chunks > 1 here), which suits data-parallel sharding better; Llama 3 trained with an
        interleaved schedule whose mix of the two is tunable.
    """)
    cheat("interleaved bubble", "bubble fraction $\\frac{p-1}{v\\,m+p-1}$", round(100 * inter["measured"], 1), "%",
          what=f"p = {p}, m = 8, v = {v}, sleep mode, measured (theory {pct(inter['theory'])})")
    cheat("interleaved messages", "messages $\\times \\frac{vp-1}{p-1}$ against 1F1B",
          round(msgs['interleaved-1f1b'] / msgs['1f1b m=8'], 2), "×",
          what=f"messages counted in one step, p = {p}, v = {v}")


def interleaved_memory_words(p, v):
    """What interleaving costs in memory, counted on the lists: the micro-batches rank 0 holds at
    m = 2p against 1F1B's p, and at p < m < 2p, where one group holds every micro-batch."""
    def rank0(name, m, chunks):
        return held(make_schedule(name, p, m, chunks))[0] / chunks
    two_p = rank0("interleaved-1f1b", 2 * p, v)
    between = {m: rank0("interleaved-1f1b", m, v) for m in range(p + 1, 2 * p)}
    words = (f"Interleaving also costs memory: at m = {2 * p} rank 0 holds {two_p:g} micro-batches "
             f"({rank0('1f1b', 2 * p, 1):g} with 1F1B; $p + (p-1)/v$ = {p + (p - 1) / v:g}), the chunk-0 "
             "forwards of a whole group running before its first backward.")
    if not between:
        return words
    lo, hi = min(between), max(between)
    if all(h == m for m, h in between.items()):
        sizes = f"m = {lo}" if lo == hi else f"m = {lo} to {hi}"
        return words + (f" With $p < m < 2p$ ({sizes} here) there is one group, so rank 0 "
                        f"holds all $m$ micro-batches at once, GPipe's memory: {between[hi]:g} at m = {hi}.")
    return words + " With $p < m < 2p$ rank 0 holds " + ", ".join(f"{h:g} at m = {m}" for m, h in between.items()) + "."


def most_idle(sim):
    """The idle time of the rank that idles most in a simulated step."""
    return max(sim.makespan - busy for busy in sim.busy)


def dualpipev_readme_holds(F, B_in, W, ps=range(2, 9), overlaps=(1.0, 0.5, 0.0)):
    """Whether DeepSeek's (S/2 − 1)(F&B + B − 3W) equals the most idle rank of DualPipeV run as
    the reference runs it (each F&B pair one unit, simulate(pair=...)), for every p in `ps`,
    m = 2p, 2p + 3, 4p, and F&B from F + B (no overlap, 1.0) down to the longer of the two
    (a perfect overlap, 0.0). Returns (holds, the largest |formula − simulation|)."""
    full_b, worst = B_in + W, 0.0
    for p in ps:
        for m in (2 * p, 2 * p + 3, 4 * p):
            sched = make_schedule("dualpipev", p, m, 2)
            for share in overlaps:
                fb = max(F, full_b) + share * min(F, full_b)
                sim = simulate(sched, {"F": F, "B": B_in, "W": W}, pair=fb)
                worst = max(worst, abs(dualpipev_readme_bubble(p, F, full_b, W, fb) - most_idle(sim)))
    return worst < 1e-9, worst


def zero_bubble_measured(R, p):
    m = 8
    names = [("1f1b m=8", "1f1b", 1), ("zb-h1", "zb-h1", 1), ("zb-h2", "zb-h2", 1), ("zb-v", "zb-v", 2),
             ("dualpipev", "dualpipev", 2)]
    rows_ = {label: bubble_row(R, label, name, m, v, p) for label, name, v in names}
    peak = {label: max(r[label]["peak_saved_bytes"] for r in R) for label, _, _ in names}
    lists = {name: make_schedule(name, p, m, v) for _, name, v in names}
    most = {name: max(held(sch)) / sch.layout.chunks for name, sch in lists.items()}
    unit = {name: simulate(sch, chunk_cost(sch.layout.chunks)).makespan for name, sch in lists.items()}
    note("## Zero bubble: split the backward")
    zero_bubble_picture(p, m)
    note(f"""
        A backward computes two things: the gradient with respect to the stage's input (B, which
        the previous stage is waiting for) and the gradients of the weights (W, which nobody
        waits for until the optimizer step). Qi et al. (2023) run B at once and postpone W into
        the slots where the rank would otherwise idle. Three schedules by Qi et al., each built
        here with its paper's defining numbers (tested in tests/test_lecture_05.py):

        - **ZB-H1** (sec. 3.1) keeps 1F1B's order of F and B; rank $r$ runs its first $r$
          backwards without their W and then a W right after every B, $r$ micro-batches late.
          Every rank holds at most $p$ micro-batches, 1F1B's peak (1F1B reaches it on rank 0
          only), and with $F = B = W$ the bubble falls from 1F1B's $(p-1)(F+B+W)$ to
          $(p-1)(F+B-W)$: a makespan of $3m + p - 1$ = {3 * m + p - 1} units instead of
          $3m + 3(p-1)$ = {3 * m + 3 * (p - 1)} (simulated: {unit['zb-h1']:g} and {unit['1f1b']:g}).
        - **ZB-H2** runs more forwards in the warm-up, holding up to $2p - 1$ micro-batches,
          so that every rank runs from its first action to its last without a gap. What is
          left in one step is the head and the tail of that parallelogram (rank $r$ starts $r$
          forwards late), so a single step here takes {units_against(unit['zb-h2'], unit['zb-h1'], "ZB-H1")}: {_fewer(unit['zb-h2'], unit['zb-h1'])}. The paper's zero bubble needs one more thing: the next step's forwards start
          on rank 0 while the last ranks finish, which a synchronous optimizer step forbids
          (gradient clipping and NaN checks need every rank's gradients). Qi et al. (sec. 4)
          replace that synchronisation by a *post-validation*: each rank steps at once and
          rolls the rare failing step back. Then the head of one step fills the tail of the
          one before, and what a step costs is Qi et al.'s $m(F+B+W) + (p-1)(F+B-2W)$: a
          bubble of $(p-1)(F+B-2W)$, zero only where $F + B = 2W$. The figure below runs two
          steps back to back on the simulator.
        - **ZB-V** (Qi et al. 2024) puts two half-size chunks on each rank in a V (the layout
          figure above): the head halves, because the first forward reaches rank $p-1$ after
          $p - 1$ half-stage forwards, and holding as many micro-batches as 1F1B ($2p$
          half-size chunks = $p$; more bytes, since every split backward keeps its output gradient
          until its W, as the memory table below measures) {_v_head_words(unit['zb-v'], p, m)}. Our ZB-V is the paper's hand-made list, in the
          order PyTorch's `ScheduleZBVZeroBubble` runs it (a test compares the two for every
          $p \\le 8$ and $m \\le 4p+1$); our ZB-H2 comes from a small greedy scheduler under its
          bound (`_greedy`: B first, then F within the bound, then W), not the paper's list.

        In sleep mode F, B and W each wait {SLEEP['F'] * 1e3:.0f} ms (a chunk's action half
        that), so 1F1B's unsplit backward is twice a forward. Measured at m = {m}:

        | | 1F1B | ZB-H1 | ZB-H2 | ZB-V | DualPipeV |
        |---|---|---|---|---|---|
        | paper's bubble (ZB-H2's: steps run back to back) | $(p-1)(F+B+W)$ | $(p-1)(F+B-W)$ | $(p-1)(F+B-2W)$ | the V's head | $(S/2-1)(F\\&B+B-3W)$ |
        | paper's micro-batches held | $p$ | $p$ | $2p-1$ | $p$ | $S + 1$ chunks |
        | most held in our lists | {most['1f1b']:g} | {most['zb-h1']:g} | {most['zb-h2']:g} | {most['zb-v']:g} | {most['dualpipev'] * 2:g} chunks |
        | bubble, simulated | {pct(rows_['1f1b m=8']['simulated'])} | {pct(rows_['zb-h1']['simulated'])} | {pct(rows_['zb-h2']['simulated'])} | {pct(rows_['zb-v']['simulated'])} | {pct(rows_['dualpipev']['simulated'])} |
        | bubble, measured | {pct(rows_['1f1b m=8']['measured'])} | {pct(rows_['zb-h1']['measured'])} | {pct(rows_['zb-h2']['measured'])} | {pct(rows_['zb-v']['measured'])} | {pct(rows_['dualpipev']['measured'])} |
        | peak activations held (rank max) | {peak['1f1b m=8'] / 2**10:.0f} KiB | {peak['zb-h1'] / 2**10:.0f} KiB | {peak['zb-h2'] / 2**10:.0f} KiB | {peak['zb-v'] / 2**10:.0f} KiB | {peak['dualpipev'] / 2**10:.0f} KiB |

        (A postponed W keeps its micro-batch's saved tensors until it runs: that is why ZB-H1
        holds $p$ micro-batches on every rank where 1F1B holds $p - r$; the memory figure under
        “Every schedule” below draws it. It also keeps what B computed for it, the gradient of
        every weight-owning module's output, which the meter counts too: measured, ZB-H1's peak
        is {peak['zb-h1'] / peak['1f1b m=8']:.2f}× 1F1B's, not 1F1B's peak, and ZB-H2's
        {peak['zb-h2'] / peak['1f1b m=8']:.2f}×.)
    """)
    zb_h2_two_steps(p, m)
    with deep_dive("Every schedule with W free and with W = B",
                   "the simulated bubbles of every list when the weight gradient costs nothing, and when it costs a B"):
        schedules_table(p, m)
    with deep_dive("Zero bubble at the costs Qi et al. measured",
                   "the zero-bubble lists simulated at the F, B, W of four models Qi et al. profiled, beside their formulas; "
                   "where ZB-V beats ZB-H1"):
        unequal_costs(p, m)
    note(f"""
        **DualPipeV** (DeepSeek-AI 2024) is a V like ZB-V built for mixtures of experts: it
        runs the forward of one micro-batch together with the backward of another (a pair the
        DualPipe README writes $F\\&B$), so that one's computation hides the other's
        expert-parallel all-to-all (lecture 06). A CPU rank cannot overlap them, so our list,
        transcribed from the reference schedule's eight phases, runs each pair in turn: on the
        simulator it takes {units_against(unit['dualpipev'], unit['zb-v'], "ZB-V")}, holding
        {most['dualpipev'] * 2:g} chunks against ZB-V's {most['zb-v'] * 2:g}. How DeepSeek's
        own bubble formula compares with this list is a deep dive:
    """)
    cheat("ZB-H1 bubble", "bubble $(p-1)(F+B-W)$ against 1F1B's $(p-1)(F+B+W)$",
          round(100 * rows_["zb-h1"]["measured"], 1), "%",
          what=f"ZB-H1, p = {p}, m = {m}, sleep mode, measured (1F1B: {pct(rows_['1f1b m=8']['measured'])})")


def zb_h2_two_steps(p, m, cost=None):
    """ZB-H2's zero bubble: two steps run back to back (no synchronising optimizer step), on the
    simulator, against one step; and the per-step time against Qi et al.'s formula."""
    import matplotlib.pyplot as plt
    cost = cost or chunk_cost(1)
    sched = make_schedule("zb-h2", p, m)
    one, two = simulate(sched, cost), simulate(consecutive_steps(sched, 2), cost)
    steady = two.makespan - one.makespan
    work = m * (cost["F"] + cost["B"] + cost["W"])
    fig, ax = plt.subplots(figsize=(8, 0.6 * p + 1.4))
    draw_rows(ax, two.timeline, f"zb-h2, two steps back to back: {two.makespan:g} units "
              f"= {one.makespan:g} + {steady:g}", unit="time (F = B = W = 1 per stage)", scale=1, fontsize=11)
    ax.axvline(one.makespan, color="black", ls=":", lw=1.2)
    figure(fig, caption=f"{p} ranks, {m} micro-batches per step, simulated (the second step's micro-batches "
                        f"are numbered from {m}). One step alone takes {one.makespan:g} units; the second "
                        f"adds {steady:g}, which is its {work:g} units of work and "
                        f"{_idle_words(steady - work)}: the first ranks start step 2 while the last finish "
                        "step 1, so the parallelogram's head fills the tail (dotted: where one step alone ends).")


def _v_head_words(makespan, p, m):
    """ZB-V's simulated makespan at F = B = W (1 per stage) against its work 3m plus the V's head
    of p − 1 half-stage forwards."""
    head = (p - 1) / 2
    if abs(makespan - (3 * m + head)) < 1e-9:
        return (f"the rest goes: with $F = B = W$ it takes {makespan:g} units, its {3 * m} units of work "
                f"and the V's head of $p-1$ half-stage forwards ({head:g}), nothing else")
    return (f"with $F = B = W$ it takes {makespan:g} units: {3 * m} of work, {head:g} of the V's head, "
            f"and {makespan - 3 * m - head:g} more")


def _idle_words(idle):
    return "no idle time" if abs(idle) < 1e-9 else f"{idle:g} units idle per rank"


# Qi et al. 2024 (ICLR 2024; arXiv 2401.10241), "Zero Bubble Pipeline Parallelism", Appendix D,
# Table 9: a stage's T_F, T_B, T_W and T_comm in ms, as profiled for its experiments (Section 5):
# (model, p, m, T_F, T_B, T_W, T_comm).
QI_TABLE_9 = [("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601),
              ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527),
              ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377),
              ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408)]
QI_2024 = ("https://arxiv.org/abs/2401.10241",
           "Qi, Wan, Huang, Lin 2024, Zero Bubble Pipeline Parallelism (ICLR 2024; the arXiv version with ZB-V), Appendix D, Table 9: profiled T_F, T_B, T_W, T_comm")


def cost_mixes():
    """{label: (F, B, W, comm)} per stage: F = B = W, then each model of Qi et al.'s Table 9
    with its times divided by its T_F (so F = 1, and the mixes compare on one clock)."""
    mixes = {"F = B = W": (1.0, 1.0, 1.0, 0.0)}
    for model, p, m, tf, tb, tw, tc in QI_TABLE_9:
        mixes[f"{model} model's costs"] = (1.0, tb / tf, tw / tf, tc / tf)
    return mixes


def mix_makespans(p, m, F, B, W, send=0.0):
    """{schedule: simulated makespan} of the zero-bubble comparison at one cost mix."""
    names = [("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("dualpipev", 2)]
    return {n: simulate(make_schedule(n, p, m, v), chunk_cost(v, F, B, W, send)).makespan for n, v in names}


def unequal_costs(p, m):
    """The zero-bubble lists simulated at the costs Qi et al. measured, beside their formulas;
    and ZB-V against ZB-H1 in words, from the makespans, without and with T_comm."""
    mixes = cost_mixes()
    measured = list(mixes.values())[1:]

    def spread(i):          # the measured models' range of one cost, in forwards
        return value_range(min(c[i] for c in measured), max(c[i] for c in measured), decimals=2)
    note(f"""
        ## Deep dive: zero bubble at the costs Qi et al. measured
        The page's zero-bubble lists assume a forward, an input gradient and a weight gradient
        of equal cost. Qi et al. profiled their own runs (Appendix D, Table 9): on GPT models of
        {QI_TABLE_9[0][0]} to {QI_TABLE_9[-1][0]} parameters, B took {spread(1)} of a forward's
        time, W {spread(2)} of it, and a message between stages ($T_{{comm}}$) {spread(3)}. Below,
        each list on the simulator ({p} ranks, {m} micro-batches) at equal costs and at each
        model's measured $T_F$, $T_B$, $T_W$ (divided by its $T_F$), beside Qi et al.'s formulas
        where they give one. Those runs had {QI_TABLE_9[0][1]} to {QI_TABLE_9[-1][1]} stages; only
        their per-stage ratios carry over, so every row here runs at {p} ranks. The formulas have no term for communication, so the table leaves
        $T_{{comm}}$ out; the sentence after it adds it.
    """)
    rows, span, with_comm = [], {}, {}
    for label, (F, B, W, comm) in mixes.items():
        got = span[label] = mix_makespans(p, m, F, B, W)
        with_comm[label] = mix_makespans(p, m, F, B, W, comm)
        across = steady_step(make_schedule("zb-h2", p, m), chunk_cost(1, F, B, W))
        work = m * (F + B + W)
        rows.append([label, f"{F:.2f}, {B:.2f}, {W:.2f}"] +
                    [f"{got[n]:.2f} ({work + qi_bubble(n, p, F, B, W):.2f})" for n in ("1f1b", "zb-h1")] +
                    [f"{got['zb-h2']:.2f}", f"{across:.2f} ({work + qi_bubble('zb-h2', p, F, B, W):.2f})",
                     f"{got['zb-v']:.2f}", f"{got['dualpipev']:.2f}"])
    table(rows, header=["costs", "F, B, W per stage", "1F1B", "ZB-H1", "ZB-H2, one step",
                        "ZB-H2, per step back to back", "ZB-V", "DualPipeV"],
          caption=f"Makespans on the simulator, {p} ranks, {m} micro-batches (a chunk's action 1/2 of a stage's), "
                  "in brackets $m(F+B+W)$ plus Qi et al.'s bubble for 1F1B, ZB-H1 and ZB-H2. Rows 2-5: Qi et al.'s "
                  "profiled times for each model, divided by its $T_F$; communication left out.")
    see(*QI_2024)
    note(f"""
        {zbv_against_zbh1(span)} With every message between two ranks taking the model's
        $T_{{comm}}$ as well (the simulator's send time; at equal costs none),
        {zbv_against_zbh1(with_comm)}
    """)


def zbv_against_zbh1(span):
    """ZB-V against ZB-H1 from the simulated makespans {mix label: {name: makespan}}, in words."""
    shorter = [c for c, got in span.items() if got["zb-v"] < got["zb-h1"] - 1e-9]
    pairs = "; ".join(f"{c}: {got['zb-v']:.2f} against {got['zb-h1']:.2f}" for c, got in span.items())
    if len(shorter) == len(span):
        verdict = "ZB-V is shorter than ZB-H1 at every one of these costs"
    elif not shorter:
        verdict = "ZB-V is not shorter than ZB-H1 at any of these costs"
    else:
        verdict = f"ZB-V is shorter than ZB-H1 at {len(shorter)} of these {len(span)} costs"
    return f"{verdict} ({pairs}), holding the same number of micro-batches ($p$, in half-size chunks)."


def zero_bubble_picture(p, m):
    """1F1B and the zero-bubble lists simulated with F = B = W, on one time axis."""
    import matplotlib.pyplot as plt
    names = [("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)]
    sims = [(name, v, simulate(make_schedule(name, p, m, v), chunk_cost(v))) for name, v in names]
    span = max(sim.makespan for _, _, sim in sims)
    fig, axes = plt.subplots(len(sims), 1, figsize=(8, 1.5 * len(sims) + 0.9), sharex=True)
    for ax, (name, v, sim) in zip(axes, sims):
        draw_rows(ax, sim.timeline, f"{name}: {sim.makespan:g} units, bubble {pct(sim.bubble)}",
                  unit="time (F = B = W = 1 per stage)", scale=1, span=span, fontsize=11)
        ax.label_outer()
    fig.legend(handles=legend_patches(), loc="lower center", ncol=2, frameon=False, fontsize=11)
    fig.tight_layout(rect=(0, 0.9 / (1.5 * len(sims) + 0.9), 1, 1))
    figure(fig, caption=f"{p} ranks, {m} micro-batches, simulated: the weight gradients W (green) move "
                        "into the slots where 1F1B idles (hatched: a rank's second chunk in ZB-V's V).")


def dualpipev_formula(p, m=8):
    """Deep dive: the DualPipe README's bubble formula against DualPipeV run pair by pair (our
    executor) and as the reference runs it (each F&B pair one unit)."""
    lists = {name: make_schedule(name, p, m, 2) for name in ("zb-v", "dualpipev")}
    most = {name: max(held(sch)) / 2 for name, sch in lists.items()}
    unit = {name: simulate(sch, chunk_cost(2)).makespan for name, sch in lists.items()}
    S = 2 * p                                           # DualPipeV's stages: the README's PP
    cost = chunk_cost(2)                                # a chunk's F, B (input) and W: 1/2 each
    F, B_in, W = cost["F"], cost["B"], cost["W"]
    full_b = B_in + W                                   # the README's B is the full backward
    fbs = {"no overlap": F + full_b, "a perfect overlap": max(F, full_b)}
    readme = {k: dualpipev_readme_bubble(p, F, full_b, W, fb) for k, fb in fbs.items()}
    paired = {k: most_idle(simulate(lists["dualpipev"], cost, pair=fb)) for k, fb in fbs.items()}
    ours = most_idle(simulate(lists["dualpipev"], cost))
    holds, _ = dualpipev_readme_holds(F, B_in, W)
    mixes = cost_mixes()
    measured = min(list(mixes)[1:], key=lambda k: mixes[k][2])   # the profiled mix with the cheapest W
    other = chunk_cost(2, *mixes[measured][:3])
    other_holds, other_gap = dualpipev_readme_holds(other["F"], other["B"], other["W"])
    exact = ("equals it exactly" if holds else "does not equal it")
    gap = paired["no overlap"] - ours
    hop_words = (f"which saves each of the $p-1$ hops down the V a backward: $(p-1)B_{{in}}$ = {gap:g} "
                 f"units, a factor only because $F = B_{{in}}$ here" if abs(gap - (p - 1) * B_in) < 1e-9 else
                 f"{gap:g} units apart")
    note(f"""
        ## Deep dive: DualPipeV's bubble formula
        **DualPipeV** is the V-shaped, "cut-in-half" DualPipe. DualPipe (DeepSeek-AI 2024,
        DeepSeek-V3 report) runs micro-batches in both directions through $S$ stages on $S$
        devices, each holding two stages; DualPipeV, which DeepSeek's README credits to Sea AI
        Lab's "cut-in-half" procedure, keeps one direction on $S/2 = p$ devices, rank $r$
        holding stages $r$ and $2p-1-r$. The README gives both $(S/2-1)(F\\&B+B-3W)$ bubble
        and $S + 1$ activations per device ($F$, $B$, $W$ a chunk's forward, full backward
        and weight backward), {S} stages here. $F\\&B$ is a forward of one chunk and a backward
        of the other, from two different micro-batches, run *together*: the overlap is within
        each pair — one's computation runs while the other's messages travel — and it exists
        to hide the expert-parallel all-to-all (dispatch and combine) of DeepSeek's
        mixture-of-experts layers (lecture 06). A CPU rank cannot overlap them, so our
        executor runs each pair's forward, then its backward; the list is transcribed from the
        eight phases of the reference schedule. On the simulator it takes
        {units_against(unit['dualpipev'], unit['zb-v'], "ZB-V")}, holding {most['dualpipev'] * 2:g} chunks against
        ZB-V's {most['zb-v'] * 2:g}.

        Whose idle time does the formula count? Not our executor's: with a chunk's $F$ =
        $B_{{in}}$ = $W$ = {F:g} (so the README's full $B$ = {full_b:g}) and no overlap
        ($F\\&B = F + B$ = {fbs['no overlap']:g}), the formula gives **{readme['no overlap']:g}**
        units per rank, while our pair-by-pair list idles **{ours:g}** on its most idle rank.
        The reference schedule runs a pair as one interleaved unit: it starts when both inputs
        are there and the forward's output leaves only when the whole pair ends. Simulated that
        way (`simulate(..., pair=F&B)`), the most idle rank idles **{paired['no overlap']:g}**
        with no overlap and **{paired['a perfect overlap']:g}** with a perfect one ($F\\&B$ =
        {fbs['a perfect overlap']:g}), where the formula says {readme['no overlap']:g} and
        {readme['a perfect overlap']:g}. For every $p$ from 2 to 8, $m = 2p, 2p+3, 4p$ and
        $F\\&B$ from $F + B$ down to the longer of the two, the simulation {exact} at these
        costs. So the factor of {readme['no overlap'] / ours:g} between the README and our list
        is where the forward's output leaves: after the whole pair in the reference, after the
        forward alone in ours, {hop_words}. The formula also
        assumes $F = B_{{in}} = W$: at the {measured} as Qi et al. profiled them (a
        chunk's $F$ = {other['F']:.3g}, $B_{{in}}$ = {other['B']:.3g}, $W$ = {other['W']:.3g}; the
        appendix's zero-bubble table) it {"still holds" if other_holds else f"is off by up to {other_gap:.2g} units"}
        over the same sizes.
    """)


def verdict(a, b, a_name, b_name, least=3):
    """`compare`'s words when both timings have at least `least` samples; otherwise both times
    and no verdict (one cold sample, or two, cannot tell a difference from noise)."""
    n = min(len(a.samples), len(b.samples))
    if n >= least:
        return compare(a, b, a_name, b_name)
    count = "one sample" if n == 1 else f"{n} samples"
    return f"{a_name} {a.ms()}, {b_name} {b.ms()} ({count}, no verdict)"


def slower_or_faster(a, b, a_name, b_name, least=3):
    """'b_name X, a_name Y: r× slower': a against b in that order, the ratio only where the
    interquartile ranges do not overlap and both have `least` samples."""
    times = f"{b_name} {b.ms()}, {a_name} {a.ms()}"
    n = min(len(a.samples), len(b.samples))
    if n < least:
        return f"{times} ({'one sample' if n == 1 else f'{n} samples'}, no verdict)"
    if spreads_overlap(a, b):
        return f"{times}: no measurable difference (the interquartile ranges overlap)"
    r = a.median / b.median
    return f"{times}: {r:.2f}× slower" if r > 1 else f"{times}: {1 / r:.2f}× faster"


def _fewer(a, b):
    """Words for a makespan a against b (simulated, exact: no spread to allow for)."""
    return "no gain in one step" if a == b else ("a gain" if a < b else "a loss")


def every_schedule_measured(R, p, mode):
    rows, pairs, extra = [], [], {}
    for label, name, m, v in [("naive", "naive", 4, 1), ("gpipe m=8", "gpipe", 8, 1), ("1f1b m=8", "1f1b", 8, 1),
                              ("interleaved-1f1b", "interleaved-1f1b", 8, 2), ("zb-h1", "zb-h1", 8, 1),
                              ("zb-h2", "zb-h2", 8, 1), ("zb-v", "zb-v", 8, 2), ("dualpipev", "dualpipev", 8, 2)]:
        b = bubble_row(R, label, name, m, v, p)
        bubbles, steps = measured_bubbles(R, label)
        rows.append([name, m, v, pct(b["theory"]), pct(b["simulated"]),
                     measured_pct(b),
                     R[0][label]["timing"].ms(), f"{b['sim'].makespan * 1e3:.0f} ms"])
        if name != "naive":          # naive has its own figure above; it would stretch the shared axis
            pairs.append((f"{name} (m={m}, v={v})", b["sim"].timeline, median_step(steps, bubbles), "s"))
        extra[name] = (R[0][label]["timing"].median - b["sim"].makespan,
                       b["measured"] / b["theory"] if b["theory"] else None)
    note("## Every schedule, simulated and measured")
    figure(side_by_side(pairs), caption=f"Every schedule of this page: simulated (left, seconds) and measured "
                                        f"(right, ms), one time axis per column, so a shorter row is a "
                                        f"faster step (naive: its own figure above). {mode}.")
    note("""
        The simulator's timeline (left, the sleep durations as costs, no communication cost)
        beside the spans measured on the ranks (right) for the same action lists.
    """)
    table(rows, header=["schedule", "m", "v", "theory", "simulated", "measured (IQR)",
                        "measured step", "simulated step"],
          caption=f"{mode}. Measured bubble: 1 − Σ compute spans / (ranks × step span), per timed "
                  "step; median and interquartile range.")
    (e1, r1), (ei, ri) = extra["1f1b"], extra["interleaved-1f1b"]
    note(f"""
        The simulator charges nothing for Python, gloo's messages, or {p} ranks sharing the
        cores; the measured steps pay for them: {e1 * 1e3:.0f} ms per step beyond the simulated
        step for 1F1B, {ei * 1e3:.0f} ms for interleaved 1F1B (which has $v$× the actions and
        messages, each action $1/v$ as long, so {"more" if ei > 1.2 * e1 else "about as much"} of
        that cost). That time shows up as bubble, and against interleaving's smaller theoretical
        bubble it is a larger multiple: measured over
        theory is {ri:.2f} for interleaved, {r1:.2f} for 1F1B. The longer an action is against
        that cost, the closer the measurement comes to the formula: `make bench` repeats these
        runs with sleeps 10× longer and prints the ratios.

        What each rank holds over the step, simulated from the same lists:
    """)
    memory_figure(4, 8)
    explorer(4, 8)


def real_compute_figure(R, runs):
    """Real compute: each run's step time against its measured bubble (medians, interquartile
    ranges as bars), and the most activations a rank held."""
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(7.5, 2.7), gridspec_kw={"width_ratios": [1.25, 1]})
    colours = plt.cm.tab10([0, 1, 2, 3])
    for r, c in zip(runs, colours):
        bubbles = measured_bubbles(R, r["label"])[0]
        b = statistics.quantiles(bubbles, n=4, method="inclusive") if len(bubbles) > 1 else [bubbles[0]] * 3
        t = R[0][r["label"]]["timing"]
        x, y = 100 * statistics.median(bubbles), t.median * 1e3
        a1.errorbar(x, y, xerr=[[x - 100 * b[0]], [100 * b[2] - x]], yerr=[[y - t.q1 * 1e3], [t.q3 * 1e3 - y]],
                    fmt="o", color=c, capsize=3, label=r["label"])
        peak = max(x_[r["label"]]["peak_saved_bytes"] for x_ in R)
        a2.barh(r["label"], peak / 2**20, color=c)
    a1.set_xlabel("measured bubble (%)", fontsize=10)
    a1.set_ylabel("step time (ms)", fontsize=10)
    a1.set_title("step time against bubble", fontsize=11, loc="left")
    a2.set_xlabel("MiB", fontsize=10)
    a2.set_title("peak activations held", fontsize=11, loc="left")
    a2.invert_yaxis()
    for ax in (a1, a2):
        ax.tick_params(labelsize=10)
        ax.grid(alpha=0.3)
    a1.set_xlim(left=0)
    a1.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def real_compute():
    p = timing_ranks_here()
    cfg, m, mb = compute_cfg(), 4 if settings.quick else 8, 4
    runs = [{"label": "gpipe", "name": "gpipe", "m": m}, {"label": "1f1b", "name": "1f1b", "m": m},
            {"label": "gpipe + checkpointing", "name": "gpipe", "m": m, "checkpoint": True},
            {"label": "zb-h1", "name": "zb-h1", "m": m}]
    run = spawn(measure_schedules, p, cfg=cfg, runs=runs, mb_size=mb, repeats=3 if settings.quick else 7,
                name=f"schedules with real compute, {p} ranks")
    R = run.returns
    rows, bub, theory = [], {}, {}
    for r in runs:
        bubbles, _ = measured_bubbles(R, r["label"])
        bub[r["label"]] = statistics.median(bubbles)
        peak = max(x[r["label"]]["peak_saved_bytes"] for x in R)
        theory[r["label"]] = (theory_bubble(r["name"], p, m) if r["name"] != "zb-h1"
                              else simulate(make_schedule("zb-h1", p, m), chunk_cost(1)).bubble)
        rows.append([r["label"], pct(theory[r["label"]]),
                     pct(bub[r["label"]]), f"{peak / 2**20:.2f} MiB", R[0][r["label"]]["timing"].ms()])
    g, c = R[0]["gpipe"]["timing"], R[0]["gpipe + checkpointing"]["timing"]
    gm = max(x["gpipe"]["peak_saved_bytes"] for x in R)
    cm = max(x["gpipe + checkpointing"]["peak_saved_bytes"] for x in R)
    note("## Real compute, and GPipe with activation checkpointing")
    figure(real_compute_figure(R, runs),
           caption=f"Real compute, {machine(p)}, {m} micro-batches: each schedule's step time against its "
                   "measured bubble (left, colours as on the right; medians, bars: interquartile ranges over "
                   "the timed steps), and the most "
                   f"activations a rank held. Checkpointing holds {gm / max(cm, 1):.1f}× less; its re-run "
                   "forwards fill idle time, so its bubble is no guide to its speed.")
    note(f"""
        **Real-compute mode**: no sleeping, {machine(p)}, lecture 01's GPT with
        {cfg.n_layers} layers of width {cfg.d_model}, {m} micro-batches of {mb} sequences.
        GPipe itself re-materialises activations: each stage keeps only its input per
        micro-batch, and its backward first re-runs the stage's forward, which saves one
        micro-batch's activations again. The peak is therefore every kept input plus one
        micro-batch's activations, and the meter counts both (saves during F and during the
        re-run): **{gm / 2**20:.2f} MiB → {cm / 2**20:.2f} MiB** held at most, {gm / max(cm, 1):.1f}×
        less. Time: {slower_or_faster(c, g, "with checkpointing", "plain GPipe")}.
        Every forward runs twice, and the re-run counts as busy time in the measured bubble
        ({pct(bub['gpipe + checkpointing'])} with checkpointing, {pct(bub['gpipe'])} without):
        extra compute fills idle slots, so for a checkpointed schedule the step time, not the
        bubble, says whether it got faster.

        Beside each measured bubble, its theory: the textbook formula with free communication.
        Measured over theory is {bub['1f1b'] / theory['1f1b']:.1f} for 1F1B and
        {bub['gpipe'] / theory['gpipe']:.1f} for GPipe: every action here also pays Python's and
        gloo's per-message cost, and {p} ranks compute at once on this machine's cores, none
        of which the formula charges; sleep mode above isolates the schedule.
    """)
    table(rows, header=["schedule", "theory", "measured bubble", "peak activations (rank max)", "step time (IQR)"],
          caption=f"Real compute, {machine(p)}. The bubble includes communication and Python "
                  "overhead between actions. Theory: (p−1)/(m+p−1) for GPipe and 1F1B; for ZB-H1 "
                  "the simulator's bubble with F = B = W, (p−1)(F+B−W) over its makespan.")
    z, o = R[0]["zb-h1"]["timing"], R[0]["1f1b"]["timing"]
    note(f"""
        ZB-H1 against 1F1B with real compute: {zb_h1_verdict(bub['zb-h1'], bub['1f1b'], z, o, measured_busy(R, 'zb-h1'), measured_busy(R, '1f1b'))} A split
        backward pays only where the slots it fills were idle and its actions are long: here each
        action of this small model costs about as much in Python and gloo as in compute, and the
        {p} ranks share {usable_cores_here()} CPU cores with gloo's threads and the other processes
        of this machine, so the slots W fills are not clean idle time as on a GPU.
    """)
    published("""
        Qi et al. 2024 (Zero Bubble Pipeline Parallelism, ICLR 2024), on GPUs: "our method
        outperforms the 1F1B schedule up to 23% in throughput under a similar memory limit. This
        number can be further pushed to 31% when the memory constraint is relaxed."
    """, "https://arxiv.org/abs/2401.10241", "Qi et al. 2024, Zero Bubble Pipeline Parallelism, abstract")


def zb_h1_verdict(bubble_z, bubble_o, z, o, busy_z=None, busy_o=None):
    """ZB-H1 against 1F1B from their measured bubbles and step Timings (and the compute summed
    over ranks, busy_*): the bubble alone does not say which step is faster, so the verdict is
    the step's, and says when the two disagree."""
    step = slower_or_faster(z, o, "ZB-H1", "1F1B")
    smaller = bubble_z < bubble_o
    bubble = f"its measured bubble is {'smaller' if smaller else 'not smaller'} ({pct(bubble_z)} against {pct(bubble_o)})"
    if step.endswith("slower") and smaller:
        why = ""
        if busy_z is not None and busy_z > busy_o:
            why = (f" Its actions add up to {busy_z * 1e3:.0f} ms of compute per step over the ranks "
                   f"against 1F1B's {busy_o * 1e3:.0f} ms: the split backward's own cost (autograd.grad "
                   "keeping the graph, then one backward per module for W) outweighs the idle time its Ws fill.")
        return f"{bubble}, yet its step is slower ({step}). The step time is the verdict.{why}"
    if step.endswith("faster"):
        return f"{bubble}, and its step is faster ({step})."
    return f"{bubble}; the steps: {step}."


def usable_cores_here():
    from util.measure import usable_cores
    return usable_cores()


def timing_ranks_here():
    from util.measure import timing_ranks
    return timing_ranks(4)


def deadlock():
    numel, timeout = 2**22, 3
    note("## Deadlock, and how batched send/receive avoids it")
    stuck = spawn(both_send_first, 2, numel=numel, expect_error=True, timeout=timeout,
                  name="both stages send first: deadlock (expected)")
    run = spawn(both_send_first, 2, numel=numel, batched=True, name="send and receive batched")
    blocked, batched = rank_spans(stuck, "send"), rank_spans(run, "batched")
    mib = numel * 4 / 2**20
    waited = max(e - s for s, e in blocked.values())
    took = max(e - s for s, e in batched.values())
    figure(deadlock_figure(blocked, batched, mib, run.returns),
           caption=f"The two demos above, from the spans each rank measured. Left: both ranks call a "
                   f"blocking send of {mib:g} MiB first and waits (up to {waited:.1f} s) until the "
                   f"{timeout} s timeout ends one rank's send and, with it, the connection the other is "
                   f"sending on; neither reaches its receive. Right: the same exchange "
                   f"posted as one batch of isend and irecv completes in {took * 1e3:.0f} ms.")
    note(f"""
        Two neighbours each hold something for the other (activations going forward,
        gradients coming back). If both first call a blocking `send`, each waits for the other
        to receive, and neither gets to its `recv` (the first demo, with a {timeout}-second
        timeout: it is expected to fail). Posting the send and the receive together with
        `batch_isend_irecv` (or any non-blocking send before the blocking receive) lets both
        complete: rank 0 received {run.returns[0]:g}, rank 1 received {run.returns[1]:g}. The
        executor above never blocks on a send for the same reason.
    """)


def pytorch_figure(times, classes):
    """PyTorch's schedules beside our closest ones: step times, medians with interquartile
    ranges, one pair of bars per PyTorch class."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 0.34 * len(classes) + 0.8))
    for i, cls in enumerate(classes):
        for j, (label, colour) in enumerate([("PyTorch " + cls, "#e45756"), ("ours: " + PYTORCH_SCHEDULES[cls][1], "#4c78a8")]):
            t = times[label]
            ax.barh(i + (j - 0.5) * 0.38, t.median * 1e3, height=0.36, color=colour,
                    xerr=[[(t.median - t.q1) * 1e3], [(t.q3 - t.median) * 1e3]], capsize=2,
                    label=("PyTorch's" if j == 0 else "ours (closest)") if i == 0 else None)
    ax.set_yticks(range(len(classes)), [f"{c.removeprefix('Schedule')} / {PYTORCH_SCHEDULES[c][1]}" for c in classes])
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms): median, bar = interquartile range", fontsize=10)
    ax.tick_params(labelsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlim(0, 1.45 * max(t.q3 for t in times.values()) * 1e3)   # room on the right for the legend
    ax.legend(fontsize=10, loc="lower right")
    fig.tight_layout()
    return fig


def pytorch_schedules():
    p = timing_ranks_here()
    cfg, m, mb = GPTConfig(n_layers=2 * p, d_model=64, n_heads=4, seq_len=32), 2 * p, 4
    classes = list(PYTORCH_SCHEDULES)
    run = spawn(compare_with_pytorch, p, cfg=cfg, m=m, mb_size=mb, classes=classes,
                repeats=3 if settings.quick else 7, warmup=1 if settings.quick else 2,
                name=f"our schedules and PyTorch's, {p} ranks")
    R = run.returns
    note("## PyTorch's own: torch.distributed.pipelining")
    figure(pytorch_figure(R[0]["times"], classes),
           caption=f"One training step with each of PyTorch's schedules (red) and our closest list (blue), "
                   f"taking turns in the same processes: {machine(p)}, {m} micro-batches of a small GPT.")
    note(f"""
        The same `GPTStage` pieces wrapped in `PipelineStage` and run by each of PyTorch's
        schedules (V-shaped ones with the V layout), on {p} ranks with {m} micro-batches, beside
        our closest schedule. PyTorch's `ScheduleInterleavedZeroBubble` is ZB-H1's rule (a
        rank's Ws run $r$ micro-batches late) on interleaved chunks, two per rank: our ZB-H1
        has one. `ScheduleZBVZeroBubble` and our `zb-v` run the same action lists (ZB-V: two
        chunks in a V, $p$ micro-batches held; a test compares ours with its `pipeline_order`);
        `ScheduleDualPipeV` and our `dualpipev` run the same lists too, with the same
        forward-and-backward pairs (its `OVERLAP_F_B` actions; also tested). One caution when
        reading PyTorch's action lists: in torch 2.13 `Schedule1F1B.pipeline_order` names the
        wrong micro-batches for the last rank (its training is correct), so we draw nothing
        from it.
    """)
    labels = list(R[0]["losses"])
    ref = reference_train(cfg, m, mb, 1)
    rows = []
    for label in labels:
        loss = next(r["losses"][label] for r in R if r["losses"][label] is not None)
        grads = {k: v for r in R for k, v in r["grads"][label].items()}
        gd = max((grads[k] - ref["grads"][k]).abs().max().item() for k in ref["grads"])
        rows.append([label, f"{loss:.6f}", f"{abs(loss - ref['losses'][0]):.1e}", f"{gd:.1e}",
                     R[0]["times"][label].ms()])
    table(rows, header=["schedule", "loss", "|Δ loss| vs one process", "max |Δ gradient|", "step time (IQR)"],
          caption=f"Real compute, ours and PyTorch's taking turns, {machine(p)}; one process's loss {ref['losses'][0]:.6f}.")
    t = R[0]["times"]
    span = {n: simulate(make_schedule(n, p, m, 2), chunk_cost(2)).makespan for n in ("zb-v", "dualpipev")}
    note(f"""
        ZB-V, ours against PyTorch's: {verdict(t['ours: zb-v'], t['PyTorch ScheduleZBVZeroBubble'], 'ours', "PyTorch's")}.
        DualPipeV, ours against PyTorch's: {verdict(t['ours: dualpipev'], t['PyTorch ScheduleDualPipeV'], 'ours', "PyTorch's")}
        (the same lists and pairs: any gap is the two executors' per-action cost, not the schedule).
        ZB-V against DualPipeV, both ours: {verdict(t['ours: zb-v'], t['ours: dualpipev'], 'ZB-V', 'DualPipeV')};
        with m = {m} {("both lists take " + format(span['zb-v'], 'g') + " units on the simulator (F = B = W = 1 per "
                       "stage), so a measured gap between them here is this machine (the per-action overhead "
                       "and cores shared by every rank), not the schedule")
                      if span['zb-v'] == span['dualpipev'] else
                      f"their lists take {span['zb-v']:g} and {span['dualpipev']:g} units on the simulator "
                      "(F = B = W = 1 per stage)"}; DualPipeV's own advantage, overlapping each
        F&B pair's all-to-all, needs a GPU and expert parallelism.
        Every timing here is one step of a small model, where per-action overhead weighs as
        much as the schedule.
    """)
    return R


def deep_dive_posting_order():
    p, m = 4, 8
    sched = make_schedule("dualpipev", p, m, 2)
    order = message_order(sched)
    src, dst = max(order, key=lambda k: _crossings(sched, k, order[k]))
    sent = order[src, dst]
    needed = _needed_order(sched, dst, src)
    moved = sum(a != b for a, b in zip(sent, needed))
    note(f"""
        ## Deep dive: NCCL matches messages in posting order
        This matters once the executor runs on GPUs. gloo matches a receive to a send by its tag; NCCL ignores tags and pairs the $k$-th
        receive a rank posts for a peer with the $k$-th send that peer posted to it. If a rank
        posts its receives in the order its own actions need them, and the peer sends in
        another order, NCCL delivers same-shaped tensors to the wrong receive: no error, wrong
        gradients. In DualPipeV at p = {p}, m = {m}, rank {src} sends rank {dst} {len(sent)}
        messages, and {moved} of them sit at another position in the order rank {dst} needs
        them (below). Interleaved 1F1B does it too at some sizes where $m$ is not a multiple
        of $p$ (p = 2, m = 5, for one). So the executor posts each message at both ends in the same slot of one
        shared clock (`communication_plan`, from `simulate.message_slots`), which makes every
        pair's posting orders equal; a test runs every schedule with ranks as threads and a
        stand-in that matches as NCCL does.

        Two more of NCCL's rules shape the executor. *One Work per batch:* with CUDA tensors,
        `batch_isend_irecv` coalesces its operations and returns a single Work for the whole
        batch (torch's `_coalescing_manager`), and a receive's buffer holds the data only after
        that Work is waited — so pairing each operation with "its" Work (as gloo's list of Works
        invites) reads buffers that have not arrived. The executor waits every Work of a batch
        before it reads any buffer of it. *One stream, in order:* a rank's batches run one after
        another on one stream, and a large send completes only when its peer's matching receive
        runs; two ranks whose batches wait on each other in opposite orders hang. Posting both
        ends of each message in the same slot of the shared clock rules that cycle out:
        `simulate.p2p_deadlock` replays every rank's posting program under these rules, and a
        test finds no deadlock for any schedule the lecture accepts up to $p = 8$.
    """)
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 2.6))
    label = lambda k: f"{'a' if k[0] == 'act' else 'g'}{k[2]}"
    pos = {k: i for i, k in enumerate(needed)}
    for i, k in enumerate(sent):
        j = pos[k]
        ax.plot([i, j], [1, 0], color="#e45756" if i != j else "#bbbbbb", lw=1.4)
    for i, k in enumerate(sent):
        ax.text(i, 1.06, label(k), ha="center", va="bottom", fontsize=9, rotation=90)
    for j, k in enumerate(needed):
        ax.text(j, -0.06, label(k), ha="center", va="top", fontsize=9, rotation=90)
    ax.set_yticks([0, 1], [f"rank {dst} needs", f"rank {src} sends"])
    ax.set_xticks([])
    ax.set_ylim(-0.45, 1.45)
    ax.tick_params(labelsize=9)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    figure(fig, caption=f"DualPipeV, p = {p}, m = {m}: the messages from rank {src} to rank {dst} in the "
                        f"order rank {src} sends them (top) and the order rank {dst}'s actions need them "
                        "(bottom); a: an activation, g: a gradient, with its micro-batch. Red lines: "
                        "messages that would be paired with another one's buffer if receives were posted "
                        "in the order needed.")


def _needed_order(sched, dst, src):
    """The messages from `src` in the order rank `dst`'s actions need them."""
    lay, out = sched.layout, []
    for a in sched[dst]:
        s = lay.stage(dst, a.chunk)
        if a.kind == "F" and s > 0 and lay.place(s - 1)[0] == src:
            out.append(("act", s, a.microbatch))
        elif a.kind == "B" and s < lay.stages - 1 and lay.place(s + 1)[0] == src:
            out.append(("grad", s, a.microbatch))
    return out


def _crossings(sched, pair, sent):
    return sum(a != b for a, b in zip(sent, _needed_order(sched, pair[1], pair[0])))


def what_to_remember():
    note("""
        ## What to remember
        - A pipeline step's idle time (the bubble) is set by the schedule: GPipe and 1F1B idle
          $(p-1)/(m+p-1)$ of the time; more micro-batches, $v$ interleaved chunks
          ($(p-1)/(vm+p-1)$) or a split backward shrink it.
        - 1F1B has GPipe's bubble with bounded memory: rank $r$ holds $p - r$ micro-batches,
          not $m$.
        - Splitting the backward into B (input gradient, urgent) and W (weight gradient, can
          wait) lets W fill the idle slots: ZB-H1 gets $(p-1)(F+B-W)$ holding 1F1B's $p$ micro-batches (more bytes: each keeps its output gradient from B to W);
          ZB-V (a V of two chunks, $p$ held) keeps only the V's head at $F = B = W$; ZB-H2 ($2p-1$ held) idles
          $(p-1)(F+B-2W)$ per step, once the optimizer step does not synchronise the ranks.
        - DualPipeV is a V like ZB-V whose forward/backward pairs overlap the MoE all-to-all:
          its gain needs GPUs and expert parallelism.
        - Checkpointing keeps each stage's input and re-runs its forward in backward: the peak
          is all kept inputs plus one micro-batch's activations, and the re-run is busy time.
        - Post a send with its matching receive (`batch_isend_irecv`), and make both ends of
          every pair post their messages in the same order: NCCL ignores tags.

        The companion notebook, `lectures/notebooks/lecture_05_pipeline_parallel.ipynb`, runs
        every section of this page cell by cell; change the schedule, p and m at its top.
    """)


def notes():
    note("""
        ## Notes
        Pipeline parallelism sends only activations between neighbours — far less than data or
        tensor parallelism — which is why it spans nodes. Its costs are the bubble (fewer with
        more micro-batches, interleaving or zero-bubble schedules), memory (1F1B bounds it;
        checkpointing trades it for compute), and load balance: the first and last stages also
        hold the embeddings and the LM head, so real systems give them fewer layers.
    """)
    for url, title in [
        ("https://arxiv.org/abs/1811.06965", "Huang et al. 2019, GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism"),
        ("https://arxiv.org/abs/1806.03377", "Harlap et al. 2018, PipeDream: Fast and Efficient Pipeline Parallel DNN Training"),
        ("https://arxiv.org/abs/2006.09503", "Narayanan et al. 2021, Memory-Efficient Pipeline-Parallel DNN Training (PipeDream-2BW and PipeDream-Flush, i.e. 1F1B)"),
        ("https://arxiv.org/abs/2104.04473", "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"),
        ("https://arxiv.org/abs/2211.05953", "Lamy-Poirier 2023, Breadth-First Pipeline Parallelism"),
        ("https://arxiv.org/abs/2401.10241", "Qi et al. 2024, Zero Bubble Pipeline Parallelism (ZB-H1, ZB-H2, post-validation)"),
        ("https://arxiv.org/abs/2405.15362", "Qi et al. 2024, Pipeline Parallelism with Controllable Memory (V-shaped schedules, ZB-V)"),
        ("https://hackmd.io/@ufotalent/r1lVXsa9Jg", "Sea AI Lab, the 'cut-in-half' DualPipe that became DualPipeV"),
        ("https://arxiv.org/abs/2412.19437", "DeepSeek-AI 2024, DeepSeek-V3 Technical Report (DualPipe)"),
        ("https://github.com/deepseek-ai/DualPipe", "DeepSeek-AI, DualPipe and DualPipeV reference schedules"),
        ("https://arxiv.org/abs/2407.21783", "Llama Team 2024, The Llama 3 Herd of Models"),
        ("https://docs.pytorch.org/docs/stable/distributed.pipelining.html", "PyTorch: torch.distributed.pipelining"),
    ]:
        see(url, title=title)


def main():
    try_it_yourself(notebook_exercises("lecture_05_pipeline_parallel"))   # its notebook's exercises, for the page
    intro()                  # the bubble in one picture; why cut by layers
    schedules_as_data()      # a schedule is action lists, checked and simulated
    executor_matches()       # one executor runs them all; equal to one process
    measured_schedules()     # naive, GPipe, 1F1B, interleaved, zero bubble, then all side by side
    real_compute()           # real compute at ranks <= cores; checkpointing's memory and time
    deadlock()               # why the executor batches its sends and receives
    pytorch_schedules()      # PyTorch's schedules on the same model
    with deep_dive("Notes and papers", "what else decides a pipeline, and the papers behind each schedule"):
        notes()              # what else decides a pipeline, and the papers
    with deep_dive("NCCL matches messages in posting order",
                   "why a pair's receives must be posted in the order the peer sends them"):
        deep_dive_posting_order()
    what_to_remember()       # the lecture in seven lines, and its notebook


def bench():
    """Measured bubble / theory for GPipe, 1F1B and interleaved (sleep mode), ZB-H1 vs 1F1B,
    and our 1F1B step vs PyTorch's Schedule1F1B (real compute)."""
    p = sleep_ranks()
    runs = [{"label": "gpipe", "name": "gpipe", "m": 8}, {"label": "1f1b", "name": "1f1b", "m": 8},
            {"label": "interleaved-1f1b", "name": "interleaved-1f1b", "m": 8, "v": 2},
            {"label": "zb-h1", "name": "zb-h1", "m": 8}]
    # Sleeps 10× the page's. Every action also pays a fixed cost here (Python, a gloo message,
    # more ranks than cores; the page measures it) that the textbook formula leaves out;
    # interleaving has v× the actions, each 1/v as long, so at the page's sleeps that cost
    # inflates its bubble most. Long actions make it small, and the ratio then measures the
    # schedule rather than the overhead.
    R = spawn(measure_schedules, p, cfg=sleep_cfg(p), runs=runs, mb_size=2,
              delay={k: 10 * d for k, d in SLEEP.items()}, repeats=5, name="bench: bubbles in sleep mode").returns
    lines = []
    for r in runs[:3]:
        got = statistics.median(measured_bubbles(R, r["label"])[0])
        want = theory_bubble(r["name"], p, 8, r.get("v", 1))
        lines.append(f"lecture_05: {r['label']} bubble measured {pct(got)} vs theory {pct(want)}: "
                     f"ratio {got / want:.2f} (target 0.8–1.2)")
    zb, one = (statistics.median(measured_bubbles(R, k)[0]) for k in ("zb-h1", "1f1b"))
    lines.append(f"lecture_05: ZB-H1 bubble {pct(zb)} vs 1F1B {pct(one)}: ratio {zb / one:.2f} (target < 1)")
    q = timing_ranks_here()
    t = spawn(compare_with_pytorch, q, cfg=GPTConfig(n_layers=2 * q, d_model=64, n_heads=4, seq_len=32),
              m=2 * q, mb_size=4, classes=["Schedule1F1B"], repeats=9, name="bench: 1F1B vs Schedule1F1B").returns[0]["times"]
    ours, theirs = t["ours: 1f1b"].median, t["PyTorch Schedule1F1B"].median
    lines.append(f"lecture_05: our 1F1B {ours * 1e3:.1f} ms/step vs Schedule1F1B {theirs * 1e3:.1f} ms/step: "
                 f"ratio {ours / theirs:.2f} (target <= 1.1)")
    return lines
