"""The appendix page of lecture 01: its deep dives, each a section function that the lecture's
main() calls inside `with deep_dive(...)`, in that order (what one block saves, tensor by
tensor; a step too big to hold; fp8 with fine-grained scales, with the helpers only it uses;
FlashAttention's backward; kernels and the roofline; the papers)."""
import math
import time

import torch
import torch.nn.functional as F

from util import cheat, note, plural, published, see, settings, table
from util.measure import machine, usable_cores, with_spread

from lectures.model.activations import block_activations
from lectures.model.attention import OnlineSoftmaxAttention, online_softmax_attention
from lectures.model.demos import blocked_and_sdpa, checked_attention_inputs
from lectures.model.figures import (delayed_scaling_figure, fmt_bytes, published_figure, roofline_figure, show,
                                    tile_error_figure)
from lectures.model.gpt import GPTConfig, causal_attention, param_count
from lectures.model.memory import SavedBytes
from lectures.model.precision import (accumulate, accumulation_error, fp8_matmul_error, ordinary_channels,
                                      outlier_matrices, overflow_table, quantize_fp8, scaled_mm_error,
                                      scaling_over_steps)
from lectures.model.gpu_evidence import TORCHAO_FP8_SHAPES, TORCHTITAN_FP8
from lectures.model.roofline import (bandwidths, write_allocate_rate, copy_bytes_beyond_cache, copy_rate, largest_cache_bytes,
                                     matmul_rate, threads)
from lectures.model.training_memory import MEM_CATEGORIES, fake_training_step


def saved_tensor_by_tensor(s0=None):
    """The tensors one block saves for backward, grouped by shape (fused attention)."""
    cfg = GPTConfig()
    b = 2
    s0 = s0 or (128 if settings.quick else 512)
    saved = block_activations(cfg, b, s0, causal_attention)
    sbh = s0 * b * cfg.d_model
    note(f"""
        The lecture's reconciliation names each term; here are the tensors autograd saved for one
        block at s = {s0}, as `SavedBytes` saw them, grouped by shape and dtype.
    """)
    groups = {}
    for shape, dtype, n in saved.tensors:
        key = (str(list(shape)), str(dtype).replace("torch.", ""), n)
        groups[key] = groups.get(key, 0) + 1
    table([[shape, dtype, count, n, count * n / (sbh * 4)] for (shape, dtype, n), count in
           sorted(groups.items(), key=lambda kv: -kv[0][2] * kv[1])],
          header=["shape", "dtype", "tensors", "bytes each", "all of them, in units of 4·s·b·h"],
          caption=f"what one block saves (fused attention), s = {s0}, b = {b}, h = {cfg.d_model}: "
                  f"{plural(len(saved.tensors), 'tensor')} of {plural(len(groups), 'shape')}")
    see(SavedBytes)


def a_step_too_big_to_hold():
    huge = GPTConfig(vocab_size=50304, seq_len=2048, d_model=8192, n_layers=2 if settings.quick else 4, n_heads=64)
    start = time.perf_counter()
    fake = fake_training_step(huge, batch_size=1)
    seconds = time.perf_counter() - start
    psi = param_count(huge)
    note(f"""
        The tracker of the anatomy section runs under `FakeTensorMode`, where tensors have shapes and dtypes but
        no storage. A GPT with h = {huge.d_model}, {huge.n_layers} layers and a vocabulary of
        {huge.vocab_size} has {psi / 1e9:.2f} billion parameters; one bf16 training step on one
        sequence of {huge.seq_len} tokens is traced in {seconds:.1f} s without allocating it
        (the optimizer here keeps its moments in bf16 too).
    """)
    table([[phase] + [fmt_bytes(r.get(c, 0)) for c in MEM_CATEGORIES] + [fmt_bytes(r["Total"])]
           for phase, r in fake.items()],
          header=["phase", "params", "grads", "optimizer", "activations", "temporaries", "total"],
          caption=f"Ψ = {psi:,}: 2Ψ bytes = {2 * psi / 1e9:.1f} GB of bf16 parameters (MemTracker under FakeTensorMode)")


def fp8_scaling():
    saturation()               # e4m3fn has no inf: a cast beyond its range saturates, silently
    tiles_win = tile_scaling()  # one scale per tensor, per token, per DeepSeek tile, per MXFP8 block
    fp8_gemm_sizes()           # published: where a real fp8 GEMM pays, by shape
    fp8_accumulation()         # tensor cores sum fp8 products in ~14 bits: promote to fp32
    delayed_scaling()          # a scale from past steps' amax saturates when the amax jumps
    return tiles_win


def saturation():
    note("## e4m3 saturates instead of overflowing")
    over = overflow_table()
    table([[name] + vals for name, vals in over.items()],
          header=["format", "1e3 becomes", "1e6 becomes", "inf becomes", "NaN becomes"],
          caption="`x.to(dtype)` on values beyond the range (PyTorch's casts)")
    e4 = over["fp8 e4m3fn"]
    note(f"""
        Past their largest value fp16 and e5m2 overflow to inf, which a check can see. e4m3fn
        has no infinity, and PyTorch's cast to it **saturates**: 1e6 becomes {e4[1]:g} and even
        inf becomes {e4[2]:g}. Saturation hides overflow: a tensor cast with too large a scale
        comes back finite and wrong, and no inf/NaN test (the one loss scaling relies on)
        fires. Whoever casts to e4m3 must choose the scale from the tensor's largest
        magnitude, as the rest of this deep dive does.
    """)


FP8_SCALINGS = {"per-tensor": (None, None, False), "row-wise (per token)": ((1, None), (None, 1), False),
                "per token, weight 128×128": ((1, None), (128, 128), False),
                "tiles 1×128, 128×128": ((1, 128), (128, 128), False),
                "MXFP8 1×32, exact scale": ((1, 32), (32, 1), False),
                "MXFP8 1×32, e8m0 scale": ((1, 32), (32, 1), True)}


def fp8_scaling_errors(a, w, channels):
    """{scaling: e4m3 matmul error} for each of `FP8_SCALINGS` (None in a tile: the whole
    reduction dimension, k), on the part of the product that `channels` carry."""
    k = a.shape[1]
    fill = lambda tile: tile and tuple(k if d is None else d for d in tile)
    return {name: fp8_matmul_error(a, w, fill(at), fill(wt), power_of_two=p2, channels=channels)
            for name, (at, wt, p2) in FP8_SCALINGS.items()}


# The activations' two granularities, compared with the weight's scales held fixed (128×128
# blocks in both): the row-wise column also changes the weight to one scale per column, which
# favours a weight whose few large entries a column scale maps onto 448 exactly.
PER_TOKEN, TILES = "per token, weight 128×128", "tiles 1×128, 128×128"


def tiles_first_win(rows):
    """The smallest outlier size at which 1×128 activation tiles err at least 10% less than one
    activation scale per token, the weight's 128×128 scales the same in both, read from the
    table's rows [(outlier, {scaling: error})]; None if they never do."""
    return next((o for o, e in rows if e[TILES] < 0.9 * e[PER_TOKEN]), None)


def fp8_verdict(rows):
    """Sentences saying which scaling wins, generated from the table's numbers: the activations'
    granularity compared with the weight's scales held fixed, then what per-column weight
    scales add."""
    rowwise, per_tensor = "row-wise (per token)", "per-tensor"
    first = tiles_first_win(rows)
    small = [(o, e) for o, e in rows if first is None or o < first]
    words = []
    if small:
        o, e = small[-1]
        words.append(f"With the weight's scales held fixed (128×128 blocks), up to {o:g}× outliers one activation "
                     f"scale per token is within 10% of 1×128 tiles: {e[PER_TOKEN]:.3g} against {e[TILES]:.3g} "
                     f"(per-tensor {e[per_tensor]:.3g}).")
    if first is None:
        words.append("At no outlier size here do 1×128 activation tiles beat one scale per token by 10% or more.")
    else:
        e = dict(rows)[first]
        words.append(f"From {first:g}× on, the tiles win: {e[TILES]:.3g} against {e[PER_TOKEN]:.3g} per token "
                     f"and per-tensor {e[per_tensor]:.3g}. A row's one scale is set by its outlier channels, "
                     f"which push that token's ordinary channels into e4m3's subnormals; a 1×128 tile "
                     f"pays only where an outlier channel falls inside it.")
    o, e = rows[0]
    words.append(f"The row-wise column changes the weight's scales too, one per output column: at {o:g}× it errs "
                 f"{e[rowwise]:.3g} against {e[PER_TOKEN]:.3g} with 128×128 weight blocks, because this weight's few "
                 f"large entries each get a scale that maps them onto 448, which a block shared by several cannot.")
    return " ".join(words)


def fp8_gemm_sizes():
    """What a real fp8 GEMM buys by shape, as published (the page's simulation cannot time it)."""
    shapes = TORCHAO_FP8_SHAPES.series["float8 / bf16"]
    note(f"""
        Whether fp8 pays depends on the GEMM's shape: the casts and the scales' reductions are
        memory-bound work the matmul must outweigh. torchao's microbenchmark on an H100 (forward
        and backward of a linear, dynamic scales) gives {shapes[0][1]:.2f}× bf16's speed at
        M, K, N = {shapes[0][0]} and {shapes[1][1]:.2f}× at {shapes[1][0]} (published, not
        measured here: [torchao float8 README]({TORCHAO_FP8_SHAPES.url}), {TORCHAO_FP8_SHAPES.where}).
        In a whole training step, with only the linears in fp8, that is {float8_gain_words()}
        bf16's tokens per second (torchtitan's runs, drawn on the main page).
    """)


def torchtitan_fp8_figure():
    """torchtitan's Llama 3.1 8B with float8 linears against bf16, as published."""
    show(published_figure(TORCHTITAN_FP8, height=2.1), TORCHTITAN_FP8.caption(
        f"Float8 linears against bf16: {float8_gain_words()} the tokens per second per GPU, at 8 and 128 GPUs."))


def float8_gain_words():
    """torchtitan's float8 linears against bf16, tokens per second, as published: 'a–b×'."""
    gain = [f / b for (_, b), (_, f) in zip(*TORCHTITAN_FP8.series.values())]
    return f"{min(gain):.2f}–{max(gain):.2f}×"


def tile_scaling():
    m, k, n = (256, 512, 256) if settings.quick else (512, 1024, 512)
    keep = ordinary_channels(k)
    rows = []
    for outlier in (1.0, 1e2, 1e3, 1e4, 1e5):
        a, w = outlier_matrices(m, k, n, outlier=outlier)
        errors = fp8_scaling_errors(a, w, keep)
        errors["e5m2 per-tensor"] = fp8_matmul_error(a, w, dtype=torch.float8_e5m2, channels=keep)
        rows.append((outlier, errors))
    a, w = outlier_matrices(m, k, n, outlier=rows[-1][0])
    pytorch = scaled_mm_error(a, w, channels=keep), scaled_mm_error(a, w, rowwise=True, channels=keep)
    note(f"""
        ## Deep dive: FP8 with fine-grained scales
        This section, with its two subsections, can be skipped on a first read: the later
        lectures do not depend on it. fp8 e4m3 has 3 mantissa bits and a range of ±448; to use it,
        each tensor is divided by a scale so its largest value lands near 448. One scale per
        tensor lets a single outlier push every other value down into the subnormals.
        LLM activations have outliers of two kinds: a few tokens ("massive activations",
        Sun et al. 2024) and a few fixed channels across every token (Dettmers et al. 2022).
        One scale per token (row-wise, what `torch._scaled_mm` takes) isolates the first kind,
        not the second. DeepSeek-V3 (§3.3) trains in fp8 with one scale per 1×128 tile of
        activations and per 128×128 block of weights, so an outlier only costs its own tile.
        The OCP microscaling formats (MXFP8) go further: one scale per block of 32
        consecutive values along the reduction dimension of both operands, and the scale
        itself is an 8-bit power of two (e8m0). The OCP specification takes
        2^(⌊log2 amax⌋ − 8) for e4m3 (8 is e4m3's largest exponent): it rounds down, and a
        block's largest values may saturate; ours rounds the scale up, so nothing saturates,
        which is NVIDIA's published recipe (Mishra et al. 2025 report that the floor rule
        diverged and rounding up trained an 8B model on 15T tokens).

        Simulated here: quantize, dequantize, multiply with an fp32 sum; activations of {m}
        tokens × {k} channels in which 1% of the tokens and {plural(int((~keep).sum()), 'channel')}
        are larger by the outlier factor, weights {k}×{n}. The error is the median over tokens
        of the relative error of the part of each output that the ordinary channels carry: the
        outlier channels act like biases (Sun et al.) and would dominate any norm of the whole
        output, hiding what their scale did to the others.
    """)
    see(quantize_fp8)
    names = list(rows[0][1])
    table([[o] + [e[name] for name in names] for o, e in rows], header=["outlier ×", *names],
          caption="e4m3 unless named; median over tokens i of ‖ĉ_i − c_i‖/‖c_i‖ against float64, "
                  "over the ordinary channels' part of each output")
    last = rows[-1][1]
    exact, e8m0 = last["MXFP8 1×32, exact scale"], last["MXFP8 1×32, e8m0 scale"]
    finer = "help further" if exact < last["tiles 1×128, 128×128"] else "do not help here"
    note(f"""
        {fp8_verdict(rows)} At {rows[-1][0]:g}×, MXFP8's finer blocks {finer}: {exact:.3g} with an
        exact scale (amax/448). Its e8m0 scale gives {e8m0:.3g}: it costs not through range (every binade
        of a floating-point format has the same 3 mantissa bits, so headroom left unused at the
        top costs no relative precision) but through each block's largest value, which an
        exact scale maps onto 448 without error and a power-of-two scale rounds like any other
        value; in a block of 32 that element carries a large share of each dot product.
        e5m2 trades a mantissa bit for range ({last['e5m2 per-tensor']:.3g} per tensor): coarser
        everywhere, which suits gradients more than activations and weights (DeepSeek-V3 uses
        e4m3 for all of them, with these scales). PyTorch's own fp8 matmul, `torch._scaled_mm`,
        which runs on this CPU, agrees with our simulation at {rows[-1][0]:g}×: per tensor
        {_maybe(pytorch[0])} (ours {last['per-tensor']:.4g}), row-wise {_maybe(pytorch[1])}
        (ours {last['row-wise (per token)']:.4g}; its output is bf16).

        The backward needs the other direction: the weight gradient's matmul reduces over
        tokens, so its activation operand must be scaled along the token dimension — a second
        quantized copy (DeepSeek-V3 requantizes activations as 128×1 tiles; MXFP8 keeps a
        row-wise and a column-wise copy of each tensor).
    """)
    a, w = outlier_matrices(m, k, n, outlier=rows[-2][0])
    show(tile_error_figure(a), caption=f"relative error of each activation after an e4m3 round trip, "
                                         f"the first 64 tokens × 256 features of the {rows[-2][0]:g}× outlier "
                                         "case: one scale per tensor (left) against one per 1×128 tile (right), "
                                         "on one colour scale")
    published("torchao's float8 training (`convert_to_float8_training`, tensorwise or rowwise scales) "
              "reports end-to-end pretraining speed-ups with torch.compile of up to 1.5× at 512 GPUs and "
              "405B parameters, and up to 1.25× at 8 GPUs and 8B parameters, against bf16 — a summary "
              f"on the docs page, not the torchtitan benchmark tables drawn below ({float8_gain_words()} "
              "at 8 and 128 H100s): two published sources, neither measured here.",
              "https://docs.pytorch.org/ao/stable/workflows/training.html",
              "PyTorch torchao documentation, Quantized Training: float8")
    see("https://arxiv.org/abs/2412.19437", "DeepSeek-AI 2024, DeepSeek-V3 Technical Report")
    see("https://arxiv.org/abs/2209.05433", "Micikevicius et al. 2022, FP8 Formats for Deep Learning")
    see("https://arxiv.org/abs/2310.10537", "Rouhani et al. 2023, Microscaling Data Formats for Deep Learning")
    see("https://arxiv.org/abs/2506.08027", "Mishra, Stosic & Layton 2025, Recipes for Pre-training LLMs with MXFP8")
    see("https://arxiv.org/abs/2402.17762", "Sun et al. 2024, Massive Activations in Large Language Models")
    see("https://arxiv.org/abs/2208.07339", "Dettmers et al. 2022, LLM.int8(): 8-bit Matrix Multiplication "
                                            "for Transformers at Scale")
    return tiles_first_win(rows)


def _maybe(x):
    return "(not run by this build)" if x is None else f"{x:.4g}"


ACCUMULATOR_MODELS = {"truncated after every product": (1, "truncate"),
                      "truncated after every 4 products": (4, "truncate"),
                      "truncated after every 32 products": (32, "truncate"),
                      "rounded to nearest after every product": (1, "nearest")}
PAPER_MAX_ERROR = 0.02      # DeepSeek-V3 §3.3.2: "a maximum relative error of nearly 2%" at k = 4096


def closest_to_paper(worst):
    """The accumulator model whose worst row error at k = 4096 is nearest (in ratio) the paper's 2%."""
    return min(worst, key=lambda name: abs(math.log(worst[name] / PAPER_MAX_ERROR)))


def fp8_accumulation():
    ks = [128, 512, 1024] if settings.quick else [128, 512, 1024, 2048, 4096]
    k_paper = 4096
    worst = {name: accumulation_error(k_paper, group=g, rounding=r, worst=True)
             for name, (g, r) in ACCUMULATOR_MODELS.items()}
    model = closest_to_paper(worst)
    group, rounding = ACCUMULATOR_MODELS[model]
    rows = [[k, accumulation_error(k, group=group, rounding=rounding),
             accumulation_error(k, group=group, rounding=rounding, promote_every=128)] for k in ks]
    note(f"""
        ### Where the fp8 products are summed
        A matmul's output is a sum of k products. On the GPUs DeepSeek-V3 trained on (H800),
        the fp8 tensor cores keep that running sum to only about 14 bits, not fp32's 24; for
        k = {k_paper} the paper reports a maximum relative error of nearly {PAPER_MAX_ERROR:.0%}. Its fix
        (§3.3.2): every N_C = 128 products, copy the partial sum out to an fp32 accumulator and
        start again. We simulate both on the CPU with e4m3 operands, against the exact product
        of the same e4m3 values. How the accumulator drops its bits is not documented, and
        the error depends on it far more than on the 14: at k = {k_paper} (32 rows of 32
        outputs), the worst row errs
        {'; '.join(f'{worst[name]:.2g} {name}' for name in worst)}.
        The model {model} comes closest to the paper's figure, so the table uses it: a fit to
        the paper's number, not a description of the hardware.
    """)
    see(accumulate)
    table(rows, header=["k (length of each sum)", f"14 bits, {model}", "the same, promoted to fp32 every 128"],
          caption="median over rows of ‖ĉ_i − c_i‖/‖c_i‖, 32×k by k×32 e4m3 operands, the accumulator's error alone")
    note(f"""
        The 14-bit accumulator's error grows with k, from {rows[0][1]:.2g} at k = {ks[0]} to
        {rows[-1][1]:.2g} at k = {ks[-1]}: every addition to a growing sum drops the bits below
        its 14th. Promoted every 128 products it stays at {rows[-1][2]:.2g}, because no partial
        sum ever holds more than 128 products.
    """)


def delayed_scaling():
    steps = 30
    amax = [1.0] * 10 + [8.0] + [1.0 + 0.15 * t for t in range(steps - 11)]
    history = 8
    errs = scaling_over_steps(amax, history=history)
    jump = 10
    late = [e[2] for e in errs[jump + history + 1:]]       # the jump has left the window
    growing = (f"Once the jump has left the window and the amax keeps growing, each step's delayed "
               f"scale is a little too small again: up to {max(late):.1%} of the values saturate per step."
               if late and max(late) > 0 else "")
    note(f"""
        ### Current against delayed scaling
        The scale needs the tensor's largest magnitude (amax) before the cast, which costs a
        pass over the tensor. *Current* scaling pays it; *delayed* scaling (NVIDIA's
        Transformer Engine) uses the largest amax of a window of past steps instead
        (Transformer Engine's default window, `DelayedScaling(amax_history_len=1024,
        amax_compute_algo="max")`, is 1024 steps; ours is {history}, so that the jump leaves
        the window within the plot).
        When the amax jumps, the delayed scale is too small (our scale divides, amax/448;
        Transformer Engine's `scale` multiplies, 448/amax, so there the stale one is too large),
        and the e4m3 cast saturates:
        at step {jump}, where the amax grew 8×, {errs[jump][2]:.0%} of the values were clipped
        to ±448 and the cast erred {errs[jump][1]:.2g} against current scaling's
        {errs[jump][0]:.2g} — with no inf to warn anyone (saturation, above). {growing}
        DeepSeek-V3 and MXFP8 compute their scales from the current tile or block.
    """)
    see(scaling_over_steps)
    see("https://nvidia.github.io/TransformerEngine/api/common.html",
        "Transformer Engine, Common API: DelayedScaling (amax_history_len, amax_compute_algo)")
    fig = delayed_scaling_figure(amax, steps, jump, errs, history)
    show(fig, caption="a tensor cast to e4m3 every step (4,096 Gaussian values scaled to the amax above): "
                        "the delayed scale lags the amax")


def flash_attention_backward():
    g, q, k, v = checked_attention_inputs()
    s = q.shape[2]
    checks = []
    for causal, bs, out, ref in blocked_and_sdpa(q, k, v):
        d_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
        g1 = torch.autograd.grad(out, (q, k, v), d_out)
        g2 = torch.autograd.grad(ref, (q, k, v), d_out)
        checks.append([causal, bs, max((x - y).abs().max().item() for x, y in zip(g1, g2))])
    note("""
        ## Deep dive: FlashAttention's backward
        This section can be skipped on a first read: lecture 06 uses the forward and the
        merge above; the backward is what makes the blocked version trainable without ever
        storing the s × s probabilities. Autograd through the blocked loop would save every
        tile's probabilities, which is the s × s matrix again in pieces. Instead the forward
        saves only q, k, v, the output and the lse (O(s) memory), and the backward walks the
        key blocks once more, recomputing each tile's probabilities from the saved lse,
        P = exp(S − lse), and accumulating dV, dQ and dK tile by tile — the backward of
        FlashAttention-2 (Dao 2023, Algorithm 2). One identity makes it cheap:
        rowsum(dP ∘ P) equals rowsum(dO ∘ O), a number per query computed once from the
        output.
    """)
    see(OnlineSoftmaxAttention)
    table(checks, header=["causal", "block size", "max |Δ grad q, k, v| vs SDPA"],
          caption=f"float64, (2, 3, {s}, 16), a random output gradient")
    errors = bf16_attention_errors()
    ours, sdpa = errors["ours"], errors["SDPA"]
    note(f"""
        In bf16 the forward computes each tile's scores $QK^T$ from fp32 copies of the operands,
        as the backward recomputes them: the backward's P is then the forward's. (Multiplying
        in bf16 and upcasting afterwards rounds every score to bf16's 8 bits first, and the
        backward's fp32 recomputation no longer matches it.) Causal attention, 2 heads × 256
        positions × 64, in bf16 against float64 on the same values: ours errs {ours[0]:.2%} in
        the output and {ours[1]:.2%} in dQ, PyTorch's SDPA {sdpa[0]:.2%} and {sdpa[1]:.2%}.
    """)
    see("https://arxiv.org/abs/2307.08691", "Dao 2023, FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning")


def bf16_attention_errors(s=256, d=64, block=64, seed=0):
    """Relative errors (output, dQ) of causal attention in bf16 against float64 on the same
    bf16-representable q, k, v and output gradient: ours (online softmax, blocked backward)
    and PyTorch's SDPA."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(1, 2, s, d, generator=g, dtype=torch.float64).bfloat16().double()
                      for _ in range(4))

    def run(attend, dtype):
        qq = q.to(dtype).detach().clone().requires_grad_(True)   # a leaf of its own, whatever the dtype
        out = attend(qq, k.to(dtype), v.to(dtype))
        out.backward(d_out.to(dtype))
        return out.double(), qq.grad.double()
    exact = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), torch.float64)
    rel = lambda x, y: ((x - y).norm() / y.norm()).item()
    return {name: tuple(rel(x, y) for x, y in zip(run(fn, torch.bfloat16), exact)) for name, fn in
            (("ours", lambda a, b, c: online_softmax_attention(a, b, c, block, causal=True)),
             ("SDPA", lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)))}


def roofline():
    sizes = [64, 128, 256, 512] if settings.quick else [64, 128, 256, 512, 1024]
    cores = usable_cores()
    mm_one = {n: matmul_rate(n) for n in sizes}          # the demos' setting: one thread
    cache = largest_cache_bytes()
    nbytes = copy_bytes_beyond_cache(cache)               # source + destination ≥ 4× the largest cache
    with threads(cores):                                  # the machine: every usable core
        mm = {n: matmul_rate(n) for n in sizes}
        rates = bandwidths(nbytes)                        # copy, add, GELU side by side
    bw, bw_t = rates["copy"]
    add = (rates["add"][0] / 12, rates["add"][1], 1 / 12)    # (FLOP/s, Timing, FLOP per byte)
    gelu = (rates["gelu"][0], rates["gelu"][1], 8 / 8)       # 8 FLOP per element (assumed) per 8 bytes
    peak = max(r for r, _ in mm.values())
    def gb_range(rate, t):        # bandwidth's interquartile range from the timing's
        moved = rate * t.median
        return moved / t.q3, moved / t.q1
    ranges = {"copy": gb_range(bw, bw_t), "add": gb_range(add[0] / add[2], add[1]),
              "GELU": gb_range(gelu[0] / gelu[2], gelu[1])}
    apart = [k for k in ("add", "GELU") if ranges[k][0] > ranges["copy"][1] or ranges[k][1] < ranges["copy"][0]]
    side = {k: "above" if ranges[k][0] > ranges["copy"][1] else "below" for k in apart}
    against_copy = ("the spreads overlap, so this machine cannot tell the three apart: all are bound by memory"
                    if not apart else
                    " and ".join(f"{k} {side[k]}" for k in apart) + " the copy's rate beyond the interquartile ranges"
                    + (f". Counted bytes leave out write-allocate: a store to a line not in cache first reads it, "
                       f"so the copy really moves 12 bytes per element where we count 8, the add 16 where we count "
                       f"12, and at the copy's real bandwidth the add's counted rate is 1.125× the copy's: "
                       f"{write_allocate_rate(bw, 'add') / 1e9:.1f} GB/s expected, "
                       f"{add[0] / add[2] / 1e9:.1f} GB/s measured" if side.get("add") == "above" else ""))
    in_cache = [n for n, (r, _) in mm.items() if n / 6 < peak / bw and r > n / 6 * bw]
    above_roof = (f" The matmuls with n = {', '.join(map(str, in_cache))} sit above the memory roof: "
                  "their operands fit in cache, which is faster than the memory the copy measured, "
                  "so the roofline drawn from main memory does not bind them." if in_cache else "")
    cache_words = (f"source and destination together are {2 * nbytes / cache:.0f}× the largest cache, "
                   f"{fmt_bytes(cache)}, so this is memory's bandwidth, not a cache's" if cache else
                   "this machine does not report its cache sizes; part of the copy may run in cache")
    note(f"""
        ## Deep dive: kernels and the roofline
        This section can be skipped on a first read: it explains why some operations are
        slow, which later lectures mention but do not build on. A kernel is limited either by
        arithmetic or by moving bytes. The roofline (Williams et al. 2009) plots attainable
        FLOP/s against arithmetic intensity (FLOP per byte moved):
        min(peak FLOP/s, intensity × bandwidth). With {plural(cores, 'thread')}, in one process: the best fp32
        matmul reaches {peak / 1e9:.1f} GFLOP/s and copying {fmt_bytes(nbytes)} moves
        {with_spread(f"{bw / 1e9:.1f} GB/s", f"a copy takes {bw_t.ms()}")} ({cache_words}), so the ridge is at
        {peak / bw:.1f} FLOP/byte. An n×n matmul does 2n³ FLOP on 12n² bytes (intensity n/6):
        here those with n/6 above the ridge (n ≥ {math.ceil(6 * peak / bw)}) can be compute
        bound; an element-wise add does 1 FLOP per 12 bytes and is bound by memory at any size:
        timed side by side with the copy, each writing into a preallocated output, it moved
        {add[0] / add[2] / 1e9:.1f} GB/s and GELU {gelu[0] / gelu[2] / 1e9:.1f} GB/s against
        the copy's {bw / 1e9:.1f}: {against_copy}. GELU is plotted at an assumed 8 FLOP per element
        (its real count depends on how the kernel evaluates erf).{above_roof}

        The GPU kernel techniques that the later lectures assume: **coalescing** (neighbouring
        threads read neighbouring addresses, so one memory transaction serves many),
        **tiling** (load a block of the operands into fast on-chip memory and reuse it many
        times: what raises a matmul's intensity, and what FlashAttention does for attention),
        and **fusion** (one kernel for a chain of element-wise operations, so the intermediate
        never goes to memory: the GELU below moves its bytes once).
    """)
    cheat("roofline ridge point",
          "attainable FLOP/s $= \\min(\\text{peak},\\ I \\cdot \\text{bandwidth})$; compute-bound above "
          "$I^* = \\text{peak} / \\text{bandwidth}$ FLOP per byte",
          peak / bw, "FLOP/byte", what=f"fp32 matmul peak over copy bandwidth, {plural(cores, 'thread')}, this machine")
    if not torch.cuda.is_available():
        note("No GPU on this machine: the GPU roofline measurement is skipped; on a GPU the "
             "same functions (`matmul_rate`, `copy_rate` with `dev='cuda'`) measure it.")
    else:
        gpu_peak = max(matmul_rate(n, torch.bfloat16, "cuda")[0] for n in (2048, 4096, 8192))
        gpu_bw, _ = copy_rate(512 * 2 ** 20, "cuda")
        note(f"GPU ({torch.cuda.get_device_name(0)}): bf16 matmul {gpu_peak / 1e12:.0f} TFLOP/s, "
             f"copy {gpu_bw / 1e9:.0f} GB/s, ridge {gpu_peak / gpu_bw:.0f} FLOP/byte.")
    table([[f"matmul {n}×{n}", n / 6, r / 1e9, t.ms(), mm_one[n][0] / 1e9] for n, (r, t) in mm.items()]
          + [["add", add[2], add[0] / 1e9, add[1].ms(), None], ["GELU (8 FLOP/element, assumed)", gelu[2], gelu[0] / 1e9, gelu[1].ms(), None]],
          header=["kernel", "FLOP per byte", f"GFLOP/s, {plural(cores, 'thread')}", "time", "GFLOP/s, 1 thread"],
          caption=f"fp32, {machine()}")
    fig = roofline_figure(sizes, mm, add, gelu, peak, bw)
    show(fig, caption=f"roofline of this machine, {machine()}")
    see("https://doi.org/10.1145/1498765.1498785", "Williams, Waterman & Patterson 2009, Roofline: an insightful visual performance model")


def references():
    note("## Papers")
    for url, title in [
        ("https://arxiv.org/abs/2205.05198", "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models"),
        ("https://arxiv.org/abs/1604.06174", "Chen et al. 2016, Training Deep Nets with Sublinear Memory Cost"),
        ("https://arxiv.org/abs/1710.03740", "Micikevicius et al. 2018, Mixed Precision Training"),
        ("https://arxiv.org/abs/1905.12322", "Kalamkar et al. 2019, A Study of BFLOAT16 for Deep Learning Training"),
        ("https://arxiv.org/abs/1910.02054", "Rajbhandari et al. 2020, ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"),
    ]:
        see(url, title=title)
