"""Each lecture's recording from the session's course build is right: the build ended well, no
demo failed unless it was meant to (and then the page shows the lesson), every section that
main() calls — the deep dives' included — recorded something, and every figure was drawn."""
import pytest

from tests.conftest import LECTURES, recording, walk
from tests.support.sections import sections_of


def test_the_course_build_ended_well(course_site):
    """The session's course build (one torchrun job, every lecture): the first test that reads
    it, so a slow build shows in --durations under this name, not under a page test."""
    _, build = course_site
    assert build.returncode == 0, build.log[-6000:]


@pytest.mark.parametrize("name", LECTURES)
def test_the_recording_is_right(course_site, name):
    rec = recording(course_site, name)
    assert rec["status"] == "ok", [r["text"][:2000] for r in rec["records"] if r["kind"] == "error"]
    assert rec["demos"]["failed"] == 0, rec["demos"]
    demos = [r for r in walk(rec["records"]) if r["kind"] == "demo"]
    assert demos and rec["demos"]["total"] == len(demos)
    for d in demos:
        assert d["status"] in ("ok", "expected_failure", "skipped"), (d["name"], d["status"])
        if d["status"] != "ok":
            assert d["error"], f"{d['name']} ended {d['status']} without saying why"
    made = {r["source"].get("section") for r in rec["records"] if r.get("source")}
    missing = [s for s in sections_of(name) if s not in made]
    assert not missing, f"{name}: sections main() calls that recorded nothing: {missing}"
    figures = [r for r in walk(rec["records"]) if r["kind"] == "figure"]
    assert figures, f"{name} drew no figure"
    for f in figures:
        assert f["svg"].lstrip().startswith(("<?xml", "<svg")) and "<path" in f["svg"], f["caption"][:80]


def main_path(records):
    """The records a first read meets: everything outside the deep dives."""
    depth = 0
    for rec in records:
        if rec["kind"] == "deep_dive":
            depth += 1 if rec["edge"] == "begin" else -1
        elif depth == 0:
            yield rec


@pytest.mark.parametrize("name", LECTURES)
def test_the_main_path_shows_published_gpu_evidence_as_a_figure(course_site, name):
    """Where this CPU cannot show a technique pay, each lecture's main path draws what GPUs
    measured, as published, with its source linked in the caption."""
    figures = [r for r in main_path(recording(course_site, name)["records"]) if r["kind"] == "figure"]
    published = [f["caption"] for f in figures if "Published, not measured here" in f["caption"]]
    assert published, f"{name}: no published GPU figure on the main path"
    assert all("](https://" in caption for caption in published), published
