"""Lecture 08's drawings, from what its runs returned."""
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from lectures.checkpoint.restart import expected_waste, young_daly
from util.figures import NOTE

RANK_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f"]


def draw_boxes(panels):
    """One panel per (title, global shape, [(rank, offset, shape)]): the global matrix, and the
    box of it each rank writes, in the rank's colour (a box two ranks hold is drawn once, by the
    lower rank: the one DCP's planner keeps may be either)."""
    fig, axes = plt.subplots(1, len(panels), figsize=(2.5 * len(panels), 2.9), squeeze=False)
    for ax, (title, shape, boxes) in zip(axes[0], panels):
        rows, cols = shape if len(shape) == 2 else (shape[0], 1)
        ax.add_patch(Rectangle((0, 0), cols, rows, fill=False, lw=1.5, ec="black"))
        seen = set()
        for rank, offset, size in sorted(boxes):
            key = (tuple(offset), tuple(size))
            if key in seen:
                continue
            seen.add(key)
            r0, c0 = offset if len(offset) == 2 else (offset[0], 0)
            h, w = size if len(size) == 2 else (size[0], 1)
            ax.add_patch(Rectangle((c0, r0), w, h, fc=RANK_COLOURS[rank % 8], ec="white", lw=1.2, alpha=0.9))
            if h * w >= 0.04 * rows * cols:
                ax.text(c0 + w / 2, r0 + h / 2, f"r{rank}", ha="center", va="center", color="white",
                        fontsize=NOTE, fontweight="bold")
        ax.set_xlim(-0.5, cols + 0.5)
        ax.set_ylim(rows + 0.5, -0.5)
        ax.set_aspect("auto")
        ax.set_title(title, fontsize=NOTE, wrap=True)
        ax.set_xticks([0, cols])
        ax.set_yticks([0, rows])
    fig.tight_layout()
    return fig


def draw_restart(events, lost):
    """The job's two attempts on one time axis: steps, checkpoints, the death, the restart."""
    t0 = min(e["t"] for e in events)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for e in events:
        t, y = e["t"] - t0, 1 - e["attempt"]
        if e["event"] == "step":
            ax.plot(t, y, "o", color="#4e79a7", ms=7)
            ax.annotate(f"{e['step']}", (t, y), textcoords="offset points", xytext=(0, 8 if e["step"] % 2 else -18),
                        ha="center", fontsize=NOTE)
        elif e["event"] == "saved":
            ax.plot(t, y, "s", color="#59a14f", ms=10)
        elif e["event"] == "died":
            ax.plot(t, y, "X", color="#e15759", ms=12)
        elif e["event"] == "resumed":
            ax.plot(t, y, ">", color="#b07aa1", ms=10)
    died = next(e["t"] for e in events if e["event"] == "died") - t0
    ax.axvspan(died, died + lost["restart"], color="#bab0ac", alpha=0.3, lw=0)
    ax.text(died + lost["restart"] / 2, 0.5, f"restart {lost['restart']:.1f} s", ha="center", va="center", fontsize=NOTE)
    ax.set_yticks([1, 0], ["attempt 0", "attempt 1"])
    ax.set_ylim(-0.7, 2.4)
    ax.set_xlabel("seconds since the job started")
    handles = [plt.Line2D([], [], ls="", marker=m, color=c, ms=8, label=l) for m, c, l in
               (("o", "#4e79a7", "a step (its number)"), ("s", "#59a14f", "checkpoint written"),
                ("X", "#e15759", "rank 1 dies"), (">", "#b07aa1", "resumed"))]
    ax.legend(handles=handles, loc="upper center", ncol=2, fontsize="small")
    fig.tight_layout()
    return fig


def draw_waste(cases, mtbf):
    """Expected fraction of time lost against the checkpoint interval, one curve per write
    time (label, δ seconds), with Young/Daly's interval marked."""
    import numpy as np
    fig, ax = plt.subplots(figsize=(7, 4))
    taus = np.logspace(0.5, 4.3, 300)
    for (label, delta), colour in zip(cases, RANK_COLOURS):
        ax.plot(taus / 60, [100 * expected_waste(t, delta, mtbf) for t in taus], color=colour, label=label)
        best = young_daly(delta, mtbf)
        ax.plot(best / 60, 100 * expected_waste(best, delta, mtbf), "o", color=colour)
        ax.annotate(f"{best / 60:.1f} min", (best / 60, 100 * expected_waste(best, delta, mtbf)),
                    textcoords="offset points", xytext=(0, 8), ha="center", fontsize=NOTE, color=colour)
    ax.set_xscale("log")
    ax.set_xticks([0.1, 1, 10, 100], ["0.1", "1", "10", "100"])
    ax.set_ylim(0, 2.6 * max(100 * expected_waste(young_daly(d, mtbf), d, mtbf) for _, d in cases))
    ax.set_xlabel("minutes between checkpoints")
    ax.set_ylabel("% of time lost")
    ax.legend(loc="upper center", fontsize="small")
    fig.tight_layout()
    return fig


def draw_costs(costs):
    """Per layout: the median time of a training step, a synchronous save, the time an
    asynchronous save blocks the step and until its files are on disk (ms, with the IQR)."""
    import numpy as np
    kinds = [("training step", "#bab0ac"), ("synchronous save", "#e15759"), ("async: step blocked", "#59a14f"),
             ("async: until on disk", "#4e79a7")]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.9 * len(costs)))
    height = 0.8 / len(kinds)
    for k, (label, colour) in enumerate(kinds):
        ys = np.arange(len(costs)) + k * height
        timings = [c[1][k] for c in costs]
        ax.barh(ys, [t.median * 1e3 for t in timings], height=height, color=colour, label=label,
                xerr=[[(t.median - t.q1) * 1e3 for t in timings], [(t.q3 - t.median) * 1e3 for t in timings]],
                capsize=2)
    ax.set_xlim(0, 1.75 * max(t.q3 * 1e3 for c in costs for t in c[1]))
    ax.set_yticks(np.arange(len(costs)) + 0.4 - height / 2, [c[0] for c in costs])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds (median of the slowest rank, IQR)")
    ax.legend(loc="center right", fontsize="small")
    fig.tight_layout()
    return fig


def draw_norms(rows, true_norm):
    """The first step's gradient norm per layout: counted once, and each rank counting all it
    holds, against clip_grad_norm_'s in one process."""
    import numpy as np
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r[1] for r in rows], width=0.4, color="#59a14f", label="counted once")
    ax.bar(x + 0.2, [r[2] for r in rows], width=0.4, color="#e15759", label="each rank counts all it holds")
    ax.axhline(true_norm, color="black", lw=1, ls="--", label="one process (clip_grad_norm_)")
    ax.set_xticks(x, [r[0] for r in rows])
    ax.set_ylabel("gradient norm, step 1")
    ax.set_ylim(0, 1.45 * max(r[2] for r in rows))
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    return fig
