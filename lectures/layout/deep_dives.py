"""The appendix page of lecture 07: its deep dives, each a section function that main() (or the
main-path section it belongs to) calls inside `with deep_dive(...)`, in the order they run —
sequence parallelism and full recomputation in the estimator (Korthikanti's selective set beside
it), the step time's error axis by axis and ZeRO on gloo, the communication model checked on the
wire, how the Table 4 fit moves with the constants it does not fit, the search's space
and the decision procedure, the same layouts from PyTorch's own pieces, and launching across
nodes."""
import dataclasses
import statistics

from util import cheat, figure, note, see, settings, spawn, table
from util.measure import machine, usable_cores, value_range

from lectures.layout.demos import _RESULTS, axes_of, long_context_words, small_run, time_ours_vs_pytorch, train_pytorch_layout
from lectures.layout.estimator import Layout, ModelShape, estimate_memory
from lectures.layout.figures import draw_decision_flow, draw_wire_ratios
from lectures.layout.published import KORTHIKANTI_175B, KORTHIKANTI_TP, selective_per_token_bytes, table4_with_hidden_tp
from lectures.layout.pytorch import pytorch_layout
from lectures.layout.search import GEMM, decision_procedure, reproduce_table4
from lectures.layout.step_time import (ATTENTION, FA2_H100, IB, IB_ACHIEVED, IB_BW, LLAMA3_405B, NVLINK,
                                       NVLINK_ACHIEVED, NVLINK_BW, h100_cluster, step_bytes)
from lectures.layout.trainer import Run, max_param_diff, reference_run
from lectures.model.activations import with_recomputation
from lectures.model.gpt import batch, loss_fn
from lectures.model.memory import SavedBytes


def memory_with_recomputation(cfg, shape, sp_shown):
    """What the layouts leave out: sequence parallelism's gap, and full recomputation checked
    in one process."""
    note(f"""
        ## Deep dive: sequence parallelism and full recomputation in the estimator
        **Sequence parallelism**: the estimator follows Megatron-LM, which splits every
        residual-stream tensor over tp and re-gathers the norm outputs in backward; lecture
        04's version keeps an all-gathered input for backward
        ({"the dp×tp + SP row's error in the memory table of the main page" if sp_shown else "the full build's dp×tp + SP run shows the gap; the tests bound it"}).
        **Full recomputation** is not among the layouts, so it is checked here in one process
        with lecture 01's `Recomputed` blocks: only each block's input stays saved between
        forward and backward.
    """)
    rows = []
    for mode in ("none", "full"):
        model = with_recomputation(cfg, mode)
        meter = SavedBytes(exclude=model.parameters())
        tokens, targets = batch(cfg, 4, 0)
        with meter:
            loss = loss_fn(model(tokens), targets)
        loss.backward()
        est = estimate_memory(shape, Layout(micro_batch=4, recompute=mode))
        rows.append([mode, meter.peak, est["stored activations"], est["activations"] - est["stored activations"],
                     f"{100 * (meter.peak - est['stored activations']) / est['stored activations']:+.1f}%"])
    table(rows, header=["recomputation", "saved (measured)", "saved (predicted)",
                        "transient: recomputed block or loss backward (predicted)", "error"],
          caption="One process, micro-batch of 4 sequences, float32.")
    korthikanti_beside_flash_attention()


def korthikanti_beside_flash_attention():
    """Korthikanti et al.'s selective set (§5) against the estimator's "none": flash attention
    already leaves out what their set recomputes."""
    m, t = KORTHIKANTI_175B, KORTHIKANTI_TP
    ours = 2 * m.act_elements_per_token(t, sp=True)            # bytes per token and block at 16 bits
    paper, masks = selective_per_token_bytes(t, m.hidden)
    note(f"""
        **Korthikanti et al.'s selective recomputation** (2022, §5) is not the course's. It
        re-runs the attention core (QKᵀ, softmax, its dropout, the product with V) so as not to
        keep 5·a·s/t bytes per token and block on each of t tensor-parallel ranks. A FlashAttention kernel never keeps that core and
        rebuilds it in its own backward. So beside flash attention their set costs what the
        estimator's "none" costs. For their GPT-3 175B at tp = {t} with sequence parallelism, "none" keeps
        {ours:,.0f} bytes per token and block at 16 bits. Their Table 2 gives 34·h/t = {paper:,.0f}, less
        {masks:,.0f} for two dropout masks (the course's models have no dropout): {paper - masks:,.0f}. The
        difference is the log-sum-exp and the norm statistics, which the paper leaves out (kernels
        keep them in fp32, twice what the estimator counts at the activations' width). The course's "selective" goes further: it also
        re-runs the norms and the MLP's activation.
    """)


def ratios_by_axis(layouts, pred, meas):
    """{what a layout splits: [measured / predicted of each such layout]}."""
    by_axis = {}
    for l, p, t in zip(layouts, pred, meas):
        by_axis.setdefault(axes_of(l), []).append(t / p)
    return by_axis


def error_by_axis():
    """The step-time model's absolute error, axis by axis, and ZeRO's layouts on gloo."""
    timed = _RESULTS.get("timed")
    if not timed:
        return
    layouts, pred, times = zip(*timed)
    meas = [t.median for t in times]
    note("## Deep dive: the step time's error axis by axis, and ZeRO on gloo")
    table([[k, len(v), statistics.median(v), min(v), max(v)]
           for k, v in sorted(ratios_by_axis(layouts, pred, meas).items())],
          header=["what the layout splits", "layouts", "median measured / predicted", "lowest", "highest"],
          caption=f"The absolute error, axis by axis: each of the {len(layouts)} layouts timed on this machine "
                  "in \"Predicting the step time\" (gloo), its measured step (median of its repeats) over the model's prediction, grouped "
                  "by what it splits. A ratio of 1 is exact; a ratio above 1 means the model under-predicts, "
                  "and so favours, that axis.")
    zero_note(layouts, pred, times)


def zero_note(layouts, pred, times):
    """ZeRO's layouts against plain data parallelism's, measured / predicted: what the model
    charges ZeRO on gloo, and what it leaves out. Each ZeRO layout is also set beside its twin
    (the same layout without ZeRO), so a cost the model misses is not confused with the axes;
    a pair counts as above or below only where the two interquartile ranges, each over its
    prediction, do not overlap."""
    by, timing = {}, {}
    for l, p, t in zip(layouts, pred, times):
        timing[l] = (t, p)
        if l.dp * l.cp > 1:
            by.setdefault("ZeRO" if l.zero else "plain", []).append(t.median / p)
    if len(by) < 2:
        return
    pairs, above, below = [], 0, 0
    for l, (t, p) in timing.items():
        twin = dataclasses.replace(l, zero=0)
        if l.zero and l.dp * l.cp > 1 and twin in timing:
            u, q = timing[twin]
            pairs.append((t.median / p) / (u.median / q))
            above += t.q1 / p > u.q3 / q
            below += t.q3 / p < u.q1 / q
    rng = lambda v: value_range(min(v), max(v), decimals=2) + "×"
    copies = """the copies ZeRO adds (gloo's reduce-scatter clones the buffer; each tensor is padded
        and copied into and out of its shard) are memory copies of a model this small, and the
        extra collective calls per tensor wait on each other; which of them costs what, the build
        does not time."""
    if pairs and above == len(pairs):
        verdict = "So ZeRO costs more than the model charges, and this build does not measure why: "
    elif pairs and below == len(pairs):
        verdict, copies = "So the model charges ZeRO more than it costs here.", ""
    elif above and not below:
        verdict = (f"So in {above} of {len(pairs)} pairs ZeRO costs more than the model charges, clear of the "
                   "noise, and this build does not measure why: ")
    elif pairs and not above and not below:
        verdict = "So this build shows no cost of ZeRO's clear of the noise; what would have to be timed to find one: "
    elif pairs:
        verdict = ("The pairs disagree (ZeRO above its twin in some, below in others), so this build names no "
                   "cost of ZeRO's; what would have to be timed to find one: ")
    elif min(by["ZeRO"]) > max(by["plain"]):
        verdict = "ZeRO still costs more than the model charges, and this build does not measure why: "
    else:
        verdict = ("The two ranges overlap, so this build shows no cost of ZeRO's beyond what the model "
                   "charges; what would have to be timed to find one: ")
    twins = (f"""Set beside its twin (the same layout without ZeRO), a ZeRO layout's measured /
        predicted is {rng(pairs)} the twin's. Counting only pairs whose interquartile ranges do
        not overlap, it is above the twin's in {above} of {len(pairs)} and below in {below}.""" if pairs else "")
    note(f"""
        **ZeRO on gloo.** The model charges ZeRO's reduce-scatter as the full all-reduce gloo
        runs (`Hardware.backend = "gloo"`), plus the all-gather of the updated weights, so a
        ZeRO-1 layout is predicted slower than the same layout without ZeRO. Measured /
        predicted: ZeRO layouts {rng(by["ZeRO"])}, the layouts with dp·cp > 1 and no ZeRO
        {rng(by["plain"])}. {twins}
        {verdict}{copies}
    """)


def wire_bytes():
    """Every layout many_layouts trained: each rank's bytes on the wire in a step, predicted by
    `step_bytes` (gloo as it is, and what NCCL would send) against /proc/self/io."""
    runs = _RESULTS.get("layouts")
    if runs is None:      # the lecture's many_layouts() trains them, earlier on the page
        raise RuntimeError("wire_bytes() checks the runs that many_layouts() trained: run many_layouts() (lec.many_layouts() in the notebook) first")
    shape = ModelShape.from_gpt(small_run().cfg)
    note(f"""
        ## Checking the communication model exactly: bytes on the wire
        Timings on {usable_cores()} cores cannot check the communication model at 4 or 8 ranks, but bytes
        can be checked exactly at any rank count. `step_bytes` predicts what each rank sends in
        one step, axis by axis, from the same counts the step-time model charges — per block
        and micro-batch for tp and cp, per micro-batch for pp, per step or per micro-batch for
        dp according to the ZeRO stage — and every rank of every layout above counted the
        bytes it wrote to its sockets during its last step (Linux's `/proc/self/io`). gloo is
        modelled as it is: its reduce-scatter is a full all-reduce and a copy, so ZeRO's
        reduce-scatters send an all-reduce's bytes here; the last column says what NCCL's
        ring would send instead.
    """)
    see(step_bytes)
    rows, ratios = [], []
    for name, lay, got in runs:
        seen = {}
        for r in got:
            if r.get("bytes_sent") is None:
                continue
            pred = step_bytes(shape, lay, r["coords"]["pp"], tensor_sizes=r["tensor_sizes"])
            nccl = step_bytes(shape, lay, r["coords"]["pp"], backend="nccl", tensor_sizes=r["tensor_sizes"])
            key = (r["coords"]["pp"], r["bytes_sent"])
            if key in seen:
                continue                           # replicas and tp peers send the same
            seen[key] = True
            ratio = r["bytes_sent"] / pred["total"] if pred["total"] else float("nan")
            ratios.append((name + (f", stage {r['coords']['pp']}" if lay.pp > 1 else ""), lay, ratio))
            rows.append([name, f"stage {r['coords']['pp']}" if lay.pp > 1 else "every rank",
                         r["bytes_sent"], pred["total"], ratio,
                         ", ".join(f"{k} {pred[k]:,.0f}" for k in ("tp", "cp", "pp", "dp") if pred[k]),
                         nccl["total"]])
    if not rows:
        note("This machine does not count the bytes a process writes (not Linux): nothing to check.")
        return
    figure(draw_wire_ratios(ratios), caption="Measured over predicted bytes per rank and step, every layout and stage.")
    table(rows, header=["layout", "rank", "measured bytes", "predicted (gloo)", "measured / predicted",
                        "predicted by axis", "NCCL would send"],
          caption="One training step, each rank's bytes on the wire, measured and predicted. Ranks "
                  "that sent the same bytes are shown once.")
    low, high = min(r for _, _, r in ratios), max(r for _, _, r in ratios)
    pp_only = [r for n, l, r in ratios if l.pp > 1 and l.dp == l.tp == l.cp == 1]
    note(f"""
        Every rank sent between {low:.2f} and {high:.2f} times the predicted payload. The
        prediction counts tensors only; the transport adds its own framing to every message
        {f"(in the pipeline-only layouts, which send only point-to-point messages, {100 * (statistics.median(pp_only) - 1):.0f}% on top)" if pp_only else ""},
        and a collective sends several messages per call, so layouts with many small
        collectives carry the most. A model that charged ZeRO-2 once per step, or a
        reduce-scatter at NCCL's (n−1)/n on gloo, would predict too few bytes: its ratios
        would reach about 2 for the ZeRO layouts. The tests require every ratio between 1 and
        1.4.
    """)
    _RESULTS["wire_ratios"] = ratios
    cheat("collective bytes", "per rank: ring all-reduce $2\\frac{n-1}{n}$ of the tensor, all-gather and reduce-scatter "
          "$\\frac{n-1}{n}$ each (gloo's reduce-scatter: an all-reduce), summed by `step_bytes` over a step",
          round(statistics.median(r for _, _, r in ratios), 3), "× predicted",
          what=f"median measured / predicted bytes over {len(ratios)} ranks and layouts (/proc/self/io)")


def table4_sensitivity(frac, out):
    """The fit and the predictions redone with each assumed constant changed: what the split
    of Table 4 depends on besides the fitted GEMM fraction."""
    note("""
        ## Deep dive: how the Table 4 fit moves with the constants it does not fit
        Attention's rate and the link bandwidths are published figures, and the overlap of
        data-parallel traffic and the exposure of tensor-parallel collectives are assumed; none
        is fitted. Changing them and fitting the GEMM
        fraction again on the first row shows how much the predictions of the other rows rest
        on each.
    """)
    rows = [["as stated", f"{100 * frac:.1f}%"] + [f"{100 * err:+.1f}%" for _, _, err in out[1:]]]
    fits = [(frac, [err for _, _, err in out[1:]])]
    overlap = "fraction of that compute hiding data-parallel traffic"
    changes = [("attention at 80% of FlashAttention-2's figure", {ATTENTION: 0.8 * FA2_H100}),
               ("attention at 120% of FlashAttention-2's figure", {ATTENTION: 1.2 * FA2_H100}),
               ("both links at 75% of NCCL's bandwidth", {NVLINK: 0.75 * NVLINK_ACHIEVED, IB: 0.75 * IB_ACHIEVED}),
               ("both links at their line rate", {NVLINK: NVLINK_BW, IB: IB_BW}),
               (f"{overlap} 0.5", {overlap: 0.5}), (f"{overlap} 0", {overlap: 0.0})]
    fitted = [reproduce_table4(LLAMA3_405B, lambda **kw: h100_cluster(**{**change, **kw})) for _, change in changes]
    changes.append(("every tensor-parallel collective hidden under compute (the most any overlap could hide)", None))
    fitted.append(table4_with_hidden_tp())
    for (words, _), (f, got) in zip(changes, fitted):
        fits.append((f, [err for _, _, err in got[1:]]))
        rows.append([words, f"{100 * f:.1f}%"]
                    + [f"{100 * err:+.1f}%" if err is not None else "no fit" for _, _, err in got[1:]])
    table(rows, header=["changed", "fitted GEMM fraction"]
          + [f"error, {r['gpus']:,} GPUs at {r['seq'] // 1024}K" for r, _, _ in out[1:]],
          caption="Each line fits the GEMM fraction on the 8,192-GPU row again with the constants it names "
                  "changed, and predicts the other rows with it.")
    errs = list(zip(*[e for _, e in fits]))
    labels = ["as stated"] + [words for words, _ in changes]
    ranges = []
    for (row, _, _), e in zip(out[1:], errs):
        if None in e:
            continue
        inside = all(abs(x) <= 0.10 for x in e)
        mover = labels[max(range(len(e)), key=lambda i: abs(e[i] - e[0]))]
        ranges.append(f"{row['seq'] // 1024}K on {row['gpus']:,} GPUs from {100 * min(e):+.0f}% to "
                      f"{100 * max(e):+.0f}% ({'inside ±10% on every line' if inside else 'leaving ±10% on some'}; "
                      f"moved most by {mover})")
    note(f"""
        Across these lines the fitted GEMM fraction runs from {100 * min(f for f, _ in fits):.0f}% to
        {100 * max(f for f, _ in fits):.0f}% of peak — whatever is made slower must be paid for
        with faster GEMMs to reach the measured 43%, and whatever is made faster leaves them
        slower — and the errors of the predicted rows run:
        {'; '.join(ranges)}.
    """)
    hw = h100_cluster(**{GEMM: frac})
    long_words = " ".join(long_context_words(row, best, err, hw) for row, best, err in out[1:] if row["cp"] > 1)
    if long_words:
        note(long_words)


def decision_flow(outcomes, space):
    note("## Deep dive: the search's space and the decision procedure, step by step")
    figure(space, caption="Every configuration of the search at 512 GPUs: grey ones exceed the memory "
                          "limit (dashed line).")
    see(decision_procedure)
    figure(draw_decision_flow(outcomes),
           caption="The decision procedure as a flowchart, with where it stopped for each model and "
                   "GPU count on the main page (from the calls that filled its table).")


PYTORCH_LAYOUTS = [("dp×pp", Layout(dp=2, pp=2, micro_batch=2, micro_batches=2)),
                   ("tp×pp", Layout(pp=2, tp=2, micro_batch=2, micro_batches=4)),
                   ("dp×tp", Layout(dp=2, tp=2, micro_batch=2, micro_batches=2))]
PYTORCH_3D = ("dp×tp×pp", Layout(dp=2, pp=2, tp=2, micro_batch=2, micro_batches=2))  # 8 ranks: full build


def pytorch_pieces():
    run = Run(steps=3)     # enough steps for AdamW's state to matter; PyTorch's pieces start slowly
    note("""
        ## Deep dive: the same layouts from PyTorch's own pieces
        This rebuilds what the lecture built with PyTorch's own building blocks, to show they
        agree. PyTorch ships every piece: `init_device_mesh` for the mesh, `parallelize_module`
        with `ColwiseParallel` / `RowwiseParallel` for tensor parallelism (DTensor
        parameters; `loss_parallel()` computes the loss on vocabulary-sharded logits),
        `fully_shard` (FSDP2) on the dp dimension, and `PipelineStage` with `Schedule1F1B`
        on the pp dimension's group. Built on the same lecture-01 GPT (lecture 05's
        `GPTStage` cuts the stages), with one adapter: the attention module reads its head
        count from its projections' `out_features`, which a column-sharded `nn.Linear`
        keeps at the global width. On top of tensor parallelism, FSDP2 shards parameters that
        are already DTensors over the tp dimension, so they become 2D DTensors (sharded on
        both mesh dimensions). The full build also runs all three together on 8 ranks.
    """)
    see(pytorch_layout)
    ref = reference_run(run)
    rows = []
    every = PYTORCH_LAYOUTS + [PYTORCH_3D]
    cases = every[:2] if settings.quick else every   # the tests check all three 4-rank layouts
    for name, lay in cases:
        demo = spawn(train_pytorch_layout, lay.world, run=run, layout=lay,
                     name=f"PyTorch pieces: {name}, {lay.label()}")
        if demo.skipped:     # torchrun started fewer ranks: the demo's line on the page says so
            rows.append([name, lay.label(), lay.world, "skipped: too few ranks", ""])
            continue
        got = demo.returns
        diff = max_param_diff(got, ref["params"])
        rows.append([name, lay.label(), lay.world, got[0]["losses"][-1], diff])
        assert diff < 1e-4, (name, diff)
    for name, lay in every[len(cases):]:
        rows.append([name, lay.label(), lay.world, "full build only", ""])
    table(rows, header=["layout", "mesh", "ranks", "last loss", "max |Δ parameter| vs one process"],
          caption=f"PyTorch's pieces train the same model to the same parameters (one process: "
                  f"last loss {ref['losses'][-1]:.6f}).")
    ranks = 4
    timed = PYTORCH_LAYOUTS[:1] if settings.quick else PYTORCH_LAYOUTS[:2]   # dp×pp, tp×pp
    demo = spawn(time_ours_vs_pytorch, ranks, run=run, layouts=[l for _, l in timed],
                 repeats=3 if settings.quick else 5, name="step time: ours vs PyTorch's pieces")
    _RESULTS["vs_pytorch"] = []
    if demo.skipped:
        return
    times = demo.returns[0]
    table([[name, lay.label(), a.ms(), b.ms(), a.median / b.median]
           for (name, lay), (a, b) in zip(timed, times)],
          header=["layout", "mesh", "ours", "PyTorch's pieces", "ours / PyTorch"],
          caption=f"Time per step, median and IQR, ours and PyTorch's alternating step by step, {machine(ranks)}.")
    _RESULTS["vs_pytorch"] = [(name, a.median / b.median) for (name, _), (a, b) in zip(timed, times)]


def notes():
    note("""
        ## Deep dive: launching across nodes, NCCL, and what to check first
        Practice for running on a real cluster, beyond the lecture's argument.

        **Launch.** Every rank runs the same program; `torchrun` starts one process per GPU on
        each node and they meet at a rendezvous endpoint:
        `torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER:29500
        --rdzv-id $JOB -m util.run lecture_07_putting_it_together --world-size 16`. Under Slurm,
        one `srun` task per node runs that command with `$MASTER` taken from
        `scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1` (the course README has the
        script). The mesh's order matters then: with 8 GPUs per node, tp = 8 keeps every
        tensor-parallel group inside a node.

        **NCCL's environment.** `NCCL_DEBUG=INFO` prints the transports and rings it picked
        (check that InfiniBand, not TCP sockets, carries inter-node traffic);
        `NCCL_SOCKET_IFNAME` / `NCCL_IB_HCA` choose the interfaces; `NCCL_ALGO` and
        `NCCL_PROTO` force ring/tree and LL/LL128/Simple for experiments;
        `TORCH_NCCL_ASYNC_ERROR_HANDLING=1` and a process-group timeout turn a hang into an
        error.

        **A big run is slow: check, in order,** (1) the MFU against the 38–56% that published
        runs reach; (2) one node alone at the same per-GPU batch — if it is fast, the network
        or the layout across nodes is the problem (run nccl-tests across nodes and compare
        bus bandwidth with the link's); (3) the profile of one step: exposed communication
        (tensor parallelism crossing nodes, data-parallel traffic not overlapped), the pipeline
        bubble ((pp − 1)/m), recomputation you do not need; (4) stragglers: one slow GPU or
        link sets everyone's pace, so compare per-rank step times; (5) the data loader and
        host-side stalls.
    """)
