"""The appendix page of lecture 03: its deep dives, each a section function that main() calls
inside `with deep_dive(...)` (the bucket-size sweep, further reading, local SGD with compressed
updates and DiLoCo, PowerSGD, the bytes on the wire), with the helpers and rank functions only they
use, and the one measurement of DP and ZeRO that the main path's sections share."""
import torch
import torch.nn.functional as F

from util import figure, note, plural, see, settings, spawn, table
from util.measure import bytes_sent, compare, machine

from lectures.data_parallel.compression import NesterovOuter, PowerSGD, average_update
from lectures.data_parallel.ddp import Collectives, plan_buckets
from lectures.data_parallel.demos import (Task, checksum, make_batches, make_model, param_count, time_variants,
                                          timing_world, memory_task, measure_stages, both_ratios, span_of)
from lectures.data_parallel.figures import bucket_sweep_figure, local_sgd_figure, powersgd_figure


def bucket_task():
    """Many small tensors (24 layers: a 64 KB weight and a 0.5 KB bias each), where the
    number of buckets really depends on the bucket size."""
    width, depth = (64, 12) if settings.quick else (128, 24)
    return Task(sizes=(32,) + (width,) * depth + (10,), batch=64)


def bucket_sweep():
    task = bucket_task()
    ranks = timing_world()
    params = list(make_model(task, task.seed).parameters())
    w = max(p.numel() * p.element_size() for p in params) / 2 ** 20    # largest tensor, MB
    sizes = [1e-6] + [float(f"{w * k:.2g}") for k in (0.5, 2, 6)] + [25.0]
    counts = {mb: len(plan_buckets(params, mb)) for mb in sizes}
    kinds = ["overlapped"] + [f"bucketed:{mb}" for mb in sizes]
    t = spawn(time_variants, ranks, task=task, kinds=kinds, reps=5,
              name=f"bucket-size sweep, {len(params)} small tensors, {ranks} ranks").returns[0]
    label = {"overlapped": "per-parameter (no buckets)",
             **{f"bucketed:{mb}": f"{mb:g} MB" for mb in sizes}}
    label[f"bucketed:{sizes[0]}"] = "one per tensor (limit below every tensor)"
    nbuckets = {"overlapped": len(params), **{f"bucketed:{mb}": counts[mb] for mb in sizes}}
    note("## How big should a bucket be?")
    fig = bucket_sweep_figure(nbuckets, kinds, t)
    figure(fig, caption=f"Step time against the number of buckets: median and IQR, {machine(ranks)}.")
    note(f"""
        Bucketing matters when there are many small tensors, so this sweep uses a deeper, narrower
        stack: widths {task.sizes[0]} → {task.sizes[1]} × {len(task.sizes) - 2} → {task.sizes[-1]},
        {len(params)} parameter tensors, the largest {max(p.numel() for p in params) * 4 / 1024:.0f} KB,
        Ψ = {param_count(task):,} ({param_count(task) * 4 / 2**20:.2f} MB). The bucket counts come
        from the code's own `plan_buckets`: a bucket never splits a tensor, so a limit below the
        smallest tensor gives one bucket per parameter, and one above Ψ a single bucket that can
        only start when backward has finished.
    """)
    table([[label[k], nbuckets[k], t[k].ms()] for k in kinds],
          header=["bucket size", "buckets (counted)", "time per step, median (IQR)"],
          caption=f"{machine(ranks)}; the variants take turns in one run")
    best = min(kinds, key=lambda k: t[k].median)
    one = f"bucketed:{sizes[-1]}"
    per_param = t["overlapped"].median
    verdict = [f"The fastest setting here is {label[best]} ({plural(nbuckets[best], 'message')} per step)."]
    if best == one:
        verdict.append(
            "That is the one setting that cannot overlap at all: its all-reduce starts only after "
            f"backward. Against the per-parameter all-reduces (no buckets), "
            f"{compare(t[one], t['overlapped'], 'one bucket', 'per-parameter')}. On this "
            "machine overlap buys little (gloo's threads need the same cores as backward), while "
            f"every extra message costs its latency α and a pass of copies: with {len(params)} "
            "small tensors, fewer messages win, even if they wait.")
    elif t[one].median > t[best].median * 1.05:
        verdict.append(f"A single bucket ({t[one].brief()}) is slower than the best: its all-reduce "
                       "cannot start until backward has produced the last gradient, so none of it "
                       "overlaps.")
    if per_param > t[best].median * 1.05:
        verdict.append(f"The per-parameter all-reduces ({t['overlapped'].brief()}) pay the per-call "
                       f"latency α (lecture 02) {len(params)} times per step.")
    else:
        verdict.append("Per-parameter all-reduces are not slower than buckets on this machine: "
                       "our bucketing copies every gradient into its flat buffer (an extra pass "
                       "over memory on the same cores), and with only a few ranks on one host "
                       "gloo's per-call latency is small next to that copy and to the compute.")
    note(" ".join(verdict))
    see(plan_buckets)


def further_reading():
    note("""
        ## Very large batches, and further reading
        Goyal et al. trained ResNet-50 with batches of 8k in an hour with linear scaling and
        warm-up. Past that, layer-wise adaptive rates keep very large batches stable: LARS for SGD
        and LAMB for Adam (You et al.). Historic arc: ImageNet ResNet-50 went from about 29 hours
        on 8 P100 GPUs (the baseline reported by Goyal et al. 2017, not He et al. 2016, whose paper
        introduced the network) to 74.7 seconds on 2,048 V100 GPUs (Yamazaki et al. 2019, in the
        paper's own title).
    """)
    for url, title in [
        ("https://arxiv.org/abs/1706.02677", "Goyal et al. 2017, Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"),
        ("https://arxiv.org/abs/1812.06162", "McCandlish et al. 2018, An Empirical Model of Large-Batch Training (the critical batch size)"),
        ("https://arxiv.org/abs/1708.03888", "You et al. 2017, Large Batch Training of Convolutional Networks (LARS)"),
        ("https://arxiv.org/abs/1404.5997", "Krizhevsky 2014, One weird trick for parallelizing convolutional neural networks (√k learning rate)"),
        ("https://arxiv.org/abs/1705.08741", "Hoffer et al. 2017, Train longer, generalize better: closing the generalization gap in large batch training"),
        ("https://arxiv.org/abs/1904.00962", "You et al. 2019, Large Batch Optimization for Deep Learning: Training BERT in 76 minutes (LAMB)"),
        ("https://arxiv.org/abs/1910.02054", "Rajbhandari et al. 2020, ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"),
        ("https://arxiv.org/abs/2101.06840", "Ren et al. 2021, ZeRO-Offload: Democratizing Billion-Scale Model Training"),
        ("https://arxiv.org/abs/2104.07857", "Rajbhandari et al. 2021, ZeRO-Infinity: Breaking the GPU Memory Wall"),
        ("https://arxiv.org/abs/1610.05492", "Konečný et al. 2016, Federated Learning: Strategies for Improving Communication Efficiency"),
        ("https://arxiv.org/abs/1903.12650", "Yamazaki et al. 2019, Yet Another Accelerated SGD: ResNet-50 Training on ImageNet in 74.7 seconds"),
        ("https://arxiv.org/abs/2304.11277", "Zhao et al. 2023, PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel"),
    ]:
        see(url, title=title)


# =========================================================================================
# 7. Local SGD / federated averaging, with compressed updates
# =========================================================================================

# The compressors (mask, int8, PowerSGD) and DiLoCo's outer optimizer live in
# lectures/data_parallel/compression.py; the rank functions that train with them are here.

def rank_stream(task, rank, world_size, steps, non_iid, seed_offset=1):
    """This rank's own data stream. Non-IID: each rank's inputs are centred at a different
    point (−2.5 … +2.5 across the ranks), as if every rank held a different slice of the world."""
    shift = 2.5 * (2 * rank / max(1, world_size - 1) - 1) if non_iid and world_size > 1 else 0.0
    return make_batches(task, steps=steps, seed_offset=seed_offset + rank, input_shift=shift)


def held_out(task, world_size, non_iid):
    """Held-out rows drawn from every rank's distribution alike."""
    parts = [rank_stream(task, r, world_size, 1, non_iid, seed_offset=999)[0] for r in range(world_size)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def local_sgd(rank, world_size, task, sync_every=1, compress="", steps=120, lr=0.5, non_iid=True,
              outer=None):
    """Each rank trains alone on its own data stream with SGD; every `sync_every` steps the
    ranks average their progress since the last sync. What compression dropped from a rank's
    update is kept and added to its next one (error feedback): delayed, not lost. With
    `outer="nesterov"` the average is applied by DiLoCo's outer optimizer instead of as is."""
    comm = Collectives(world_size)
    model = make_model(task, task.seed)
    params = list(model.parameters())
    flat = lambda: torch.nn.utils.parameters_to_vector(params).detach()
    synced, residual = flat(), torch.zeros_like(flat())
    outer_opt = NesterovOuter(synced) if outer == "nesterov" else None
    data = rank_stream(task, rank, world_size, steps, non_iid)
    x_eval, y_eval = held_out(task, world_size, non_iid)
    opt = torch.optim.SGD(params, lr=lr)
    with torch.no_grad():
        curve = [(0, 0, F.mse_loss(model(x_eval), y_eval).item())]
    for t, (x, y) in enumerate(data, 1):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if t % sync_every == 0:
            delta = flat() - synced + residual
            average, mine = average_update(delta, comm, compress, t)
            residual = delta - mine
            synced = outer_opt.step(synced, average) if outer_opt else synced + average
            # a copy: vector_to_parameters makes the parameters views of the vector it is given
            torch.nn.utils.vector_to_parameters(synced.clone(), params)
            with torch.no_grad():
                curve.append((t, comm.sent, F.mse_loss(model(x_eval), y_eval).item()))
    return {"curve": curve, "checksum": checksum(params)}


def local_sgd_sweep(rank, world_size, task, variants, steps):
    """Every (H, compression, outer optimizer) variant in turn, on the same ranks."""
    return {f"H={h} {c or 'fp32'}" + (f" {o}" if o else ""):
            local_sgd(rank, world_size, task, h, c, steps, outer=o) for h, c, o in variants}


def local_sgd_words(final, noise=0.05):
    """The local-SGD comparison in words from one run per variant (`final`: variant ->
    (step, bytes, loss)). With one run each there is no spread to compare against, so losses
    within `noise` (relative) of each other are called indistinguishable, not ranked."""
    h1, h16, dl = final["H=1 fp32"][2], final["H=16 fp32"][2], final["H=16 fp32 nesterov"][2]
    close = lambda a, b: abs(a - b) <= noise * min(a, b)
    drift = ("about the same" if close(h16, h1) else
             "worse: between syncs each rank drifts towards its own data" if h16 > h1 else "better")
    outer = ("ends about where plain averaging does" if close(dl, h16) else
             "recovers part of the loss of syncing rarely" if dl < h16 else "ends worse than plain averaging")
    ranked = sorted(final, key=lambda k: final[k][2])
    best, runner = ranked[0], ranked[1]
    lowest = (f"The lowest final loss here is {best} ({final[best][2]:.4f}), next {runner} "
              f"({final[runner][2]:.4f}).")
    if close(final[best][2], final[runner][2]):
        lowest += (f" These are single runs, one seed each, and differences within {noise:.0%} "
                   "are within what another seed could change: without repeated runs they rank nothing.")
    return (f"Per step: syncing every step ends at {h1:.4f}; syncing every 16 steps, with 1/16 of "
            f"the traffic, at {h16:.4f} ({drift}); DiLoCo's outer Nesterov step on the same "
            f"16-step averages at {dl:.4f}: momentum across rounds {outer}. {lowest}")


def local_sgd_section():
    task = Task(batch=16)
    n = settings.world_size
    steps = 48 if settings.quick else 96     # multiples of every H below: the run ends on a sync
    note(f"""
        ## Deep dive: local SGD, compressed updates and DiLoCo
        You can skip this section and the next on a first read: they leave the main path
        (every rank syncs every step) for methods that talk less. Averaging gradients every
        step is one end of a spectrum. Local SGD (federated
        averaging when the ranks are phones) lets each rank take H steps on its own data and
        then averages the *parameters* — with plain SGD and H = 1 that is exactly data
        parallelism. Konečný et al. (2016) also shrink what is sent: a random mask keeps a
        fraction of the coordinates (with a shared seed, only values travel), and quantization
        sends 8 bits per value with stochastic rounding; what a rank's compressed update left
        out is added to its next one (*error feedback*, Seide et al. 2014; Karimireddy et al.
        2019). DiLoCo (Douillard et al. 2023) keeps H large and applies the averaged change
        with an *outer* optimizer, Nesterov momentum, instead of as is. Its recipe is AdamW
        inside, H ≈ 500 and the outer step at lr 0.7, μ 0.9; the run below keeps that outer
        step but runs SGD inside with H = 16, a regime DiLoCo does not use, so what it shows
        about the outer step holds for this regime only.

        The trade-off shows only when the ranks' data differ: here each rank's inputs are
        centred at a different point (*non-IID* shards), so a rank left alone for H steps drifts
        towards its own data. {n} ranks, SGD, {steps} local steps; the held-out loss (on all
        ranks' distributions) after each sync, against the step and against the bytes each rank
        has sent:
    """)
    see(average_update)
    see(local_sgd)
    see(NesterovOuter)
    variants = [(1, "", None), (4, "", None), (16, "", None), (16, "", "nesterov"),
                (4, "mask", None), (4, "int8", None), (4, "mask+int8", None)]
    run = spawn(local_sgd_sweep, n, task=task, variants=variants, steps=steps,
                name=f"local SGD sweep, {len(variants)} variants, non-IID, {n} ranks")
    curves = run.returns[0]
    assert all(len({r[k]["checksum"] for r in run.returns}) == 1 for k in curves), "ranks disagree after sync"
    fig = local_sgd_figure(curves)
    figure(fig, caption="held-out loss after each sync, per step (left) and per byte (right); "
                        f"starting loss {curves['H=1 fp32']['curve'][0][2]:.3f}")
    final = {k: c["curve"][-1] for k, c in curves.items()}
    table([[k, v[1], v[2], len(curves[k]["curve"]) - 1] for k, v in final.items()],
          header=["variant", "bytes sent per rank (counted)", "final held-out loss", "syncs"],
          caption=f"{n} ranks, {steps} local steps each on non-IID shards; ranks hold identical "
                  "models after every sync (checked)")
    note(f"""
        {local_sgd_words(final)} Per byte the picture
        changes: the curves on the right that reach a given loss with the fewest megabytes
        are the ones with rare or compressed syncs. Which side wins depends on what is scarce: across datacentres it is bytes,
        inside an NVLink node it is steps.

        Int8 arrives via all-gather, not all-reduce: 8-bit numbers cannot be added on the way
        round a ring without overflowing or re-quantizing at every hop, so every rank collects
        all N quantized vectors and sums after decoding. An all-gather sends (N−1)·S/4 bytes per
        rank where the fp32 all-reduce sends 2(N−1)/N·S, so int8 saves bytes only while
        N < 8, and costs more beyond.
    """)


def powersgd_train(rank, world_size, task, impl="ours", rank_r=1, steps=60, lr=0.3, non_iid=True,
                   every=5):
    """Data-parallel SGD on non-IID streams with the gradient all-reduce done three ways:
    "exact" (PyTorch DDP), "pytorch" (DDP with PyTorch's powerSGD_hook), "ours" (`PowerSGD`).
    Returns the held-out loss every `every` steps and the bytes written per step (measured)."""
    from torch.nn.parallel import DistributedDataParallel
    comm = Collectives(world_size)
    model = make_model(task, task.seed)
    net, ours = model, None
    if impl in ("exact", "pytorch"):
        net = DistributedDataParallel(model)
        if impl == "pytorch":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook
            state = hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                                       start_powerSGD_iter=2, min_compression_rate=2,
                                       use_error_feedback=True, warm_start=True, random_seed=0)
            net.register_comm_hook(state, hook.powerSGD_hook)
    else:
        ours = PowerSGD(model.parameters(), comm, rank=rank_r, start_iter=2, min_rate=2)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x_eval, y_eval = held_out(task, world_size, non_iid)
    curve, wire = [], 0
    for t, (x, y) in enumerate(rank_stream(task, rank, world_size, steps, non_iid), 1):
        with bytes_sent() as written:
            F.mse_loss(net(x), y).backward()
            if ours:
                ours.sync()
            opt.step()
            opt.zero_grad()
        wire += written.bytes or 0
        if t % every == 0 or t == steps:
            with torch.no_grad():
                curve.append((t, F.mse_loss(model(x_eval), y_eval).item()))
    return {"curve": curve, "wire_per_step": wire / steps, "checksum": checksum(model.parameters())}


def powersgd_section():
    task = Task(sizes=(32, 128, 128, 10), batch=16)
    n = settings.world_size
    steps = 40 if settings.quick else 80
    note(f"""
        ## Deep dive: PowerSGD
        You can skip this section on a first read. **PowerSGD** (Vogels et al. 2019)
        compresses the gradient itself, every step, inside
        ordinary data parallelism: each gradient matrix is replaced by a rank-r approximation
        found with one step of power iteration per training step (warm-started from the last
        step's), which costs two small all-reduces of r·(rows + cols) numbers instead of one of
        rows·cols, with error feedback. PyTorch ships it as a DDP communication hook; below,
        ours and PyTorch's `powerSGD_hook` against exact all-reduce (PyTorch DDP), rank 1, the
        first 2 steps uncompressed as in the hook, {n} ranks on non-IID streams, {steps} steps,
        widths {task.sizes}:
    """)
    see(PowerSGD)
    run = {impl: spawn(powersgd_train, n, task=task, impl=impl, steps=steps,
                       name=f"PowerSGD comparison: {label}, {n} ranks").returns
           for impl, label in [("exact", "exact all-reduce (PyTorch DDP)"),
                               ("pytorch", "PyTorch powerSGD_hook, rank 1"),
                               ("ours", "our PowerSGD, rank 1")]}
    fig = powersgd_figure(run)
    figure(fig, caption="held-out loss per step: exact all-reduce, PyTorch's PowerSGD hook, ours")
    table([[impl, r[0]["wire_per_step"], r[0]["wire_per_step"] / run["exact"][0]["wire_per_step"],
            r[0]["curve"][-1][1], len({x["checksum"] for x in r}) == 1] for impl, r in run.items()],
          header=["all-reduce", "bytes written per step (measured)", "relative to exact",
                  "final held-out loss", "replicas identical"],
          caption=f"rank 0, {n} ranks; bytes include the first uncompressed steps and gloo's headers")
    ours_b, theirs_b = run["ours"][0]["wire_per_step"], run["pytorch"][0]["wire_per_step"]
    note(f"""
        Both compressors train like the exact all-reduce on this task, at a fraction of its
        bytes. Ours writes {ours_b / theirs_b:.2f}× the bytes of PyTorch's hook: ours issues
        two all-reduces per matrix and one per vector, each with its own headers, where the
        hook works on DDP's bucket and packs all the bucket's P matrices into one all-reduce,
        all its Q matrices into another, and the uncompressed vectors into a third. The numbers
        sent are the same; the number of messages is not (lecture 02's α per message).
    """)
    see("https://arxiv.org/abs/1905.13727", title="Vogels et al. 2019, PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization")
    see("https://arxiv.org/abs/1901.09847", title="Karimireddy et al. 2019, Error Feedback Fixes SignSGD and other Gradient Compression Schemes")
    see("https://www.microsoft.com/en-us/research/publication/1-bit-stochastic-gradient-descent-and-application-to-data-parallel-distributed-training-of-speech-dnns/",
        title="Seide et al. 2014, 1-Bit Stochastic Gradient Descent and its Application to Data-Parallel Distributed Training of Speech DNNs")
    see("https://arxiv.org/abs/2311.08105", title="Douillard et al. 2023, DiLoCo: Distributed Low-Communication Training of Language Models")


# --- DP and ZeRO's memory and bytes, measured once for the ZeRO, memory and bytes sections -----

def stage_measurements():
    """What each rank held and sent under DP and ZeRO-1/2/3 on the memory model: measured once,
    shown by the ZeRO section's picture and the memory section's tables."""
    n = settings.world_size
    key = (n, settings.quick)
    if key not in _STAGES:
        _STAGES[key] = spawn(measure_stages, n, task=memory_task(),
                             name=f"memory and traffic, {n} ranks").returns
    return _STAGES[key]


_STAGES = {}


def bytes_on_the_wire():
    """Formula, counted and measured bytes per step for DP and ZeRO-1/2/3, from the same run."""
    task = memory_task()
    n = settings.world_size
    psi = param_count(task)
    stages = ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    got = stage_measurements()[0]
    note("## Deep dive: bytes on the wire, formula, counted and measured")
    last = task.sizes[-2] * task.sizes[-1] + task.sizes[-1]
    ring = (n - 1) / n
    theory = {"DP": 2 * ring * psi, "ZeRO-1": 2 * ring * psi, "ZeRO-2": 2 * ring * psi,
              "ZeRO-3": ring * (3 * psi - last)}
    what = {"DP": "all-reduce (= RS + AG)", "ZeRO-1": "reduce-scatter + all-gather",
            "ZeRO-2": "reduce-scatter + all-gather",
            "ZeRO-3": "all-gather fwd + all-gather bwd + reduce-scatter"}
    table([[s, theory[s] * 4, got[s]["bytes_per_step"], got[s]["gloo_per_step"],
            got[s]["wire_per_step"], got[s]["wire_per_step"] / got[s]["bytes_per_step"],
            got[s]["wire_per_step"] / got[s]["gloo_per_step"], got[s]["calls_per_step"], what[s]]
           for s in stages],
          header=["stage", "formula (bytes)", "counted: our calls as rings (NCCL)",
                  "counted: our calls as gloo runs them", "measured: written to sockets",
                  "measured / rings", "measured / gloo count", "calls per step", "collectives"],
          caption=f"bytes sent per rank per step, rank 0, N = {n}, the MLP of the memory section "
                  f"({len(task.sizes) - 1} linear layers, Ψ = {psi:,} fp32 parameters). Formula: a ring sends (N−1)/N "
                  "of a tensor per pass; ≈ 2Ψ·4 bytes for DP/ZeRO-1/2, ≈ 3Ψ·4 for ZeRO-3 (ours "
                  "keeps the last layer gathered from forward to backward: 2L−1 all-gathers, "
                  "not 2L).")
    ring_ratio = {s: got[s]["wire_per_step"] / got[s]["bytes_per_step"] for s in stages}
    gloo_ratio = {s: got[s]["wire_per_step"] / got[s]["gloo_per_step"] for s in stages}
    rs_share = {s: got[s]["gloo_per_step"] / got[s]["bytes_per_step"] for s in stages}
    note(f"""
        Four columns, four different things. The *formula* is the ZeRO paper's accounting;
        *counted as rings* adds up what our `Collectives` wrapper's calls send when each runs
        as a bandwidth-optimal ring (what NCCL does with large messages); *counted as gloo
        runs them* uses gloo's real algorithms instead; *measured* is what this rank's process
        handed to the kernel's socket writes during the training steps
        (`util.measure.bytes_sent`, from Linux's `/proc/self/io`).

        Against the rings, DP's measured bytes are {ring_ratio['DP']:.2f}× the count, but
        ZeRO-1 and ZeRO-2 write {both_ratios(ring_ratio['ZeRO-1'], ring_ratio['ZeRO-2'])},
        ZeRO-3 {ring_ratio['ZeRO-3']:.2f}×. These are not headers, and they do not shrink with
        size: gloo's reduce-scatter is a full all-reduce plus a copy (lecture 02 measured it
        writing an all-reduce's bytes), so reduce-scatter + all-gather costs
        2 + 1 = 3 ring passes instead of 1 + 1 = 2 (gloo count / ring count
        {rs_share['ZeRO-1']:.2f} for ZeRO-1), and ZeRO-3's two all-gathers and one
        reduce-scatter cost 1 + 1 + 2 = 4 instead of 3 ({rs_share['ZeRO-3']:.2f}). Against
        the gloo count, measured is {span_of(gloo_ratio.values())}
        for every stage: what remains is gloo's message headers, the padding of each tensor to
        a multiple of N, and the naive sync's one small all-reduce that agrees on which
        parameters have gradients. With NCCL, whose reduce-scatter is a real ring, ZeRO-1 and
        ZeRO-2 send what DP sends, and ZeRO-3 1.5× that, for holding only 1/N of the
        parameters.
    """)
