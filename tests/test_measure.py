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


def _on_the_page(markdown):
    """What a reader sees of a sentence, and the hovers' details."""
    import re
    from util.render import markdown_inline, visible_text
    return visible_text(markdown), re.findall(r'title="([^"]*)"', str(markdown_inline(markdown)))


def test_compare_says_no_difference_when_spreads_overlap():
    from util.measure import Timing, compare
    a, b = Timing([0.010, 0.011, 0.012, 0.013, 0.014]), Timing([0.0125, 0.013, 0.0135, 0.014, 0.015])
    text, hovers = _on_the_page(compare(a, b))
    assert text == "no measurable difference here (the interquartile ranges overlap)"
    assert hovers == ["ours 12 ms (IQR 11–13), theirs 13.5 ms (IQR 13–14)"]
    fast, slow = Timing([1.0, 1.01, 1.02]), Timing([2.0, 2.02, 2.04])
    assert _on_the_page(compare(fast, slow, "ring", "gloo"))[0] == "ring is 2.00× faster than gloo"
    assert _on_the_page(compare(slow, fast, "ring", "gloo"))[0] == "gloo is 2.00× faster than ring"
    wide = Timing([1.0, 1.0, 3.0, 3.5, 3.6])
    assert _on_the_page(compare(wide, fast, "ring", "gloo"))[0] == \
        "gloo's median is 2.97× lower, but the spreads overlap: no firm ranking"


def test_a_sentence_gets_the_median_and_a_hover_the_spread():
    """`Timing.brief()`: one number in the text; the spread, never lost, on hover."""
    from util.measure import Timing, with_spread
    import pytest
    text, hovers = _on_the_page(f"a step takes {Timing([0.010, 0.011, 0.012, 0.013, 0.015]).brief()}.")
    assert text == "a step takes 12 ms." and hovers == ["median of 5; interquartile range 11–13 ms"]
    with pytest.raises(ValueError, match="no"):
        with_spread("a]b", "detail")
    from util.in_notebook import record_text      # a notebook's text output keeps the spread in brackets
    timing = Timing([0.010, 0.011, 0.012, 0.013, 0.015])
    assert record_text({"kind": "note", "text": f"a step takes {timing.brief()}."}) == \
        "a step takes 12 ms (median of 5; interquartile range 11–13 ms)."


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
