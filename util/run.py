"""Build lectures: run each one's main(), record everything, write <out>/<lecture>.json and its page.

    python -m util.run NAME [NAME ...] [--quick] [--world-size N] [--backend gloo|nccl]
                                       [--launcher pool|spawn] [--timeout S] [--verbose] [--out DIR]

NAME is a lecture in lectures/ (lecture_02_communication), a dotted module
(tests.support.fixture_lecture) or a path to a .py file. Several are built one after the
other by one process (under torchrun, by the same job's ranks). Exit status: 0 built (demos that failed as expected
are lessons, not failures), 1 a demo or a lecture failed (the page is still written and shows
the failure), 2 bad command line.

Under torchrun every rank runs this: rank 0 runs the lectures and writes the files, the other
ranks serve rank 0's demos (util/torchrun_job.py). The recording's format is documented in
util/recording.py.
"""
import argparse
import datetime
import importlib
import importlib.util
import json
import os
import math
import platform
import signal
import socket
import sys
import time
import traceback

from util import launch, record, recording, torchrun_job
from util.measure import usable_cores


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error and exit code 2 instead of a usage dump."""

    def error(self, message):
        name = self.prog.split()[-1]  # "python -m util.run" -> "util.run"
        self.exit(2, f"{name}: error: {message} (see {self.prog} --help)\n")


def parse_args(argv):
    p = Parser(prog="python -m util.run", description="Build lectures into content/.")
    p.add_argument("lectures", nargs="+", metavar="lecture",
                   help="lecture name in lectures/, dotted module, or .py path")
    p.add_argument("--quick", action="store_true", help="small sizes (tests, CI)")
    p.add_argument("--world-size", type=int, help="ranks for demos that take any number (default 4, or "
                   "the ranks torchrun started if fewer)")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl with a GPU per rank, else gloo")
    p.add_argument("--launcher", choices=["pool", "spawn"], default="pool",
                   help="pool reuses worker processes; spawn starts new ones per demo")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a waiting collective fails")
    p.add_argument("--verbose", action="store_true",
                   help="also print the traceback of demos that fail as expected")
    p.add_argument("--out", default=os.path.join(record.ROOT, "content"), help="output folder")
    args = p.parse_args(argv)
    args.world_size = world_size(args.world_size, p)
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= 86400):
        p.error(f"--timeout must be a number of seconds between 0 and 86400, not {args.timeout:g}")
    if args.backend == "nccl":
        import torch
        if not torch.cuda.is_available():
            p.error("--backend nccl needs CUDA GPUs, and none are visible")
    args.modules = []
    for name in args.lectures:
        args.modules.append(resolve(name, p))
        module = importlib.import_module(args.modules[-1])   # importing a lecture has no side effects
        sizes = getattr(module, "WORLD_SIZES", None)
        if sizes and args.world_size not in sizes:
            p.error(f"{name} runs its demos on {', '.join(map(str, sizes))} ranks, not "
                    f"--world-size {args.world_size}")
    check_out(args.out, p)
    return args


def world_size(asked, parser):
    """--world-size, 4 by default; under torchrun never more ranks than it started (a demo that
    takes any number uses them all, and the page's sections read its results)."""
    started = int(os.environ["WORLD_SIZE"]) if launch.in_torchrun() else None
    if asked is None:
        return min(4, started) if started else 4
    if asked < 1:
        parser.error("--world-size must be at least 1")
    if started and asked > started:
        parser.error(f"--world-size {asked} needs {asked} ranks, but torchrun started {started}: "
                     f"pass --world-size {started} or fewer, or start more ranks")
    return asked


def check_out(out, parser):
    """The output folder, made now: a bad --out is said before the build, not after it."""
    if os.path.exists(out) and not os.path.isdir(out):
        parser.error(f"--out {out} is not a folder")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {out}: cannot make that folder ({e.strerror})")
    if not os.access(out, os.W_OK):
        parser.error(f"--out {out}: cannot write in that folder")


def resolve(name, parser):
    """Lecture name, dotted module or file path -> importable module name."""
    if name.endswith(".py"):
        path = os.path.relpath(os.path.abspath(name), record.ROOT)
        if not os.path.isfile(name) or path.startswith(".."):
            parser.error(f"no lecture file {name!r} in this repository")
        return path[:-3].replace(os.sep, ".")
    if "." not in name:
        if not os.path.isfile(os.path.join(record.ROOT, "lectures", name + ".py")):
            known = sorted(f[:-3] for f in os.listdir(os.path.join(record.ROOT, "lectures"))
                           if f.startswith("lecture_") and f.endswith(".py"))
            parser.error(f"no lecture {name!r}; known: {', '.join(known) or 'none'}")
        return "lectures." + name
    try:
        found = importlib.util.find_spec(name) is not None
    except ImportError:
        found = False
    if not found:
        parser.error(f"no module {name!r}")
    module = importlib.import_module(name)
    if not callable(getattr(module, "main", None)):
        parser.error(f"{name!r} is not a lecture: it has no main()")
    return name


def describe_device():
    import torch
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)}x {names[0]}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU: {cpu}, {usable_cores()} usable cores"


def describe_module(module, name):
    """(title, summary): the docstring's first line, and its first paragraph after that."""
    doc = (module.__doc__ or name).strip()
    title, _, rest = doc.partition("\n")
    summary = " ".join(rest.strip().split("\n\n")[0].split())
    return title.strip(), summary


def apply_settings(args):
    s = launch.settings
    s.quick, s.world_size, s.backend = args.quick, args.world_size, args.backend
    s.launcher, s.timeout, s.verbose = args.launcher, args.timeout, args.verbose
    s.progress = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 reports progress


def build(args, module_name):
    """Run one lecture; returns the recording (a dict)."""
    import torch
    recorder = record.Recorder()
    recorder.demo_names = set()
    record.use(recorder)
    first_demo, first_startup = len(launch.demos), len(launch.startups)
    module = importlib.import_module(module_name)
    name = module_name.rsplit(".", 1)[-1]
    title, summary = describe_module(module, name)
    if launch.settings.progress:
        print(f"building {name}: {title}", file=sys.stderr, flush=True)
    start, status = time.perf_counter(), "ok"
    try:
        module.main()
    except launch.DemoFailed as e:
        status = "failed"
        recorder.add("error", text=f"The lecture stopped here: {e}")
    except Exception:
        status = "failed"
        traceback.print_exc()
        recorder.add("error", text="The lecture stopped here:\n" + traceback.format_exc())
    finally:
        if not launch.in_torchrun():
            launch.shutdown()
    statuses = [d[2] for d in launch.demos[first_demo:]]
    if "failed" in statuses:
        status = "failed"
    return {
        "schema": recording.SCHEMA, "lecture": name, "title": title, "summary": summary,
        "module": module_name,
        "file": record.relpath(module.__file__),
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "elapsed": round(time.perf_counter() - start, 3), "status": status,
        "startup": {"workers": sum(n for n, _ in launch.startups[first_startup:]),
                    "seconds": round(sum(t for _, t in launch.startups[first_startup:]), 3)},
        "environment": {
            "python": platform.python_version(), "torch": torch.__version__,
            "backend": args.backend or launch.choose_backend(args.world_size),
            "launcher": "torchrun" if launch.in_torchrun() else args.launcher,
            "world_size": args.world_size, "quick": args.quick,
            "device": describe_device(), "cores": usable_cores(), "host": socket.gethostname()},
        "demos": {"total": len(statuses), "failed": statuses.count("failed"),
                  "expected_failures": statuses.count("expected_failure"),
                  "skipped": statuses.count("skipped")},
        "exercises": recorder.exercises,
        "functions": recorder.functions,
        "records": recorder.records,
    }


def _stop_on_sigterm():
    """SIGTERM ends the build as Ctrl-C does: the exit handlers run and stop the worker processes
    (Python's default would die at once and leave them running)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    _stop_on_sigterm()
    apply_settings(args)
    if launch.in_torchrun():
        if torchrun_job.rank() != 0:
            torchrun_job.job().serve()  # rank 0 runs the lectures; this rank runs its demos
            return 0
        import torch                    # torchrun set one thread per process; while rank 0
        torch.set_num_threads(usable_cores())   # narrates, the other ranks only wait
    failed = 0
    try:
        for module_name in args.modules:
            failed += write(args, build(args, module_name)) != 0
    finally:
        launch.shutdown()
        torchrun_job.end()
    return 1 if failed else 0


def write(args, rec):
    """Write one lecture's recording and page (and the index); returns its exit status. A failed
    build never replaces a good page: the page it would write is dropped, and stderr says so."""
    d = rec["demos"]
    failed = "" if rec["status"] == "ok" else "the lecture stopped with an error" if not d["failed"] else (
        f"{d['failed']} demo{'' if d['failed'] == 1 else 's'} failed")
    if failed and _good_page(args.out, rec["lecture"]):
        print(f"{rec['lecture']}: {failed}; the previous page, which built without errors, is kept "
              f"({os.path.relpath(os.path.join(args.out, rec['lecture'] + '.html'))})", file=sys.stderr)
        return 1
    keep_returns(rec["lecture"])
    path = os.path.join(args.out, rec["lecture"] + ".json")
    recording.save(path, rec)
    from util import render
    page = render.render_lecture(path)
    render.render_index(args.out)
    print(f"{rec['lecture']}: {d['total']} demo{'' if d['total'] == 1 else 's'}, {d['failed']} failed, "
          f"{d['expected_failures']} failed as expected, {d['skipped']} skipped"
          f"{'; the lecture stopped with an error' if failed and not d['failed'] else ''}; "
          f"{rec['elapsed']:.1f} s (of which worker start-up {rec['startup']['seconds']:.1f} s) "
          f"-> {os.path.relpath(page)}", file=sys.stderr)
    return 0 if rec["status"] == "ok" else 1


def _good_page(out, lecture):
    """Whether `out` holds a page of `lecture` from a build without errors (a page without its
    recording counts as good: nothing says otherwise)."""
    try:
        with open(os.path.join(out, lecture + ".json"), encoding="utf-8") as f:
            return json.load(f).get("status") == "ok"
    except (OSError, ValueError):
        return os.path.exists(os.path.join(out, lecture + ".html"))


def keep_returns(lecture):
    """With COURSE_RETURNS=DIR, every demo's full returns go to DIR/<lecture>.pkl (the tests
    compare two builds' numbers with them; the page keeps only a summary)."""
    folder = os.environ.get("COURSE_RETURNS")
    if folder:
        import pickle
        os.makedirs(folder, exist_ok=True)
        recording.write_atomic(os.path.join(folder, lecture + ".pkl"), pickle.dumps(launch.returned))
    launch.returned.clear()


if __name__ == "__main__":
    sys.exit(main())
