"""The counter behind the first-read test's 'at most two measured numbers a sentence': what it
counts and what it leaves alone, so the page test cannot pass by miscounting."""
from tests.support.density import dense_sentences, measured_numbers, sentences


def test_measured_numbers_count_units_decimals_signs_and_spreads():
    assert measured_numbers("ZeRO-1 1.11× faster than ZeRO-3 (76 ms (IQR 75–76.5) vs 84.5 ms)") == \
        ["1.11×", "76 ms", "84.5 ms", "IQR 75–76.5"]
    assert measured_numbers("a step (199 ms (IQR 197–205) alone)") == ["199 ms", "IQR 197–205"]
    assert measured_numbers("rank 0 wrote 3,444,472 bytes, 2.00× DP's") == ["3,444,472 bytes", "2.00×"]
    assert measured_numbers("it reports 2.2975 instead of 1.2791") == ["2.2975", "1.2791"]
    assert measured_numbers("a gradient RMS of 1.6e-05, 34% unchanged") == ["1.6e-05", "34%"]
    assert measured_numbers("from +6.7% at 1.7B to -8.8% at 1T") == ["+6.7%", "-8.8%"]
    assert measured_numbers("883 kB against 2 TB/s") == ["883 kB", "2 TB/s"]
    # a measurement after "at", "a", "one", "each" still counts: only given sizes do not
    assert measured_numbers("it ended at 1.40× the mean, a 1.4× gain, each 2.2 ms hop") == ["1.40×", "1.4×", "2.2 ms"]


def test_names_sizes_given_and_counts_are_not_measurements():
    assert measured_numbers("Llama 3.1 8B on 8 H100s with 4 ranks, v = 32768, ZeRO-3 (§3.3.2)") == []
    assert measured_numbers("a 4 MB bucket, each 2 MB chunk, one 400 Gb/s port, at 64 MB") == []
    assert measured_numbers("74–90 ms for the split lists") == ["90 ms"]          # a range counts once
    assert measured_numbers("1.7–3.9 ms per action") == ["1.7"]


def test_dense_sentences_read_the_main_path_only():
    page = """<main><div class="note"><p>Fast: 1.2 ms, 3.4 ms and 5.6 ms. Fine: 1.2 ms.</p>
      <p>The table: <code>x = 1.0, 2.0, 3.0 ms</code> once.</p>
      <p>Spread on hover: <span class="spread" title="IQR 1.1–1.3 ms, 9 repeats, 4.4 ms">1.2 ms</span>.</p>
      <p>One sentence; 1.0 ms; 2.0 ms: And 3.0 ms.</p>
      <ul><li>An item with 1.0 ms, 2.0 ms and 3.0 ms<ul><li>nested 1 ms</li></ul></li></ul>
      <details><p>Folded: 1.0 ms, 2.0 ms, 3.0 ms.</p></details></div>
      <figure><figcaption>1.0 ms, 2.0 ms, 3.0 ms</figcaption></figure></main>"""
    dense = [s for _, s in dense_sentences(page)]
    assert dense == ["Fast: 1.2 ms, 3.4 ms and 5.6 ms.", "One sentence; 1.0 ms; 2.0 ms: And 3.0 ms.",
                     "An item with 1.0 ms, 2.0 ms and 3.0 ms"]
    assert sentences("One 1.2 ms. Two (2.0 ms). Code three.") == ["One 1.2 ms.", "Two (2.0 ms).", "Code three."]
