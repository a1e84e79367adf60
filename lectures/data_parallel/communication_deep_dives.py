"""The appendix page of lecture 02: its deep dives, each a section function that main() calls
inside `with deep_dive(...)`, in the order main() calls them: the build machine's topology, a
pipelined ring checked and raced, the α–β fit size by size, finding the culprit of a hang, and
CUDA streams. The main page's sections stay in the lecture."""
import shutil
import subprocess

import numpy as np
import torch

from util import note, see, settings, spawn, table
from util.launch import choose_backend
from util.measure import compare, machine, timing_ranks

from lectures.data_parallel.collectives import bandwidths, pipelined_ring_all_reduce
from lectures.data_parallel.communication_demos import (MEASURED, RING_VARIANTS, race_ring, ring_vs_builtin,
                                                        streams_overlap, us)
from lectures.data_parallel.figures import KB, MB, human_bytes


# =========================================================================================
# The build machine's topology
# =========================================================================================

def machine_topology():
    """What this machine says about itself: GPU links with nvidia-smi, CPU facts otherwise."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                 timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                return "nvidia-smi topo -m", out.stdout.rstrip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    keep = ("Model name", "CPU(s):", "Thread(s) per core", "Core(s) per socket", "Socket(s)",
            "L1d cache", "L2 cache", "L3 cache", "NUMA node(s)", "Hypervisor vendor")
    if shutil.which("lscpu"):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30)
        lines = [l.replace("(s)", "s") for l in out.stdout.splitlines() if l.strip().startswith(keep)]
        if lines:
            return "lscpu (selected lines)", "\n".join(lines)
    with open("/proc/cpuinfo") as f:
        models = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    return "/proc/cpuinfo", f"{len(models)} logical CPUs: {models[0] if models else 'unknown'}"


def this_machine():
    note("""
        `nvidia-smi topo -m` lists which GPUs talk over NVLink (`NV#`) or PCIe (`PIX`, `PHB`,
        `SYS`); without GPUs we record the CPU layout, since the "ranks" here are processes
        sharing these cores and one memory.
    """)
    source, text = machine_topology()
    note(f"Output of `{source}` on the build machine:\n\n```text\n{text}\n```")


# =========================================================================================
# A pipelined ring, checked and raced
# =========================================================================================

def ring_checked():
    world_size = settings.world_size
    lengths = [1, 2, 3, 7, 13, 97, 1000, 4099]
    note("""
        Waiting for a whole chunk before passing it on leaves the link idle while a rank adds.
        Real implementations cut chunks into slices and overlap moving one slice with adding
        the previous one — a pipeline. Whether that pays off depends on whether moving and
        adding really use different resources; the race below measures it here.
    """)
    run = spawn(ring_vs_builtin, world_size, lengths=lengths,
                name=f"rings vs dist.all_reduce, awkward lengths, {world_size} ranks")
    rows = []
    for j, variant in ((1, "ring"), (2, "pipelined ring")):
        worst_builtin = worst_exact = 0.0
        for k in range(len(lengths)):
            reference = sum(r[k][0].double() for r in run.returns)
            worst_builtin = max(worst_builtin, max((r[k][j] - r[k][3]).abs().max().item() for r in run.returns))
            worst_exact = max(worst_exact, max((r[k][j].double() - reference).abs().max().item() for r in run.returns))
        rows.append([variant, worst_builtin, worst_exact])
    table(rows, header=["variant", "max |ours − dist.all_reduce|", "max |ours − float64 sum|"],
          caption=f"Both hand-written rings agree with the built-in on {world_size} ranks for "
                  f"awkward lengths ({', '.join(map(str, lengths))}; the largest difference over "
                  "all of them and every rank): the differences are float rounding, the additions "
                  "happen in a different order.")
    see(pipelined_ring_all_reduce)


def ring_raced():
    world_size = settings.world_size
    sizes = [4 * KB, 256 * KB, 4 * MB] if settings.quick else [4 * KB, 256 * KB, 4 * MB, 64 * MB]
    iters = 5 if settings.quick else 9
    ranks = timing_ranks(world_size)
    run = spawn(race_ring, ranks, sizes=sizes, warmup=2, iters=iters,
                name=f"race: ring vs pipelined ring vs built-in, {ranks} ranks")
    timings = run.returns[0]
    names = list(RING_VARIANTS)
    rows = []
    for nbytes, ts in zip(sizes, timings):
        bus = [bandwidths("all_reduce", nbytes, t.median, ranks)[1] / 1e9 for t in ts]
        rows.append([human_bytes(nbytes), *(us(t) for t in ts), *bus,
                     bus[0] / bus[2], bus[1] / bus[2]])
    table(rows, header=["size", *(f"{n} µs, median (IQR)" for n in names),
                        *(f"{n} busbw (GB/s)" for n in names),
                        "ring / built-in", "pipelined / built-in"],
          caption=f"{iters} timed calls per variant after 2 warm-ups, each after a barrier, slowest "
                  f"rank; the three variants take turns. "
                  f"{choose_backend(ranks)}, {machine(ranks)}.")
    for nbytes, ts in zip(sizes, timings):
        MEASURED["race", ranks, settings.quick, nbytes] = ts[2]
    small, large = rows[0], rows[-1]
    note(f"""
        Timed on {ranks} ranks, not {world_size}: a timing with more ranks than cores measures
        the operating system taking turns, not the algorithm.
        At {large[0]} the pipelined ring reaches {large[-1]:.2f}× the built-in's bus bandwidth
        (the simple ring {large[-2]:.2f}×). At {small[0]} the ratios are {small[-2]:.2f}×
        (simple) and {small[-1]:.2f}× (pipelined): small messages are all latency, our ring pays
        $2(n-1)$ Python-level exchanges (the pipelined one, one per slice), while the library
        runs its loop in C++ (and NCCL would switch to a tree). For large messages the ratio
        says how much a few lines of Python around `isend`/`irecv` cost once bytes dominate.

        {pipelining_verdict(large[0], timings[-1][0], timings[-1][1])}
    """)


def pipelining_verdict(size, ring, pipelined):
    """Did cutting chunks into slices pay off at `size`? From the two rings' Timings."""
    said = f"Pipelined against simple ring at {size}: {compare(pipelined, ring, 'pipelined', 'simple')}."
    if pipelined.q3 < ring.q1:
        return said + (" Moving one slice while adding the previous one hid some of the additions "
                       "behind the transfers.")
    return said + (" Pipelining pays only when moving and adding use different resources; here "
                   "both are CPU work on the same cores (gloo copies bytes through loopback "
                   "sockets with CPU threads), and every slice adds a Python-level exchange "
                   "with its own fixed cost, so there is nothing to overlap and more to pay.")


# =========================================================================================
# The α–β fit, size by size
# =========================================================================================

def alpha_beta_details(fit):
    """The fit size by size, whether one line fits both regimes, and the ring's refined model."""
    sizes, timings, times, model, rel = (fit[k] for k in ("sizes", "timings", "times", "model", "rel"))
    table([[human_bytes(s), us(t), m * 1e6, f"{100 * (m / t.median - 1):+.0f}%"]
           for s, t, m in zip(sizes, timings, model)],
          header=["size", "measured µs, median (IQR)", "one-line model (µs)", "model − measured"],
          caption=f"Median relative error of the fit: {np.median(rel) * 100:.0f}%; largest "
                  f"{rel.max() * 100:.0f}% (at {human_bytes(sizes[int(rel.argmax())])}).")
    if fit["misfit"]:
        fits = (f"One straight line does not fit both regimes here: at {human_bytes(sizes[-1])} it "
                f"predicts {model[-1] * 1e3:.3g} ms where {times[-1] * 1e3:.3g} ms was measured "
                f"({100 * (model[-1] / times[-1] - 1):+.0f}%), and at {human_bytes(sizes[0])} "
                f"{model[0] * 1e6:.0f} µs for {times[0] * 1e6:.0f} µs. Fitted separately, the "
                f"smaller half gives α ≈ {fit['small_alpha'] * 1e6:.0f} µs and the larger half "
                f"β ≈ {fit['large_beta'] / 1e9:.2f} GB/s (dashed lines in the figure): the bandwidth "
                "this machine reaches depends on the size (caches, socket buffers, gloo switching "
                "algorithms), which the model's single β cannot express. Use α from small "
                "messages and β from the sizes you will really send.")
    else:
        fits = (f"The line misses by at most {rel.max() * 100:.0f}% over the whole range "
                f"(at {human_bytes(sizes[int(rel.argmax())])}).")
    note(f"""
        {fits} The fit itself is exact: a two-unknown non-negative least-squares problem
        (`fit_alpha_beta`). For a ring the model can be refined per link:
        $t = 2(n-1)\\,\\alpha_\\text{{link}} + \\frac{{2(n-1)}}{{n}}\\frac{{S}}{{\\beta_\\text{{link}}}}$
        — the latency term grows with the number of ranks, which is why NCCL uses trees for
        small messages on many nodes.
    """)


# =========================================================================================
# Finding the culprit in a real job
# =========================================================================================

def finding_the_culprit():
    note("""
        - `TORCH_DISTRIBUTED_DEBUG=DETAIL` makes PyTorch check, before every collective, that
          all ranks are calling the same operation with the same shapes (it wraps the process
          group and compares fingerprints with an extra all-gather). A mismatch becomes an error
          naming the op and the ranks, instead of a hang or silent corruption. It costs time:
          use it to debug, not to train.
        - `NCCL_DEBUG=INFO` makes NCCL log its set-up (version, rings/trees chosen, which
          transport — NVLink, PCIe, InfiniBand — connects each pair) and errors;
          `NCCL_DEBUG_SUBSYS=COLL` adds a line per collective call, so the rank whose log stops
          early is the one that skipped.
        - Keep timeouts short while debugging (`init_process_group(timeout=...)`). With NCCL a
          watchdog thread notices the timeout; `TORCH_NCCL_ASYNC_ERROR_HANDLING` says what it
          does then: 0 nothing, 1 abort the communicator and tear the process down, 2 only
          abort the communicator, 3 (the default) tear the process down *without* aborting
          the communicator. Either way the job dies loudly instead of hanging.
        - The "flight recorder" keeps the last collectives each rank issued (op, sizes,
          sequence number, state) in a ring buffer whose length is `TORCH_FR_BUFFER_SIZE`
          (PyTorch 2.13's name; older releases read `TORCH_NCCL_TRACE_BUFFER_SIZE`, which is
          still accepted); 0 records nothing. 2.13's source defaults it to 2,000 entries,
          older releases to 0, so set it explicitly. `TORCH_NCCL_DUMP_ON_TIMEOUT=1` only
          *writes that buffer out* when the watchdog fires (to files whose name starts with
          `TORCH_FR_DUMP_TEMP_FILE`; the old name `TORCH_NCCL_DEBUG_INFO_TEMP_FILE` is still
          read), so set both. Comparing the ranks' last sequence
          numbers names the rank that fell behind.
    """)


# =========================================================================================
# CUDA streams
# =========================================================================================

def overlap_streams():
    note("""
        A GPU executes kernels from different streams concurrently when it
        has the resources; copies between host and device run on separate copy engines. Put a
        host-to-device copy on a side stream and a matmul on the default stream, and the copy
        is hidden behind the matmul (NCCL runs its kernels on its own streams the same way).
    """)
    if torch.cuda.is_available():
        n = 2048 if settings.quick else 8192
        copy_bytes = (64 if settings.quick else 1024) * MB
        see(streams_overlap)
        run = spawn(streams_overlap, 1, n=n, copy_bytes=copy_bytes, reps=5,
                    name="CUDA streams: copy on a side stream during a matmul, 1 GPU")
        r = run.returns[0]
        table([["matmul alone", r["matmul"].ms()], ["copy alone", r["copy"].ms()],
               ["matmul then copy, one stream", r["sequential"].ms()],
               ["copy on a side stream during the matmul", r["overlapped"].ms()]],
              header=["what", "time, median (IQR) of 5"],
              caption=f"{n}×{n} fp32 matmul and a {human_bytes(copy_bytes)} pinned host-to-device "
                      f"copy, {machine(1)}.")
        s, o = r["sequential"].median * 1e3, r["overlapped"].median * 1e3
        note(f"Overlapping saved {s - o:.1f} ms of {s:.1f} ms ({s / o:.2f}× faster, medians).")
    else:
        note("""
            *Skipped on this build:* no CUDA GPU is visible, and streams are a GPU feature.
            The demo (`streams_overlap`) runs automatically when the page is built on a machine
            with a GPU.
        """)
