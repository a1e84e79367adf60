"""Shared test fixtures. Tests run on CPU with gloo, whatever the machine has."""
import os
import pathlib
import subprocess
import sys
import time

import pytest

from lectures import LECTURES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(ROOT, "tests", "artifacts")  # screenshots etc., ignored by git


@pytest.fixture(scope="session", autouse=True)
def gloo_ranks():
    """spawn() called from tests uses gloo and a short collective timeout; pools are shared by
    the whole session and stopped at its end."""
    from util import launch
    launch.settings.backend, launch.settings.timeout = "gloo", 30.0
    yield launch.settings
    launch.shutdown()


def build(lecture, out, *flags, check=True):
    """Build a lecture with the real command line; returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "util.run", lecture, "--out", str(out), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


# --- the session's course build: made once, read by many tests ------------------------------

BUILD_READERS = ("course_site", "executed_notebooks")
# Tests marked `timed` (a browser's redraw, overlap against its model, a bandwidth) run after
# both builds, on a machine no build shares.
_BUILDS = []        # the session's builds, reported at the end of the run
_background = None
_START = time.monotonic()
_PHASE, _SPANS, _WAITED = {}, {}, {}    # test -> phase; test -> [start, end]; build -> seconds waited


def _lectures():
    # COURSE_ONLY=lecture_04_tensor_parallel,... builds only those (while working on one lecture)
    only = [n for n in os.environ.get("COURSE_ONLY", "").split(",") if n]
    return [n for n in LECTURES if not only or n in only]


@pytest.hookimpl(trylast=True)      # after -k and -m have deselected what will not run
def pytest_collection_modifyitems(session, config, items):
    """Start the builds the collected tests need in the background, and run the tests that read
    them last: the unit tests run while the course builds."""
    global _background
    from tests.support import course_build
    from util import build_notebooks

    def reads(item, fixture):
        return fixture in getattr(item, "fixturenames", ())
    def timed(item):
        return item.get_closest_marker("timed") is not None
    late = [i for i in items if any(reads(i, f) for f in BUILD_READERS) or timed(i)]
    # each build's own test first: --durations then names the build, not a test that waited for it
    first = ("test_the_course_build_ended_well", "test_cli_ran_every_notebook")
    items[:] = [i for i in items if i not in late] + \
        sorted(late, key=lambda i: (timed(i), reads(i, "executed_notebooks"),
                                    i.name not in first))
    for i in items:
        _PHASE[i.nodeid] = ("timed, after the builds" if timed(i) else
                            "reading the builds" if i in late else "unit tests, while the builds run")
    plan = []
    if any(reads(i, "course_site") for i in items):
        plan.append(("pages", course_build.pages, _lectures()))
    if any(reads(i, "executed_notebooks") for i in items):
        plan.append(("notebooks", course_build.notebooks, build_notebooks.available()))
    if plan and not config.option.collectonly:
        _background = course_build.Background(plan)


def _session_build(kind):
    from tests.support import course_build
    from util import build_notebooks
    if _background and kind in _background.kinds:
        start = time.monotonic()
        build = _background.get(kind)
        _WAITED[kind] = _WAITED.get(kind, 0.0) + time.monotonic() - start
    elif kind == "pages":
        build = course_build.pages(_lectures())
    else:
        build = course_build.notebooks(build_notebooks.available())
    if build not in _BUILDS:
        _BUILDS.append(build)
    return build


@pytest.fixture(scope="session")
def course_site():
    """Every lecture built once, quick, into one content folder (so pages link their neighbours)
    by one torchrun job on 4 ranks, and reused by later runs while the sources are unchanged
    (tests/support/course_build.py): (folder, Build). Lecture, page, exercise and torchrun tests
    all read it instead of building a lecture again."""
    build = _session_build("pages")
    return pathlib.Path(build.path("content")), build


def pytest_sessionfinish(session):
    from tests.support import course_build
    course_build.stop_all()


def pytest_runtest_logstart(nodeid, location):
    _SPANS[nodeid] = [time.monotonic(), None]


def pytest_runtest_logfinish(nodeid, location):
    if nodeid in _SPANS:
        _SPANS[nodeid][1] = time.monotonic()


def pytest_terminal_summary(terminalreporter):
    """Say what the builds cost, apart from the tests that waited for them, and where the run's
    time went: each phase's span of wall-clock time (the builds run beside the unit tests)."""
    for b in _BUILDS:
        terminalreporter.write_line(
            f"course build '{b.kind}': " + (f"reused {os.path.relpath(b.folder, ROOT)} (sources unchanged)"
                                            if b.reused else f"built in {b.seconds:.0f} s, exit {b.returncode}"))
    for kind, seconds in _WAITED.items():
        terminalreporter.write_line(f"tests waited {seconds:.0f} s for the course build '{kind}'")
    for phase in dict.fromkeys(_PHASE.values()):
        spans = [_SPANS[n] for n, p in _PHASE.items() if p == phase and n in _SPANS and _SPANS[n][1]]
        if spans:
            terminalreporter.write_line(
                f"{phase}: {len(spans)} tests from {min(a for a, _ in spans) - _START:.0f} s to "
                f"{max(b for _, b in spans) - _START:.0f} s into the run")


def walk(records):
    """Every record of a recording, including those the ranks made inside each demo."""
    for rec in records:
        yield rec
        if rec["kind"] == "demo":
            yield from walk(rec["records"])


def built(course_site, name):
    """The content folder holding `name`'s page; fails with the build's own error output."""
    out, build = course_site
    if name not in build.command:
        pytest.skip(f"{name} is not in COURSE_ONLY")
    path = out / f"{name}.json"
    if not path.exists():
        raise AssertionError(f"the course build wrote no {name}.json (exit {build.returncode}); "
                             f"its log:\n{build.log[-4000:]}")
    return out


def recording(course_site, name):
    """`name`'s recording from the session's build (a dict)."""
    import json
    return json.loads((built(course_site, name) / f"{name}.json").read_text())


def demo_returns(course_site, name):
    """What every demo of `name` returned in the session's build: [{"name", "world_size",
    "status", "timed", "call", "returns"}] (util.launch keeps them under COURSE_RETURNS)."""
    import pickle
    with open(built(course_site, name).parent / "returns" / f"{name}.pkl", "rb") as f:
        return pickle.load(f)


@pytest.fixture(scope="session")
def executed_notebooks():
    """Every companion notebook executed once, quick, on 4 pooled ranks, reused while the sources
    are unchanged: (folder, Build). The notebook tests read it, and the torchrun test compares
    its demos' numbers with the course build's."""
    build = _session_build("notebooks")
    return pathlib.Path(build.path("notebooks")), build


@pytest.fixture(scope="session")
def fixture_site(tmp_path_factory):
    """The fixture lecture built once (quick, pooled) into a temporary content folder."""
    out = tmp_path_factory.mktemp("content")
    build("tests.support.fixture_lecture", out, "--quick")
    return out


# --- a real browser, for the page tests -------------------------------------------------

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", "--disable-sync"]


@pytest.fixture(scope="session")
def browser():
    """Debian's headless Chromium driven by Playwright (its own browser download does not work
    here); one for the whole session."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


class Watched:
    """A page whose requests, console errors and page errors are all recorded."""

    def __init__(self, browser, **context_args):
        self.context = browser.new_context(offline=True, **context_args)
        # Chromium's offline emulation leaves navigator.onLine true for file:// pages; a reader
        # who is really offline has it false, and the page relies on that.
        self.context.add_init_script(
            "Object.defineProperty(Navigator.prototype, 'onLine', {get: () => false})")
        self.page = self.context.new_page()
        self.requests, self.errors = [], []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def check_clean(self):
        remote = [u for u in self.requests if not u.startswith(("file:", "data:"))]
        assert not remote, f"the page made network requests: {remote}"
        assert not self.errors, f"console errors: {self.errors}"

    def close(self):
        self.context.close()
