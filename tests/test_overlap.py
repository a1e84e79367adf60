"""Overlap that shows (issue 39): the model of an overlapped step, the compute stand-in that
releases the core, and each lecture's overlap demo in release-the-core mode against its model.

The demo tests time real ranks on a shared machine, so each gets up to three tries (a busy
neighbour can stall gloo's threads for tens of milliseconds); a demo whose overlap does not work
gains about 1× against models of 1.5–2×, more than 25% off on every try. Releasing the core
helps only if a core is free: on a machine whose load stays above 4 runnable tasks per usable
core for a minute, the test skips and says so (measured here: at a load of 19 on 2 cores the
gains fall 13–49% short of the models; at 3 to 12 they were within 25%)."""
import os
import time

import pytest
import torch

from lectures.data_parallel.communication_demos import released_overlap
from lectures.data_parallel.demos import released_buckets, released_prefetch
from lectures.data_parallel.overlap import ComputeStandIn, measured_against_model, overlap_model, overlapped_step
from lectures.context_parallel.demos import released_ring
from lectures.tensor_parallel.demos import released_async_tp
from util import spawn
from util.measure import Timing

pytestmark = pytest.mark.timed    # runs after the other tests, alone on the machine (conftest.py)


def test_model_independent_is_the_longer_of_the_two():
    assert overlapped_step([3.0], [5.0], "independent") == 5.0
    assert overlap_model([4.0], [4.0], "independent")["gain"] == pytest.approx(2.0)


def test_model_produce_leaves_the_last_transfer_exposed():
    # a backward of 4 layers, 1 s each, and a 1 s bucket after each: 4 + the last bucket
    assert overlapped_step([1.0] * 4, [1.0] * 4, "produce") == pytest.approx(5.0)
    # transfers longer than the compute queue up behind each other: 1 + 4 × 2
    assert overlapped_step([1.0] * 4, [2.0] * 4, "produce") == pytest.approx(9.0)


def test_model_consume_prefetches_one_ahead():
    # ZeRO-3: the first gather is exposed, every later one hides behind the layer before
    assert overlapped_step([2.0] * 3, [1.0] * 3, "consume") == pytest.approx(1 + 3 * 2)
    # a ring: the own block needs nothing, and each hop longer than a block shows its excess
    assert overlapped_step([1.0] * 3, [0.0, 3.0, 3.0], "consume") == pytest.approx(1 + 3 + 3)
    m = overlap_model([1.0] * 2, [0.0, 1.0], "consume")
    assert m["sequential"] == 3 and m["overlapped"] == 2 and m["gain"] == 1.5


def test_model_refuses_mismatched_pieces_and_unknown_patterns():
    with pytest.raises(ValueError, match="3 compute pieces but 2 transfers"):
        overlapped_step([1, 1, 1], [1, 1], "produce")
    with pytest.raises(ValueError, match="pattern is"):
        overlapped_step([1], [1], "prefetch")


def test_measured_against_model_reads_the_timings():
    t = {"compute": Timing([4.0]), "comm": Timing([3.0]), "sequential": Timing([7.0]), "overlapped": Timing([5.0])}
    r = measured_against_model(t, 4, "produce")
    assert r["model"]["overlapped"] == pytest.approx(4 + 0.75) and r["gain"] == pytest.approx(1.4)
    assert r["off"] == pytest.approx(1.4 / (7 / 4.75) - 1) and r["model"]["exposed"] == 0
    t["sequential"] = Timing([8.0])    # 1 s of bookkeeping: exposed with and without overlap
    assert measured_against_model(t, 4, "produce")["model"]["overlapped"] == pytest.approx(5.75)


def test_stand_in_waits_in_forward_and_backward_and_passes_values_on():
    layer = ComputeStandIn(forward_s=0.02, backward_s=0.03)
    x = torch.randn(3, requires_grad=True)
    t0 = time.perf_counter()
    y = layer(x)
    t1 = time.perf_counter()
    (y * torch.arange(3.0)).sum().backward()
    t2 = time.perf_counter()
    assert torch.equal(y, x) and torch.equal(x.grad, torch.arange(3.0))
    assert t1 - t0 >= 0.02 and t2 - t1 >= 0.03


DEMOS = {
    "lecture 02: async all-reduce": (released_overlap, {"numel": 2 ** 21, "reps": 9}),
    "lecture 03: DDP buckets": (released_buckets, {"reps": 9}),
    "lecture 03: ZeRO-3 prefetch": (released_prefetch, {"reps": 9}),
    "lecture 04: async TP": (released_async_tp, {"reps": 9}),
    "lecture 06: ring attention": (released_ring, {"reps": 9}),
}


def wait_for_a_free_core(limit_s=60):
    """Wait (up to `limit_s`) until the 1-minute load is at most 4 per usable core; skip if it never is."""
    from util.measure import usable_cores
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] > 4 * usable_cores():
        if time.monotonic() > deadline:
            pytest.skip(f"the machine is too busy to time overlap: load {os.getloadavg()[0]:.1f} "
                        f"on {usable_cores()} cores")
        time.sleep(5)


TOLERANCE = 0.25      # each demo's measured gain within 25% of its model's


def overlap_shows(r):
    """(whether the run `r` of a release-the-core demo shows the overlap its model predicts, what
    it measured, in words)."""
    if "waiting" in r:   # the ring: its blocks' real work is as long as a hop, so the gain is small;
        # what overlap must do is hide the hop: the time still spent waiting for it
        hidden = r["waiting"].median <= 0.25 * r["comm"].median
        sized = True
    else:
        # the overlapped step measurably shorter (its median below the other's lower quartile): a
        # run that overlapped nothing fails here even where the model's gain is within TOLERANCE of 1
        hidden = r["overlapped"].median < r["sequential"].q1
        # the demo must be sized so that overlap can show; a try whose timings (a stalled transfer,
        # a late wake-up) left the model too little to gain does not count, like any other bad try
        sized = r["model"]["gain"] > 1.2
    words = (f"measured {r['gain']:.2f}× against the model's {r['model']['gain']:.2f}×"
             + (f", waited {r['waiting'].median * 1e3:.2f} ms of a {r['comm'].median * 1e3:.2f} ms hop"
                if "waiting" in r else "" if hidden else ", overlapped not below the other's lower quartile")
             + ("" if sized else " (a model gain of 1.2× or less: too small to show overlap)"))
    return abs(r["off"]) <= TOLERANCE and hidden and sized, words


@pytest.mark.parametrize("name", list(DEMOS))
def test_overlap_demo_gains_what_its_model_says(name):
    fn, kw = DEMOS[name]
    tries = []
    for _ in range(3):
        wait_for_a_free_core()
        shows, words = overlap_shows(spawn(fn, 2, name=name, **kw).returns[0])
        tries.append(words)
        if shows:
            return
    pytest.fail(f"{name}: " + "; ".join(tries))


def test_a_run_that_overlaps_nothing_fails_the_check():
    """Same steps with and without overlap: whatever the model (sized or not), not a pass, nor an
    overlapped step inside the other's spread; the ring's overlapped run that still waits out its
    hop is not either."""
    for pieces, pattern in ((1, "independent"), (6, "produce"), (6, "consume")):
        t = {"compute": Timing([0.010]), "comm": Timing([0.010]), "sequential": Timing([0.020]),
             "overlapped": Timing([0.020])}
        r = measured_against_model(t, pieces, pattern)
        assert r["model"]["gain"] > 1.3 and not overlap_shows(r)[0], (pattern, r["model"])
    near = {"compute": Timing([0.010]), "comm": Timing([0.002]), "sequential": Timing([0.012]),
            "overlapped": Timing([0.011])}       # a model of 1.2x: too small to tell, so no pass either
    assert not overlap_shows(measured_against_model(near, 1, "independent"))[0]
    ring = {"compute": Timing([0.010]), "comm": Timing([0.010]), "sequential": Timing([0.020]),
            "overlapped": Timing([0.020]), "waiting": Timing([0.010])}
    assert not overlap_shows(measured_against_model(ring, 2, "consume", first_held=True))[0]
    noisy = {"compute": Timing([0.010]), "comm": Timing([0.005]), "sequential": Timing([0.010, 0.015, 0.020]),
             "overlapped": Timing([0.010, 0.013, 0.016])}      # 1.15x of a 1.5x model, within the spread
    r = measured_against_model(noisy, 1, "independent")
    assert abs(r["off"]) <= TOLERANCE and not overlap_shows(r)[0]
    paid = {"compute": Timing([0.010]), "comm": Timing([0.010]), "sequential": Timing([0.020]),
            "overlapped": Timing([0.011])}
    assert overlap_shows(measured_against_model(paid, 1, "independent"))[0]     # and a real gain passes


def test_gain_words_say_the_medians_and_the_model():
    from lectures.data_parallel.overlap import gain_words
    t = {"compute": Timing([0.010]), "comm": Timing([0.010]), "sequential": Timing([0.020]),
         "overlapped": Timing([0.012])}
    from util.render import markdown_inline, visible_text
    words = gain_words(measured_against_model(t, 1, "independent"))
    assert visible_text(words) == "Overlapped, the step is 1.67× faster, where the model predicts 2.00×"
    assert "without overlap 20 ms (IQR 0), with it 12 ms (IQR 0)" in markdown_inline(words)
    assert "the measured 1.67× is 17% below it" in markdown_inline(words)


def test_real_compute_words_follow_the_timings():
    """Each of the three cases in words that agree with the numbers: no measurable difference,
    overlap slower, overlap faster; and gain_words and the bars say 'slower' below 1."""
    from lectures.data_parallel.overlap import gain_words, real_compute_words
    from lectures.data_parallel.figures import overlap_bars
    from util.render import visible_text
    tied = {"sequential": Timing([0.010, 0.011, 0.012]), "overlapped": Timing([0.0105, 0.0110, 0.0115])}
    words = visible_text(real_compute_words(tied, "with", "without"))
    assert words == ("no measurable difference here (the interquartile ranges overlap); gloo's copies and the "
                     "compute share the cores")
    lost = {"sequential": Timing([0.010, 0.011, 0.012]), "overlapped": Timing([0.020, 0.021, 0.022])}
    words = visible_text(real_compute_words(lost, "with", "without"))
    assert words.startswith("without is 1.91× faster than with") and "overlapping cost time here" in words
    paid = {"sequential": Timing([0.020, 0.021, 0.022]), "overlapped": Timing([0.010, 0.011, 0.012])}
    words = visible_text(real_compute_words(paid, "with", "without"))
    assert words.startswith("with is 1.91× faster than without") and "hides part of the transfers" in words
    slower = measured_against_model({"compute": Timing([0.010]), "comm": Timing([0.010]), **lost}, 1, "independent")
    assert visible_text(gain_words(slower)).startswith("Overlapped, the step is 1.91× slower")
    fig = overlap_bars({"tied": tied, "lost": lost, "stand-in": slower})
    assert [t.get_text() for t in fig.axes[0].texts if "\n" in t.get_text()] == \
        ["tied\nno measurable difference", "lost\n1.91× slower", "stand-in\n1.91× slower (model 2.00×)"]


@pytest.mark.parametrize("lecture,demo", [("lecture_03_data_parallel", "ZeRO-3 prefetch with a compute stand-in"),
                                          ("lecture_06_context_and_expert_parallel", "ring attention forward with a compute stand-in")])
def test_the_release_the_core_demos_time_real_compute_beside_the_stand_in(course_site, lecture, demo):
    """Beside the stand-in's run, the same overlap with its real compute, without and with it,
    timed taking turns in the same demo (what the page's figure draws on top)."""
    from tests.conftest import demo_returns
    found = [d for d in demo_returns(course_site, lecture) if d["name"].startswith(demo)]
    assert len(found) == 1 and found[0]["status"] == "ok", found
    real = found[0]["returns"][0]["real"]
    assert set(real) == {"sequential", "overlapped"}
    assert len(real["sequential"].samples) == len(real["overlapped"].samples) >= 5


def test_published_gpu_numbers_carry_their_source():
    """Issue 39: every published figure names its source, a link and where in it the numbers are,
    and draws with the course's style."""
    from lectures.model import gpu_evidence as G
    from lectures.model.figures import published_figure
    pubs = [v for v in vars(G).values() if isinstance(v, G.Published)]
    assert len(pubs) >= 6
    for pub in pubs:
        assert pub.url.startswith("https://") and pub.source and pub.where and pub.hardware
        assert all(len(points) >= 2 or pub.kind == "bars" for points in pub.series.values())
        assert pub.url in pub.caption() and pub.where in pub.caption()
        published_figure(pub)
    # torchtitan's Table 2, as published (FSDP 8, CP 1 at 32K; FSDP 1, CP 8 at 256K)
    assert dict(G.TORCHTITAN_CP.series["tokens/s per GPU"]) == {32768: 3890, 65536: 2540, 131072: 1071, 262144: 548}
