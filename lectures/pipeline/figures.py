"""Lecture 05's figures: the drawings of its page. `draw_rows` draws a schedule's timeline (one
row per rank, F/B/W coloured, later chunks hatched), the notebook's too; the rest draw measured
schedules side by side, the interleaved layouts, the executor against the simulator, and a deadlock.
The figures that compute what they draw (memory over time, measured bubbles) stay in the lecture."""
from lectures.pipeline.schedules import Action, Layout
from util import figure

COLOURS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}


def draw_rows(ax, rows, title, unit="ms", scale=1e3, span=None, fontsize=11, numbers=True):
    """A schedule's timeline: one row per rank, F blue, B orange, W green, the micro-batch
    number on each bar wide enough to hold it (unless `numbers` is False), later chunks hatched.
    `rows[r]` = [(Action, start, end)]; `span`: the x-axis length shared with other panels."""
    t0 = min(s for row in rows for _, s, _ in row)
    span = span or max(e for row in rows for _, _, e in row) - t0
    for r, row in enumerate(rows):
        for a, start, end in row:
            left, width = (start - t0) * scale, (end - start) * scale
            ax.barh(r, width, left=left, height=0.8, color=COLOURS[a.kind], edgecolor="black",
                    linewidth=0.3, hatch="//" if a.chunk else None)
            if numbers and width >= span * scale / 40:
                ax.text(left + width / 2, r, str(a.microbatch), ha="center", va="center",
                        fontsize=fontsize - 2, color="white")
    ax.set_yticks(range(len(rows)), [f"rank {r}" for r in range(len(rows))])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span * scale)
    ax.set_title(title, fontsize=fontsize + 1, loc="left")
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
                  fontsize=10, numbers=False)
        if measured_rows is not None:
            draw_rows(right, measured_rows, f"{title}: measured", span=meas_span, fontsize=10, numbers=False)
        else:
            right.set_axis_off()
    for ax in axes[:-1].flat:          # one time axis per column: tick labels on the bottom row only
        ax.tick_params(labelbottom=False)
        ax.set_xlabel("")
    fig.legend(handles=legend_patches(), loc="lower center", ncol=4, frameon=False, fontsize=10)
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
            ax.text(st, r, str(st), ha="center", va="center", color="white", fontsize=11, zorder=3)
        ax.set_title(title, fontsize=12, loc="left")
        ax.set_xlabel("stage (forward order)", fontsize=12)
        ax.set_xticks(range(lay.stages))
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.set_ylim(p - 0.5, -0.6)
        ax.tick_params(labelsize=11)
    axes[0].scatter([], [], color="#4c78a8", label="chunk 0"), axes[0].scatter([], [], color="#e45756", label="chunk 1")
    fig.legend(loc="lower center", ncol=2, frameon=False, fontsize=12)
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
                  fontsize=10, numbers=False)
        ax.label_outer()
    fig.legend(handles=legend_patches(), loc="lower center", ncol=4, frameon=False, fontsize=10)
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
            ax.text(t1 * scale, r, f" {what}", va="center", fontsize=10)
        mid = end / 3
        for r in spans:                    # the message each rank sends the other
            x = mid + (0.04 if r else -0.04) * end
            ax.annotate("", xy=(x, 0.8 - 0.6 * r), xytext=(x, 0.2 + 0.6 * r),
                        arrowprops={"arrowstyle": "->", "lw": 1.3, "color": "black",
                                    "linestyle": "--" if ax is axes[0] else "-"})
        ax.text(mid + 0.1 * end, 0.5, f"{mib:g} MiB each way", ha="left", va="center", fontsize=10)
        ax.set_yticks([0, 1], ["rank 0", "rank 1"])
        ax.set_ylim(1.6, -0.6)
        ax.set_xlim(0, end * 1.45)
        ax.set_xlabel(unit, fontsize=10)
        ax.set_title(title, fontsize=11, loc="left")
        ax.tick_params(labelsize=10)
    fig.tight_layout()
    return fig
