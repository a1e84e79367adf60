"""What overlap can buy, shown on a CPU: a compute stand-in that releases the core, and the model
of an overlapped step that each lecture's measurement is compared with.

On this machine gloo moves bytes with CPU threads, which need the same cores as the matmuls, so
real compute and communication partly take turns and overlap shows little. A GPU runs its
kernels on the SMs while NCCL's transfers use NVLink, the network and a few SMs of their own.
`release_core(s)` stands in for `s` seconds of compute by a timed wait: the rank is busy for
that long but its core is free for the communication thread, as on a GPU. It is the idea of
lecture 05's sleep mode (`PipelineExecutor(delay=...)`, which sleeps inside each action),
taken out of the pipeline so that lectures 02, 03, 04 and 06 can use it before lecture 05.

The model: the step without overlap costs compute + communication; the step with it, at best,
max(compute, communication). What cannot hide is spelled out by a two-resource timeline
(`overlapped_step`): with pieces of compute and communication in a dependency chain, the first
transfer of a prefetch (or the last bucket of a backward) stays exposed.
"""
import time

import torch
import torch.distributed as dist
from torch import nn

from util.measure import compare, spreads_overlap, with_spread


def release_core(seconds):
    """Stand in for `seconds` of compute without using the core: the communication thread gets it."""
    if seconds > 0:
        time.sleep(seconds)


def agreed_wait(comm_seconds, pieces, min_wait, longer=1.0):
    """Each stand-in's wait: `longer` × the transfers' time per piece (1: compute and communication
    alike, where overlap gains most), at least `min_wait` (long against the clock's and the wake-up's
    overheads); rank 0's on every rank."""
    t = torch.tensor([max(min_wait, longer * comm_seconds / pieces)], dtype=torch.float64)
    dist.broadcast(t, 0)
    return t.item()


class _WaitInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        release_core(ctx.seconds)
        return grad, None


class ComputeStandIn(nn.Module):
    """A layer without parameters that stands in for compute: it waits `forward_s` in the forward
    and `backward_s` in the backward (timed waits, `release_core`) and passes its input on."""

    def __init__(self, forward_s=0.0, backward_s=0.0):
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x):
        release_core(self.forward_s)
        return _WaitInBackward.apply(x, self.backward_s) if self.backward_s and x.requires_grad else x


def overlapped_step(compute, comm, pattern):
    """The step time of pieces of `compute` and `comm` (seconds) on two resources that run at once,
    one piece at a time each.

    - pattern "independent" (an async collective launched before compute that does not need it):
      max(compute, comm);
    - pattern "produce" (a backward's gradient buckets): comm[i] can start once compute[i] is done;
      the step ends when the last transfer does.
    - pattern "consume" (a prefetch, a ring): compute[i] needs comm[i] (comm[0] may be 0: the block a
      rank holds already), and comm[i+1] is launched when compute[i] starts."""
    if len(compute) != len(comm):
        raise ValueError(f"overlapped_step: {len(compute)} compute pieces but {len(comm)} transfers")
    if pattern == "independent":
        return max(sum(compute), sum(comm))
    if pattern == "produce":
        done_c = done_m = 0.0
        for c, m in zip(compute, comm):
            done_c += c
            done_m = max(done_m, done_c) + m
        return max(done_c, done_m)
    if pattern == "consume":
        arrived, done_c = comm[0], 0.0
        for i, c in enumerate(compute):
            start = max(done_c, arrived)
            if i + 1 < len(comm):
                arrived = start + comm[i + 1]
            done_c = start + c
        return done_c
    raise ValueError(f"overlapped_step: pattern is 'independent', 'produce' or 'consume', not {pattern!r}")


def overlap_model(compute, comm, pattern):
    """{"sequential", "overlapped", "bound", "gain"}: the step without overlap (everything in turn),
    with it (`overlapped_step`), the bound max(compute, comm), and the gain the model predicts."""
    seq, ovl = sum(compute) + sum(comm), overlapped_step(compute, comm, pattern)
    return {"sequential": seq, "overlapped": ovl, "bound": max(sum(compute), sum(comm)), "gain": seq / ovl}


def measured_against_model(t, pieces, pattern, first_held=False):
    """A demo's result in release-the-core mode, read against the model. `t` holds Timings
    "compute" (the stand-in's pieces), "comm" (the transfers alone), "sequential" and "overlapped";
    the compute and the transfers are cut into `pieces` equal parts, as the demo cut them (with
    `first_held` the first compute piece needs no transfer: a ring's own block). What the step
    without overlap takes beyond compute + comm (launching, bookkeeping, agreeing on shapes) is
    counted as exposed in both. Adds the model's numbers and the measured gain; "off" is
    measured gain / model gain − 1."""
    c, m = t["compute"].median, t["comm"].median
    other = max(0.0, t["sequential"].median - c - m)
    comm = [0.0] + [m / (pieces - 1)] * (pieces - 1) if first_held else [m / pieces] * pieces
    model = overlap_model([c / pieces] * pieces, comm, pattern)
    model = {"sequential": model["sequential"] + other, "overlapped": model["overlapped"] + other,
             "bound": model["bound"] + other, "exposed": other}
    model["gain"] = model["sequential"] / model["overlapped"]
    gain = t["sequential"].median / t["overlapped"].median
    return {**t, "model": model, "gain": gain, "off": gain / model["gain"] - 1, "pattern": pattern}


def times_faster(gain):
    """'1.25× faster', or below 1 '1.15× slower': a step's gain from overlap, said as it reads."""
    return f"{gain:.2f}× faster" if gain >= 1 else f"{1 / gain:.2f}× slower"


def gain_words(r):
    """'Overlapped, the step is 1.83× faster, where the model predicts 1.89×', a sentence's start
    with two numbers: the two steps' times and how far the model is off on hover."""
    off = r["off"]
    where = ("matches it" if abs(off) < 0.005 else f"is {abs(off):.0%} below it" if off < 0 else
             f"is {off:.0%} above it: overlapped, the run also hid part of the overhead the step "
             "without overlap pays beyond compute and transfers, which the model counts as exposed in both")
    steps = f"without overlap {r['sequential'].ms()}, with it {r['overlapped'].ms()}"
    gain = with_spread(times_faster(r["gain"]), steps)
    model = with_spread(f"{r['model']['gain']:.2f}×", f"the measured {r['gain']:.2f}× {where}")
    return f"Overlapped, the step is {gain}, where the model predicts {model}"


def real_compute_words(real, with_name, without_name):
    """The clause on a real-compute run ({"sequential", "overlapped"} Timings): which was faster
    (util.measure.compare), then what that says on this CPU, where gloo's copies and the
    compute share the cores."""
    said = compare(real["overlapped"], real["sequential"], with_name, without_name)
    if spreads_overlap(real["overlapped"], real["sequential"]):
        return said + "; gloo's copies and the compute share the cores"
    if real["overlapped"].median > real["sequential"].median:
        return said + ": overlapping cost time here, gloo's copies taking the cores the compute needs"
    return said + ": real compute hides part of the transfers here, though gloo's copies and the compute share the cores"
