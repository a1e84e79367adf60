"""The test session's course build: made once, read by every test that needs it.

Two builds, each kept in `.pytest_cache/course/<kind>-<key>/` where the key is a hash of the
course's sources (lectures/, util/, exercises/, requirements.txt), of the build's command and of
the torch and Python versions: a re-run with unchanged sources reuses them, and any change to a
source builds anew. Folders of older sources are deleted after an hour (a session still running
may read one).
A file lock makes concurrent test processes (two terminals, pytest-xdist) wait for one build
instead of making two. A failed build is not kept: the next run tries again.

- `pages`: every lecture built quick by ONE torchrun job on 4 ranks (rank 0 narrates, the others
  serve its demos), into `content/`; every demo's full returns in `returns/`. The page, lecture,
  exercise-listing and torchrun tests read it.
- `notebooks`: every companion notebook executed quick on 4 ranks (the pooled launcher), into
  `notebooks/`, with its demos' returns in `returns/`. The notebook tests read it, and the
  torchrun test compares the two builds' numbers.
"""
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CACHE = os.path.join(ROOT, ".pytest_cache", "course")
SOURCES = ("lectures", "util", "exercises", "requirements.txt")
RANKS = 4
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
BUILD_TIMEOUT = 2400      # seconds: a build that takes longer has hung; its log says where


def source_key(*extra):
    """A hash of every source file the builds run, and of the versions that run them."""
    import torch
    digest = hashlib.sha1(f"{torch.__version__} {sys.version} {extra}".encode())
    for top in SOURCES:
        path = os.path.join(ROOT, top)
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, dirs, names in os.walk(path)
            if "__pycache__" not in d and ".ipynb_checkpoints" not in d for f in names
            if not f.endswith((".pyc", ".pyo")))
        for f in files:
            try:
                with open(f, "rb") as fh:
                    data = fh.read()
            except FileNotFoundError:       # an editor's swap file, gone since the walk
                continue
            digest.update(os.path.relpath(f, ROOT).encode())
            digest.update(data)
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def _locked(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Build:
    """A finished build: its folder, exit code, log, seconds, and whether this run reused it."""

    def __init__(self, kind, folder, info, reused):
        self.kind, self.folder, self.reused = kind, folder, reused
        self.returncode, self.seconds, self.command = info["returncode"], info["seconds"], info["command"]

    @property
    def log(self):
        with open(os.path.join(self.folder, "log.txt"), encoding="utf-8", errors="replace") as f:
            return f.read()

    def path(self, *parts):
        return os.path.join(self.folder, *parts)


_running = set()     # build processes not yet finished


def stop(proc):
    """Stop a build and everything it started (its own session: torchrun's ranks, kernels, pools)."""
    import signal
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def stop_all():
    """At the end of a test session: no build outlives it (one the session no longer waited for)."""
    for proc in list(_running):
        stop(proc)


def cached(kind, command, lectures, env=None):
    """Run `command` (a list, with {out} standing for the build's folder) once per source key,
    under a lock; later calls with the same sources reuse its folder."""
    key = source_key(kind, tuple(lectures), tuple(command), tuple(sorted((env or {}).items())))
    folder = os.path.join(CACHE, f"{kind}-{key}")
    with _locked(os.path.join(CACHE, f"{kind}.lock")):
        done = os.path.join(folder, "build.json")
        if os.path.exists(done):
            with open(done) as f:
                return Build(kind, folder, json.load(f), reused=True)
        for old in os.listdir(CACHE):   # builds of older sources, unless a session may still read one
            path = os.path.join(CACHE, old)
            if old.startswith(kind + "-") and os.path.isdir(path) and time.time() - os.path.getmtime(path) > 3600:
                shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)   # a build of these sources that did not finish
        os.makedirs(folder)
        cmd = [part.replace("{out}", folder) for part in command]
        start = time.monotonic()
        with open(os.path.join(folder, "log.txt"), "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {}),
                                                        "COURSE_RETURNS": os.path.join(folder, "returns")},
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            _running.add(proc)
            try:
                rc = proc.wait(timeout=BUILD_TIMEOUT)
            except subprocess.TimeoutExpired:
                stop(proc)
                rc = f"killed after {BUILD_TIMEOUT} s"
            finally:
                _running.discard(proc)
        info = {"returncode": rc, "seconds": round(time.monotonic() - start, 1), "command": cmd}
        # Only a good build is kept for the next run, and only if no source changed while it ran
        # (it would be filed under sources it did not build).
        if rc == 0 and source_key(kind, tuple(lectures), tuple(command), tuple(sorted((env or {}).items()))) == key:
            with open(done, "w") as f:
                json.dump(info, f)
        return Build(kind, folder, info, reused=False)


def pages(lectures):
    """Every lecture of `lectures` built quick by one torchrun job on 4 ranks."""
    return cached("pages", [TORCHRUN, "--standalone", "--nproc-per-node", str(RANKS), "-m", "util.run",
                            *lectures, "--quick", "--out", "{out}/content"], lectures,
                  env={"PYTHONFAULTHANDLER": "1"})


def notebooks(lectures):
    """Every companion notebook of `lectures` executed quick on 4 pooled ranks."""
    return cached("notebooks", [sys.executable, "-m", "util.build_notebooks", *lectures, "--quick",
                                "--world-size", str(RANKS), "--backend", "gloo", "--cell-timeout", "600",
                                "--out", "{out}/notebooks"], lectures)


class Background:
    """The builds this session needs, each started in a thread of its own as soon as the tests
    are collected, so that the unit tests run while the course builds (the tests that read a
    build run last, see conftest.py): on two cores the builds' waits (ranks in collectives,
    kernels starting) and the tests' waits fill each other's idle time. `get(kind)` waits for
    that build and returns it."""

    def __init__(self, plan):
        import threading
        self.done, self.errors = {}, {}
        self.kinds = [kind for kind, _, _ in plan]        # plan: [(kind, function, lectures)]
        self.threads = {kind: threading.Thread(target=self._run, args=(kind, make, lectures),
                                               name=f"course-build-{kind}", daemon=True)
                        for kind, make, lectures in plan}
        for thread in self.threads.values():
            thread.start()

    def _run(self, kind, make, lectures):
        try:
            self.done[kind] = make(lectures)
        except BaseException as e:     # said by get(), in the test that needs the build
            self.errors[kind] = e

    def get(self, kind):
        self.threads[kind].join()
        if kind not in self.done:
            raise RuntimeError(f"the course build '{kind}' did not finish: {self.errors.get(kind)!r}")
        return self.done[kind]
