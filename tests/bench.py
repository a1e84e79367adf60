"""`make bench`: timings taken side by side in one run and printed as ratios.

Not a test: these machines are noisy, so nothing here passes or fails. It prints
- the fixture lecture built with the pooled launcher and with one fresh set of processes per
  demo (the naive baseline), alternating, and their ratio;
- every line returned by `bench()` of each lecture that defines one (ours vs PyTorch's).

    python -m tests.bench [--repeat N] [--only engine|lecture_02_communication|...]
"""
import argparse
import importlib
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_seconds(launcher, out):
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "util.run", "tests.fixture_lecture", "--quick",
                    "--launcher", launcher, "--out", out], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def engine(repeat):
    times = {"pool": [], "spawn": []}
    with tempfile.TemporaryDirectory() as out:
        for i in range(repeat):
            for launcher in ("pool", "spawn"):  # alternate, so drift hits both alike
                times[launcher].append(build_seconds(launcher, out))
                print(f"  fixture build #{i + 1} with --launcher {launcher}: "
                      f"{times[launcher][-1]:.1f} s", flush=True)
    pool, spawn = min(times["pool"]), min(times["spawn"])
    return [f"fixture lecture (15 demos, world sizes 1, 2, 4): pooled {pool:.1f} s, "
            f"one spawn per demo {spawn:.1f} s -> pooled is {spawn / pool:.1f}x faster "
            f"(target >= 3x; best of {repeat})"]


def lectures():
    names = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "lectures"))
                   if f.startswith("lecture_") and f.endswith(".py"))
    return [n for n in names if hasattr(importlib.import_module(f"lectures.{n}"), "bench")]


def main():
    p = argparse.ArgumentParser(prog="python -m tests.bench")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--only", help="engine, or a lecture name")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    from util import launch
    launch.settings.verbose = False
    sections = {"engine": lambda: engine(args.repeat)}
    for name in lectures():
        sections[name] = importlib.import_module(f"lectures.{name}").bench
    lines = []
    for name, fn in sections.items():
        if args.only and args.only != name:
            continue
        print(f"== {name}", flush=True)
        out = fn()
        launch.shutdown()
        for line in out:
            print("  " + line, flush=True)
        lines += [f"{name}: {line}" for line in out]
    from util.run import describe_device
    print(f"\nsummary (measured on this machine: {describe_device()})")
    for line in lines:
        print("  " + line)


if __name__ == "__main__":
    main()
