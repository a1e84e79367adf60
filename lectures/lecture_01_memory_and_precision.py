"""Memory and precision on one device

Before any communication: what a training step holds in memory, how number formats trade range
for resolution, and why both decide everything the later lectures do. This lecture also defines
the small GPT and the learnable synthetic task that lectures 04–07 train.

The building blocks live in `lectures/model/`, and this file narrates them: the model and
the task in `gpt.py`, the two memory meters in `memory.py`, a step's memory by category in
`training_memory.py`, activation accounting, recomputation and accumulation in `activations.py`,
number formats, loss scaling, master weights and fp8 in `precision.py`, blocked attention with an
online softmax in `attention.py`, and the roofline's rates in `roofline.py`. What the demos run is in
`demos.py`, the appendix page's deep dives in `deep_dives.py`, the page's drawings in `figures.py`.
"""
import dataclasses
import functools
import math
import time

import torch

from util import cheat, deep_dive, note, see, settings, spawn, table
from util import try_it_yourself
from util.measure import compare, machine, measure, measure_side_by_side

from exercises import listing as notebook_exercises
from lectures.model.activations import (Recomputed, _save_matmuls, accumulated_gradients, block_activations,
                                        chunked_cross_entropy, korthikanti_bytes, loss_memory, reconciled_bytes,
                                        recomputation_step)
from lectures.model.attention import (attention_with_lse, merge_attention, naive_causal_attention,
                                      online_softmax_attention)
from lectures.model.gpt import GPT, Block, GPTConfig, batch, causal_attention, entropy_rate, loss_fn, param_count
from lectures.model.memory import SavedBytes
from lectures.model.precision import (FORMATS, MasterWeights, format_properties, fp16_gradients, fp32_gradients,
                                      freeze_threshold, frozen_fraction, gradient_error, gradient_rms,
                                      per_tensor_error, train_curve)
from lectures.model.training_memory import MEM_CATEGORIES, CastWeightCopies, held_by_training, memory_timeline
from lectures.model.deep_dives import (a_step_too_big_to_hold, flash_attention_backward, float8_gain_words,
                                       fp8_scaling, references, roofline, saved_tensor_by_tensor,
                                       torchtitan_fp8_figure)
from lectures.model.demos import (attention_peak_bytes, autocast_held_before_backward,
                                  blocked_and_sdpa, checked_attention_inputs, same_on_every_rank)
from lectures.model.gpu_paths import WHAT_A_GPU_SHOWS, fp8_matmul, gpu_attention, gpu_memory_meter, gpu_roofline
from lectures.model.figures import (show, fmt_bytes, training_loss_figure, memory_phases_figure, bytes_per_parameter_figure,
                                    activations_figure, recomputation_figure, accumulation_figure, format_bits_figure,
                                    attention_blocks_figure, logits_figure, rounding_error_figure,
                                    loss_scaling_figure, master_weights_figure, attention_memory_figure)


def intro():
    note("""
        Every later lecture splits something — the batch, the layers, the sequence, the
        optimizer state — across devices. What there is to split, and how many bytes each
        piece takes, is decided here on one device: a training step holds parameters,
        gradients, optimizer state, activations and temporaries, and the number format of each
        decides its size and what it can represent. Everything below is measured by the run
        that built this page, on the small GPT that lectures 04–07 train.

        **What you will learn.** Where a training step's bytes go, phase by phase; why
        mixed-precision AdamW costs 16 bytes per parameter; how much a transformer block saves
        for backward (against Korthikanti et al.'s formula, term by term) and the ways to hold
        less: recomputation, gradient accumulation and a chunked loss; what fp16, bf16 and fp8 can and
        cannot represent, and the fixes each needs (loss scaling, fp32 master weights,
        fine-grained scales); and how attention runs without its s × s matrix.

        **What you need.** No earlier lecture: this is the first. PyTorch basics — tensors,
        `nn.Module`, `loss.backward()` and an optimizer step — and the idea of a float
        (sign, exponent, mantissa). The deep dives (fp8 scaling,
        FlashAttention's backward, the roofline, and more) wait on this lecture's appendix page
        for a second reading.
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
    fig = training_loss_figure(losses, floor, cfg.vocab_size)
    note("## The model and the task")
    show(fig, caption=f"AdamW, lr 3e-3, batch 16 × {cfg.seq_len} tokens, {steps} steps in "
                        f"{seconds:.1f} s ({machine()}): from {losses[0]:.2f} to {losses[-1]:.2f}")
    note(f"""
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
    ranks = min(2, settings.world_size)        # two ranks show it; more only cost start-up time
    run = spawn(same_on_every_rank, ranks, cfg=cfg,
                name="batch and initial weights built on every rank")
    same = all(r["identical"] for r in run.returns)
    table([[r, *c] for r, c in enumerate(run.returns[0]["checksums"])],
          header=["rank", "sum of batch 3's tokens", "sum of its first column", "sum of the initial weights"],
          caption=f"{ranks} ranks each built batch 3 and GPT(cfg) alone: "
                  + ("identical on every rank" if same else "**ranks disagree**"))
    see(GPTConfig)
    see(Block)
    see(batch)


@functools.cache
def step_rows():
    """Three AdamW steps of the GPT (batch 16), read after each phase: measured once per page."""
    return memory_timeline(GPTConfig(), batch_size=16, steps=3)


def anatomy_of_a_step():
    cfg = GPTConfig()
    rows = step_rows()
    note("## Anatomy of a step, measured")
    show(memory_phases_figure(rows),
           caption="memory after each phase (forward, backward, optimizer step, zero_grad) of the "
                   "first three steps (MemTracker): the optimizer "
                   "state appears at step 1's optimizer step and stays; gradients live from "
                   "backward to zero_grad; activations from forward to backward")
    note("""
        PyTorch's `MemTracker` (`torch.distributed._tools.mem_tracker`; it works on the CPU)
        sees every tensor an operator creates and files it under parameter, gradient,
        optimizer state, activation or temporary until it is freed. We train three AdamW
        steps and read it after each phase, beside our own count from the tensors themselves
        (parameters, gradients, the optimizer state dict, and the bytes autograd saved for
        backward, each storage once). Like the course's own meters (`lectures/model/memory.py`), it
        sees tensors, not the allocator. On a GPU, PyTorch's caching allocator keeps freed
        blocks for later tensors instead of returning them to the driver:
        `torch.cuda.memory_allocated()` counts live tensors, as these meters do, and
        `memory_reserved()` adds the cache. Sizes round up to 512-byte multiples and freed
        blocks fragment, so an out-of-memory error can come with gigabytes reserved but free
        (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` reduces it;
        `torch.cuda.memory._record_memory_history()` and `_dump_snapshot()` show every block).
    """)
    see("https://docs.pytorch.org/docs/stable/notes/cuda.html#memory-management",
        "PyTorch documentation, CUDA semantics: memory management")
    see("https://docs.pytorch.org/docs/stable/torch_cuda_memory.html",
        "PyTorch documentation, Understanding CUDA memory usage (memory snapshots)")
    first, later = rows[2]["tracker"]["Total"], rows[6]["tracker"]["Total"]
    act_tracker, act_own = rows[0]["tracker"]["Activation"], rows[0]["own"]["Activation"]
    tokens, targets = batch(cfg, 16, 1)
    loss = loss_fn(GPT(cfg)(tokens), targets)
    gap = ("the same count" if act_tracker == act_own else
           f"{act_tracker - act_own:,} bytes more" + (" — the loss, a one-element fp32 tensor, which "
           "nothing saves for backward" if act_tracker - act_own == loss.nbytes else ""))
    note(f"""
        Step 1 grows: AdamW allocates its two moments (m and v, {fmt_bytes(rows[2]['own']['Optstate'])}
        = 2 × the parameters' {fmt_bytes(rows[2]['own']['Parameter'])}) at its first
        `step()`. From then on the pattern repeats: after the optimizer step the total is
        {fmt_bytes(first)} at step 1 and {fmt_bytes(later)} at step 2. After the forward,
        autograd has saved {act_own:,} bytes for backward by our count. MemTracker files
        {act_tracker:,} bytes under activations, {gap}. The logits themselves are freed as
        soon as cross-entropy has taken their log-softmax, which it keeps for its backward.
        The activations are {act_own / rows[0]['own']['Parameter']:.1f}× the parameters here:
        with a small model and a modest batch, activations already dominate. Every phase's
        bytes, and what stays from one step to the next, are in the deep dive below.
    """)
    see(memory_timeline)


def step_in_bytes():
    """Every phase of the three steps in bytes: MemTracker's categories beside our own count,
    what stays after a backward, and the peak of each phase."""
    cfg = GPTConfig()
    rows = step_rows()
    note("## Deep dive: the step in bytes, phase by phase")
    top = max(rows, key=lambda r: r["peak"])
    after_bwd = rows[1]["tracker"]["Activation"]
    residue = rows[1]["batch"] + rows[1]["loss"]
    leftover = (f"After each backward MemTracker still files {after_bwd:,} bytes under activations, "
                f"to the next forward: the batch's token ids and targets ({rows[1]['batch']:,} bytes, "
                f"int64; autograd had saved them for the embedding's and the loss's backward, and the "
                f"training loop still holds them) and the {rows[1]['loss']}-byte loss. They go when the "
                f"next step's batch replaces them." if after_bwd == residue else
                f"After each backward MemTracker still files {after_bwd:,} bytes under activations, "
                f"{after_bwd - residue:+,} bytes beside the batch ({rows[1]['batch']:,}) and the loss "
                f"({rows[1]['loss']}) that the loop still holds.")
    note(f"""
        What ran: three AdamW steps of the page's GPT ({fmt_bytes(rows[0]['own']['Parameter'])} of fp32
        parameters, 16 sequences of {cfg.seq_len} tokens), read after every phase by MemTracker and by our own count; each
        row of the table is one phase of one step.

        {leftover} The table's last column is `LiveBytes`' peak in each phase: the most bytes
        alive at once that were allocated since training began, so everything but the
        parameters. It is highest in step {top['step']}'s {top['phase']} ({fmt_bytes(top['peak'])},
        {top['peak'] / rows[0]['own']['Parameter']:.1f}× the parameters).
    """)
    table([[r["step"], r["phase"]] + [r["tracker"].get(c, 0) for c in MEM_CATEGORIES] +
           [r["tracker"]["Total"], r["own"]["Parameter"], r["own"]["Gradient"], r["own"]["Optstate"],
            r["own"]["Activation"], r["peak"]] for r in rows],
          header=["step", "after", "params", "grads", "optimizer", "activations", "temporaries",
                  "MemTracker total", "own: params", "own: grads", "own: optimizer",
                  "own: saved for backward", "LiveBytes peak in phase"],
          caption=f"bytes, GPT {param_count(cfg):,} parameters, batch 16 × {cfg.seq_len}, fp32 AdamW")


def parameters_and_bytes():
    cfg = GPTConfig()
    tokens, targets = batch(cfg, 8, 0)
    fp32 = GPT(cfg)
    opt = torch.optim.AdamW(fp32.parameters(), lr=1e-3)
    loss_fn(fp32(tokens), targets).backward()
    opt.step()
    psi = param_count(cfg)
    fp32_held = held_by_training(fp32, opt)
    auto = GPT(cfg)                      # PyTorch's autocast: fp32 parameters are the master
    auto_opt = torch.optim.AdamW(auto.parameters(), lr=1e-3)
    auto_peak, copies = autocast_held_before_backward(auto, auto_opt, tokens, targets, set_to_none=True)
    auto_held = held_by_training(auto, auto_opt)   # after the backward: 16 again
    auto_kept, _ = autocast_held_before_backward(GPT(cfg), None, tokens, targets, set_to_none=False)
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
    copied = copies.numel / psi
    mixed_total, acc_total = sum(mixed[False].values()) / psi, sum(mixed[True].values()) / psi
    note("## Parameters and bytes per parameter")
    show(bytes_per_parameter_figure(
             {"fp32 AdamW": fp32_held, "bf16 + fp32 master": mixed[False],
              "+ fp32 grad accumulation": mixed[True], "autocast bf16, after the step": auto_held,
              "autocast, fwd to bwd": auto_peak, "autocast, fwd to bwd, last grads kept": auto_kept}, psi),
         caption="bytes per parameter, measured from the tensors each setup holds after a step "
                 "(autocast also between a forward and its backward)")
    note(f"""
        fp32 AdamW keeps 4 + 4 + 8 = 16 bytes per parameter: weights, gradients, and Adam's m
        and v. Mixed precision computes in bf16 but keeps an fp32 master copy for the update,
        because bf16 cannot represent small updates (below): 2 + 2 + 4 + 8 =
        {mixed_total:.0f} again. Mixed precision saves activation memory and time, not state.
        An fp32 buffer that sums gradients over micro-batches makes it {acc_total:.0f}
        (2 + 2 + 4 + 4 + 8: the bf16 gradient the backward writes, then the fp32 sum); lecture
        07 counts 18 for the same idea as Megatron-LM and Llama 3 do it (2 + 4 + 12), where
        the backward adds straight into the fp32 gradient and no bf16 gradient is kept.
        `torch.autocast` keeps fp32 parameters (they are the master) and casts them to bf16
        inside each forward: 16 after the step. The bf16 copies of the matmul weights
        ({copied:.0%} of the parameters) live until the backward has used them. Between forward
        and backward that makes {sum(auto_peak.values()) / psi:.1f} bytes per parameter after
        `opt.zero_grad(set_to_none=True)`, {sum(auto_kept.values()) / psi:.1f} while last step's
        gradients are alive (gradient accumulation). This 16Ψ is what ZeRO (lecture 03) divides;
        how Ψ itself is counted, the usual closed form against `param_count`, is a deep dive below.
    """)
    cheat("bytes per parameter, mixed-precision AdamW",
          "$2 + 2 + 4 + 4 + 4 = 16$ bytes: bf16 weights and gradients, fp32 master, Adam's $m$ and $v$",
          mixed_total, "bytes per parameter", what=f"measured from the tensors `MasterWeights` holds, Ψ = {psi:,}")
    columns = {"weights": ("Parameter", "bf16 parameters"), "gradients": ("Gradient", "bf16 gradients"),
               "fp32 master": ("fp32 master parameters",), "Adam m and v": ("Optstate", "fp32 Adam m and v"),
               "fp32 grad accumulation": ("fp32 gradient accumulation",),
               "bf16 weight copies saved by the forward, freed by the backward": ("Copies",)}
    setups = {"fp32 AdamW": fp32_held, "bf16 + fp32 master": mixed[False],
              "bf16 + fp32 master, fp32 grad accumulation": mixed[True],
              "autocast bf16 (fp32 parameters are the master)": auto_held,
              "autocast bf16, forward to backward, after zero_grad(set_to_none=True)": auto_peak,
              "autocast bf16, forward to backward, last step's gradients kept (accumulation)": auto_kept}
    table([[name] + [sum(held.get(k, 0) for k in keys) / psi for keys in columns.values()]
           + [sum(held.values()) / psi] for name, held in setups.items()],
          header=["setup", *columns, "total"],
          caption=f"bytes per parameter, measured; Ψ = {psi:,}")
    see(CastWeightCopies)
    see(MasterWeights)


def counting_parameters():
    """The usual closed form for Ψ against `param_count` and the built model's numel."""
    configs = [GPTConfig(), GPTConfig(n_kv_heads=2), GPTConfig(tie_embeddings=True),
               GPTConfig(d_model=96, n_heads=6, n_kv_heads=3, n_layers=3, d_ff=200, vocab_size=101, seq_len=17),
               GPTConfig(d_model=768, n_heads=12, n_layers=12, vocab_size=50257, seq_len=1024, tie_embeddings=True)]
    est_rows = []
    for c in configs:
        h, v, L = c.d_model, c.vocab_size, c.n_layers
        numel = sum(p.numel() for p in GPT(c).parameters()) if h < 512 else None
        est_rows.append([f"h={h} L={L} a={c.n_heads} kv={c.kv_heads} f={c.ff} v={v} s={c.seq_len}"
                     + (" tied" if c.tie_embeddings else ""),
                     h * v + L * (12 * h * h + 13 * h) + 2 * h, param_count(c), numel])
    note("""
        ## Deep dive: counting the parameters
        The usual estimate Ψ ≈ h·v + L·(12h² + 13h) + 2h counts an embedding, per layer 4h² + 4h
        for attention (Q, K, V, O with biases), 8h² + 5h for a 4h MLP, 4h for two LayerNorms,
        and a final LayerNorm. `param_count` is the exact count for this architecture — learned
        positions (s·h), an untied head (h·v), K and V narrower under grouped-query attention,
        any MLP width — and equals `sum(p.numel())` of the built model.
    """)
    see(param_count)
    off = [f"{r[0].split(' v=')[0]}: {r[1] / r[2] - 1:+.0%}" for c, r in zip(configs, est_rows)
           if c.ff != 4 * c.d_model]
    table(est_rows, header=["config", "estimate h·v + L(12h²+13h) + 2h (assumes f = 4h)", "param_count",
                        "sum(p.numel())"],
          caption="the estimate assumes a 4h MLP and full-width K and V" +
                  (f"; where f ≠ 4h it misses ({'; '.join(off)})" if off else "") +
                  ". The last row is GPT-2 small (124M with tied embeddings); its numel is not built here")


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
    s0 = seqs[-1]
    saved = block_activations(cfg, b, s0, causal_attention)
    sbh = s0 * b * cfg.d_model
    terms = reconciled_bytes(cfg, b, s0, "sdpa")
    terms_naive = reconciled_bytes(cfg, b, s0, "naive")
    note("## Activation memory against the formula")
    show(activations_figure(seqs, measured, reconciled, paper),
         caption=f"activations saved by one block, b = {b}, h = {cfg.d_model}, a = {cfg.n_heads}: "
                 "linear in s with the fused kernel, quadratic once a·s/h outgrows the rest with naive attention")
    note("""
        Korthikanti et al. count what one transformer layer keeps for backward in 16-bit with
        dropout: s·b·h·(34 + 5·a·s/h) bytes. We measure what autograd really saves for one
        of our blocks: `torch.autograd.graph.saved_tensors_hooks` sees every tensor saved for
        backward; we count each storage once (the output of LN1 feeds Q, K and V and is
        saved once) and leave out the weights.
    """)
    note(f"""
        Term by term: the paper's 34·s·b·h bytes are 16 tensors of s·b·h elements at 2 bytes
        each (32) plus two dropout masks of s·b·h elements at 1 byte each (2). Ours keeps the
        same 16 tensors (there is no dropout, so no masks) at 4 bytes each, since we train in
        fp32: 64·s·b·h, twice the paper's 32. The
        s² term depends on the attention: the naive version keeps the fp32 probabilities
        ({fmt_bytes(terms_naive['softmax probabilities (a·s per token)'])} at s = {s0}) where the
        paper keeps softmax output, dropout mask and dropout output (5·a·s²·b bytes);
        the fused kernel PyTorch uses on this CPU (`scaled_dot_product_attention`) keeps only
        a log-sum-exp per query and head: no s² term at all — FlashAttention's idea, built
        below. Measured and reconciled agree to the byte at every s
        ({sum(m == r for m, r in zip(measured['sdpa'] + measured['naive'], reconciled['sdpa'] + reconciled['naive']))}
        of {2 * len(seqs)} sizes).
    """)
    cheat("activation memory per layer",
          "$s b h \\left(34 + 5 \\frac{a s}{h}\\right)$ bytes in 16-bit with dropout (Korthikanti et al.); "
          "fp32, no dropout, fused attention: $\\approx 64\\, s b h$",
          saved.total / sbh, "bytes per s·b·h",
          what=f"one block's saved tensors, fused attention, s = {s0}, b = {b}, h = {cfg.d_model}")
    table([[k, v] for k, v in terms.items()] + [["**total (reconciled)**", sum(terms.values())],
                                                ["**measured**", saved.total]],
          header=["term", "bytes"], caption=f"reconciliation, fused attention, s = {s0}")
    see(SavedBytes)
    see(reconciled_bytes)


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
    note("## Activation recomputation")
    show(recomputation_figure(results, timings),
         caption=f"what each recomputation mode holds between forward and backward, and its "
                 f"forward + backward time (median, bars: interquartile range), {machine()}")
    note("""
        Keep fewer activations and recompute the rest during backward (Chen et al. 2016).
        `torch.utils.checkpoint` keeps only a block's input and runs its forward again in
        backward ("full"); with `create_selective_checkpoint_contexts` a policy decides per
        operator: "selective" below is a selective policy of our own, which keeps the matmul and
        attention outputs and recomputes LayerNorms and GELU. It is not Korthikanti et al.'s selective recomputation, which recomputes the
        attention core behind the 5·a·s²·b term: fused attention already keeps no s² tensor.
        Saved-tensor hooks cannot see inside a checkpoint, so the bytes are measured with
        `LiveBytes`, which tracks every storage an operator creates until it is freed.
    """)
    held = {m: results[m]["held"] / results["none"]["held"] for m in results}
    worst = max((r["grads"][k] - ref[k]).abs().max().item() for r in results.values() for k in ref)
    same_grads = ("The gradients are identical: the recomputed forward does the same arithmetic."
                  if worst == 0 else f"The gradients agree to {worst:.1g} (rounding).")
    sel, full = timings["selective"], timings["full"]
    sel_slower = sel.q1 > full.q3               # beyond the spread, not just the medians
    sel_faster = sel.q3 < full.q1
    heavier = results["selective"]["held"] / results["full"]["held"]
    if heavier > 1 and not sel_faster:
        verdict = (f"Selective against full: selective holds {heavier:.1f}× full's bytes and "
                   + ("is slower too" if sel_slower else "is not measurably faster")
                   + f" ({compare(sel, full, 'selective', 'full')}), so on this model our "
                   "selective policy loses to full recomputation"
                   + (" on both counts" if sel_slower else "") + ": it keeps the matmul outputs, "
                   "most of a block's bytes, and pays a Python call per operator. Selective pays "
                   "where what it drops is large to store and cheap to recompute, like the s² "
                   "attention core at long sequences without a fused kernel.")
    else:
        verdict = (f"Selective against full: selective holds {heavier:.1f}× full's bytes; "
                   f"{compare(sel, full, 'selective', 'full')}.")
    note(f"""
        Full recomputation holds {held['full']:.0%} of the bytes (only each block's input
        stays). Forward + backward:
        {compare(full, timings['none'], 'full recomputation', 'storing everything')}. Selective
        holds {held['selective']:.0%}:
        {compare(sel, timings['none'], 'selective recomputation', 'storing everything')}.
        {verdict} {same_grads}
    """)
    table([[m, r["held"], r["held"] / results["none"]["held"], r["peak"], timings[m].ms(),
            timings[m].median / timings["none"].median,
            max((r["grads"][k] - ref[k]).abs().max().item() for k in ref)] for m, r in results.items()],
          header=["recomputation", "bytes held after forward", "vs none", "peak bytes fwd+bwd",
                  "forward+backward", "time vs none", "max |Δ grad| vs none"],
          caption=f"GPT with {cfg.n_layers} layers, batch {bsz} × {cfg.seq_len}, {machine()}")
    see(_save_matmuls)
    see(Recomputed)


def logits_memory():
    vocabs = [64, 1024, 8192] if settings.quick else [64, 1024, 8192, 32768]
    bsz, chunk = 8, 32
    rows, held = [], {}
    for v in vocabs:
        cfg = GPTConfig(vocab_size=v)
        whole, chunked = loss_memory(cfg, bsz), loss_memory(cfg, bsz, chunk_rows=chunk)
        held[v] = (whole["held"], chunked["held"], whole["log_softmax"])
        rows.append([v, whole["held"], whole["log_softmax"], whole["log_softmax"] / whole["held"],
                     chunked["held"], whole["peak"], chunked["peak"],
                     max((whole["grads"][k] - chunked["grads"][k]).abs().max().item() for k in whole["grads"])])
    note("## The logits: a large share at large vocabularies")
    fig = logits_figure(vocabs, chunk, held)
    show(fig, caption="what the forward holds for backward as the vocabulary grows, with the whole "
                        "loss and with chunked cross-entropy (LiveBytes)")
    cfg = GPTConfig()
    note(f"""
        Cross-entropy saves its fp32 log-softmax, one number per token and vocabulary entry:
        b·s·v·4 bytes, beside the blocks' b·s·h-sized tensors. Our GPT's vocabulary of
        {cfg.vocab_size} hides it; real vocabularies are 32k–256k entries against h of a few
        thousand. The fix is to never hold all of it: compute the head and the loss a chunk of
        tokens at a time, each chunk under a checkpoint, so one chunk's logits exist in the
        forward and again when the backward recomputes them. Cut Cross-Entropy (Wijmans et
        al. 2024) goes further on GPUs: one kernel computes the log-sum-exp over the
        vocabulary block by block in on-chip memory, the online softmax of the attention
        section below applied to the loss, and never writes the logits to memory at all.
    """)
    v = vocabs[-1]
    note(f"""
        At a large vocabulary the log-softmax is {"most" if rows[-1][3] > 0.5 else "a large part"} of
        what the forward keeps: {rows[-1][3]:.0%} at v = {v}. Chunked, the forward holds {fmt_bytes(rows[-1][4])} instead of
        {fmt_bytes(rows[-1][1])}. The peak of the whole step falls too, to
        {fmt_bytes(rows[-1][6])} from {fmt_bytes(rows[-1][5])}; what remains at large v is
        mostly the head's and the embedding's gradients, v·h each. The gradients agree to
        rounding.
    """)
    cheat("the loss's fp32 log-softmax",
          "$4\\, b s v$ bytes held for backward; chunked cross-entropy holds one chunk's",
          rows[-1][1] / rows[-1][4], "× fewer bytes held with chunks",
          what=f"held after the forward, whole loss against chunks of {chunk} tokens, v = {v}, LiveBytes")
    table(rows, header=["vocabulary v", "held after forward, whole loss", "of which fp32 log-softmax (b·s·v·4)",
                        "share", f"held after forward, chunks of {chunk} tokens", "peak fwd+bwd, whole",
                        "peak fwd+bwd, chunked", "max |Δ grad|"],
          caption=f"GPT with h = {cfg.d_model}, {cfg.n_layers} layers, batch {bsz} × {cfg.seq_len} "
                  "random tokens, bytes measured with LiveBytes")
    see(chunked_cross_entropy)
    see("https://arxiv.org/abs/2411.09009", "Wijmans et al. 2024, Cut Your Losses in Large-Vocabulary Language Models")


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
    note("## Gradient accumulation")
    show(accumulation_figure(rows),
         caption="the most bytes a forward holds for backward, for the same global batch of "
                 f"{bsz} sequences cut into k micro-batches (bars), against 1/k of one batch's (dashed)")
    note(f"""
        k micro-batches of b/k sequences, each loss divided by k, backward after each: the
        gradients sum to the big batch's. Activations are held for one micro-batch at a time,
        {falls} for the same global batch (global batch = micro-batch ×
        accumulation steps × data-parallel ranks, lecture 03).
    """)
    table(rows, header=["micro-batches k", "sequences per micro-batch", "most bytes held after a forward",
                        "one batch's ÷ this", "max |Δ grad| vs one batch"],
          caption="fp32; the differences are rounding (sums in another order)")
    see(accumulated_gradients)


def number_formats():
    formats_and_rounding()     # range against resolution, from finfo and measured
    loss_scaling()             # fp16's range is too small for gradients: scale the loss
    master_weights()           # bf16's resolution is too coarse for small updates: keep fp32 weights


def formats_and_rounding():
    note("## Number formats: range against resolution")
    show(format_bits_figure(), caption="the bits of each format, from torch.finfo: mantissa "
                                         "bits = −log2(eps), exponent bits = the rest after the sign")
    note("""
        A float is sign × 2^exponent × 1.mantissa. Exponent bits buy range, mantissa bits
        resolution: between 1 and 2 a format with m mantissa bits has 2^m + 1 values (both
        ends included), so rounding there errs by at most 2^−(m+1) relative. `torch.finfo`
        gives the constants; the values in [1, 2] are counted from the bit patterns (positive
        floats are ordered like their bits read as integers); and we round 200,001 evenly
        spaced values in [1, 2] to each format and measure the worst error.
    """)
    table([list(format_properties(n, d).values()) for n, d in FORMATS.items()],
          header=list(format_properties("fp32", torch.float32).keys()))
    exps = list(range(-12, 7)) if settings.quick else [e / 2 for e in range(-26, 14)]
    fig = rounding_error_figure(exps)
    show(fig, caption="within its normal range each format's median error is about eps/4 and its "
                        "worst case eps/2 (the unit roundoff, as in the table); below it "
                        "(subnormals) the error grows until values flush to zero (error 1), above "
                        "it e4m3fn saturates at 448 and the others overflow; fp32 errors are "
                        "clipped at 1e-9 for the plot")
    note("""
        Beyond the largest value fp16 and e5m2 overflow to inf; e4m3fn has no infinity and
        saturates, which the fp8 deep dive shows.
    """)


def loss_scaling():
    cfg = GPTConfig()
    bsz = 16 if settings.quick else 32
    ref = fp32_gradients(cfg, bsz)
    scales = [None, 2.0 ** 8, 2.0 ** 16, 2.0 ** 24]
    rows, per_tensor = [], {}
    for sc in scales:
        g, count, skipped = fp16_gradients(cfg, bsz, sc)
        per_tensor[sc] = per_tensor_error(g, ref)
        rows.append(["none" if sc is None else f"2^{int(math.log2(sc))}", count["flushed to zero"] / count["elements"],
                     count["subnormal"] / count["elements"], gradient_error(g, ref),
                     "skip (inf found)" if skipped else "step"])
    rms = gradient_rms(ref)
    # The bias of K has a zero gradient in exact arithmetic (adding the same number to all of a
    # query's scores leaves its softmax unchanged): its fp32 "gradient" is rounding noise.
    typical = sorted(rms.values())[len(rms) // 2]
    noise = [k for k in rms if rms[k] < 1e-6 * typical]
    real = sorted((k for k in rms if k not in noise), key=rms.get)
    smallest, largest = real[:4], real[-2:]
    worst = max(smallest, key=lambda k: per_tensor[None][k])
    left_out = (f"(Left out: {', '.join(f'`{k}`' for k in noise)}, whose gradient is zero in exact "
                "arithmetic — adding the same number to all of a query's scores leaves its softmax "
                "unchanged.)" if noise else "")
    s16 = 2.0 ** 16
    note("## fp16 needs loss scaling")
    fig = loss_scaling_figure(worst, rms, real, s16, per_tensor)
    show(fig, caption="one point per parameter tensor: without scaling, the tensors with the "
                        "smallest gradients lose the most; scaling the loss lifts them above fp16's "
                        "subnormals")
    note(f"""
        fp16 has bf16's precision eight times over but a smallest normal of
        {torch.finfo(torch.float16).smallest_normal:.3g}: gradients, which are small, fall into the
        subnormals (fewer bits) or flush to zero. We store every gradient of the GPT in fp16 as
        it flows backward (each module's incoming gradient and each parameter's gradient are
        rounded) and count. Multiplying the loss by S moves them all up by S; `GradScaler`
        divides by S again in fp32 before the step and skips a step whose gradients overflowed
        (then halves S). Micikevicius et al. (2018) introduced exactly this.
    """)
    note(f"""
        The error over all parameters together moves far less than the smallest tensors'
        ({rows[0][3]:.2g} unscaled, {rows[2][3]:.2g} with 2^16), because it is dominated by
        the largest gradients, which fp16 stores well. The damage is in the smallest gradients,
        such as `{worst}`'s (RMS {rms[worst]:.2g}). That tensor comes back
        {per_tensor[None][worst]:.1%} wrong without scaling and {per_tensor[s16][worst]:.2%}
        wrong with 2^16. Those are whole
        tensors (here {", ".join(f"`{k}`" for k in smallest)}) learning from gradients
        that kept a few bits each; in a deeper
        model or later in training, when gradients shrink, they flush to zero entirely and the
        layer stops learning. Too large a scale overflows: at 2^24 the scaler finds inf and
        skips the step{"" if rows[3][4].startswith("skip") else " (not here: this run found none)"}.
        {left_out}
    """)
    table(rows, header=["loss scale", "gradient elements flushed to 0", "subnormal", "‖g − g_fp32‖ / ‖g_fp32‖",
                        "GradScaler"], caption=f"the GPT's real gradients, batch {bsz} × {cfg.seq_len}")
    table([[k, rms[k]] + [per_tensor[sc][k] for sc in scales] for k in smallest + largest],
          header=["parameter", "gradient RMS (fp32)"] + ["error, " + r[0] for r in rows],
          caption="‖g − g_fp32‖ / ‖g_fp32‖ per tensor: the four with the smallest gradients, then the two "
                  "with the largest")
    see(fp16_gradients)


def master_weights():
    cfg = GPTConfig()
    steps = 80 if settings.quick else 100
    lr = 3e-4
    variants = ("fp32", "bf16 weights", "bf16 + fp32 master", "autocast bf16")
    curves = {v: train_curve(cfg, v, steps, lr, batch_size=8, log_every=2 if settings.quick else 5)
              for v in variants}
    eps = torch.finfo(torch.bfloat16).eps
    frozen_at = freeze_threshold(lr)
    bf16_model = GPT(dataclasses.replace(cfg, dtype="bfloat16"))
    frozen = frozen_fraction(bf16_model.parameters(), lr)
    note("## bf16 needs fp32 master weights")
    styles = {"fp32": dict(color="black", lw=4, alpha=0.35),
              "bf16 weights": dict(color="C3", lw=1.8),
              "bf16 + fp32 master": dict(color="C0", lw=1.5, ls="--"),
              "autocast bf16": dict(color="C2", lw=1.5, ls=":")}
    fig = master_weights_figure(curves, styles)
    show(fig, caption=f"AdamW lr {lr}, batch 8; fp32 is the wide grey line, and the lower panel "
                        "shows each variant's distance from it on one shared step axis")
    note(f"""
        bf16 keeps fp32's range (no loss scaling) with 8 bits of precision: a weight w in
        [2^e, 2^(e+1)) moves only in steps of ulp(w) = 2^e·eps (eps = {eps}), and an update
        smaller than half a step rounds away. AdamW's update, lr·m̂/(√v̂ + ε), is at most about
        lr, and an update of size lr rounds away exactly when lr < ulp(w)/2. With
        lr = {lr}, every bf16 weight with |w| ≥ {frozen_at:g} (`freeze_threshold`) cannot move
        at all. Here that is {frozen:.1%} of the initial weights, all LayerNorm gains among them. Smaller weights freeze whenever their own update is
        below half their step, and Adam's update is often far below lr once noisy gradients
        average out in m̂. Training the same GPT four ways: fp32; bf16 weights
        updated in place; bf16 weights with an fp32 master copy that the optimizer updates
        (`MasterWeights`, above); and PyTorch's own mixed precision, `torch.autocast`, where
        the parameters stay fp32 — they are the master weights — and are cast to bf16 for
        each matmul of the forward.
    """)
    final = {v: c[-1][1] for v, (c, _) in curves.items()}
    gap = {v: abs(final[v] - final["fp32"]) for v in variants[1:]}
    behind = "bf16 weights updated in place fall behind fp32" if final["bf16 weights"] > final["fp32"] \
        and gap["bf16 weights"] > 2 * max(gap["bf16 + fp32 master"], gap["autocast bf16"]) \
        else "here the bf16 weights do not fall clearly behind"
    note(f"""
        With an fp32 copy to update, both mixed-precision versions end within
        {max(gap['bf16 + fp32 master'], gap['autocast bf16']):.2g} of fp32's loss. Without one,
        {behind} ({final['bf16 weights'] - final['fp32']:+.3f}). The last step left
        {curves['bf16 weights'][1]:.0%} of the bf16 weights unchanged. The
        two master-weight versions differ in what they keep: `MasterWeights` holds bf16
        parameters and gradients beside the fp32 copy (the 2 + 2 + 4 + 8 bytes above), while
        autocast holds fp32 parameters and gradients and makes bf16 copies of the weights
        in each forward (4 + 4 + 8): the same 16 bytes per parameter after the step, plus 2 per
        copied weight while the forward's copies wait for the backward, and activations in bf16 either
        way where the matmuls produce them.
    """)
    cheat("bf16 weights that cannot move",
          "an update $u$ rounds away when $|u| < \\mathrm{ulp}(w)/2$; with $u \\approx$ lr, every $|w| \\ge$ "
          "`freeze_threshold(lr)` is frozen",
          100 * curves["bf16 weights"][1], "% of the bf16 weights unchanged by the last step",
          what=f"bf16 weights updated in place, AdamW lr = {lr}, step {steps}")
    table([[v, final[v], final[v] - final["fp32"], u] for v, (c, u) in curves.items()],
          header=["variant", f"loss after {steps} steps", "minus fp32's",
                  "weights the optimizer updates left unchanged by the last step"])
    see(freeze_threshold)
    note(f"""
        PyTorch's own fp8 path is torchao: `torchao.float8.convert_to_float8_training(model)`
        swaps each `nn.Linear` for a `Float8Linear` whose three matmuls cast their operands to
        fp8 with scales from the current values; its recipes `tensorwise`, `rowwise` and
        `rowwise_with_gw_hp` (weight gradient kept in bf16) are the scale granularities the
        appendix compares. It needs fp8 tensor cores; there, as published, torchtitan's
        Llama 3.1 8B trained at {float8_gain_words()} bf16's tokens per second on 8 and 128
        H100s with float8 linears, not the tensor cores' 2×: only the linears run in fp8, and
        each cast reads and writes its operand.
    """)
    torchtitan_fp8_figure()
    see("https://docs.pytorch.org/ao/stable/workflows/training.html",
        "PyTorch torchao documentation, Quantized Training: float8")


def flash_attention_idea():
    online_softmax_checks()    # blocks of keys merged by their log-sum-exp equal SDPA, gradients too
    attention_memory()         # what that saves, measured, and what it costs in time


def online_softmax_checks():
    g, q, k, v = checked_attention_inputs()
    s = q.shape[2]
    checks = [[causal, bs, (out - ref).abs().max().item()] for causal, bs, out, ref in blocked_and_sdpa(q, k, v)]
    note("## FlashAttention's idea: attention in blocks with an online softmax")
    show(attention_blocks_figure(s=16, block=4),
           caption="causal attention over 16 positions in blocks of 4 keys: each coloured column is "
                   "one step of the loop in `online_softmax_attention`, merged into the running result; "
                   "grey scores lie in the query's future and are masked (this plain-PyTorch version "
                   "still computes them; FlashAttention also cuts the queries into blocks and skips "
                   "tiles wholly in the future)")
    note("""
        softmax(QKᵀ)V needs, for each query, the maximum and the sum of exponentials over all
        keys. Computed over blocks of keys, a running result can absorb the next block: keep
        each block's output and log-sum-exp (lse); two partial results combine with weights
        exp(lse_a − lse) and exp(lse_b − lse), lse = log(e^lse_a + e^lse_b) — the running-max
        rescaling of Milakov & Gimelshein's online softmax, which FlashAttention (Dao et al.)
        runs in on-chip memory. Only a (queries × block) tile of scores ever exists.
        `merge_attention` is the piece lecture 06's ring attention reuses: each rank's block
        of keys arrives, is attended, and merged.
    """)
    table([[causal, ", ".join(str(c[1]) for c in checks if c[0] == causal),
            max(c[2] for c in checks if c[0] == causal)] for causal in (False, True)],
          header=["causal", "block sizes", "max |Δ out| vs SDPA, any block size"],
          caption=f"float64, (2, 3, {s}, 16): block sizes that do not divide s = {s} included "
                  "(gradients: see the deep dive on the backward)")
    see(merge_attention, lesson=True)
    see(attention_with_lse)


def attention_memory():
    b, heads, d = 1, 4, 16
    g = torch.Generator().manual_seed(0)
    seqs = [128, 256, 512] if settings.quick else [128, 256, 512, 1024]
    block = 64
    variants = {"naive (s × s scores)": naive_causal_attention,
                f"online softmax, block {block}": lambda q, k, v: online_softmax_attention(q, k, v, block, causal=True),
                "PyTorch SDPA (fused)": causal_attention}
    rows, times = [], {}
    for s in seqs:
        xs = [torch.randn(b, heads, s, d, generator=g) for _ in range(3)]
        # the three take turns, rotating, so the machine's drift hits them alike
        timed = measure_side_by_side({name: (lambda fn=fn: fn(*xs)) for name, fn in variants.items()},
                                     warmup=1, repeats=7 if settings.quick else 11)
        for name, fn in variants.items():
            times[s, name] = t = timed[name]
            rows.append([s, name, attention_peak_bytes(fn, b, heads, s, d),
                         attention_peak_bytes(fn, b, heads, s, d, backward=True), t.ms()])
    names = list(variants)
    peaks = {name: [r[2] for r in rows if r[1] == name] for name in names}
    naive, online = peaks[names[0]], peaks[names[1]]
    growth = len(seqs) - 1        # doublings of s from the first row to the last
    longest = seqs[-1]
    fig = attention_memory_figure(peaks, seqs)
    show(fig, caption=f"forward peak beyond q, k, v (LiveBytes), {heads} heads of {d}: the s × s "
                        "scores grow 4× per doubling of s, the blocked and fused versions 2×")
    note(f"""
        The naive version's bytes grow as s², the blocked one's as s·block. From s = {seqs[0]}
        to {seqs[-1]} the naive forward peak grows {naive[-1] / naive[0]:.0f}×, against
        {4 ** growth}× for s². The blocked one grows {online[-1] / online[0]:.0f}×, against
        {2 ** growth}× for s. At the longest sequence the blocked version holds
        {online[-1] / naive[-1]:.0%} of the naive peak, in plain PyTorch. In time, at s =
        {longest}:
        {compare(times[longest, names[1]], times[longest, names[2]], "our blocked version", "PyTorch's fused kernel")};
        the fused kernel does the same in C++ with the tiles in cache. Against the naive one:
        {compare(times[longest, names[1]], times[longest, names[0]], "our blocked version", "the naive one")}.
    """)
    table([[name] + [r[2] for r in rows if r[1] == name]
           + [r[3] for r in rows if r[1] == name and r[0] == longest] + [times[longest, name].ms()]
           for name in names],
          header=["attention"] + [f"peak bytes forward, s = {x}" for x in seqs]
                 + [f"peak bytes fwd + bwd, s = {longest}", f"forward time, s = {longest}"],
          caption=f"b = {b}, {heads} heads of {d}, causal, timed taking turns; bytes allocated beyond q, k, v (the "
                  f"backward's include their gradients), measured with LiveBytes; {machine()}")
    see("https://arxiv.org/abs/1805.02867", "Milakov & Gimelshein 2018, Online normalizer calculation for softmax")
    see("https://arxiv.org/abs/2205.14135", "Dao et al. 2022, FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness")


def gpt_step_on_cuda(batch_size=8):
    """A forward and backward of this lecture's GPT on the GPU, for the memory meter."""
    cfg = GPTConfig()
    model = GPT(cfg).cuda()
    tokens, targets = (t.cuda() for t in batch(cfg, batch_size, 0))

    def step():
        loss_fn(model(tokens), targets).backward()
        model.zero_grad(set_to_none=True)
    return step


def on_a_gpu():
    """This lecture's one-device measurements on a GPU (lectures/model/gpu_paths.py): run and shown
    when the page is built with one, said what they would show when not."""
    shows = "\n".join(f"- {what}" for what in WHAT_A_GPU_SHOWS.values())
    if not torch.cuda.is_available():
        note("## Deep dive: on a GPU\nBuilt with a GPU, this page runs the CUDA paths of its one-device "
             "measurements (`lectures/model/gpu_paths.py`, tested in `tests/test_gpu_paths.py`; skipped on this "
             "CPU build, which has none). What each would show:\n\n" + shows)
        return
    r, a = gpu_roofline(), gpu_attention()
    rows = [["bf16 matmul peak", f"{r['peak'] / 1e12:.0f} TFLOP/s"], ["copy bandwidth", f"{r['bandwidth'] / 1e12:.2f} TB/s"],
            ["ridge", f"{r['ridge']:.0f} FLOP/byte"],
            ["causal attention, fused vs naive", f"{a['fused_ms']:.2f} vs {a['naive_ms']:.2f} ms, "
                                                 f"{fmt_bytes(a['fused_bytes'])} vs {fmt_bytes(a['naive_bytes'])}"]]
    m = gpu_memory_meter(gpt_step_on_cuda())
    rows.append(["a GPT step's peak, LiveBytes vs the CUDA allocator",
                 f"{fmt_bytes(m['live_peak'])} vs {fmt_bytes(m['allocator_peak'])} (512-byte rounding, memory kernels hold outside any tensor)"])
    if torch.cuda.get_device_capability() >= (8, 9):
        f = fp8_matmul()
        rows.append(["e4m3 matmul against bf16", f"{f['speedup']:.2f}× faster, error {f['error']:.3g} (bf16 {f['bf16_error']:.3g})"])
    note(f"## Deep dive: on a GPU\nOn this GPU ({torch.cuda.get_device_name(0)}), the same measurements' CUDA paths:")
    table(rows, header=["measured on the GPU", "result"], caption="lectures/model/gpu_paths.py")


def what_to_remember(tiles_win=...):
    """`tiles_win`: the outlier size from which the fp8 appendix measured tiles beating
    row-wise scales (None: they never did; left out: not measured in this run)."""
    fp8_scales = ("scales as fine as its outliers (the fp8 appendix measures where tiles start to pay)"
                  if tiles_win is ... else
                  "one scale per token while outliers stay small, a scale per tile or block once "
                  f"outlier channels reach {tiles_win:g}× (measured in the appendix)" if tiles_win else
                  "at least one scale per token (the appendix's tiles never beat row-wise scales here)")
    note(f"""
        ## What to remember
        - A step holds parameters, gradients, optimizer state and activations; mixed-precision AdamW
          costs 16 bytes per parameter, the number ZeRO divides in lecture 03.
        - A block saves about 32·s·b·h bytes in 16-bit (no dropout, fused attention); the loss adds
          its fp32 log-softmax, b·s·v·4, which dominates at large vocabularies.
        - Recomputation, gradient accumulation and chunked cross-entropy each trade time or steps
          for activation memory, and give the same gradients.
        - fp16 needs loss scaling (small gradients underflow); bf16 needs fp32 master weights (an
          update below half a weight's spacing, lr < ulp(w)/2, rounds away).
        - fp8 needs {fp8_scales}, from the current values, summed in fp32: e4m3's cast
          saturates, so a wrong scale fails silently.
        - Attention in key blocks with an online softmax never holds the s × s matrix; its (output,
          log-sum-exp) merge is what ring attention (lecture 06) sends around.

        The companion notebook, `lectures/notebooks/lecture_01_memory_and_precision.ipynb`,
        runs every section above in one process; its first cell holds the knobs (recomputation
        mode, micro-batches, attention block size, the fp8 outliers' size).
    """)


def main():
    try_it_yourself(notebook_exercises("lecture_01_memory_and_precision"))   # its notebook's exercises, for the page
    torch.set_num_threads(1)   # small tensors, shared cores: extra threads mostly wait (roofline uses all)
    intro()                    # what this lecture teaches, and what it needs
    the_model_and_task()       # the GPT and data every later lecture trains
    anatomy_of_a_step()        # what a training step holds, phase by phase
    with deep_dive("The step in bytes, phase by phase",
                   "MemTracker's categories beside our own count for every phase, and what stays between steps"):
        step_in_bytes()
    parameters_and_bytes()     # 16 bytes per parameter, and mixed precision's
    with deep_dive("Counting the parameters", "the usual closed form for Ψ against param_count and the built model"):
        counting_parameters()
    saved_against_formula()    # the paper's formula against what autograd saves
    with deep_dive("What one block saves, tensor by tensor", "the shapes behind the reconciliation's terms"):
        saved_tensor_by_tensor()
    with deep_dive("A step too big to hold", "MemTracker on shapes alone: a billion-parameter step traced without its memory"):
        a_step_too_big_to_hold()
    recomputation()            # trade compute for activation memory
    logits_memory()            # the loss's fp32 log-softmax, and chunked cross-entropy
    accumulation()             # trade steps for activation memory
    number_formats()           # range vs resolution; loss scaling; master weights
    flash_attention_idea()     # attention without the s × s matrix (lecture 06 builds on it)
    with deep_dive("FP8 with fine-grained scales",
                   "which scales e4m3 needs against which outliers, fp32 sums and the current amax"):
        tiles_win = fp8_scaling()
    with deep_dive("FlashAttention's backward", "how the tiles are recomputed from the saved log-sum-exp"):
        flash_attention_backward()
    with deep_dive("Kernels and the roofline, and on a GPU",
                   "what this machine does per second, where a kernel is memory-bound, and the CUDA paths"):
        roofline()
        on_a_gpu()
    with deep_dive("Papers", "the papers this lecture draws on, with links"):
        references()
    what_to_remember(tiles_win)  # the main story in six lines, and the notebook


def bench():
    """Plain-PyTorch online-softmax attention vs PyTorch's fused SDPA, forward, causal."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 16, generator=g) for _ in range(3))
    ours = measure(lambda: online_softmax_attention(q, k, v, 128, causal=True), repeats=7)
    theirs = measure(lambda: causal_attention(q, k, v), repeats=7)
    return [f"lecture_01: online-softmax attention {ours.median * 1e3:.2f} ms vs SDPA "
            f"{theirs.median * 1e3:.2f} ms (s=1024): ratio {ours.median / theirs.median:.1f} "
            "(plain PyTorch vs a fused kernel; no target)"]
