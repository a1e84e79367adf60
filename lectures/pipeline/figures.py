"""Lecture 05's figures: the drawings of its page and its appendix. `draw_rows` draws a schedule's
timeline (one row per rank, F/B/W coloured, later chunks hatched), the notebook's too; the rest draw
measured schedules side by side, the interleaved layouts, the executor against the simulator, a
deadlock, the bubble in one picture, what each rank holds over a step, the zero-bubble lists, the
real-compute and PyTorch comparisons, and NCCL's posting order. Some compute what they draw (memory
over time, measured bubbles) and emit it with its caption (`figure`); the others return the figure."""
import statistics

from lectures.pipeline.demos import PYTORCH_SCHEDULES, bubble_row, chunk_cost, measured_bubbles, pct
from lectures.pipeline.schedules import Action, Layout, make_schedule
from lectures.pipeline.simulate import consecutive_steps, held, simulate
from util import figure
from util.figures import NOTE

COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}


def draw_rows(ax, rows, title, unit="ms", scale=1e3, span=None, fontsize=NOTE, numbers=True):
    """A schedule's timeline: one row per rank, F blue, B orange, W green, the micro-batch
    number on each bar wide enough to hold it (unless `numbers` is False), later chunks hatched.
    `rows[r]` = [(Action, start, end)]; `span`: the x-axis length shared with other panels;
    `fontsize`: the axis and tick labels', "medium" in small panels, "large" in a figure of its own."""
    # the title a step above the labels, the bars' numbers a step or two below
    title_size, number_size = {"medium": (NOTE, "small"), NOTE: ("large", "small"),
                               "large": ("large", "medium")}[fontsize]
    t0 = min(s for row in rows for _, s, _ in row)
    span = span or max(e for row in rows for _, _, e in row) - t0
    for r, row in enumerate(rows):
        for a, start, end in row:
            left, width = (start - t0) * scale, (end - start) * scale
            ax.barh(r, width, left=left, height=0.8, color=COLOURS[a.kind], edgecolor="black",
                    linewidth=0.3, hatch="//" if a.chunk else None)
            if numbers and width >= span * scale / 40:
                ax.text(left + width / 2, r, str(a.microbatch), ha="center", va="center",
                        fontsize=number_size, color="white")
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span * scale)
    ax.set_title(title, fontsize=title_size, loc="left")
    ax.set_xlabel(unit, fontsize=fontsize)
    ax.tick_params(labelsize=fontsize)


def legend_patches(chunks=True):
    from matplotlib.patches import Patch
    names = {"F": "F forward", "B": "B backward", "W": "W weight gradient"}
    return ([Patch(color=c, label=names[k]) for k, c in COLOURS.items()] +
            ([Patch(facecolor="white", edgecolor="black", hatch="//", label="chunk 1")] if chunks else []))


def side_by_side(pairs):
    """One row per schedule: simulated (left) and measured (right) timelines, each column on
    one shared time axis, so rows compare at a glance."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(pairs), 2, figsize=(7.5, 0.8 + 1.2 * len(pairs)), squeeze=False, sharex="col")
    sim_span = max(e - min(s for row in rows for _, s, _ in row)
                   for _, rows, _, _ in pairs for row in rows for _, _, e in row)
    measured = [m for _, _, m, _ in pairs if m is not None]
    meas_span = max((max(e for row in m for _, _, e in row) - min(s for row in m for _, s, _ in row))
                    for m in measured) if measured else None
    for (title, sim_rows, measured_rows, sim_unit), (left, right) in zip(pairs, axes):
        draw_rows(left, sim_rows, f"{title}: simulated", unit=sim_unit, scale=1, span=sim_span,
                  fontsize="medium", numbers=False)
        if measured_rows is not None:
            draw_rows(right, measured_rows, f"{title}: measured", span=meas_span, fontsize="medium",
                      numbers=False)
        else:
            right.set_axis_off()
    for ax in axes[:-1].flat:          # one time axis per column: tick labels on the bottom row only
        ax.tick_params(labelbottom=False)
        ax.set_xlabel("")
    fig.legend(handles=legend_patches(), loc="lower center", ncol=4, frameon=False, fontsize="medium")
    fig.tight_layout(rect=(0, 0.5 / (0.8 + 1.2 * len(pairs)), 1, 1))
    return fig


def layouts_figure(p):
    """Which rank holds which stage, and the path a micro-batch takes: looped vs V (from Layout)."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    for ax, (style, title) in zip(axes, [("looped", "looped (interleaved)"),
                                         ("v", "V (ZB-V, DualPipeV)")]):
        lay = Layout(p, 2, style)
        pts = [lay.place(st) for st in range(lay.stages)]
        ax.plot(range(lay.stages), [r for r, _ in pts], "-", color="grey", zorder=1)
        for st, (r, c) in enumerate(pts):
            ax.scatter(st, r, s=330, color=["#4c78a8", "#e45756"][c], zorder=2)
            ax.text(st, r, str(st), ha="center", va="center", color="white", fontsize=NOTE, zorder=3)
        ax.set_title(title, loc="left")
        ax.set_xlabel("stage (forward order)")
        ax.set_xticks(range(lay.stages))
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.set_ylim(p - 0.5, -0.6)
    axes[0].scatter([], [], color="#4c78a8", label="chunk 0"), axes[0].scatter([], [], color="#e45756", label="chunk 1")
    fig.legend(loc="lower center", ncol=2, frameon=False, fontsize="large")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    figure(fig, caption=f"Two chunks per rank on {p} ranks. Looped: stage c·p + r on rank r, so a "
                        "micro-batch crosses rank p−1 → rank 0 mid-model. V: stages r and 2p−1−r on "
                        "rank r, so the turn at the last rank is a local hand-over and rank 0 holds "
                        "the first and the last stage (the loss starts where the input entered).")


def executor_figure(returns, runs, names=("1f1b", "zb-v")):
    """What the executor ran on each rank in the last training step of two schedules, from the
    spans every rank measured, on one time axis (ms)."""
    import matplotlib.pyplot as plt
    keys = [next(k for k in runs if k[0] == name) for name in names]
    rows = {k: [[(Action(*a), t0, t1) for a, t0, t1 in r[k]["events"]] for r in returns] for k in keys}
    length = {k: max(e for row in rs for _, _, e in row) - min(t for row in rs for _, t, _ in row)
              for k, rs in rows.items()}
    fig, axes = plt.subplots(1, len(keys), figsize=(7.5, 2.3), sharey=True)
    for ax, k in zip(axes, keys):
        name, m, v = k
        draw_rows(ax, rows[k], f"{name}, m = {m}: {length[k] * 1e3:.0f} ms", span=max(length.values()),
                  fontsize="medium", numbers=False)
        ax.label_outer()
    fig.legend(handles=legend_patches(), loc="lower center", ncol=4, frameon=False, fontsize="medium")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig, length


def deadlock_figure(blocked, batched, mib, received):
    """Two ranks, each sending `mib` MiB to the other: blocking sends first (left: both wait
    until the timeout) against one batch of isend and irecv (right: both complete), drawn from
    the spans each rank measured."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 2.3))
    panels = [(axes[0], blocked, 1, "s", "#e45756", "blocking send first: deadlock"),
              (axes[1], batched, 1e3, "ms", "#54a24b", "send and receive in one batch")]
    for ax, spans, scale, unit, colour, title in panels:
        end = max(e for _, e in spans.values()) * scale
        for r, (t0, t1) in spans.items():
            ax.barh(r, (t1 - t0) * scale, left=t0 * scale, height=0.35, color=colour)
            what = "timed out" if ax is axes[0] else f"got {received[r]:g}"
            ax.text(t1 * scale, r, f" {what}", va="center")
        mid = end / 3
        for r in spans:                    # the message each rank sends the other
            x = mid + (0.04 if r else -0.04) * end
            ax.annotate("", xy=(x, 0.8 - 0.6 * r), xytext=(x, 0.2 + 0.6 * r),
                        arrowprops={"arrowstyle": "->", "lw": 1.3, "color": "black",
                                    "linestyle": "--" if ax is axes[0] else "-"})
        ax.text(mid + 0.1 * end, 0.5, f"{mib:g} MiB each way", ha="left", va="center")
        ax.set_yticks([0, 1], ["rank 0", "rank 1"])
        ax.set_ylim(1.6, -0.6)
        ax.set_xlim(0, end * 1.45)
        ax.set_xlabel(unit, fontsize="medium")
        ax.set_title(title, fontsize=NOTE, loc="left")
        ax.tick_params(labelsize="medium")
    fig.tight_layout()
    return fig


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
                  scale=1, span=span, fontsize="large")
        ax.axvspan(0, sim.makespan, color="#e8e8e8", zorder=0)   # grey up to the step's end: the bubble
        ax.label_outer()
    from matplotlib.patches import Patch
    fig.legend(handles=legend_patches(chunks=False)[:2] + [Patch(color="#e8e8e8", label="idle: the bubble")],
               loc="lower center", ncol=3, frameon=False, fontsize="large")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    figure(fig, caption=f"{p} stages on {p} ranks, simulated. Top: one batch keeps one rank busy at a time. "
                        f"Bottom: cut into {m} micro-batches, the stages work at once and the grey "
                        "(the bubble) shrinks to the fill at the start and the drain at the end.")


def schedule_figure(sim, p, m):
    """1F1B's action lists simulated: each bar one action, its number the micro-batch."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 2.6))
    draw_rows(ax, sim.timeline, f"1F1B, {p} ranks, {m} micro-batches: bubble {pct(sim.bubble)}",
              unit="time (F = 1, unsplit B = 2)", scale=1, fontsize="large")
    fig.legend(handles=legend_patches(chunks=False)[:2], loc="lower center", ncol=2, frameon=False, fontsize="large")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


def gpipe_figure(R, p, ms, mem):
    """GPipe's and 1F1B's measured bubble (beside the formula) and peak activations, against m."""
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
        ax.set_ylim(bottom=0)
        ax.set_xlabel("micro-batches m (log scale)", fontsize=NOTE)
        ax.set_ylabel(ylabel, fontsize=NOTE)
        ax.set_title(title, loc="left")
        ax.legend()
    fig.tight_layout()
    return fig


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
        ax.set_title(f"{name}: most {max(held(sch)) / v:g}", fontsize=NOTE, loc="left")
        ax.tick_params(labelsize="medium")
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("held", fontsize=NOTE)
    for ax in axes[-1]:
        ax.set_xlabel("time (F = B = W = 1)", fontsize="medium")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=p, frameon=False)
    fig.tight_layout(rect=(0, 0.7 / (2.0 * rows + 0.7), 1, 1))
    figure(fig, caption=caption or f"Activations each rank holds during one step ({p} ranks, {m} micro-batches, "
                        "simulated from the action lists the ranks run): a micro-batch counts from its F "
                        "until the action that releases its activations (B, or W when the backward is "
                        "split); a chunk counts 1/v. GPipe climbs to m; 1F1B holds p − r on rank r; "
                        "ZB-H1 holds p on every rank (its postponed Ws keep activations longer), ZB-H2 "
                        "2p − 1, ZB-V p in half-size chunks.")


def zero_bubble_picture(p, m):
    """1F1B and the zero-bubble lists simulated with F = B = W, on one time axis."""
    import matplotlib.pyplot as plt
    names = [("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2)]
    sims = [(name, v, simulate(make_schedule(name, p, m, v), chunk_cost(v))) for name, v in names]
    span = max(sim.makespan for _, _, sim in sims)
    fig, axes = plt.subplots(len(sims), 1, figsize=(8, 1.5 * len(sims) + 0.9), sharex=True)
    for ax, (name, v, sim) in zip(axes, sims):
        draw_rows(ax, sim.timeline, f"{name}: {sim.makespan:g} units, bubble {pct(sim.bubble)}",
                  unit="time (F = B = W = 1 per stage)", scale=1, span=span)
        ax.label_outer()
    fig.legend(handles=legend_patches(), loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.9 / (1.5 * len(sims) + 0.9), 1, 1))
    figure(fig, caption=f"{p} ranks, {m} micro-batches, simulated: the weight gradients W (green) move "
                        "into the slots where 1F1B idles (hatched: a rank's second chunk in ZB-V's V).")


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
              f"= {one.makespan:g} + {steady:g}", unit="time (F = B = W = 1 per stage)", scale=1)
    ax.axvline(one.makespan, color="black", ls=":", lw=1.2)
    figure(fig, caption=f"{p} ranks, {m} micro-batches per step, simulated (the second step's micro-batches "
                        f"are numbered from {m}). One step alone takes {one.makespan:g} units; the second "
                        f"adds {steady:g}, which is its {work:g} units of work and "
                        f"{_idle_words(steady - work)}: the first ranks start step 2 while the last finish "
                        "step 1, so the parallelogram's head fills the tail (dotted: where one step alone ends).")


def _idle_words(idle):
    return "no idle time" if abs(idle) < 1e-9 else f"{idle:g} units idle per rank"


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
    a1.set_xlabel("measured bubble (%)", fontsize="medium")
    a1.set_ylabel("step time (ms)", fontsize="medium")
    a1.set_title("step time against bubble", fontsize=NOTE, loc="left")
    a2.set_xlabel("MiB", fontsize="medium")
    a2.set_title("peak activations held", fontsize=NOTE, loc="left")
    a2.invert_yaxis()
    for ax in (a1, a2):
        ax.tick_params(labelsize="medium")
        ax.grid(alpha=0.3)
    a1.set_xlim(left=0)
    a1.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


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
    ax.set_xlabel("step time (ms): median, bar = interquartile range", fontsize="medium")
    ax.tick_params(labelsize="medium")
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlim(0, 1.45 * max(t.q3 for t in times.values()) * 1e3)   # room on the right for the legend
    ax.legend(fontsize="medium", loc="lower right")
    fig.tight_layout()
    return fig


def posting_order_figure(sent, needed, src, dst):
    """The messages from rank `src` to rank `dst` in the order `src` sends them (top) and the
    order `dst` needs them (bottom), a line from each to where it is needed; red where they differ."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 2.6))
    label = lambda k: f"{'a' if k[0] == 'act' else 'g'}{k[2]}"
    pos = {k: i for i, k in enumerate(needed)}
    for i, k in enumerate(sent):
        j = pos[k]
        ax.plot([i, j], [1, 0], color="#e45756" if i != j else "#bbbbbb", lw=1.4)
    for i, k in enumerate(sent):
        ax.text(i, 1.06, label(k), ha="center", va="bottom", fontsize="small", rotation=90)
    for j, k in enumerate(needed):
        ax.text(j, -0.06, label(k), ha="center", va="top", fontsize="small", rotation=90)
    ax.set_yticks([0, 1], [f"rank {dst} needs", f"rank {src} sends"])
    ax.set_xticks([])
    ax.set_ylim(-0.45, 1.45)
    ax.tick_params(labelsize="small")
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def published_zero_bubble_figure(memory=True):
    """Qi et al.'s GPU measurements (Table 4, carried in lectures/pipeline/published.py): each
    schedule's throughput over 1F1B's at each model's fewest micro-batches (left), and, with
    `memory`, the memory each used (right); the source is written on the figure."""
    import matplotlib.pyplot as plt
    from lectures.pipeline.published import (QI_TABLE_4, QI_TABLE_4_HARDWARE, QI_TABLE_4_SCHEDULES,
                                             QI_TABLE_4_SOURCE, speedups_over_1f1b)
    colours = {"1F1B": "#9e9e9e", "1F1B-I": "#4c78a8", "ZB-1p": "#54a24b", "ZB-2p": "#e45756"}
    speed = speedups_over_1f1b()
    models = list(QI_TABLE_4)
    fig, axes = plt.subplots(1, 2 if memory else 1, figsize=(7.5, 3.6 if memory else 3.0), squeeze=False)
    left, right = axes[0][0], axes[0][-1] if memory else None
    width = 0.8 / len(QI_TABLE_4_SCHEDULES)
    for k, s in enumerate(QI_TABLE_4_SCHEDULES):
        xs = [i + (k - 1.5) * width for i in range(len(models))]
        left.bar(xs, [speed[mo][2][s] for mo in models], width, color=colours[s], label=s)
        if memory:
            right.bar(xs, [QI_TABLE_4[mo][3][s] for mo in models], width, color=colours[s], label=s)
    labels = [f"{mo}\n{speed[mo][0]} GPUs\nm={speed[mo][1]}" for mo in models]
    left.set_xticks(range(len(models)), labels, fontsize="medium")
    left.set_ylim(0.9, 1.35)
    left.axhline(1, color="black", linewidth=0.6)
    left.set_ylabel("throughput / 1F1B's")
    left.set_title("samples/GPU/s over 1F1B's", loc="left")
    if memory:
        right.set_xticks(range(len(models)), [f"{mo}\n{QI_TABLE_4[mo][0]} GPUs" for mo in models], fontsize="medium")
        right.set_ylabel("memory (GB)")
        right.set_title("memory per GPU", loc="left")
    handles, names = left.get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=len(names), fontsize="medium", frameon=False)
    fig.text(0.01, 0.01, f"Published, not measured here: {QI_TABLE_4_SOURCE[1]},\n"
                         f"{QI_TABLE_4_HARDWARE}; {QI_TABLE_4_SOURCE[0]}", fontsize="small")
    fig.tight_layout(rect=(0, 0.11, 1, 0.91))
    return fig


def step_ratio_figure(ratios):
    """Each schedule's step over 1F1B's, simulated (hollow) and measured (filled), in sleep mode
    with long sleeps: {name: (measured, simulated)}."""
    import matplotlib.pyplot as plt
    names = list(ratios)
    fig, ax = plt.subplots(figsize=(6, 0.7 + 0.36 * len(names)))
    ys = range(len(names))
    ax.barh([y + 0.2 for y in ys], [ratios[n][1] for n in names], 0.38, facecolor="white",
            edgecolor="#4c78a8", hatch="//", label="simulated")
    ax.barh([y - 0.2 for y in ys], [ratios[n][0] for n in names], 0.38, color="#4c78a8", label="measured")
    for y, n in zip(ys, names):
        ax.text(ratios[n][0] + 0.01, y - 0.2, f"{ratios[n][0]:.3f}", va="center", fontsize="medium")
        ax.text(ratios[n][1] + 0.01, y + 0.2, f"{ratios[n][1]:.3f}", va="center", fontsize="medium")
    ax.set_yticks(list(ys), names)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(0.6, 1.12)
    ax.axvline(1, color="black", linewidth=0.6)
    ax.set_xlabel("step time / 1F1B's")
    ax.legend(loc="lower right", fontsize="medium")
    fig.tight_layout()
    return fig
