"""Under torchrun with fewer ranks than a demo needs, the demo is skipped (util.torchrun_job) and
a section that reads its results goes on without them. Each section here runs with a stub spawn
that skips every demo, as a one-rank torchrun job would: no rank starts, so it is cheap."""
import pytest

import lectures.lecture_04_tensor_parallel as L04
import lectures.lecture_06_context_and_expert_parallel as L06
import lectures.lecture_07_putting_it_together as L07
import lectures.tensor_parallel.deep_dives as L04_deep_dives
import lectures.layout.deep_dives as L07_deep_dives
from util import launch, record, settings


def skipping_spawn(fn, world_size=None, *, name=None, **kwargs):
    """What spawn returns for a demo torchrun has too few ranks for, and records on the page."""
    run = launch.Run(name=name or fn.__name__, world_size=world_size, status="skipped",
                     error=f"needs {world_size} ranks, but torchrun started 1")
    record.current().add("demo", name=run.name, world_size=world_size, status=run.status, error=run.error)
    return run


def run_skipping(monkeypatch, modules, section):
    """Run `section()` with every demo of `modules` skipped; the demo records it left."""
    for module in modules:
        monkeypatch.setattr(module, "spawn", skipping_spawn)
    recorder = record.Recorder()
    previous = record.use(recorder)
    try:
        section()
    finally:
        record.use(previous)
    demos = [r for r in recorder.records if r["kind"] == "demo"]
    assert demos and all(d["status"] == "skipped" and "torchrun started 1" in d["error"] for d in demos)
    return demos


@pytest.mark.parametrize("module,section", [(L06, "ulysses_section"), (L07, "the_mesh")])
def test_a_section_goes_on_without_a_skipped_demo(monkeypatch, module, section):
    if module is L06:
        monkeypatch.setattr(L06, "_VARIANT_RUN", {})
    run_skipping(monkeypatch, [module], getattr(module, section))


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_lecture_04_goes_on_without_its_skipped_demos(monkeypatch, quick):
    """Every section of lecture 04's main(), its deep dives included: the page is written with
    each demo marked skipped and none of its numbers."""
    monkeypatch.setattr(settings, "quick", quick)
    run_skipping(monkeypatch, [L04, L04_deep_dives], L04.main)


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
def test_lecture_07s_pytorch_pieces_go_on_without_their_skipped_demos(monkeypatch, quick):
    """The full build's 8-rank dp×tp×pp run of PyTorch's pieces: a 4-rank torchrun job skips it,
    and the deep dive lists it as skipped (it read the missing returns, and the build stopped)."""
    monkeypatch.setattr(settings, "quick", quick)
    demos = run_skipping(monkeypatch, [L07_deep_dives], L07_deep_dives.pytorch_pieces)
    assert len(demos) == (3 if quick else 5)
