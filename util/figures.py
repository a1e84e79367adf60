"""The course's figure style, figures drawn from what a run measured, and progress bars for
long sweeps."""
import os
import sys

os.environ.setdefault("MPLBACKEND", "Agg")

import matplotlib  # noqa: E402  (after MPLBACKEND: the backend is chosen on import)

# One style for every figure of the course, in points. It is set here, when util is imported, so
# before any figure exists: matplotlib fixes a text's size when the text is made, not when it is
# saved. A figure asks for a size by role, never in points: nothing (the style's size for axis
# labels, titles, tick labels, legends), a name matplotlib scales from font.size ("x-small" 6.9,
# "small" 8.3, "medium" 10, "large" 12, "x-large" 14.4), or NOTE. On a phone a chart is drawn
# about 5 inches wide (util.record.PHONE_INCHES), where 1 pt is about 1 px.
STYLE = {
    "font.size": 10,            # text written on a chart or a diagram (ax.text), and "medium"
    "axes.labelsize": 12,
    "axes.titlesize": 12,
    "xtick.labelsize": 11,
    "ytick.labelsize": 11,
    "legend.fontsize": 11,
    "figure.titlesize": 14,
}
# The size of the tick labels and the legend, between the text and the axis labels (no name of
# matplotlib's gives it): a value or remark written beside a bar or an arrow, a diagram's box, and
# the titles and labels of figures packed with panels.
NOTE = STYLE["legend.fontsize"]
matplotlib.rcParams.update(STYLE)


def timeline(spans, title="", ax=None):
    """A per-rank Gantt chart of `span` records (Run.spans): one row per rank, one colour per label.

    Spans are in seconds from the demo's start, measured on each rank, so what overlapped on
    the machine overlaps in the picture."""
    import matplotlib.pyplot as plt
    from matplotlib.transforms import ScaledTranslation
    from util.record import HANGING
    if not spans:  # e.g. a demo skipped under torchrun: say so rather than fail
        fig, ax = plt.subplots(figsize=(6, 1))
        ax.text(0.5, 0.5, "no spans were recorded", ha="center", va="center")
        ax.set_axis_off()
        return fig
    ranks = sorted({s["rank"] for s in spans})
    labels = list(dict.fromkeys(s["label"] for s in spans))
    colours = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
    # Spans that share a rank and overlap in time (e.g. compute and an async all-reduce) get
    # their own lane so neither hides the other.
    lanes = {r: [] for r in ranks}
    placed = []
    for s in sorted(spans, key=lambda s: (s["rank"], s["start"])):
        rows = lanes[s["rank"]]
        for lane, end in enumerate(rows):
            if end <= s["start"]:
                rows[lane] = s["end"]
                break
        else:
            lane = len(rows)
            rows.append(s["end"])
        placed.append((s, lane))
    fig = ax.figure if ax else plt.figure(figsize=(9, 0.6 + 0.55 * sum(max(1, len(v)) for v in lanes.values())))
    ax = ax or fig.add_subplot()
    base, ticks = {}, []
    y = 0
    for r in reversed(ranks):
        base[r] = y
        ticks.append((y + (max(1, len(lanes[r])) - 1) / 2, f"rank {r}"))
        y += max(1, len(lanes[r])) + 0.4
    scale, unit = (1e3, "ms") if max((s["end"] for s in spans), default=0) < 1 else (1, "s")
    for s, lane in placed:
        ax.barh(base[s["rank"]] + lane, (s["end"] - s["start"]) * scale, left=s["start"] * scale,
                height=0.8, color=colours[s["label"]], edgecolor="black", linewidth=0.3)
    ax.set_yticks([t for t, _ in ticks], [name for _, name in ticks])
    ax.set_xlabel(f"time since the demo started ({unit})")
    # under the x label at a fixed distance in inches, whatever the axes' height (a fraction of
    # it left a wide gap on a phone's taller drawing); on a phone: one entry per line
    under = ax.transAxes + ScaledTranslation(0, -0.62, fig.dpi_scale_trans)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[l]) for l in labels], labels=labels,
              loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=under, ncol=min(5, len(labels)),
              frameon=False).set_gid(HANGING)
    if title:
        ax.set_title(title)
    return fig


def progress(iterable, desc="", total=None):
    """A progress bar on a terminal (the lecture process or rank 0 only): never on the page, and
    never in a log file or pipe, where its carriage returns would be garbage."""
    from tqdm import tqdm
    from util.record import current
    rank = current().rank
    return tqdm(iterable, desc=desc, total=total, file=sys.__stderr__, leave=False,
                disable=bool(rank) or not sys.__stderr__.isatty(),
                mininterval=0.5, dynamic_ncols=True)


def kb_bars(ax, labels, nbytes, colours, xmax, fontsize="large"):
    """Horizontal bars of byte counts in kB, top to bottom in the given order, each labelled with
    its value; the x axis runs to 1.3 × `xmax` bytes so the labels fit."""
    bars = ax.barh(range(len(nbytes)), [b / 1e3 for b in nbytes], color=colours)
    ax.bar_label(bars, labels=[f"{b / 1e3:.0f} kB" for b in nbytes], padding=3, fontsize=fontsize)
    ax.set_yticks(range(len(nbytes)), labels, fontsize=fontsize)
    ax.invert_yaxis()
    ax.set_xlim(0, xmax / 1e3 * 1.3)
    return bars
