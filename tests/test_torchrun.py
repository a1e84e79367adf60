"""The course under torchrun, as a user who outgrows one machine runs it: every lecture on 4
ranks (the session's course build) ends its demos as the pooled launcher does, with the same
numbers where a demo is deterministic (demos for more ranks are skipped and say so),
PyTorch's DDP comm hooks survive their process groups ending, and two torchrun agents on this
machine, as two "nodes" meeting at a c10d rendezvous, build a lecture exactly as one 4-rank job
does. Marked `torchrun` (`make test-torchrun` runs only these)."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import LECTURES, ROOT, built, demo_returns

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
RANKS = 4
needs_torchrun = pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
torchrun_test = [pytest.mark.torchrun, needs_torchrun, pytest.mark.timeout(900)]


def start(module, out, *agent, flags=("--quick",)):
    """One torchrun agent building `module` into `out` (a Popen; stderr captured)."""
    cmd = [TORCHRUN, *agent, "-m", "util.run", module, *flags, "--out", str(out)]
    env = dict(os.environ, PYTHONFAULTHANDLER="1")  # a rank that aborts shows its threads
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=840):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out + err


def one_job(module, out):
    """`torchrun --standalone --nproc-per-node 4 -m util.run MODULE --quick`."""
    started = time.monotonic()
    rc, log = finish(start(module, out, "--standalone", "--nproc-per-node", str(RANKS)))
    return rc, log, time.monotonic() - started


def load(folder, name):
    with open(os.path.join(folder, name + ".json")) as f:
        return json.load(f)


def demos(rec):
    return [d for d in rec["records"] if d["kind"] == "demo"]


def demo_list(rec):
    """(name, ranks, status) of every demo, in order."""
    return [(d["name"], d["world_size"], d["status"]) for d in demos(rec)]


def under_torchrun(pooled, ranks=RANKS):
    """The demo list a `ranks`-rank torchrun job must build: the pooled build's, with the demos
    that need more ranks than the job has skipped."""
    return [(n, w, "skipped" if w > ranks else s) for n, w, s in demo_list(pooled)]


def check_build(rc, log, out, name, expected):
    """The job ended well, rank 0 alone wrote the page, and the demo list is `expected`
    (unless None)."""
    assert "Resource deadlock avoided" not in log, log[-6000:]
    assert rc == 0, log[-6000:]
    for f in (f"{name}.json", f"{name}.html", "index.html"):
        assert os.path.exists(os.path.join(out, f)), f
    summary = [line for line in log.splitlines() if line.startswith(f"{name}: ")]
    assert len(summary) == 1, summary       # one rank wrote the page and said so
    rec = load(out, name)
    assert rec["environment"]["launcher"] == "torchrun"
    got = demo_list(rec)
    if expected is not None:
        assert [d[:2] for d in got] == [d[:2] for d in expected]     # same demos, same order
        assert got == expected, [(e, g) for e, g in zip(expected, got) if e != g]
    for d in demos(rec):
        if d["status"] == "skipped":
            assert f"needs {d['world_size']} ranks, but torchrun started {RANKS}" in d["error"]
    return rec


def pooled_returns(notebooks, name):
    """What each demo of `name`'s notebook returned (the pooled launcher, 4 ranks):
    {(demo, ranks, call): entry}."""
    import pickle
    with open(notebooks / "returns" / f"{name}.pkl", "rb") as f:
        return {(d["name"], d["world_size"], d["call"]): d for d in pickle.load(f)}


def first_difference(a, b, where="returns", rtol=1e-5, atol=1e-7, numbers=True):
    """Where two returned values differ (None when they agree): numbers within a tolerance
    (the pooled and torchrun ranks run with different thread counts), everything else equal.
    Without `numbers` (a demo that timed something or counted bytes), plain numbers and
    timings are not compared, only what was computed: tensors, strings, flags, the shape."""
    import math
    import torch
    from util.measure import Timing
    if not numbers and (isinstance(a, Timing) or isinstance(b, Timing) or (
            isinstance(a, (int, float)) and isinstance(b, (int, float))
            and not isinstance(a, bool) and not isinstance(b, bool))):
        return None
    again = dict(rtol=rtol, atol=atol, numbers=numbers)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{where}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
        close = torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True) \
            if a.is_floating_point() or a.is_complex() else a == b
        return None if bool(close.all()) else f"{where}: tensors differ"
    if isinstance(a, float) and isinstance(b, (int, float)):
        return None if math.isclose(a, b, rel_tol=rtol, abs_tol=atol) or (a != a and b != b) \
            else f"{where}: {a!r} vs {b!r}"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{where}[{k!r}]", **again))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} items"
        return next((d for i, (x, y) in enumerate(zip(a, b))
                     if (d := first_difference(x, y, f"{where}[{i}]", **again))), None)
    if hasattr(a, "__dict__") and type(a) is type(b) and not isinstance(a, type):
        return first_difference(vars(a), vars(b), where, **again)
    try:
        return None if a == b else f"{where}: {a!r:.80} vs {b!r:.80}"
    except Exception:               # numpy arrays and the like
        import numpy as np
        return None if np.allclose(a, b, rtol=rtol, atol=atol) else f"{where}: arrays differ"


def test_first_difference_sees_a_changed_number():
    import torch
    assert first_difference({"a": [1.0, torch.ones(2)]}, {"a": [1.0, torch.ones(2)]}) is None
    assert first_difference({"a": [1.0, torch.ones(2)]}, {"a": [1.0, torch.ones(2) * 1.01]}) == "returns['a'][1]: tensors differ"
    assert first_difference([0.5], [0.5000001]) is None and first_difference([0.5], [0.6]) is not None
    # a timed demo: its numbers may differ, what it computed may not
    assert first_difference({"ms": 1.5, "n": 3, "y": torch.ones(2)}, {"ms": 2.5, "n": 4, "y": torch.ones(2)},
                            numbers=False) is None
    assert first_difference({"ms": 1.5, "y": torch.ones(2)}, {"ms": 1.5, "y": torch.zeros(2)},
                            numbers=False) == "returns['y']: tensors differ"
    assert first_difference([True, "a"], [False, "a"], numbers=False) is not None


@pytest.mark.torchrun
@needs_torchrun
@pytest.mark.parametrize("name", LECTURES)
def test_every_lecture_builds_under_torchrun_with_the_numbers_of_the_pooled_launcher(
        course_site, executed_notebooks, name):
    """The session's course build is one torchrun job on 4 ranks (rank 0 narrates, the others
    serve its demos). Each lecture's demos ended as they do under the pooled launcher (its
    notebook, run on 4 pooled ranks, calls every section), demos that need more than 4 ranks
    are skipped with the reason on the page, and every demo returned on every rank what the
    same call returned under the pool: the same numbers where it timed nothing and counted no
    bytes, and otherwise the same tensors, strings and shape (its plain numbers and timings
    differ from run to run)."""
    _, build = course_site
    rec = load(built(course_site, name), name)
    assert rec["environment"]["launcher"] == "torchrun" and rec["status"] == "ok", rec["status"]
    summary = [line for line in build.log.splitlines() if line.startswith(f"{name}: ")]
    assert len(summary) == 1, summary       # one rank wrote the page and said so
    for d in demos(rec):
        if d["world_size"] > RANKS:
            assert d["status"] == "skipped", d["name"]
            assert f"needs {d['world_size']} ranks, but torchrun started {RANKS}" in d["error"]
    pooled = pooled_returns(executed_notebooks[0].parent, name)
    compared, missing, differ = 0, [], []
    for d in demo_returns(course_site, name):
        if d["status"] == "skipped":
            continue
        twin = pooled.get((d["name"], d["world_size"], d["call"]))
        if twin is None:
            missing.append(d["name"])
            continue
        assert twin["status"] == d["status"], (d["name"], twin["status"], d["status"])
        if d["status"] == "ok":
            compared += 1
            diff = first_difference(twin["returns"], d["returns"], numbers=not (d["timed"] or twin["timed"]))
            if diff:
                differ.append(f"{d['name']}: {diff}")
    print(f"{name}: {compared} demos compared with the pooled launcher's; "
          f"not in the notebook: {missing}")
    assert not differ, differ
    assert not missing, f"demos of the page that its notebook never ran with the same arguments: {missing}"
    assert compared == len([d for d in demo_returns(course_site, name) if d["status"] == "ok"]) >= 1


@pytest.mark.torchrun
@needs_torchrun
def test_a_demo_for_more_ranks_than_torchrun_started_is_skipped_with_its_reason(course_site):
    """Lecture 07's three-axis layout needs 8 ranks: in the 4-rank job it is skipped, the page
    says why, and the build still succeeds."""
    name = "lecture_07_putting_it_together"
    rec = load(built(course_site, name), name)
    skipped = [d for d in demos(rec) if d["status"] == "skipped"]
    assert skipped and all(d["world_size"] > RANKS for d in skipped), [d["name"] for d in skipped]
    assert all(f"torchrun started {RANKS}" in d["error"] for d in skipped)


@pytest.mark.torchrun
@needs_torchrun
@pytest.mark.timeout(900)
def test_ddp_comm_hooks_survive_the_process_groups_ending(tmp_path):
    """The reproducer of the teardown crash: DDP with PyTorch's powerSGD_hook (and the plain
    all-reduce hook) in several demos in a row, the group ending whenever the ranks change
    (4, 2, 4, 2) with the hooks' objects still alive. Before the launcher let a group die on the
    main thread, a rank aborted with "Resource deadlock avoided" at the first PowerSGD demo in
    every run."""
    rc, log, _ = one_job("tests.support.hooks_lecture", tmp_path)
    rec = check_build(rc, log, tmp_path, "hooks_lecture", None)
    assert {d["status"] for d in demos(rec)} == {"ok"}
    assert len(demos(rec)) >= 12 and {d["world_size"] for d in demos(rec)} == {2, 4}


@pytest.fixture(scope="module")
def fixture_one_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_job")
    rc, log, _ = one_job("tests.support.fixture_lecture", out)
    return rc, log, out


@pytest.mark.torchrun
@needs_torchrun
@pytest.mark.timeout(900)
def test_the_fixture_lecture_under_torchrun_builds_the_pooled_demos(fixture_site, fixture_one_job):
    rc, log, out = fixture_one_job
    check_build(rc, log, out, "fixture_lecture",
                under_torchrun(load(fixture_site, "fixture_lecture")))


@pytest.mark.torchrun
@needs_torchrun
@pytest.mark.timeout(300)
def test_under_torchrun_a_rank_in_an_endless_loop_ends_its_demo_at_the_deadline(tmp_path):
    """No pool can stop a torchrun rank from outside: the rank interrupts itself at the demo's
    deadline, the demo fails (as this one expects) naming it, and the next demo runs."""
    started = time.monotonic()
    rc, log = finish(start("tests.support.endless_lecture", tmp_path, "--standalone", "--nproc-per-node", "2"),
                     timeout=240)
    assert rc == 0, log[-6000:]
    rec = load(tmp_path, "endless_lecture")
    assert demo_list(rec) == [("loop_forever_on_the_last_rank", 2, "expected_failure"), ("sum_of_ranks", 2, "ok")]
    assert "deadline of 3 s" in demos(rec)[0]["error"]
    assert demos(rec)[1]["returns"] and time.monotonic() - started < 150


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_notes(rec):
    """What each rank wrote in each demo: {demo: [(rank, text), ...]}."""
    return {d["name"]: [(r["rank"], r["text"]) for r in d["records"] if r["kind"] in ("note", "output")]
            for d in demos(rec)}


@pytest.mark.torchrun
@needs_torchrun
@pytest.mark.timeout(900)
def test_two_agents_as_two_nodes_build_a_lecture_as_one_four_rank_job_does(tmp_path, fixture_one_job):
    """What scripts/course.sbatch does across hosts, on one machine: two torchrun agents
    (`--nnodes 2 --node-rank 0|1`, 2 processes each) meet at a c10d rendezvous on localhost.
    One of them holds global rank 0 and writes the page; the demos, their statuses and what
    every rank said are those of one 4-rank job (the expected failure stays inside its demo)."""
    rc1, log1, out1 = fixture_one_job
    assert rc1 == 0, log1[-6000:]
    one = load(out1, "fixture_lecture")
    port = free_port()
    outs = [tmp_path / f"node{i}" for i in (0, 1)]
    agents = [start("tests.support.fixture_lecture", outs[i], "--nnodes", "2", "--node-rank", str(i),
                    "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", f"two-nodes-{port}")
              for i in (0, 1)]
    ended = [finish(a) for a in agents]
    for rc, log in ended:
        assert "Resource deadlock avoided" not in log and rc == 0, log[-6000:]
    writers = [i for i in (0, 1) if os.path.exists(outs[i] / "fixture_lecture.json")]
    assert len(writers) == 1, writers          # the agent holding rank 0, and only it
    node = writers[0]
    assert not os.path.exists(outs[1 - node]) or not os.listdir(outs[1 - node])
    rec = check_build(ended[node][0], ended[0][1] + ended[1][1], outs[node], "fixture_lecture",
                      demo_list(one))
    assert rank_notes(rec) == rank_notes(one)
    four = next(d for d in demos(rec) if d["name"] == "sum of ranks, 4 ranks")
    assert [r["rank"] for r in four["records"] if r["kind"] == "note"] == [0, 1, 2, 3]


def test_the_slurm_script_is_valid_bash_and_the_readme_points_at_it():
    script = os.path.join(ROOT, "scripts", "course.sbatch")
    proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = open(script).read()
    assert text.startswith("#!/bin/bash\n")
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    body = text.split(directives[-1], 1)[0].splitlines()[1:]
    assert all(line.startswith("#SBATCH") for line in body)   # Slurm reads them only up front
    assert "--nodes=2" in text and "torchrun" in text and "--rdzv-backend c10d" in text
    assert "scripts/course.sbatch" in open(os.path.join(ROOT, "README.md")).read()
