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
