"""Lecture 07's figures: the drawings of its page (the mesh and each axis' groups, the layouts'
agreement with one process, memory at scale, predicted against measured step times, bytes on the
wire against the prediction, the search space here and at 512 GPUs, the decision flow and MFU).
Each helper returns a matplotlib figure."""
import math

from lectures.layout.estimator import estimate_memory
from lectures.layout.mesh import MESH_AXES, axis_groups, mesh_coords, replica_groups
from lectures.layout.step_time import H100_MEMORY, step_time
from util import figure, plural
from util.figures import NOTE


def draw_mesh(shape, highlight=0):
    """A picture of the mesh: one box per global rank, laid out as tp × cp columns and
    dp × pp rows, with the groups of rank `highlight` outlined."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    dp, pp, cp, tp = shape
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * cp * tp + 3.4), 0.75 * dp * pp + 1.4))
    colours = {"dp": "#4c72b0", "pp": "#dd8452", "cp": "#55a868", "tp": "#c44e52"}
    here = mesh_coords(highlight, shape)
    for rank in range(math.prod(shape)):
        c = mesh_coords(rank, shape)
        x, y = c["cp"] * tp + c["tp"], c["dp"] * pp + c["pp"]
        inside = [a for a in MESH_AXES if all(c[b] == here[b] for b in MESH_AXES if b != a)]
        face = "#fff3c4" if rank == highlight else "white"
        ax.add_patch(Rectangle((x + 0.05, -y - 0.95), 0.9, 0.9, facecolor=face, edgecolor="black", lw=0.8))
        ax.text(x + 0.5, -y - 0.42, f"{rank}", ha="center", va="center", fontsize=NOTE, weight="bold")
        ax.text(x + 0.5, -y - 0.78, f"d{c['dp']} p{c['pp']} c{c['cp']} t{c['tp']}",
                ha="center", va="center", fontsize="small")
        for j, axis in enumerate(a for a in MESH_AXES if a in inside and shape[MESH_AXES.index(a)] > 1):
            ax.add_patch(Rectangle((x + 0.05 + 0.04 * j, -y - 0.95 + 0.04 * j), 0.9 - 0.08 * j,
                                   0.9 - 0.08 * j, fill=False, edgecolor=colours[axis], lw=2))
    for j, axis in enumerate(MESH_AXES):
        ax.plot([], [], color=colours[axis], lw=2,
                label=f"{axis} group of rank {highlight} (size {shape[j]})")
    ax.set_xlim(-0.1, cp * tp + 0.1)
    ax.set_ylim(-dp * pp - 0.1, 0.1)
    ax.set_xticks([i + 0.5 for i in range(cp * tp)], [f"c{i // tp} t{i % tp}" for i in range(cp * tp)])
    ax.set_yticks([-i - 0.5 for i in range(dp * pp)], [f"d{i // pp} p{i % pp}" for i in range(dp * pp)])
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="medium", frameon=False)
    ax.set_title(f"mesh dp={dp} × pp={pp} × cp={cp} × tp={tp}", fontsize=NOTE)
    fig.tight_layout()
    return fig


def _passes_through(a, b, points):
    """Whether the segment a–b runs through any of `points` other than its ends."""
    (x0, y0), (x1, y1) = a, b
    for x, y in points:
        if (x, y) in (a, b):
            continue
        on_line = abs((x1 - x0) * (y - y0) - (y1 - y0) * (x - x0)) < 1e-9
        if on_line and min(x0, x1) <= x <= max(x0, x1) and min(y0, y1) <= y <= max(y0, y1):
            return True
    return False


def draw_axis_groups(shape):
    """One small panel per axis: the mesh's ranks, each group of that axis in its own colour
    and joined by lines, bowed around any rank they would pass through (from `axis_groups`,
    the lists make_mesh builds)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch
    dp, pp, cp, tp = shape
    axes_shown = [a for a in MESH_AXES if shape[MESH_AXES.index(a)] > 1] + ["replica"]
    fig, axs = plt.subplots(1, len(axes_shown), figsize=(2.3 * len(axes_shown) + 0.4, 0.7 * dp * pp + 1.6))
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]
    where = lambda r: (mesh_coords(r, shape)["cp"] * tp + mesh_coords(r, shape)["tp"],
                       -(mesh_coords(r, shape)["dp"] * pp + mesh_coords(r, shape)["pp"]))
    everyone = [where(r) for r in range(math.prod(shape))]
    for ax, axis in zip(axs, axes_shown):
        groups = replica_groups(shape) if axis == "replica" else axis_groups(shape, axis)
        columns = {}   # groups started so far in each column
        for g, members in enumerate(groups):
            colour = palette[g % len(palette)]
            xy = [where(r) for r in members]
            side = columns.setdefault(xy[0][0], 0)
            columns[xy[0][0]] += 1
            for a, b in zip(xy, xy[1:]):
                # a straight line, unless another rank sits on it: then an arc that bows around
                # that rank, the groups that start in the same column bowing to alternate sides
                bend = (0.35 if side % 2 == 0 else -0.35) if _passes_through(a, b, everyone) else 0
                ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-", color=colour, lw=3,
                                             alpha=0.5, zorder=1, connectionstyle=f"arc3,rad={bend}"))
            for r, (x, y) in zip(members, xy):
                ax.scatter([x], [y], s=420, color=colour, zorder=2)
                ax.text(x, y, str(r), ha="center", va="center", color="white", weight="bold", zorder=3)
        title = ("replicas (dp·cp):\nZeRO and the gradient sync" if axis == "replica"
                 else f"{axis}: {len(groups)} group{'s' if len(groups) > 1 else ''} of {len(groups[0])} rank{'s' if len(groups[0]) > 1 else ''}")
        ax.set_title(title, fontsize="medium")
        ax.set_xlim(-0.6, cp * tp - 0.4)
        ax.set_ylim(-dp * pp + 0.4, 0.6)
        ax.set_xticks([])
        ax.set_yticks([])
        for side in ax.spines.values():
            side.set_color("0.85")
    fig.tight_layout()
    return fig


def draw_layout_agreement(ref, runs, rows):
    """Top: the one-process loss curve and every layout's losses as markers on it; bottom: each
    layout's largest loss and parameter difference from one process (log scale, a dot plot)."""
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(2, 1, figsize=(7.5, 0.34 * len(runs) + 4.6),
                                      gridspec_kw={"height_ratios": [2.6, 0.34 * len(runs) + 0.8]})
    steps = range(1, len(ref["losses"]) + 1)
    left.plot(steps, ref["losses"], color="black", lw=2, label="one process")
    for k, (name, lay, got) in enumerate(runs):
        left.scatter(steps, got[0]["losses"], s=18, marker="o", facecolor="none",
                     edgecolor="#4c72b0", label="each layout" if k == 0 else None)
    left.set_xlabel("step", fontsize="medium")
    left.set_ylabel("training loss (whole global batch)", fontsize="medium")
    left.set_xticks(list(steps))
    left.legend(fontsize="small")
    names = [f"{r[0]} ({r[2]} ranks)" for r in rows]
    y = range(len(rows))
    tiny = 1e-12                                      # an exact match still gets a dot
    right.scatter([max(r[4], tiny) for r in rows], y, color="#dd8452", label="max |Δ loss|", zorder=3)
    right.scatter([max(r[5], tiny) for r in rows], y, color="#4c72b0", marker="s", label="max |Δ parameter|", zorder=3)
    right.axvline(1e-4, color="#c44e52", ls="--", lw=1, label="limit 1e-4")
    right.set_xscale("log")
    right.set_yticks(list(y), names, fontsize="medium")
    right.invert_yaxis()
    right.grid(axis="x", color="0.9")
    right.set_xlabel("difference from one process", fontsize="medium")
    right.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def draw_memory_bars(model, lays):
    """Stacked bars of the estimator's parts, on a linear axis (the heights add up), cut at
    2.5 × the H100's memory with the total written on any bar that runs past it."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8.5, 4.4))
    colours = {"weights": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868",
               "gathered": "#8172b3", "activations": "#c44e52"}
    top = 2.5 * H100_MEMORY / 2 ** 30
    for i, (label, lay) in enumerate(lays):
        est = estimate_memory(model, lay)
        bottom = 0
        for k, c in colours.items():
            ax.bar(i, est[k] / 2 ** 30, bottom=bottom, color=c, label=k if i == 0 else None)
            bottom += est[k] / 2 ** 30
        if bottom > top:    # inside the cut bar, on two lines: as narrow as a bar on a phone
            ax.text(i, top * 0.97, f"{bottom:,.0f}\nGiB ↑", ha="center", va="top", fontsize="small",
                    weight="bold", color="white")
        else:
            ax.text(i, bottom + 2, f"{bottom:.0f} GiB", ha="center", va="bottom", fontsize="small")
    ax.axhline(H100_MEMORY / 2 ** 30, color="black", ls="--", lw=1, label=f"H100: {H100_MEMORY / 2 ** 30:.0f} GiB")
    ax.set_ylim(0, top)
    ax.set_xticks(range(len(lays)), [l for l, _ in lays], fontsize="small", rotation=20, ha="right")
    ax.set_ylabel("GiB per GPU", fontsize="medium")
    # one column at the upper right, over the short bars of the splits that fit: a wider one
    # covers the cut bars' totals on a phone's narrower drawing
    ax.legend(fontsize="small", loc="upper right")
    ax.set_title(f"{model.name} on 64 GPUs, micro-batch 1", fontsize="medium")
    fig.tight_layout()
    return fig


AXIS_COLOURS = {"dp": "#4c72b0", "pp": "#dd8452", "cp": "#55a868", "tp": "#c44e52", "one rank": "#8172b3"}


def draw_predicted_vs_measured(layouts, pred, times, rho, ranks):
    """Predicted vs measured, one numbered point per layout (the table's # column), coloured by
    the axis it splits; a shared log scale on both axes and the line measured = predicted."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    seen = set()
    vals = [x * 1e3 for x in pred] + [t.median * 1e3 for t in times]
    lo, hi = min(vals) * 0.7, max(vals) * 1.4
    frac = lambda v: (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo))   # axis fraction
    placed = []                                  # label positions already used, in axis fractions
    for i, (l, p, t) in enumerate(zip(layouts, pred, times), 1):
        axis = next((a for a in MESH_AXES if getattr(l, a) > 1), "one rank")
        ax.errorbar([p * 1e3], [t.median * 1e3], yerr=[[(t.median - t.q1) * 1e3], [(t.q3 - t.median) * 1e3]],
                    fmt="o", ms=6, capsize=2, color=AXIS_COLOURS[axis],
                    label=None if axis in seen else f"splits {axis}")
        seen.add(axis)
        fx, fy = frac(p * 1e3), frac(t.median * 1e3)
        k = 0                                    # move a label up, one line at a time, until it is free
        while any(abs(fx - x) < 0.045 and abs(fy + 0.04 * k - y) < 0.035 for x, y in placed) and k < 12:
            k += 1
        placed.append((fx, fy + 0.04 * k))
        ax.annotate(str(i), (p * 1e3, t.median * 1e3), xytext=(5, 3 + 13 * k), textcoords="offset points",
                    arrowprops=dict(arrowstyle="-", color="0.6", lw=0.5) if k else None)
    ax.plot([lo, hi], [lo, hi], color="0.6", ls="--", lw=1, label="measured = predicted")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "125" else "")
    for axis in (ax.xaxis, ax.yaxis):             # "200", not "2×10²"; minor ticks at 2 and 5 only
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain)
    ax.set_xlabel("predicted step time (ms)", fontsize=NOTE)
    ax.set_ylabel("measured step time (ms)", fontsize=NOTE)
    ax.tick_params(which="both", labelsize="small")
    ax.legend(fontsize="medium", loc="lower right")   # the points sit above the diagonal
    ax.set_title(f"{len(layouts)} layouts on {ranks} ranks: Spearman ρ = {rho:.2f}", fontsize=NOTE)
    fig.tight_layout()
    return fig


def draw_wire_ratios(ratios):
    """Measured over predicted bytes per rank and step, one bar per (layout and stage, layout,
    ratio) of `ratios`; the line at 1 is the payload exactly."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 0.34 * len(ratios) + 1.4))
    names = [f"{n} ({l.world} ranks)" for n, l, _ in ratios]
    ax.barh(range(len(ratios)), [r for _, _, r in ratios], color="#4c72b0")
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(range(len(ratios)), names, fontsize="medium")
    ax.invert_yaxis()
    ax.set_xlim(0, max(1.5, max(r for _, _, r in ratios) * 1.1))
    ax.set_xlabel("measured / predicted bytes (1 = the payload exactly)", fontsize="medium")
    fig.tight_layout()
    return fig


def search_space_picture(rows):
    """Configurations per rank count (log scale), each bar labelled with its number of meshes."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.2, 2.6))
    worlds, meshes, configs = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    bars = ax.bar([str(w) for w in worlds], configs, color="#4c72b0")
    for bar, m, c in zip(bars, meshes, configs):
        ax.annotate(f"{c} ({plural(m, 'mesh', 'meshes')})", (bar.get_x() + bar.get_width() / 2, c),
                    ha="center", va="bottom", xytext=(0, 2), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_ylim(1, max(configs) * 4)
    ax.set_xlabel("ranks", fontsize="medium")
    ax.set_ylabel("valid configurations", fontsize="medium")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    figure(fig, caption="How many valid configurations this GPT has at each rank count (log scale), "
                        "and on how many meshes dp×pp×cp×tp; counted by `valid_layouts`.")


DECISION_STEPS = [("fits with data parallelism alone\n(ZeRO-0, 1 or 2) on every rank?", "DP", "data parallelism"),
                  ("fits with ZeRO-3 (FSDP)\non every rank?", "ZeRO-3", "ZeRO-3 (FSDP)"),
                  ("fits with TP = 2, 4 or 8 (+ SP)\nwithin a node?", "TP", "tensor parallelism"),
                  ("fits with the node's TP\nand PP across nodes?", "PP", "pipeline across nodes")]


def draw_search_at_scale(models, searched, rule_of, hw, world=512):
    """Every configuration the search predicted for each of `models` at `world` GPUs, one
    panel each: GiB per GPU against seconds per step, grey where it exceeds the memory cap
    (dashed line), the fastest that fits starred and the decision procedure's pick ringed."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(models), figsize=(10, 4.2), sharey=True, dpi=200)
    for ax, model in zip(axes, models):
        found, rule = searched[model.name, world], rule_of[model.name, world]
        fitting = [r for r in found if r["fits"]]
        xs = [r["memory"]["total"] / 2 ** 30 for r in found]
        ys = [r["time"]["total"] for r in found]
        # thousands of dots: drawn as one embedded image (the axes, labels and marks stay vector),
        # which keeps the page's SVG small and quick to draw
        ax.scatter(xs, ys, s=3, c=["#4c72b0" if r["fits"] else "#c0c0c0" for r in found], rasterized=True)
        if fitting:
            best = fitting[0]["layout"].label().rsplit(" mb", 1)[0]
            ax.scatter([fitting[0]["memory"]["total"] / 2 ** 30], [fitting[0]["time"]["total"]],
                       marker="*", s=150, color="#c44e52", label=f"fastest that fits:\n{best}")
        if rule is not None:
            ax.scatter([estimate_memory(model, rule)["total"] / 2 ** 30], [step_time(model, rule, hw)["total"]],
                       marker="D", s=110, facecolors="none", edgecolors="#55a868", linewidths=2,
                       zorder=3, label="decision procedure")
        ax.axvline(hw.memory / 2 ** 30, color="black", ls="--", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("predicted GiB per GPU")
        ax.set_ylabel("predicted s per step")
        ax.set_title(f"{model.name}, {world} GPUs: {len(found)} configurations", fontsize="medium")
        ax.legend(fontsize="small", loc="upper left")
    return fig


def decision_step(reasons):
    """Which of DECISION_STEPS a decision_procedure answer stopped at (or None)."""
    for i, (_, _, words) in reversed(list(enumerate(DECISION_STEPS))):
        if any(words in r for r in reasons):
            return i
    return None


def draw_decision_flow(outcomes):
    """The decision procedure as a flowchart, top to bottom; `outcomes` = [(label, reasons)]
    from real calls, each written beside the step where it stopped."""
    import matplotlib.pyplot as plt
    n = len(DECISION_STEPS)
    fig, ax = plt.subplots(figsize=(6.2, 1.5 * n + 1.0))
    box = dict(boxstyle="round,pad=0.4", linewidth=1)
    ends = {i: [] for i in range(n)}
    recompute = []
    for label, reasons in outcomes:
        step = decision_step(reasons)
        if step is not None:
            ends[step].append(label)
        if any("recomputation" in r for r in reasons):
            recompute.append(label)
    for i, (question, short, _) in enumerate(DECISION_STEPS):
        y = -1.4 * i - 0.6
        ax.text(0.3, y, question, ha="center", va="center", fontsize=NOTE,
                bbox={**box, "facecolor": "#eef3fb", "edgecolor": "#4c72b0"})
        ax.annotate("", xy=(0.645, y), xytext=(0.575, y), arrowprops=dict(arrowstyle="->", lw=1.2))
        ax.text(0.61, y + 0.12, "yes", ha="center")
        chosen = ends[i]
        ax.text(0.66, y, short + ("\n" + "\n".join(chosen) if chosen else ""), ha="left", va="center",
                fontsize=NOTE, bbox={**box, "facecolor": "#fff3c4" if chosen else "#f4f4f4",
                                    "edgecolor": "#dd8452" if chosen else "0.7"})
        if i < n - 1:
            ax.annotate("", xy=(0.3, y - 0.95), xytext=(0.3, y - 0.45), arrowprops=dict(arrowstyle="->", lw=1.2))
            ax.text(0.32, y - 0.7, "no" + ("; sequence ≥ 32K tokens? then cp = 2 from here on" if i == 0 else ""),
                    style="normal" if i else "italic")
    y = -1.4 * n - 0.3
    ax.annotate("", xy=(0.3, y + 0.3), xytext=(0.3, y + 0.8), arrowprops=dict(arrowstyle="->", lw=1.2))
    ax.text(0.32, y + 0.5, "no")
    ax.text(0.3, y, "no: turn on full recomputation\nand ask again from ZeRO-3"
            + (f"\n(taken by {', '.join(recompute)})" if recompute else ""), ha="center", va="center",
            fontsize=NOTE, bbox={**box, "facecolor": "#fbeeee", "edgecolor": "#c44e52"})
    ax.set_xlim(0, 1)
    ax.set_ylim(y - 0.6, -0.05)
    ax.axis("off")
    fig.tight_layout()
    return fig


def mfu_picture(here, t4):
    """MFU side by side: Llama 3 405B's Table 4 rows as Meta measured them (published, not
    measured here) and as this lecture's model predicts them, and this CPU's measured MFU."""
    import matplotlib.pyplot as plt
    labels, published_mfu, predicted = [], [], []
    for row, best, _ in (t4 or {}).get("rows", []):
        labels.append(f"Llama 3 405B\n{row['gpus']:,} GPUs, {row['seq'] // 1024}K")
        published_mfu.append(100 * row["mfu"])
        predicted.append(100 * best["mfu"] if best else 0)
    fig, ax = plt.subplots(figsize=(6.8, 0.75 * (len(labels) + 1) + 0.9))
    y = list(range(len(labels)))
    ax.barh([i + 0.2 for i in y], published_mfu, height=0.38, color="white", edgecolor="#8a6d0b",
            hatch="//", label="published (Meta, Table 4): not measured here")
    ax.barh([i - 0.2 for i in y], predicted, height=0.38, color="#4c72b0", label="predicted by this lecture's model")
    if here is not None:
        y.append(len(labels))
        labels.append("this CPU, fastest\nlayout measured")
        ax.barh([len(labels) - 1], [100 * here], height=0.38, color="#dd8452", label="measured by this build")
    for bars in ax.containers:
        ax.bar_label(bars, fmt="%.1f%%", fontsize="small", padding=2)
    ax.set_yticks(range(len(labels)), labels, fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("MFU (%)", fontsize="medium")
    ax.set_xlim(0, 100)
    ax.legend(fontsize="small", loc="lower right", frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    figure(fig, caption="Model FLOPs utilisation: Meta's measured Table 4 rows beside this model's "
                        "predictions (the first row fitted, the others predicted), and this machine's own. "
                        "Published, not measured here (hatched): Llama 3 405B on 8,192 and 16,384 H100s. Source: "
                        "[Llama Team 2024, The Llama 3 Herd of Models](https://arxiv.org/abs/2407.21783), Table 4.")
