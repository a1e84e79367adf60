"""Shared test fixtures. Tests run on CPU with gloo, whatever the machine has."""
import os
import subprocess
import sys

import pytest

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


@pytest.fixture(scope="session")
def fixture_site(tmp_path_factory):
    """The fixture lecture built once (quick) into a temporary content folder."""
    out = tmp_path_factory.mktemp("content")
    build("tests.fixture_lecture", out, "--quick")
    return out
