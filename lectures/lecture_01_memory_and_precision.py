"""Memory and precision on one device

Before any communication: what a training step holds in memory, how number formats trade range
for resolution, and why both decide everything the later lectures do. This lecture also defines
the small GPT and the learnable synthetic task that lectures 04–07 train.

The building blocks live in modules beside this file, and this file narrates them: the model and
the task in `gpt.py`, the two memory meters in `memory.py`, a step's memory by category in
`training_memory.py`, activation accounting, recomputation and accumulation in `activations.py`,
number formats, loss scaling, master weights and fp8 in `precision.py`, blocked attention with an
online softmax in `attention.py`, and the roofline's rates in `roofline.py`.
"""
import dataclasses
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from util import device, figure, note, see, settings, spawn, table
from util.measure import machine, measure, usable_cores

from lectures.activations import (Recomputed, _save_matmuls, accumulated_gradients,  # noqa: F401
                                  block_activations, korthikanti_bytes, reconciled_bytes,
                                  recomputation_step, with_recomputation)
from lectures.attention import (OnlineSoftmaxAttention, attention_with_lse, merge_attention,  # noqa: F401
                                naive_causal_attention, online_softmax_attention)
from lectures.gpt import (GPT, Block, CausalSelfAttention, GPTConfig, MLP, batch,  # noqa: F401
                          causal_attention, entropy_rate, loss_fn, markov_chain, param_count)
from lectures.memory import LiveBytes, SavedBytes
from lectures.precision import (FORMATS, MasterWeights, dequantize_fp8, format_properties,  # noqa: F401
                                fp8_matmul_error, fp16_gradients, fp32_gradients, gradient_error,
                                outlier_matrices, quantize_fp8, relative_error_across_magnitudes,
                                round_to, scaled_mm_error, train_curve)
from lectures.roofline import copy_rate, elementwise_rate, matmul_rate, threads
from lectures.training_memory import (MEM_CATEGORIES, by_category, fake_training_step,  # noqa: F401
                                      held_by_training, memory_timeline)


# =========================================================================================
# Page-only helpers and the one demo spawned on ranks
# =========================================================================================

def attention_peak_bytes(attend, b, heads, s, d, backward=False, seed=0):
    """Most bytes alive at once while `attend(q, k, v)` runs (and its backward, if asked),
    beyond the inputs, measured with LiveBytes: a view of q, k or v (kᵀ) is not new memory;
    their gradients, allocated by the backward, are."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, heads, s, d, generator=g, requires_grad=backward) for _ in range(3))
    with LiveBytes() as live:
        out = attend(q, k, v)
        if backward:
            out.sum().backward()
    return live.peak


def same_on_every_rank(rank, world_size, cfg, batch_size=8, step=3):
    """Each rank builds batch `step` and the initial GPT by itself; an all-gather of their
    checksums shows whether every rank got the same (what lectures 03–07 rely on)."""
    tokens, _ = batch(cfg, batch_size, step)
    model = GPT(cfg)
    mine = torch.tensor([float(tokens.sum()), float(tokens[:, 0].sum()),
                         sum(p.detach().double().sum().item() for p in model.parameters())],
                        dtype=torch.float64, device=device())
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    return {"identical": all(torch.equal(e, everyone[0]) for e in everyone),
            "checksums": [e.tolist() for e in everyone]}


def fmt_bytes(n):
    for unit, k in [("GB", 1e9), ("MB", 1e6), ("kB", 1e3)]:
        if abs(n) >= k:
            return f"{n / k:.3g} {unit}"
    return f"{n:.0f} B"


def intro():
    note("""
        ## Memory and precision on one device
        Every later lecture splits something — the batch, the layers, the sequence, the
        optimizer state — across devices. What there is to split, and how many bytes each
        piece takes, is decided here on one device: a training step holds parameters,
        gradients, optimizer state, activations and temporaries, and the number format of each
        decides its size and what it can represent. Everything below is measured on this
        machine by the run that built this page, on the small GPT that lectures 04–07 train.
    """)


def the_model_and_task():
    cfg = GPTConfig()
    steps = 60 if settings.quick else 100
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    start = time.perf_counter()
    for t in range(steps):
        tokens, targets = batch(cfg, 16, t)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    floor = entropy_rate(cfg)
    note(f"""
        ## The model and the task
        A pre-LayerNorm GPT: token and learned position embeddings, L blocks of
        x + attention(LN(x)) then x + MLP(LN(x)), a final LayerNorm and a linear head.
        Q, K and V are separate projections (lecture 04 splits their heads across ranks, and
        grouped-query attention gives K and V fewer heads); the attention function is an
        attribute, `attn.attend`, that lectures 06 and 07 swap for distributed versions.
        The data: walks through a fixed random Markov chain over {cfg.vocab_size} tokens in
        which each token has a few likely successors. A model that learns the chain reaches its
        entropy rate, {floor:.3f} nats/token; guessing uniformly costs ln {cfg.vocab_size} =
        {math.log(cfg.vocab_size):.3f}. `batch(cfg, batch_size, step)` depends only on its
        arguments, so every rank of a later lecture builds the same global batch.
    """)
    see(GPTConfig)
    see(Block)
    see(batch)
    ranks = min(2, settings.world_size)        # two ranks show it; more only cost start-up time
    run = spawn(same_on_every_rank, ranks, cfg=cfg,
                name="batch and initial weights built on every rank")
    same = all(r["identical"] for r in run.returns)
    table([[r, *c] for r, c in enumerate(run.returns[0]["checksums"])],
          header=["rank", "sum of batch 3's tokens", "sum of its first column", "sum of the initial weights"],
          caption=f"{ranks} ranks each built batch 3 and GPT(cfg) alone: "
                  + ("identical on every rank" if same else "**ranks disagree**"))
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3))
    ax.plot(range(1, steps + 1), losses, label="training loss")
    ax.axhline(floor, color="gray", ls="--", label="entropy rate (best possible)")
    ax.axhline(math.log(cfg.vocab_size), color="gray", ls=":", label="uniform guess")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=8)
    figure(fig, caption=f"AdamW, lr 3e-3, batch 16 × {cfg.seq_len} tokens, {steps} steps in "
                        f"{seconds:.1f} s ({machine()}): from {losses[0]:.2f} to {losses[-1]:.2f}")


def anatomy_of_a_step():
    cfg = GPTConfig()
    rows = memory_timeline(cfg, batch_size=16, steps=3)
    note("""
        ## Anatomy of a step, measured
        PyTorch's `MemTracker` (in `torch.distributed._tools.mem_tracker`) intercepts every
        tensor allocation and files it under parameter, gradient, optimizer state, activation
        or temporary; it works on the CPU. We train three AdamW steps and read it after each
        phase of each step (calling `reset_mod_stats()` between iterations), and beside it our
        own accounting from the tensors themselves (parameter and gradient sizes, the optimizer
        state dict, and the bytes autograd saved for backward, de-duplicated by storage).
    """)
    see(memory_timeline)
    table([[r["step"], r["phase"]] + [r["tracker"].get(c, 0) for c in MEM_CATEGORIES] +
           [r["tracker"]["Total"], r["own"]["Parameter"], r["own"]["Gradient"], r["own"]["Optstate"],
            r["own"]["Activation"], r["peak"]] for r in rows],
          header=["step", "after", "params", "grads", "optimizer", "activations", "temporaries",
                  "MemTracker total", "own: params", "own: grads", "own: optimizer",
                  "own: saved for backward", "LiveBytes peak in phase"],
          caption=f"bytes, GPT {param_count(cfg):,} parameters, batch 16 × {cfg.seq_len}, fp32 AdamW")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, ax = plt.subplots(figsize=(8, 3.4))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for c in MEM_CATEGORIES:
        vals = np.array([r["tracker"].get(c, 0) for r in rows]) / 1e6
        ax.bar(x, vals, bottom=bottom, label=c)
        bottom += vals
    ax.set_xticks(x, [f"{r['step']}:{r['phase'][:4]}" for r in rows], rotation=60, fontsize=7)
    ax.set_ylabel("MB (MemTracker)")
    ax.legend(fontsize=7, ncol=5)
    figure(fig, caption="memory after each phase of the first three steps: the optimizer state "
                        "appears at step 1's optimizer step and stays; gradients live from backward "
                        "to zero_grad; activations from forward to backward")
    first, later = rows[2]["tracker"]["Total"], rows[6]["tracker"]["Total"]
    top = max(rows, key=lambda r: r["peak"])
    note(f"""
        Step 1 grows: AdamW allocates its two moments (m and v, {fmt_bytes(rows[2]['own']['Optstate'])}
        = 2 × the parameters' {fmt_bytes(rows[2]['own']['Parameter'])}) at its first
        `step()`. From then on the pattern repeats: after the optimizer step the total is
        {fmt_bytes(first)} at step 1 and {fmt_bytes(later)} at step 2. The activations
        saved for backward ({fmt_bytes(rows[0]['own']['Activation'])} by our count; MemTracker
        files {fmt_bytes(rows[0]['tracker']['Activation'])} under activations, including the
        logits and loss that are not saved for backward) are {rows[0]['own']['Activation'] / rows[0]['own']['Parameter']:.1f}×
        the parameters here: with a small model and a modest batch, activations already dominate.
        The last column is `LiveBytes`' peak in each phase: the most bytes alive at once that
        were allocated since training began, so everything but the parameters. It is highest
        in step {top['step']}'s {top['phase']} ({fmt_bytes(top['peak'])}, {top['peak'] / rows[0]['own']['Parameter']:.1f}× the
        parameters).
    """)


def parameters_and_bytes():
    configs = [GPTConfig(), GPTConfig(n_kv_heads=2), GPTConfig(tie_embeddings=True),
               GPTConfig(d_model=96, n_heads=6, n_kv_heads=3, n_layers=3, d_ff=200, vocab_size=101, seq_len=17),
               GPTConfig(d_model=768, n_heads=12, n_layers=12, vocab_size=50257, seq_len=1024, tie_embeddings=True)]
    rows = []
    for c in configs:
        h, v, L = c.d_model, c.vocab_size, c.n_layers
        numel = sum(p.numel() for p in GPT(c).parameters()) if h < 512 else None
        rows.append([f"h={h} L={L} a={c.n_heads} kv={c.kv_heads} f={c.ff} v={v} s={c.seq_len}"
                     + (" tied" if c.tie_embeddings else ""),
                     h * v + L * (12 * h * h + 13 * h) + 2 * h, param_count(c), numel])
    note("""
        ## Parameters and bytes per parameter
        The usual estimate Ψ ≈ h·v + L·(12h² + 13h) + 2h counts an embedding, per layer 4h² + 4h
        for attention (Q, K, V, O with biases), 8h² + 5h for a 4h MLP, 4h for two LayerNorms,
        and a final LayerNorm. `param_count` is the exact count for this architecture — learned
        positions (s·h), an untied head (h·v), K and V narrower under grouped-query attention,
        any MLP width — and equals `sum(p.numel())` of the built model.
    """)
    see(param_count)
    table(rows, header=["config", "estimate h·v + L(12h²+13h) + 2h", "param_count", "sum(p.numel())"],
          caption="the last row is GPT-2 small (124M with tied embeddings); its numel is not built here")

    cfg = GPTConfig()
    tokens, targets = batch(cfg, 8, 0)
    fp32 = GPT(cfg)
    opt = torch.optim.AdamW(fp32.parameters(), lr=1e-3)
    loss_fn(fp32(tokens), targets).backward()
    opt.step()
    psi = param_count(cfg)
    fp32_held = held_by_training(fp32, opt)
    mixed = {}
    for acc in (False, True):
        model = GPT(dataclasses.replace(cfg, dtype="bfloat16"))
        mw = MasterWeights(model, lr=1e-3, fp32_accumulation=acc)
        loss_fn(model(tokens), targets).backward()
        if acc:
            mw.accumulate()
            loss_fn(model(tokens), targets).backward()   # the next micro-batch's bf16 gradients
        mw.step()
        loss_fn(model(tokens), targets).backward()       # gradients exist during the next step
        mixed[acc] = mw.held()
    rows = [["fp32 AdamW", "parameters", fp32_held["Parameter"] / psi],
            ["", "gradients", fp32_held["Gradient"] / psi],
            ["", "Adam m and v", fp32_held["Optstate"] / psi],
            ["", "**total**", sum(fp32_held.values()) / psi]]
    for acc in (False, True):
        label = "bf16 + fp32 master" + (", fp32 grad accumulation" if acc else "")
        for i, (k, b) in enumerate(mixed[acc].items()):
            rows.append([label if i == 0 else "", k, b / psi])
        rows.append(["", "**total**", sum(mixed[acc].values()) / psi])
    note("""
        Bytes per parameter, measured from the tensors a real setup holds after a step: fp32
        AdamW keeps 4 + 4 + 8 = 16. Mixed precision computes in bf16 but keeps an fp32 master
        copy for the update, because bf16 cannot represent small updates (below): 2 + 2 + 4 + 8
        = 16 again — mixed precision saves activation memory and time, not state — and 20 with
        an fp32 buffer that sums gradients over micro-batches. This 16Ψ is what ZeRO (lecture
        03) divides among ranks.
    """)
    see(MasterWeights)
    table(rows, header=["setup", "tensor", "bytes per parameter (measured)"],
          caption=f"Ψ = {psi:,}")


def activation_memory():
    saved_against_formula()    # what autograd saves for one block, term by term against the paper
    a_step_too_big_to_hold()   # the same tracker on shapes alone, at billions of parameters


def saved_against_formula():
    cfg = GPTConfig()
    b = 2
    seqs = [16, 32, 64, 128] if settings.quick else [16, 32, 64, 128, 256, 512]
    measured = {"sdpa": [], "naive": []}
    for s in seqs:
        measured["sdpa"].append(block_activations(cfg, b, s, causal_attention).total)
        measured["naive"].append(block_activations(cfg, b, s, naive_causal_attention).total)
    reconciled = {k: [sum(reconciled_bytes(cfg, b, s, k).values()) for s in seqs] for k in measured}
    paper = [korthikanti_bytes(cfg, b, s) for s in seqs]
    note("""
        ## Activation memory against the formula
        Korthikanti et al. count what one transformer layer keeps for backward in 16-bit with
        dropout: s·b·h·(34 + 5·a·s/h) bytes. We measure what autograd really saves for one
        of our blocks: `torch.autograd.graph.saved_tensors_hooks` sees every tensor saved for
        backward; we count each storage once (q, k and v are views of separate projections,
        but the output of LN1 feeds all three and is saved once) and leave out the weights.
    """)
    see(SavedBytes)
    s0 = seqs[-1]
    saved = block_activations(cfg, b, s0, causal_attention)
    sbh = s0 * b * cfg.d_model
    table([[str(list(shape)), str(dtype).replace("torch.", ""), n, n / (sbh * 4)] for shape, dtype, n in saved.tensors],
          header=["shape", "dtype", "bytes", "in units of 4·s·b·h"],
          caption=f"what one block saves (fused attention), s = {s0}, b = {b}, h = {cfg.d_model}")
    terms = reconciled_bytes(cfg, b, s0, "sdpa")
    terms_naive = reconciled_bytes(cfg, b, s0, "naive")
    table([[k, v] for k, v in terms.items()] + [["**total (reconciled)**", sum(terms.values())],
                                                ["**measured**", saved.total]],
          header=["term", "bytes"], caption=f"reconciliation, fused attention, s = {s0}")
    see(reconciled_bytes)
    note(f"""
        Term by term: the paper's 34·s·b·h (2 bytes per element) counts 17 tensors of s·b·h
        elements; ours keeps 16 (the paper's two dropout masks, 1 byte each, do not exist
        without dropout: 34 − 2 = 32 = 2 × 16), at 4 bytes since we train in fp32. The
        s² term depends on the attention: the naive version keeps the fp32 probabilities
        ({fmt_bytes(terms_naive['softmax probabilities (a·s per token)'])} at s = {s0}) where the
        paper keeps softmax output, dropout mask and dropout output (5·a·s²·b bytes);
        the fused kernel PyTorch uses on this CPU (`scaled_dot_product_attention`) keeps only
        a log-sum-exp per query and head: no s² term at all — FlashAttention's idea, built
        below. Measured and reconciled agree to the byte at every s
        ({sum(m == r for m, r in zip(measured['sdpa'] + measured['naive'], reconciled['sdpa'] + reconciled['naive']))}
        of {2 * len(seqs)} sizes).
    """)
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.plot(seqs, [m / 1e6 for m in measured["naive"]], "o", label="measured, naive attention")
    ax.plot(seqs, [m / 1e6 for m in measured["sdpa"]], "s", label="measured, fused (SDPA)")
    ax.plot(seqs, [r / 1e6 for r in reconciled["naive"]], "-", color="C0", lw=1, label="reconciled, naive")
    ax.plot(seqs, [r / 1e6 for r in reconciled["sdpa"]], "-", color="C1", lw=1, label="reconciled, fused")
    ax.plot(seqs, [2 * p / 1e6 for p in paper], "--", color="gray", label="paper × 2 (fp32)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("MB saved per layer")
    ax.legend(fontsize=7)
    figure(fig, caption=f"activations saved by one block, b = {b}, h = {cfg.d_model}, a = {cfg.n_heads}: "
                        "linear in s with the fused kernel, quadratic once a·s/h outgrows the rest with naive attention")


def a_step_too_big_to_hold():
    huge = GPTConfig(vocab_size=50304, seq_len=2048, d_model=8192, n_layers=2 if settings.quick else 4, n_heads=64)
    start = time.perf_counter()
    fake = fake_training_step(huge, batch_size=1)
    seconds = time.perf_counter() - start
    psi = param_count(huge)
    note(f"""
        The same tracker runs under `FakeTensorMode`, where tensors have shapes and dtypes but
        no storage. A GPT with h = {huge.d_model}, {huge.n_layers} layers and a vocabulary of
        {huge.vocab_size} has {psi / 1e9:.2f} billion parameters; one bf16 training step on one
        sequence of {huge.seq_len} tokens is traced in {seconds:.1f} s without allocating it
        (the optimizer here keeps its moments in bf16 too).
    """)
    table([[phase] + [r.get(c, 0) / 1e9 for c in MEM_CATEGORIES] + [r["Total"] / 1e9] for phase, r in fake.items()],
          header=["after", "params GB", "grads GB", "optimizer GB", "activations GB", "temporaries GB", "total GB"],
          caption=f"Ψ = {psi:,}: 2Ψ bytes = {2 * psi / 1e9:.1f} GB of bf16 parameters (MemTracker under FakeTensorMode)")


def recomputation():
    cfg = GPTConfig(n_layers=4)
    bsz = 16 if settings.quick else 32
    results, timings = {}, {}
    for mode in ("none", "selective", "full"):
        results[mode] = recomputation_step(cfg, bsz, mode)
        model = results[mode]["model"]
        tokens, targets = batch(cfg, bsz, 0)

        def step():
            loss_fn(model(tokens), targets).backward()
        timings[mode] = measure(step, warmup=1, repeats=5 if settings.quick else 9)
    ref = results["none"]["grads"]
    note("""
        ## Activation recomputation
        Keep fewer activations and recompute the rest during backward (Chen et al. 2016).
        `torch.utils.checkpoint` with `use_reentrant=False` keeps only a block's input and runs
        its forward again in backward ("full"); with `create_selective_checkpoint_contexts` a
        policy decides per operator: ours keeps the matmul and attention outputs and recomputes
        LayerNorms and GELU ("selective"). Saved-tensor hooks cannot see inside a checkpoint,
        so the bytes held between forward and backward are measured with `LiveBytes`, a
        `TorchDispatchMode` that tracks every storage an operator creates until it is freed
        (views and in-place results of older tensors, such as a weight's transpose, are not
        new memory and are not counted).
    """)
    see(_save_matmuls)
    see(Recomputed)
    table([[m, r["held"], r["held"] / results["none"]["held"], r["peak"], timings[m].ms(),
            timings[m].median / timings["none"].median,
            max((r["grads"][k] - ref[k]).abs().max().item() for k in ref)] for m, r in results.items()],
          header=["recomputation", "bytes held after forward", "vs none", "peak bytes fwd+bwd",
                  "forward+backward", "time vs none", "max |Δ grad| vs none"],
          caption=f"GPT with {cfg.n_layers} layers, batch {bsz} × {cfg.seq_len}, {machine()}")
    t = {m: timings[m].median / timings["none"].median for m in timings}
    note(f"""
        Full recomputation holds {results['full']['held'] / results['none']['held']:.0%} of the
        bytes and costs {t['full']:.2f}× the time (one more forward per block); selective
        holds {results['selective']['held'] / results['none']['held']:.0%} and costs
        {t['selective']:.2f}×.
        {"On a model this small, selective recomputation is the slowest: its policy is a "
         "Python call for every operator, forward and again during recomputation, which "
         "costs more than the arithmetic it saves; at real sizes the matmuls dominate and "
         "selective costs a few percent. " if t['selective'] > t['full'] else ""}
        The gradients are identical because the recomputed forward does the same arithmetic.
    """)


def accumulation():
    cfg = GPTConfig()
    bsz = 16
    big, held_big = accumulated_gradients(cfg, bsz, 1)
    rows = [[1, bsz, held_big, 1.0, 0.0]]
    for k in (2, 4, 8):
        g, held = accumulated_gradients(cfg, bsz, k)
        rows.append([k, bsz // k, held, held_big / held, max((g[n] - big[n]).abs().max().item() for n in big)])
    k, ratio = rows[-1][0], rows[-1][3]
    if all(abs(r[3] / r[0] - 1) < 0.05 for r in rows):
        falls = f"so the bytes held after a forward fall by k ({ratio:.1f}× fewer with k = {k})"
    elif ratio > 1:
        falls = (f"so the bytes held after a forward fall, though by less than k ({ratio:.1f}× fewer "
                 f"with k = {k}: part of what a forward holds does not shrink with the micro-batch)")
    else:
        falls = f"yet here the bytes held after a forward do not fall ({ratio:.2f}× with k = {k})"
    note(f"""
        ## Gradient accumulation
        k micro-batches of b/k sequences, each loss divided by k, backward after each: the
        gradients sum to the big batch's. Activations are held for one micro-batch at a time,
        {falls} for the same global batch (global batch = micro-batch ×
        accumulation steps × data-parallel ranks, lecture 03).
    """)
    see(accumulated_gradients)
    table(rows, header=["micro-batches k", "sequences per micro-batch", "most bytes held after a forward",
                        "one batch's ÷ this", "max |Δ grad| vs one batch"],
          caption="fp32; the differences are rounding (sums in another order)")


def number_formats():
    formats_and_rounding()     # range against resolution, from finfo and measured
    loss_scaling()             # fp16's range is too small for gradients: scale the loss
    master_weights()           # bf16's resolution is too coarse for small updates: keep fp32 weights


def formats_and_rounding():
    import matplotlib.pyplot as plt
    note("""
        ## Number formats: range against resolution
        A float is sign × 2^exponent × 1.mantissa. Exponent bits buy range, mantissa bits
        resolution: between 1 and 2 a format with m mantissa bits has 2^m values, so rounding
        there errs by at most 2^−(m+1) relative. `torch.finfo` gives the constants; we also
        round 200,001 evenly spaced values in [1, 2] to each format and measure.
    """)
    table([list(format_properties(n, d).values()) for n, d in FORMATS.items()],
          header=list(format_properties("fp32", torch.float32).keys()))
    exps = list(range(-12, 7)) if settings.quick else [e / 2 for e in range(-26, 14)]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for name, dtype in FORMATS.items():
        errs = relative_error_across_magnitudes(dtype, exps)
        ax.plot([10 ** e for e in exps], [max(e, 1e-9) for e in errs], marker=".", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("magnitude of the value")
    ax.set_ylabel("median relative rounding error")
    ax.legend(fontsize=7)
    figure(fig, caption="each format is accurate to ~eps/4 within its normal range; below it "
                        "(subnormals) the error grows until values flush to zero (error 1), above "
                        "it e4m3fn saturates at 448 and the others overflow; fp32 errors are "
                        "clipped at 1e-9 for the plot")


def loss_scaling():
    cfg = GPTConfig()
    bsz = 16 if settings.quick else 32
    ref = fp32_gradients(cfg, bsz)
    scales = [None, 2.0 ** 8, 2.0 ** 16, 2.0 ** 24]
    rows = []
    for sc in scales:
        g, count, skipped = fp16_gradients(cfg, bsz, sc)
        rows.append(["none" if sc is None else f"2^{int(math.log2(sc))}", count["flushed to zero"] / count["elements"],
                     count["subnormal"] / count["elements"], gradient_error(g, ref),
                     "skip (inf found)" if skipped else "step"])
    note(f"""
        ### fp16 needs loss scaling
        fp16 has bf16's precision eight times over but a smallest normal of
        {torch.finfo(torch.float16).smallest_normal:.3g}: gradients, which are small, fall into the
        subnormals (fewer bits) or flush to zero. We store every gradient of the GPT in fp16 as
        it flows backward (each module's incoming gradient and each parameter's gradient are
        rounded) and count. Multiplying the loss by S moves them all up by S; `GradScaler`
        divides by S again in fp32 before the step and skips a step whose gradients overflowed
        (then halves S). Micikevicius et al. (2018) introduced exactly this.
    """)
    see(fp16_gradients)
    table(rows, header=["loss scale", "gradient elements flushed to 0", "subnormal", "‖g − g_fp32‖ / ‖g_fp32‖",
                        "GradScaler"], caption=f"the GPT's real gradients, batch {bsz} × {cfg.seq_len}")


def master_weights():
    import matplotlib.pyplot as plt
    cfg = GPTConfig()
    steps = 80 if settings.quick else 100
    lr = 3e-4
    curves = {v: train_curve(cfg, v, steps, lr, batch_size=8, log_every=2 if settings.quick else 5)
              for v in ("fp32", "bf16 weights", "bf16 + fp32 master")}
    note(f"""
        ### bf16 needs fp32 master weights
        bf16 keeps fp32's range (no loss scaling) with 8 bits of precision: a weight near 1 moves
        only by steps of {torch.finfo(torch.bfloat16).eps}, so an update smaller than half that
        rounds away. Adam's updates are about lr in size, so with lr = {lr} every weight larger
        than about lr·2^8 = {lr * 256:.3f} in magnitude cannot move at all when the weights are
        bf16 (all LayerNorm gains, for instance). Training the same GPT three ways:
    """)
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for v, (c, _) in curves.items():
        ax.plot(*zip(*c), label=v)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    figure(fig, caption=f"AdamW lr {lr}, batch 8: bf16 compute with an fp32 master copy follows fp32; "
                        "bf16 weights updated in place fall behind")
    table([[v, c[-1][1], c[-1][1] - curves["fp32"][0][-1][1], u] for v, (c, u) in curves.items()],
          header=["variant", f"loss after {steps} steps", "minus fp32's",
                  "weights the optimizer updates left unchanged by the last step"])


def fp8_scaling():
    m, k, n = (256, 512, 256) if settings.quick else (512, 1024, 512)
    rows = []
    for outlier in (1.0, 1e2, 1e3, 1e4, 1e5):
        a, w = outlier_matrices(m, k, n, outlier=outlier)
        row = [outlier]
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            row += [fp8_matmul_error(a, w, None, None, dtype), fp8_matmul_error(a, w, (1, 128), (128, 128), dtype)]
        row += [scaled_mm_error(a, w), scaled_mm_error(a, w, rowwise=True)]
        rows.append(row)
    note(f"""
        ## FP8 with scaling
        fp8 e4m3 has 3 mantissa bits and a range of ±448; to use it, each tensor is divided by
        a scale so its largest value lands near 448. One scale per tensor lets a single outlier
        push every other value down into the subnormals. DeepSeek-V3 trains in fp8 with one
        scale per 1×128 tile of activations and per 128×128 block of weights, so an outlier
        only costs its own tile. Simulated here: quantize, dequantize, multiply in fp32 (as the
        tensor cores accumulate); activations of {m} tokens × {k} in which 1% of the tokens are
        larger by the outlier factor, weights {k}×{n}; the error is the median over tokens of
        each output row's relative error. `torch._scaled_mm` (PyTorch's fp8 matmul, which runs
        on this CPU) with one scale per tensor, and one per row of activations and column of
        weights, for comparison.
    """)
    see(quantize_fp8)
    table(rows, header=["outlier ×", "e4m3 per-tensor", "e4m3 tiles", "e5m2 per-tensor", "e5m2 tiles",
                        "_scaled_mm per-tensor", "_scaled_mm row-wise"],
          caption="median over tokens i of ‖ĉ_i − c_i‖/‖c_i‖ against float64")
    note(f"""
        With outliers of {rows[-1][0]:g}×, tile scaling errs {rows[-1][2]:.3g} against
        {rows[-1][1]:.3g} per tensor (e4m3): one scale for everything pushed the ordinary
        tokens into e4m3's subnormals (below {torch.finfo(torch.float8_e4m3fn).smallest_normal}
        after scaling), while each 1×128 tile keeps its own range. Without outliers the two
        are within {abs(rows[0][2] / rows[0][1] - 1):.0%} of each other. e5m2 trades a
        mantissa bit for range: coarser everywhere, which suits gradients more than
        activations and weights (DeepSeek-V3 uses e4m3 for all of them, with these scales).
        Our per-tensor simulation and `_scaled_mm` agree ({rows[-1][1]:.4g} and
        {rows[-1][5] if rows[-1][5] is not None else float('nan'):.4g}).
    """)
    see("https://arxiv.org/abs/2412.19437", "DeepSeek-AI 2024, DeepSeek-V3 Technical Report")
    see("https://arxiv.org/abs/2209.05433", "Micikevicius et al. 2022, FP8 Formats for Deep Learning")


def flash_attention_idea():
    online_softmax_checks()    # blocks of keys merged by their log-sum-exp equal SDPA, gradients too
    attention_memory()         # what that saves, measured, and what it costs in time


def online_softmax_checks():
    g = torch.Generator().manual_seed(0)
    s = 200
    q, k, v = (torch.randn(2, 3, s, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    checks = []
    for causal in (False, True):
        for bs in (7, 64, 256):
            out = online_softmax_attention(q, k, v, bs, causal=causal)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            d_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
            g1 = torch.autograd.grad(out, (q, k, v), d_out)
            g2 = torch.autograd.grad(ref, (q, k, v), d_out)
            checks.append([causal, bs, (out - ref).abs().max().item(),
                           max((x - y).abs().max().item() for x, y in zip(g1, g2))])
    note("""
        ## FlashAttention's idea: attention in blocks with an online softmax
        softmax(QKᵀ)V needs, for each query, the maximum and the sum of exponentials over all
        keys. Computed over blocks of keys, a running result can absorb the next block: keep
        each block's output and log-sum-exp (lse); two partial results combine with weights
        exp(lse_a − lse) and exp(lse_b − lse), lse = log(e^lse_a + e^lse_b) — the running-max
        rescaling of Milakov & Gimelshein's online softmax, which FlashAttention (Dao et al.)
        runs in on-chip memory. Only a (queries × block) tile of scores ever exists. The
        backward recomputes each tile from the saved lse instead of storing the probabilities.
        `merge_attention` is the piece lecture 06's ring attention reuses: each rank's block
        of keys arrives, is attended, and merged.
    """)
    see(attention_with_lse)
    see(merge_attention)
    see(OnlineSoftmaxAttention)
    table(checks, header=["causal", "block size", "max |Δ out| vs SDPA", "max |Δ grad q, k, v| vs SDPA"],
          caption=f"float64, (2, 3, {s}, 16): block sizes that do not divide s = {s} included")


def attention_memory():
    b, heads, d = 1, 4, 16
    g = torch.Generator().manual_seed(0)
    seqs = [128, 256, 512] if settings.quick else [128, 256, 512, 1024]
    block = 64
    variants = {"naive (s × s scores)": naive_causal_attention,
                f"online softmax, block {block}": lambda q, k, v: online_softmax_attention(q, k, v, block, causal=True),
                "PyTorch SDPA (fused)": causal_attention}
    rows = []
    for s in seqs:
        xs = [torch.randn(b, heads, s, d, generator=g) for _ in range(3)]
        for name, fn in variants.items():
            t = measure(lambda: fn(*xs), warmup=1, repeats=5)
            rows.append([s, name, attention_peak_bytes(fn, b, heads, s, d),
                         attention_peak_bytes(fn, b, heads, s, d, backward=True), t.ms()])
    table(rows, header=["s", "attention", "peak bytes, forward", "peak bytes, forward + backward", "forward time"],
          caption=f"b = {b}, {heads} heads of {d}, causal; bytes allocated beyond q, k, v (the "
                  f"backward's include their gradients), measured with LiveBytes; {machine()}")
    naive, online = ([r[2] for r in rows if r[1] == name] for name in list(variants)[:2])
    growth = len(seqs) - 1        # doublings of s from the first row to the last
    note(f"""
        The naive version's bytes grow as s², the blocked one's as s·block (from s = {seqs[0]}
        to {seqs[-1]}, the forward peaks grow {naive[-1] / naive[0]:.0f}× and
        {online[-1] / online[0]:.0f}×, against {4 ** growth}× and {2 ** growth}× for s² and s): at
        the longest sequence the blocked version holds {online[-1] / naive[-1]:.0%} of the naive
        peak, in plain PyTorch. It is slower than PyTorch's fused kernel, which does the same in
        C++ with the tiles in cache.
    """)
    see("https://arxiv.org/abs/1805.02867", "Milakov & Gimelshein 2018, Online normalizer calculation for softmax")
    see("https://arxiv.org/abs/2205.14135", "Dao et al. 2022, FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness")
    see("https://arxiv.org/abs/2307.08691", "Dao 2023, FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning")


def roofline():
    import matplotlib.pyplot as plt
    sizes = [64, 128, 256, 512] if settings.quick else [64, 128, 256, 512, 1024]
    cores = usable_cores()
    mm_one = {n: matmul_rate(n) for n in sizes}          # the demos' setting: one thread
    nbytes = (16 if settings.quick else 64) * 2 ** 20
    with threads(cores):                                  # the machine: every usable core
        mm = {n: matmul_rate(n) for n in sizes}
        bw, bw_t = copy_rate(nbytes)
        add = elementwise_rate(nbytes // 4, "add")
        gelu = elementwise_rate(nbytes // 4, "gelu")
    peak = max(r for r, _ in mm.values())
    note(f"""
        ## Notes: kernels and the roofline
        A kernel is limited either by arithmetic or by moving bytes. The roofline (Williams et
        al. 2009) plots attainable FLOP/s against arithmetic intensity (FLOP per byte moved):
        min(peak FLOP/s, intensity × bandwidth). With {cores} thread(s), {machine()}: the best fp32
        matmul reaches {peak / 1e9:.1f} GFLOP/s and copying {fmt_bytes(nbytes)} moves
        {bw / 1e9:.1f} GB/s ({bw_t.ms()}), so the ridge is at
        {peak / bw:.1f} FLOP/byte. An n×n matmul does 2n³ FLOP on 12n² bytes (intensity n/6):
        large ones are compute bound; an element-wise add does 1 FLOP per 12 bytes and is
        bound by memory at any size.

        The GPU kernel techniques that the later lectures assume: **coalescing** (neighbouring
        threads read neighbouring addresses, so one memory transaction serves many),
        **tiling** (load a block of the operands into fast on-chip memory and reuse it many
        times: what raises a matmul's intensity, and what FlashAttention does for attention),
        and **fusion** (one kernel for a chain of element-wise operations, so the intermediate
        never goes to memory: the GELU below moves its bytes once).
    """)
    if not torch.cuda.is_available():
        note("No GPU on this machine: the GPU roofline measurement is skipped; on a GPU the "
             "same functions (`matmul_rate`, `copy_rate` with `dev='cuda'`) measure it.")
    else:
        gpu_peak = max(matmul_rate(n, torch.bfloat16, "cuda")[0] for n in (2048, 4096, 8192))
        gpu_bw, _ = copy_rate(512 * 2 ** 20, "cuda")
        note(f"GPU ({torch.cuda.get_device_name(0)}): bf16 matmul {gpu_peak / 1e12:.0f} TFLOP/s, "
             f"copy {gpu_bw / 1e9:.0f} GB/s, ridge {gpu_peak / gpu_bw:.0f} FLOP/byte.")
    table([[f"matmul {n}×{n}", n / 6, r / 1e9, t.ms(), mm_one[n][0] / 1e9] for n, (r, t) in mm.items()]
          + [["add", add[2], add[0] / 1e9, add[1].ms(), None], ["GELU", gelu[2], gelu[0] / 1e9, gelu[1].ms(), None]],
          header=["kernel", "FLOP per byte", f"GFLOP/s, {cores} thread(s)", "time", "GFLOP/s, 1 thread"],
          caption=f"fp32, {machine()}")
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    xs = [2 ** e for e in range(-5, 10)]
    ax.plot(xs, [min(peak, x * bw) / 1e9 for x in xs], color="gray", label="roofline (measured peak, bandwidth)")
    ax.plot([n / 6 for n in sizes], [r / 1e9 for r, _ in mm.values()], "o", label="matmul n×n")
    ax.plot([add[2]], [add[0] / 1e9], "s", label="add")
    ax.plot([gelu[2]], [gelu[0] / 1e9], "^", label="GELU")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=7)
    figure(fig, caption=f"roofline of this machine, {machine()}")
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


def main():
    torch.set_num_threads(1)   # small tensors, shared cores: extra threads mostly wait (roofline uses all)
    intro()                    # what this lecture measures, and why it comes first
    the_model_and_task()       # the GPT and data every later lecture trains
    anatomy_of_a_step()        # what a training step holds, phase by phase
    parameters_and_bytes()     # Ψ in closed form; 16 bytes per parameter
    activation_memory()        # the paper's formula against what autograd saves
    recomputation()            # trade compute for activation memory
    accumulation()             # trade steps for activation memory
    number_formats()           # range vs resolution; loss scaling; master weights
    fp8_scaling()              # fp8 needs fine-grained scales
    flash_attention_idea()     # attention without the s × s matrix (lecture 06 builds on it)
    roofline()                 # what this machine does per second
    references()


def bench():
    """Plain-PyTorch online-softmax attention vs PyTorch's fused SDPA, forward, causal."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 16, generator=g) for _ in range(3))
    ours = measure(lambda: online_softmax_attention(q, k, v, 128, causal=True), repeats=7)
    theirs = measure(lambda: causal_attention(q, k, v), repeats=7)
    return [f"lecture_01: online-softmax attention {ours.median * 1e3:.2f} ms vs SDPA "
            f"{theirs.median * 1e3:.2f} ms (s=1024): ratio {ours.median / theirs.median:.1f} "
            "(plain PyTorch vs a fused kernel; no target)"]
