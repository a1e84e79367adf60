"""Lecture 06's figures: the drawings of its page (the ring's steps, the bytes all-gather
attention holds, Ulysses' all-to-all, and MoE's token dispatch); `attention_blocks_figure` stays in
the lecture beside the work counts it draws. Each helper returns a matplotlib figure."""
from util import figure


def ring_steps_figure(n):
    """The ring's forward steps as a grid: which rank's K/V block each rank holds at each step (from
    `ring_source`, the schedule RingAttention follows), arrows showing where it goes next."""
    import matplotlib.pyplot as plt
    from lectures.context_parallel.ring import ring_source
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for step in range(n):
        for r in range(n):
            src = ring_source(r, step, n)
            ax.add_patch(plt.Rectangle((step * 2, -r - 0.4), 1.2, 0.8, color=colors[src], alpha=0.85))
            ax.text(step * 2 + 0.6, -r, f"K/V {src}", ha="center", va="center", fontsize=12, color="white",
                    fontweight="bold")
            if step < n - 1:
                nxt = (r + 1) % n
                ax.annotate("", xy=(step * 2 + 2, -nxt), xytext=(step * 2 + 1.2, -r),
                            arrowprops=dict(arrowstyle="->", color="gray", lw=1,
                                            connectionstyle="arc3,rad=0.0" if nxt > r else "arc3,rad=-0.25"))
    ax.set_xticks([step * 2 + 0.6 for step in range(n)])
    ax.set_xticklabels([f"step {t}" for t in range(n)], fontsize=12)
    ax.set_yticks([-r for r in range(n)])
    ax.set_yticklabels([f"rank {r}\n(queries {r})" for r in range(n)], fontsize=12)
    ax.set_xlim(-0.3, 2 * n - 0.5)
    ax.set_ylim(-n + 0.4, 0.6)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(length=0)
    figure(fig, caption=f"the ring's forward on {n} ranks: at step t rank r attends with its own queries to the "
                        "K/V block of rank r−t (box) while it sends that block on to rank r+1 (arrow); after "
                        f"{n} steps every query has seen every block. Backward repeats the walk, and each block's "
                        "dK/dV accumulator follows it one hop behind, arriving home after n hops")


def held_bytes_picture(r, n):
    """What a rank holds for backward under the ring and under all-gather, against one q shard."""
    import matplotlib.pyplot as plt
    names = ("ring", "all-gather")
    held = [max(x[name]["held"] for x in r) / 2**20 for name in names]
    shard = r[0]["ring"]["shard_bytes"] / 2**20
    fig, ax = plt.subplots(figsize=(6.2, 2.2))
    bars = ax.barh(names, held, color=["#4c72b0", "#dd8452"], height=0.55)
    ax.bar_label(bars, labels=[f"{h:.2f} MiB = {h / shard:.1f} q shards" for h in held], fontsize=10, padding=3)
    ax.set_xlim(0, max(held) * 1.6)
    ax.invert_yaxis()
    ax.set_xlabel("held for backward per rank (MiB, busiest rank)", fontsize=10)
    ax.tick_params(labelsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    figure(fig, caption=f"Causal attention on {n} ranks, measured with a saved-tensors hook: the all-gather "
                        "variant keeps the whole sequence's K and V for backward, the ring only its own block.")


def ulysses_picture(layouts):
    """The head↔sequence swap, drawn from what the ranks returned: one grid of heads × positions,
    coloured by the rank that held each entry before; outlined, what each rank holds."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    n = len(layouts)
    heads, per = len(layouts[0]["before"]), len(layouts[0]["before"][0])
    hn, S = heads // n, per * n
    colours = plt.cm.tab10.colors
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 3.2))
    for ax, when in zip(axes, ("before", "after")):
        for r, got in enumerate(layouts):
            grid = got[when]
            for i, row in enumerate(grid):
                for j, owner in enumerate(row):
                    head, pos = (i, r * per + j) if when == "before" else (r * hn + i, j)
                    ax.add_patch(Rectangle((pos, heads - 1 - head), 1, 1, facecolor=colours[int(owner)],
                                           edgecolor="white", linewidth=1))
            x0, y0, w, h = (r * per, 0, per, heads) if when == "before" else (0, heads - (r + 1) * hn, S, hn)
            ax.add_patch(Rectangle((x0, y0), w, h, fill=False, edgecolor="black", linewidth=2))
            ax.text(x0 + w / 2, y0 + h / 2, f"rank {r}", ha="center", va="center", fontsize=10,
                    color="white", fontweight="bold",
                    bbox={"facecolor": "black", "alpha": 0.45, "edgecolor": "none", "pad": 1.5})
        ax.set_xlim(0, S); ax.set_ylim(0, heads); ax.set_aspect("equal")
        ax.set_xticks([]); ax.set_yticks([])
        ax.set_xlabel(f"sequence positions (0–{S - 1})", fontsize=10)
        ax.set_ylabel(f"heads (0–{heads - 1})", fontsize=10)
        ax.set_title("before: a block of positions, every head" if when == "before"
                     else "after one all-to-all: a head, every position", fontsize=10)
    fig.tight_layout()
    return fig


def dispatch_figure(rows_sent, n):
    """Expert parallelism's two all-to-alls drawn from one run's row counts: dispatch (each rank's
    token rows to the ranks owning their experts) and combine (the results back)."""
    import matplotlib.pyplot as plt
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    top = max(max(row) for row in rows_sent)
    xs = (0, 1, 2)
    for i in range(n):
        for j in range(n):
            w = rows_sent[i][j]
            if w:
                for a, b, (src, dst) in ((xs[0], xs[1], (i, j)), (xs[1], xs[2], (j, i))):
                    ax.plot([a + 0.12, b - 0.12], [-src, -dst], color=colors[i], lw=0.5 + 6 * w / top, alpha=0.6,
                            solid_capstyle="butt")
    for x, label in zip(xs, ("tokens\n(routed here)", "experts", "tokens\n(combined)")):
        for r in range(n):
            ax.add_patch(plt.Rectangle((x - 0.12, -r - 0.3), 0.24, 0.6, color=colors[r], zorder=3))
            ax.text(x, -r, f"rank {r}", ha="center", va="center", fontsize=11, color="white", zorder=4,
                    fontweight="bold")
        ax.text(x, 0.75, label, ha="center", va="bottom", fontsize=12)
    ax.text(0.5, -n + 0.2, "dispatch (all-to-all)", ha="center", fontsize=12)
    ax.text(1.5, -n + 0.2, "combine (all-to-all)", ha="center", fontsize=12)
    ax.set_xlim(-0.3, 2.3)
    ax.set_ylim(-n, 1.5)
    ax.axis("off")
    figure(fig, caption=f"expert parallelism on {n} ranks, drawn from the run above: a line's width is the number "
                        "of token rows one rank sends another (its colour: the rank the tokens belong to). "
                        "Dispatch sends each kept (token, choice) row to its expert's rank; combine returns the "
                        "expert outputs along the same lines, reversed")
