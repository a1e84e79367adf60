"""Shared test fixtures. Tests run on CPU with gloo, whatever the machine has."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(ROOT, "tests", "artifacts")  # screenshots etc., ignored by git


def pytest_configure(config):
    config.addinivalue_line("markers", "torchrun: builds under torchrun (one job, or two agents as "
                            "two nodes); `make test-torchrun` runs only these")


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


LECTURES = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "lectures"))
                  if f.startswith("lecture_") and f.endswith(".py"))


@pytest.fixture(scope="session")
def course_site(tmp_path_factory):
    """Every lecture built once per test session, quick, into one content folder (so pages link
    their neighbours): (folder, {lecture: CompletedProcess}). Lecture tests and page tests
    share it instead of building each lecture again."""
    out = tmp_path_factory.mktemp("course")
    # COURSE_ONLY=lecture_04_tensor_parallel,... builds only those (while working on one lecture)
    only = [n for n in os.environ.get("COURSE_ONLY", "").split(",") if n]
    return out, {name: build(name, out, "--quick", check=False) for name in LECTURES
                 if not only or name in only}


def walk(records):
    """Every record of a recording, including those the ranks made inside each demo."""
    for rec in records:
        yield rec
        if rec["kind"] == "demo":
            yield from walk(rec["records"])


def built(course_site, name):
    """The content folder holding `name`'s page; fails with the build's own error output."""
    out, procs = course_site
    if name not in procs:
        pytest.skip(f"{name} is not in COURSE_ONLY")
    proc = procs[name]
    if proc.returncode != 0:
        raise AssertionError(f"building {name} --quick exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return out


@pytest.fixture(scope="session")
def fixture_site(tmp_path_factory):
    """The fixture lecture built once (quick) into a temporary content folder."""
    out = tmp_path_factory.mktemp("content")
    build("tests.fixture_lecture", out, "--quick")
    return out


# --- a real browser, for the page tests -------------------------------------------------

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run", "--disable-sync"]


@pytest.fixture(scope="module")
def browser():
    """Debian's headless Chromium driven by Playwright (its own browser download does not work
    here); one per test module."""
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
