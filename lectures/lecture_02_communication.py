"""Communication: collectives, how to measure them, and overlap

Every parallel training scheme in this course is a pattern of communication between ranks. This
lecture runs each collective on real ranks, builds all-reduce from point-to-point messages,
measures bandwidth the way nccl-tests does, fits the α–β cost model, makes a hang on purpose,
and overlaps communication with computation.
"""
import math

import numpy as np
import torch

from util import (cheat, deep_dive, figure, note, plural, published, see, settings, spawn, table,
                  timeline)
from util import try_it_yourself
from util.launch import choose_backend
from util.measure import compare, machine, measure, spreads_overlap, timing_ranks, value_range, with_spread

from exercises import listing as notebook_exercises
from lectures.data_parallel.collectives import (SWEPT, _exchange, _ring_buffer, bandwidths, binomial_broadcast_sends,
                                                bus_bandwidth_factor, crossover_bytes, fit_alpha_beta, optimal_bytes,
                                                ring_all_reduce, sweep, wire_bytes)
from lectures.data_parallel.communication_demos import (COLLECTIVES, MEASURED, RING_VARIANTS, all_reduce_in_two_halves,
                                                        all_reduce_two_ways, async_overlap, released_overlap, copy_time, demo_all_to_all,
                                                        demo_send_recv, race_ring, ring_trace, skip_a_collective, us)
from lectures.data_parallel.communication_deep_dives import (
    alpha_beta_details, finding_the_culprit, overlap_streams, ring_checked, ring_raced, this_machine)
from lectures.data_parallel.overlap import gain_words
from lectures.model.figures import published_figure
from lectures.model.gpu_evidence import H200_ALL_REDUCE
from lectures.data_parallel.figures import (overlap_bars, human_bytes, draw_hierarchy, draw_stages, draw_gallery, draw_ring_trace,
                                            draw_ring_arrows, draw_busbw, draw_wire, draw_alpha_beta, draw_hang)

KB, MB = 1024, 1024 ** 2


# --world-size values its demos accept: send/recv needs a second rank (util.run refuses others)
WORLD_SIZES = (2, 3, 4, 5, 6, 7, 8)


# =========================================================================================
# 1. The hardware hierarchy
# =========================================================================================


def hardware_hierarchy():
    nbytes = (16 if settings.quick else 256) * MB
    t = copy_time(nbytes, repeats=5 if settings.quick else 9)
    bw = nbytes / t.median
    note("## The hardware hierarchy")
    figure(draw_hierarchy(bw / 1e9),
           caption="Each step away from the arithmetic costs bandwidth: an H100 node's levels "
                   "(published figures, not measured here) and this machine's memory copy (measured).")
    note(f"""
        Data lives at several distances from the arithmetic units, and each step outwards is
        larger and slower: from HBM to NVLink to InfiniBand, roughly an order of magnitude in
        bandwidth per hop. That shapes every layout later in the course: the chattiest scheme
        (tensor parallelism: several all-reduces of activations in every layer, on the
        critical path) stays inside a node on NVLink. Data parallelism goes outermost, across
        nodes, not because it moves few bytes (its all-reduce carries the whole gradient: with
        Ψ parameters in bf16 a ring sends about 4Ψ bytes per rank per step) but because it
        talks once per step and that traffic can hide behind backward (lecture 03).

        Measured now, in the lecture process: copying a {human_bytes(nbytes)} buffer in main
        memory runs at **{with_spread(f"{bw / 1e9:.1f} GB/s", f"median of {len(t.samples)} copies after a warm-up, interquartile range {value_range(nbytes / t.q3 / 1e9, nbytes / t.q1 / 1e9, 'GB/s')}")}**. On a CPU-only
        machine every "link" between ranks is this memory: gloo moves data between processes
        through the kernel's loopback TCP, so the bandwidths measured below are a fraction of it.
    """)
    table([
        ["registers", "256 KB per SM (132 SMs)", "next to the ALUs", "H100 whitepaper"],
        ["L1 / shared memory", "up to 256 KB per SM", "on-chip, per SM", "H100 whitepaper"],
        ["L2 cache", "50 MB", "on-chip, shared by all SMs", "H100 whitepaper"],
        ["HBM3", "80 GB", "3.35 TB/s", "H100 datasheet (SXM)"],
        ["NVLink 4 (GPU↔GPU in a node)", "18 links", "900 GB/s total, both directions", "H100 datasheet"],
        ["PCIe Gen5 x16 (GPU↔CPU)", "", "128 GB/s total, both directions", "H100 datasheet"],
        ["InfiniBand NDR (node↔node)", "one 400 Gb/s port per GPU", "50 GB/s per direction", "ConnectX-7 / NDR spec"],
    ], header=["level", "size", "bandwidth", "source"],
       caption="Memory and interconnect hierarchy of an H100 SXM node (published figures, not measured here).")


# =========================================================================================
# 2. The collectives, each on real ranks
# =========================================================================================

def collectives():
    world_size = settings.world_size
    results, said = {}, []
    for name, fn, what, sums in COLLECTIVES:
        run = spawn(fn, world_size, chunk=1, name=f"{name}, {world_size} ranks")
        results[name] = ([r["before"] for r in run.returns], [r["after"] for r in run.returns], sums)
        said.append(f"**{name}**: {what}")
    note("## The eight collectives, and send/recv")
    figure(draw_gallery(results),
           caption="Drawn from the tensors the ranks returned. " + "; ".join(said) + ". Colour: the rank "
                   "a value came from; grey and bold: a sum over ranks; hatched: a reduce's scratch "
                   "buffers, which only rank 0 may read.")
    note(f"""
        A *collective* is an operation that every rank of a group calls together. Each panel
        above ran on {world_size} real ranks (processes; gloo on CPU, NCCL on GPUs). Rank $r$
        starts with values $10r + i$, so every value tells where it came from (23 is element 3
        of rank 2). The reductions (reduce, reduce-scatter, all-reduce) sum by default; `op=`
        picks `MAX`, `MIN`, `PRODUCT` or `AVG` (NCCL). Send and receive are not collectives:
        only the two ranks involved take part, and a send must meet a matching receive.

        Two libraries implement these calls under `torch.distributed`: **gloo** (CPU tensors,
        TCP between processes; what this page uses without GPUs) and **NCCL** (GPU tensors over
        NVLink, PCIe and InfiniBand). NCCL chooses an algorithm per call from the topology and
        message size: a *ring* (bandwidth-optimal, latency grows with the number of ranks) or a
        *tree* (logarithmic latency, for small messages and many nodes).
    """)
    see(demo_all_to_all)
    see(demo_send_recv)


# =========================================================================================
# 3. All-reduce = reduce-scatter + all-gather
# =========================================================================================


def all_reduce_decomposed():
    world_size = settings.world_size
    length = world_size * (1000 if settings.quick else 100_000)
    run = spawn(all_reduce_in_two_halves, world_size, name=f"all-reduce in two halves, {world_size} ranks")
    note("## All-reduce = reduce-scatter + all-gather")
    figure(draw_stages("all-reduce = reduce-scatter + all-gather",
                       [("before", [r["before"] for r in run.returns], "none"),
                        ("after reduce-scatter", [r["scattered"] for r in run.returns], "mine"),
                        ("after all-gather", [r["gathered"] for r in run.returns], "gathered")],
                       stacked=True),
           caption="Top: each rank's input, coloured by rank. Middle: after the reduce-scatter, "
                   "rank r holds the sum over all ranks of piece r only (bold, in rank r's colour). "
                   "Bottom: the all-gather copies every rank's finished piece to everyone; every "
                   "row now holds the all-reduce's result.")
    note(f"""
        After a reduce-scatter every rank owns the finished sum of one piece; an all-gather then
        hands every piece to every rank. That is an all-reduce, and it is how bandwidth-optimal
        all-reduce algorithms (and ZeRO/FSDP, later) work. Checked on {world_size} ranks with
        {length:,} elements each, against `dist.all_reduce`:
    """)
    rows = []
    for integer in (True, False):
        run = spawn(all_reduce_two_ways, world_size, length=length, integer=integer,
                    name=("integer data" if integer else "random floats")
                         + ": all-reduce vs reduce-scatter + all-gather")
        reference = sum(r["input"].double() for r in run.returns)
        rows.append(["integers" if integer else "random floats", world_size,
                     max((r["direct"] - r["composed"]).abs().max().item() for r in run.returns),
                     max((r["composed"].double() - reference).abs().max().item() for r in run.returns)])
    table(rows, header=["data", "ranks", "max |all-reduce − (reduce-scatter + all-gather)|, any rank",
                        "max |composed − float64 sum|, any rank"],
          caption="Both routes give the same sum. With integer-valued data they agree exactly; "
                  "with random floats any difference is rounding from a different order of additions.")
    see(all_reduce_in_two_halves)
    see(all_reduce_two_ways)


# =========================================================================================
# 4. Ring all-reduce from send and receive
# =========================================================================================


def ring_step_by_step():
    world_size = settings.world_size
    run = spawn(ring_trace, world_size, name=f"ring trace, one element per chunk, {world_size} ranks")
    note("## Ring all-reduce from send and receive")
    figure(draw_ring_arrows(run.returns),
           caption=f"The messages of the ring on {world_size} ranks, step by step, read from the "
                   f"recorded trace. Each arrow is one send to the right neighbour; its label is the "
                   f"chunk and the value it carried (rank r contributes 2ʳ, so the value's binary "
                   f"digits say whose data it already contains). In the reduce-scatter the values "
                   f"grow as partial sums travel; in the all-gather every chunk carries the full "
                   f"sum, {2 ** world_size - 1}.")
    note("""
        Arrange the $n$ ranks in a ring and cut the buffer into $n$ chunks. In the
        **reduce-scatter phase** ($n-1$ steps) every rank sends one chunk to its right
        neighbour and adds the chunk arriving from its left into its own copy; afterwards rank
        $r$ holds the complete sum of chunk $r+1$. In the **all-gather phase** ($n-1$ more
        steps) the finished chunks travel around the ring once more. Each rank sends
        $2(n-1)$ chunks of size $S/n$, i.e. $2(n-1)/n \\cdot S$ bytes.
    """)
    figure(draw_ring_trace(run.returns),
           caption=f"The ring on {world_size} ranks, recorded step by step. Rank r contributes "
                   f"2ʳ to every chunk, so a value's binary digits say whose data it already "
                   f"contains ({2 ** world_size - 1} = everyone's). Red: the chunk received in that step.")
    note("""
        **Why no algorithm sends less (a sketch).** Take one element. Its $n$ inputs sit on $n$ different
        ranks, and a message carries (a partial sum of) it from one rank to one other. Adding
        $n$ values held in $n$ places into one sum needs at least $n-1$ such transfers (each
        transfer merges at most two partial sums), and getting the result to the $n-1$ ranks
        that did not compute it needs at least $n-1$ more (each transfer informs one rank).
        So every element costs at least $2(n-1)$ transfers, and the whole buffer at least
        $2(n-1) \\cdot S$ bytes summed over all ranks; shared out among $n$ ranks, the
        busiest rank sends at least $2(n-1)/n \\cdot S$. This counting only sketches the idea
        (it assumes, for one, that a transfer carries one partial sum of an element); the bound
        itself, for any all-reduce, is proved by Patarasuk & Yuan (2009). The ring meets it, with every rank equally busy. *That* is
        why the ring is called bandwidth-optimal; that the volume barely grows with $n$ is a
        consequence, not the reason. Its weakness is latency: $2(n-1)$ sequential
        steps. Lengths that are not a multiple
        of $n$ give chunks whose sizes differ by one (some may even be empty); every rank
        computes the same split, so sender and receiver always agree. A pipelined variant,
        both rings checked against `dist.all_reduce` and raced against it, waits in the
        appendix.
    """)
    see(ring_all_reduce, lesson=True)
    see(_ring_buffer)
    see(_exchange)


# =========================================================================================
# 5. Bandwidth, the nccl-tests way
# =========================================================================================

def sweep_sizes():
    if device_is_gpu():
        return [4 * KB * 4 ** k for k in range(9 if settings.quick else 12)]    # up to 256 MB / 16 GB
    return [4 * KB * 4 ** k for k in range(4 if settings.quick else 8)]         # up to 256 KB / 64 MB


def device_is_gpu():
    return torch.cuda.is_available() and (settings.backend in (None, "nccl"))


def alpha_beta_sizes():
    """The all-reduce sizes of the α–β fit: every power of two in the sweep's range."""
    if device_is_gpu():
        return [4 * KB * 2 ** k for k in range(12 if settings.quick else 19)]
    return [4 * KB * 2 ** k for k in range(11 if settings.quick else 15)]     # up to 4 MB / 64 MB


def wire_verdict(wire, nbytes, n):
    """What the bytes on the wire say about gloo's collectives (`wire`: collective -> bytes the
    busiest rank wrote for one call on an `nbytes` buffer, `n` ranks), in the page's words."""
    ratio = {k: v / optimal_bytes(k, nbytes, n) for k, v in wire.items() if v}
    said = []
    if "reduce_scatter" in ratio and "all_reduce" in ratio:
        rs, ar = wire["reduce_scatter"], wire["all_reduce"]
        same = abs(rs / ar - 1) < 0.01
        said.append(
            f"gloo's reduce-scatter wrote **{ratio['reduce_scatter']:.2f}×** the bytes a "
            f"bandwidth-optimal reduce-scatter sends, "
            + ((f"the same as its all-reduce: {ar:,} bytes each" if rs == ar else
                f"the same as its all-reduce ({rs:,} and {ar:,} bytes)") if same else
               f"{rs / ar:.2f}× its all-reduce's ({rs:,} vs {ar:,} bytes)")
            + ". That is how gloo implements it: its reduce-scatter is a clone of the input, "
              "a full all-reduce of the clone and a copy of this rank's chunk "
              "(`ProcessGroupGloo::reduce_scatter_tensor_coalesced` in PyTorch's source). Its busbw "
              f"divides an all-reduce's work by the reduce-scatter factor $(n-1)/n$, so its curve "
              f"sits low because it moved {ratio['reduce_scatter']:.2f}× the bytes the formula "
              "credits, not because adding costs time. NCCL runs a real ring reduce-scatter: "
              "$n-1$ steps, $(n-1)/n \\cdot S$ bytes per rank, half an all-reduce.")
    if ratio.get("broadcast", 1) > 1.2:
        tree = binomial_broadcast_sends(0, n)
        how = (f"a binomial tree: in each of $\\lceil \\log_2 n \\rceil = {tree}$ rounds every rank "
               "holding the buffer sends it to one that does not, so the root writes it "
               f"{tree} times" if abs(ratio["broadcast"] / tree - 1) < 0.02 else
               "not a pipelined ring")
        said.append(f"gloo's broadcast is {how}: the busiest rank wrote {ratio['broadcast']:.2f}× the "
                    "$S$ a pipelined ring (NCCL's) sends per rank, while the ranks at the tree's "
                    "leaves send nothing, so its busbw undercounts what the root moved.")
    fine = [k.replace("_", "-") for k in ratio if k not in ("reduce_scatter", "broadcast")
            and abs(ratio[k] - 1) < 0.05]
    if fine:
        said.append(f"{', '.join(fine)} wrote within 5% of the optimal bytes (the rest is "
                    "gloo's message headers).")
    return " ".join(said)


def pub_at(pub, x):
    """A published line's value at `x` (one of its points)."""
    return dict(next(iter(pub.series.values())))[x]


def bandwidth():
    ranks = timing_ranks(settings.world_size)
    sizes = sweep_sizes()
    warmup, iters = (1, 5) if settings.quick else (2, 9)
    plan = {name: sizes for name in SWEPT}
    plan["all_reduce"] = sorted(set(sizes) | set(alpha_beta_sizes()))
    run = spawn(sweep, ranks, collectives=SWEPT, sizes=plan, warmup=warmup, iters=iters,
                name=f"busbw sweep, 5 collectives x {len(sizes)} sizes, {ranks} ranks")
    timings = run.returns[0]
    for nbytes, t in zip(plan["all_reduce"], timings[SWEPT.index("all_reduce")]):
        MEASURED["sweep", ranks, settings.quick, nbytes] = t
    note("## Measuring bandwidth the nccl-tests way")
    figure(draw_busbw(SWEPT, [plan[n] for n in SWEPT], timings, ranks),
           caption=f"Bus bandwidth of each collective as the message grows: median and "
                   f"interquartile range of {iters} single calls, {machine(ranks)}.")
    note(f"""
        [nccl-tests](https://github.com/NVIDIA/nccl-tests) is how everyone measures collectives.
        For each message size $S$ it reports two numbers:

        $$\\mathrm{{algbw}} = \\frac{{S}}{{t}}, \\qquad \\mathrm{{busbw}} = \\mathrm{{algbw}} \\cdot f(n)$$

        *algbw* is what the application sees. *busbw* corrects for how much data each rank
        really has to move, so that it can be compared with the speed of the hardware's links:
        $f = 2(n-1)/n$ for all-reduce (the ring above), $(n-1)/n$ for all-gather,
        reduce-scatter and all-to-all, and $1$ for broadcast and reduce. For all-gather, $S$ is
        the size of the gathered *output*; for reduce-scatter, of the *input*.

        We take nccl-tests' definitions but not its clock. nccl-tests runs a few warm-up calls,
        then times a batch of back-to-back iterations (20 by default) and divides by their
        number: one *mean* per size, in which consecutive calls may overlap their start-up costs.
        Here each call is timed *alone*: a barrier, one call, the slowest rank's time (a
        collective is done when its last rank is), repeated {iters} times after
        {plural(warmup, 'warm-up call')}; we report the median and the interquartile range. Single calls include
        the full latency of every call, so our small-message times are, if anything, higher
        than nccl-tests' would be. {len(sizes)} sizes from {human_bytes(sizes[0])} to
        {human_bytes(sizes[-1])}, {machine(ranks)}; all-reduce also at every power of two in
        between, for the α–β fit of the next section.
    """)
    rows = []
    for name, ts in zip(SWEPT, timings):
        for nbytes, t in zip(plan[name], ts):
            if nbytes in sizes:
                alg, bus = bandwidths(name, nbytes, t.median, ranks)
                rows.append([name, human_bytes(nbytes), us(t), alg / 1e9, bus / 1e9])
    table(rows, header=["collective", "size", "time µs, median (IQR)", "algbw (GB/s)", "busbw (GB/s)"],
          caption="The sweep in nccl-tests' units (slowest rank per call; medians).")
    # the busbw each curve reaches at the largest size the table shows (all-reduce's own sweep
    # goes further, for the fit, but the sentence reads the table)
    last = {name: bandwidths(name, sizes[-1], ts[plan[name].index(sizes[-1])].median, ranks)[1] / 1e9
            for name, ts in zip(SWEPT, timings)}
    best, worst = max(last, key=last.get), min(last, key=last.get)
    same_call = [nb for nb in plan["all_reduce"] if ("race", ranks, settings.quick, nb) in MEASURED]
    twice = ""
    if same_call:
        nb = same_call[-1]
        a, b = MEASURED['race', ranks, settings.quick, nb], MEASURED['sweep', ranks, settings.quick, nb]
        agree = ("The page reports one call, measured twice, consistently." if spreads_overlap(a, b)
                 else "Nothing differs but the context: in the race each call followed one of our "
                      "rings, here another all-reduce, on cores shared by every rank. That gap is "
                      "the size of this machine's noise; differences between variants smaller than "
                      "it say nothing.")
        twice = f"""
        The built-in all-reduce of {human_bytes(nb)} was also timed in the race against our
        rings (appendix); the two measurements of the same call: {compare(
            MEASURED['race', ranks, settings.quick, nb], MEASURED['sweep', ranks, settings.quick, nb],
            'in the race', 'in this sweep')}. {agree}
        """
    note(f"""
        Small messages reach only a sliver of the peak: their time is fixed per-call cost
        (latency). Even at the largest size, {human_bytes(sizes[-1])}, the collectives end
        {with_spread(f"{last[best] / last[worst]:.1f}× apart", f"{worst.replace('_', '-')} {last[worst]:.3g} GB/s, {best.replace('_', '-')} {last[best]:.3g} GB/s")}:
        {worst.replace('_', '-')} slowest, {best.replace('_', '-')} fastest.
        {twice}
        On a GPU node the same sweep climbs two orders of magnitude higher, and the shape is
        the lesson. Published below for 8 H200s on NVSwitch, all-reduce's busbw rises from
        {pub_at(H200_ALL_REDUCE, 2 ** 20):.0f} GB/s at 1 MiB to {pub_at(H200_ALL_REDUCE, 2 ** 34):.0f} GB/s
        at 16 GiB. This machine's all-reduce reached {last['all_reduce']:.2f} GB/s at
        {human_bytes(sizes[-1])}. Latency costs a GPU too: a
        4 MiB gradient bucket reaches {pub_at(H200_ALL_REDUCE, 2 ** 22) / pub_at(H200_ALL_REDUCE, 2 ** 34):.0%}
        of the bandwidth of the largest payload.
    """)
    figure(published_figure(H200_ALL_REDUCE, mark=(last["all_reduce"], f"this machine, all-reduce at "
                                                                       f"{human_bytes(sizes[-1])}")),
           caption=H200_ALL_REDUCE.caption("NCCL all-reduce bus bandwidth against payload on one 8× H200 node "
                                           "(above 450 GB/s, the NVLink spec, NCCL reduces inside the NVSwitch)."))
    note(f"""
        On a GPU cluster, busbw is built so that every collective's curve approaches one
        ceiling, the bandwidth of the slowest link, because NCCL implements each of them with a
        bandwidth-optimal algorithm whose only cost at large sizes is moving bytes — as long as
        the ranks do the additions. With in-network reduction (NVLink SHARP in an H100's
        NVSwitch, InfiniBand SHARP), which NCCL uses where the hardware has it, the switch adds:
        each GPU sends about S, not 2(n−1)/n·S, and an all-reduce's busbw can exceed the link. Here there
        is no separate link (gloo "sends" by copying through the kernel's loopback TCP, on the
        same cores that run the ranks), and gloo picks its own algorithm per collective. Before
        explaining a curve, count what was really sent: one call of each collective, with the
        bytes each rank wrote to its sockets (`util.measure.bytes_sent`, from Linux's
        `/proc/self/io`) beside what a bandwidth-optimal algorithm sends.
    """)
    cheat("bus bandwidth", "$\\mathrm{busbw} = \\frac{S}{t} \\cdot \\frac{2(n-1)}{n}$ for all-reduce (nccl-tests)",
          bandwidths("all_reduce", plan["all_reduce"][-1], timings[SWEPT.index("all_reduce")][-1].median, ranks)[1] / 1e9,
          "GB/s", what=f"all-reduce of {human_bytes(plan['all_reduce'][-1])}, {ranks} ranks, median of {iters} calls")
    nbytes = min(sizes[-1], 4 * MB)
    run = spawn(wire_bytes, ranks, collectives=SWEPT, nbytes=nbytes,
                name=f"bytes on the wire, one call of each collective, {human_bytes(nbytes)}, {ranks} ranks")
    if any(run.returns[0][k] is None for k in SWEPT):
        note("*This kernel does not count the bytes a process writes (`/proc/self/io`), so the "
             "comparison is skipped on this build.*")
        return
    wire = {k: max(r[k] for r in run.returns) for k in SWEPT}
    figure(draw_wire(wire, nbytes, ranks),
           caption="The bytes of the table: what each collective should send (outline) and what "
                   "gloo's busiest rank wrote (filled).")
    table([[k.replace("_", "-"), optimal_bytes(k, nbytes, ranks), wire[k],
            wire[k] / optimal_bytes(k, nbytes, ranks)] for k in SWEPT],
          header=["collective", "bandwidth-optimal bytes per rank (NCCL's ring)",
                  "written to sockets, busiest rank (measured)", "measured / optimal"],
          caption=f"One call on a {human_bytes(nbytes)} buffer (nccl-tests' S), {ranks} ranks, "
                  f"{choose_backend(ranks)}; optimal = $f(n) \\cdot S$.")
    note(wire_verdict(wire, nbytes, ranks) + " On a DGX H100 the common ceiling of the ring "
         "algorithms would be NVLink's ~450 GB/s per direction; with NVLink SHARP an all-reduce's "
         "busbw goes above it.")
    cheat("ring all-reduce bytes per rank", "$2\\,\\frac{n-1}{n}\\,S$ sent by each rank (the least when ranks do the additions)",
          wire["all_reduce"] / nbytes, "× S",
          what=f"written to sockets by the busiest rank, one all-reduce of S = {human_bytes(nbytes)}, {ranks} ranks, gloo")
    cheat("all-gather bytes per rank", "$\\frac{n-1}{n}\\,S$ per rank, $S$ the gathered output",
          wire["all_gather"] / nbytes, "× S",
          what=f"written to sockets by the busiest rank, S = {human_bytes(nbytes)}, {ranks} ranks, gloo")
    see(bus_bandwidth_factor)
    see(measure)
    see(wire_bytes)


# =========================================================================================
# 6. The alpha-beta model
# =========================================================================================


def alpha_beta_verdict(sizes, times, alpha, beta):
    """What the fitted α and β say, in words that stay inside the measured sizes: S* = αβ is
    reported only where it falls between the smallest and largest size measured, and β beside
    the highest algorithm bandwidth any measured size reached (β is a slope, reached only in
    the limit of large messages)."""
    sizes, times = np.asarray(sizes, dtype=float), np.asarray(times, dtype=float)
    algbw = sizes / times
    top = int(algbw.argmax())
    reached = (f"The highest algorithm bandwidth measured is {algbw[top] / 1e9:.3f} GB/s "
               f"at {human_bytes(sizes[top])}")
    if not math.isfinite(beta):
        return ("The times did not grow with size over this range, so the fit found no bandwidth "
                "term: every size measured here is in the latency regime.")
    cross = crossover_bytes(alpha, beta)
    if cross > sizes[-1]:
        return (f"The two terms would be equal only at $S^* = \\alpha\\beta$ ≈ {human_bytes(cross)}, "
                f"beyond the largest size measured ({human_bytes(sizes[-1])}): no bandwidth regime "
                f"was reached here, and β extrapolates the slope of the times. {reached}; even "
                f"the largest size spent about {100 * alpha / times[-1]:.0f}% of its time on the "
                "fixed cost, by the model.")
    if cross < sizes[0]:
        return (f"$S^* = \\alpha\\beta$ ≈ {human_bytes(cross)} lies below the smallest size measured: "
                f"every size here is in the bandwidth regime. {reached}.")
    below = [s for s in sizes if s < cross]
    return (f"The two terms are equal at $S^* = \\alpha\\beta$ ≈ **{human_bytes(cross)}**, inside "
            "the measured range. Below it the fixed cost is more than half of the modelled time "
            f"(here {human_bytes(below[0])} to {human_bytes(below[-1])}), above it the bytes are. "
            f"{reached}, {'below' if algbw[top] < beta else 'above'} β ({beta / 1e9:.3f} GB/s).")


def alpha_beta_fit():
    """The α–β section of the main path; returns what `alpha_beta_details` shows."""
    ranks = timing_ranks(settings.world_size)
    sizes = alpha_beta_sizes()
    warmup, iters = (1, 5) if settings.quick else (2, 9)
    keys = [("sweep", ranks, settings.quick, nb) for nb in sizes]
    reused = all(k in MEASURED for k in keys)
    if reused:
        timings = [MEASURED[k] for k in keys]
    else:       # this section on its own (a notebook cell): measure
        run = spawn(sweep, ranks, collectives=["all_reduce"], sizes=sizes, warmup=warmup,
                    iters=iters, name=f"all-reduce sweep for the α–β fit, {len(sizes)} sizes, {ranks} ranks")
        timings = run.returns[0][0]
    times = np.array([t.median for t in timings])
    alpha, beta = fit_alpha_beta(sizes, times)
    model = alpha + np.array(sizes) / beta
    rel = np.abs(model / times - 1)
    # the two regimes on their own: latency from the smaller half, bandwidth from the larger
    half = len(sizes) // 2
    small_alpha, _ = fit_alpha_beta(sizes[:half], times[:half])
    large_alpha, large_beta = fit_alpha_beta(sizes[half:], times[half:])
    misfit = rel[-1] > 0.15 or rel[0] > 0.15
    note("## The α–β cost model")
    figure(draw_alpha_beta(sizes, timings, alpha, beta,
                           regimes=(small_alpha, large_alpha, large_beta) if misfit else None),
           caption=f"All-reduce time and the fitted α–β model, {machine(ranks)}.")
    note("""
        A message of $S$ bytes costs a fixed start-up time plus its size over a bandwidth:

        $$t(S) \\approx \\alpha + \\frac{S}{\\beta}$$

        $\\alpha$ (latency) collects everything that does not depend on size: the call into the
        library, synchronising with the other ranks, the network's round trip. $\\beta$ is the
        bandwidth the collective achieves on large messages. The two terms are equal at
        $S^* = \\alpha\\beta$: below it latency dominates and sending more data is almost
        free, above it time grows linearly with size. We fit both to the all-reduce timings of
        the sweep above""" + (" (measured once, read twice)" if reused else "") + """, minimising
        relative error so small and large messages count alike.
    """)
    verdict = alpha_beta_verdict(sizes, times, alpha, beta)
    note(f"""
        The fit gives a latency of **α ≈ {alpha * 1e6:.0f} µs** and a bandwidth of
        **β ≈ {beta / 1e9:.2f} GB/s** (algorithm bandwidth of the whole all-reduce, not of one
        link). {verdict} That is why data-parallel training packs gradients into buckets of
        megabytes (next lecture) instead of sending each small tensor on its own. The α here
        is mostly software (Python, gloo's TCP round trips through the kernel); on NVLink with
        NCCL it is a few microseconds.
    """)
    cheat("all-reduce latency α", "$t(S) \\approx \\alpha + S/\\beta$: the fixed cost per call",
          alpha * 1e6, "µs", what=f"fitted to the all-reduce sweep, {ranks} ranks, {choose_backend(ranks)}")
    cheat("all-reduce bandwidth β", "$t(S) \\approx \\alpha + S/\\beta$: $\\beta$ is the slope's inverse",
          beta / 1e9, "GB/s", what=f"fitted to the all-reduce sweep, {ranks} ranks, {choose_backend(ranks)}")
    see(fit_alpha_beta)
    return {"sizes": sizes, "timings": timings, "times": times, "model": model, "rel": rel,
            "small_alpha": small_alpha, "large_beta": large_beta, "misfit": misfit}


# =========================================================================================
# 7. Hangs and timeouts
# =========================================================================================


def hang_demo():
    world_size = settings.world_size
    timeout = 3
    note("## Hangs and timeouts")
    note(f"""
        A collective completes only when *every* rank of the group has called it, and ranks
        must call collectives in the same order with matching shapes. If one rank skips a call
        (a data-dependent `if`, an early `return`, a different number of batches), the others
        wait for it forever: the job hangs with no error and full GPUs. The process group's
        `timeout` turns that hang into an error. Below, the last rank skips an all-reduce and
        the others give up after {timeout} seconds (this failure is the lesson, and expected;
        a rank may instead report that a peer closed the connection, because a rank that gave
        up closes its links). In a real job, `TORCH_DISTRIBUTED_DEBUG=DETAIL`, `NCCL_DEBUG=INFO`
        and the flight recorder name the rank that fell behind. Worse than a hang: ranks that
        pass tensors of different shapes or dtypes but the same number of bytes (float32 (8,)
        on one, float64 (4,) on another) get no error at all, from `dist.all_reduce` or from
        the course's rings, only numbers that mean nothing; `TORCH_DISTRIBUTED_DEBUG=DETAIL`
        checks shapes and dtypes across ranks before every collective.
    """)
    run = spawn(skip_a_collective, world_size, expect_error=True, timeout=timeout,
                name=f"hang: the last rank skips an all-reduce, {timeout} s timeout")
    waited = {}
    for r in run.records:
        if r.get("kind") == "output" and r["text"].strip().startswith("waited"):
            waited[r.get("rank")] = float(r["text"].split()[1])
    figure(draw_hang(waited, world_size, timeout),
           caption=f"The demo above, read from each rank's own output: the last rank skipped the "
                   f"all-reduce, and {plural(len(waited), 'rank')} waited in it until the {timeout} s timeout.")
    see(skip_a_collective)


# =========================================================================================
# 8. Overlap
# =========================================================================================


def overlap_paid(t):
    """Overlapped beat sequential, and the parts timed alone, clear of the noise: 'in part', or
    'fully' where it hid all of the shorter part; None where it did not pay."""
    ovl = t["overlapped"]
    if not (ovl.q3 < t["sequential"].q1 and ovl.q3 < t["compute"].q1 + t["all-reduce"].q1):
        return None
    parts = t["compute"].median + t["all-reduce"].median
    return "fully" if parts - ovl.median >= min(t["compute"].median, t["all-reduce"].median) else "in part"


def overlap_verdict(t):
    """The overlap demo's result in words, from its timings (`t`: compute, all-reduce,
    sequential, overlapped): util.measure.compare decides whether overlapping was faster,
    slower, or not measurably different."""
    seq, ovl = t["sequential"], t["overlapped"]
    said = "Overlapped against sequential: " + compare(ovl, seq, "overlapped", "sequential") + "."
    ideal = max(t["compute"].median, t["all-reduce"].median)
    shorter = min(t["compute"].median, t["all-reduce"].median)
    if ovl.q3 < seq.q1:
        # measured against the parts timed alone: the sequential run can pay more than its parts
        # (a loaded machine), and that excess is no communication hidden
        parts = t["compute"].median + t["all-reduce"].median
        paid = overlap_paid(t)
        said += f" Perfect overlap would take the longer of the two alone, {ideal * 1e3:.3g} ms. "
        if not paid:     # no faster than the parts, clear of the noise: nothing hidden to count
            said += (f"But compute and all-reduce timed alone add up to {parts * 1e3:.3g} ms, no measurably "
                     "more than the overlapped run: what it saved is the sequential run's excess over its "
                     "parts, not communication hidden.")
        else:
            said += (f"Against compute and all-reduce timed alone ({parts * 1e3:.3g} ms together), the "
                     + ("overlap hid all of the shorter one." if paid == "fully" else
                        f"overlap hid about {100 * (parts - ovl.median) / shorter:.0f}% of the shorter one."))
    else:
        said += (f" Perfect overlap would take {ideal * 1e3:.3g} ms (the longer of the two alone): "
                 "starting the all-reduce early gained no measurable time here.")
    return said


def overlap_async():
    ranks = timing_ranks(settings.world_size)
    numel = (1 * MB if settings.quick else 8 * MB) // 4
    matmul_n, matmuls = (128, 20) if settings.quick else (256, 40)
    reps = 5 if settings.quick else 9
    note("## Overlapping communication with computation")
    run = spawn(async_overlap, ranks, numel=numel, matmul_n=matmul_n, matmuls=matmuls, reps=reps,
                name=f"overlap: compute with an async all-reduce, {ranks} ranks")
    t = run.returns[0]
    freed = spawn(released_overlap, ranks, numel=numel, reps=reps,
                  name=f"overlap: a stand-in that releases the core, with an async all-reduce, {ranks} ranks")
    r = freed.returns[0]
    figure(timeline(freed.spans, title=f"compute stand-in (core released): sequential, then overlapped"),
           caption="Measured spans of one traced repetition on every rank, with the compute replaced by a timed "
                   "wait at least as long as the all-reduce: first one after the other, then with the all-reduce in flight "
                   "during the wait.")
    note(f"""
        Communication that waits for computation, and computation that waits for
        communication, both waste the hardware. Every collective can return immediately with a work handle
        instead of blocking; `handle.wait()` blocks until it is done (on GPUs: makes the current
        stream wait). Between the two, the rank is free to compute — as long as that
        computation does not touch the buffer being reduced. Here each of {ranks} ranks
        all-reduces a buffer of {human_bytes(numel * 4)} and runs {matmuls} {matmul_n}×{matmul_n}
        matmuls, first one after the other, then with the all-reduce started before the
        matmuls. Each variant is timed {reps} times after a warm-up (barrier before each,
        slowest rank). The timeline above is one extra repetition of the same experiment with the
        matmuls replaced by a stand-in (below), every span recorded; the async all-reduce's bar
        ends when its completion callback fired.
    """)
    table([[k, t[k].ms()] for k in ("compute", "all-reduce", "sequential", "overlapped")],
          header=["", "time, median (IQR)"],
          caption=f"real compute: {reps} repetitions each, slowest rank, {machine(ranks)}.")
    figure(overlap_bars({"real compute (matmuls)": t, "compute stand-in (core released)": r}),
           caption="Medians of the two runs (bars: interquartile range). Red: the model's overlapped step, "
                   "the longer of compute and all-reduce (the stand-in run only; the matmul run's stretch "
                   "under load is what the model leaves out).")
    note(f"""
        {overlap_verdict(t)} What limits it here: gloo moves the bytes with CPU threads (copies
        into and out of loopback sockets, and the additions of the reduction), and those threads
        need the same cores as the matmuls, so "at once" is partly "taking turns".

        **Release the core, and overlap shows.** Replace the matmuls by a stand-in that keeps the
        rank busy at least as long as the all-reduce takes but leaves its core free (a timed wait,
        `release_core`: lecture 05's sleep mode uses the same idea), as a GPU's kernels leave
        NCCL's transfers alone. {gain_words(r)}; perfect overlap takes the longer of the two,
        $\\max(\\text{{compute}}, \\text{{communication}})$ instead of their sum. The timeline
        above is that run: the all-reduce's bar lies under the wait. On a GPU,
        compute runs on the SMs while NCCL's transfers use NVLink/the network and a few SMs of
        their own, so overlap comes much closer to the ideal. Data-parallel training uses
        exactly this: it starts each gradient bucket's all-reduce as soon as backward has
        produced it (lecture 03). {f"Here it paid off {overlap_paid(t)}; on GPUs" if overlap_paid(t)
        else "This CPU cannot show it pay off, because gloo's transfers and the matmuls share the same cores; on GPUs"}
        that overlap, with bucketing, is what makes data parallelism scale:
    """)
    published("""
        PyTorch's DDP, which buckets gradients and overlaps their all-reduce with the backward
        (and can skip synchronisation), *"when configured appropriately, [...] attains
        near-linear scalability using 256 GPUs"*.
    """, "https://arxiv.org/abs/2006.15704",
        "Li et al. 2020, PyTorch Distributed: Experiences on Accelerating Data Parallel Training, PVLDB 13(12)")
    see(async_overlap)


# =========================================================================================
# 9. Further reading
# =========================================================================================

def further_reading():
    note("## Further reading")
    see("https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/index.html",
        title="NCCL User Guide (collectives, environment variables such as NCCL_DEBUG)")
    see("https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md",
        title="nccl-tests: PERFORMANCE.md — algbw, busbw and the correction factors")
    see("https://pytorch.org/docs/stable/distributed.html",
        title="PyTorch: torch.distributed (collectives, async_op, TORCH_DISTRIBUTED_DEBUG)")
    see("https://www.nvidia.com/en-us/data-center/h100/",
        title="NVIDIA H100 Tensor Core GPU datasheet (HBM3, NVLink, PCIe figures)")
    see("https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper",
        title="NVIDIA H100 Tensor Core GPU Architecture whitepaper (SM, L1/shared, L2)")
    see("https://www.nvidia.com/en-us/networking/infiniband-adapters/",
        title="NVIDIA ConnectX-7 InfiniBand adapters (NDR 400 Gb/s)")
    see("https://www.cs.fsu.edu/~xyuan/paper/09jpdc.pdf",
        title="Patarasuk & Yuan (2009), Bandwidth optimal all-reduce algorithms for clusters of workstations")
    see("https://doi.org/10.1177/1094342005051521",
        title="Thakur, Rabenseifner & Gropp (2005), Optimization of collective communication operations in MPICH")
    see("https://arxiv.org/abs/1802.05799",
        title="Sergeev & Del Balso (2018), Horovod: fast and easy distributed deep learning (ring all-reduce in practice)")
    see("https://huggingface.co/spaces/nanotron/ultrascale-playbook",
        title="The Ultra-Scale Playbook: training LLMs on GPU clusters (appendix on collectives)")


def what_to_remember():
    note("""
        ## What to remember
        - All-reduce = reduce-scatter + all-gather; ZeRO and FSDP use the two halves apart.
        - The ring sends $2(n-1)/n \\cdot S$ bytes per rank, the least any all-reduce can send
          when the ranks do the additions: each element's $n$ inputs need $n-1$ transfers to
          combine and $n-1$ to spread (a switch that adds, NVLink or InfiniBand SHARP, needs ~S).
        - Measure like nccl-tests: algbw $= S/t$, busbw $=$ algbw $\\cdot f(n)$; compare busbw
          with the slowest link. Count the bytes on the wire before you explain a curve.
        - gloo's reduce-scatter is a full all-reduce plus a copy: it writes all-reduce's bytes.
          NCCL's sends $(n-1)/n \\cdot S$.
        - $t \\approx \\alpha + S/\\beta$: small messages cost latency, so gradients travel in
          buckets of megabytes; one line rarely fits every size.
        - Every rank must call the same collectives in the same order, or the job hangs until
          the timeout.
        - `async_op=True` + `wait()` lets communication run under computation.

        The companion notebook, `lectures/notebooks/lecture_02_communication.ipynb`, runs
        every section of this page cell by cell, with its knobs at the top.
    """)


# =========================================================================================

def main():
    try_it_yourself(notebook_exercises("lecture_02_communication"))   # its notebook's exercises, for the page
    note("""
        **What you will learn.** What each collective does (run on real ranks, drawn from the
        real tensors); why all-reduce is a reduce-scatter followed by an all-gather, and how a
        ring builds it from messages between neighbours with the fewest bytes any algorithm
        can send; how to measure collectives the way NCCL's own benchmarks do (and what the
        bytes on the wire say about gloo); the α–β model of their cost and where it stops
        fitting; what happens when ranks disagree; and how to hide communication behind
        computation.

        **What you need.** Lecture 01 (a training step, and what its gradients weigh);
        PyTorch tensors (`view`, `chunk`, in-place ops); and the primer on the index page:
        what a rank, a world size and a process group are, and that every rank runs the same
        function (SPMD).
    """)
    hardware_hierarchy()    # each hop outwards costs an order of magnitude in bandwidth
    with deep_dive("The build machine's topology", "what `nvidia-smi topo -m` or `lscpu` says about the machine that built this page"):
        this_machine()
    collectives()           # the eight collectives and send/recv, on real ranks
    all_reduce_decomposed()  # the two halves ZeRO and FSDP use apart
    ring_step_by_step()     # all-reduce from messages between neighbours
    with deep_dive("A pipelined ring, checked and raced", "both hand-written rings against dist.all_reduce: "
                   "awkward lengths, and how fast they are"):
        ring_checked()
        ring_raced()
    bandwidth()             # algbw and busbw, and the bytes really on the wire
    fit = alpha_beta_fit()  # t ≈ α + S/β
    with deep_dive("The α–β fit, size by size", "the model against every size, and where one line stops fitting"):
        alpha_beta_details(fit)
    hang_demo()             # one rank skips a collective: the others wait until the timeout
    with deep_dive("Finding the culprit in a real job", "TORCH_DISTRIBUTED_DEBUG, NCCL_DEBUG and the flight recorder"):
        finding_the_culprit()
    overlap_async()         # async_op=True: communication under computation
    with deep_dive("CUDA streams", "the GPU's own overlap: kernels and copies on separate streams"):
        overlap_streams()
    further_reading()
    what_to_remember()      # the lecture in seven lines, and its notebook


def bench():
    """Hand-written rings vs dist.all_reduce at the largest size, on as many ranks as cores."""
    nbytes, ranks = 64 * MB, timing_ranks(4)
    run = spawn(race_ring, ranks, sizes=[nbytes], warmup=2, iters=15,
                name=f"bench: rings vs dist.all_reduce, {human_bytes(nbytes)}, {ranks} ranks")
    bus = [bandwidths("all_reduce", nbytes, t.median, ranks)[1] / 1e9 for t in run.returns[0][0]]
    names = list(RING_VARIANTS)
    return [f"lecture_02 {names[j]} vs dist.all_reduce, {human_bytes(nbytes)} on {ranks} "
            f"ranks ({choose_backend(ranks)}): busbw {bus[j]:.2f} vs {bus[2]:.2f} GB/s, "
            f"ratio {bus[j] / bus[2]:.2f} (target >= 0.8)" for j in (0, 1)]
