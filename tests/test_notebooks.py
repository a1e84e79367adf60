"""The companion notebooks: committed clean, executed headless by papermill (`make notebooks`
--quick on 4 ranks, the session's notebook build: tests/support/course_build.py), checked on
what they computed, and their HTML opened offline in a browser."""
import json
import os
import subprocess
import sys

import pytest
# nbformat is imported inside the tests that read notebooks: its import (jsonschema) costs
# seconds at every collection, even of `pytest -k` on another test.

from tests.conftest import ARTIFACTS, LECTURES, ROOT, Watched
from tests.support.sections import sections_of
from util import build_notebooks as tool

NAMES = tool.available()
RANKS = 4                                   # the notebooks run on as many ranks as the pages
CLI = [sys.executable, "-m", "util.build_notebooks"]


def _all_equal(values):
    return len(values) >= 2 and all(v == values[0] for v in values)


# What each notebook must have computed (its `checks` cell publishes these as JSON); beyond
# these, every boolean a notebook publishes must be True.
EXPECT = {
    "lecture_01_memory_and_precision": lambda c: (
        c["param_count_matches"] is True and c["recomputation_gradients_equal"] is True
        and c["accumulation_gradients_equal"] is True and c["attention_equals_sdpa"] is True
        and c["attention_max_diff"] <= 1e-10 and c["fp8_tile_error"] < c["fp8_per_tensor_error"]),
    "lecture_02_communication": lambda c: (
        c["ring_equals_builtin"] is True and c["ring_max_abs_error"] <= 1e-5
        and c["all_reduce_is_reduce_scatter_plus_all_gather"] is True
        and c["ranks"] == RANKS),
    "lecture_03_data_parallel": lambda c: (
        c["replicas_identical"] is True and _all_equal(c["parameter_checksums"])
        and len(c["parameter_checksums"]) == RANKS
        and c["matches_single_process"] is True and c["max_abs_diff_vs_single_process"] <= 1e-5
        and c["zero_matches_single_process"] is True and c["zero_max_abs_diff"] <= 1e-5),
    "lecture_04_tensor_parallel": lambda c: (
        c["ranks"] == RANKS and c["matches_single_process"] is True
        and c["max_abs_diff_vs_single_process"] <= 1e-4 and c["ranks_agree"] is True),
    "lecture_05_pipeline_parallel": lambda c: (
        c["ranks"] == RANKS and c["matches_single_process"] is True and 0 < c["simulated_bubble"] < 1
        and c["every_parameter_on_one_stage"] is True),
    "lecture_06_context_and_expert_parallel": lambda c: (
        c["ranks"] == RANKS and c["ring_matches_single_process"] is True and c["ring_max_abs_diff"] <= 1e-10
        and c["expert_parallel_matches"] is True and c["same_tokens_dropped"] is True),
    "lecture_07_putting_it_together": lambda c: (
        c["ranks"] == RANKS and c["matches_single_process"] is True
        and c["estimator_exact_for_weights_grads_optimizer"] is True
        and c["search_found_a_fitting_layout"] is True),
    "lecture_08_checkpoints_and_restarts": lambda c: (
        c["ranks"] == RANKS and c["matches_single_process"] is True and c["resumed_at"] == 2
        and c["max_abs_diff_vs_single_process"] <= 1e-6 and c["saved_under"] != c["loaded_under"]),
}


def outputs(nb):
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            yield cell, out


def published_checks(nb):
    """Merged JSON of every cell tagged `checks`."""
    found = {}
    for cell, out in outputs(nb):
        if "checks" in cell.metadata.get("tags", []) and "application/json" in out.get("data", {}):
            found.update(out["data"]["application/json"])
    return found


@pytest.fixture(scope="module")
def executed(executed_notebooks):
    """Every notebook run once through the real command line, quick, on 4 ranks."""
    return executed_notebooks


def test_there_are_notebooks():
    assert set(LECTURES) <= set(NAMES)            # every lecture has its companion notebook
    assert set(EXPECT) == set(NAMES)              # and says what its notebook must compute


@pytest.mark.parametrize("name", NAMES)
def test_committed_clean_with_parameters(name):
    import nbformat
    nb = nbformat.read(os.path.join(tool.NOTEBOOKS, name + ".ipynb"), as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "commit without outputs"
    first = nb.cells[0]
    assert first.cell_type == "code" and "parameters" in first.metadata.get("tags", [])
    for knob in ("quick", "world_size", "backend"):
        assert f"{knob} =" in first.source, f"parameters cell lacks {knob}"
    assert nb.metadata.kernelspec.name == tool.KERNEL
    prose = " ".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "pickle" in prose and f"lectures/{name}.py" in prose
    assert any("checks" in c.metadata.get("tags", []) for c in code), "no checks cell"


def test_sections_of_sees_the_deep_dives():
    """The sections inside deep dives count: lecture 02 runs `this_machine` inside one."""
    assert "this_machine" in sections_of("lecture_02_communication")


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_every_section(name):
    """Every section function the lecture's main() calls has its cell (lectures grow), the deep
    dives' sections included."""
    import nbformat
    sections = sections_of(name)
    nb = nbformat.read(os.path.join(tool.NOTEBOOKS, name + ".ipynb"), as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    missing = [s for s in sections if f"lec.{s}(" not in code]
    assert sections and not missing, f"{name}.ipynb has no cell for section(s) {missing}"
    # and each once: a cell that calls a wrapper of several sections would run them twice
    called = [c.source.strip()[4:].split("(")[0] for c in nb.cells if c.cell_type == "code"
              and c.source.strip().startswith("lec.") and c.source.strip().endswith(")")
              and "\n" not in c.source.strip()]
    assert sorted(called) == sorted(set(called)) and set(called) <= set(sections), called


def test_cli_ran_every_notebook(executed):
    out, build = executed
    assert build.returncode == 0, build.log[-4000:]
    for name in NAMES:
        assert f"{name}: ok in" in build.log
        assert os.path.isfile(out / f"{name}.ipynb") and os.path.isfile(out / f"{name}.html")
    assert not [f for f in os.listdir(out) if f.startswith(".tmp-")], "temporary files left"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_outputs(executed, name):
    import nbformat
    out, _ = executed
    nb = nbformat.read(out / f"{name}.ipynb", as_version=4)
    errors = [o for _, o in outputs(nb) if o.output_type == "error"]
    assert not errors, f"{errors[0].ename}: {errors[0].evalue}"
    stderr = "".join(o.get("text", "") for _, o in outputs(nb)
                     if o.output_type == "stream" and o.name == "stderr")
    assert "Traceback" not in stderr, stderr[-2000:]
    text = json.dumps([o.get("data", {}).get("text/plain", "") for _, o in outputs(nb)])
    assert f"quick=True, world_size={RANKS}, backend=gloo" in text, "parameters were not applied"
    assert "demo " in text, "no demo ran"
    # Knobs and what was shown: at least one table and one figure came out inline.
    mimes = [m for _, o in outputs(nb) for m in o.get("data", {})]
    assert "image/svg+xml" in mimes, "no figure shown"
    assert any("<table" in o.get("data", {}).get("text/html", "") for _, o in outputs(nb))
    checks = published_checks(nb)
    assert checks, "the notebook published no checks"
    assert all(v is True for v in checks.values() if isinstance(v, bool)), checks
    assert EXPECT[name](checks), checks


def exercise_verdicts(nb):
    """{exercise: (passed, detail)} from the JSON every cell tagged `check` published."""
    found = {}
    for cell, out in outputs(nb):
        data = out.get("data", {}).get("application/json")
        if "check" in cell.metadata.get("tags", []) and data and "exercise" in data:
            found[data["exercise"]] = (data["passed"], data["detail"])
    return found


@pytest.mark.parametrize("name", NAMES)
def test_exercises_fail_with_stubs(executed, name):
    """solutions = False (the default): the notebook ran to the end (test_notebook_outputs) and
    every exercise's check reported passed: false, saying the stub is not written yet and giving
    its hint — the stubs fail, so the checks can fail."""
    import nbformat
    import exercises
    out, _ = executed
    nb = nbformat.read(out / f"{name}.ipynb", as_version=4)
    verdicts = exercise_verdicts(nb)
    assert set(verdicts) == {n for n, _ in exercises.listing(name)}, verdicts
    assert not any(passed for passed, _ in verdicts.values()), verdicts
    for exercise, (_, detail) in verdicts.items():
        assert "NotImplementedError" in detail and "hint:" in detail, (exercise, detail)


@pytest.mark.parametrize("name", NAMES)
def test_solutions_true_hands_every_check_the_reference(name):
    """`solutions = True` in the parameters cell: each exercise cell binds the names its check
    cell passes to the course's reference solution (whose check passes in test_exercises: each
    reference is evaluated once, there), and the reference's source is not in the notebook."""
    import ast
    import exercises
    import nbformat
    from util import exercise as engine
    nb = nbformat.read(os.path.join(tool.NOTEBOOKS, name + ".ipynb"), as_version=4)
    stubs = [c.source for c in nb.cells if "exercise" in c.metadata.get("tags", [])]
    checks = [c.source for c in nb.cells if "check" in c.metadata.get("tags", [])]
    listed = [n for n, _ in exercises.listing(name)]
    assert len(stubs) == len(checks) == len(listed) >= 3
    everything = "\n".join(c.source for c in nb.cells)
    for exercise, stub, check in zip(listed, stubs, checks):
        ns = {**engine.namespace(), "solutions": True, "exercises": exercises}
        exec(compile(stub, f"<{exercise} cell>", "exec"), ns)
        call = ast.parse(check).body[0].value
        assert call.args[0].value == exercise, check
        handed = tuple(ns[a.id] for a in call.args[1:])
        assert handed == exercises.get(exercise).solution, exercise
        for fn in handed:
            assert engine.source_of(fn).strip() not in everything, f"{exercise}'s reference is in the notebook"


def _open_offline(browser, path, shot=None):
    w = Watched(browser)
    try:
        w.page.goto(f"file://{path}")
        w.page.wait_for_load_state("load")
        info = w.page.evaluate("""() => ({title: document.title,
            demos: document.querySelectorAll('.course-demo').length,
            images: [...document.images].filter(i => !i.complete || !i.naturalWidth).length})""")
        if shot:
            os.makedirs(os.path.dirname(shot), exist_ok=True)
            # The viewport only: a full-page shot of a notebook (dozens of inline SVGs, tens of
            # thousands of pixels tall) can take Chromium longer than 30 s on a loaded 2-core CI.
            w.page.screenshot(path=shot, timeout=120_000)
        return w.requests, w.errors, info
    finally:
        w.close()


@pytest.mark.parametrize("name", NAMES)
def test_html_is_offline(browser, executed, name):
    out, _ = executed
    path = str(out / f"{name}.html")
    with open(path, encoding="utf-8") as f:
        page = f.read()
    assert "<script src" not in page and 'rel="stylesheet" href="http' not in page
    requests, errors, info = _open_offline(browser, path, os.path.join(ARTIFACTS, f"notebook_{name}.png"))
    assert requests and all(u.startswith(("file:", "data:")) for u in requests), requests
    assert not errors, errors
    assert info["demos"] >= 1 and info["images"] == 0, info
    assert info["title"] and info["title"] != name, "title should be the lecture's heading"


def test_bad_command_line():
    for argv in (["--world-size", "0"], ["no_such_notebook"], ["--bogus"], ["missing.ipynb"]):
        proc = subprocess.run([*CLI, *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "error:" in proc.stderr, proc.stderr


def test_failing_notebook_is_loud(tmp_path):
    """A failed check stops the run: exit 1, one line naming the notebook, cell and reason; the
    executed copy and its page are still written, and no worker is left behind to die noisily."""
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": tool.KERNEL, "display_name": "course", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("quick = False", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(
                    "from util import in_notebook, spawn\nfrom tests.support import fixture_lecture\n"
                    "in_notebook.setup(quick=quick, world_size=1, backend='gloo')\n"
                    "run = spawn(fixture_lecture.sum_of_ranks, 1)"),
                nbformat.v4.new_code_cell("in_notebook.checks(sum_is_one=run.returns == [1.0])")]
    source = tmp_path / "broken.ipynb"
    nbformat.write(nb, source)
    out = tmp_path / "out"
    proc = subprocess.run([*CLI, str(source), "--out", str(out), "--cell-timeout", "120"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("util.build_notebooks: error: broken failed"), last
    assert ": AssertionError: check failed: sum_is_one" in last and " cell " in last, last
    # jupyter_client interrupts a kernel that is slow to shut down (its pool stopping on a loaded
    # machine) and the kernel logs one line about it; a worker dying noisily prints a traceback
    workers = "\n".join(line for line in proc.stderr.splitlines()
                        if "[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel" not in line)
    assert "KeyboardInterrupt" not in workers and "Traceback" not in workers, proc.stderr[-3000:]
    ran = nbformat.read(out / "broken.ipynb", as_version=4)  # kept, showing the error
    assert any(o.output_type == "error" for _, o in outputs(ran))
    assert os.path.isfile(out / "broken.html")


def test_recorder_displays_each_kind(monkeypatch):
    """In-process: what the display recorder shows for notes, tables, figures, code and demos."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tests.support import fixture_lecture
    from util import launch, in_notebook, record
    shown = []
    monkeypatch.setattr(in_notebook, "_display", shown.append)
    import dataclasses
    saved, previous = dataclasses.asdict(launch.settings), record.current()
    try:
        in_notebook.setup(quick=True, world_size=2, backend="gloo", timeout=launch.settings.timeout)
        record.note("## Heading\nmath $a^2$ and <b>tags</b>")
        record.table([[1, 0.5]], header=["n", "x"])
        fig, _ = plt.subplots()
        record.figure(fig, caption="cap")
        record.see(fixture_lecture.sum_of_ranks)
        run = launch.spawn(fixture_lecture.talk, 2)
        with pytest.raises(AssertionError, match="bad"):
            in_notebook.checks(good=True, bad=False)
    finally:
        for key, value in saved.items():
            setattr(launch.settings, key, value)
        record.use(previous)
    settings_line, note, tab, fig_, code, demo, checks = shown
    assert "world_size=2" in settings_line["text/plain"]
    assert "<math" in note["text/html"] and "&lt;b&gt;" in note["text/html"]
    assert "<table" in tab["text/html"] and "0.5" in tab["text/html"]
    assert fig_["image/svg+xml"].lstrip().startswith("<?xml") and "cap" in fig_["text/html"]
    assert "sum_of_ranks" in code["text/html"]
    assert run.status == "ok" and demo["text/html"].count(">rank ") == 2
    assert "[rank 1] stdout of rank 1" in demo["text/plain"]
    assert checks["application/json"] == {"good": True, "bad": False}


def test_index_links_the_notebook_page(fixture_site, tmp_path):
    """Written into <content>/notebooks/, the pages get a link from the refreshed index."""
    import shutil
    site = tmp_path / "content"
    shutil.copytree(fixture_site, site)
    assert 'href="notebooks/fixture_lecture.html"' not in (site / "index.html").read_text()
    (site / "notebooks").mkdir()
    (site / "notebooks" / "fixture_lecture.html").write_text("<!DOCTYPE html><title>nb</title>")
    tool.refresh_index(str(site / "notebooks"))
    assert 'href="notebooks/fixture_lecture.html"' in (site / "index.html").read_text()


def test_cell_timeout_is_loud(tmp_path):
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": tool.KERNEL, "display_name": "course", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("quick = False", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("import time\ntime.sleep(60)")]
    source = tmp_path / "slow.ipynb"
    nbformat.write(nb, source)
    proc = subprocess.run([*CLI, str(source), "--out", str(tmp_path / "out"), "--cell-timeout", "3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("util.build_notebooks: error: slow failed") and "3 s cell timeout" in last, last
    ran = nbformat.read(tmp_path / "out" / "slow.ipynb", as_version=4)
    assert any(o.get("ename") == "CellTimeoutError" for _, o in outputs(ran))
