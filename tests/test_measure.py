"""util.measure: timing things against each other."""
from util.measure import measure_side_by_side


def test_measure_side_by_side_takes_turns():
    """Each thing is warmed up, then timed once per round, the order rotating every round."""
    calls = []
    times = measure_side_by_side({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"),
                                  "c": lambda: calls.append("c")}, warmup=1, repeats=4)
    assert calls[:3] == ["a", "b", "c"]                             # the warm-ups
    assert calls[3:] == list("abc" "bca" "cab" "abc")               # rounds, rotating
    assert {k: len(t.samples) for k, t in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(s >= 0 for t in times.values() for s in t.samples)


def test_compare_says_no_difference_when_spreads_overlap():
    from util.measure import Timing, compare
    a, b = Timing([1.0, 1.1, 1.2, 1.3, 1.4]), Timing([1.25, 1.3, 1.35, 1.4, 1.5])
    assert compare(a, b).startswith("no measurable difference here")
    fast, slow = Timing([1.0, 1.01, 1.02]), Timing([2.0, 2.02, 2.04])
    assert compare(fast, slow, "ring", "gloo").startswith("ring 2.00× faster than gloo")
    assert compare(slow, fast, "ring", "gloo").startswith("gloo 2.00× faster than ring")


def test_machine_says_only_the_ranks_and_oversubscription(monkeypatch):
    from util import measure
    monkeypatch.setattr(measure, "usable_cores", lambda: 2)
    assert measure.machine(2) == "2 ranks" and measure.machine() == "one process"
    assert measure.machine(4).startswith("4 ranks, taking turns on 2 cores")


def test_a_range_never_reads_the_same_number_twice():
    from util.measure import value_range
    assert value_range(23.81, 26.6, "GB/s") == "23.8–26.6 GB/s"
    assert value_range(1.01, 1.04, "GB/s") == "1.01–1.04 GB/s"    # one more decimal, not "1.0–1.0"
    assert value_range(2.0, 2.0, "×") == "2.0 ×"


def test_a_timing_never_prints_its_quartiles_alike():
    from util.measure import Timing
    t = Timing([0.2791, 0.2792, 0.2793, 0.2794, 0.2795])
    assert "279–279" not in t.ms() and "IQR 279.2–279.4" in t.ms()
    assert Timing([0.5] * 5).ms() == "500 ms (IQR 0)"
