"""Lecture 04's figures: the drawings of its page (a matrix cut by columns and by rows, f and g
around the MLP, grouped-query heads across ranks, the vocabulary-parallel bytes, the training
loss, memory per rank, the sequence-parallel split and its activation memory, dropout masks, the
async-TP timeline, GEMM efficiency against t and DTensor's placements). Each helper returns a
matplotlib figure."""
from util import figure
from util.figures import NOTE, kb_bars


def cut_figure(n, shapes):
    """Column- and row-parallel cuts of A (h_in x h_out) and B (h_out x h_in), coloured by rank,
    labelled with the local shapes a rank held (nn.Linear stores the transpose)."""
    import matplotlib.pyplot as plt
    colours = [plt.cm.tab10(i) for i in range(n)]
    h_out, h_in = shapes["column weight"][0] * n, shapes["column weight"][1]
    fig, axes = plt.subplots(1, 2, figsize=(6.4, 3.6))
    for ax, kind in zip(axes, ("column", "row")):
        rows, cols = (h_in, h_out) if kind == "column" else (h_out, h_in)
        for r in range(n):
            if kind == "column":   # A = [A_1 ... A_n]: rank r owns a block of columns
                rect = (r * cols / n, 0, cols / n, rows)
            else:                  # B = [B_1; ...; B_n]: rank r owns a block of rows
                rect = (0, rows - (r + 1) * rows / n, cols, rows / n)
            ax.add_patch(plt.Rectangle(rect[:2], rect[2], rect[3], color=colours[r], alpha=0.75, ec="black"))
            ax.text(rect[0] + rect[2] / 2, rect[1] + rect[3] / 2, f"rank {r}", ha="center", va="center",
                    fontsize="large", rotation=90 if kind == "column" else 0)
        ax.set_xlim(0, cols)
        ax.set_ylim(0, rows)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        local = shapes["column weight"][::-1] if kind == "column" else shapes["row weight"][::-1]
        name = "A" if kind == "column" else "B"
        ax.set_title(f"{kind}-parallel: {name} is {rows}×{cols},\nrank 0 holds {local[0]}×{local[1]}")
        ax.set_xlabel("outputs" if kind == "column" else "outputs (whole)")
        ax.set_ylabel("inputs (whole)" if kind == "column" else "inputs")
    axes[0].text(0.5, -0.22, r"$Y_r = X A_r$: no collective", transform=axes[0].transAxes,
                 ha="center", va="top", fontsize="large")
    axes[1].text(0.5, -0.22, r"$Z = \sum_r Y_r B_r$: all-reduce", transform=axes[1].transAxes,
                 ha="center", va="top", fontsize="large")
    fig.tight_layout()
    return fig


def fg_figure(n, counts):
    """The Megatron MLP on n ranks between f and g, with the collective each runs forward and
    backward (the counts measured by CommDebugMode in the demo)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 1.6 + 0.85 * n))
    ax.set_xlim(0, 10)
    ax.set_ylim(-1.7, n - 0.4)
    ax.set_axis_off()
    box = lambda x, y, text, c: (ax.add_patch(plt.Rectangle((x - 0.62, y - 0.3), 1.24, 0.6, color=c, alpha=0.8)),
                                 ax.text(x, y, text, ha="center", va="center", fontsize="large"))
    mid = (n - 1) / 2
    box(0.6, mid, "$X$", "#cccccc")
    box(2.2, mid, "f", "#8fbc8f")
    for r in range(n):
        y = n - 1 - r
        ax.annotate("", xy=(3.35, y), xytext=(2.85, mid), arrowprops=dict(arrowstyle="->"))
        box(4.0, y, f"$XA_{r}$", plt.cm.tab10(r))
        box(5.6, y, "GELU", plt.cm.tab10(r))
        box(7.2, y, f"$\\cdot B_{r}$", plt.cm.tab10(r))
        ax.annotate("", xy=(4.98, y), xytext=(4.62, y), arrowprops=dict(arrowstyle="->"))
        ax.annotate("", xy=(6.58, y), xytext=(6.22, y), arrowprops=dict(arrowstyle="->"))
        ax.annotate("", xy=(8.18, mid), xytext=(7.82, y), arrowprops=dict(arrowstyle="->"))
    box(8.8, mid, "g", "#8fbc8f")
    ax.annotate("", xy=(1.58, mid), xytext=(1.22, mid), arrowprops=dict(arrowstyle="->"))
    fwd = ", ".join(f"{k} ×{v}" for k, v in counts["forward"].items()) or "none"
    bwd = ", ".join(f"{k} ×{v}" for k, v in counts["backward"].items()) or "none"
    ax.text(2.2, -0.75, "f: identity fwd,\nall-reduce bwd", ha="center", va="center", fontsize="large")
    ax.text(8.8, -0.75, "g: all-reduce fwd,\nidentity bwd", ha="center", va="center", fontsize="large")
    ax.text(5.5, -1.55, f"measured: fwd {fwd}; bwd {bwd}", ha="center", va="center", fontsize="large")
    return fig


def gqa_figure(layouts):
    """One panel row per (tp, heads, K/V heads) case: a box per rank with its query and K/V heads."""
    import matplotlib.pyplot as plt
    cases = list(layouts)
    fig, axes = plt.subplots(len(cases), 1, figsize=(8, 1.05 * len(cases) + 0.3), squeeze=False)
    for ax, key in zip(axes[:, 0], cases):
        n, a, k = key
        width = 1 / n
        for r, g in enumerate(layouts[key]):
            x0 = r * width
            ax.add_patch(plt.Rectangle((x0 + 0.005, 0.02), width - 0.01, 0.96, fill=False, lw=1.2))
            ax.text(x0 + width / 2, 0.86, f"rank {r}", ha="center", va="center")
            for j, q in enumerate(g["q heads"]):
                span = (width - 0.02) / len(g["q heads"])
                ax.add_patch(plt.Rectangle((x0 + 0.01 + j * span, 0.42), span * 0.9, 0.28, color="#4c72b0"))
                ax.text(x0 + 0.01 + (j + 0.45) * span, 0.56, f"q{q}", ha="center", va="center", color="white",
                        fontsize="small")
            for j, kv in enumerate(g["kv heads"]):
                span = (width - 0.02) / len(g["kv heads"])
                ax.add_patch(plt.Rectangle((x0 + 0.01 + j * span, 0.06), span * 0.9, 0.28, color="#dd8452"))
                ax.text(x0 + 0.01 + (j + 0.45) * span, 0.2, f"kv{kv}", ha="center", va="center", color="white",
                        fontsize="small")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_axis_off()
        ax.set_title(f"tp={n}, {a} query heads, {k} K/V heads: K/V {layouts[key][0]['kv kind']}",
                     fontsize="medium", loc="left")
    fig.tight_layout()
    return fig


def sp_split_figure(cfg, t, b):
    """One block with sequence parallelism, left to right: what each rank holds at every step
    (its shape for this page's GPT) and the collective at each change of split."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    s, h, f, hd = cfg.seq_len, cfg.d_model, cfg.ff, cfg.head_dim
    seq, ten, col = "#9ecae1", "#fdae6b", "#d9d9d9"
    steps = [("x", f"({b}, {s // t}, {h})", seq), ("LayerNorm", f"({b}, {s // t}, {h})", seq),
             ("all-gather\n(f's place)", "", col), ("Q, K, V,\nattention, O", f"heads {cfg.n_heads // t} of {cfg.n_heads}", ten),
             ("reduce-scatter\n(g's place)", "", col), ("+ residual,\nLayerNorm", f"({b}, {s // t}, {h})", seq),
             ("all-gather\n(f's place)", "", col), ("MLP", f"width {f // t} of {f}", ten),
             ("reduce-scatter\n(g's place)", "", col), ("+ residual", f"({b}, {s // t}, {h})", seq)]
    fig, ax = plt.subplots(figsize=(7, 4))
    per_row, w = 5, 1.6
    ax.set_xlim(0, per_row * w)
    ax.set_ylim(-0.2, 4.3)
    ax.axis("off")
    for i, (name, shape, colour) in enumerate(steps):
        row, k = divmod(i, per_row)
        x0, y0 = k * w, 2.3 - 2.0 * row
        collective = colour == col
        ax.add_patch(FancyBboxPatch((x0 + 0.12, y0 + 0.35), w - 0.24, 0.95,
                                    boxstyle="round,pad=0.02,rounding_size=0.08", facecolor=colour,
                                    edgecolor="black", lw=0.8, linestyle="--" if collective else "-"))
        ax.text(x0 + w / 2, y0 + 0.82, name, ha="center", va="center", fontsize=NOTE)
        if shape:
            ax.text(x0 + w / 2, y0 + 0.12, shape, ha="center", va="center", fontsize=NOTE, color="#333")
        if k:
            ax.annotate("", xy=(x0 + 0.12, y0 + 0.82), xytext=(x0 - 0.12, y0 + 0.82),
                        arrowprops=dict(arrowstyle="->", lw=0.9))
    # the second row continues the first: from the attention's reduce-scatter to the residual
    ax.annotate("", xy=(w / 2, 0.3 + 1.3), xytext=(per_row * w - w / 2, 2.3 + 0.35),
                arrowprops=dict(arrowstyle="->", lw=0.9, color="#666", shrinkA=0, shrinkB=0))
    ax.text(0.1, 4.1, f"t = {t}. blue: split along the sequence ({s // t} of {s} positions)",
            fontsize=NOTE, ha="left", va="center")
    ax.text(0.1, 3.75, "orange: split across heads or MLP width; grey: a collective",
            fontsize=NOTE, ha="left", va="center")
    figure(fig, caption=f"Where sequence parallelism splits one block ({t} ranks, this page's GPT: b = {b}, s = {s}, "
                        f"h = {h}, {cfg.n_heads} heads of {hd}, MLP width {f}). Every shape is what a rank holds. "
                        "Backward runs the same path right to left with each collective swapped "
                        "(all-gather ↔ reduce-scatter).")


def dropout_mask_figure(masks):
    """One row per way of drawing masks ({setup: [each rank's {"hidden", "residual"} mask]}):
    ranks 0 and 1's masks of the split hidden and of the replicated output, side by side."""
    import matplotlib.pyplot as plt
    setups = [s for s in masks if s != "one-process masks"]   # in the order the demo ran them
    fig, axes = plt.subplots(len(setups), 4, figsize=(7.5, 1.2 + 1.9 * len(setups)), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 2, 1, 1]})
    for row, setup in zip(axes, setups):
        for col, (kind, rank) in enumerate((("hidden", 0), ("hidden", 1), ("residual", 0), ("residual", 1))):
            image = masks[setup][rank][kind]
            row[col].imshow(image, cmap="gray", vmin=0, vmax=1, interpolation="nearest", aspect="auto")
            row[col].set_xticks([])
            row[col].set_yticks([])
            if setup == setups[0]:
                row[col].set_title(f"{'hidden (split)' if kind == 'hidden' else 'output (repl.)'}\nrank {rank}",
                                   fontsize="medium")
        same_h = masks[setup][0]["hidden"] == masks[setup][1]["hidden"]
        same_r = masks[setup][0]["residual"] == masks[setup][1]["residual"]
        row[0].set_ylabel(setup.replace(" ", "\n", 1), fontsize="medium")
        row[1].set_xlabel("same on both ranks ✗" if same_h else "differs across ranks ✓", fontsize="medium")
        row[3].set_xlabel("same ✓" if same_r else "differs ✗", fontsize="medium")
    fig.tight_layout()
    return fig


def async_tp_figure(spans):
    """The plain and the decomposed forward on one time axis (each from its own start): per rank,
    matmuls on the upper lane, communication on the lower one, waiting in red."""
    import matplotlib.pyplot as plt
    colours = {"matmul": "#4c72b0", "partial matmul": "#4c72b0", "all-gather": "#dd8452",
               "reduce-scatter": "#dd8452", "transfer (posted → done)": "#dd8452",
               "waiting for the transfer": "#c44e52", "posting a transfer": "#8172b3"}
    fig, axes = plt.subplots(2, 1, figsize=(8, 3.6), sharex=True)
    for ax, name in zip(axes, ("plain", "decomposed")):
        ticks = []
        for row, rank in enumerate((1, 0)):
            whole = [sp for sp in spans if sp["rank"] == rank and sp["label"] == f"{name} forward"]
            if not whole:
                continue
            t0 = min(sp["start"] for sp in spans if sp["label"] == f"{name} forward")
            inside = [sp for sp in spans if sp["rank"] == rank and sp["label"] in colours
                      and whole[0]["start"] <= sp["start"] <= whole[0]["end"]]
            y = row * 1.2
            for sp in inside:
                lane = y + (0.45 if "matmul" in sp["label"] else 0)
                height = 0.25 if sp["label"] in ("waiting for the transfer", "posting a transfer") else 0.4
                ax.barh(lane, (sp["end"] - sp["start"]) * 1e3, left=(sp["start"] - t0) * 1e3, height=height,
                        color=colours[sp["label"]], edgecolor="black", linewidth=0.3)
            ticks.append((y + 0.22, f"rank {rank}"))
        ax.set_yticks([t for t, _ in ticks], [n for _, n in ticks])
        ax.set_title(f"{name}: " + ("all-gather, matmul, …, matmul, reduce-scatter" if name == "plain"
                                    else "partial matmuls while the chunks travel"), fontsize="medium", loc="left")
    axes[-1].set_xlabel("time since the forward started (ms)")
    labels = ["matmul (whole or partial)", "collective, or transfer in flight", "posting a transfer",
              "waiting for a transfer"]
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#4c72b0", "#dd8452", "#8172b3", "#c44e52")],
               labels=labels, loc="lower center", ncol=2, frameon=False, fontsize="small")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


def placements_picture(rows, n):
    """DTensor's placements as a graph: an arrow for each redistribution the run made, labelled
    with the collective CommDebugMode counted for it."""
    import matplotlib.pyplot as plt
    at = {"P(sum)": (0.0, 0.0), "R": (1.0, 1.0), "S(0)": (2.0, 0.0), "S(1)": (3.0, 1.0)}
    names = {"P(sum)": "Partial\n(summands)", "R": "Replicate", "S(0)": "Shard(0)", "S(1)": "Shard(1)"}
    fig, ax = plt.subplots(figsize=(7.2, 2.9))
    for key, (x, y) in at.items():
        ax.text(x, y, names[key], ha="center", va="center", fontsize=NOTE,
                bbox={"boxstyle": "round,pad=0.4", "facecolor": "#f3f3f3", "edgecolor": "#555555"})
    pairs = {(r[0], r[1]) for r in rows}
    for src, dst, collective, *_ in rows:
        (x0, y0), (x1, y1) = at[src], at[dst]
        rad = 0.3 if (dst, src) in pairs else 0     # a pair of opposite arrows bends apart
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops={"arrowstyle": "-|>", "color": "#4c72b0", "lw": 1.5, "shrinkA": 28, "shrinkB": 28,
                                "connectionstyle": f"arc3,rad={rad}"})
        # the label at the curve's middle: half-way from the chord's middle to arc3's control point
        mx, my = (x0 + x1) / 2 + 0.5 * rad * (y1 - y0), (y0 + y1) / 2 - 0.5 * rad * (x1 - x0)
        ax.text(mx, my, collective.replace(" ×1", ""), ha="center", va="center", color="#1f3b63",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    ax.set_xlim(-0.6, 3.6)
    ax.set_ylim(-0.45, 1.45)
    ax.set_axis_off()
    fig.tight_layout()
    figure(fig, caption=f"Each arrow is a redistribution run on {n} ranks (gloo), labelled with the collective "
                        "PyTorch's CommDebugMode counted for it; 'none' is a local slice.")


def training_loss_figure(steps, ref, runs, tps):
    """Training loss per step: one process (wide grey) beneath each tensor-parallel size's."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(range(1, steps + 1), ref["losses"], lw=4, alpha=0.35, color="k", label="one process")
    for n, style in zip(tps, ("-", "--")):
        ax.plot(range(1, steps + 1), runs[n][0]["losses"], style, label=f"tp={n}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize="large")
    return fig


def memory_per_rank_figure(ts, parts, n_full):
    """What a rank holds between steps for each tp (measured, stacked) beside one process's bytes ÷ tp."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    keys = ("sharded parameters", "replicated parameters", "gradients", "Adam moments")
    bottom = [0.0] * len(ts)
    for key, colour in zip(keys, ("#4c72b0", "#dd8452", "#55a868", "#8172b3")):
        vals = [parts[t][key] / 1e3 for t in ts]
        ax.bar([str(t) for t in ts], vals, bottom=bottom, color=colour, label=key.replace("sharded", "split"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot([str(t) for t in ts], [16 * n_full / t / 1e3 for t in ts], "k--", lw=1, label="one process ÷ tp")
    ax.set_xlabel("tp")
    ax.set_ylabel("kB per rank (measured)")
    ax.legend(frameon=False)
    return fig


def vocab_parallel_figure(labels, values, full, got):
    """Measured kB per bar, one process's in grey beside the vocabulary-parallel ranks' in blue."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 0.7 + 0.55 * len(values)))
    kb_bars(ax, labels, values, ["gray"] + ["#4c72b0"] * len(got), full)
    ax.set_xlabel("kB (measured)")
    return fig


def sp_activation_figure(rows):
    """Bytes saved for backward per rank, one process against tp with sequence parallelism off and on."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 0.8 + 0.5 * len(rows)))
    labels = [("one process" if r[0] == 1 else f"tp={r[0]}, SP {r[1]}") for r in rows]
    colours = ["gray" if r[0] == 1 else ("#4c72b0" if r[1] == "off" else "#55a868") for r in rows]
    kb_bars(ax, labels, [r[2] for r in rows], colours, max(r[2] for r in rows))
    ax.set_xlabel("saved for backward per rank (kB, measured)")
    return fig


def gemm_efficiency_figure(widths, tps, rates):
    """Speed-up of one rank's share of a column- and a row-parallel matmul against t, per width h,
    beside the ideal t."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    for ax, which, title in zip(axes, (0, 1), ("column-parallel (h × 4h/t)", "row-parallel (4h/t × h)")):
        for h in widths:
            base = rates[(h, 1)][which]
            ax.plot(tps, [rates[(h, t)][which] / base * t for t in tps], "o-", label=f"h = {h}")
        ax.plot(tps, tps, "k--", lw=1, label="ideal: t")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("t (ranks splitting the matmul)")
        ax.set_title(title, fontsize="medium")
    axes[0].set_ylabel("speed-up of one rank's share")
    axes[0].legend(fontsize="small", frameon=False)
    return fig
