"""The build command: arguments, the recording it writes, failures, parallel builds, torchrun."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, build
from util import recording, run as runner


def load(out, name="fixture_lecture"):
    with open(os.path.join(out, name + ".json")) as f:
        return json.load(f)


@pytest.mark.parametrize("args, complaint", [
    (["no_such_lecture"], "no lecture 'no_such_lecture'"),
    (["tests.support.fixture_lecture", "--launcher", "threads"], "invalid choice"),
    (["tests.support.fixture_lecture", "--world-size", "0"], "--world-size must be at least 1"),
    (["tests.support.fixture_lecture", "--timeout", "-1"], "--timeout must be a number of seconds between 0 and 86400"),
    (["tests.support.fixture_lecture", "--timeout", "nan"], "--timeout must be a number of seconds between 0 and 86400, not nan"),
    (["tests.support.fixture_lecture", "--timeout", "inf"], "not inf"),
    (["tests.support.fixture_lecture", "--timeout", "1e300"], "not 1e+300"),
    (["lectures.model.gpt"], "'lectures.model.gpt' is not a lecture: it has no main()"),
    (["lectures.nonexistent"], "no module 'lectures.nonexistent'"),
    (["os.nonexistent"], "no module 'os.nonexistent'"),
    (["tests.support.fixture_lecture", "--bogus"], "unrecognized arguments"),
    (["lecture_02_communication", "--world-size", "1"], "runs its demos on 2, 3, 4, 5, 6, 7, 8 ranks, not --world-size 1"),
    (["lecture_03_data_parallel", "--world-size", "3"], "runs its demos on 2, 4, 8 ranks, not --world-size 3"),
    (["tests.support.fixture_lecture", "--out", "/dev/null"], "--out /dev/null is not a folder"),
    ([], "required"),
])
def test_bad_command_line_gives_one_line_and_exit_code_2(args, complaint):
    proc = subprocess.run([sys.executable, "-m", "util.run", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and complaint in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_under_torchrun_the_world_size_is_at_most_the_ranks_it_started(monkeypatch, tmp_path, capsys):
    """Demos that take any number of ranks use torchrun's when it started fewer than 4 (none is
    skipped, so no section reads a skipped demo), and asking for more is refused at once."""
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    assert runner.parse_args(["lecture_02_communication", "--out", str(tmp_path)]).world_size == 2
    with pytest.raises(SystemExit) as refused:
        runner.parse_args(["lecture_02_communication", "--world-size", "4", "--out", str(tmp_path)])
    assert refused.value.code == 2
    assert "--world-size 4 needs 4 ranks, but torchrun started 2" in capsys.readouterr().err


def test_recording_follows_the_schema(fixture_site):
    rec = load(fixture_site)
    assert rec["schema"] == recording.SCHEMA and rec["status"] == "ok"
    assert rec["lecture"] == "fixture_lecture" and rec["title"].startswith("Fixture lecture")
    assert rec["file"] == "tests/support/fixture_lecture.py"
    assert rec["demos"] == {"total": 15, "failed": 0, "expected_failures": 1, "skipped": 0}
    assert rec["summary"].startswith("Small on purpose")
    # 4 workers, and 4 again after the expected failure threw the pool away
    assert rec["startup"]["workers"] == 8 and rec["startup"]["seconds"] > 0
    first = next(r for r in rec["records"] if r["kind"] == "demo")
    assert first["elapsed"] < rec["startup"]["seconds"]      # start-up is not the first demo's time
    env = rec["environment"]
    assert env["backend"] == "gloo" and env["launcher"] == "pool" and env["quick"] is True
    assert env["device"] and env["torch"].startswith("2.")
    kinds = {r["kind"] for r in rec["records"]}
    assert {"note", "table", "figure", "code", "link", "image", "demo"} <= kinds
    for r in rec["records"]:
        assert r["source"]["file"] == "tests/support/fixture_lecture.py" and r["source"]["line"] > 0
        assert r["rank"] is None
        if r["source"]["key"]:
            assert r["source"]["key"] in rec["functions"]
    demos = [r for r in rec["records"] if r["kind"] == "demo"]
    assert [d["world_size"] for d in demos[:9]] == [1, 1, 1, 2, 2, 2, 4, 4, 4]
    talk = demos[8]
    assert [r["rank"] for r in talk["records"] if r["kind"] == "output"] == [0, 1, 2, 3]
    assert "stdout of rank 3" in talk["records"][-1]["text"]
    assert all(r["source"]["function"] == "talk" for r in talk["records"])
    assert len({d["name"] for d in demos}) == len(demos)
    timed = [d for d in demos if d["name"] == "timed work, 2 ranks"][0]
    assert {r["rank"] for r in timed["records"] if r["kind"] == "span"} == {0, 1}


def test_failing_demo_fails_the_build_promptly_and_still_writes_the_page(tmp_path):
    start = time.monotonic()
    proc = build("tests.support.failing_lecture", tmp_path, "--timeout", "60", check=False)
    assert proc.returncode == 1
    assert time.monotonic() - start < 45  # not the 60 s collective timeout
    assert "rank one cannot go on" in proc.stderr and "FAILED" in proc.stderr
    rec = load(tmp_path, "failing_lecture")
    assert rec["status"] == "failed" and rec["demos"]["failed"] == 1
    demo = next(r for r in rec["records"] if r["kind"] == "demo")
    assert demo["status"] == "failed" and "rank 1 raised" in demo["error"]
    assert any("Traceback" in r["text"] for r in demo["records"] if r["kind"] == "error")
    assert not any("Never reached" in r.get("text", "") for r in rec["records"])
    assert (tmp_path / "failing_lecture.html").exists()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


def test_a_failed_build_never_replaces_a_good_page(tmp_path):
    """The first failing build writes its page (there was none); once the page on disk comes
    from a good build, the next failing build keeps it and says so."""
    build("tests.support.failing_lecture", tmp_path, check=False)
    saved = tmp_path / "failing_lecture.json"
    good = json.loads(saved.read_text())
    good["status"] = "ok"                                   # as a build without errors left it
    saved.write_text(json.dumps(good))
    page = (tmp_path / "failing_lecture.html").read_bytes()
    proc = build("tests.support.failing_lecture", tmp_path, check=False)
    assert proc.returncode == 1
    assert "failing_lecture: 1 demo failed; the previous page, which built without errors, is kept" in proc.stderr
    assert (tmp_path / "failing_lecture.html").read_bytes() == page and json.loads(saved.read_text()) == good


def test_write_atomic_never_leaves_half_a_file(tmp_path, monkeypatch):
    target = tmp_path / "page.html"
    recording.write_atomic(str(target), "old")

    def broken_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        recording.write_atomic(str(target), "new " * 1000)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["page.html"]


def test_two_builds_at_once(tmp_path):
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = [subprocess.Popen([sys.executable, "-m", "util.run", "tests.support.fixture_lecture", "--quick",
                               "--out", str(o)], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for o in outs]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    for o in outs:
        assert load(o)["demos"]["failed"] == 0


def build_tiny(tmp_path, body, *flags):
    """Build a throwaway lecture whose main() is `body` (it must live in the repository to be
    importable by the workers)."""
    name = f"_tiny_lecture_{os.getpid()}"      # two test processes never share the file
    path = os.path.join(ROOT, "tests", "support", name + ".py")
    with open(path, "w") as f:
        f.write("from tests.support.fixture_lecture import seeded_noise, skip_a_collective\n"
                "from util import spawn\n\ndef main():\n" + body)
    try:
        return build(f"tests.support.{name}", tmp_path, *flags, check=False)
    finally:
        os.unlink(path)


def test_a_demo_name_used_twice_is_refused_with_a_clear_error(tmp_path):
    proc = build_tiny(tmp_path, "    spawn(seeded_noise, 1, name='noise')\n"
                                "    spawn(seeded_noise, 2, name='noise')\n")
    assert proc.returncode == 1
    assert "a demo named 'noise' already ran in this lecture" in proc.stderr
    assert load(tmp_path, f"_tiny_lecture_{os.getpid()}")["status"] == "failed"


def test_expected_failure_prints_its_status_first_and_its_traceback_only_when_verbose(tmp_path):
    body = "    spawn(skip_a_collective, 2, name='the hang', expect_error=True, timeout=2)\n"
    quiet = build_tiny(tmp_path / "q", body)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    line = next(l for l in quiet.stderr.splitlines() if "the hang" in l)
    assert line.rstrip().endswith("failed, as expected") and "Traceback" not in quiet.stderr
    loud = build_tiny(tmp_path / "v", body, "--verbose")
    after = loud.stderr.split("the hang", 1)[1]
    assert after.splitlines()[0].rstrip().endswith("failed, as expected") and "Traceback" in after


@pytest.mark.torchrun
@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun not installed")
def test_under_torchrun_demos_run_on_sub_groups_and_failures_stay_inside_their_demo(tmp_path):
    """2 ranks from torchrun: 1-rank demos run on rank 0 (rank 1 waits), 2-rank demos on both,
    4-rank demos are skipped with the reason; the expected failure (a rank skips a collective,
    2 s timeout) ends inside its demo and the build goes on and exits 0."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "util.run",
                           "tests.support.fixture_lecture", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = load(tmp_path)
    assert rec["environment"]["launcher"] == "torchrun"
    demos = {d["name"]: d for d in rec["records"] if d["kind"] == "demo"}
    assert demos["sum of ranks, 1 rank"]["status"] == "ok"
    assert demos["sum of ranks, 2 ranks"]["status"] == "ok"
    assert demos["a rank skips a collective"]["status"] == "expected_failure"
    assert demos["draw, 2 ranks"]["status"] == "ok"          # after the failure, demos go on
    skipped = [d for d in demos.values() if d["status"] == "skipped"]
    assert skipped and all(d["world_size"] == 4 and "torchrun started 2" in d["error"]
                           for d in skipped)
    sums = [r for r in demos["sum of ranks, 2 ranks"]["records"] if r["kind"] == "note"]
    assert [r["rank"] for r in sums] == [0, 1] and "**1**" in sums[0]["text"]
    one = [r for r in demos["sum of ranks, 1 rank"]["records"] if r["kind"] == "note"]
    assert [r["rank"] for r in one] == [0] and "**0**" in one[0]["text"]
    assert (tmp_path / "fixture_lecture.html").exists()


def session(sid):
    """Pids of the live processes in session `sid` (a build started in a session of its own:
    the lecture, the fork server, the resource tracker, the workers); zombies are not running."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(entry))
    return out


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_a_signalled_build_leaves_no_course_process_running(tmp_path, how):
    """Signalled while its ranks are inside a demo (asleep), the build leaves nothing running:
    SIGTERM and SIGINT through the build's clean-up, SIGKILL through the workers' watch on it."""
    env = {**os.environ, "COURSE_TEST_MARKERS": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "util.run", "tests.support.sleeping_lecture", "--world-size", "2",
                             "--out", str(tmp_path / "site")], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            # a shell's background job starts with SIGINT ignored, and Python then
                            # keeps ignoring it: give the build Ctrl-C's default, as a terminal does
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        start = time.monotonic()
        while not all(os.path.exists(tmp_path / f"rank{r}") for r in (0, 1)):
            assert time.monotonic() - start < 120 and proc.poll() is None, "the ranks never started"
            time.sleep(0.2)
        assert len(session(proc.pid)) >= 3                  # the lecture and its two ranks, at least
        os.kill(proc.pid, getattr(signal, how))
        proc.wait(timeout=30)
        start = time.monotonic()
        while session(proc.pid) and time.monotonic() - start < 10:
            time.sleep(0.2)
        assert session(proc.pid) == [], f"left running after {how}: {session(proc.pid)}"
    finally:
        if proc.poll() is None or session(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
