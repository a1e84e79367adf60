"""Lecture 01's figures: the drawings of its page (the training loss, memory by phase, bytes per
parameter, saved activations, recomputation, accumulation, the logits' share, number formats and
their rounding error, loss scaling, master weights, fp8 tiles and delayed scaling, attention by
blocks and its memory, the roofline), and `show`, the page's `util.figure` with log axes
labelled in plain numbers. Each helper takes what a demo measured and returns a matplotlib
figure; the lecture narrates and shows it."""
import math

import torch

from lectures.model.precision import FORMATS, dequantize_fp8, quantize_fp8, relative_error_across_magnitudes
from lectures.model.training_memory import MEM_CATEGORIES
from util import figure
from util.figures import NOTE


def show(fig, caption=""):
    """`util.figure` with log axes labelled with plain numbers (16, 0.001) at their major ticks
    only, never "2×10⁰"."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax in fig.axes:
        for axis, scale, lim in ((ax.xaxis, ax.get_xscale(), ax.get_xlim()),
                                 (ax.yaxis, ax.get_yscale(), ax.get_ylim())):
            if scale != "log":
                continue
            decades = math.log10(max(lim) / min(lim))
            if axis.get_transform().base == 10 and decades < 2.5 and \
                    not isinstance(axis.get_major_locator(), FixedLocator):
                axis.set_major_locator(LogLocator(10, subs=(1, 2, 5)))   # a short range: 1, 2, 5 per decade
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(NullFormatter())
    figure(fig, caption=caption)


def fmt_bytes(n):
    for unit, k in [("GB", 1e9), ("MB", 1e6), ("kB", 1e3)]:
        if abs(n) >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} B"


def training_loss_figure(losses, floor, vocab_size):
    """The training loss per step against the task's entropy rate (`floor`, the best possible)
    and a uniform guess over `vocab_size` tokens."""
    import matplotlib.pyplot as plt
    steps = len(losses)
    fig, ax = plt.subplots(figsize=(6.5, 2.8))
    ax.plot(range(1, steps + 1), losses, label="training loss")
    ax.axhline(floor, color="gray", ls="--", label="entropy rate (best possible)")
    ax.axhline(math.log(vocab_size), color="gray", ls=":", label="uniform guess")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    return fig


def memory_phases_figure(rows):
    """Stacked bars of MemTracker's categories after each phase, grouped by step."""
    import matplotlib.pyplot as plt
    import numpy as np
    names = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer state",
             "Activation": "activations", "Temp": "temporaries"}
    short = {"forward": "fwd", "backward": "bwd", "optimizer step": "opt", "zero_grad": "zero"}
    fig, ax = plt.subplots(figsize=(8, 3.8))
    x = np.arange(len(rows)) + np.array([r["step"] - 1 for r in rows]) * 0.6   # a gap between steps
    bottom = np.zeros(len(rows))
    for c in MEM_CATEGORIES:
        vals = np.array([r["tracker"].get(c, 0) for r in rows]) / 1e6
        if vals.any():
            ax.bar(x, vals, bottom=bottom, width=0.8, label=names[c])
        bottom += vals
    ax.set_ylim(0, bottom.max() * 1.18)
    ax.set_xticks(x, [short[r["phase"]] for r in rows])
    for step in sorted({r["step"] for r in rows}):
        xs = [xi for xi, r in zip(x, rows) if r["step"] == step]
        ax.text(sum(xs) / len(xs), bottom.max() * 1.06, f"step {step}", ha="center", fontsize="large")
        if step > 1:
            ax.axvline(xs[0] - 0.7, color="gray", lw=0.8, ls=":")
    ax.set_ylabel("MB held (MemTracker)")
    ax.legend(fontsize="large", ncol=2, loc="lower center", bbox_to_anchor=(0.5, 1.01), frameon=False)
    return fig


def bytes_per_parameter_figure(setups, psi):
    """Horizontal stacked bars: bytes per parameter by role, one bar per setup (measured)."""
    import matplotlib.pyplot as plt
    roles = [("weights (bf16)", "#9ecae1", ("bf16 parameters",)),
             ("weights (fp32)", "#3182bd", ("Parameter",)),
             ("gradients (bf16)", "#fdae6b", ("bf16 gradients",)),
             ("gradients (fp32)", "#e6550d", ("Gradient", "fp32 gradient accumulation")),
             ("fp32 master weights", "#31a354", ("fp32 master parameters",)),
             ("Adam m and v (fp32)", "#756bb1", ("Optstate", "fp32 Adam m and v")),
             ("bf16 weight copies", "#bdbdbd", ("Copies",))]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = list(setups)
    for i, name in enumerate(names):
        left = 0
        for label, color, keys in roles:
            w = sum(setups[name].get(k, 0) for k in keys) / psi
            if w:
                ax.barh(i, w, left=left, color=color, edgecolor="white",
                        label=label if label not in ax.get_legend_handles_labels()[1] else None)
                left += w
        ax.text(left + 0.2, i, f"{left:.3g}", va="center", fontsize="large")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, max(sum(v.values()) for v in setups.values()) / psi * 1.12)
    ax.set_xlabel("bytes per parameter")
    ax.legend(ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.01), frameon=False)
    return fig


def activations_figure(seqs, measured, reconciled, paper):
    """Bytes one block saves against s: measured (points), reconciled (lines), the paper × 2."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.plot(seqs, [m / 1e6 for m in measured["naive"]], "o", color="C0", label="measured, naive attention")
    ax.plot(seqs, [m / 1e6 for m in measured["sdpa"]], "s", color="C1", label="measured, fused (SDPA)")
    ax.plot(seqs, [r / 1e6 for r in reconciled["naive"]], "-", color="C0", lw=1, label="reconciled, naive")
    ax.plot(seqs, [r / 1e6 for r in reconciled["sdpa"]], "-", color="C1", lw=1, label="reconciled, fused")
    ax.plot(seqs, [2 * p / 1e6 for p in paper], "--", color="gray", label="paper × 2 (fp32)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seqs, [str(x) for x in seqs])
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("MB saved per layer")
    ax.legend()
    return fig


def recomputation_figure(results, timings):
    """Two panels: bytes held after the forward, and time of forward + backward, per mode."""
    import matplotlib.pyplot as plt
    modes = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 2.9))
    held = [results[m]["held"] / 1e6 for m in modes]
    ax1.bar(modes, held, color=["C0", "C1", "C2"])
    for i, h in enumerate(held):
        ax1.text(i, h, f"{h:.2f}", ha="center", va="bottom", fontsize="large")
    ax1.set_ylim(0, max(held) * 1.2)
    ax1.set_ylabel("MB held after forward")
    ms = [timings[m].median * 1e3 for m in modes]
    err = [[(timings[m].median - timings[m].q1) * 1e3 for m in modes],
           [(timings[m].q3 - timings[m].median) * 1e3 for m in modes]]
    ax2.bar(modes, ms, yerr=err, capsize=4, color=["C0", "C1", "C2"])
    ax2.set_ylabel("ms, forward + backward")
    fig.tight_layout()
    return fig


def accumulation_figure(rows):
    """Bytes held after a forward per number of micro-batches, against the ideal 1/k."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ks = [r[0] for r in rows]
    mb = [r[2] / 1e6 for r in rows]
    ax.bar(range(len(ks)), mb, color="C0", width=0.6)
    ax.plot(range(len(ks)), [mb[0] / k for k in ks], "k--", marker="_", ms=20, label="1/k of one batch")
    for i, (m, r) in enumerate(zip(mb, rows)):
        ax.text(i, m, fmt_bytes(r[2]), ha="center", va="bottom", fontsize="large")
    ax.set_xticks(range(len(ks)), [f"k = {k}" for k in ks])
    ax.set_ylim(0, max(mb) * 1.2)
    ax.set_ylabel("MB held after a forward")
    ax.legend(fontsize="large")
    return fig


def format_bits_figure():
    """Sign, exponent and mantissa bits of each format, as coloured boxes, from torch.finfo."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    fig, ax = plt.subplots(figsize=(8, 2.9))
    for row, (name, dtype) in enumerate(FORMATS.items()):
        bits = dtype.itemsize * 8
        mant = round(-math.log2(torch.finfo(dtype).eps))
        expo = bits - 1 - mant
        y = len(FORMATS) - 1 - row
        x = 0
        for n, color, label in ((1, "#d62728", "sign"), (expo, "#1f77b4", "exponent"), (mant, "#2ca02c", "mantissa")):
            ax.add_patch(Rectangle((x, y + 0.1), n, 0.8, color=color, alpha=0.75, lw=0))
            if n >= 2 or label == "sign":
                ax.text(x + n / 2, y + 0.5, str(n) if label != "sign" else "s", ha="center", va="center",
                        color="white", fontsize="large", fontweight="bold")
            x += n
        ax.text(-0.6, y + 0.5, name, ha="right", va="center", fontsize="large")
    for label, color in (("sign", "#d62728"), ("exponent bits (range)", "#1f77b4"),
                         ("mantissa bits (resolution)", "#2ca02c")):
        ax.bar(0, 0, color=color, alpha=0.75, label=label)
    ax.set_xlim(-9, 33)
    ax.set_ylim(0, len(FORMATS) + 0.2)
    ax.set_xticks(range(0, 33, 8))
    ax.set_xlabel("bits")
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.legend(ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return fig


def tile_error_figure(a, tokens=64, features=256):
    """Per-element relative error of an fp8 round trip, per-tensor vs 1×128 tiles, as images."""
    import matplotlib.pyplot as plt
    import numpy as np
    rel = {}
    for name, tile in (("one scale per tensor", None), ("one scale per 1×128 tile", (1, 128))):
        back = dequantize_fp8(*quantize_fp8(a, tile))
        err = ((back - a).abs() / a.abs().clamp_min(1e-30))[:tokens, :features]
        rel[name] = np.log10(err.clamp(1e-4, 1).numpy())
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.4), sharey=True)
    for ax, (name, img) in zip(axes, rel.items()):
        im = ax.imshow(img, aspect="auto", vmin=-4, vmax=0, cmap="magma", interpolation="nearest")
        ax.set_title(name)
        ax.set_xlabel("feature")
        for x in range(128, features, 128):
            ax.axvline(x - 0.5, color="white", lw=1, ls="--")
    axes[0].set_ylabel("token")
    bar = fig.colorbar(im, ax=axes, shrink=0.9)
    bar.set_ticks([-4, -3, -2, -1, 0], labels=["≤1e-4", "1e-3", "1e-2", "0.1", "1 (lost)"])
    return fig


def attention_blocks_figure(s, block):
    """Which (query, key) tiles the blocked causal forward visits, in the order it visits them:
    the same loop bounds as `_blocked_forward`."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    fig, ax = plt.subplots(figsize=(7, 3.6))
    starts = [st for st in range(0, s, block) if st <= s - 1]
    for i, st in enumerate(starts):
        width = min(block, s - st)
        for q in range(s):
            for kk in range(st, st + width):
                visible = kk <= q
                ax.add_patch(Rectangle((kk, q), 1, 1, color=f"C{i}" if visible else "#eeeeee",
                                       alpha=0.8 if visible else 1, lw=0))
        ax.text(st + width / 2, -0.6, f"step {i + 1}", ha="center", va="bottom", fontsize="large")
        ax.axvline(st, color="black", lw=1)
    ax.set_xlim(0, s)
    ax.set_ylim(s, -1.8)
    ax.set_aspect("equal")
    ax.set_xlabel("key position (blocks of keys, one per loop step)")
    ax.set_ylabel("query position")
    return fig


def logits_figure(vocabs, chunk, held):
    """Bytes the forward holds for backward at each vocabulary size: the whole loss (its fp32 log-softmax apart) against chunked cross-entropy."""
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(figsize=(8, 3.2))
    x = np.arange(len(vocabs))
    rest = [held[v][0] / 1e6 - held[v][2] / 1e6 for v in vocabs]
    ax.bar(x - 0.2, rest, 0.38, color="C0", label="whole loss: everything else")
    ax.bar(x - 0.2, [held[v][2] / 1e6 for v in vocabs], 0.38, bottom=rest, color="C3",
           label="whole loss: fp32 log-softmax")
    ax.bar(x + 0.2, [held[v][1] / 1e6 for v in vocabs], 0.38, color="C2", label=f"chunked ({chunk} tokens)")
    # in MB, as the axis says, without the unit: two bars' labels side by side stay apart
    for i, v in enumerate(vocabs):
        ax.text(i - 0.2, held[v][0] / 1e6, f"{held[v][0] / 1e6:.3g}", ha="center", va="bottom", fontsize=NOTE)
        ax.text(i + 0.2, held[v][1] / 1e6, f"{held[v][1] / 1e6:.3g}", ha="center", va="bottom", fontsize=NOTE)
    ax.set_xticks(x, [f"v = {v}" for v in vocabs])
    ax.set_ylim(0, max(held[v][0] for v in vocabs) / 1e6 * 1.15)
    ax.set_ylabel("MB held after forward")
    ax.legend(loc="upper left")
    return fig


def rounding_error_figure(exps):
    """Each format's median relative rounding error across magnitudes (log-log)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.8))
    styles = {"fp32": dict(lw=3, color="black"), "fp16": dict(color="C0"), "bf16": dict(color="C1"),
              "fp8 e4m3fn": dict(color="C2", ls="--"), "fp8 e5m2": dict(color="C3", ls="--")}
    for name, dtype in FORMATS.items():
        errs = relative_error_across_magnitudes(dtype, exps)
        ax.plot([10 ** e for e in exps], [max(e, 1e-9) for e in errs], marker=".", label=name, **styles[name])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("magnitude of the value")
    ax.set_ylabel("median relative\nrounding error")
    ax.legend(ncol=5, loc="lower center", bbox_to_anchor=(0.5, 1.01), frameon=False,
              handlelength=1.5, columnspacing=1.0)
    return fig


def delayed_scaling_figure(amax, steps, jump, errs, history):
    """A tensor's amax over the steps, and the cast's error under current and delayed scaling."""
    import matplotlib.pyplot as plt
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(8, 4.6), sharex=True, height_ratios=[1, 2])
    ax0.plot(range(steps), amax, "k.-")
    ax0.set_ylabel("amax")
    ax1.plot(range(steps), [e[0] for e in errs], "o-", label="current scaling")
    ax1.plot(range(steps), [e[1] for e in errs], "s--", label=f"delayed (max of last {history} steps)")
    ax1.set_ylim(0, max(max(e[:2]) for e in errs) * 1.15)
    ax1.set_ylabel("relative error\nof the cast")
    ax1.set_xlabel("step")
    ax1.annotate(f"{errs[jump][2]:.0%} saturated", (jump, errs[jump][1]), textcoords="offset points",
                 xytext=(10, -4), fontsize=NOTE)
    ax1.legend(loc="center right")
    fig.tight_layout()
    return fig


def roof_points(peak, bw):
    """The intensities the roof is drawn through: powers of two, and the ridge peak/bw itself, so
    that the straight segments meet at the corner instead of cutting it."""
    return sorted({2 ** e for e in range(-5, 10)} | {peak / bw})


def roofline_figure(sizes, mm, add, gelu, peak, bw):
    """This machine's roofline (measured peak and bandwidth) with matmuls, add and GELU placed on it."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4))
    xs = roof_points(peak, bw)
    ax.plot(xs, [min(peak, x * bw) / 1e9 for x in xs], color="gray", label="roofline (measured peak, bandwidth)")
    ax.plot([n / 6 for n in sizes], [r / 1e9 for r, _ in mm.values()], "o", label="matmul n×n")
    for i, (n, (r, _)) in enumerate(mm.items()):     # each label centred on its point, above or below
        ax.annotate(f"n={n}", (n / 6, r / 1e9), textcoords="offset points", ha="center",
                    xytext=(0, 9) if i % 2 == 0 else (0, -9), va="bottom" if i % 2 == 0 else "top",
                    fontsize=NOTE)
    ax.plot([add[2]], [add[0] / 1e9], "s", label="add")
    ax.plot([gelu[2]], [gelu[0] / 1e9], "^", label="GELU (8 FLOP assumed)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("GFLOP/s")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.01), ncol=2, frameon=False)
    return fig


def loss_scaling_figure(worst, rms, real, s16, per_tensor):
    """Each parameter tensor's fp16 gradient error against its gradient RMS, without and with a loss scale of 2^16."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.8))
    xs = [rms[k] for k in real]
    for sc, marker, label in ((None, "o", "no scaling"), (s16, "s", "loss scale 2^16")):
        ax.plot(xs, [per_tensor[sc][k] for k in real], marker, label=label, alpha=0.8)
    ax.annotate(worst, (rms[worst], per_tensor[None][worst]), textcoords="offset points",
                xytext=(8, 4), fontsize=NOTE)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 3)               # room for the label
    ax.set_xlabel("gradient RMS of the tensor (fp32)")
    ax.set_ylabel("relative error of its fp16 gradient")
    ax.legend()
    return fig


def master_weights_figure(curves, styles):
    """Loss curves per precision recipe, and each one's difference from fp32's below."""
    import matplotlib.pyplot as plt
    fig, (ax, dax) = plt.subplots(2, 1, figsize=(8, 4.4), sharex=True, height_ratios=[3, 2])
    for v, (c, _) in curves.items():
        ax.plot(*zip(*c), label=v, **styles[v])
    ref = dict(curves["fp32"][0])
    for v, (c, _) in curves.items():
        if v != "fp32":
            dax.plot([t for t, _ in c], [loss - ref[t] for t, loss in c], label=v, **styles[v])
    dax.axhline(0, color="black", lw=1, alpha=0.35)
    ax.set_ylabel("loss")
    dax.set_ylabel("loss − fp32's")
    dax.set_xlabel("step")
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


def attention_memory_figure(peaks, seqs):
    """Forward peak bytes against sequence length for each attention (log-log), each curve labelled at its end."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ends = sorted(peaks, key=lambda name: peaks[name][-1])
    for (name, ys), marker in zip(peaks.items(), "os^"):
        ax.plot(seqs, [y / 1e6 for y in ys], marker + "-", label=name)
        # labels at the right end, moved apart where two curves end close together
        close = [other for other in ends if abs(math.log(peaks[other][-1] / ys[-1])) < 0.35]
        shift = 7 * (2 * close.index(name) - (len(close) - 1)) if len(close) > 1 else 0
        ax.annotate(fmt_bytes(ys[-1]), (seqs[-1], ys[-1] / 1e6), textcoords="offset points",
                    xytext=(6, -3 + shift), fontsize=NOTE)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seqs, [str(x) for x in seqs])
    ax.set_xlim(seqs[0] / 1.3, seqs[-1] * 2.2)
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("peak MB, forward")
    ax.legend(loc="upper left")
    return fig


def published_figure(pub, mark=None, ratio=None, computed=None, height=3.2):
    """A published GPU measurement (a gpu_evidence.Published) as bars or a line, with its source
    written on the figure. `mark` ((y, text)) draws a level, e.g. what this machine measured;
    `ratio` ((series, baseline)) draws one series over another instead of both; `computed`
    ({name: points}) adds lines this course computed (dashed, named as computed)."""
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(figsize=(6.4, height))
    series, y_label = pub.series, pub.y_label
    if ratio:
        top, base = ratio
        series = {f"{top} / {base}": [(x, y / b) for (x, y), (_, b) in zip(pub.series[top], pub.series[base])]}
        y_label = f"speed-up ({pub.y_label})"
    names = list(series)
    colours = ["#4c72b0", "#dd8452", "#55a868", "#8172b2"]
    if pub.kind == "line":
        for name, colour in zip(names, colours):
            xs, ys = zip(*series[name])
            ax.plot(xs, ys, "o-", color=colour, label=name)
        for name, points in (computed or {}).items():
            ax.plot(*zip(*points), "s--", color="#777777", label=name)
        ax.set_xscale("log", base=2)
        xs = [x for x, _ in series[names[0]]]
        ticks = xs if len(xs) <= 6 else xs[::max(1, len(xs) // 5)]
        binary = lambda x: next(f"{x / k:g} {u}" for u, k in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10), ("B", 1))
                                if x >= k or u == "B")
        ax.set_xticks(ticks, [binary(x) if "bytes" in pub.x_label else f"{x // 1024:,}K" for x in ticks])
        ax.minorticks_off()
        if mark:
            ax.axhline(mark[0], color="#c44e52", lw=1.5, ls="--")
            ax.text(ax.get_xlim()[1] / 1.1, mark[0], mark[1], ha="right", va="bottom", color="#c44e52",
                    fontsize=NOTE)        # at the right, where the published curve is high above it
    elif pub.kind == "barh":        # many categories, one series: their names read across
        cats, ys = zip(*series[names[0]])
        bars = ax.barh(range(len(cats)), ys, 0.7, color=colours[0])
        for b, y in zip(bars, ys):
            ax.text(y, b.get_y() + b.get_height() / 2, f" {y:,.4g}", va="center", fontsize="small")
        ax.set_yticks(range(len(cats)), cats)
        ax.invert_yaxis()
        ax.set_xlim(0, max(ys) * 1.15)
    else:
        cats = [x for x, _ in series[names[0]]]
        width = 0.8 / len(names)
        for i, (name, colour) in enumerate(zip(names, colours)):
            ys = [y for _, y in series[name]]
            pos = np.arange(len(cats)) + (i - (len(names) - 1) / 2) * width
            bars = ax.bar(pos, ys, width * 0.95, color=colour, label=name)
            for b, y in zip(bars, ys):
                ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.2f}×" if ratio else f"{y:,.4g}", ha="center",
                        va="bottom", fontsize="small")
        ax.set_xticks(range(len(cats)), cats)
        ax.set_ylim(0, max(y for s in series.values() for _, y in s) * 1.18)
        if ratio:
            ax.axhline(1, color="black", lw=0.8)
    ax.set_xlabel(y_label if pub.kind == "barh" else pub.x_label)
    ax.set_ylabel(pub.x_label if pub.kind == "barh" else y_label)
    ax.set_title(pub.title, fontsize=NOTE, loc="right" if pub.kind == "barh" else "center")   # over the names too
    legend = len(names) > 1 or pub.kind == "line"
    if legend:
        handles, labels = ax.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.22 / height),
                   ncol=min(3, len(labels)), frameon=False)
    fig.text(0.01, 0.02 / height, f"published, not measured here: {pub.source}", fontsize="small", color="#555555")
    fig.tight_layout(rect=(0, (0.62 if legend else 0.25) / height, 1, 1))   # inches kept for legend and source
    return fig
