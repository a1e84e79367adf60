"""Lecture 06's figures: the drawings of its page (activation memory per rank, the ring's
steps, the bytes all-gather attention holds, Ulysses' all-to-all, PyTorch's variants beside ours,
MoE's loads and dispatch, expert and data-parallel groups, USP's layouts, and the load-balance
section's: which scores each rank computes under each layout, the counted imbalance, each rank's
share counted and timed). Each helper returns a matplotlib figure."""
import torch

from lectures.context_parallel.demos import LAYOUTS, ring_work
from lectures.context_parallel.sharding import sequence_positions, striped_positions
from util import figure
from util.figures import NOTE
from util.measure import errorbar


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
            ax.text(step * 2 + 0.6, -r, f"K/V {src}", ha="center", va="center", fontsize="large", color="white",
                    fontweight="bold")
            if step < n - 1:
                nxt = (r + 1) % n
                ax.annotate("", xy=(step * 2 + 2, -nxt), xytext=(step * 2 + 1.2, -r),
                            arrowprops=dict(arrowstyle="->", color="gray", lw=1,
                                            connectionstyle="arc3,rad=0.0" if nxt > r else "arc3,rad=-0.25"))
    ax.set_xticks([step * 2 + 0.6 for step in range(n)])
    ax.set_xticklabels([f"step {t}" for t in range(n)], fontsize="large")
    ax.set_yticks([-r for r in range(n)])
    ax.set_yticklabels([f"rank {r}\n(queries {r})" for r in range(n)], fontsize="large")
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
    ax.bar_label(bars, labels=[f"{h:.2f} MiB = {h / shard:.1f} q shards" for h in held], padding=3)
    ax.set_xlim(0, max(held) * 1.6)
    ax.invert_yaxis()
    ax.set_xlabel("held for backward per rank (MiB, busiest rank)", fontsize="medium")
    ax.tick_params(labelsize="medium")
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
            ax.text(x0 + w / 2, y0 + h / 2, f"rank {r}", ha="center", va="center",
                    color="white", fontweight="bold",
                    bbox={"facecolor": "black", "alpha": 0.45, "edgecolor": "none", "pad": 1.5})
        ax.set_xlim(0, S); ax.set_ylim(0, heads); ax.set_aspect("equal")
        ax.set_xticks([]); ax.set_yticks([])
        ax.set_xlabel(f"sequence positions (0–{S - 1})", fontsize="medium")
        ax.set_ylabel(f"heads (0–{heads - 1})", fontsize="medium")
        ax.set_title("before: a block of positions, every head" if when == "before"
                     else "after one all-to-all: a head, every position", fontsize="medium")
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
            ax.text(x, -r, f"rank {r}", ha="center", va="center", fontsize=NOTE, color="white", zorder=4,
                    fontweight="bold")
        ax.text(x, 0.75, label, ha="center", va="bottom", fontsize="large")
    ax.text(0.5, -n + 0.2, "dispatch (all-to-all)", ha="center", fontsize="large")
    ax.text(1.5, -n + 0.2, "combine (all-to-all)", ha="center", fontsize="large")
    ax.set_xlim(-0.3, 2.3)
    ax.set_ylim(-n, 1.5)
    ax.axis("off")
    figure(fig, caption=f"expert parallelism on {n} ranks, drawn from the run above: a line's width is the number "
                        "of token rows one rank sends another (its colour: the rank the tokens belong to). "
                        "Dispatch sends each kept (token, choice) row to its expert's rank; combine returns the "
                        "expert outputs along the same lines, reversed")


def activation_memory_figure(lens, one, per):
    """Activation memory per rank against sequence length on 1, 2 and 4 ranks."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(lens, [one[S] / 2**20 for S in lens], "o-", label="1 rank")
    for n in (2, 4):
        ax.plot(lens, [max(x[S] for x in per[n]) / 2**20 for S in lens], "o-", label=f"CP = {n}, per rank")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("activations kept (MiB)")
    ax.legend()
    return fig


def pytorch_cp_figure(names, t):
    """PyTorch's all-gather and ring context parallelism beside ours: forward+backward time (with
    its spread) and the bytes rank 0 sent."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    colors = ["tab:blue", "tab:orange"] * 2
    errorbar(axes[0], range(4), [t["time"][x] for x in names], fmt="none", ecolor="black", capsize=4)
    axes[0].bar(range(4), [t["time"][x].median * 1e3 for x in names], color=colors)
    axes[0].set_ylabel("forward+backward (ms)")
    axes[1].bar(range(4), [t["sent"][x] / 2**20 for x in names], color=colors)
    axes[1].set_ylabel("MiB sent by rank 0")
    for ax in axes:
        ax.set_xticks(range(4))
        ax.set_xticklabels(["PyTorch\nall-gather", "ours\nall-gather", "PyTorch\nring", "ours\nring"],
                           fontsize="small")
        ax.axvline(1.5, color="gray", lw=0.8, ls=":")
    return fig


def moe_figure(counts, labels, r):
    """Tokens per expert under an untrained router, then the busiest expert's load and the loss
    over training, one curve per setting."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    axes[0].bar(range(8), counts)
    axes[0].set_xlabel("expert")
    axes[0].set_ylabel("tokens routed (both choices)")
    axes[0].set_title("untrained router, 512 tokens", fontsize="medium")
    for label, log in zip(labels, r):
        axes[1].plot(log["max_load"], label=label)
        axes[2].plot(log["loss"], label=label)
    axes[1].axhline(1, color="gray", lw=0.5)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("busiest expert / mean load")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("training loss")
    axes[1].legend(fontsize="small")
    fig.tight_layout()
    return fig


def expert_groups_figure(ep_groups, edp_groups, ep, world, starts, colors, counts):
    """4 ranks as expert-parallel rows × data-parallel columns: which ranks average which gradients."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 3.0))
    for g in ep_groups:
        d = g[0] // ep
        ax.add_patch(plt.Rectangle((-0.45, -d - 0.42), ep - 0.1, 0.84, fill=False, ec="tab:blue", lw=2))
        ax.text(ep - 0.5, -d, f"EP group {g}", va="center", fontsize="small", color="tab:blue")
    for j, g in enumerate(edp_groups):
        ax.add_patch(plt.Rectangle((j - 0.4, -len(g) + 0.55), 0.8, len(g) - 0.1, fill=False, ec="tab:red", lw=2,
                                   ls="--"))
        ax.text(j, -len(g) + 0.4, f"expert-DP\ngroup {g}", ha="center", va="top", fontsize="small", color="tab:red")
    for g in ep_groups:
        for j, rank in enumerate(g):
            d = rank // ep
            ax.add_patch(plt.Rectangle((j - 0.3, -d - 0.3), 0.6, 0.6, color=colors[rank], alpha=0.8))
            experts = list(range(starts[j], starts[j] + counts[j]))
            ax.text(j, -d, f"rank {rank}\nrouter\nexperts {experts}", ha="center", va="center", fontsize="small")
    ax.set_xlim(-0.6, ep + 1.0)
    ax.set_ylim(-world // ep - 0.3, 0.5)
    ax.axis("off")
    return fig


def usp_figure(R, h, U, colors):
    """USP's two layouts: the sequence shards before the all-to-all, and the head shards with the ring over R during attention."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, phase in zip(axes, ("before the all-to-all (sequence shards)", "during attention (head shards, ring over R)")):
        for ring in range(R):
            for u in range(U):
                rank = ring * U + u
                if phase.startswith("before"):
                    x0, w, y0, hh = ring * U + u, 1, 0, h           # all heads, its own s/(U·R) positions
                else:
                    x0, w, y0, hh = ring * U, U, u * h // U, h // U  # h/U heads, the ring slot's s/R positions
                ax.add_patch(plt.Rectangle((x0, y0), w, hh, color=colors[rank], alpha=0.8, ec="white", lw=2))
                ax.text(x0 + w / 2, y0 + hh / 2, f"rank {rank}", ha="center", va="center", color="white",
                        fontweight="bold")
        ax.set_xlim(0, U * R)
        ax.set_ylim(0, h)
        ax.set_xticks([i + 0.5 for i in range(U * R)])
        ax.set_xticklabels([f"s/{U * R}" for _ in range(U * R)], fontsize="small")
        ax.set_xlabel("sequence", fontsize="medium")
        ax.set_title(phase, fontsize="medium")
    axes[0].set_ylabel("heads", fontsize="medium")
    axes[0].set_yticks(range(h + 1))
    return fig


def layout_owner(seq_len, world_size, layout):
    """owner[p] = the rank holding position p under `layout` (from the same functions the ranks use)."""
    owner = [0] * seq_len
    for r in range(world_size):
        pos = striped_positions(seq_len, r, world_size) if layout == "striped" else \
            sequence_positions(seq_len, r, world_size, layout)
        for p in pos.tolist():
            owner[p] = r
    return owner


def attention_blocks_figure(seq_len=16, world_size=4):
    """Which (query, key) score entries each rank computes under each layout: the causal matrix
    coloured by the rank that holds the query, with every rank's count of entries."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    colors = plt.get_cmap("tab10").colors[:world_size]
    fig, axes = plt.subplots(1, 3, figsize=(9, 3.9), sharey=True)
    for ax, layout in zip(axes, LAYOUTS):
        owner = layout_owner(seq_len, world_size, layout)
        grid = torch.full((seq_len, seq_len), float("nan"))
        for i in range(seq_len):
            grid[i, :i + 1] = owner[i]
        ax.imshow(grid, cmap=ListedColormap(colors), vmin=-0.5, vmax=world_size - 0.5)
        work = ring_work(seq_len, world_size, layout)
        ax.set_title(f"{layout}\nentries per rank: {', '.join(map(str, work))}", fontsize="medium")
        ax.set_xlabel("key position", fontsize="medium")
        ax.set_xticks([0, seq_len - 1])
        ax.set_yticks([0, seq_len - 1])
    axes[0].set_ylabel("query position", fontsize="medium")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors]
    fig.legend(handles, [f"rank {r}" for r in range(world_size)], loc="lower center", ncol=world_size,
               fontsize="medium", frameon=False)
    fig.subplots_adjust(bottom=0.24, top=0.84, wspace=0.08)
    figure(fig, caption=f"causal attention on {seq_len} tokens over {world_size} ranks: each coloured cell is a "
                        "score a rank computes (the rank holding that query); white cells are masked and skipped. "
                        "Contiguous chunks leave rank 0 a small triangle and the last rank a long strip")


def work_imbalance_figure(ns, S0):
    """The counted busiest/idlest work ratio of causal attention against the number of ranks, one
    line per layout (from ring_work, the count the ranks' shares are checked against)."""
    import matplotlib.pyplot as plt
    imb = {layout: [max(w) / min(w) for w in (ring_work(S0, m, layout) for m in ns)] for layout in LAYOUTS}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for layout, marker in zip(LAYOUTS, "os^"):
        ax.plot(ns, imb[layout], marker + "-", label=layout)
        ax.annotate(f"{imb[layout][-1]:.2f}", (ns[-1], imb[layout][-1]), textcoords="offset points",
                    xytext=(6, 0), va="center", fontsize="small")
    ax.set_xlabel("ranks n", fontsize="medium")
    ax.set_ylabel("busiest / idlest rank's work", fontsize="medium")
    ax.set_xlim(1.5, 9)
    ax.legend(fontsize="small")
    return fig


def share_bars_figure(shares, S, nb):
    """Each ring rank's share of causal attention, contiguous beside zig-zag: its counted entries
    (ring_work) and its measured time (the lower quartile of `shares`), each over its busiest rank."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    for ax, layout in zip(axes, ("contiguous", "zigzag")):
        c = ring_work(S, nb, layout)
        t = [shares[layout, r].q1 for r in range(nb)]
        ax.bar([r - 0.2 for r in range(nb)], [x / max(c) for x in c], width=0.4, label="work counted")
        ax.bar([r + 0.2 for r in range(nb)], [x / max(t) for x in t], width=0.4, label="time measured")
        ax.set_title(layout, fontsize="medium")
        ax.set_xlabel("rank", fontsize="medium")
        ax.set_xticks(range(nb))
    axes[0].set_ylabel("relative to the busiest rank", fontsize="medium")
    axes[0].legend(fontsize="small", loc="upper left")
    return fig
