"""The course under torchrun, as a user who outgrows one machine runs it: every lecture on 4
ranks builds the same demos as the pooled build (demos for more ranks are skipped and say so),
PyTorch's DDP comm hooks survive one process group per demo, and two torchrun agents on this
machine, as two "nodes" meeting at a c10d rendezvous, build a lecture exactly as one 4-rank job
does. Marked `torchrun` (`make test-torchrun` runs only these)."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import LECTURES, ROOT, built

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


@pytest.mark.torchrun
@needs_torchrun
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", LECTURES)
def test_every_lecture_builds_under_torchrun_with_the_demos_of_the_pooled_build(course_site, tmp_path, name):
    """4 ranks from torchrun, quick sizes: the demo list (names, ranks, statuses) equals the
    pooled quick build's that the session already made, except demos that need more than 4
    ranks, which are skipped with the reason on the page."""
    pooled = load(built(course_site, name), name)
    rc, log, seconds = one_job(name, tmp_path)
    print(f"{name}: torchrun {seconds:.1f} s, pooled {pooled['elapsed']:.1f} s")
    check_build(rc, log, tmp_path, name, under_torchrun(pooled))


@pytest.mark.torchrun
@needs_torchrun
@pytest.mark.timeout(900)
def test_ddp_comm_hooks_survive_a_process_group_per_demo(tmp_path):
    """The reproducer of the teardown crash: DDP with PyTorch's powerSGD_hook (and the plain
    all-reduce hook) in several demos in a row, each on a group of its own. Before the launcher
    let a demo's group die on the main thread, a rank aborted with "Resource deadlock avoided"
    at the first PowerSGD demo in every run."""
    rc, log, _ = one_job("tests.hooks_lecture", tmp_path)
    rec = check_build(rc, log, tmp_path, "hooks_lecture", None)
    assert {d["status"] for d in demos(rec)} == {"ok"}
    assert len(demos(rec)) >= 12 and {d["world_size"] for d in demos(rec)} == {2, 4}


@pytest.fixture(scope="module")
def fixture_one_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_job")
    rc, log, _ = one_job("tests.fixture_lecture", out)
    return rc, log, out


@pytest.mark.torchrun
@needs_torchrun
@pytest.mark.timeout(900)
def test_the_fixture_lecture_under_torchrun_builds_the_pooled_demos(fixture_site, fixture_one_job):
    rc, log, out = fixture_one_job
    check_build(rc, log, out, "fixture_lecture",
                under_torchrun(load(fixture_site, "fixture_lecture")))


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
    agents = [start("tests.fixture_lecture", outs[i], "--nnodes", "2", "--node-rank", str(i),
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
