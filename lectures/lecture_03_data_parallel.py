"""Data parallelism and ZeRO: replicate the model, split the data

Every rank holds the model (or, with ZeRO, a slice of it), reads its own slice of every batch,
and the ranks agree on the update through collectives. Each implementation below is written out
in a few lines, run on real ranks, and checked against single-process training.
"""
from util import cheat, deep_dive, figure, note, plural, see, settings, spawn, table, timeline
from util import try_it_yourself
from util.measure import compare, spreads_overlap, machine, timing_ranks

from exercises import listing as notebook_exercises
from lectures.data_parallel.ddp import (AllReduceAfterBackward, BucketedAllReduce, Collectives, OverlappedAllReduce,
                                        broadcast_parameters)
from lectures.data_parallel.zero import Zero1, Zero2, Zero3Layer, Zero3LinearFunction, adamw_update
from lectures.data_parallel.demos import (Task, make_model, make_batches, shard_rows, param_count,
                                          reference_train, data_parallel_step, train_data_parallel,
                                          sampler_epochs, strided_batches, uneven_with_join, train_zero,
                                          wrap_pytorch, train_pytorch, time_variants, traced_steps,
                                          budget_probe, train_at_batch, lr_scaling, memory_task,
                                          fsdp2_variant, timing_world, formula_bytes, max_diff,
                                          merge_in_flight, published_scale_numbers, published_scale,
                                          best_rules, zero2_words, released_buckets,
                                          released_prefetch)
from lectures.data_parallel.overlap import gain_words, real_compute_words
from lectures.model.figures import published_figure
from lectures.model.gpu_evidence import TORCHTITAN_FSDP_SCALING
from lectures.data_parallel.deep_dives import (bucket_sweep, bytes_on_the_wire, further_reading, local_sgd_section,
                                              powersgd_section, stage_measurements)
from lectures.data_parallel.figures import (overlap_bars, ddp_figure, sampler_figure, draw_holdings, hidden_all_reduce_figure,
                                            accumulation_traffic_figure, pytorch_versions_figure,
                                            fsdp2_knobs_figure, batch_scaling_figure, memory_per_rank_figure)

# --world-size values its demos accept: the tasks' batch of 16 rows splits evenly, and data
# parallelism needs a second rank (util.run refuses others)
WORLD_SIZES = (2, 4, 8)

# =========================================================================================
# The lecture
# =========================================================================================

def small_task():
    return Task(steps=4 if settings.quick else 6)


def timing_task():
    if settings.quick:
        return Task(sizes=(32, 256, 256, 256, 10), batch=64)
    return Task(sizes=(64, 1024, 1024, 1024, 1024, 10), batch=128)


def intro():
    note("""
        # Data parallelism and ZeRO
        Data parallelism is the first thing to reach for when one device is too slow: every
        rank keeps the whole model, reads a different slice of each batch, and the ranks average
        their gradients so that every replica takes exactly the step that one process would
        have taken on the whole batch. ZeRO (Rajbhandari et al. 2020) then removes the
        redundancy: why should N ranks each hold the same optimizer state, the same gradients,
        the same parameters?

        Everything here runs on this machine's ranks (gloo on CPU, NCCL on GPUs), and every
        version is compared with one process training on the whole batch.

        **What you will learn.** DDP from scratch (broadcast, split, average), overlapping its
        all-reduce with backward and bucketing it; data sharding and gradient accumulation;
        batch size and learning rate; ZeRO-1/2/3, with the bytes each rank holds and sends,
        measured; PyTorch's DDP and FSDP2 beside ours. The deep dives at the end (local SGD,
        DiLoCo, PowerSGD) can wait for a second read.

        **What you need.** Lecture 01 (what a training step holds: parameters, gradients, AdamW's
        two moments) and lecture 02 (all-reduce = reduce-scatter + all-gather, the ring's
        bytes, `async_op=True`); PyTorch's `nn.Module`, autograd hooks and `torch.optim.AdamW`.
    """)


def the_task():
    task = small_task()
    note(f"""
        **The model, the data, the reference.** A stack of `Linear` layers with tanh between them,
        widths {task.sizes}: Ψ = {param_count(task):,} parameters, a number divisible by neither 2
        nor 4, so every shard boundary below is awkward on purpose. The data are Gaussian inputs
        labelled by a fixed random "teacher" network, generated from a seed identically on every
        rank; the loss is the mean squared error, the optimizer AdamW. The reference is one process
        that sees the whole global batch of {task.batch} rows, and every parallel version below must
        equal it.
    """)
    see(make_model)
    see(make_batches)
    see(reference_train)


def ddp_from_scratch():
    task = small_task()
    note("## DDP from scratch")
    ref = reference_train(task)
    runs = {n: spawn(train_data_parallel, n, task=task, name=f"DDP from scratch, {n} ranks") for n in (1, 2, 4)}
    runs = {n: run.returns for n, run in runs.items() if not run.skipped}
    a, b = spawn(train_data_parallel, 2, task=task, broadcast=False, name="DDP without the broadcast").returns
    figure(ddp_figure(ref, runs, {0: a, 1: b}),
           caption=f"left: the loss of {task.steps} AdamW steps on {', '.join(map(str, runs))} ranks lies on "
                   "the one-process curve; right: two ranks that skip the broadcast apply the same averaged "
                   "gradients to different weights")
    note("""
        Three ingredients. (1) Start equal: every rank initialises its own random weights (seeded
        by rank to make the point), then takes rank 0's with a broadcast. (2) Split the data: rank
        r reads rows [r·B/N, (r+1)·B/N) of every global batch. (3) Average the gradients: each
        rank's gradient is the mean over its B/N rows; the all-reduce sums the N of them and we
        divide by N, which is exactly the mean over all B rows, so every rank takes the
        single-process step.
    """)
    rows = []
    for world_size, r in runs.items():
        diff = max_diff(r[0]["params"], ref["params"])
        spread = max(max_diff(x["params"], r[0]["params"]) for x in r)
        same = all(x["checksums"] == r[0]["checksums"] for x in r)
        assert spread == 0 and diff < 1e-4, (spread, diff)
        rows.append([world_size, r[0]["losses"][-1], "yes" if same else "no", spread, diff])
    table(rows, header=["ranks", "last loss (mean over ranks)", "checksums equal on every rank, every step",
                        "max |Δ| between replicas", "max |Δ| vs one process"],
          caption=f"after {task.steps} steps; one process ends at loss {ref['losses'][-1]:.6f}. The "
                  "differences from one process are float32 rounding: the same sums, added in another order")
    note(f"""
        Without the broadcast, the last checksums are {a['checksums'][-1]:.6f} on rank 0 and
        {b['checksums'][-1]:.6f} on rank 1.
    """)
    see(broadcast_parameters)
    see(shard_rows)
    see(AllReduceAfterBackward)
    see(data_parallel_step)


def data_sharding():
    n = settings.world_size
    rows = 4 * n + 1 if n > 1 else 7            # never a multiple of the ranks
    note("## Data sharding: every rank its own samples")
    result = {}
    for drop_last in (False, True):
        run = spawn(sampler_epochs, n, n_rows=rows, epochs=2, drop_last=drop_last,
                    name=f"DistributedSampler, {rows} rows on {n} ranks, drop_last={drop_last}")
        result[drop_last] = run.returns
    forgot = spawn(sampler_epochs, n, n_rows=rows, epochs=2, drop_last=True, set_epoch=False,
                   name=f"DistributedSampler without set_epoch, {rows} rows on {n} ranks").returns
    figure(sampler_figure(result, rows),
           caption=f"the indices DistributedSampler handed each of {n} ranks, {rows} rows, two epochs; "
                   "red: a sample read twice in the epoch (the padding)")
    table_rows = []
    for drop_last, per_rank in result.items():
        for epoch in range(2):
            seen = [i for r in per_rank for i in r[epoch]]
            table_rows.append([f"drop_last={drop_last}", epoch, len(seen), len(set(seen)),
                               rows - len(set(seen)), len(seen) - len(set(seen))])
    same = all(r[0] == r[1] for r in forgot)
    note(f"""
        Real data come from a dataset, and the usual tool is a sampler per rank:
        `DistributedSampler` shuffles the indices with a seed all ranks share, then rank r takes
        every N-th index starting at r. `set_epoch(e)` must be called every epoch, or every epoch
        repeats the same order (here, without it, both epochs came out in
        {'the same order on every rank' if same else 'different orders (unexpected)'}). When N does
        not divide the dataset the sampler *pads* (the default: it repeats the first indices, so
        {plural(table_rows[0][5], 'sample')} per epoch count twice here) or *drops* the tail
        (`drop_last=True`: the ranks' indices are disjoint, and a different few are skipped each
        epoch).
    """)
    table(table_rows, header=["sampler", "epoch", "samples drawn", "distinct", "never drawn", "drawn twice"],
          caption=f"{rows} rows on {n} ranks, counted from the indices above")
    batch = 2
    counts = [len(strided_batches(r, n, rows, batch)) for r in range(n)]
    run = spawn(uneven_with_join, n, n_rows=rows, batch=batch,
                name=f"PyTorch DDP inside Join, uneven batch counts {counts}, {n} ranks")
    sums = {x["checksum"] for x in run.returns}
    note(f"""
        **The uneven last batch.** A hand-made partition without padding (rank r takes rows r,
        r+N, …) gives ranks different numbers of batches: the ranks with one batch more call one
        all-reduce more, and wait for partners that never come (lecture 02's hang, hidden in a data
        loader). Pad, drop the tail, or wrap the loop in `torch.distributed.algorithms.Join`, which
        makes a rank that ran out answer the others' all-reduces with zeros until all are done.
        Here PyTorch's DDP inside `Join` ran batch counts {counts} on {n} ranks without a hang and
        ended with {'the same model on every rank' if len(sums) == 1 else 'different models (unexpected)'}
        (parameter checksum {next(iter(sums)):.6f}).
    """)
    see(sampler_epochs)
    see(uneven_with_join)


def overlap_and_buckets():
    task = timing_task()
    note("## Overlap communication with backward, and bucket it")
    psi = param_count(task)
    ranks = timing_world()
    bucket_mb = 2.0 if not settings.quick else 0.25
    kinds = ["naive", "overlapped", "bucketed", "ddp"]
    names = {"naive": "all-reduce after backward", "overlapped": "per-parameter async all-reduce",
             "bucketed": f"bucketed ({bucket_mb} MB)", "ddp": "PyTorch DistributedDataParallel"}
    for kind in ("naive", "bucketed"):
        step_timeline(task, ranks, kind, names[kind], bucket_mb)
        if kind == "bucketed":
            note("""
                The naive version waits for the whole backward pass and only then talks. But the
                last layer's gradients are ready first: a hook that fires when a parameter's
                gradient is complete (`register_post_accumulate_grad_hook`) can start its
                all-reduce asynchronously while autograd works on the earlier layers, and the
                optimizer waits on the handles. One message per parameter pays the per-message
                latency many times over, so DDP packs gradients into buckets (PyTorch's default
                is 25 MB) and all-reduces a bucket once all its gradients are in. Two details
                decide how early it starts: the first bucket is capped at 1 MiB
                (`dist._DEFAULT_FIRST_BUCKET_BYTES`), so the first all-reduce leaves soon, and
                after the first iteration DDP rebuilds its buckets in the order the gradients
                actually became ready.
            """)
    check = small_task()
    ref = reference_train(check)
    worst, checked = 0.0, set()
    for kind, kw in [("overlapped", {}), ("bucketed", {"bucket_mb": 0.002})]:
        for world_size in (2, 4):
            run = spawn(train_data_parallel, world_size, task=check, grad_sync=kind,
                        name=f"{kind} DDP, {world_size} ranks", **kw)
            if run.skipped:
                continue
            r = run.returns
            checked.add(world_size)
            assert max(max_diff(x["params"], r[0]["params"]) for x in r) == 0
            worst = max(worst, max_diff(r[0]["params"], ref["params"]))
    times = step_times()
    table([[names[k], times[k].ms(), times[k].median / times["naive"].median] for k in kinds],
          header=["gradient sync", "time per step, median (IQR)", "relative to naive"],
          caption=f"widths {task.sizes}, Ψ = {psi:,} ({psi * 4 / 2**20:.1f} MB of float32 gradients), "
                  f"global batch {task.batch}, {machine(ranks)}; PyTorch's DDP gets the same "
                  "`bucket_cap_mb`; the variants take turns, several repetitions each, slowest rank")
    best = min(kinds, key=lambda k: times[k].median)
    note(f"""
        Both hooked syncs still train the one-process model (replicas bit-identical, at most
        {worst:.1e} from one process on {' and '.join(map(str, sorted(checked)))} ranks). Lowest median
        here: {names[best]}. {f"Against the naive sync: {compare(times[best], times['naive'], names[best], 'the naive sync')}."
                              if best != 'naive' else ''} gloo's communication threads
        compete with the compute for the cores, so overlap hides less than on a GPU, where
        NCCL's transfers run beside the compute kernels.
    """)
    pub = TORCHTITAN_FSDP_SCALING
    kept = {name: pts[1][1] / pts[0][1] for name, pts in pub.series.items()}
    figure(published_figure(pub, height=2.6), caption=pub.caption(
        f"What this page cannot show, data parallelism at scale (FSDP): from 8 to 128 GPUs (16 nodes, RDMA between them), 2 sequences "
        f"per GPU, each GPU kept {min(kept.values()):.0%}–{max(kept.values()):.0%} of its tokens per second: 16× the "
        f"GPUs, about 16× the throughput, the gathers and reduce-scatters hidden behind the layers' compute."))
    see("https://arxiv.org/abs/2006.15704", "Li et al. 2020, PyTorch Distributed: Experiences on Accelerating Data "
        "Parallel Training (DDP's buckets and overlap: \"near-linear scalability using 256 GPUs\")")
    note("Bucket sizes, swept, and the same buckets with the compute's core released, are deep dives:")
    see(OverlappedAllReduce)
    see(BucketedAllReduce)


def step_timeline(task, ranks, kind, label, bucket_mb=None):
    """Two measured steps of one gradient sync, drawn rank by rank."""
    run = spawn(traced_steps, ranks, task=task, kind=kind, bucket_mb=bucket_mb,
                name=f"timeline of two steps: {label}, {ranks} ranks")
    spans, merged = merge_in_flight(run.spans)
    figure(timeline(spans, title=f"{label}: two steps"),
           caption=f"{label}: measured spans per rank. Async collectives are drawn from "
                   "launch to completion (a completion callback on the communication thread)"
                   + (f"; the {merged} per-parameter all-reduces of each rank overlap one "
                      "another, so they are drawn as one bar per stretch of time in which at "
                      "least one was in flight." if merged else "."))


def per_parameter_timeline():
    """The hooked sync without buckets: one message per parameter, each in flight at once."""
    note("## One all-reduce per parameter, on a timeline")
    task, ranks = timing_task(), timing_world()
    step_timeline(task, ranks, "overlapped", "per-parameter async all-reduce")
    note(f"""
        The companion of the main page's naive and bucketed timelines, on the same model (widths
        {task.sizes}) and {ranks} ranks. Without buckets, each parameter's hook starts its own
        all-reduce the moment its gradient is complete: many small messages in flight together,
        each paying the per-message latency. The sweep below, on a deeper model of many small
        tensors, trades their number against how early the first one can leave.
    """)


def ddp_overlap_released():
    note("## Deep dive: DDP's overlap, with the core released")
    ranks = timing_world()
    times = step_times()
    freed = spawn(released_buckets, ranks, name=f"DDP buckets with a compute stand-in that releases the core, "
                                                f"{ranks} ranks").returns[0]
    figure(overlap_bars({"real compute (naive sync vs buckets)": {"sequential": times["naive"],
                                                             "overlapped": times["bucketed"]},
                         "compute stand-in (core released)": freed}),
           caption="time per step without and with overlap, medians (bars: interquartile range); red: the "
                   "model's overlapped step for the stand-in run")
    note(f"""
        The real-compute bars are the main page's table: on this CPU gloo's threads need the
        cores backward runs on. Give the core back and the overlap shows: each of 6 layers of 1024×1024 (a 4 MB bucket
        each) also waits in its backward, as long as one bucket's all-reduce, in a stand-in that
        releases the core (`ComputeStandIn`, lecture 05's sleep mode). {gain_words(freed)}. The
        model (`overlapped_step`) is $\\max(\\text{{compute}}, \\text{{communication}})$ plus
        the last bucket, which nothing is left to hide.
    """)
    see(released_buckets)


def step_times():
    """Seconds per step of every variant this page compares (our three syncs, PyTorch's DDP, our
    ZeRO-1/2/3 and FSDP2) on the timing model, measured once, in one run where they take turns,
    and reused by every table that shows them (so no two tables disagree about one variant)."""
    ranks, bucket_mb = timing_world(), (2.0 if not settings.quick else 0.25)
    key = (ranks, settings.quick, bucket_mb)
    if key not in _STEP_TIMES:
        kinds = ["naive", "overlapped", "bucketed", "ddp", "zero1", "zero2", "zero3", "fsdp2"]
        _STEP_TIMES[key] = spawn(
            time_variants, ranks, task=timing_task(), kinds=kinds, bucket_mb=bucket_mb, reps=5,
            name=f"step time: our syncs, DDP, ZeRO-1/2/3 and FSDP2 taking turns, {ranks} ranks").returns[0]
    return _STEP_TIMES[key]


_STEP_TIMES = {}


def hide_the_all_reduce():
    task = timing_task()
    ranks = timing_world()
    psi = param_count(task)
    note("## Can data parallelism hide the all-reduce?")
    t = spawn(budget_probe, ranks, task=task,
              name=f"overlap budget: backward vs gradient all-reduce, {ranks} ranks").returns[0]
    backward = max(1e-9, t["forward+backward"].median - t["forward"].median)
    comm = t["all-reduce"].median
    busbw = 2 * (ranks - 1) / ranks * 4 * psi / comm
    at_scale = published_scale_numbers()
    fig = hidden_all_reduce_figure(backward, comm, at_scale)
    figure(fig, caption="the overlap budget: the gradient all-reduce can hide only behind as much backward "
                        "as there is; left, this run's medians; right, the published-scale estimate below")
    note(f"""
        The all-reduce of the gradients (2Ψ bytes in 16-bit, 4Ψ in our float32) takes about
        $\\frac{{2(n-1)}}{{n}} \\cdot \\frac{{\\text{{gradient bytes}}}}{{\\text{{busbw}}}}$ and starts
        only as buckets fill during backward, so it is hidden when it is shorter than backward.
        Backward's time grows with the batch per rank, the all-reduce's does not: shrinking the
        batch per rank (more ranks, same global batch) eventually exposes it. Measured on the
        timing model (Ψ = {psi:,}, {task.batch // ranks} rows per rank):
    """)
    table([["forward", t["forward"].ms()], ["forward + backward", t["forward+backward"].ms()],
           ["backward (difference of medians)", f"{backward * 1e3:.3g} ms"],
           [f"all-reduce of all {4 * psi / 2**20:.1f} MB of gradients", t["all-reduce"].ms()],
           ["bus bandwidth of that all-reduce", f"{busbw / 1e9:.2f} GB/s"],
           ["all-reduce / backward", f"{comm / backward:.2f}"]],
          header=["measured", "median (IQR)"], caption=machine(ranks))
    cheat("Ring all-reduce time (DP's gradients)",
          "$\\frac{2(n-1)}{n} \\cdot \\frac{\\text{gradient bytes}}{\\text{busbw}}$; hidden when shorter than backward",
          round(busbw / 1e9, 3), "GB/s",
          what=f"the bus bandwidth this run measured: {4 * psi / 2**20:.1f} MB of float32 gradients on "
               f"{ranks} ranks in {comm * 1e3:.3g} ms")
    verdict = ("shorter than backward: with perfect overlap it would be hidden" if comm < backward
               else "longer than backward: even perfect overlap leaves "
                    f"{(comm - backward) * 1e3:.3g} ms per step exposed")
    note(f"""
        Here the gradient all-reduce is {comm / backward:.2f}× backward, {verdict}. Neither
        number transfers to a cluster; the method does.

        **At published scale.** {published_scale()}
    """)
    see(budget_probe)
    see("https://www.nvidia.com/en-us/data-center/h100/", title="NVIDIA H100 datasheet (989 TFLOP/s dense BF16, SXM)")
    see("https://www.nvidia.com/en-us/networking/infiniband-adapters/", title="NVIDIA ConnectX-7: 400 Gb/s NDR InfiniBand")


def gradient_accumulation():
    task = small_task()
    note("## Gradient accumulation: skip the all-reduce until the last micro-batch")
    ref = reference_train(task)
    rows = []
    for world_size, micro in [(2, 1), (2, 3), (4, 3), (2, 6)]:
        for kind in ("overlapped", "bucketed"):
            run = spawn(train_data_parallel, world_size, task=task, grad_sync=kind, micro_batches=micro,
                        bucket_mb=0.002, name=f"accumulation, {kind} sync, {world_size} ranks x {micro} micro-batches")
            if run.skipped:
                continue
            r = run.returns
            mbs = task.batch // world_size // micro
            rows.append([mbs, micro, world_size, mbs * micro * world_size, kind,
                         max_diff(r[0]["params"], ref["params"]), r[0]["bytes_per_step"]])
    fig = accumulation_traffic_figure(rows)
    figure(fig, caption="the traffic per step does not grow with the number of micro-batches: one all-reduce "
                        "per step, after the last one")
    note("""
        When the batch that fits in memory is smaller than the batch we want, run several
        micro-batches and let autograd add their gradients up in `.grad` (each loss divided by the
        number of micro-batches). Only the last micro-batch's hooks all-reduce, the `no_sync`
        idea, so accumulation costs no extra communication, and the result is the large batch,
        exactly. Three numbers name every configuration, and they multiply: the global batch is

        $$B = b \\times a \\times N$$

        for a micro-batch of $b$ rows, $a$ accumulation steps and $N$ data-parallel ranks.
    """)
    table(rows, header=["micro-batch", "accumulation steps", "DP ranks", "global batch (product)",
                        "sync", f"max |Δ| vs one process, batch {task.batch}",
                        "bytes sent per step per rank (counted)"],
          caption="accumulated micro-batches equal one large batch; the traffic is one all-reduce "
                  "per step whatever the number of micro-batches")


def batch_and_learning_rate():
    ranks = timing_world()
    base_batch, base_lr = 8, 0.05
    batches = [8, 32, 128] if settings.quick else [8, 32, 128, 512]
    samples = base_batch * (100 if settings.quick else 300)
    rules = ["none", "sqrt", "linear"]
    note("## Batch size and learning rate")
    configs = [(b, r) for b in batches for r in rules]
    got = {}
    run = spawn(lr_scaling, ranks, configs=configs, base_batch=base_batch, base_lr=base_lr,
                samples=samples, name=f"learning-rate scaling, {len(configs)} SGD runs over {ranks} ranks")
    for part in run.returns:
        got.update(part)
    fig = batch_scaling_figure(rules, batches, got)
    figure(fig, caption="final held-out loss against batch size for three learning-rate rules")
    note(f"""
        Data parallelism grows the global batch with the number of ranks (times micro-batch
        times accumulation). With a fixed budget of samples a bigger batch means fewer steps,
        and each step must then move further: the learning rate has to grow. Goyal et al.
        (2017) scale it *linearly* with the batch (k times the batch, k times the rate), after
        a warm-up; the *square-root* rule (Krizhevsky 2014; Hoffer et al. 2017) scales it by
        √k, which keeps the variance of each update constant: a batch k times larger divides
        the gradient noise's variance by k, and a rate √k times larger multiplies the update's
        variance by k. A small experiment: plain SGD on the teacher task, {samples:,} samples
        in all, batch {base_batch} at rate {base_lr} as the base, a linear warm-up over the
        first tenth of the steps, the held-out loss at the end (one run per point).
    """)
    table([[b, samples // b, *(got[b, r] for r in rules)] for b in batches],
          header=["global batch", "steps", *(f"loss, {r} scaling" for r in rules)])
    note(f"""
        {best_rules(got, batches, rules, base_batch)}
        Keeping the rate fixed ("none") wastes the larger batches: the same samples buy fewer
        and equally small steps. Linear scaling keeps the loss close to the small-batch result
        as long as the scaled rate stays stable. Past the task's *critical batch size*
        (McCandlish et al. 2018) no learning-rate rule restores linear speed-up: once the
        batch's gradient is nearly noise-free, a k-times larger batch gives a barely better
        gradient, so it cannot replace k smaller steps; the square-root rule and LARS/LAMB
        change how stable a large batch is, not this limit. What holds for this small
        regression need not hold for a transformer; the experiment is the method.
    """)
    see(train_at_batch)


def zero_stages():
    task = small_task()
    n = settings.world_size
    note("## ZeRO-1, ZeRO-2, ZeRO-3")
    stages = ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    figure(draw_holdings(stage_measurements(), stages),
           caption=f"What each of the {n} ranks holds, drawn from the bytes each one measured (the memory "
                   "model below): a full block is a replica, a short block at the rank's own position is "
                   "its 1/N shard. DP replicates everything; ZeRO-1 shards the optimizer state, ZeRO-2 "
                   "the gradients too, ZeRO-3 the parameters too (transient full tensors left out).")
    note("""
        With mixed-precision Adam each parameter costs 2 bytes (16-bit weight) + 2 (gradient) +
        12 (fp32 master weight and two moments), and plain data parallelism stores all of it N
        times. ZeRO (Rajbhandari et al. 2020) shards it:

        * **ZeRO-1** shards the optimizer state. Gradients are *reduce-scattered* (rank r
          receives the averaged gradient of its shard only), each rank runs AdamW on its shard,
          and the updated shards are *all-gathered* back: together the bytes of one all-reduce.
        * **ZeRO-2** also shards gradients: each is reduce-scattered as soon as backward produces
          it, and the full gradient is dropped.
        * **ZeRO-3** shards the parameters too. A layer's weights exist in full only while it
          runs: gathered before its forward (the next layer's gather launched meanwhile:
          prefetch), freed, gathered again for its backward, freed again.

        Ours flattens *each* tensor, pads it to a multiple of N and cuts N equal pieces. FSDP1
        instead flattens all of a unit's tensors into one `FlatParameter`; FSDP2 keeps each
        parameter as a `DTensor` sharded along dim 0 (`Shard(0)`), so a shard is still a tensor
        the optimizer and checkpoints can address. Against single-process AdamW:
    """)
    ref = reference_train(task)
    rows = []
    configs = [(stage, world_size, {}) for stage in (1, 2, 3) for world_size in (2, 4)]
    configs += [(stage, 2, {"micro_batches": 3}) for stage in (1, 2, 3)]
    configs += [(3, 2, {"eval_between": True})]
    for stage, world_size, kw in configs:
        how = ("3 micro-batches accumulated" if kw.get("micro_batches") else
               "a no_grad loss between backward and step" if kw.get("eval_between") else "plain")
        run = spawn(train_zero, world_size, task=task, stage=stage,
                    name=f"ZeRO-{stage}, {world_size} ranks, {how}", **kw)
        if run.skipped:
            continue
        r = run.returns
        diff = max_diff(r[0]["params"], ref["params"])
        changed = sum(bool((a != b).any()) for a, b in zip(r[0]["params"], ref["initial"]))
        assert diff < 1e-4 and changed == len(ref["params"]), (stage, kw, diff, changed)
        rows.append([f"ZeRO-{stage}", world_size, how, r[0]["losses"][-1], diff,
                     f"{changed} of {len(ref['params'])}", r[0]["calls_per_step"]])
    table(rows, header=["stage", "ranks", "training", "last loss", "max |Δ| vs single-process AdamW",
                        "parameter tensors changed", "collective calls per step"],
          caption=f"reference last loss {ref['losses'][-1]:.6f}")
    note("""
        Two ways to get ZeRO wrong that the last rows check. *Accumulation*: ZeRO-2 and ZeRO-3
        drop the full gradient after reduce-scattering it, so each micro-batch's shard must be
        *added* to the previous ones until the step (overwriting it would train on the last
        micro-batch only); the price is a reduce-scatter per micro-batch, visible in the call
        count. *A forward without backward* (logging a loss under `torch.no_grad()` between
        backward and step): ZeRO-3 keeps the last layer gathered after its forward because its
        backward comes next, but under `no_grad` no backward comes, and a copy kept past
        `step()` would be the pre-step weights; ours frees it when no backward can follow, and
        `step()` drops any gathered copy. And a common bug in public ZeRO-3 sketches hooks the
        gather for backward onto the layer's *input* gradient, which never exists for the first
        layer, so it never trains: here the shards are inputs of the autograd function, and the
        table checks that every parameter tensor changed. Modules it cannot shard (anything with
        parameters but `Linear`) are refused when the model is wrapped.
    """)
    see(adamw_update)
    see(Zero1)
    see(Zero2)
    see(Zero3Layer)
    see(Zero3LinearFunction)


def zero3_prefetch_released():
    note("## Deep dive: what ZeRO-3's prefetch buys, with the core released")
    ranks = timing_world()
    freed = spawn(released_prefetch, ranks, name=f"ZeRO-3 prefetch with a compute stand-in that releases the core, "
                                                 f"{ranks} ranks").returns[0]
    real = freed["real"]
    figure(overlap_bars({f"ZeRO-3 forward, real matmuls ({freed['real_rows']} rows)": real,
                         "ZeRO-3 forward, compute stand-in (core released)": freed}),
           caption="a ZeRO-3 forward of 6 sharded 1024×1024 layers without and with prefetch, its matmuls real (top) or "
                   "each followed by a stand-in that waits as long as one layer's all-gather (below): medians (bars: "
                   "interquartile range); red: the stand-in's model")
    note(f"""
        Each layer's forward needs its gathered weights; launched when the
        previous layer starts, the gather travels while that layer computes. Here the compute is
        replaced by a stand-in that releases the core, as long as one layer's gather.
        {gain_words(freed)}. The model: only the first gather is exposed, every later one hides
        behind the layer before it. With real matmuls instead ({freed['real_rows']} rows a layer),
        {real_compute_words(real, "the forward with prefetch", "the forward without")}. On a
        GPU the gathers run on NCCL's own stream beside the kernels.
    """)
    see(released_prefetch)


def memory_and_traffic():
    task = memory_task()
    n = settings.world_size
    psi = param_count(task)
    note("## Memory per rank and bytes on the wire, measured")
    returns = stage_measurements()
    stages = ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    got = returns[0]
    fig = memory_per_rank_figure(got, stages, psi, n)
    figure(fig, caption="Measured (left bar of each pair) beside the 4Ψ + 4Ψ + 8Ψ formula "
                        "(right, hatched); grey: the transient full tensors at their peak.")
    note(f"""
        A deeper model for this one: {len(task.sizes) - 1} layers, Ψ = {psi:,}, on {n} ranks. Each
        rank reports the bytes of the tensors it actually holds (parameters, gradients, optimizer
        state) and separately the *transient* full tensors at their peak (ZeRO-2's full gradients
        waiting to be reduce-scattered, ZeRO-3's gathered layers and full gradients in flight).
        This run is float32 throughout, so its formula is 4Ψ + 4Ψ + 8Ψ (weights, gradients, two
        Adam moments, no separate master copy); the ZeRO paper's mixed-precision accounting is
        2Ψ + 2Ψ + 12Ψ. Both are listed:
    """)
    rows = []
    for s in stages:
        h = got[s]["held"]
        fp32 = formula_bytes(psi, n, s, 4, 4, 8)
        mixed = formula_bytes(psi, n, s, 2, 2, 12)
        rows.append([s, h["params"], h["grads"], h["optimizer"], h["transient"],
                     sum(h.values()), sum(fp32), sum(mixed)] +
                    ([got[s]["peak_allocated"]] if got[s]["peak_allocated"] is not None else []))
    header = ["stage", "params (B)", "grads (B)", "optimizer (B)", "transient peak (B)",
              "measured total (B)", "fp32 formula (B)", "mixed-precision formula (B)"]
    if got["DP"]["peak_allocated"] is not None:
        header.append("GPU peak allocated (B)")
    table(rows, header=header, caption=f"rank 0, Ψ = {psi:,}, N = {n}")
    if got["DP"]["peak_allocated"] is None:
        note("On a GPU this table also shows `torch.cuda.max_memory_allocated()` per stage "
             "(activations and workspace included); this build ran on CPU, where there is none.")

    cheat("Training state per rank under ZeRO",
          "$(2+2+12)\\Psi$ (DP) → $(2+2+\\frac{12}{N})\\Psi$ → $(2+\\frac{14}{N})\\Psi$ → $\\frac{16}{N}\\Psi$ bytes "
          "(mixed-precision Adam; $4+4+8$ in float32)",
          round(sum(got["ZeRO-3"]["held"][c] for c in ("params", "grads", "optimizer")) / psi, 3),
          "bytes per parameter",
          what=f"ZeRO-3 in float32 on N = {n} ranks, measured on rank 0 (16/N = {16 / n:g} plus padding; "
               "transient full tensors left out)")
    note(f"""
        Measured and predicted agree up to padding (each tensor is padded to a multiple of
        N) and the transient full tensors, which the formulas leave out: ZeRO-3 holds about two
        layers' weights in full (the one running and the prefetched one) and the full gradients
        of at most two layers (each layer's reduce-scatter is waited for in the next layer's
        backward, as FSDP2 does; left pending until the step, every layer's full gradient would
        stay alive, since a gloo Work keeps a full-size copy of its input until it is dropped),
        ZeRO-2 a couple of full gradients in flight. For scale, the paper's example — Ψ = 7.5 B parameters on N = 64
        GPUs with mixed-precision Adam — needs
        {sum(formula_bytes(7.5e9, 64, 'DP', 2, 2, 12)) / 1e9:.0f} GB per GPU for DP (formulas
        evaluated here). ZeRO-1 brings it to
        {sum(formula_bytes(7.5e9, 64, 'ZeRO-1', 2, 2, 12)) / 1e9:.1f} GB, ZeRO-2 to
        {sum(formula_bytes(7.5e9, 64, 'ZeRO-2', 2, 2, 12)) / 1e9:.1f} GB. ZeRO-3, which shards
        the parameters too, needs {sum(formula_bytes(7.5e9, 64, 'ZeRO-3', 2, 2, 12)) / 1e9:.2f} GB.
    """)
    ratio = got["ZeRO-3"]["wire_per_step"] / got["DP"]["wire_per_step"]
    note(f"""
        ZeRO-3 pays on the wire for holding 1/{n} of the state: rank 0 wrote {ratio:.2f}× DP's
        {got['DP']['wire_per_step']:,.0f} bytes per step. Rings would make it 1.5×; gloo's
        reduce-scatter, a full all-reduce, adds the rest. The deep dive on bytes puts
        the formula, our calls counted as rings and as gloo runs them, and the socket writes side
        by side.
    """)
    cheat("DP gradient all-reduce per step",
          "ring: $2\\,\\frac{N-1}{N}$ × the gradient bytes sent per rank",
          got["DP"]["wire_per_step"], "bytes",
          what=f"measured on rank 0's sockets, N = {n}, {4 * psi:,} bytes of float32 gradients (gloo's "
               "headers included)")
    cheat("ZeRO-3 traffic per step",
          "ring: $3\\,\\frac{N-1}{N}\\,\\Psi$ values per rank (all-gather forward and backward, "
          "reduce-scatter): 1.5× DP's",
          round(ratio, 3), "× DP's bytes",
          what=f"measured on rank 0's sockets, N = {n}; on gloo, whose reduce-scatter is an all-reduce, "
               "the count is 4/3 of a ring's")
    see(Collectives)


def pytorch_versions():
    task = small_task()
    note("## PyTorch's own: DistributedDataParallel and FSDP2")
    t = step_times()        # the run of the overlap section: every variant measured once
    fig = pytorch_versions_figure(t)
    figure(fig, caption=f"time per step, ours beside PyTorch's on the timing model (Ψ = "
                        f"{param_count(timing_task()):,}), {machine(timing_world())}: the same run as the "
                        "overlap section's table (the variants take turns in it)")
    note("""
        `DistributedDataParallel` is the bucketed, overlapped all-reduce above, in C++.
        FSDP2 (`torch.distributed.fsdp.fully_shard`) is ZeRO-3 on per-parameter `DTensor`
        shards; we make each `Linear` its own unit, as in our ZeRO-3. On CPU it needs a CPU
        device mesh: `init_device_mesh("cpu", (N,))`.
    """)
    n = settings.world_size
    ref = reference_train(task)
    results = {
        "ours: DDP (bucketed)": spawn(train_data_parallel, n, task=task, grad_sync="bucketed",
                                      bucket_mb=0.002, name="ours: bucketed DDP").returns[0],
        "PyTorch DDP": spawn(train_pytorch, n, task=task, kind="ddp", name="PyTorch DDP").returns[0],
        "ours: ZeRO-3": spawn(train_zero, n, task=task, stage=3, name="ours: ZeRO-3").returns[0],
        "PyTorch FSDP2": spawn(train_pytorch, n, task=task, kind="fsdp2", name="PyTorch FSDP2").returns[0],
    }
    table([[k, r["losses"][-1], max_diff(r["params"], ref["params"])] for k, r in results.items()],
          header=["implementation", f"last loss (one process: {ref['losses'][-1]:.6f})",
                  "max |Δ param| vs single process"],
          caption=f"{n} ranks, {task.steps} AdamW steps on the small task")
    overlaps = lambda a, b: spreads_overlap(t[a], t[b])
    if overlaps("zero3", "zero1"):
        z3 = ("Bytes are not the whole cost: our ZeRO-1 (and ZeRO-2's all-gather) runs its "
              "collectives one tensor at a time *after* backward, blocking, while ZeRO-3 issues its "
              "reduce-scatters asynchronously during backward and prefetches the next layer's "
              "all-gather, which here makes up for its extra bytes.")
    elif t["zero3"].median < t["zero1"].median:
        z3 = ("Bytes are not the whole cost: our ZeRO-1 (and ZeRO-2's all-gather) runs its "
              "collectives one tensor at a time *after* backward, blocking, so every call's "
              "latency is exposed, while ZeRO-3 issues its reduce-scatters asynchronously during "
              "backward and prefetches the next layer's all-gather while the current one computes. "
              "Exposed latency, not volume, dominates small models on a few ranks.")
    else:
        z3 = ("ZeRO-3's extra all-gathers (every layer's weights gathered twice per step) cost more "
              "here than its overlap saves.")
    if t["zero3"].median < t["fsdp2"].median and not overlaps("zero3", "fsdp2"):
        fsdp = ("Per step FSDP2 does work ours skips. It keeps every parameter as a `DTensor`, so "
                "the optimizer step and the gradient bookkeeping go through DTensor's dispatch on "
                "every tensor; before each all-gather it copies the unit's shards into one flat "
                "buffer and afterwards copies the gathered buffer out into the per-parameter "
                "tensors (its \"copy-in/copy-out\"), and the same around each reduce-scatter; and "
                "it runs a pre-/post-forward and backward hook state machine per unit. On a model "
                "this small those fixed costs per unit are a large share of the step; on a GPU "
                "with big layers they vanish behind the matmuls and FSDP2's stream overlap.")
    else:
        fsdp = ("FSDP2 packs each unit's shards into one buffer per collective and overlaps its "
                "communication on its own streams; ours issues one collective per tensor.")
    note(f"""
        **Reading the figure.** Our ZeRO-3 against our ZeRO-1:
        {compare(t['zero3'], t['zero1'], 'ZeRO-3', 'ZeRO-1')}. With rings ZeRO-3 sends 1.5×
        plain data parallelism's bytes (4/3 of ZeRO-1's on gloo, whose reduce-scatter is an
        all-reduce). {z3}
        {zero2_words(t)}

        Our bucketed DDP against PyTorch's: {compare(t['bucketed'], t['ddp'], 'ours', 'PyTorch DDP')}.
        Our ZeRO-3 against FSDP2: {compare(t['zero3'], t['fsdp2'], 'ours', 'FSDP2')}. {fsdp}
        Our version is smaller because it handles one case (a `Sequential` of `Linear`s, fp32,
        no mixed precision, no checkpointing of its state).
    """)
    see(wrap_pytorch)


def fsdp2_knobs():
    task = Task(sizes=(32, 256, 256, 10), batch=16, steps=3)
    n = settings.world_size
    psi = param_count(task)
    note("## FSDP2's knobs, with numbers")
    ref = reference_train(task)
    variants = [("plain model, no FSDP (every rank a full replica)", {"wrap": False}),
                ("FSDP2, reshard_after_forward=True", {}),
                ("FSDP2, reshard_after_forward=False", {"reshard": False}),
                ("FSDP2, bf16 params, fp32 reduce", {"mixed": True})]
    if n == 4:
        variants.append(("HSDP on a 2x2 mesh (shard 2, replicate 2)", {"hsdp": True}))
    rows, got = [], {}
    for label, kw in variants:
        r = spawn(fsdp2_variant, n, task=task, name=f"{label}, {n} ranks", **kw).returns
        got[label] = r[0]
        rows.append([label, r[0]["held"], r[0]["wire_per_step"], r[0]["activations"],
                     max_diff(r[0]["params"], ref["params"]) if kw.get("wrap", True) else None])
    fig = fsdp2_knobs_figure(rows)
    figure(fig, caption=f"FSDP2 with one knob changed at a time, {n} ranks, Ψ = {psi:,}: what a rank "
                        "wrote to its sockets per step")
    note(f"""
        `fully_shard` has a few settings that trade memory against communication. Each run
        below trains the same model (widths {task.sizes}, Ψ = {psi:,}) on {n} ranks with one
        knob changed, and reports what a rank holds, what it wrote to its sockets per step
        (measured), and the activations it saved for backward.

        * `reshard_after_forward=True` (the default for every unit but the root, which stays
          gathered; the runs here pass it explicitly) frees each unit's gathered weights after
          its forward and all-gathers them again for backward: ZeRO-3's ≈ 3Ψ of traffic.
          `False` keeps them gathered from forward to backward: ≈ 2Ψ, ZeRO-2's traffic with
          ZeRO-3's memory between steps, but a whole model's weights alive during the step.
        * `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: the all-gathers move
          bf16 (half the bytes) and compute runs in bf16, while gradients are reduced in fp32.
        * HSDP (hybrid sharding): a 2-D mesh, shard within a group and replicate across
          groups; each rank holds Ψ/(ranks per group) and the groups all-reduce their
          gradients. In a cluster the shard group is a node (fast NVLink), the replicas span
          nodes.
    """)
    table(rows, header=["run", "parameter bytes held per rank", "bytes written per step (measured)",
                        "activation bytes saved for backward", "max |Δ param| vs one process"],
          caption=f"rank 0, {n} ranks, Ψ = {psi:,} ({4 * psi:,} bytes in fp32)")
    plain = got[variants[0][0]]["activations"]
    same = all(g["activations"] == plain for k, g in got.items() if "bf16" not in k)
    bf16_act = got["FSDP2, bf16 params, fp32 reduce"]["activations"]
    default = got["FSDP2, reshard_after_forward=True"]["wire_per_step"]
    keep = got["FSDP2, reshard_after_forward=False"]["wire_per_step"]
    bf16 = got["FSDP2, bf16 params, fp32 reduce"]["wire_per_step"]
    hsdp_note = (f" *HSDP skipped on this build:* its 2×2 mesh needs exactly 4 ranks, and this "
                 f"build ran {n}." if n != 4 else
                 f" HSDP holds {got[variants[-1][0]]['held']:,} bytes per rank (Ψ/2 in fp32) and "
                 "still trains the single-process model.")
    note(f"""
        Keeping the weights gathered from forward to backward cut the bytes written per step
        to {keep / default:.2f}× the default run's ({keep:,.0f} bytes). A ring would give the bullet's
        2Ψ/3Ψ = 0.67×. On gloo the reduce-scatter is an all-reduce, which writes two
        all-gathers' worth: all-gather + reduce-scatter against all-gather + all-gather +
        reduce-scatter is (1 + 2)/(1 + 1 + 2) = 0.75× here. With bf16 parameters the bytes fall
        to {bf16 / default:.2f}× the default run's ({bf16:,.0f} bytes): the two all-gathers,
        now in bf16, halve, and the fp32 gradient reduce-scatter (an all-reduce on gloo) is unchanged,
        and the parameters drift from the fp32 reference by bf16 rounding.{hsdp_note}
        **What ZeRO does not shard:** the activations. In float32 every rank saved
        {'exactly the same' if same else 'about the same'} {plain:,} bytes of activations for
        backward with or without FSDP, however the parameters were sharded: they belong to the
        rank's own micro-batch. (The bf16 run saved {bf16_act:,}: its activations are 2-byte
        numbers, a precision effect, not sharding.) Sharding
        them is what sequence/context parallelism and activation recomputation are for
        (lectures 01 and 06).
    """)
    see("https://github.com/pytorch/pytorch/issues/114299", title="PyTorch RFC: per-parameter-sharding FSDP (FSDP2 design)")
    see(fsdp2_variant)


def scaling_notes():
    note("""
        **Offload, and where data parallelism stops.** ZeRO-Offload keeps the fp32 optimizer state
        and the update on the CPU and the compute on the GPU, ZeRO-Infinity adds NVMe; both trade
        PCIe bandwidth for GPU memory. Data parallelism alone stops helping in two ways: every rank
        must still hold a whole layer's weights and activations (ZeRO-3 shards the storage, but
        each layer is gathered in full to compute), and past the critical batch size more replicas
        add samples that no longer shorten training. Tensor and pipeline parallelism, the next
        lectures, split each layer and the model itself, which is what lets a model larger than
        one device's memory train at all. Where bytes, not steps, are scarce (across
        datacentres), ranks can also talk less often or send compressed updates: local SGD,
        DiLoCo and PowerSGD, measured on the appendix page, after the history of very large
        batches and the references.
    """)


def what_to_remember():
    note("""
        ## What to remember
        - Data parallelism = start equal (broadcast), split the batch, average the gradients:
          every replica then takes the one-process step, and the tests check it to rounding.
        - Start each bucket's all-reduce during backward; buckets of megabytes pay the
          per-message latency once, and a hook per parameter pays it per tensor.
        - Global batch = micro-batch × accumulation steps × DP ranks; accumulation adds no
          communication. Past the critical batch size no learning-rate rule buys speed-up.
        - ZeRO-1/2/3 shard optimizer state, then gradients, then parameters: per rank
          (2 + 2 + 12)Ψ → (2 + 2 + 12/N)Ψ → (2 + 14/N)Ψ → 16Ψ/N bytes with mixed-precision Adam.
        - With ring collectives ZeRO-1/2 send what DP sends and ZeRO-3 1.5×; gloo's
          reduce-scatter is an all-reduce, so count bytes on the wire before explaining them.
        - Nothing here shards activations: that is recomputation's and sequence/context
          parallelism's job.

        The companion notebook, `lectures/notebooks/lecture_03_data_parallel.ipynb`, runs every
        section of this page cell by cell, with its knobs at the top.
    """)


def main():
    try_it_yourself(notebook_exercises("lecture_03_data_parallel"))   # its notebook's exercises, for the page
    intro()
    the_task()                  # the model, the data and the one-process reference
    ddp_from_scratch()          # broadcast, split the batch, average gradients: equal to one process
    data_sharding()             # a sampler per rank, and the uneven last batch that hangs
    overlap_and_buckets()       # start all-reduces during backward, in buckets
    with deep_dive("Bucket size, swept",
                   "the per-parameter timeline, then a sweep from one message per tensor to one bucket, "
                   "on a model of many small tensors"):
        per_parameter_timeline()
        bucket_sweep()
    with deep_dive("DDP's overlap, with the core released",
                   "the bucketed all-reduce beside a backward whose compute leaves the core to gloo, against its model"):
        ddp_overlap_released()
    hide_the_all_reduce()       # is there enough backward to hide the all-reduce behind?
    gradient_accumulation()     # gbs = mbs x accumulation x dp, one all-reduce per step
    batch_and_learning_rate()   # bigger batches need bigger steps: linear vs square-root
    zero_stages()               # shard optimizer state, gradients, parameters
    with deep_dive("ZeRO-3's prefetch, with the core released",
                   "the next layer's all-gather during this layer's compute, measured against its model"):
        zero3_prefetch_released()
    memory_and_traffic()        # what each rank holds and sends: formula, counted, measured
    with deep_dive("Bytes on the wire", "ZeRO's bytes per step: the formula, our calls counted as "
                   "rings and as gloo runs them, and the socket writes"):
        bytes_on_the_wire()
    pytorch_versions()          # the same with PyTorch's DDP and FSDP2, and their speed
    fsdp2_knobs()               # reshard_after_forward, mixed precision, HSDP; activations stay
    scaling_notes()             # offload, and where data parallelism stops
    # Deep dives, on the appendix page: history and references; talk less often, send fewer bytes.
    with deep_dive("Further reading", "very large batches from 29 hours to 74.7 seconds, and the papers"):
        further_reading()
    with deep_dive("Local SGD, compressed updates and DiLoCo",
                   "sync every H steps, masks and int8, DiLoCo's outer Nesterov step, per step and per byte"):
        local_sgd_section()
    with deep_dive("PowerSGD", "low-rank gradients inside data parallelism, ours beside PyTorch's hook"):
        powersgd_section()
    what_to_remember()          # the lecture in seven lines, and its notebook


def bench():
    """Ours vs PyTorch's, side by side in one run: bucketed DDP vs DDP, ZeRO-3 vs FSDP2."""
    task, ranks = timing_task(), timing_ranks(4)
    t = spawn(time_variants, ranks, task=task, kinds=["bucketed", "ddp", "zero3", "fsdp2"],
              bucket_mb=2.0, reps=7, name=f"bench: ours vs PyTorch, {ranks} ranks").returns[0]
    m = {k: v.median * 1e3 for k, v in t.items()}
    return [f"lecture_03: bucketed DDP {m['bucketed']:.1f} ms/step vs PyTorch DDP "
            f"{m['ddp']:.1f} ms/step: ratio {m['bucketed'] / m['ddp']:.2f} (target <= 1.1)",
            f"lecture_03: ZeRO-3 {m['zero3']:.1f} ms/step vs FSDP2 {m['fsdp2']:.1f} "
            f"ms/step: ratio {m['zero3'] / m['fsdp2']:.2f} (target <= 1.3)"]
