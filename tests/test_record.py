"""The recorder: each narration call becomes one JSON-ready record that knows where it came from."""
import json

import numpy as np
import pytest
import torch

from util import figure, image, note, record, see, span, table


@pytest.fixture
def recorder():
    rec = record.Recorder()
    previous = record.use(rec)
    yield rec
    record.use(previous)


def a_section():
    note("""
        ## A section
        Indented text is dedented.
    """)


def test_note_is_dedented_and_knows_its_source(recorder):
    a_section()
    (r,) = recorder.records
    assert r["kind"] == "note" and r["text"] == "## A section\nIndented text is dedented."
    assert r["source"]["file"] == "tests/test_record.py" and r["source"]["function"] == "a_section"
    assert r["rank"] is None and r["t"] >= 0
    code = recorder.functions[r["source"]["key"]]
    assert code["code"].startswith("def a_section():") and code["start"] > 1


def test_table_keeps_numbers_as_numbers(recorder):
    table([[np.float32(1.5), torch.tensor(3), "x", None]], header=("a", "b", "c", "d"))
    r = recorder.records[0]
    assert r["rows"] == [[1.5, 3, "x", None]] and r["header"] == ["a", "b", "c", "d"]
    json.dumps(recorder.records)  # everything serializes


def test_figure_becomes_svg_and_is_closed(recorder):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3])
    figure(fig, caption="a line")
    r = recorder.records[0]
    assert r["svg"].lstrip().startswith("<?xml") and "<svg" in r["svg"] and r["caption"] == "a line"
    assert not plt.fignum_exists(fig.number)


def test_see_shows_source_or_cites_a_url(recorder):
    see(a_section)
    see("https://example.org/paper", title="A paper")
    code, link = recorder.records
    assert code["kind"] == "code" and code["name"] == "a_section"
    assert code["file"] == "tests/test_record.py" and code["code"].startswith("def a_section")
    assert link == {**link, "kind": "link", "url": "https://example.org/paper", "title": "A paper"}


def test_image_checks_local_files_and_keeps_urls(recorder, tmp_path):
    with pytest.raises(FileNotFoundError):
        image(tmp_path / "missing.png")
    (tmp_path / "x.png").write_bytes(b"\x89PNG")
    image(tmp_path / "x.png", caption="local", width=50)
    image("https://example.org/x.png")
    local, remote = recorder.records
    assert local["src"] == str(tmp_path / "x.png") and local["width"] == 50
    assert remote["src"] == "https://example.org/x.png"


def test_span_records_its_interval_even_when_the_block_raises(recorder):
    with pytest.raises(KeyError):
        with span("failing block"):
            raise KeyError
    (r,) = recorder.records
    assert r["kind"] == "span" and r["label"] == "failing block" and r["end"] >= r["start"]
    assert r["source"]["function"] == "test_span_records_its_interval_even_when_the_block_raises"


def test_a_record_does_not_read_source_until_the_functions_are_asked_for(monkeypatch):
    # Reading a function's source takes milliseconds; done at the first record of a function it
    # landed inside timed spans (a 28 ms "gap" on lecture 02's overlap timeline).
    import inspect
    from util import record
    calls = []
    real = inspect.getsourcelines
    monkeypatch.setattr(inspect, "getsourcelines", lambda code: calls.append(code) or real(code))
    rec = record.Recorder()
    previous = record.use(rec)
    try:
        record.note("hello")
    finally:
        record.use(previous)
    assert calls == []
    key = rec.records[0]["source"]["key"]
    assert rec.functions[key]["name"] == "test_a_record_does_not_read_source_until_the_functions_are_asked_for"
    assert len(calls) == 1
