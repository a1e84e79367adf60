"""Lecture 01's figures: the drawings of its page (memory by phase, bytes per parameter, saved
activations, recomputation, accumulation, number formats, fp8 tiles, attention by blocks), and
`show`, the page's `util.figure` with tick labels readable at a phone's width. Each helper takes
what a demo measured and returns a matplotlib figure; the lecture narrates and shows it."""
import math

import torch

from lectures.model.precision import FORMATS, dequantize_fp8, quantize_fp8
from lectures.model.training_memory import MEM_CATEGORIES
from util import figure


def show(fig, caption=""):
    """`util.figure` with tick labels large enough to read when the page shrinks the figure to
    a phone's width, and log axes labelled with plain numbers (16, 0.001) at their major ticks
    only, never "2×10⁰"."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax in fig.axes:
        ax.tick_params(labelsize=11)
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
    ax.set_xticks(x, [short[r["phase"]] for r in rows], fontsize=12)
    for step in sorted({r["step"] for r in rows}):
        xs = [xi for xi, r in zip(x, rows) if r["step"] == step]
        ax.text(sum(xs) / len(xs), bottom.max() * 1.06, f"step {step}", ha="center", fontsize=12)
        if step > 1:
            ax.axvline(xs[0] - 0.7, color="gray", lw=0.8, ls=":")
    ax.set_ylabel("MB held (MemTracker)", fontsize=12)
    ax.legend(fontsize=12, ncol=2, loc="lower center", bbox_to_anchor=(0.5, 1.01), frameon=False)
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
        ax.text(left + 0.2, i, f"{left:.3g}", va="center", fontsize=12)
    ax.set_yticks(range(len(names)), names, fontsize=12)
    ax.invert_yaxis()
    ax.set_xlim(0, max(sum(v.values()) for v in setups.values()) / psi * 1.12)
    ax.set_xlabel("bytes per parameter", fontsize=12)
    ax.tick_params(labelsize=12)
    ax.legend(fontsize=11, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.01), frameon=False)
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
    ax.set_xlabel("sequence length s", fontsize=12)
    ax.set_ylabel("MB saved per layer", fontsize=12)
    ax.legend(fontsize=11)
    return fig


def recomputation_figure(results, timings):
    """Two panels: bytes held after the forward, and time of forward + backward, per mode."""
    import matplotlib.pyplot as plt
    modes = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 2.9))
    held = [results[m]["held"] / 1e6 for m in modes]
    ax1.bar(modes, held, color=["C0", "C1", "C2"])
    for i, h in enumerate(held):
        ax1.text(i, h, f"{h:.2f}", ha="center", va="bottom", fontsize=12)
    ax1.set_ylim(0, max(held) * 1.2)
    ax1.set_ylabel("MB held after forward", fontsize=12)
    ms = [timings[m].median * 1e3 for m in modes]
    err = [[(timings[m].median - timings[m].q1) * 1e3 for m in modes],
           [(timings[m].q3 - timings[m].median) * 1e3 for m in modes]]
    ax2.bar(modes, ms, yerr=err, capsize=4, color=["C0", "C1", "C2"])
    ax2.set_ylabel("ms, forward + backward", fontsize=12)
    for ax in (ax1, ax2):
        ax.tick_params(labelsize=12)
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
        ax.text(i, m, fmt_bytes(r[2]), ha="center", va="bottom", fontsize=12)
    ax.set_xticks(range(len(ks)), [f"k = {k}" for k in ks], fontsize=12)
    ax.set_ylim(0, max(mb) * 1.2)
    ax.set_ylabel("MB held after a forward", fontsize=12)
    ax.tick_params(labelsize=12)
    ax.legend(fontsize=12)
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
                        color="white", fontsize=12, fontweight="bold")
            x += n
        ax.text(-0.6, y + 0.5, name, ha="right", va="center", fontsize=12)
    for label, color in (("sign", "#d62728"), ("exponent bits (range)", "#1f77b4"),
                         ("mantissa bits (resolution)", "#2ca02c")):
        ax.bar(0, 0, color=color, alpha=0.75, label=label)
    ax.set_xlim(-9, 33)
    ax.set_ylim(0, len(FORMATS) + 0.2)
    ax.set_xticks(range(0, 33, 8))
    ax.set_xlabel("bits", fontsize=12)
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.legend(fontsize=11, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
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
        ax.set_title(name, fontsize=12)
        ax.set_xlabel("feature", fontsize=12)
        for x in range(128, features, 128):
            ax.axvline(x - 0.5, color="white", lw=1, ls="--")
    axes[0].set_ylabel("token", fontsize=12)
    bar = fig.colorbar(im, ax=axes, shrink=0.9)
    bar.set_ticks([-4, -3, -2, -1, 0], labels=["≤1e-4", "1e-3", "1e-2", "0.1", "1 (lost)"])
    bar.ax.tick_params(labelsize=11)
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
        ax.text(st + width / 2, -0.6, f"step {i + 1}", ha="center", va="bottom", fontsize=12)
        ax.axvline(st, color="black", lw=1)
    ax.set_xlim(0, s)
    ax.set_ylim(s, -1.8)
    ax.set_aspect("equal")
    ax.set_xlabel("key position (blocks of keys, one per loop step)", fontsize=12)
    ax.set_ylabel("query position", fontsize=12)
    ax.tick_params(labelsize=11)
    return fig
