"""Lectures 02 and 03's figures: the drawings of their pages. Lecture 02: the hardware hierarchy,
each collective's tensors before and after, the ring step by step, bus bandwidth, bytes on the
wire, the α–β fit and a hang. Lecture 03: DDP's steps, the sampler's shards and what each ZeRO
stage holds. Each helper takes what a demo measured and returns a matplotlib figure."""
import math

import numpy as np

from lectures.data_parallel.collectives import bus_bandwidth_factor, crossover_bytes, optimal_bytes
from lectures.data_parallel.overlap import times_faster
from util import plural
from util.figures import NOTE, kb_bars
from util.measure import Timing, errorbar, spreads_overlap

KB, MB = 1024, 1024 ** 2


def human_bytes(n):
    """4096 -> '4 KB', 1000 -> '1000 B', 1023 KB -> '1023 KB' (binary units, no exponents)."""
    for unit, size in (("TB", 1024 ** 4), ("GB", 1024 ** 3), ("MB", MB), ("KB", KB), ("B", 1)):
        if abs(n) >= size or unit == "B":
            value = n / size
            text = f"{value:.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.3g}"
            return f"{text} {unit}"


H100_LEVELS = [  # level, bandwidth in GB/s per direction (published; sources in the table below)
    ("HBM3", 3350), ("NVLink 4\n(GPU↔GPU)", 450), ("PCIe Gen5 x16\n(GPU↔CPU)", 64), ("InfiniBand NDR\n(node↔node)", 50)]


def draw_hierarchy(copy_gbs):
    """Published H100 bandwidths per level (bars, log scale) beside this machine's measured copy."""
    import matplotlib.pyplot as plt
    names = [n for n, _ in H100_LEVELS] + ["this machine, measured:\nmemory copy"]
    values = [v for _, v in H100_LEVELS] + [copy_gbs]
    fig, ax = plt.subplots(figsize=(6.2, 3.4))
    bars = ax.barh(range(len(names)), values, color=["#4c72b0"] * len(H100_LEVELS) + ["#dd8452"])
    for bar, v in zip(bars, values):
        ax.text(v * 1.1, bar.get_y() + bar.get_height() / 2,
                f"{v:,.0f} GB/s" if v >= 100 else f"{v:.3g} GB/s", va="center", fontsize="large")
    ax.set_xscale("log")
    ax.set_xlim(min(values) / 3, max(values) * 12)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s per direction (log scale)")
    # No legend: on a phone it covered the short bars' values. The colours are said by the
    # labels (the measured bar is "this machine") and by the caption.
    return fig


def draw_stages(name, panels, stacked=False):
    """One panel per stage (title, one tensor per rank, which results are sums: "none", "all"
    or "dst"), one row per rank. Cells are coloured by the rank whose value they hold in the
    first panel; sums are grey and bold; a reduce's non-destination buffers are hatched.
    `stacked` puts the panels one under the other (for wide tensors, readable on a phone)."""
    import matplotlib.pyplot as plt
    world_size = len(panels[0][1])
    origin = {}
    for r, t in enumerate(panels[0][1]):
        for v in (t.tolist() if t is not None else []):
            origin.setdefault(v, r)
    widths = [max((len(t) for t in data if t is not None), default=1) for _, data, _ in panels]
    if stacked:
        widths = [max(widths)] * len(panels)
        fig, axes = plt.subplots(len(panels), 1, figsize=(1.6 + 0.8 * widths[0],
                                                          len(panels) * (0.5 * world_size + 0.7)))
    else:
        fig, axes = plt.subplots(1, len(panels), figsize=(1.6 + 0.95 * sum(widths) + 0.5 * len(panels),
                                                          0.55 * world_size + 1.0),
                                 gridspec_kw={"width_ratios": widths})
    axes = np.atleast_1d(axes)
    # stacked figures are shrunk most on a phone: their text is larger
    cells, titles, heading = ("large", "x-large", "x-large") if stacked else ("small", "medium", NOTE)
    for k, (ax, (side, data, sums), width) in enumerate(zip(axes, panels, widths)):
        _draw_panel(ax, side, data, sums, width, origin, cells, titles, ranks=k == 0 or stacked)
    fig.suptitle(name, fontweight="bold", fontsize=heading)
    fig.tight_layout()
    return fig


def _draw_panel(ax, side, data, sums, width, origin, fontsize, title_size, ranks=True):
    """One stage of a collective on `ax`: a row of cells per rank (see `draw_stages`); `fontsize`
    is the cells' and the ranks' size."""
    import matplotlib.pyplot as plt
    world_size = len(data)
    colours = plt.cm.Pastel1
    for r, t in enumerate(data):
        y = world_size - 1 - r
        values = t.tolist() if t is not None else []
        if not values:
            ax.text(0.05, y + 0.4, "(nothing)", va="center", fontsize=fontsize, color="0.5")
        for i, v in enumerate(values):
            kind = "moved"
            if sums == "all" or (sums == "dst" and r == 0):
                kind = "sum"
            elif sums == "dst":
                kind = "scratch"
            elif sums in ("mine", "gathered"):
                kind = "owned"      # a finished sum, in the colour of the rank that owns it
            owner = r if sums == "mine" else i * world_size // len(values)
            face = {"moved": colours(origin.get(v, 8) % 9), "sum": "0.82", "scratch": "white",
                    "owned": colours(owner % 9)}[kind]
            ax.add_patch(plt.Rectangle((i, y), 0.95, 0.8, facecolor=face, edgecolor="0.3",
                                       hatch="///" if kind == "scratch" else None,
                                       linewidth=1.6 if kind == "owned" else 0.6))
            ax.text(i + 0.475, y + 0.4, f"{v:g}", ha="center", va="center", fontsize=fontsize,
                    color="0.45" if kind == "scratch" else "black",
                    fontweight="bold" if kind in ("sum", "owned") else "normal")
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(-0.2, world_size)
    ax.set_yticks([world_size - 1 - r + 0.4 for r in range(world_size)],
                  [f"rank {r}" for r in range(world_size)] if ranks else [],
                  fontsize=fontsize)
    ax.tick_params(length=0)
    ax.set_xticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_title(side, fontsize=title_size)


def draw_gallery(results, columns=2):
    """Every collective in one figure: `results` maps a name to (before, after, sums), drawn as
    two small panels (before | after) per collective, `columns` collectives side by side."""
    import matplotlib.pyplot as plt
    names = list(results)
    world_size = len(next(iter(results.values()))[0])
    width = max(max((len(t) for t in data if t is not None), default=1)
                for before, after, _ in results.values() for data in (before, after))
    rows = math.ceil(len(names) / columns)
    fig = plt.figure(figsize=(columns * (0.62 * 2 * width + 1.5), rows * (0.5 * world_size + 0.95)))
    outer = fig.add_gridspec(rows, columns, hspace=0.75, wspace=0.15)
    for i, name in enumerate(names):
        before, after, sums = results[name]
        origin = {}
        for r, t in enumerate(before):
            for v in (t.tolist() if t is not None else []):
                origin.setdefault(v, r)
        inner = outer[i // columns, i % columns].subgridspec(1, 2, wspace=0.08)
        for k, (side, data, kind) in enumerate((("before", before, "none"), ("after", after, sums))):
            ax = fig.add_subplot(inner[0, k])
            _draw_panel(ax, side, data, kind, width, origin, "large", NOTE, ranks=k == 0 and i % columns == 0)
            if k == 0:
                ax.text(1.04, 1.32, name, transform=ax.transAxes, ha="center", va="bottom",
                        fontsize="x-large", fontweight="bold")
    return fig


def draw_ring_trace(traces):
    """One panel per step: rows are ranks, columns chunks; the chunk just received is outlined.
    The start and the reduce-scatter steps on the first row, the all-gather steps below."""
    import matplotlib.pyplot as plt
    world_size, n_steps = len(traces), len(traces[0])
    cols = max(1, (n_steps + 1) // 2)
    fig, axes = plt.subplots(2, cols, figsize=(1.0 + 1.9 * cols, 2 * (0.5 * world_size + 1.2)),
                             squeeze=False)
    places = [(0, k) for k in range(cols)] + [(1, k) for k in range(1, cols)]
    full = 2 ** world_size - 1
    for ax in axes.flat:
        ax.set_axis_off()
    for k, (row, col) in enumerate(places[:n_steps]):
        ax = axes[row][col]
        ax.set_axis_on()
        phase, step, _, _ = traces[0][k]
        for r in range(world_size):
            _, _, got, values = traces[r][k]
            for c, v in enumerate(values.tolist()):
                share = bin(int(v)).count("1") / world_size     # fraction of ranks summed in
                ax.add_patch(plt.Rectangle((c, world_size - 1 - r), 0.95, 0.9,
                                           facecolor=plt.cm.Blues(0.15 + 0.75 * share),
                                           edgecolor="red" if c == got else "0.4",
                                           linewidth=2.0 if c == got else 0.5))
                ax.text(c + 0.475, world_size - 1 - r + 0.45, f"{int(v)}", ha="center",
                        va="center", fontsize="small", color="white" if share > 0.6 else "black",
                        fontweight="bold" if v == full else "normal")
        ax.set_xlim(0, world_size)
        ax.set_ylim(0, world_size)
        ax.set_xticks([c + 0.475 for c in range(world_size)], [f"c{c}" for c in range(world_size)],
                      fontsize="small")
        ax.set_yticks([world_size - 1 - r + 0.45 for r in range(world_size)],
                      [f"rank {r}" for r in range(world_size)] if col in (0, 1) and (row, col) != (0, 1)
                      else [], fontsize="small")
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title("start" if phase == "start" else f"{phase}\nstep {step}", fontsize="small")
    fig.tight_layout()
    return fig


def draw_ring_arrows(traces):
    """The ring's messages, one small panel per step (reduce-scatter above, all-gather below):
    ranks on a circle, an arrow from each rank to its right neighbour labelled with the chunk
    it sent and that chunk's value when it left (read from the recorded trace: what rank r+1
    received in step k is chunk i, and rank r held value v in chunk i after step k-1)."""
    import matplotlib.pyplot as plt
    n = len(traces)
    steps = max(1, n - 1)
    fig, axes = plt.subplots(2, steps, figsize=(max(4.5, 2.7 * steps), 5.6), squeeze=False)
    angle = [np.pi / 2 - 2 * np.pi * r / n for r in range(n)]
    pos = [(np.cos(a), np.sin(a)) for a in angle]
    for row, phase in enumerate(("reduce-scatter", "all-gather")):
        for col in range(steps):
            ax = axes[row][col]
            ax.set_xlim(-1.6, 1.6)
            ax.set_ylim(-1.6, 1.6)
            ax.set_aspect("equal")
            ax.set_axis_off()
            k = 1 + row * (n - 1) + col                # index in the trace (0 is the start)
            if n == 1 or k >= len(traces[0]):
                continue
            ax.set_title(f"{phase}, step {col + 1}", fontsize=NOTE)
            for r in range(n):
                right = (r + 1) % n
                chunk = traces[right][k][2]
                value = traces[r][k - 1][3][chunk].item()
                (x0, y0), (x1, y1) = pos[r], pos[right]
                ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                            arrowprops=dict(arrowstyle="-|>", color=plt.cm.tab10(chunk % 10), lw=1.8,
                                            shrinkA=13, shrinkB=13, connectionstyle="arc3,rad=-0.25"))
                mx, my = (x0 + x1) / 2, (y0 + y1) / 2
                norm = max(1e-9, np.hypot(mx, my))
                lx, ly = (mx / norm * 1.2, my / norm * 1.2) if n > 2 else (mx + (0.55 if r else -0.55), my)
                ax.text(lx, ly, f"c{chunk}={value:g}", ha="center", va="center", fontsize=NOTE,
                        color=plt.cm.tab10(chunk % 10), fontweight="bold")
            for r, (x, y) in enumerate(pos):
                ax.add_patch(plt.Circle((x, y), 0.27, facecolor="white", edgecolor="0.3", lw=1))
                ax.text(x, y, f"r{r}", ha="center", va="center", fontsize=NOTE)
    fig.tight_layout()
    return fig


def draw_busbw(names, sizes, timings, ranks):
    """Bus bandwidth against message size, one curve per collective, with the IQR as error bars.
    `sizes` is one list per collective (all-reduce has more points: the α–β fit's)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, these, ts in zip(names, sizes, timings):
        factor = bus_bandwidth_factor(name, ranks)
        # busbw = S·f/t, so a time's IQR maps to a bandwidth range (slow time = low bandwidth)
        bus = [Timing([nbytes * factor / s / 1e9 for s in t.samples]) for nbytes, t in zip(these, ts)]
        errorbar(ax, these, bus, scale=1, marker="o", label=name.replace("_", "-"))
    ticks = min(sizes, key=len)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [human_bytes(s) for s in ticks], rotation=45)
    ax.set_xlabel("message size S")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"busbw vs size, {ranks} ranks")
    return fig


def draw_wire(wire, nbytes, n):
    """Bytes per rank for one call of each collective: bandwidth-optimal vs measured."""
    import matplotlib.pyplot as plt
    names = list(wire)
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    y = np.arange(len(names))
    ax.barh(y, [wire[k] / MB for k in names], 0.6, color="#4c72b0", label="written by gloo (measured)")
    ax.barh(y, [optimal_bytes(k, nbytes, n) / MB for k in names], 0.6, fill=False,
            edgecolor="black", lw=1.5, label="bandwidth-optimal (NCCL's ring)")
    for i, k in enumerate(names):
        ax.text(wire[k] / MB, i, f" {wire[k] / optimal_bytes(k, nbytes, n):.2f}×", va="center",
                fontsize="large")
    ax.set_yticks(y, [k.replace("_", "-") for k in names])
    ax.invert_yaxis()
    ax.set_xlim(0, max(wire.values()) / MB * 1.25)
    ax.set_xlabel(f"MB sent per rank, S = {human_bytes(nbytes)}, {n} ranks")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def draw_alpha_beta(sizes, timings, alpha, beta, regimes=None):
    """Measured all-reduce times (median and IQR) on log axes, the fitted line, and S* = αβ;
    with `regimes` = (α of the small sizes, α and β of the large ones), those two fits too."""
    import matplotlib.pyplot as plt
    cross = crossover_bytes(alpha, beta)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    errorbar(ax, sizes, timings, scale=1e6, fmt="o", label="measured: median and IQR (slowest rank)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    grid = np.geomspace(sizes[0], sizes[-1], 200)
    ax.plot(grid, (alpha + grid / beta) * 1e6, "-",
            label=f"fit: α = {alpha * 1e6:.0f} µs, β = {beta / 1e9:.2f} GB/s")
    ax.axhline(alpha * 1e6, color="0.6", ls=":", lw=1)
    if regimes:
        small_alpha, large_alpha, large_beta = regimes
        ax.axhline(small_alpha * 1e6, color="tab:green", ls="--", lw=1.2,
                   label=f"small sizes alone: α = {small_alpha * 1e6:.0f} µs")
        ax.plot(grid, (large_alpha + grid / large_beta) * 1e6, "--", color="tab:purple", lw=1.2,
                label=f"large sizes alone: β = {large_beta / 1e9:.2f} GB/s")
    if sizes[0] <= cross <= sizes[-1]:           # S* only where it was measured, never extrapolated
        ax.axvline(cross, color="red", ls="--", lw=1, label=f"S* = αβ = {human_bytes(cross)}")
    ax.set_xlabel("all-reduce message size (bytes)")
    ax.set_ylabel("time (µs)")
    ax.set_ylim(min(t.q1 for t in timings) * 1e6 / 2, max(t.q3 for t in timings) * 1e6 * 2)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return fig


def draw_hang(waited, world_size, timeout):
    """One bar per rank: how long it waited inside the all-reduce (from its own output)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 0.55 * world_size + 1.3))
    for rank in range(world_size):
        w = waited.get(rank)
        if w is None:
            ax.text(0.05, rank, "skipped the all-reduce, returned at once", va="center", fontsize="large",
                    color="#c44e52")
        else:
            ax.barh(rank, w, color="#8c8c8c", height=0.6)
            ax.text(w + 0.05, rank, f"waited {w:.1f} s", va="center", fontsize="large")
    ax.axvline(timeout, color="#c44e52", ls="--", lw=1.5)
    ax.text(timeout, -0.75, f"timeout {timeout} s", color="#c44e52", ha="center", fontsize="large")
    ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
    ax.set_ylim(world_size - 0.5, -1.1)
    ax.set_xlim(0, timeout * 1.6)
    ax.set_xlabel("seconds inside dist.all_reduce")
    return fig


def ddp_figure(ref, runs, apart):
    """Loss per step of one process and of each DDP run (which lie on top of each other), and the
    parameter checksums of two replicas started without the broadcast (which never meet)."""
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(7.5, 3.2))
    steps = range(1, len(ref["losses"]) + 1)
    left.plot(steps, ref["losses"], lw=6, alpha=0.3, color="k", label="one process")
    for (n, r), style in zip(runs.items(), ("o-", "s--", "^:")):
        left.plot(steps, r[0]["losses"], style, ms=5, label=plural(n, "rank"))
    left.set_xlabel("step")
    left.set_ylabel("loss")
    left.set_title("with the broadcast")
    left.legend(fontsize="medium", frameon=False)
    for r, (k, run) in enumerate(apart.items()):
        right.plot(steps, run["checksums"], "o-", ms=5, label=f"rank {k}")
    right.set_xlabel("step")
    right.set_ylabel("parameter checksum")
    right.set_title("without it: replicas never meet")
    right.legend(fontsize="medium", frameon=False)
    for ax in (left, right):
        ax.tick_params(labelsize="medium")
    fig.tight_layout()
    return fig


def sampler_figure(result, rows):
    """What each rank reads in each epoch (`result[drop_last][rank][epoch]`: its indices), one
    cell per index; an index drawn twice in an epoch is red, so padding shows at a glance."""
    import matplotlib.pyplot as plt
    n = len(result[False])
    fig, axes = plt.subplots(2, 2, figsize=(7.5, 1.2 + 0.95 * n), sharex=True)
    width = max(len(result[d][r][e]) for d in result for r in range(n) for e in range(2))
    for i, drop_last in enumerate((False, True)):
        for epoch in range(2):
            ax = axes[i, epoch]
            lists = [result[drop_last][r][epoch] for r in range(n)]
            seen = [x for l in lists for x in l]
            for r, l in enumerate(lists):
                for j, x in enumerate(l):
                    twice = seen.count(x) > 1
                    ax.add_patch(plt.Rectangle((j, n - 1 - r), 0.92, 0.85,
                                               color="#c44e52" if twice else "#4c72b0", alpha=0.85))
                    ax.text(j + 0.46, n - 1 - r + 0.42, str(x), ha="center", va="center", color="white",
                            fontsize=NOTE)
            ax.set_xlim(0, width)
            ax.set_ylim(0, n)
            ax.set_yticks([n - 1 - r + 0.42 for r in range(n)], [f"rank {r}" for r in range(n)])
            ax.set_xticks([])
            ax.set_title(f"{'drop_last' if drop_last else 'padding (default)'}, epoch {epoch}")
            for spine in ax.spines.values():
                spine.set_visible(False)
    fig.tight_layout()
    return fig


def draw_holdings(per_rank, stages):
    """What each rank holds under each stage, as a picture: one panel per stage, one row per
    rank, three blocks per row (parameters, gradients, optimizer state) as wide as their bytes
    under DP. A block is filled as far as the rank's measured bytes go, at the rank's own slot
    when it holds a shard (1/N of the block, at position r), across the whole block when it
    holds a replica. `per_rank[r][stage]["held"]` are the bytes rank r measured."""
    import matplotlib.pyplot as plt
    n = len(per_rank)
    parts = ["params", "grads", "optimizer"]
    full = {c: max(1, per_rank[0]["DP"]["held"][c]) for c in parts}
    scale = 1 / sum(full.values())
    colours = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868"}
    cols = 2 if len(stages) > 2 else 1
    rows_ = -(-len(stages) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(8, rows_ * (0.34 * n + 0.9)), sharex=True, squeeze=False)
    axes = list(axes.flat)
    for ax, stage in zip(axes, stages):
        for r in range(n):
            y = n - 1 - r
            x0 = 0.0
            for c in parts:
                width = full[c] * scale * 0.96
                frac = min(1.0, per_rank[r][stage]["held"][c] / full[c])
                ax.add_patch(plt.Rectangle((x0, y + 0.1), width, 0.8, facecolor="white",
                                           edgecolor="0.5", lw=0.6))
                if frac > 0.75:                     # a replica
                    ax.add_patch(plt.Rectangle((x0, y + 0.1), width * frac, 0.8,
                                               facecolor=colours[c], edgecolor="none"))
                elif frac > 0:                      # a shard: this rank's slot
                    ax.add_patch(plt.Rectangle((x0 + width * r / n, y + 0.1), width * frac, 0.8,
                                               facecolor=colours[c], edgecolor="black", lw=0.6))
                x0 += full[c] * scale
        ax.set_xlim(0, 1)
        ax.set_ylim(0, n)
        ax.set_yticks([n - 1 - r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)],
                      fontsize="large")
        ax.set_title(stage, loc="left")
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
    x0, ticks = 0.0, []
    for c in parts:
        ticks.append(x0 + full[c] * scale * 0.48)
        x0 += full[c] * scale
    for ax in axes[-cols:]:
        ax.set_xticks(ticks, ["params", "grads", "Adam state"], fontsize="large")
    fig.tight_layout()
    return fig


def bucket_sweep_figure(nbuckets, kinds, t):
    """Step time (median and IQR) against the number of all-reduce messages per step."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    errorbar(ax, [nbuckets[k] for k in kinds], [t[k] for k in kinds], fmt="o-")
    ax.set_xscale("log")
    ax.set_xlabel("all-reduce messages per step (buckets)")
    ax.set_ylabel("ms per step")
    ax.grid(alpha=0.3, which="both")
    return fig


def hidden_all_reduce_figure(backward, comm, at_scale):
    """Backward against the gradient all-reduce: this run's medians beside the published-scale estimate."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 2.4))
    for ax, (title, bwd, ar, unit) in zip(axes, [("this run (measured)", backward * 1e3, comm * 1e3, "ms"),
                                                 ("7B on H100s (computed)", at_scale["backward"],
                                                  at_scale["comm"], "s")]):
        bars = ax.barh([0, 1], [bwd, ar], color=["#dd8452", "#8172b3"])
        ax.bar_label(bars, labels=[f"{bwd:.3g} {unit}", f"{ar:.3g} {unit}"], padding=3, fontsize="large")
        ax.set_yticks([0, 1], ["backward", "all-reduce"], fontsize="large")
        ax.invert_yaxis()
        ax.set_xlim(0, max(bwd, ar) * 1.45)
        ax.set_xticks([])
        ax.set_title(title)
        for spine in ("top", "right", "bottom"):
            ax.spines[spine].set_visible(False)
    fig.tight_layout()
    return fig


def accumulation_traffic_figure(rows):
    """Bytes sent per step against micro-batches accumulated, overlapped and bucketed, on 2 and 4 ranks."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 2.6))
    for kind, marker in (("overlapped", "o"), ("bucketed", "s")):
        for ranks_, colour in ((2, "#4c72b0"), (4, "#dd8452")):
            pts = [(r[1], r[6] / 1e3) for r in rows if r[4] == kind and r[2] == ranks_]
            if pts:
                ax.plot(*zip(*pts), marker + "-", color=colour, ms=7,
                        label=f"{ranks_} ranks, {kind}")
    ax.set_xlabel("micro-batches accumulated per step")
    ax.set_ylabel("kB sent per step\nper rank (counted)")
    ax.set_ylim(0, max(r[6] for r in rows) / 1e3 * 1.3)
    ax.legend(fontsize="medium", frameon=False, ncol=2, loc="lower right")
    return fig


def pytorch_versions_figure(t):
    """Our DDP and ZeRO stages beside PyTorch's DDP and FSDP2: step times with their spread."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    pairs = [("DDP", "bucketed", "ddp"), ("ZeRO-3 / FSDP2", "zero3", "fsdp2"), ("ZeRO-1", "zero1", None),
             ("ZeRO-2", "zero2", None)]
    for i, (name, ours, theirs) in enumerate(pairs):
        for dy, key, colour, who in ((-0.17, ours, "#4c72b0", "ours"), (0.17, theirs, "#dd8452", "PyTorch")):
            if key is None:
                continue
            m = t[key].median * 1e3
            ax.barh(i + dy, m, 0.32, color=colour, label=who if i == 0 else None,
                    xerr=[[m - t[key].q1 * 1e3], [t[key].q3 * 1e3 - m]], capsize=3)
            ax.text(m * 1.02 + 0.02, i + dy, f"{m:.3g} ms", va="center", fontsize=NOTE)
    ax.set_yticks(range(len(pairs)), [p[0] for p in pairs], fontsize="large")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median, IQR)")
    ax.set_xlim(0, max(t[k].q3 for p in pairs for k in p[1:] if k) * 1e3 * 1.3)
    ax.legend(frameon=False, loc="lower right")
    return fig


def fsdp2_knobs_figure(rows):
    """Bytes each FSDP2 setting wrote to its sockets per step, one bar per setting."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 0.9 + 0.5 * len(rows)))
    short = [r[0].replace("FSDP2, ", "").replace(" (every rank a full replica)", "")
             .replace(" (shard 2, replicate 2)", "") for r in rows]
    kb_bars(ax, short, [r[2] for r in rows], "#8172b3", max(r[2] for r in rows), fontsize=NOTE)
    ax.set_xlabel("bytes written per step by rank 0 (kB, measured)")
    return fig


def local_sgd_figure(curves):
    """Loss against step (left) and against bytes sent (right) for each local-SGD setting."""
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for label, c in curves.items():
        steps_, sent, loss = zip(*c["curve"])
        left.plot(steps_, loss, marker=".", label=label)
        right.plot([s / 2**20 for s in sent[1:]], loss[1:], marker=".", label=label)
    left.set_xlabel("local steps")
    left.set_ylabel("held-out loss")
    right.set_xscale("log")
    right.set_xlabel("MB sent per rank (cumulative, counted)")
    right.legend(fontsize="x-small")
    return fig


def powersgd_figure(run):
    """Loss curves of exact averaging and of each compressed variant."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for impl, r in run.items():
        s, loss = zip(*r[0]["curve"])
        ax.plot(s, loss, marker=".", label=impl)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss")
    ax.legend(fontsize="small")
    return fig


def batch_scaling_figure(rules, batches, got):
    """Final loss against the global batch for each learning-rate scaling rule."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for rule, style in zip(rules, ["s:", "o--", "^-"]):
        ax.plot(batches, [got[b, rule] for b in batches], style, label=f"{rule} scaling")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("global batch (same samples in all)")
    ax.set_ylabel("held-out loss at the end")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


# --- lecture 02 (communication) ---

def draw_collective(name, before, after, sums):
    """Two panels, one row per rank: the tensors before and after. Cells are coloured by the
    rank the value came from; sums are grey; a reduce's non-destination buffers are hatched.
    Wide results (all-gather's, gather's: n pieces per rank) stack the panels, so that the
    figure stays readable when the page shrinks it to a phone's width."""
    cells = sum(max((len(t) for t in data if t is not None), default=1) for data in (before, after))
    return draw_stages(name, [("before", before, "none"), ("after", after, sums)], stacked=cells > 6)


# --- lecture 03: the memory section's bytes per rank ---

def memory_per_rank_figure(got, stages, psi, n):
    """Bytes per rank under DP and each ZeRO stage: what rank 0 measured (`got`, from
    measure_stages) beside the float32 formula, stacked by kind."""
    import matplotlib.pyplot as plt
    from lectures.data_parallel.demos import formula_bytes
    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "transient": "#c0c0c0"}
    for i, s in enumerate(stages):
        h = got[s]["held"]
        predicted = dict(zip(["params", "grads", "optimizer"], formula_bytes(psi, n, s, 4, 4, 8)))
        for dx, parts, hatch in [(-0.2, h, None), (0.2, predicted, "//")]:
            bottom = 0
            for key in ["params", "grads", "optimizer", "transient"]:
                value = parts.get(key, 0) / 2**20
                ax.bar(i + dx, value, 0.38, bottom=bottom, color=colours[key], hatch=hatch,
                       edgecolor="black", linewidth=0.4, label=key if i == 0 and dx < 0 else None)
                bottom += value
    tallest = max(max(sum(got[s]["held"].values()), sum(formula_bytes(psi, n, s, 4, 4, 8)))
                  for s in stages) / 2**20
    ax.set_ylim(0, tallest * 1.12)              # every bar inside the axes
    ax.set_xticks(range(len(stages)), [f"{s}\nmeas. | form." for s in stages], fontsize="large")
    ax.set_ylabel("MB per rank")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=4, fontsize="large", frameon=False)
    ax.set_title(f"bytes per rank, float32, Ψ = {psi:,}, N = {n}")
    fig.tight_layout()
    return fig


def overlap_bars(results, title=""):
    """Measured step without and with overlap (medians, interquartile bars) for each mode in
    `results` ({mode: a result of overlap.measured_against_model, or a dict of Timings
    "sequential" and "overlapped"}), with the model's overlapped step marked where there is one."""
    import matplotlib.pyplot as plt
    modes = list(results)
    fig, ax = plt.subplots(figsize=(6.4, 0.9 + 1.25 * len(modes)))
    step = 4.2                                                      # rows per mode: 2 bars and a 2-line label
    colours = {"sequential": "#8c8c8c", "overlapped": "#4c72b0"}
    names = {"sequential": "without overlap", "overlapped": "with overlap"}
    labelled = set()
    for i, mode in enumerate(modes):
        r, base = results[mode], (len(modes) - 1 - i) * step       # the first mode on top
        for j, kind in enumerate(("sequential", "overlapped")):
            y = base + (1 - j)
            t = r[kind]
            ax.barh(y, t.median * 1e3, xerr=[[(t.median - t.q1) * 1e3], [(t.q3 - t.median) * 1e3]],
                    color=colours[kind], capsize=3, label=names[kind] if i == 0 else None)
            ax.annotate(f"{t.median * 1e3:.3g} ms", xy=(t.q3 * 1e3, y), xytext=(4, 0), textcoords="offset points",
                        va="center", fontsize=NOTE)
        if "model" in r:
            ax.plot([r["model"]["overlapped"] * 1e3] * 2, [base - 0.45, base + 0.45], color="#c44e52", lw=2.5,
                    label=None if labelled else "model: overlapped step")
            labelled.add("model")
        gain = r["sequential"].median / r["overlapped"].median
        said = times_faster(gain)
        if "model" in r:             # as gain_words says it, beside the model's
            said += f" (model {r['model']['gain']:.2f}×)"
        elif spreads_overlap(r["sequential"], r["overlapped"]):    # as util.measure.compare says it
            said = "no measurable difference"
        ax.text(0, base + 1.55, f"{mode}\n{said}", fontsize=NOTE, va="bottom")
    ax.set_yticks([])
    ax.set_ylim(-0.8, step * len(modes) - 0.4)
    ax.set_xlim(0, max(r[k].q3 for r in results.values() for k in ("sequential", "overlapped")) * 1e3 * 1.3)
    ax.set_xlabel("time per step (ms), median and interquartile range")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout(rect=(0, 0.6 / fig.get_figheight(), 1, 1))     # room for the legend below
    return fig
