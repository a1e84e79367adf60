"""Lecture 02 (communication): every demo against a single-process reference, the building blocks
of lectures/data_parallel/collectives.py (the rings against dist.all_reduce, the bandwidth arithmetic and the
α–β fit on synthetic data), and a quick build of the page."""
import ast
import json
import math
import pathlib
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lectures.data_parallel import collectives as C
from lectures.data_parallel.communication_deep_dives import finding_the_culprit
from lectures.data_parallel.communication_demos import COLLECTIVES, all_reduce_two_ways, ring_trace, ring_vs_builtin
from lectures.data_parallel.figures import draw_ring_arrows, human_bytes
from lectures.data_parallel import communication_demos as D
from lectures.data_parallel import communication_deep_dives as DD
from lectures import lecture_02_communication as L
from tests.conftest import built, walk
from util import settings, spawn
from util.measure import timing_ranks
from util.recording import trim_build_paths
from util.render import visible_text

SECTIONS = [
    "## The hardware hierarchy",
    "## The eight collectives, and send/recv",
    "## All-reduce = reduce-scatter + all-gather",
    "## Ring all-reduce from send and receive",
    "## Measuring bandwidth the nccl-tests way",
    "## The α–β cost model",
    "## Hangs and timeouts",
    "## Overlapping communication with computation",
    "## Further reading",
]


# --- the collectives against single-process references -------------------------------------

def references(name, before, world_size):
    """What each rank must hold after collective `name`, computed in this one process."""
    total = sum(before) if before[0] is not None and name in ("reduce", "all-reduce", "reduce-scatter") else None
    if name == "broadcast":
        return [before[0]] * world_size
    if name == "scatter":
        return list(before[0].chunk(world_size))
    if name == "gather":
        return [torch.cat(before)] + [None] * (world_size - 1)
    if name == "reduce":
        return [total] + [None] * (world_size - 1)         # other ranks: scratch, undefined
    if name == "all-gather":
        return [torch.cat(before)] * world_size
    if name == "reduce-scatter":
        return list(total.chunk(world_size))
    if name == "all-reduce":
        return [total] * world_size
    if name == "all-to-all":
        return [torch.cat([b.chunk(world_size)[r] for b in before]) for r in range(world_size)]
    if name == "send/recv":
        return [before[(r - 1) % world_size] for r in range(world_size)]
    raise AssertionError(name)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name,fn", [(name, fn) for name, fn, _, _ in COLLECTIVES])
def test_collective_matches_single_process_reference(name, fn, world_size):
    chunk = 3   # not the figure's 2: pieces of odd length
    run = spawn(fn, world_size, chunk=chunk)
    before = [r["before"] for r in run.returns]
    after = [r["after"] for r in run.returns]
    # The inputs are what the lecture says they are (rank r holds 10r + i) ...
    roots_only = name == "scatter"
    for r, b in enumerate(before):
        if roots_only and r > 0:
            assert b is None
            continue
        assert torch.equal(b, D.rank_data(r, b.numel()))
    # ... and every defined output equals the single-process reference.
    for r, (got, want) in enumerate(zip(after, references(name, before, world_size))):
        if want is None:
            continue
        assert got is not None and torch.equal(got, want), f"{name} rank {r}: {got} != {want}"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("integer", [True, False])
def test_all_reduce_is_reduce_scatter_plus_all_gather(world_size, integer):
    run = spawn(all_reduce_two_ways, world_size, length=6 * world_size, integer=integer)
    reference = sum(r["input"].double() for r in run.returns)
    for r in run.returns:
        assert torch.allclose(r["direct"].double(), reference, atol=1e-5)
        assert torch.allclose(r["composed"].double(), reference, atol=1e-5)
        if integer:     # integer-valued floats: every summation order is exact
            assert torch.equal(r["direct"], r["composed"])


# --- the hand-written ring -------------------------------------------------------------------

LENGTHS = [1, 2, 3, 5, 7, 13, 31, 97, 1000, 1009]   # 1, primes, non-multiples of the world size


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_all_reduce_equals_dist_all_reduce(world_size):
    run = spawn(ring_vs_builtin, world_size, lengths=LENGTHS)
    for k, length in enumerate(LENGTHS):
        reference = sum(r[k][0].double() for r in run.returns)
        for rank, (x, ours, pipelined, theirs) in enumerate(r[k] for r in run.returns):
            for got in (ours, pipelined):
                assert got.shape == (length,)
                assert torch.allclose(got, theirs, rtol=1e-5, atol=1e-5), (length, rank)
                assert torch.allclose(got.double(), reference, rtol=1e-5, atol=1e-5), (length, rank)
        if world_size == 1:
            assert torch.equal(run.returns[0][k][1], run.returns[0][k][0])
            assert torch.equal(run.returns[0][k][2], run.returns[0][k][0])


def ring_on_integers(rank, world_size, length, slices):
    """Integer-valued data, so every summation order gives exactly the same floats."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(-50, 50, (length,), generator=g).float()
    ours, pipelined, theirs = x.clone(), x.clone(), x.clone()
    C.ring_all_reduce(ours)
    C.pipelined_ring_all_reduce(pipelined, slices=slices)
    dist.all_reduce(theirs)
    return ours, pipelined, theirs


@pytest.mark.parametrize("length,slices", [(1, 4), (5, 4), (11, 3), (37, 16), (1003, 7)])
def test_rings_are_exact_on_integer_data(length, slices):
    run = spawn(ring_on_integers, 4, length=length, slices=slices)
    for ours, pipelined, theirs in run.returns:
        assert torch.equal(ours, theirs) and torch.equal(pipelined, theirs)


def test_ring_trace_ends_with_everyones_sum():
    run = spawn(ring_trace, 4)
    for steps in run.returns:
        assert len(steps) == 1 + 2 * 3                      # start + 2(n-1) steps
        assert torch.equal(steps[-1][3], torch.full((4,), 15.0))
    # After the reduce-scatter phase rank r holds the complete chunk r+1.
    for rank, steps in enumerate(run.returns):
        assert steps[3][3][(rank + 1) % 4] == 15


def ring_on_strided(rank, world_size, length):
    """A non-contiguous input (every other element), then a second, ordinary ring call: the
    first must not leave a message behind that the second would swallow."""
    base = (torch.arange(2 * length, dtype=torch.float32) + 100 * rank)
    strided = base.clone()[::2]
    assert not strided.is_contiguous()
    expected = strided.clone()
    dist.all_reduce(expected)
    C.ring_all_reduce(strided)
    piped = base.clone()[::2]
    C.pipelined_ring_all_reduce(piped, slices=3)
    after = torch.full((length,), float(rank))
    C.ring_all_reduce(after)
    transposed = (torch.arange(12.0).view(3, 4) + rank).t()     # a non-contiguous matrix
    C.ring_all_reduce(transposed)
    return strided, piped, expected, after, transposed


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_accepts_non_contiguous_input_and_keeps_working(world_size):
    run = spawn(ring_on_strided, world_size, length=7, timeout=10)
    total = sum(range(world_size))
    for strided, piped, expected, after, transposed in run.returns:
        assert torch.equal(strided, expected) and torch.equal(piped, expected)
        assert torch.equal(after, torch.full((7,), float(total)))
        want = (world_size * torch.arange(12.0).view(3, 4) + total).t()
        assert torch.equal(transposed, want)


def ring_on_wrong_type(rank, world_size):
    """A rank that passes something the ring cannot sum fails before posting anything."""
    with pytest.raises(TypeError):
        C.ring_all_reduce(torch.zeros(4, dtype=torch.bool))
    x = torch.ones(5)
    C.ring_all_reduce(x)            # the next call still pairs up correctly
    return x


def test_ring_refuses_before_any_message():
    run = spawn(ring_on_wrong_type, 2, timeout=10)
    assert all(torch.equal(x, torch.full((5,), 2.0)) for x in run.returns)


def test_sweep_times_every_collective_at_awkward_sizes():
    sizes = [4, 100, 4096 + 12]
    run = spawn(C.sweep, 2, collectives=C.SWEPT, sizes=sizes, warmup=1, iters=3)
    timings = run.returns[0]
    assert len(timings) == len(C.SWEPT) and all(len(row) == len(sizes) for row in timings)
    for row in timings:
        for t in row:
            assert len(t.samples) == 3 and t.q1 <= t.median <= t.q3
            assert all(s > 0 and math.isfinite(s) for s in t.samples)
    # every rank reports the same (slowest-rank) timing
    assert [t.samples for t in run.returns[1][0]] == [t.samples for t in timings[0]]


# --- pure helpers on synthetic data ------------------------------------------------------------

def test_bus_bandwidth_factors():
    f = C.bus_bandwidth_factor
    assert f("all_reduce", 4) == pytest.approx(1.5)
    assert f("all_reduce", 8) == pytest.approx(1.75)
    assert f("all_reduce", 1) == 0.0                    # one rank moves nothing
    for name in ("all_gather", "reduce_scatter", "all_to_all"):
        assert f(name, 4) == pytest.approx(0.75)
        assert f(name, 2) == pytest.approx(0.5)
    assert f("broadcast", 16) == 1.0 and f("reduce", 3) == 1.0
    with pytest.raises(ValueError):
        f("all_scatter", 4)
    with pytest.raises(ValueError):
        f("all_reduce", 0)


def test_bandwidths_from_synthetic_timing():
    # 1 GB all-reduced in 0.5 s on 8 ranks: algbw 2 GB/s, busbw 2 * 2*7/8 = 3.5 GB/s.
    alg, bus = C.bandwidths("all_reduce", 1e9, 0.5, 8)
    assert alg == pytest.approx(2e9) and bus == pytest.approx(3.5e9)
    alg, bus = C.bandwidths("all_gather", 4e6, 1e-3, 4)
    assert alg == pytest.approx(4e9) and bus == pytest.approx(3e9)


SIZES = [4096 * 2 ** k for k in range(15)]


def test_fit_alpha_beta_recovers_exact_parameters():
    alpha, beta = 50e-6, 2e9
    times = [alpha + s / beta for s in SIZES]
    a, b = C.fit_alpha_beta(SIZES, times)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    assert C.crossover_bytes(a, b) == pytest.approx(1e5, rel=1e-6)
    # At the crossover, latency and bandwidth terms are equal.
    s = C.crossover_bytes(a, b)
    assert a == pytest.approx(s / b)


def test_fit_alpha_beta_tolerates_noise():
    rng = np.random.default_rng(0)
    alpha, beta = 200e-6, 0.5e9
    times = [(alpha + s / beta) * rng.uniform(0.95, 1.05) for s in SIZES]
    a, b = C.fit_alpha_beta(SIZES, times)
    assert a == pytest.approx(alpha, rel=0.15) and b == pytest.approx(beta, rel=0.15)


def exact_relative_fit(sizes, times):
    """An independent solver for min Σ((α + x·s)/t − 1)² over α, x ≥ 0: for a fixed α the best
    x ≥ 0 is in closed form, and the remaining one-variable function of α is convex (a partial
    minimum of a convex function), so a golden-section search finds its minimum."""
    s, t = np.asarray(sizes, float), np.asarray(times, float)
    a, b = 1 / t, s / t

    def best_x(alpha):
        return max(0.0, float(np.sum(b * (1 - alpha * a)) / np.sum(b * b)))

    def err(alpha):
        return float(np.sum((alpha * a + best_x(alpha) * b - 1) ** 2))

    lo, hi = 0.0, 2 * float(np.max(t))
    g = (math.sqrt(5) - 1) / 2
    for _ in range(300):
        m1, m2 = hi - g * (hi - lo), lo + g * (hi - lo)
        if err(m1) <= err(m2):
            hi = m2
        else:
            lo = m1
    alpha = (lo + hi) / 2
    return alpha, best_x(alpha), err(alpha)


def relative_error(sizes, times, alpha, beta):
    s, t = np.asarray(sizes, float), np.asarray(times, float)
    return float(np.sum(((alpha + s / beta) / t - 1) ** 2))


CASES = {   # each reaches a different branch of fit_alpha_beta
    "interior": (SIZES, [50e-6 + s / 2e9 for s in SIZES]),
    "noisy interior": (SIZES, [(2e-4 + s / 5e8) * (1 + 0.04 * math.sin(k)) for k, s in enumerate(SIZES)]),
    "pure bandwidth (α would be < 0)": ([1e3, 1e4, 1e5, 1e6], [0.5e-6, 9e-6, 1e-4, 1e-3]),
    "pure latency (1/β would be < 0)": ([1, 2, 3], [3e-3, 1e-3, 0.9e-3]),
    "flat": (SIZES[:5], [1e-3, 1.1e-3, 0.9e-3, 1e-3, 1.05e-3]),
    "two points": ([1, 2], [3e-3, 1e-3]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fit_alpha_beta_matches_an_exact_solver(case):
    sizes, times = CASES[case]
    alpha, beta = C.fit_alpha_beta(sizes, times)
    assert alpha >= 0 and beta > 0
    a_ref, x_ref, e_ref = exact_relative_fit(sizes, times)
    e_ours = relative_error(sizes, times, alpha, beta)
    assert e_ours <= e_ref * (1 + 1e-9) + 1e-15, (e_ours, e_ref)
    assert alpha == pytest.approx(a_ref, rel=1e-5, abs=1e-12)
    assert (0 if math.isinf(beta) else 1 / beta) == pytest.approx(x_ref, rel=1e-5, abs=1e-18)


def test_fit_alpha_beta_pure_latency_is_the_relative_error_minimiser():
    """Not the harmonic mean: Σ(1/t)/Σ(1/t²) minimises Σ(α/t − 1)²."""
    times = [3e-3, 1e-3, 0.9e-3]
    alpha, beta = C.fit_alpha_beta([1, 2, 3], times)
    t = np.array(times)
    assert math.isinf(beta)
    assert alpha == pytest.approx(np.sum(1 / t) / np.sum(1 / t ** 2), rel=1e-12)
    assert alpha != pytest.approx(len(t) / np.sum(1 / t), rel=1e-3)


def test_fit_alpha_beta_degenerate_cases():
    a, b = C.fit_alpha_beta(SIZES, [s / 1e9 for s in SIZES])         # no latency at all
    assert a == pytest.approx(0, abs=1e-12) and b == pytest.approx(1e9, rel=1e-6)
    a, b = C.fit_alpha_beta(SIZES, [1e-3] * len(SIZES))              # no size dependence
    assert a == pytest.approx(1e-3, rel=1e-6) and (math.isinf(b) or b > 1e15)
    a, b = C.fit_alpha_beta([1, 2], [3e-3, 1e-3])                    # shrinking times: no bandwidth
    assert a > 0 and math.isinf(b)
    with pytest.raises(ValueError):
        C.fit_alpha_beta([1], [1.0])
    with pytest.raises(ValueError):
        C.fit_alpha_beta([1, 2], [1.0, 0.0])


def test_human_bytes():
    h = human_bytes
    assert h(4096) == "4 KB" and h(64 * 2 ** 20) == "64 MB"
    assert h(10) == "10 B" and h(0) == "0 B"
    assert h(1000) == "1000 B" and h(1023) == "1023 B"          # no '1e+03 B'
    assert h(1023 * 1024) == "1023 KB"                          # no '1.02e+03 KB'
    assert h(1.5 * 2 ** 20) == "1.5 MB" and h(1536) == "1.5 KB"
    assert h(118.4 * 2 ** 20) == "118 MB" and h(3 * 2 ** 40) == "3 TB"
    for n in [1, 999, 1000, 1023, 1024, 10 ** 5, 10 ** 6, 10 ** 9, 10 ** 12]:
        assert "e" not in h(n)


# --- where the building blocks live -------------------------------------------------------------

def test_collectives_module_imports_no_lecture():
    """Modules sit below the lecture files: lectures/data_parallel/collectives.py imports util, never a lecture."""
    tree = ast.parse(pathlib.Path(C.__file__).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.startswith("lectures")], imported


# --- the page --------------------------------------------------------------------------------

def test_quick_build_has_every_section_and_figure(course_site):
    site = built(course_site, "lecture_02_communication")    # the session's one quick build
    page = json.loads((site / "lecture_02_communication.json").read_text())
    assert page["status"] == "ok"
    assert page["demos"]["failed"] == 0
    assert page["demos"]["expected_failures"] == 1          # the hang demo, and only it
    records = list(walk(page["records"]))
    notes = "\n".join(r["text"] for r in records if r["kind"] == "note")
    for heading in SECTIONS:
        assert heading in notes, heading
    figures = [r for r in page["records"] if r["kind"] == "figure"]
    captions = " ".join(f["caption"] for f in figures)
    for name, *_ in COLLECTIVES:                            # one figure per collective
        assert f"**{name}**" in captions
    assert "ring on 4 ranks" in captions and "α–β" in captions
    assert "Bus bandwidth" in captions and "Measured spans" in captions
    assert all(f["svg"].lstrip().startswith(("<?xml", "<svg")) for f in figures)
    # The hang is shown as the lesson: a timeout error on the page.
    hang = next(r for r in page["records"] if r["kind"] == "demo" and r["name"].startswith("hang:"))
    assert hang["status"] == "expected_failure"
    errors = [r["text"] for r in hang["records"] if r["kind"] == "error"]
    assert len(errors) == 3 and any("imed out" in e for e in errors)    # the last rank left early
    waited = [r["text"] for r in hang["records"] if r["kind"] == "output"]
    assert len(waited) == 3 and all(t.startswith("waited") for t in waited)
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in notes and "NCCL_DEBUG=INFO" in notes
    assert "TORCH_FR_BUFFER_SIZE" in notes and "3 (the default)" in notes
    # Demo names are unique and timing demos never oversubscribe the cores.
    demos = [r for r in page["records"] if r["kind"] == "demo"]
    names = [d["name"] for d in demos]
    assert len(names) == len(set(names)), names
    from util.measure import usable_cores
    for d in demos:
        if d["name"].startswith(("race:", "busbw sweep", "all-reduce sweep", "overlap:")):
            assert d["world_size"] <= max(2, usable_cores()), d["name"]
    # The page's header names the machine once (from the recorded environment); a sentence
    # beside a measurement says only how many ranks made it.
    assert page["environment"]["device"] and "2 cores" not in notes and "measured on a CPU" not in notes
    assert "**S* = " not in notes                            # the stray-asterisk markdown bug
    # Without a GPU the streams demo says it was skipped, and why.
    if not torch.cuda.is_available():
        assert "Skipped on this build" in notes
    links = [r for r in records if r["kind"] == "link"]
    assert len(links) >= 5 and any("nccl-tests" in l["url"] for l in links)


# --- what gloo really sends -------------------------------------------------------------------

def test_gloo_reduce_scatter_writes_an_all_reduces_bytes():
    """3 ranks, 3 MB: gloo's reduce_scatter_tensor is a clone, a full all-reduce and a copy, so
    it writes what an all-reduce writes (4,195,456 bytes), twice the ring's (n-1)/n·S."""
    nbytes, n = 3 * 2 ** 20, 3
    got = spawn(C.wire_bytes, n, collectives=["all_reduce", "reduce_scatter", "all_gather"],
                nbytes=nbytes).returns
    if got[0]["all_reduce"] is None:
        pytest.skip("this kernel does not count written bytes")
    for r in got:
        assert r["reduce_scatter"] == r["all_reduce"]
        assert r["all_reduce"] == pytest.approx(C.optimal_bytes("all_reduce", nbytes, n), rel=0.01)
        assert r["all_gather"] == pytest.approx(C.optimal_bytes("all_gather", nbytes, n), rel=0.01)
        assert r["reduce_scatter"] / C.optimal_bytes("reduce_scatter", nbytes, n) == pytest.approx(2, rel=0.01)


def test_wire_verdict_explains_reduce_scatter_by_its_bytes():
    nbytes, n = 3 * 2 ** 20, 3
    wire = {"all_reduce": 4195456, "all_gather": 2097728, "reduce_scatter": 4195456,
            "broadcast": 6291648, "all_to_all": 2097440}
    text = L.wire_verdict(wire, nbytes, n)
    assert "the same as its all-reduce: 4,195,456 bytes each" in text and "2.00×" in text
    assert "reduce_scatter_tensor_coalesced" in text and "NCCL" in text
    assert "arithmetic" not in text
    assert "broadcast" in text                       # the root writes (n-1)·S on gloo
    other = L.wire_verdict({**wire, "reduce_scatter": 2097728}, nbytes, n)
    assert "the same as its all-reduce" not in other


def test_busbw_note_no_longer_blames_arithmetic():
    import inspect
    assert "arithmetic" not in inspect.getsource(L.bandwidth)


def test_ring_arrows_are_read_from_the_trace():
    """The arrow figure labels each send with the chunk its receiver recorded and the value the
    sender held: in the all-gather every label carries the full sum."""
    import matplotlib
    matplotlib.use("Agg")
    traces = spawn(ring_trace, 3).returns
    fig = draw_ring_arrows(traces)
    labels = [t.get_text() for ax in fig.axes for t in ax.texts if t.get_text().startswith("c")]
    assert len(labels) == 2 * (3 - 1) * 3
    assert all(l.endswith("=7") for l in labels[len(labels) // 2:])     # 1 + 2 + 4


def test_alpha_beta_reuses_the_sweep(monkeypatch):
    """The α–β section reads the all-reduce timings the bandwidth sweep took (one measurement
    of each size per page) instead of timing them again."""
    from util.measure import Timing
    sizes = L.alpha_beta_sizes()
    ranks = timing_ranks(settings.world_size)
    monkeypatch.setattr(L, "MEASURED", {("sweep", ranks, settings.quick, s):
                                        Timing([1e-4 + s / 1e9] * 3) for s in sizes})
    monkeypatch.setattr(L, "spawn", lambda *a, **k: pytest.fail("measured again"))
    for module, names in ((L, ("note", "see", "table", "figure")), (DD, ("note", "table"))):
        for name in names:
            monkeypatch.setattr(module, name, lambda *a, **k: None)
    L.alpha_beta_details(L.alpha_beta_fit())


def broadcast_counted_and_written(rank, world_size, nbytes):
    from lectures.data_parallel import Collectives
    t = torch.zeros(nbytes // 4)
    comm = Collectives(world_size)
    comm.broadcast(t, src=0)                  # connections set up
    comm.sent_by_gloo = 0
    dist.barrier()
    from util.measure import bytes_sent
    with bytes_sent() as sent:
        comm.broadcast(t, src=0)
    dist.barrier()
    return comm.sent_by_gloo, sent.bytes


@pytest.mark.parametrize("n", [3, 4])
def test_gloo_broadcast_is_a_binomial_tree(n):
    """gloo's broadcast is a binomial tree, not the root sending to each of the n-1 others: at
    4 ranks, 1 MB the root wrote 2,097,344 bytes, rank 1 1,048,720 and ranks 2-3 48. The count
    of Collectives.sent_by_gloo follows it rank by rank."""
    nbytes = 2 ** 20
    assert [C.binomial_broadcast_sends(r, n) for r in range(n)] == ([2, 0, 0] if n == 3 else [2, 1, 0, 0])
    assert [C.binomial_broadcast_sends(r, 5) for r in range(5)] == [3, 1, 0, 0, 0]
    assert [C.binomial_broadcast_sends(r, 6, root=2) for r in range(6)] == [0, 0, 3, 2, 0, 0]
    for counted, written in spawn(broadcast_counted_and_written, n, nbytes=nbytes).returns:
        if written is None:
            pytest.skip("this kernel does not count written bytes")
        assert written == pytest.approx(counted, abs=1024), (counted, written)


def test_wire_verdict_names_the_broadcast_tree():
    wire = {"all_reduce": 4195456, "broadcast": 6291648}
    text = L.wire_verdict(wire, 3 * 2 ** 20, 3)
    assert "binomial tree" in text and "to every other rank" not in text


def test_alpha_beta_verdict_stays_inside_the_measured_sizes():
    """The page said 'S* = αβ ≈ 614 KB: anything smaller costs roughly the same as an empty
    one' with 256 KB the largest size measured (and 760 µs at 256 KB vs 456 µs at 4 KB)."""
    sizes = [4096 * 2 ** k for k in range(7)]                       # 4 KB .. 256 KB
    times = [456e-6 * (1 + 0.1 * k) for k in range(6)] + [760e-6]
    alpha, beta = 380e-6, 1.62e9                                     # S* ≈ 614 KB
    text = L.alpha_beta_verdict(sizes, times, alpha, beta)
    assert "no bandwidth regime" in text and "beyond the largest size measured" in text
    assert "empty one" not in text and "**" not in text
    assert "0.345" in text                                           # 256 KB / 760 µs
    inside = L.alpha_beta_verdict(sizes + [2 ** 20, 2 ** 22], times + [1e-3, 3e-3], 100e-6, 1.6e9)
    assert "inside the measured range" in inside
    assert L.alpha_beta_verdict(sizes, times, 1e-4, float("inf")).startswith("The times did not grow")


def test_overlap_verdict_says_slower_when_it_was():
    """'0.51× the speed: no gain here' for 2.74 ms sequential vs 5.41 ms overlapped: the words
    now come from util.measure.compare."""
    from util.measure import Timing
    t = {"compute": Timing([1.3e-3, 1.4e-3, 1.5e-3]), "all-reduce": Timing([1.2e-3, 1.3e-3, 1.4e-3]),
         "sequential": Timing([2.74e-3, 2.74e-3, 2.87e-3]), "overlapped": Timing([3.24e-3, 5.41e-3, 6.85e-3])}
    text = visible_text(L.overlap_verdict(t))
    assert "sequential is 1.97× faster than overlapped" in text, text
    assert "gained no measurable time" in text
    t["overlapped"] = Timing([1.5e-3, 1.6e-3, 1.7e-3])
    assert "overlapped is 1.71× faster" in visible_text(L.overlap_verdict(t))


def test_overlap_verdict_counts_what_was_hidden_against_the_parts_timed_alone():
    """A review's case: the sequential run (41.2 ms) paid more than compute and all-reduce alone
    (16.6 + 12.7 ms); measured from it, the overlap 'hid about 100%' while it took 25.3 ms, far
    above the longer part. Against the parts it hid (29.3 - 25.3) / 12.7 = 31%."""
    from util.measure import Timing
    around = lambda ms: Timing([ms * 0.99e-3, ms * 1e-3, ms * 1.01e-3])
    t = {"compute": around(16.6), "all-reduce": around(12.7), "sequential": around(41.2),
         "overlapped": around(25.3)}
    text = visible_text(L.overlap_verdict(t))
    assert "hid about 31% of the shorter one" in text and "100%" not in text, text
    assert L.overlap_paid(t) == "in part"
    t["overlapped"] = around(30.0)          # faster than sequential, slower than the parts alone
    text = visible_text(L.overlap_verdict(t))
    assert "not communication hidden" in text and "hid about" not in text, text
    assert L.overlap_paid(t) is None
    t["overlapped"] = around(29.2)          # under the parts' median sum, inside their spread: no claim
    assert L.overlap_paid(t) is None
    text = visible_text(L.overlap_verdict(t))
    assert "not communication hidden" in text and "hid about" not in text, text
    t["overlapped"] = around(16.0)          # the shorter part hidden whole
    assert "hid all of the shorter one" in visible_text(L.overlap_verdict(t)) and L.overlap_paid(t) == "fully"


def test_hang_errors_lose_the_build_path():
    line = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
            "Timed out waiting 3000ms for recv operation to complete")
    assert trim_build_paths(line) == "RuntimeError: Timed out waiting 3000ms for recv operation to complete"
    assert trim_build_paths("plain message") == "plain message"


def test_flight_recorder_names_the_dump_file_variable():
    import inspect
    src = inspect.getsource(finding_the_culprit)        # the hang section's deep dive
    assert "TORCH_FR_DUMP_TEMP_FILE" in src and "still" in src


def test_pipelining_verdict_from_the_numbers():
    """The race had no verdict on pipelining (0.41× vs 0.55× of the built-in at 4 MB)."""
    from util.measure import Timing
    ring, piped = Timing([10e-3, 10.2e-3, 10.4e-3]), Timing([13e-3, 13.6e-3, 14e-3])
    text = visible_text(DD.pipelining_verdict("4 MB", ring, piped))
    assert "simple is 1.33× faster than pipelined" in text and "same cores" in text
    assert "hid some" in DD.pipelining_verdict("4 MB", piped, ring)


def test_wide_collective_figures_stack_for_phones():
    """The all-gather figure was 1,699 px wide side by side (shown at 358 px on a phone)."""
    import matplotlib
    matplotlib.use("Agg")
    from lectures.data_parallel.figures import draw_collective
    before = [torch.tensor([10. * r, 10. * r + 1]) for r in range(4)]
    after = [torch.cat(before)] * 4
    wide = draw_collective("all-gather", before, after, "none")
    narrow = draw_collective("broadcast", before, before, "none")
    assert wide.get_size_inches()[0] <= 9 and len({round(ax.get_position().x0, 2) for ax in wide.axes}) == 1
    assert len({round(ax.get_position().x0, 2) for ax in narrow.axes}) == 2
