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
from lectures.pipeline.deep_dives import (deep_dive_posting_order, dualpipev_formula, notes, schedules_table,
                                          tied_embeddings, unequal_costs)
from lectures.pipeline.demos import (ALL, PYTORCH_SCHEDULES, RATIO_RUNS, RATIO_SLEEP, SLEEP, between_actions,
                                     both_send_first, bubble_row, chunk_cost, compare_with_pytorch, differences, excess_per_action,
                                     measure_schedules, measured_bubbles, measured_busy, measured_pct, median_step,
                                     overhead_per_action, pct, rank_spans, ratio_cfg, reference_train, step_ratios, train_schedules, units_against)
from lectures.pipeline.explorer import explorer_data
from lectures.pipeline.executor import PipelineExecutor
from lectures.pipeline.simulate import held, simulate, theory_bubble
from lectures.pipeline.schedules import Layout, make_schedule
from lectures.pipeline.figures import (side_by_side, layouts_figure, executor_figure, deadlock_figure, bubble_picture,
                                       schedule_figure, gpipe_figure, memory_figure, zero_bubble_picture,
                                       zb_h2_two_steps, real_compute_figure, pytorch_figure,
                                       published_zero_bubble_figure, step_ratio_figure)
from lectures.pipeline.published import QI_TABLE_4, QI_TABLE_4_HARDWARE, QI_TABLE_4_SOURCE, speedups_over_1f1b
from util import cheat, deep_dive, figure, note, see, settings, spawn, table, widget
from util import try_it_yourself
from util.measure import compare, machine, spreads_overlap, value_range, with_spread


def sleep_cfg(p):
    return GPTConfig(n_layers=max(8, 2 * p), d_model=32, n_heads=2, seq_len=16)


def compute_cfg():
    return GPTConfig(n_layers=8, d_model=64, n_heads=4, seq_len=32)


def sleep_ranks():
    """Sleep mode runs the build's world size (4 by default): sleeping ranks share cores fine."""
    return max(2, settings.world_size)


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
    sched = make_schedule("1f1b", p, m)
    sim = simulate(sched, chunk_cost(1))
    note("## Schedules as data")
    figure(schedule_figure(sim, p, m), caption=f"The action lists below, simulated: each bar is one action, its number the micro-batch.")
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
    short = every_schedule_measured(R, p, mode)         # all of them side by side, with the explorer
    schedules_pay_off(p, short, mode, R)                # the step over 1F1B's, with long sleeps; on GPUs
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
    figure(gpipe_figure(R, p, ms, mem), caption=f"Bubble and activation memory against m ({mode}).")
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
        most $p - r$ micro-batches, whatever $m$. At m = {top}, 1F1B's measured peak is
        **{mem['1f1b', top] / 2**10:.0f} KiB**,
        {with_spread(f"{mem['gpipe', top] / mem['1f1b', top]:.1f}× less", f"GPipe's {mem['gpipe', top] / 2**10:.0f} KiB")}
        than GPipe's ($m/p$ = {top / p:g}), for the same bubble in theory (the table above has
        both measured). So $m$ can grow to shrink the
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
        (m = 8, v = {v}). Measured, it is **{pct(inter['measured'])}**, against 1F1B's
        {pct(one['measured'])}.
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

        {zb_h1_gap_words(R)} Rank by rank, and what a postponed W keeps, in the deep dive on every
        schedule's numbers below.
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
        **DualPipeV** (DeepSeek-AI 2025, the DualPipe repository's "cut-in-half" variant of DeepSeek-V3's DualPipe) is a V like ZB-V built for mixtures of experts: it
        runs the forward of one micro-batch together with the backward of another (a pair the
        DualPipe README writes $F\\&B$), so that one's computation hides the other's
        expert-parallel all-to-all (lecture 06). A CPU rank cannot overlap them, so our list,
        transcribed from the reference schedule's eight phases, runs each pair in turn: on the
        simulator it takes {units_against(unit['dualpipev'], unit['zb-v'], "ZB-V")}, holding
        {most['dualpipev'] * 2:g} chunks against ZB-V's {most['zb-v'] * 2:g}. How DeepSeek's
        own bubble formula compares with this list is a deep dive:
    """)


def zb_h1_peaks(R):
    """Per rank: (1F1B's peak, ZB-H1's peak, the output gradients ZB-H1 held at its peak), bytes."""
    return [(r["1f1b m=8"]["peak_saved_bytes"], r["zb-h1"]["peak_saved_bytes"], r["zb-h1"]["peak_held_grads"])
            for r in R]


def zb_h1_gap_words(R):
    """Why ZB-H1's peak row exceeds 1F1B's: the output gradients its postponed Ws wait with
    (the same numbers as zb_h1_memory_words, on the appendix)."""
    peaks = zb_h1_peaks(R)
    one = max(o for o, _, _ in peaks)
    zb = max(z for _, z, _ in peaks)
    without = max(z - dy for _, z, dy in peaks)
    return (f"ZB-H1's peak exceeds 1F1B's ({kib(zb)} against {kib(one)}) by the output gradients "
            f"its postponed Ws wait with. Without them it holds at most {kib(without)} on any rank, "
            f"{'within' if without <= one else 'still above'} 1F1B's.")


def zb_h1_memory_words(R, p):
    """ZB-H1's peak against 1F1B's, from the sleep-mode run's meters: Qi et al. give ZB-H1 1F1B's
    peak (p micro-batches' activations); the output gradients W waits with come on top."""
    peaks = zb_h1_peaks(R)
    one_max = max(one for one, _, _ in peaks)
    worst, rank = max((zb - dy, r) for r, (_, zb, dy) in enumerate(peaks))
    dys = [dy for _, _, dy in peaks]
    most = dys.index(max(dys))
    return (f"Qi et al. give ZB-H1 1F1B's peak memory, $p$ micro-batches' activations. Measured, without the "
            f"output gradients W waits with, ZB-H1's peak is at most {kib(worst)} (rank {rank}) against 1F1B's "
            f"{kib(one_max)}: {'within it' if worst <= one_max else f'{kib(worst - one_max)} more'}. The output "
            f"gradients add {kib(min(dys))}–{kib(max(dys))} per rank (most on rank {most}"
            f"{', whose Ws run latest' if most == p - 1 else ''}), the price of postponing W.")


def zb_h1_memory_table(R):
    """ZB-H1's and 1F1B's peaks, rank by rank (in the deep dive with the numbers)."""
    peaks = zb_h1_peaks(R)
    one_max = max(one for one, _, _ in peaks)
    rows = [[f"rank {r}", kib(one), kib(zb), kib(dy), kib(zb - dy), f"{(zb - dy) / one_max:.2f}×"]
            for r, (one, zb, dy) in enumerate(peaks)]
    table(rows, header=["rank", "1F1B peak", "ZB-H1 peak", "of which output gradients held for W",
                        "ZB-H1 peak without them", "against 1F1B's peak (rank max)"],
          caption="Sleep mode, m = 8: the most bytes each rank held for backward at once (saved by autograd, "
                  "plus what W waits with), and how much of ZB-H1's peak is output gradients.")


def kib(nbytes):
    return f"{nbytes / 2**10:.0f} KiB"


def _v_head_words(makespan, p, m):
    """ZB-V's simulated makespan at F = B = W (1 per stage) against its work 3m plus the V's head
    of p − 1 half-stage forwards."""
    head = (p - 1) / 2
    if abs(makespan - (3 * m + head)) < 1e-9:
        return (f"the rest goes: with $F = B = W$ it takes {makespan:g} units, its {3 * m} units of work "
                f"and the V's head of $p-1$ half-stage forwards ({head:g}), nothing else")
    return (f"with $F = B = W$ it takes {makespan:g} units: {3 * m} of work, {head:g} of the V's head, "
            f"and {makespan - 3 * m - head:g} more")


def verdict(a, b, a_name, b_name, least=3):
    """`compare`'s words when both timings have at least `least` samples; otherwise both times
    and no verdict (one cold sample, or two, cannot tell a difference from noise)."""
    n = min(len(a.samples), len(b.samples))
    if n >= least:
        return compare(a, b, a_name, b_name)
    count = "one sample" if n == 1 else f"{n} samples"
    return f"{a_name} {a.brief()}, {b_name} {b.brief()} ({count}, no verdict)"


def slower_or_faster(a, b, a_name, b_name, least=3):
    """'a_name is r× slower than b_name': a against b in that order, the ratio only where the
    interquartile ranges do not overlap and both have `least` samples; both times on hover."""
    times = f"{a_name} {a.ms()}, {b_name} {b.ms()}"
    n = min(len(a.samples), len(b.samples))
    if n < least:
        return (f"{a_name} {a.brief()}, {b_name} {b.brief()} "
                f"({'one sample' if n == 1 else f'{n} samples'}, no verdict)")
    if spreads_overlap(a, b):
        return f"{a_name} and {b_name} show no {with_spread('measurable difference', times)} (the interquartile ranges overlap)"
    return f"{a_name} is {ratio_words(a, b, a_name, b_name)[1]} than {b_name}"


def ratio_words(a, b, a_name, b_name):
    """(a's median over b's, "r× slower" or "r× faster" with both timings on hover)."""
    r = a.median / b.median
    words = f"{r:.2f}× slower" if r > 1 else f"{1 / r:.2f}× faster"
    return r, with_spread(words, f"{a_name} {a.ms()}, {b_name} {b.ms()}")


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
    (e1, r1), (ei, ri) = extra["1f1b"], extra["interleaved-1f1b"]
    split = {n: extra[n][0] for n in ("zb-h1", "zb-h2", "zb-v", "dualpipev")}
    note(f"""
        Measured steps also pay for what the simulator leaves out (Python, gloo, compute, {p}
        ranks on shared cores): {e1 * 1e3:.0f} ms per step for 1F1B. Interleaving ($v$× the
        actions) pays {ei * 1e3:.0f} ms, the split lists (W: one more action per micro-batch)
        {min(split.values()) * 1e3:.0f}–{max(split.values()) * 1e3:.0f} ms. In 1F1B and interleaving it is bubble
        (measured over theory {r1:.2f}, {ri:.2f}); in the split lists mostly compute inside the
        spans, so their bubble shrinks but not their step. The step is the verdict; the section
        after the explorer measures it with sleeps {RATIO_SLEEP / SLEEP["F"]:.0f}× longer.
    """)
    with deep_dive("What each rank holds over the step, every schedule",
                   "the micro-batches each rank holds, simulated from the same lists, side by side"):
        note("## Deep dive: what each rank holds over the step, every schedule")
        memory_figure(4, 8)
    explorer(4, 8)
    return rows


def schedules_pay_off(p, short_rows, mode, sleep_returns, m=8):
    """The verdict is the step: each schedule's step over 1F1B's, measured with sleeps long
    against the per-action cost, beside the simulator's; then Qi et al.'s GPU measurements."""
    runs = [{"label": name, "name": name, "m": m, "v": v} for name, v in RATIO_RUNS]
    run = spawn(measure_schedules, p, cfg=ratio_cfg(p), runs=runs, mb_size=1, delay={k: RATIO_SLEEP for k in "FBW"},
                repeats=3 if settings.quick else 5, warmup=1, track_memory=False,
                name=f"every schedule's step with {RATIO_SLEEP * 1e3:.0f} ms sleeps, {p} ranks")
    R = run.returns
    ratios = step_ratios(R, p, m)
    rows, excess = [], {}
    for name, v in RATIO_RUNS:
        sim = simulate(make_schedule(name, p, m, v), chunk_cost(v, RATIO_SLEEP, RATIO_SLEEP, RATIO_SLEEP)).makespan
        excess[name] = excess_per_action(R, name, name, m, v, p, RATIO_SLEEP)
        got, want = ratios[name]
        t = R[0][name]["timing"]
        rows.append([name, v, f"{sim * 1e3:.0f} ms", f"{t.median * 1e3:.0f} ms (IQR {value_range(t.q1 * 1e3, t.q3 * 1e3, 'ms', 0)})",
                     f"{want:.3f}", f"{got:.3f}",
                     f"{got - want:+.3f}", f"{excess[name] * 1e3:.1f} ms"])
    worst = max((n for n in ratios if n != "1f1b"), key=lambda n: abs(ratios[n][0] - ratios[n][1]))
    gap = abs(ratios[worst][0] - ratios[worst][1])
    note("## Does the schedule pay? The step, measured against the simulator")
    figure(step_ratio_figure({n: r for n, r in ratios.items() if n != "1f1b"}),
           caption=f"Step over 1F1B's, p = {p}, m = {m}, each action sleeping {RATIO_SLEEP * 1e3:.0f} ms (a chunk's "
                   f"half): simulated (hatched), measured (filled; median of the rounds' ratios, the lists taking turns).")
    short = SLEEP["F"] / 2
    chunks = dict(RATIO_RUNS)      # a list with v chunks per rank runs actions 1/v as long
    against_short = max(excess[n] / (SLEEP["F"] / chunks[n]) for n in excess)
    note(f"""
        The step is what a schedule delivers: with {RATIO_SLEEP * 1e3:.0f} ms actions each measured
        step over 1F1B's is the simulator's within {gap:.3f} ({worst}). What the simulator leaves
        out costs {min(excess.values()) * 1e3:.1f}–{max(excess.values()) * 1e3:.1f} ms per action
        here (compute, Python, gloo, waking a rank on {usable_cores_here()} shared cores): at most
        {100 * max(excess.values()) / RATIO_SLEEP:.0f}% of these actions. The short actions above
        last {SLEEP['F'] * 1e3:.0f} ms, {short * 1e3:.0f} ms per chunk. Against those it is up to
        {against_short:.1f}× a list's own action.
    """)
    with deep_dive("Every schedule's step, bubble and memory, in numbers",
                   "each list's simulated and measured step and bubble at the short sleeps, its step over "
                   "1F1B's with long ones, and ZB-H1's memory rank by rank"):
        note("## Deep dive: every schedule's step, bubble and memory, in numbers")
        table(short_rows, header=["schedule", "m", "v", "theory", "simulated", "measured (IQR)",
                                  "measured step", "simulated step"],
              caption=f"{mode}. Measured bubble: 1 − Σ compute spans / (ranks × step span), per timed "
                      "step; median and interquartile range.")
        table(rows, header=["schedule", "v", "simulated step", "measured step (IQR)", "simulated / 1F1B",
                            "measured / 1F1B", "difference", "step's excess per action"],
              caption=f"Sleep mode with {RATIO_SLEEP * 1e3:.0f} ms per action; the excess per action is (measured "
                      "step − simulated step) over the actions of a rank's list: what each action costs here "
                      "beyond its sleep.")
        note(f"""
            A postponed W keeps only what it needs: the inputs of the parameter-owning modules and
            their output gradients. B runs without `retain_graph`, so what autograd saved only for B
            — attention's probabilities, GELU's inputs, LayerNorm's statistics — goes when B ends, as
            in Qi et al.'s implementation and Megatron-LM's weight-gradient store. So ZB-H1 holds up
            to $p$ micro-batches on every rank where 1F1B holds $p - r$, those waiting for W with less
            than their activations plus their output gradients. {zb_h1_memory_words(sleep_returns, p)}
        """)
        zb_h1_memory_table(sleep_returns)
    cheat("ZB-H1 step, sleep mode", "step over 1F1B's $\\frac{3m+p-1}{3m+3(p-1)}$ at $F = B = W$", round(ratios["zb-h1"][0], 3), "×",
          what=f"ZB-H1's step over 1F1B's, p = {p}, m = {m}, sleep mode with {RATIO_SLEEP * 1e3:.0f} ms actions, "
               f"measured (simulated {ratios['zb-h1'][1]:.3f})")
    speed = speedups_over_1f1b()
    zb1 = [s[2]["ZB-1p"] for s in speed.values()]
    zb2 = [s[2]["ZB-2p"] for s in speed.values()]
    inter = [s[2]["1F1B-I"] for s in speed.values()]
    extra = [mem["ZB-1p"] - mem["1F1B"] for _, _, _, mem in QI_TABLE_4.values()]
    models, gpus = list(QI_TABLE_4), [g for g, _, _, _ in QI_TABLE_4.values()]
    note(f"""
        On GPUs, Qi et al. measured {models[0]} to {models[-1]} GPT models on {min(gpus)} to
        {max(gpus)} A100s with $m = 3p$ (their Table 4). ZB-1p, scheduled within 1F1B's memory
        like ZB-H1, ran {min(zb1):.2f}–{max(zb1):.2f}× 1F1B's samples per second with
        {min(extra)}–{max(extra)} GB more per GPU. ZB-2p, with twice the activation memory like
        ZB-H2, ran {min(zb2):.2f}–{max(zb2):.2f}×; interleaved 1F1B {min(inter):.2f}–{max(inter):.2f}×
        (the deep dive below adds each one's memory).
    """)
    figure(published_zero_bubble_figure(memory=False),
           caption=f"Published, not measured here: {QI_TABLE_4_HARDWARE}. Source: "
                   f"[{QI_TABLE_4_SOURCE[1]}]({QI_TABLE_4_SOURCE[0]}): each schedule's samples per "
                   "GPU per second over 1F1B's at m = 3p.")
    with deep_dive("Zero bubble on GPUs, as published",
                   "Qi et al.'s Table 4: throughput over 1F1B's and memory per GPU, model by model"):
        note("## Deep dive: zero bubble on GPUs, as published")
        figure(published_zero_bubble_figure(),
               caption=f"Published on GPUs, not measured here: [{QI_TABLE_4_SOURCE[1]}]({QI_TABLE_4_SOURCE[0]}). Left: "
                       "throughput over 1F1B's at m = 3p; right: memory per GPU.")
        note("""
            The paper's ZB-1p and ZB-2p are its automatically scheduled lists under a memory
            limit of p and 2p micro-batches' activations (1F1B's peak, and twice it; the
            handcrafted ZB-H1 and ZB-H2 hold p and 2p − 1); 1F1B-I is interleaved 1F1B. Table 4 measures each at m = 3p, 4p and 8p micro-batches; the
            figure draws m = 3p, where the bubble weighs most.
        """)


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
        The GPipe paper re-materialises activations, and our "gpipe + checkpointing" row does
        the same: each stage keeps only its input per micro-batch, and its backward first
        re-runs the stage's forward, which saves one
        micro-batch's activations again. The peak is therefore every kept input plus one
        micro-batch's activations, and the meter counts both (saves during F and during the
        re-run). With checkpointing a stage holds at most **{cm / 2**20:.2f} MiB** instead of
        {gm / 2**20:.2f} MiB. Time: {slower_or_faster(c, g, "the checkpointed step", "plain GPipe's")}.
        Every forward runs twice, and the re-run counts as busy time in the measured bubble
        ({pct(bub['gpipe + checkpointing'])} with checkpointing, {pct(bub['gpipe'])} without):
        extra compute fills idle slots, so for a checkpointed schedule the step time, not the
        bubble, says whether it got faster.

        Beside each measured bubble, its theory: the textbook formula with free communication.
        Measured over theory is {bub['1f1b'] / theory['1f1b']:.1f} for 1F1B and
        {bub['gpipe'] / theory['gpipe']:.1f} for GPipe: every action here also pays Python's and
        gloo's per-message cost, and {p} ranks compute at once on this machine's cores, none
        of which the formula charges.
    """)
    table(rows, header=["schedule", "theory", "measured bubble", "peak activations (rank max)", "step time (IQR)"],
          caption=f"Real compute, {machine(p)}. The bubble includes communication and Python "
                  "overhead between actions. Theory: (p−1)/(m+p−1) for GPipe and 1F1B; for ZB-H1 "
                  "the simulator's bubble with F = B = W, (p−1)(F+B−W) over its makespan.")
    z, o = R[0]["zb-h1"]["timing"], R[0]["1f1b"]["timing"]
    (zl, zo), (ol, oo) = (overhead_per_action(R, n, n, m, 1, p) for n in ("zb-h1", "1f1b"))
    note(f"""
        ZB-H1 against 1F1B with real compute: {zb_h1_verdict(bub['zb-h1'], bub['1f1b'], z, o, measured_busy(R, 'zb-h1'), measured_busy(R, '1f1b'))}
        Against the list simulated at its measured
        {with_spread("action lengths", f"medians: F {zl['F'] * 1e3:.1f}, B {zl['B'] * 1e3:.1f}, W {zl['W'] * 1e3:.1f} ms; 1F1B's F {ol['F'] * 1e3:.1f}, B {ol['B'] * 1e3:.1f} ms")},
        {between_actions(zo, oo, statistics.mean(zl.values()), z, o)} (Its plan was timed with the
        F, B, W a first step measured.)
    """)


def zb_h1_verdict(bubble_z, bubble_o, z, o, busy_z=None, busy_o=None):
    """ZB-H1 against 1F1B from their measured bubbles and step Timings (and the compute summed
    over ranks, busy_*): the bubble alone does not say which step is faster, so the verdict is
    the step's, and says when the two disagree."""
    smaller = bubble_z < bubble_o
    bubble = f"its measured bubble is {'smaller' if smaller else 'not smaller'} ({pct(bubble_z)} against {pct(bubble_o)})"
    # the bubble's two numbers, then the step's in a sentence of its own (two numbers each at most)
    if min(len(z.samples), len(o.samples)) < 3 or spreads_overlap(z, o):
        steps = slower_or_faster(z, o, "its step", "1F1B's")
        return f"{bubble}. {steps[0].upper()}{steps[1:]}."
    r, step = ratio_words(z, o, "ZB-H1", "1F1B")
    if r > 1 and smaller:
        why = ""
        if busy_z is not None and busy_z > busy_o:
            why = (f" Its actions add up to {busy_z * 1e3:.0f} ms of compute per step over the ranks "
                   f"against 1F1B's {busy_o * 1e3:.0f} ms: the split backward's own cost outweighs the idle "
                   "time its Ws fill (B asks autograd for every weighted module's output gradient as well as "
                   "the input's, and W runs one small product per module from Python).")
        return f"{bubble}. Yet its step is {step} than 1F1B's: the step time is the verdict.{why}"
    if r < 1:
        return f"{bubble}. {'Its step is' if smaller else 'Yet its step is'} {step} than 1F1B's{' too' if smaller else ''}."
    return f"{bubble}. Its step is {step} than 1F1B's."


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
                   f"blocking send of {mib:g} MiB first and wait (up to {waited:.1f} s) until the "
                   f"{timeout} s timeout ends one rank's send and, with it, the connection the other is "
                   f"sending on; neither reaches its receive. Right: the same exchange "
                   f"posted as one batch of isend and irecv completes in {took * 1e3:.0f} ms.")
    note(f"""
        Two neighbours each hold something for the other (activations going forward,
        gradients coming back). If both first call a blocking `send`, each waits for the other
        to receive, and neither gets to its `recv` (the first demo, with a {timeout}-second
        timeout: it is expected to fail). Posting the send and the receive together in one
        `batch_isend_irecv` lets both complete: rank 0 received {run.returns[0]:g}, rank 1
        received {run.returns[1]:g}. A non-blocking `isend` followed by a separate `recv` is
        not enough in general: it works on gloo, which moves the send in the background, but on
        NCCL a rank's point-to-point calls run one after another on one stream and a send
        completes only when the peer's receive runs, so two neighbours that each `isend` and
        then `recv` wait for each other exactly like two blocking sends (tests/test_nccl_contract.py
        checks that case). Only a batch (one group of calls) lets the pair meet. The executor
        above posts every exchange as such a batch, for the same reason.
    """)


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
                   f"alternating step by step in the same processes: {machine(p)}, {m} micro-batches of a small GPT.")
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
          caption=f"Real compute, ours and PyTorch's alternating step by step, {machine(p)}; one process's loss {ref['losses'][0]:.6f}.")
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
