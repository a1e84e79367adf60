"""`make bench`: timings taken side by side in one run and printed as ratios.

Not a test: these machines are noisy, so nothing here passes or fails. It prints
- the fixture lecture built with the pooled launcher and with one fresh set of processes per
  demo (the naive baseline), alternating, and their ratio;
- every line returned by `bench()` of each lecture that defines one (ours vs PyTorch's);
- each lecture's build time: a quick build timed here, and the full build's time from the last
  `make` (content/<lecture>.json), against the budget (quick < 60 s, all of `make` < 10 min).

    python -m scripts.bench [--repeat N] [--only engine|lecture_02_communication|...]
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
    subprocess.run([sys.executable, "-m", "util.run", "tests.support.fixture_lecture", "--quick",
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


def build_times(repeat):
    """Quick builds timed now; full builds as the last `make` recorded them."""
    from util import recording
    lines, total_full = [], 0.0
    for name in all_lectures():
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "util.run", name, "--quick", "--out", out],
                                  cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            quick = time.perf_counter() - start
        full = recording.load(os.path.join(ROOT, "content", name + ".json"))
        full_text = "no full build in content/ (run make)"
        if full and not full["environment"]["quick"]:
            total_full += full["elapsed"]
            full_text = f"last full build {full['elapsed']:.1f} s"
        status = "" if proc.returncode == 0 else f" (exit {proc.returncode})"
        lines.append(f"{name}: quick build {quick:.1f} s{status} (budget 60 s); {full_text}")
    lines.append(f"all lectures, full builds as last made: {total_full:.0f} s (the whole `make`, "
                 "notebooks included, has a 10 min budget)")
    return lines


def all_lectures():
    return sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "lectures"))
                  if f.startswith("lecture_") and f.endswith(".py"))


def lectures():
    return [n for n in all_lectures() if hasattr(importlib.import_module(f"lectures.{n}"), "bench")]


def main():
    p = argparse.ArgumentParser(prog="python -m scripts.bench")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--only", help="engine, builds, or a lecture name")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    from util import launch
    launch.settings.verbose = False
    sections = {"engine": lambda: engine(args.repeat), "builds": lambda: build_times(args.repeat)}
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
