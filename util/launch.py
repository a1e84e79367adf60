"""Launching ranks: `spawn(fn, world_size, **kwargs)` runs `fn(rank, world_size, **kwargs)` on
every rank of a fresh-looking process group and brings back what each rank recorded.

Three ways to get ranks, one API:
- pool (default, `util/pool.py`): one set of worker processes, reused by every demo of the
  build; each demo starts seeded and clean.
- spawn: a new set of freshly started Python processes per demo, the naive baseline
  (`--launcher spawn`).
- torchrun (`util/torchrun_job.py`): when RANK/WORLD_SIZE are in the environment, rank 0 runs
  the lecture and the other ranks serve its demos, so a lecture runs across nodes.

What a rank runs is in `util/ranks.py`, and what the terminal says in `util/report.py`.
Failure is loud and bounded: a rank's exception ends the demo within seconds (the others are
stopped), a rank that never finishes is stopped `timeout` seconds after the first rank
finished, and a dead worker is noticed at once. Any failure throws the pool away, so the next
demo starts on a healthy one. Under torchrun a demo runs in the ranks' own processes: a rank's
exception and a missed collective end the demo as in the pool, and a rank past the demo's
`deadline` interrupts itself (SIGALRM; a rank blocked in C code outside a collective is not
stopped).
"""
import atexit
import dataclasses
import hashlib
import os
import pickle
import sys
import time

from util import pool as pools, record, torchrun_job
from util.pool import startups
from util.ranks import Settings, choose_backend, device, in_torchrun, mesh_options, new_group, settings
from util.report import STATUS_WORDS, status_line, summarize

__all__ = ["spawn", "Run", "DemoFailed", "settings", "Settings", "device", "in_torchrun",
           "choose_backend", "shutdown", "summarize", "STATUS_WORDS", "demos", "startups", "returned"]

demos = []                      # (name, world_size, status, seconds) of every demo this process ran
# With COURSE_RETURNS set (the tests set it), every demo's full per-rank returns are kept here
# too, with a digest of the call, so two builds of one lecture can be compared number by number.
returned = []


class DemoFailed(RuntimeError):
    def __init__(self, run):
        super().__init__(run.error)
        self.run = run


@dataclasses.dataclass
class Run:
    """What a demo did: per-rank return values, spans, records, and how it ended."""
    name: str
    world_size: int
    status: str = "ok"          # ok | failed | expected_failure | skipped
    elapsed: float = 0.0
    returns: list = None
    spans: list = dataclasses.field(default_factory=list)
    records: list = dataclasses.field(default_factory=list)
    error: str = None
    timed: bool = False         # a rank measured time or bytes: its numbers differ run to run

    @property
    def skipped(self):
        """A demo for more ranks than torchrun started: it did not run (the page says why), and
        a lecture must not read its returns."""
        return self.status == "skipped"


@atexit.register
def shutdown():
    """Stop every pooled worker (called at exit, and by the build when it finishes)."""
    pools.close_all()
    torchrun_job.close()


def _check_importable(fn):
    module = sys.modules.get(fn.__module__)
    if fn.__module__ == "__main__" and not getattr(module, "__file__", None):
        raise ValueError(f"spawn() needs {fn.__name__} to live in an importable module (a lecture "
                         "file): worker processes import it by name, and a notebook's or "
                         "console's functions cannot be imported.")


def _check_unique(name):
    """Two demos with one name cannot be told apart on the page: refuse the second."""
    names = record.current().demo_names
    if names is None:  # a notebook: re-running a cell repeats its demos on purpose
        return
    if name in names:
        raise ValueError(f"a demo named {name!r} already ran in this lecture; give spawn() a "
                         "name= that says what differs (e.g. the world size or the variant)")
    names.add(name)



def spawn(fn, world_size=None, *, name=None, expect_error=False, timeout=None, deadline=None, **kwargs):
    """Run `fn(rank, world_size, **kwargs)` on `world_size` ranks and record what they did.

    Returns a `Run`. A failed demo is recorded and raises `DemoFailed`, unless `expect_error`
    (then a failure is the lesson, and success is the error). `timeout` (seconds) overrides
    the build's collective timeout for this demo, and `deadline` (seconds) the time the whole
    demo may take (`settings.deadline`): past it, ranks that never reported (an endless loop)
    are stopped and the error says where each one was. `name` (default: the function's name)
    must be unique within the lecture.
    """
    world_size = world_size or settings.world_size
    timeout = float(timeout or settings.timeout)
    name = name or fn.__name__
    _check_importable(fn)
    _check_unique(name)
    run = Run(name=name, world_size=world_size)
    if in_torchrun():
        start = time.perf_counter()
        results, error = torchrun_job.run_in_place(fn, world_size, kwargs, timeout, run, deadline)
    else:
        backend = choose_backend(world_size)
        pool = pools.pooled(backend, world_size)   # start-up is not the demo's time
        start = time.perf_counter()
        error = "the launcher failed"
        try:
            results, error = pool.run(fn, kwargs, world_size, timeout, deadline)
        finally:  # a failure may leave ranks stuck in a collective: never reuse them
            if settings.launcher == "spawn" or error or any(m.get("retire") for m in results.values()):
                pools.discard(backend, pool)
    run.elapsed = time.perf_counter() - start
    traceback_text = None
    if run.status != "skipped":
        traceback_text = _finish(run, results, error, expect_error)
    recorder = record.current()
    recorder.add("demo", name=name, world_size=world_size, status=run.status,
                 elapsed=round(run.elapsed, 3), error=run.error,
                 returns=[summarize(v) for v in run.returns or []],
                 function=recorder.remember(fn.__code__), records=run.records)
    demos.append((name, world_size, run.status, run.elapsed))
    if os.environ.get("COURSE_RETURNS"):
        returned.append({"name": name, "world_size": world_size, "status": run.status,
                         "timed": run.timed, "call": _digest(fn, kwargs), "returns": run.returns})
    if settings.progress:
        status_line(run, traceback_text, len(demos))
    if run.status == "failed":
        raise DemoFailed(run)
    return run




def _finish(run, results, error, expect_error):
    """Fill `run` from the ranks' results; returns the first failing rank's traceback."""
    recorder = record.current()
    t0 = min((m["start"] for m in results.values() if m.get("start")), default=0.0)
    for rank in sorted(results):
        msg = results[rank]
        recorder.absorb(msg.get("functions", {}))
        for rec in msg.get("records", []):
            if rec["kind"] == "span":  # relative to the demo's start, comparable across ranks
                rec["start"], rec["end"] = round(rec["start"] - t0, 6), round(rec["end"] - t0, 6)
                run.spans.append(rec)
            run.records.append(rec)
    run.returns = [results[r]["returns"] if r in results else None for r in range(run.world_size)]
    run.timed = any(m.get("timed") for m in results.values())
    first = None
    if error:
        errors = [results[r]["error"] for r in sorted(results) if not results[r]["ok"]]
        # A timeout is the cause; "connection closed by peer" on another rank is its echo.
        first = next((e for e in errors if "imed out" in e.strip().splitlines()[-1]),
                     errors[0] if errors else "")
        run.error = f"demo {run.name!r} on {run.world_size} ranks failed: {error}"
        if first:
            last = first.strip().splitlines()[-1]
            run.error += f"\n{last}"
            finished = sorted(r for r, m in results.items() if m["ok"])
            if "imed out" in last and finished:
                run.error += (f"\n{record.rank_list(finished)} had already finished: a rank probably "
                              "skipped a collective that the others were waiting in")
        run.status = "expected_failure" if expect_error else "failed"
    elif expect_error:
        run.status, run.error = "failed", f"demo {run.name!r} was expected to fail, but succeeded"
    return first



def _digest(fn, kwargs):
    """Which call a demo made: the same function with the same arguments has the same digest."""
    try:
        return hashlib.sha1(pickle.dumps((fn, kwargs))).hexdigest()[:16]
    except Exception:
        return None
