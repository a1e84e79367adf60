"""Putting it together: a 4D mesh, a memory estimator, and a configuration search

Data, pipeline, context and tensor parallelism (and ZeRO on the data axis) on one device mesh;
the same small GPT trained under many layouts and checked against one process; then the
formulas of the earlier lectures turned into a per-rank memory estimator and a step-time model
calibrated on this machine, used to search every valid layout — here, where we can run them,
and at published scale, where we cannot.
"""
import dataclasses
import math
import statistics

from util import cheat, deep_dive, figure, note, plural, published, see, settings, spawn, table, widget
from util import try_it_yourself
from util.measure import machine, timing_ranks, value_range, with_spread

from exercises import listing as notebook_exercises
from lectures.layout.calculator import calculator_data
from lectures.layout.estimator import Layout, ModelShape, estimate_memory
from lectures.model.gpt import param_count
from lectures.layout.search import (GEMM, decision_procedure, near_ties, reproduce_table4, table4_row,
                                    valid_layouts)
from lectures.layout.trainer import GroupCollectives, LayoutTrainer, max_param_diff, reference_run, train_layout
from lectures.layout.mesh import MESH_AXES, axis_groups, make_mesh, mesh_coords
from lectures.layout.step_time import (ASSUMED, FA2_H100, H100_MEMORY, H100_PEAK_BF16, IB_ACHIEVED, IB_BW,
                                       NVLINK_ACHIEVED, LLAMA3_70B, LLAMA3_8B, LLAMA3_405B, NVLINK_BW, dp_parts,
                                       after_the_pipeline, flops_per_token, h100_cluster, matmul_params, mfu,
                                       step_time)
from lectures.layout.figures import (draw_mesh, draw_axis_groups, draw_layout_agreement, draw_memory_bars,
                                     draw_predicted_vs_measured, search_space_picture, draw_search_at_scale,
                                     mfu_picture)
from lectures.layout.demos import (_RESULTS, calibrate, compare_meshes, compute_only_prediction, rank_correlation,
                                   rho_interval, ring_link, small_run, this_machine, time_layouts, timing_layouts,
                                   rho_uncertainty, ties_words, trivial_prediction, verdict_of, worst_ratios)
from lectures.layout.at_scale import across_scale, experts_at_scale, hidden_pick_words, search_at, trust_words
from lectures.layout.published import a100_validation, h100_validation
from lectures.layout.step_time import H100_HBM, a100_cluster, h800_cluster
from lectures.layout.deep_dives import (decision_flow, error_by_axis, memory_with_recomputation, notes,
                                        pytorch_pieces, ratios_by_axis, table4_sensitivity, wire_bytes)


# =========================================================================================
# The page: its sections (what each rank runs is in lectures/layout/demos.py)
# =========================================================================================

LAYOUTS_4 = [  # (name, Layout) trained on 4 ranks; global batch 8 sequences in every one
    ("dp×tp", Layout(dp=2, tp=2, micro_batch=4)),
    ("dp×pp", Layout(dp=2, pp=2, micro_batch=2, micro_batches=2)),
    ("tp×pp", Layout(pp=2, tp=2, micro_batch=2, micro_batches=4)),
    ("dp×cp", Layout(dp=2, cp=2, micro_batch=4)),
    ("dp×cp + ZeRO-1", Layout(dp=2, cp=2, zero=1, micro_batch=2, micro_batches=2)),   # ZeRO over dp·cp
    ("dp×tp + ZeRO-1", Layout(dp=2, tp=2, zero=1, micro_batch=2, micro_batches=2)),
    ("dp×tp + SP", Layout(dp=2, tp=2, sp=True, micro_batch=4)),
    ("dp + ZeRO-1", Layout(dp=4, zero=1, micro_batch=2)),
    ("dp×pp + ZeRO-2", Layout(dp=2, pp=2, zero=2, micro_batch=2, micro_batches=2)),
    ("pp (1F1B)", Layout(pp=4, micro_batch=1, micro_batches=8)),
    ("pp (GPipe)", Layout(pp=4, micro_batch=1, micro_batches=8, schedule="gpipe")),
]
LAYOUT_8 = ("dp×pp×tp", Layout(dp=2, pp=2, tp=2, micro_batch=2, micro_batches=2))
QUICK_SKIPS = ("dp + ZeRO-1", "dp×tp + SP")
ACT_TOLERANCE = 0.08      # saved activations: the formula leaves out a few bytes per token,
ACT_SLACK_PER_TOKEN = 32  # which matter only on a stage that holds almost nothing (no blocks)


def intro():
    note("""
        # Putting it together: 4D parallelism, memory, and choosing a layout
        The earlier lectures each split one thing: the batch (data parallelism and ZeRO,
        lecture 03), the matrices (tensor parallelism, lecture 04), the layers (pipelines,
        lecture 05), the sequence (context parallelism, lecture 06). Real training runs use
        several at once, on one *device mesh*. This lecture builds the mesh, trains lecture 01's
        GPT under many combinations — each checked against one process — and then turns the
        formulas of those lectures into two predictions: **how many bytes each rank holds** and
        **how long a step takes**. Both are checked where we can run them and then used where we
        cannot: an 8B and a 70B model on 64 to 512 H100s.

        **You will learn** how ranks are placed on a (dp, pp, cp, tp) mesh and which group each
        collective runs on; that every combination trains exactly like one process; how to
        predict bytes per rank and seconds per step, and how far to trust those predictions;
        how to choose a layout, by rule of thumb and by search. **You need** lectures 03–06
        (ZeRO, tensor, pipeline and context parallelism: each is used here as a finished
        piece), lecture 02's α–β model, and PyTorch's `torch.distributed` process groups.
    """)


def the_mesh():
    note("## The device mesh")
    figure(draw_mesh((2, 2, 1, 2), highlight=5),
           caption="8 ranks as dp=2 × pp=2 × cp=1 × tp=2. Rank 5's groups are outlined: its tp "
                   "group {4, 5} (neighbours), its pp group {5, 7}, its dp group {1, 5} (the "
                   "farthest apart).")
    note("""
        Lay the ranks out on a grid of shape (dp, pp, cp, tp). Global rank
        $r = ((d\\cdot PP + p)\\cdot CP + c)\\cdot TP + t$: the tensor-parallel index varies
        fastest, so a tensor-parallel group is a run of consecutive ranks — on a GPU cluster,
        GPUs of one node joined by NVLink, because tensor parallelism talks in every layer.
        Context parallelism comes next (a ring exchange per attention layer), then the
        pipeline (one activation per micro-batch and stage boundary), and data parallelism,
        which talks once per step, spans the farthest ranks. This is Llama 3's order ([TP, CP,
        PP, DP] from the innermost out, Llama 3 report §3.3.2); torchtitan orders its mesh
        [pp, dp_replicate, dp_shard, cp, tp], the pipeline outermost. An axis' *groups* are the sets of
        ranks that differ only in that coordinate; every rank belongs to exactly one group of
        each axis, and `dist.new_group` must be called by every rank for every group, in the
        same order.
    """)
    see(mesh_coords)
    see(axis_groups)
    see(make_mesh)
    figure(draw_axis_groups((2, 2, 1, 2)),
           caption="The same 8 ranks, one panel per axis: every group of that axis in its own colour "
                   "(make_mesh's lists). Each rank is in exactly one group per axis; the tp groups are "
                   "neighbours, the dp groups the farthest apart. The last panel is the group the "
                   "gradients are averaged over and ZeRO shards over: the dp·cp ranks with the same "
                   "weights (here cp = 1, so it equals dp).")
    figure(draw_axis_groups((2, 1, 2, 2)),
           caption="With context parallelism (dp=2 × cp=2 × tp=2): the cp groups hold different "
                   "tokens of the same sequences with the same weights, so the replica group spans "
                   "dp and cp — 4 ranks, not 2.")
    rows, agree = [], True
    for shape in [(2, 1, 1, 2), (1, 2, 1, 2), (2, 1, 2, 1), (1, 1, 2, 2)]:
        run = spawn(compare_meshes, 4, shape=shape,
                    name=f"mesh dp{shape[0]} pp{shape[1]} cp{shape[2]} tp{shape[3]}: ours vs init_device_mesh")
        if run.skipped:      # torchrun started fewer ranks: the page says so, and there is nothing to compare
            continue
        got = run.returns
        same = sum(all(g["ours"][a] == g["torch"][a] for a in MESH_AXES) for g in got)
        counted = sum(all(g.get("sums", {}).get(a, 1) == len(g["ours"][a]) for a in MESH_AXES) for g in got)
        agree &= same == counted == len(got)
        groups = {a: sorted({tuple(g["ours"][a]) for g in got}) for a in MESH_AXES}
        rows.append(["×".join(map(str, shape))]
                    + [" ".join(str(list(x)) for x in groups[a]) if shape[MESH_AXES.index(a)] > 1 else "—"
                       for a in MESH_AXES]
                    + [f"{same} of {len(got)}", f"{counted} of {len(got)}"])
    assert agree, "our groups differ from init_device_mesh's"
    if rows:
        table(rows, header=["dp×pp×cp×tp", "dp groups", "pp groups", "cp groups", "tp groups",
                            "ranks whose groups equal init_device_mesh's", "all-reduce counts the members"],
              caption="Every group of every axis on 4 ranks, from our make_mesh; PyTorch's init_device_mesh "
                      "with mesh_dim_names=('dp', 'pp', 'cp', 'tp') gives the same lists on every rank, and an "
                      "all-reduce over each group counts its members.")
    _RESULTS["mesh_agrees"] = agree if rows else None      # None: not compared (skipped under torchrun)


def many_layouts():
    run = small_run()
    cfg = run.cfg
    note("## One model, many layouts")
    idea = f"""
        Lecture 01's GPT ({cfg.n_layers} layers, h = {cfg.d_model}, {cfg.n_heads} heads,
        sequences of {cfg.seq_len} tokens, vocabulary {cfg.vocab_size}; Ψ = {param_count(cfg):,})
        on its Markov-chain task, global batch {run.global_batch} sequences, AdamW, {run.steps}
        steps. Each layout applies the earlier lectures' pieces to the same seeded model, in a
        fixed order: tensor parallelism (lecture 04's `parallelize_gpt` on the mesh's tp group;
        vocabulary-parallel embedding, head and loss), context parallelism (lecture 06's ring
        attention on zig-zag token shards, the cp group), pipeline stages (lecture 05's
        `GPTStage` and executor with the pp group), then the gradient average over the *weight
        replicas* — the dp × cp ranks with the same pp and tp coordinates, since context
        parallelism splits tokens, not weights — and AdamW or lecture 03's ZeRO-1 or ZeRO-2 on
        that group. One thin adapter is written here: lecture 03's collectives run on the whole
        world, so `GroupCollectives` gives them an explicit group (and ZeRO its shard index).
    """
    ref = reference_run(run)
    runs = []
    cases = list(LAYOUTS_4) + [LAYOUT_8]
    if settings.quick:     # the tests run the rest; the quick build keeps one of each kind
        cases = [c for c in cases if c[0] not in QUICK_SKIPS]
    for name, lay in cases:
        demo = spawn(train_layout, lay.world, run=run, layout=lay,
                     name=f"layout {name}: {lay.label()}, {lay.world} ranks")
        if demo.skipped:
            continue
        runs.append((name, lay, demo.returns))
    rows = []
    for name, lay, got in runs:
        loss_diff = max(abs(x - y) for x, y in zip(got[0]["losses"], ref["losses"]))
        pdiff = max_param_diff(got, ref["params"])
        rows.append([name, lay.label(), lay.world, got[0]["losses"][-1], loss_diff, pdiff])
    figure(draw_layout_agreement(ref, runs, rows),
           caption=f"Top: the one-process loss, with every layout's loss at each step on top of it "
                   f"({len(runs)} layouts on {' and '.join(sorted({str(l.world) for _, l, _ in runs}))} ranks: they coincide). Bottom: how far each layout is "
                   f"from one process, on a log scale — float32 summation order, far below the 1e-4 "
                   f"the build requires.")
    note(idea)
    see(LayoutTrainer)
    see(GroupCollectives)
    table(rows, header=["layout", "mesh and micro-batching", "ranks", "last loss",
                        "max |Δ loss| vs one process", "max |Δ parameter| vs one process"],
          caption=f"After {run.steps} AdamW steps, every parameter (tensor-parallel slices gathered, "
                  f"pipeline stages merged) against the one-process run; float32, so differences of "
                  f"~1e-6 are summation order. One-process last loss {ref['losses'][-1]:.6f}.")
    worst = max(r[-1] for r in rows)
    assert worst < 1e-4, f"a layout drifted from one process: {worst}"
    _RESULTS["layouts"] = runs
    _RESULTS["layout_worst_diff"] = worst
    return runs


def memory_estimator():
    runs = _RESULTS.get("layouts") or many_layouts()
    cfg = small_run().cfg
    shape = ModelShape.from_gpt(cfg)
    note("""
        ## Memory per rank: the formulas together
        For each rank, from the earlier lectures:

        * **weights** $= b_w\\,\\Psi_\\text{stage}/\\text{tp}$ for the split matrices plus the
          replicated norms and row-parallel biases; the first stage adds the embeddings
          (vocabulary-parallel: $v h/\\text{tp}$), the last the final norm and head; ZeRO-3
          divides by dp·cp — ZeRO shards over every rank that holds the same weights, and
          context parallelism splits tokens, not weights — and keeps two blocks unsharded at a
          time (`gathered`);
        * **gradients** the same count at $b_g$ bytes (fp32 in mixed precision: micro-batches
          accumulate in fp32), divided by dp·cp under ZeRO-2/3;
        * **optimizer** $K$ bytes per parameter (AdamW in fp32: two moments, $K = 8$; mixed
          precision: master weights too, $K = 12$), divided by dp·cp under ZeRO-1/2/3;
        * **activations** per block and token: the block input, both norm outputs, the residual
          after attention and the norm statistics stay whole ($4h + 4$ elements), while Q, K, V,
          the attention output and log-sum-exp and the MLP's $2f$ split over tp
          ($(2h + 2h_{kv} + a + 2f)/\\text{tp}$; sequence parallelism splits the rest too); times
          $b\\cdot s/\\text{cp}$ tokens per micro-batch, times the micro-batches a stage holds at
          once (all $m$ under GPipe, $\\text{pp} - \\text{stage}$ under 1F1B); full
          recomputation keeps only each block's input, plus one block while it is recomputed;
          the last stage's loss briefly holds two fp32 copies of its logits in backward.
    """)
    memory_at_scale()      # the picture first: the formulas at published scale
    note("""
        Measured on every rank of every run of "One model, many layouts": the bytes of the parameters, gradients and
        optimizer-state tensors the rank holds, and the peak bytes autograd kept for backward
        (a saved-tensors hook, counting each storage once and releasing it when autograd does;
        the pipeline executor of lecture 05 counts its stages' own).
    """)
    see(ModelShape.act_elements_per_token)
    see(estimate_memory)
    memory_of_the_layouts(runs, shape)
    with deep_dive("Sequence parallelism and full recomputation in the estimator",
                   "where the estimator follows Megatron-LM rather than lecture 04, and full recomputation measured"):
        memory_with_recomputation(cfg, shape, sp_shown=any(lay.sp for _, lay, _ in runs))


def memory_of_the_layouts(runs, shape):
    """Every run of many_layouts: what its ranks held against the estimator, stage by stage."""
    rows, worst = [], {"weights": 0, "grads": 0, "optimizer": 0, "activations": 0}
    for name, lay, got in runs:
        seen = set()
        for r in got:
            key = r["coords"]["pp"]
            if key in seen:
                continue              # equal ranks (replicas, tp peers) say the same
            seen.add(key)
            est = estimate_memory(shape, lay, r["coords"]["pp"])
            m = r["memory"]
            errs = {}
            for k in worst:
                e = est["stored activations" if k == "activations" else k]
                errs[k] = (m[k] - e) / e
                worst[k] = max(worst[k], abs(errs[k]))
            rows.append([name, f"pp stage {r['coords']['pp']}" if lay.pp > 1 else "every rank"]
                        + [x for k in worst for x in (m[k], est["stored activations" if k == "activations" else k])]
                        + [f"{100 * errs['activations']:+.1f}%"])
    table(rows, header=["layout", "rank", "weights measured", "predicted", "grads measured", "predicted",
                        "optimizer measured", "predicted", "activations measured", "predicted",
                        "activation error"],
          caption="Bytes per rank, measured vs the estimator (float32 runs).")
    note(f"""
        Weights, gradients and optimizer state are predicted to within
        {100 * max(worst['weights'], worst['grads'], worst['optimizer']):.2f}% (exact counts:
        the tensors are what the formulas say). Saved activations are within
        {100 * worst['activations']:.1f}% (tolerance {100 * ACT_TOLERANCE:.0f}%): what the
        formula leaves out are a few bytes per token — the vocabulary-parallel loss's masks and
        indices, a stage's received input.
    """)
    _RESULTS["memory_worst"] = worst
    plain = next(((name, got) for name, lay, got in runs if not lay.zero), None)   # no ZeRO: every state whole
    if plain:
        m = plain[1][0]["memory"]
        per_param = (m["weights"] + m["grads"] + m["optimizer"]) / (m["weights"] / 4)   # float32 weights: 4 bytes each
        cheat("bytes per parameter", "$4 + 4 + 8 = 16$ bytes per parameter (fp32 weights, gradients, AdamW's two moments); "
              "ZeRO-$k$ divides its parts by dp·cp", round(per_param, 2), "bytes",
              what=f"per parameter rank 0 holds, {plain[0]} layout, measured from its tensors")


def memory_at_scale():
    """How the parts scale, for a model we cannot run: the estimator at published scale."""
    lays = [("dp", Layout(dp=64, micro_batch=1, precision="bf16")),
            ("dp + ZeRO-1", Layout(dp=64, zero=1, micro_batch=1, precision="bf16")),
            ("dp + ZeRO-3", Layout(dp=64, zero=3, micro_batch=1, precision="bf16")),
            ("tp8 + SP", Layout(dp=8, tp=8, sp=True, zero=1, micro_batch=1, precision="bf16")),
            ("tp8 pp4 + SP", Layout(dp=2, tp=8, pp=4, sp=True, zero=1, micro_batch=1, micro_batches=8, precision="bf16")),
            ("tp8 pp4 + SP + recompute", Layout(dp=2, tp=8, pp=4, sp=True, zero=1, micro_batch=1, micro_batches=8,
                                                recompute="full", precision="bf16"))]
    figure(draw_memory_bars(LLAMA3_70B, lays),
           caption=f"The same estimator at published scale ({LLAMA3_70B.name}, bf16 weights + fp32 gradients "
                   f"and AdamW, sequences of {LLAMA3_70B.seq}): each split removes part of a bar. The "
                   "axis stops at 2.5 × an H100's memory; a bar that runs past it says its total.")
    note("""
        At this scale three terms the small runs cannot show decide what fits: gradients are
        accumulated in fp32 (Megatron-LM and Llama 3: 2 + 4 + 12 = 18 bytes per parameter, not
        the ZeRO paper's 16; lecture 01's 20 is another recipe, which keeps the bf16 gradients
        beside a separate fp32 buffer that sums them, where Megatron-LM accumulates straight into
        the fp32 one), ZeRO-3 keeps about two blocks' weights and gradients unsharded
        while it computes (`gathered`), and the loss's backward holds two fp32 copies of the
        logits — about 4 GB each for Llama 3 at one sequence of 8192 tokens without tensor
        parallelism.

        A calculator at the start of the published-scale section runs this estimator in the page
        for any model and layout you type.
    """)


def search_here():
    run = small_run()
    shape = ModelShape.from_gpt(run.cfg)
    rows = []
    for world in (1, 2, 4, 8):
        ls = valid_layouts(shape, world, run.global_batch)
        meshes = sorted({(l.dp, l.pp, l.cp, l.tp) for l in ls})
        rows.append([world, len(meshes), len(ls), ", ".join("×".join(map(str, m)) for m in meshes)])
    note("## Every valid configuration")
    search_space_picture(rows)
    note(f"""
        A configuration is valid when the four axes multiply to the rank count and each
        axis can split what it splits: tp divides the heads and the K/V heads, pp divides the
        layers (equal stages), the sequence splits into 2·cp zig-zag chunks, dp divides the
        global batch, and a pipeline gets at least pp micro-batches. For this GPT
        ({shape.layers} layers, {shape.heads} heads, sequence {shape.seq}, global batch
        {run.global_batch}):
    """)
    see(valid_layouts)
    table(rows, header=["ranks", "meshes", "configurations (with micro-batching, ZeRO-1)", "meshes dp×pp×cp×tp"],
          caption="The search space grows fast: each mesh multiplies by the ways to cut the batch.")


def fixed_costs(hw):
    """The fixed costs this build's calibration found: a fit can put one at zero."""
    found = [("per block", hw.overhead), ("per message", max(hw.intra[0], (hw.p2p or (0,))[0])),
             ("per ring step", max(hw.ring_step))]
    return [name for name, seconds in found if seconds > 0]


def without_fixed_costs(hw):
    """`hw` with every fixed cost a fit can find at zero: per block, per message, per ring step."""
    zero = lambda link: link and (0.0, link[1])
    return dataclasses.replace(hw, overhead=0.0, ring_step=(0.0, 0.0), intra=zero(hw.intra), inter=zero(hw.inter),
                               p2p=zero(hw.p2p))


def fixed_share(shape, layout, hw):
    """The share of `layout`'s predicted step that its fixed costs take."""
    return 1 - step_time(shape, layout, without_fixed_costs(hw))["total"] / step_time(shape, layout, hw)["total"]


def fixed_costs_sentence(hw, share, layout):
    found = fixed_costs(hw)
    if not found:
        return ("This build's fit put every fixed cost (per block, per message, per ring step) at "
                "zero; the model keeps those terms for builds, and machines, that measure them.")
    why = ": that is why the cost model carries them and counts messages, not only bytes" if share >= 0.2 else ""
    return (f"Fixed costs — {', '.join(found)} in this build's fit — make up {100 * share:.0f}% of the "
            f"predicted step of {layout.label()}{why}.")


def step_time_model():
    run = small_run()
    ranks = timing_ranks(4)
    shape = ModelShape.from_gpt(run.cfg)
    quick = settings.quick
    note(f"""
        ## Predicting the step time
        The cost model adds up, for the slowest pipeline stage: compute (its FLOPs over the
        measured rate, plus a fixed cost per block, for launches and Python; full
        recomputation runs the forward again), the tensor-parallel all-reduces (4 per block and
        micro-batch, 6 with recomputation), the ring-attention steps (their bytes and a fixed
        cost per step), the pipeline's $m + \\text{{pp}} - 1$ slots (the bubble is
        $\\text{{pp}}-1$ of them), and the gradient sync over the weight replicas — once per step
        in the last micro-batch's backward for plain data parallelism and ZeRO-1, every
        micro-batch for ZeRO-2 and ZeRO-3 (`dp_parts`). A later pipeline stage ends its last
        backward before the first stage does, and spends that cool-down on its once-a-step sync;
        the optimizer step waits for every stage, as clipping by the global norm does
        (`after_the_pipeline`). Collectives use lecture 02's α–β
        model per ring step. Every constant is measured in this build, {machine(ranks)}: one
        rank per core, every rank busy at once, as in the runs being predicted — but in
        calibration runs of their own (matmuls, one-process steps, collectives, one block's
        ring attention), never in the layouts' training steps, which are the validation.
    """)
    see(step_time)
    see(dp_parts)
    see(after_the_pipeline)
    # 4 KB to 4 MB (quick: 4-256 KB and 4 MB): the small sizes are latency-bound and fix α; β
    # needs a size whose time grows with its bytes
    sizes = [4096 * 4 ** k for k in range(4)] + [4 * 2 ** 20] if quick else [4096 * 4 ** k for k in range(6)]
    cal = spawn(calibrate, ranks, cfg=run.cfg, batch_sizes=[1, 2, 4, 8], sizes=sizes,
                repeats=5 if quick else 9, name=f"calibration: matmul, model compute, all-reduce, send/recv and a ring step, {ranks} ranks").returns[0]
    hw = this_machine(cal, run.cfg, ranks)
    _RESULTS["this_machine"] = hw     # the calculator at published scale offers these constants too
    a_ar, b_ar = cal["fit_all_reduce"]
    a_p, b_p = cal["fit_p2p"]
    fell_back = ring_link(cal, ranks)[1]
    gbs = lambda b: f"{b / 1e9:.2f} GB/s" if math.isfinite(b) else "no growth with size (β = ∞)"
    rows = [["matmul FLOP/s (one rank, {0}×{0} fp32)".format(cal["matmul"]["n"]), f"{cal['matmul']['flops'] / 1e9:.2f} GFLOP/s", cal["matmul"]["timing"].ms()],
            ["model compute rate (fit over micro-batches 1–8)", f"{hw.flops / 1e9:.2f} GFLOP/s", ""],
            ["fixed cost per block and micro-batch", f"{hw.overhead * 1e3:.3f} ms", ""],
            ["optimizer step (whole model)", f"{hw.step_overhead * 1e3:.3f} ms", cal["optimizer"].ms()],
            [f"all-reduce on {ranks} ranks: α, β", f"{a_ar * 1e6:.0f} µs, {gbs(b_ar)}",
             "β not used: the send/recv β stands in" if fell_back else ""],
            ["send/recv: α, β", f"{a_p * 1e6:.0f} µs, {gbs(b_p)}", ""]]
    if cal.get("ring"):
        rows.append(["ring-attention step beyond its FLOPs and bytes (forward, backward)",
                     f"{hw.ring_step[0] * 1e3:.3f} ms, {hw.ring_step[1] * 1e3:.3f} ms",
                     f"ring {cal['ring']['ring forward+backward'].ms()}; alone {cal['ring']['alone forward+backward'].ms()}"])
    constants = rows      # shown after the picture and the layouts it predicts
    layouts = timing_layouts(run, ranks)
    # The full build times every valid layout, the quick one at least 6; one warm-up step is
    # enough here (the first step builds AdamW's state, later ones are alike).
    times = spawn(time_layouts, ranks, run=run, layouts=layouts, repeats=5, warmup=1,
                  name=f"step time of {len(layouts)} layouts, {ranks} ranks").returns[0]
    pred = [step_time(shape, l, hw)["total"] for l in layouts]
    meas = [t.median for t in times]
    rho = rank_correlation(pred, meas)
    rho_trivial = rank_correlation([trivial_prediction(shape, l) for l in layouts], meas)
    free = [compute_only_prediction(shape, l, hw) for l in layouts]
    rho_compute = rank_correlation(free, meas)
    rows = []
    for i, (l, p, t) in enumerate(zip(layouts, pred, times), 1):
        parts = step_time(shape, l, hw)
        rows.append([i, l.label(), p * 1e3, t.ms(), t.median / p,
                     ", ".join(f"{k} {parts[k] * 1e3:.1f}" for k in ("compute", "tp", "cp", "pp", "bubble", "dp") if parts[k] > 0)])
    figure(draw_predicted_vs_measured(layouts, pred, times, rho, ranks),
           caption=f"Predicted vs measured, {len(layouts)} layouts (median and IQR), {machine(ranks)}. "
                   "Each number is the table's #; points above the dashed line took longer than predicted.")
    table(rows, header=["#", "layout", "predicted (ms)", "measured (median, IQR)", "measured / predicted",
                        "predicted parts (ms)"],
          caption=f"Every valid layout{' (quick build: a subset)' if quick else ''} of the "
                  f"{ranks}-rank search, predicted and measured (5 repeats, no meter); Spearman "
                  f"rank correlation ρ = {rho:.2f}.")
    table(constants, header=["constant", "value", "measured (median, IQR)"],
          caption="The cost model's constants, all measured by this build's calibration runs."
                  + (" The all-reduce fit found no growth with size (β = ∞, a latency-bound fit), which "
                     "would make every byte free: ring steps use the send/recv β instead." if fell_back else ""))
    by_axis = ratios_by_axis(layouts, pred, meas)
    best_pred, best_meas = layouts[pred.index(min(pred))], layouts[meas.index(min(meas))]
    ratios = {k: statistics.median(v) for k, v in by_axis.items()}
    worst_axis = max(ratios, key=lambda k: abs(math.log(ratios[k])))
    lo_ratio, hi_ratio = min(t / p for t, p in zip(meas, pred)), max(t / p for t, p in zip(meas, pred))
    slower = sum(t > p for t, p in zip(meas, pred))
    n_lay = len(meas)
    direction = ("so the model under-predicts every layout" if slower == n_lay else
                 "so the model over-predicts every layout" if slower == 0 else
                 f"{slower} of {n_lay} slower than predicted, so the model mostly under-predicts"
                 if slower >= 0.75 * n_lay else
                 f"{n_lay - slower} of {n_lay} faster than predicted, so the model mostly over-predicts"
                 if slower <= 0.25 * n_lay else
                 f"{slower} of {n_lay} slower than predicted and {n_lay - slower} faster, so the model errs both ways")
    lo_rho, hi_rho = rho_interval(rho, len(layouts))
    verdict = verdict_of(rho_trivial, lo_rho, hi_rho)
    note(f"""
        The model ranks the layouts with Spearman ρ = **{rho:.2f}**. A predictor with no
        constants at all — micro-batches × blocks on the busiest rank — reaches
        ρ = {rho_trivial:.2f}, so the cost model {verdict} counting work. The same model with
        every transfer free (compute and bubble only) reaches ρ = {rho_compute:.2f}, so the full
        model {verdict_of(rho_compute, lo_rho, hi_rho)} the model without its communication
        terms{ties_words(free)}. Both baselines follow the number of micro-batches, which differs
        between layouts, so they are the bar to clear, not a measure of the terms alone. With
        {len(layouts)} layouts a ρ is uncertain ({rho_uncertainty(rho, lo_rho, hi_rho)}),
        which is why the absolute errors sit beside it. Every layout measured
        **{value_range(lo_ratio, hi_ratio, decimals=2)}×** its prediction, {direction}. It is
        furthest off for **{worst_axis}**: its {plural(len(by_axis[worst_axis]), 'layout')} measured
        {worst_ratios(by_axis[worst_axis])}
        the prediction (the deep dive below gives every axis, and what the model leaves out of
        ZeRO on gloo). The constants are
        calibrated under the same load as the runs they predict, but on shared cores that load
        changes between the calibration and the runs and from build to build, so the constants
        (and this range) swing between builds; the ranking carries over better than the
        absolute times. It predicts **{best_pred.label()}** fastest; the
        fastest measured was **{best_meas.label()}**. {fixed_costs_sentence(hw, fixed_share(shape, best_pred, hw), best_pred)}

        **What these timings validate, and what they cannot.** They exercise the per-block
        fixed cost, the per-message α, the ring-step cost, gloo's bytes per second, pipelines of
        at most {max(l.pp for l in layouts)} stages without interleaving, and data-parallel
        traffic that hides under nothing (overlap {hw.overlap:g} here). At published scale
        those fixed costs are set to zero, and what chooses the layouts there is never timed
        on this machine: an H100's sustained FLOP rate, NVLink and InfiniBand bandwidth and
        which groups cross nodes, the overlap of data-parallel traffic (assumed complete),
        deep and interleaved pipelines, and all four axes at once. Their *byte* counts are
        checked exactly (the deep dive "The communication model, checked exactly on the
        wire"); their *times* are checked only against the
        published runs below. So ρ here supports the counting, not the picks at scale.
    """)
    _RESULTS.update(hw=hw, cal=cal, rho=rho, rho_trivial=rho_trivial, rho_compute=rho_compute, timed=list(zip(layouts, pred, times)))
    return rho


def published_scale():
    a = {k: v for k, v in ASSUMED.items() if k != GEMM}
    note(f"""
        ## At published scale: Llama 3's runs, then an 8B and a 70B model on 64–512 H100s
        The same estimator and cost model, with published hardware numbers instead of
        measured ones (the table: what a DGX H100 node of 8 GPUs offers, and what NCCL
        achieves of it; the rest is protocol overhead). Models: Llama 3 8B and
        70B (grouped-query attention with 8 K/V heads, SwiGLU, vocabulary 128,256), sequences of
        8192, a global batch of 512 sequences (4M tokens, Llama 3's first batch size; Llama 3
        report, §3.4.1), bf16 weights with fp32 gradients and AdamW. The search covers tp ≤ 8 (one node), any pp dividing the
        layers, interleaved virtual stages (v = 1, 2, 4, 5), cp, ZeRO 0–3, recomputation (none,
        selective or full), sequence parallelism or not, micro-batches of 1, 2 (and 4 in the
        full build). Every constant below is published or fitted; the deep dive after it lists
        the model's assumptions.
    """)
    table([["dense BF16 compute", f"{H100_PEAK_BF16 / 1e12:.0f} TFLOP/s", "", "NVIDIA H100 datasheet"],
           ["memory", f"{H100_MEMORY / 2 ** 30:.0f} GiB ({H100_MEMORY / 1e9:.1f} GB)", "", "NVIDIA H100 datasheet"],
           ["NVLink 4, each way", f"{NVLINK_BW / 1e9:.0f} GB/s (900 GB/s both ways)",
            f"{NVLINK_ACHIEVED / 1e9:.0f} GB/s", "NVIDIA's NCCL team, nccl-tests issue 212"],
           ["InfiniBand NDR, one 400 Gb/s port", f"{IB_BW / 1e9:.0f} GB/s",
            f"46–48 GB/s (the model takes {IB_ACHIEVED / 1e9:.0f})", "the same team, nccl-tests issue 290"]],
          header=["per H100 SXM", "published", "NCCL achieves", "source"],
          caption="the published hardware numbers the model uses at scale")
    with deep_dive("Every assumption of the model at scale, stated",
                   "what is assumed rather than cited, and what the model leaves out"):
        note(f"""
            ## Deep dive: every assumption of the step-time model at scale
            Assumed, not cited:
            {'; '.join(f'{k} {v}' for k, v in a.items())}. The sustained GEMM fraction of peak is
            not assumed: it is fitted on one published run below. Attention is not assumed either:
            it runs at FlashAttention-2's published best on an H100, {FA2_H100 / 1e12:.0f} TFLOP/s
            forward and backward ({100 * FA2_H100 / H100_PEAK_BF16:.0f}% of peak; Dao 2023, §4.1),
            on the half of its 12·h·s FLOPs per token and block that a causal kernel computes (MFU
            still counts all 12·h·s, as PaLM's convention does). Other matrix products run at the
            fitted rate less what tile and wave quantization waste on the H100's 132 SMs (NVIDIA's
            GEMM guide, §3; `gemm_efficiency`): the fit is for products whose tiles fill every wave;
            memory-bound kernels (norms, activations, residual adds, with the course's selective recomputation their re-run, and AdamW's step) move
            their bytes at the stated fraction of HBM's datasheet rate ({H100_HBM / 1e12:.2f} TB/s on an H100); nothing
            else costs time — no kernel launches, no stragglers or failures; communication never
            slows compute (on GPUs NCCL's kernels share the SMs); a group is inside a node only when
            it tiles the nodes (tp = 6 on 8-GPU nodes straddles two, and is charged the network);
            tensor-parallel, context-parallel and pipeline transfers are fully exposed; the
            data-parallel traffic hides under the compute beside it as `dp_traffic` says (fully,
            with the overlap assumed above), and a later stage's once-a-step sync also in its
            pipeline cool-down (1F1B's, for DeepSeek-V3's DualPipe too); every stage then waits for
            the others before its optimizer step, as clipping by the global gradient norm requires;
            an all-gather, reduce-scatter or all-reduce takes the ring's time on NCCL (this
            machine's gloo sends an all-reduce's bytes for a reduce-scatter); each pipeline stage gets equal blocks and the last one the LM head.
        """)
        note("""
            The assumption that data-parallel traffic hides under the backward rests on GPU
            measurements like the one below; this CPU cannot check it, because gloo moves the bytes
            with CPU threads that compete with the very compute they would hide under.
        """)
        published("""
            Li et al. 2020 (PyTorch Distributed: Experiences on Accelerating Data Parallel Training,
            PVLDB 13(12)), with gradient bucketing and communication overlapped with the backward:
            "when configured appropriately, the PyTorch distributed data parallel module attains
            near-linear scalability using 256 GPUs".
        """, "https://arxiv.org/abs/2006.15704", "Li et al. 2020, PyTorch Distributed, abstract")

    # the calculator opens the section, so the two fits it offers are made first and shown below
    table4, a100 = reproduce_table4(LLAMA3_405B, h100_cluster), a100_validation()
    calculator(h100_cluster(**{GEMM: table4[0]}), a100[0])
    hw, band = llama3_table4(table4)
    band = max(band, across_scale(a100))
    _RESULTS["h100_validation"] = h100_validation(hw)     # read by the deep dive on published runs
    experts_at_scale(hw)
    rows, agree, outcomes, searched, rule_of = [], [], [], {}, {}
    for model in (LLAMA3_8B, LLAMA3_70B):
        for world in (64, 512):
            found = searched[model.name, world] = search_at(model, world, hw)
            fitting = [r for r in found if r["fits"]]
            rule, why = decision_procedure(model, world, 512, hw)
            rule_of[model.name, world] = rule
            outcomes.append((f"{model.name.replace('Llama 3 ', '')} on {world}", why))
            agree.append(bool(fitting) and rule == fitting[0]["layout"])
            tokens = 512 * model.seq
            for tag, r in [("search: fastest that fits", fitting[0] if fitting else None),
                           ("search: runner-up", fitting[1] if len(fitting) > 1 else None)]:
                if r is None:
                    continue
                t = r["time"]["total"]
                rows.append([model.name, world, tag, r["layout"].label(), r["memory"]["total"] / 2 ** 30, t,
                             mfu(model, tokens / t, world * H100_PEAK_BF16), r["time"]["dp before hiding"],
                             ""])
            if rule is not None:
                t = step_time(model, rule, hw)["total"]
                rows.append([model.name, world, "decision procedure", rule.label(),
                             estimate_memory(model, rule)["total"] / 2 ** 30, t,
                             mfu(model, tokens / t, world * H100_PEAK_BF16),
                             step_time(model, rule, hw)["dp before hiding"], "; ".join(why)])
    fig = draw_search_at_scale((LLAMA3_8B, LLAMA3_70B), searched, rule_of, hw)
    val = _RESULTS.get("validation", {})
    near = {name: err for name, err in val.items() if "Llama 3 8B" in name or "Llama 3 70B" in name}
    mosaic = [r for r in _RESULTS["mpt_validation"][0] if r["run"]["model"].name in ("MPT 7B", "MPT 70B")]
    table(rows, header=["model", "GPUs", "chosen by", "layout", "GiB per GPU", "s per step", "MFU",
                        "DP seconds before hiding", "why"],
          caption=f"The search's best layouts beside the syllabus' decision procedure, predicted. "
                  f"{trust_words(_RESULTS['h100_validation'], near, mosaic)} "
                  f"{hidden_pick_words([(m, w, searched[m.name, w]) for m in (LLAMA3_8B, LLAMA3_70B) for w in (64, 512)])} 'DP seconds before "
                  f"hiding': one step's data-parallel collectives on the busiest stage, before the assumed overlap "
                  f"and the cool-down hide them; where they are a large share of the step, the pick rests on that "
                  f"assumption (with less overlap, ZeRO-2/3 picks lose first).")

    with deep_dive("The search's space and the decision procedure, step by step",
                   "every configuration at 512 GPUs, and the rule of thumb as code and as a flowchart"):
        decision_flow(outcomes, fig)
    differ = [(k, rule_of[k], searched[k]) for k in searched if rule_of.get(k) is not None
              and not agree[list(searched).index(k)]]
    exposed = [(name, world, r, step_time(LLAMA3_8B if "8B" in name else LLAMA3_70B, r, hw))
               for (name, world), r, _ in differ]
    worst = max(exposed, key=lambda e: e[3]["dp"] / e[3]["total"], default=None)
    why_differ = "Where they differ, the rule stopped at the first layout that fits and the search found a faster one."
    if worst and worst[3]["dp"] > 0.2 * worst[3]["total"]:
        how = {2: "ZeRO-2 reduce-scatters the fp32 gradients every micro-batch",
               3: "ZeRO-3 gathers the weights twice and reduce-scatters the fp32 gradients every micro-batch"}
        share = with_spread(f"{100 * worst[3]['dp'] / worst[3]['total']:.0f}%",
                            f"{worst[3]['dp']:.2f} of {worst[3]['total']:.2f} s")
        why_differ = f"""The case with the most exposed data-parallel traffic is {worst[0]} on {worst[1]} GPUs: the rule stops at
        {worst[2].label()}, and {share} of its step is *exposed* data-parallel traffic —
        {how.get(worst[2].zero, "its gradient sync")}, more than a micro-batch's backward can
        hide — while the search fits the model with tensor parallelism and a larger micro-batch,
        which the rule never tries before sharding more."""
    note(f"""
        The rule of thumb picks the search's fastest layout in {sum(agree)} of the {len(agree)}
        cases. {why_differ} The rule's value is that it needs no cost model; the search's is
        that it compares the thousands of configurations that fit.
    """)
    _RESULTS["published"] = rows
    nvidia_and_ties(searched, hw, band)


def calculator(hw, a100_fraction=None):
    machines = [_RESULTS["this_machine"]] if "this_machine" in _RESULTS else []
    fitted = dataclasses.replace(hw, name=f"DGX H100 cluster, GEMMs at {100 * hw.flops / hw.peak:.0f}% of peak (fitted below)")
    if a100_fraction is not None:
        a100 = a100_cluster(**{GEMM: a100_fraction})
        machines.append(dataclasses.replace(a100, name=f"DGX A100 cluster, GEMMs at {100 * a100.flops / a100.peak:.0f}% "
                                                        "of peak (fitted on Megatron-LM's 76.1B)"))
    machines.append(dataclasses.replace(h800_cluster(**{GEMM: hw.flops / hw.peak}),
                                        name="H800 cluster, the H100's GEMM fraction, all-to-alls exposed"))
    widget("memory-calculator", calculator_data(hardware=machines, cluster=fitted),
           caption=f"Try it: the estimator and the step-time model in the page (JavaScript ports the tests "
                   f"check against Python on hundreds of random layouts). "
                   f"Per-rank memory of the most loaded pipeline stage (the black line is the device's "
                   f"memory, starting at the search's cap: {hw.memory / 2 ** 30:.1f} GiB, "
                   f"{ASSUMED['usable fraction of HBM']} of 80 GiB) and the predicted step time with its parts, "
                   f"on the H100 cluster's constants with the GEMM fraction fitted on Table 4 below, the A100 "
                   f"cluster's fitted on Megatron-LM's 76.1B, the H800's, or this machine's as measured above. "
                   f"Experts: set experts > 0 (the DeepSeek-V3 preset) and ep, a divisor of dp and of the experts.")


def llama3_table4(fitted=None):
    """Table 4 of the Llama 3 report through the model: the GEMM fraction fitted on one row,
    the other rows predicted (`fitted`: reproduce_table4's result, if made already); returns the
    calibrated hardware and the model's error band."""
    frac, out = fitted or reproduce_table4(LLAMA3_405B, h100_cluster)
    hw = h100_cluster(**{GEMM: frac})
    note(f"""
        ### Llama 3 405B: Table 4 through the model
        Meta published three layouts of Llama 3 405B with the MFU each measured (Llama 3
        report, Table 4), but not their micro-batch size, virtual stages, ZeRO stage or
        recomputation: the search chooses those on each row's mesh, under the same memory cap as
        everywhere here ({hw.memory / 2 ** 30:.1f} GiB). How fast an H100 runs these GEMMs is
        honestly unknown: it is fitted on the first row alone ({100 * frac:.1f}% of peak), and the
        other rows are *predicted* with it and every other constant as stated above.
    """)
    rows = []
    for i, (row, best, err) in enumerate(out):
        lay, t = best["layout"], best["time"]
        rows.append([f"{row['gpus']:,}", f"TP{row['tp']} CP{row['cp']} PP{row['pp']} DP{row['dp']}",
                     f"{row['seq'] // 1024}K", "fitted" if i == 0 else "predicted", lay.label(),
                     f"{best['memory'] / 2 ** 30:.1f}", f"{100 * best['mfu']:.1f}%", f"{100 * row['mfu']:.0f}%",
                     "—" if i == 0 else f"{100 * err:+.1f}%",
                     " · ".join(f"{k} {100 * t[k] / t['total']:.0f}%"
                                + (f" (attention {100 * t['attention'] / t['total']:.0f}%)" if k == "compute" else "")
                                for k in ("compute", "tp", "cp", "bubble", "pp", "dp") if t[k] > 0)])
    table(rows, header=["GPUs", "mesh (Table 4)", "sequence", "role", "the search's open knobs",
                        "GiB per GPU", "MFU predicted", "MFU measured", "error", "where the step goes"],
          caption="Llama 3 405B's Table 4 rows through the course's model: the GEMM fraction is fitted "
                  "on the first row only, with attention at FlashAttention-2's published rate and NCCL's "
                  "published link bandwidths; the other rows are predictions.")
    first = out[0][1]
    bare = estimate_memory(dataclasses.replace(LLAMA3_405B, seq=out[0][0]["seq"]),
                           dataclasses.replace(first["layout"], recompute="none"))["total"]
    held_out = [(row, best, err) for row, best, err in out[1:]]
    plain = [table4_row(row, LLAMA3_405B, hw, virtual_stages=(1,)) for row, _, _ in out if row["cp"] == 1]
    good = [x for x in held_out if abs(x[2]) <= 0.10]
    band = max((abs(e) for _, _, e in good), default=0.10)
    long_rows = [f"{row['seq'] // 1024}K" for row, _, _ in held_out if row["cp"] > 1]
    long_words = (f"The {' and '.join(long_rows)} row rests on attention's published rate and on an MFU count "
                  f"Meta does not define; the deep dive below puts both in numbers."
                  if long_rows else "")
    note(f"""
        {len(good)} of the {len(held_out)} predicted rows {with_spread(f"{'lands' if len(good) == 1 else 'land'} within ±10%", '; '.join(f"{row['gpus']:,} GPUs at {row['seq'] // 1024}K: {100 * err:+.1f}%" for row, _, err in held_out))}
        of what Meta measured (the table has each row's error), and every row fits. {long_words} Meta says it trained at 8K tokens without activation
        checkpointing; the estimator counts what eager PyTorch saves (every norm output, SwiGLU's
        four tensors), and with that count the first row's pick needs
        {bare / 2 ** 30:.0f} GiB per GPU without recomputation, so the search keeps only what no
        cheap kernel can rebuild (the course's own "selective" set, not Korthikanti et al.'s §5:
        norms and the MLP's activation re-run, no matrix product, charged as memory-bound work). Interleaving is what makes a 16-stage pipeline affordable:
        the search picks v = {first['layout'].virtual_stages}, a bubble of
        (p − 1)/(v·m) = {first['layout'].pp - 1}/({first['layout'].virtual_stages}·{first['layout'].micro_batches}) of the work.
        Without it (v = 1 and every other knob still open) the 8K rows are predicted at
        {' and '.join(f"{100 * b['mfu']:.0f}%" if b else "no fit" for b in plain)}.
    """)
    _RESULTS["table4"] = {"fraction": frac, "rows": out, "band": band}
    with deep_dive("How the Table 4 fit moves with the constants it does not fit",
                   "attention's rate, the link bandwidths and data-parallel overlap changed, the fit redone; "
                   "the 128K row's context-parallel account"):
        table4_sensitivity(frac, out)
    return hw, band


def nvidia_and_ties(searched, hw, band):
    """NVIDIA's published 70B recipe beside the model's picks, and the near-ties reported as a
    group: every layout within the model's own error of the fastest."""
    rows = []
    for world in (64, 512):
        found = searched.get((LLAMA3_70B.name, world))
        if not found:
            continue
        fitting = [r for r in found if r["fits"]]
        best = fitting[0]["time"]["total"]
        recipe = next(((i, r) for i, r in enumerate(fitting)
                       if (r["layout"].tp, r["layout"].pp, r["layout"].cp, r["layout"].virtual_stages) == (4, 4, 2, 5)), None)
        group, differ, shared = near_ties(found, band)
        rows.append([world, fitting[0]["layout"].label(), f"TP4 PP4 CP2 DP{world // 32} VP5",
                     f"#{recipe[0] + 1} of {len(fitting)}, {100 * (recipe[1]['time']['total'] / best - 1):+.1f}%" if recipe else "does not fit",
                     len(group), "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in differ.items())])
        _RESULTS.setdefault("nvidia", {})[world] = (recipe[0] + 1 if recipe else None, len(group))
    table(rows, header=["GPUs", "the model's fastest", "NVIDIA's recipe", "its rank in the model",
                        f"layouts within {100 * band:.0f}% of the fastest", "what varies among them"],
          caption="Llama 3 70B at 8K tokens, global batch 512 sequences: the search beside NVIDIA's published "
                  "BF16 H100 recipe (NeMo / DGX Cloud benchmarking).")
    ties = {w: t for w, (_, t) in _RESULTS.get("nvidia", {}).items()}
    inside = [w for w, (rank, n) in _RESULTS.get("nvidia", {}).items() if rank and rank <= n]
    outside = [w for w in ties if w not in inside]
    in_group = (" and ".join(f"is in that group at {w} GPUs" for w in inside) or "is in neither group")
    if inside and outside:
        in_group += f", not at {' or '.join(map(str, outside))}"
    note(f"""
        **Near-ties are ties.** The model's largest error on the published runs it predicts (Table 4, the A100 runs) is
        {100 * band:.0f}%, so every layout within {100 * band:.0f}% of the fastest is as good as
        the fastest as far as the model can tell: {', '.join(f"{n:,} at {w} GPUs" for w, n in ties.items())}.
        The search's first line is one member of that group, not a verdict. NVIDIA's recipe for the same model — tensor parallelism 4 within a
        node, a pipeline of 4 with 5 virtual stages, context parallelism 2 even at 8K tokens —
        {in_group}. Context parallelism at 8K is cheap with grouped-query
        attention: a ring step moves K and V, {2 * LLAMA3_70B.kv_dim / LLAMA3_70B.hidden:.2f}× the
        activation that each of tensor parallelism's four collectives per block moves.
    """)
    see("https://catalog.ngc.nvidia.com/orgs/nvidia/teams/dgxc-benchmarking/resources/nemo-llama31-dgxc-benchmarking-f",
        title="NVIDIA DGX Cloud benchmarking recipe for Llama 3.1 70B (BF16, H100: TP 4, PP 4, CP 2, VP 5)")


def mfu_section():
    run = small_run()
    shape = ModelShape.from_gpt(run.cfg)
    hw, timed = _RESULTS.get("hw"), _RESULTS.get("timed")
    here = None
    if hw is not None and timed:
        best = min(timed, key=lambda x: x[2].median)
        here = mfu(shape, run.global_batch * shape.seq / best[2].median, timing_ranks(4) * hw.peak)
    note("## Model FLOPs utilisation")
    mfu_picture(here, _RESULTS.get("table4"))
    note(f"""
        MFU (Chowdhery et al. 2022, PaLM) divides the FLOPs a step *must* do — about $6\\Psi$
        per token for forward and backward, plus $12 L h s$ for attention — by what the
        hardware could do in that time; recomputation is work the model did not need and does
        not count. The course counts $6\\Psi_\\text{{mat}}$: only the weights a token is
        multiplied by (the blocks' matrices and the LM head, not the embedding tables or the
        norms), {int(matmul_params(shape)[0]):,} of this model's Ψ = {param_count(run.cfg):,}.
    """)
    see(matmul_params)
    see(flops_per_token)
    if hw is not None and timed:
        ranks = timing_ranks(4)
        tokens = run.global_batch * shape.seq
        best = min(timed, key=lambda x: x[2].median)
        u = mfu(shape, tokens / best[2].median, ranks * hw.peak)
        parts = step_time(shape, best[0], hw)
        in_bubble = (f" (some of them inside its bubble, {100 * parts['bubble'] / parts['total']:.0f}% of the step)"
                     if parts["bubble"] > 0 else "")     # the bubble's slots hold fixed costs too
        note(f"""
            Here the fastest layout measured ({best[0].label()}) trains {tokens / best[2].median:,.0f}
            tokens/s on {machine(ranks)}: **MFU {100 * u:.2f}%**. A token costs
            {int(flops_per_token(shape)[0]):,} FLOPs, and the peak is {ranks} × {hw.peak / 1e9:.2f} GFLOP/s
            (the measured {cal_n()}² matmul). For a model this small the cost model puts
            {100 * fixed_share(shape, best[0], hw):.0f}% of this layout's predicted step in fixed costs{in_bubble}.
        """)
        _RESULTS["mfu_here"] = u
        cheat("MFU", "$\\text{MFU} = \\frac{(6\\Psi_\\text{mat} + 12Lhs)\\cdot\\text{tokens/s}}{\\text{ranks}\\cdot\\text{peak FLOP/s}}$",
              round(100 * u, 2), "%", what=f"fastest measured layout, {best[0].label()}, peak = the measured matmul rate")
    t4 = _RESULTS.get("table4")
    val = _RESULTS.get("validation")
    where = (f"""At published scale the model was fitted to Llama 3's measured 43% on one row
        and predicts the others to within {100 * t4['band']:.0f}% (the long-context row resting on
        attention's published rate and on Meta's MFU count). On A100s, fitted on one run, it
        predicts eleven others from 1.7B to 1T parameters within
        {100 * max(abs(e) for e in val.values()) if val else 10:.0f}%, with an error that drifts
        from too fast at 1.7B to too slow at 1T; on H100s it predicts an eager 8B's runs
        {h100_words(_RESULTS["h100_validation"])}. It knows nothing of stragglers or failures, so
        its MFU for the 8B and 70B picks is a prediction under stated assumptions, not a bound.""" if t4 else "")
    note(f"""
        {where}
        Published runs reach 38–56% MFU (the table). The Ultra-Scale Playbook swept more than
        4,000 configurations up to 512 GPUs to find the best layouts for its models.
    """)
    table([["PaLM 540B", "6144 TPU v4 chips", "46.2%", "Chowdhery et al. 2022"],
           ["GPT 1T, selective recomputation and sequence parallelism", "A100s", "56.3%", "Korthikanti et al. 2022"],
           ["GPT 1T (52% of peak, counting the recomputed FLOPs)", "A100s", "about 39%", "Narayanan et al. 2021"],
           ["Llama 3 405B, BF16", "8K–16K H100s", "38–43%", "Llama 3 report, Table 4"],
           ["picotron (a small open 4D framework), 1–7B", "8–64 H100s", "38–50%", "its README"]],
          header=["run", "hardware", "MFU", "source"], caption="public reference points, as published")
    for url, title in [
        ("https://arxiv.org/abs/2204.02311", "Chowdhery et al. 2022, PaLM: Scaling Language Modeling with Pathways (MFU)"),
        ("https://arxiv.org/abs/2104.04473", "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"),
        ("https://arxiv.org/abs/2407.21783", "Llama Team 2024, The Llama 3 Herd of Models"),
        ("https://huggingface.co/spaces/nanotron/ultrascale-playbook", "Tazi et al. 2025, The Ultra-Scale Playbook: Training LLMs on GPU Clusters"),
        ("https://arxiv.org/abs/2205.05198", "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models"),
        ("https://arxiv.org/abs/2307.08691", "Dao 2023, FlashAttention-2 (§4.1, Fig. 7: up to 335 TFLOP/s forward and backward on an H100)"),
        ("https://github.com/huggingface/picotron", "picotron: a minimalist 4D-parallelism framework (README: MFU on H100s)"),
        ("https://www.nvidia.com/en-us/data-center/h100/", "NVIDIA H100 Tensor Core GPU (datasheet: 989 TFLOP/s dense BF16, 80 GB, NVLink 900 GB/s)"),
        ("https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html", "NVIDIA DGX H100 User Guide (8 GPUs, ConnectX-7 400 Gb/s InfiniBand)"),
    ]:
        see(url, title=title)


def h100_words(rows):
    """'1.69–1.75× too fast' (or too slow, or from one to the other): the H100 validation's
    published steps against the predicted ones."""
    ratios = sorted(1 + r["error"] for r in rows)
    if ratios[0] >= 1:
        return value_range(ratios[0], ratios[-1], decimals=2) + "× too fast"
    if ratios[-1] <= 1:
        return value_range(1 / ratios[-1], 1 / ratios[0], decimals=2) + "× too slow"
    return f"from {1 / ratios[0]:.2f}× too slow to {ratios[-1]:.2f}× too fast"


def cal_n():
    cal = _RESULTS.get("cal")
    return cal["matmul"]["n"] if cal else 0


def remember():
    note("""
        ## What to remember
        * A mesh puts each rank at (dp, pp, cp, tp) coordinates; each axis' groups are the
          ranks that differ in that coordinate only. Put the chattiest axis (tp) innermost.
        * Any combination of the four axes trains exactly like one process — checked here,
          parameter by parameter.
        * Gradients are averaged, and ZeRO shards, over the *replicas*: dp × cp ranks — and a
          routed expert's over dp × cp / ep ranks: expert parallelism lives inside dp.
        * Memory per rank is a sum of counts you can write down: weights, gradients (fp32 when
          accumulated), optimizer state, ZeRO-3's gathered blocks, activations.
        * A cost model must charge what the code does: per step or per micro-batch, what can
          hide under what. Check it with absolute errors, not only a rank correlation.
        * Trust a cost model at scale only as far as published runs confirm it: fit what is
          unknown on one run, predict the others, and say where it fails. Layouts within its
          error of each other are ties, not a ranking.
        * Pick a layout by rule of thumb (DP alone; if it does not fit, CP = 2 for sequences of
          32K tokens or more, then ZeRO-3 → TP in a node → PP across nodes, then the same chain
          with full recomputation), then let measurements decide.

        The notebook `lectures/notebooks/lecture_07_putting_it_together.ipynb` runs every
        section above and lets you train your own layout against one process.
    """)


def main():
    try_it_yourself(notebook_exercises("lecture_07_putting_it_together"))   # its notebook's exercises, for the page
    intro()
    the_mesh()              # where each rank sits, and its group on each axis
    many_layouts()          # the same training under every combination, against one process
    memory_estimator()      # bytes per rank predicted, checked on every run above
    search_here()           # the space of valid configurations
    step_time_model()       # time per step predicted from measured constants, checked on ≥ 6 layouts
    with deep_dive("The step time's error axis by axis, and ZeRO on gloo",
                   "measured / predicted for each axis a layout splits, and what the model leaves out of ZeRO"):
        error_by_axis()     # where the absolute error sits
    with deep_dive("The communication model, checked exactly on the wire",
                   "every layout's bytes per rank and step from /proc/self/io, against step_bytes"):
        wire_bytes()        # the communication model checked exactly: bytes per rank and step
    published_scale()       # the same search for an 8B and a 70B model on H100s
    mfu_section()           # how much of the hardware a step uses
    with deep_dive("The same layouts from PyTorch's own pieces",
                   "init_device_mesh, parallelize_module, fully_shard and PipelineStage train the same model"):
        pytorch_pieces()
    with deep_dive("Launching across nodes, NCCL, and what to check first",
                   "torchrun and Slurm, NCCL's environment variables, and a checklist for a slow run"):
        notes()
    remember()              # what to remember


def bench():
    """Predicted vs measured step time (rank correlation) and ours vs PyTorch's pieces."""
    rho = step_time_model()
    pytorch_pieces()
    lines = [f"lecture_07: step-time model vs measured over {len(_RESULTS['timed'])} layouts: "
             f"rank correlation {rho:.2f} (target >= 0.8)"]
    for name, ratio in _RESULTS["vs_pytorch"]:
        lines.append(f"lecture_07: {name} step, ours / PyTorch's pieces: ratio {ratio:.2f} (target <= 1.2)")
    return lines
