"""Launching ranks: `spawn(fn, world_size, **kwargs)` runs `fn(rank, world_size, **kwargs)` on
every rank of a fresh-looking process group and brings back what each rank recorded.

Three ways to get ranks, one API:
- pool (default): one set of worker processes, reused by every demo of the build; a demo on
  k ranks runs on the first k workers in a process group of its own, formed anew (in
  milliseconds) when the world size or timeout changes. Each demo starts seeded and clean.
  Workers are forked from a server process that imported PyTorch once, so a start-up costs
  milliseconds after the first; the lecture's own modules are imported fresh by each worker.
- spawn: a new set of freshly started Python processes per demo, the naive baseline
  (`--launcher spawn`).
- torchrun: when RANK/WORLD_SIZE are in the environment, demos run in place on the existing
  process group, so a lecture runs across nodes.

Failure is loud and bounded: a rank's exception ends the demo within seconds (the others are
killed), a rank that never finishes is killed `timeout` seconds after the first rank finished,
and a dead worker is noticed at once. Any failure throws the pool away, so the next demo starts
on a healthy one.
"""
import atexit
import contextlib
import dataclasses
import datetime
import gc
import io
import multiprocessing
import os
import pickle
import random
import re
import shutil
import signal
import tempfile
import sys
import threading
import time
import traceback

from util import record


@dataclasses.dataclass
class Settings:
    quick: bool = False         # smaller sizes, for tests and CI
    world_size: int = 4         # ranks for demos that do not insist on a number
    backend: str = None         # None: nccl when there is a GPU per rank, else gloo
    launcher: str = "pool"      # pool | spawn (torchrun is detected from the environment)
    timeout: float = 60.0       # seconds a collective may wait before it is an error
    deadline: float = 900.0     # seconds a whole demo may run before its ranks are stopped
    progress: bool = False      # one status line per demo on stderr
    verbose: bool = False       # also print the traceback of a demo that failed as expected


settings = Settings()
STATUS_WORDS = {"ok": "ok", "failed": "FAILED", "expected_failure": "failed, as expected",
                "skipped": "skipped"}  # how a demo ended, as the terminal and notebooks say it
demos = []                      # (name, world_size, status, seconds) of every demo this process ran
startups = []                   # (workers, seconds): worker start-ups, reported apart from demos
NAME_WIDTH = 46                 # the demo-name column of the terminal's status lines


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


def in_torchrun():
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def choose_backend(world_size):
    if settings.backend:
        return settings.backend
    import torch
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


_device = None


def device():
    """The torch device of this rank (cuda:<local rank> under NCCL, else cpu)."""
    import torch
    return _device or torch.device("cpu")


# --- what runs on a rank -----------------------------------------------------------------

def _reset(seed, threads):
    """Make a reused worker indistinguishable from a fresh one, as far as a demo can see."""
    import numpy as np
    import torch
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _run_task(rank, world_size, fn, kwargs, threads):
    import torch.distributed as dist
    _reset(0, threads)
    try:
        dist.barrier()          # everyone starts together: spans line up across ranks
    except Exception as e:
        raise RuntimeError("the process group was unusable at the start of this demo: the previous "
                           "demo or check probably caught a collective's error and returned (the "
                           f"group is broken after a timeout); its error: {e}") from e
    recorder = record.Recorder(rank=rank)
    previous = record.use(recorder)
    out, err = io.StringIO(), io.StringIO()
    result = {"rank": rank, "start": time.perf_counter(), "ok": True, "returns": None, "error": None}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result["returns"] = fn(rank, world_size, **kwargs)
    except BaseException:
        result["ok"] = False
        result["error"] = traceback.format_exc()
    finally:
        record.use(previous)
    result["end"] = time.perf_counter()
    # Output and errors belong to the demo function as a whole.
    code = getattr(fn, "__code__", None)
    source = code and {"file": record.relpath(code.co_filename), "line": code.co_firstlineno,
                       "function": code.co_name, "key": None}
    if out.getvalue():
        recorder.add("output", source=source, stream="stdout", text=out.getvalue())
    # What a rank wrote to stderr (library warnings, mostly) goes to the terminal, not the page.
    if err.getvalue():
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in err.getvalue().splitlines()))
        sys.stderr.flush()
    if not result["ok"]:
        recorder.add("error", source=source, text=result["error"])
    result["records"], result["functions"] = recorder.records, recorder.functions
    return result


def _run_task_or_error(rank, world_size, fn, kwargs, threads):
    try:
        return _run_task(rank, world_size, fn, kwargs, threads)
    except Exception:
        return _error_result(rank)


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _dumps(result):
    try:
        return pickle.dumps(result)
    except Exception as e:  # an unpicklable return value must not kill the worker silently
        result.update(ok=False, returns=None, error=f"return value cannot be sent back: {e!r}")
        return pickle.dumps(result)


def _error_result(rank):
    return {"rank": rank, "ok": False, "returns": None, "records": [], "functions": {},
            "start": 0, "end": 0, "error": traceback.format_exc()}


def _forget_meshes():
    """DTensor caches its sharding decisions keyed by DeviceMesh, and two meshes of one shape
    compare equal whatever their process groups. After a worker leaves its process group for
    a new one, a cached decision would hand a demo a mesh of the destroyed groups ("Could not
    resolve the process group registered under the name N"): drop those caches."""
    if "torch.distributed.tensor._api" not in sys.modules:   # this worker never used DTensor
        return
    import torch
    torch._C._clear_DTensor_sharding_propagator_cache()      # the C++ dispatch fast path's
    from torch.distributed.tensor import DTensor
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()  # Python's


def _worker(rank, port, backend, tasks, results, parent=None, stack_file=None):
    """A rank that lives across demos. Each task names the group it runs in (world size and
    timeout); when that changes, the rank leaves its old process group and joins the new one,
    which costs milliseconds where a new process costs seconds. It exits when the lecture's
    process (`parent`) is gone, however that ended, and writes its Python stack to `stack_file`
    on SIGUSR1 (what a rank was doing when its demo ran out of time)."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    if stack_file:
        import faulthandler
        import signal
        faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=False)
    global _device
    import torch
    import torch.distributed as dist
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        _device = torch.device("cuda", torch.cuda.current_device())
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=300))
    if parent:
        _exit_with(parent)
    results.put(pickle.dumps({"rank": rank, "ready": True}))
    joined = None
    while True:
        task = tasks.get()
        if task is None:
            break
        (generation, world_size, timeout), blob = task
        try:
            if joined != generation:
                joined = None
                if dist.is_initialized():
                    dist.destroy_process_group()
                    _forget_meshes()
                dist.init_process_group(backend, store=dist.PrefixStore(f"group{generation}", store),
                                        rank=rank, world_size=world_size,
                                        timeout=datetime.timedelta(seconds=timeout))
                joined = generation
            fn, kwargs = pickle.loads(blob)
        except Exception:
            results.put(pickle.dumps(_error_result(rank)))
            continue
        threads = max(1, (os.cpu_count() or 1) // world_size)  # 4 ranks on 2 cores: no thrashing
        results.put(_dumps(_run_task_or_error(rank, world_size, fn, kwargs, threads)))
        if not dist.is_initialized():   # the demo destroyed the group (a tutorial's last line): join anew
            joined = None
    if dist.is_initialized():
        dist.destroy_process_group()


def _exit_with(parent):
    """Exit this rank as soon as the lecture's process is gone, however it ended (SIGKILL too),
    even in the middle of a demo that loops or sleeps: a thread watches it. A parent killed but
    not yet reaped still answers kill(0); the fork server between us exits with it, which
    changes our parent id."""
    born_of = os.getppid()

    def watch():
        while _alive(parent) and os.getppid() == born_of:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name="exit-with-the-lecture", daemon=True).start()


# --- the lecture's side ------------------------------------------------------------------

def _project_modules():
    """Files of the project's modules imported in this process (the lecture and what it uses;
    the workers import the same ones by name)."""
    root = record.ROOT + os.sep
    files = set()
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if f and f.endswith(".py") and os.path.abspath(f).startswith(root) and os.sep + "." not in f:
            files.add(os.path.abspath(f))
    return files


def _stamp(path):
    try:
        st = os.stat(path)
        return st.st_mtime_ns, st.st_size
    except OSError:
        return None


class SourceWatch:
    """Knows which version of each project file the workers run: a notebook user who edits a
    lecture and re-runs a cell must not get the old code on the ranks. Checking costs a stat()
    per project module, well under a millisecond."""

    def __init__(self):
        self.seen = {}
        self.changed()

    def changed(self):
        """The files that changed since the workers may have imported them (and note new ones)."""
        out = [f for f, st in self.seen.items() if _stamp(f) != st]
        for f in _project_modules() - set(self.seen):
            self.seen[f] = _stamp(f)
        return out


# Imported once by the fork server; every pooled worker is forked from it with these in memory
# (torch._dynamo is what the first optimizer a process builds would otherwise import, seconds).
# Third-party modules only: the project's own files must be imported fresh by each worker, or a
# worker restarted after an edit (SourceWatch) would run the old code.
PRELOAD = ["torch", "torch.distributed", "torch.optim", "torch._dynamo", "numpy"]


def _context():
    """Fork from a server that has PyTorch imported (importing PyTorch costs seconds of CPU
    per process); plain spawn for the naive launcher, or where there is no fork server."""
    if settings.launcher == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class Pool:
    """Worker processes that run demos one at a time. A demo on k ranks runs on workers
    0..k-1 in a process group of exactly k ranks; the pool starts more workers when a demo
    needs them, so a lecture pays for at most as many start-ups as its largest demo has ranks."""

    GRACE = 1.0  # seconds the other ranks get to report after one rank failed

    def __init__(self, backend):
        import torch.distributed as dist
        self.backend = backend
        self.ctx = _context()
        # The lecture process owns the rendezvous store on a port the OS picks: no fixed port,
        # no race, so any number of builds can run at once.
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.results = self.ctx.Queue()
        self.tasks, self.procs = [], []
        self.group, self.generation = None, 0
        self.sources = SourceWatch()  # the code the workers import
        self.stacks = tempfile.mkdtemp(prefix="course-stacks-")   # where a rank writes its stack on SIGUSR1

    def grow(self, world_size):
        new = range(len(self.procs), world_size)
        if not new:
            return
        start = time.perf_counter()
        for r in new:
            self.tasks.append(self.ctx.Queue())
            self.procs.append(self.ctx.Process(target=_worker, daemon=True, name=f"rank{r}",
                                               args=(r, self.store.port, self.backend,
                                                     self.tasks[r], self.results, os.getpid(),
                                                     os.path.join(self.stacks, f"rank{r}.txt"))))
            self.procs[r].start()
        ready = self._collect(new, deadline=time.monotonic() + 300)
        if len(ready) < len(new):
            dead = [r for r in new if r not in ready and self.procs[r].exitcode is not None]
            raise RuntimeError(f"could not start {record.rank_list([r for r in new if r not in ready])}: " +
                               (f"exit codes {[self.procs[r].exitcode for r in dead]}" if dead
                                else "timed out"))
        seconds = time.perf_counter() - start
        startups.append((len(new), seconds))
        if settings.progress:
            print(f"  started {len(new)} worker process{'es' if len(new) != 1 else ''} in "
                  f"{seconds:.1f} s (Python + PyTorch start-up, not counted in the demos' times)",
                  file=sys.stderr, flush=True)

    def _dead(self, ranks):
        return [r for r in ranks if self.procs[r].exitcode is not None]

    def _collect(self, ranks, deadline, on_result=None):
        """Gather one message from each of `ranks` until all arrived, one of them died, or
        `deadline` passed. `on_result` may move the deadline (returns a new one or None)."""
        got = {}
        while len(got) < len(ranks) and time.monotonic() < deadline:
            try:
                msg = pickle.loads(self.results.get(timeout=0.1))
            except Exception:  # queue.Empty, or a rank died mid-message
                if self._dead([r for r in ranks if r not in got]):
                    break
                continue
            got[msg["rank"]] = msg
            if on_result:
                deadline = on_result(msg, got, deadline) or deadline
        return got

    def where(self, ranks):
        """{rank: 'file:line in function'} of each rank's innermost frame in the project's code,
        read from the stack it writes on SIGUSR1."""
        for r in ranks:
            with contextlib.suppress(OSError):
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(0.3)
        out = {}
        for r in ranks:
            with contextlib.suppress(OSError):
                with open(os.path.join(self.stacks, f"rank{r}.txt")) as f:
                    text = f.read()
                frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', text.split("Current thread")[-1])
                mine = [f for f in frames if f[0].startswith("<your ") or (   # an exercise's shipped code
                        os.path.abspath(f[0]).startswith(record.ROOT + os.sep) and os.sep + "util" + os.sep not in f[0])]
                if mine:    # faulthandler lists the innermost frame first
                    where = mine[0][0] if mine[0][0].startswith("<") else record.relpath(mine[0][0])
                    out[r] = f"{where}:{mine[0][1]} in {mine[0][2]}"
        return out

    def run(self, fn, kwargs, world_size, timeout, deadline=None):
        """Run a demo (workers already started); returns (per-rank results, error or None).
        Ranks that have not reported `deadline` seconds after the demo started are stopped,
        and the error says where each of them was."""
        if self.group != (world_size, timeout):
            self.group, self.generation = (world_size, timeout), self.generation + 1
        task = ((self.generation, world_size, timeout), pickle.dumps((fn, kwargs)))
        ranks = range(world_size)
        for r in ranks:
            self.tasks[r].put(task)
        first_done = []

        def on_result(msg, got, deadline):
            now = time.monotonic()
            if not msg["ok"]:                      # one rank failed: the rest get a moment
                return min(deadline, now + self.GRACE)
            if not first_done:                     # others must follow within the timeout
                first_done.append(msg["rank"])
                return min(deadline, now + timeout + 5)
        deadline = deadline or settings.deadline
        start = time.monotonic()
        end = start + deadline
        got = self._collect(ranks, end, on_result)
        error = _describe_failure(got, ranks, timeout, first_done and first_done[0],
                                  self._dead, lambda r: self.procs[r].exitcode, time.monotonic() - start)
        late = [r for r in ranks if r not in got]
        if late and time.monotonic() >= end and not first_done and not self._dead(ranks) \
                and all(m["ok"] for m in got.values()):
            at = self.where(late)
            error = (f"{record.rank_list(late)} did not finish within the demo's deadline of {deadline:g} s "
                     "(an endless loop or a very long wait?) and were stopped"
                     + "".join(f"; rank {r} was at {w}" for r, w in sorted(at.items())))
        return got, error

    def close(self):
        shutil.rmtree(self.stacks, ignore_errors=True)
        for q in self.tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        end = time.monotonic() + 2            # 2 s for all of them to leave, not 2 s each
        for p in self.procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


def _describe_failure(got, ranks, timeout, first_done, dead_of=None, exitcode=None, ran=None):
    """One sentence on what went wrong (None when every rank finished)."""
    failed = sorted(r for r, m in got.items() if not m["ok"])
    missing = sorted(set(ranks) - set(got))
    if not failed and not missing:
        return None
    parts = []
    if failed:
        parts.append(f"{record.rank_list(failed)} raised")
    if missing:
        dead = dead_of(missing) if dead_of else []
        stuck = [r for r in missing if r not in dead]
        if dead:
            parts.append(f"{record.rank_list(dead)} died (exit codes {[exitcode(r) for r in dead]})")
        if stuck:
            parts.append(f"{record.rank_list(stuck)} " + (
                f"{'was' if len(stuck) == 1 else 'were'} stopped after {record.rank_list(dead)} died"
                + (f", {ran:.1f} s into the demo" if ran is not None else "") if dead else
                f"did not finish within {timeout:g} s of rank {first_done} finishing; a rank probably "
                "skipped a collective" if first_done is not None and not failed else
                f"{'was' if len(stuck) == 1 else 'were'} stopped"))
    return "; ".join(parts)


_pools = {}


@atexit.register
def shutdown():
    """Stop every pooled worker (called at exit, and by the build when it finishes)."""
    while _pools:
        _pools.popitem()[1].close()
    if _job is not None:
        _job.close()


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


def _pooled(backend, world_size):
    """The pool for this backend, with `world_size` workers running current code."""
    pool = _pools.get(backend)
    changed = pool.sources.changed() if pool is not None else None
    if changed:
        print(f"  {', '.join(record.relpath(f) for f in changed)} changed on disk: restarting "
              "the worker processes so the ranks run the new code", file=sys.stderr, flush=True)
        _pools.pop(backend).close()
        pool = None
    if pool is None:
        pool = _pools[backend] = Pool(backend)
    try:
        pool.grow(world_size)
    except BaseException:
        _pools.pop(backend, None)
        pool.close()
        raise
    return pool


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
        results, error = _run_in_place(fn, world_size, kwargs, timeout, run)
    else:
        backend = choose_backend(world_size)
        pool = _pooled(backend, world_size)   # start-up is not the demo's time
        start = time.perf_counter()
        error = "the launcher failed"
        try:
            results, error = pool.run(fn, kwargs, world_size, timeout, deadline)
        finally:  # a failure may leave ranks stuck in a collective: never reuse them
            if settings.launcher == "spawn" or error:
                _pools.pop(backend, None)
                pool.close()
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
    if settings.progress:
        _status_line(run, traceback_text)
    if run.status == "failed":
        raise DemoFailed(run)
    return run


def _status_line(run, traceback_text):
    """`  demo  12  name ...  ranks=4   0.31 s  ok`; a failure's traceback follows its line
    (an expected failure's only with --verbose: it is the lesson, not a crash)."""
    shown = run.name if len(run.name) <= NAME_WIDTH else run.name[:NAME_WIDTH - 1] + "…"
    print(f"  demo {len(demos):>3}  {shown:<{NAME_WIDTH}}  ranks={run.world_size:<2} "
          f"{run.elapsed:7.2f} s  {STATUS_WORDS[run.status]}", file=sys.stderr, flush=True)
    if run.status == "skipped":
        print(f"           {run.error}", file=sys.stderr, flush=True)
    elif run.status == "failed" or (run.status == "expected_failure" and settings.verbose):
        print("\n".join("           " + line for line in run.error.splitlines()),
              file=sys.stderr, flush=True)
        if traceback_text:
            print(traceback_text, file=sys.stderr, flush=True)


def summarize(value, limit=160):
    """A short, readable description of what a rank returned (the page shows it)."""
    if value is None:
        return None
    if isinstance(value, (bool, int, float)):
        return repr(value)
    name = type(value).__name__
    if hasattr(value, "shape") and hasattr(value, "dtype"):     # a torch tensor, a numpy array or scalar
        size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", 1)
        return f"{name}{tuple(value.shape)} {value.dtype}" if size > 8 else repr(value)
    if isinstance(value, dict):
        keys = ", ".join(str(k) for k in value)
        text = f"dict with keys: {keys}"
    elif isinstance(value, (list, tuple)) and not all(isinstance(v, (bool, int, float, str)) for v in value):
        text = f"{name} of {len(value)}: " + ", ".join(summarize(v, 40) or "None" for v in value[:4]) \
            + (", …" if len(value) > 4 else "")
    else:
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


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


# --- under torchrun ------------------------------------------------------------------------

class _Job:
    """This process's place in a torchrun job. Each demo runs in a process group of its own,
    formed over the job's rendezvous store on the first k ranks (the rest wait), so a demo that
    fails — even one that leaves a collective hanging — stays inside that demo. Results travel
    through the store, not through a process group a demo might have broken.

    A demo's group is taken down with care (`_leave`): PyTorch objects a demo made — a DDP
    comm hook's callbacks, FSDP or DTensor state, a pipeline schedule — hold the group, and
    some of them run on, and are released by, the group's own worker threads. Had one of those
    threads dropped the group's last reference, the group's destructor would join that very
    thread: `std::system_error: Resource deadlock avoided`, and the rank aborts."""

    def __init__(self):
        import torch
        import torch.distributed as dist
        global _device
        self.rank, self.size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.store = next(dist.rendezvous("env://"))[0]
        self.backend = choose_backend(int(os.environ.get("LOCAL_WORLD_SIZE", self.size)))
        if self.backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            _device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        self.demo = 0
        self.group = None   # the running demo's process group
        self.retired = []   # groups something still held when their demo ended

    def run(self, fn, world_size, kwargs, timeout):
        import torch.distributed as dist
        self.demo += 1
        prefix = f"course/demo{self.demo}/"
        self.store.set_timeout(datetime.timedelta(seconds=timeout + 30))
        if self.rank < world_size:
            threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
            try:
                dist.init_process_group(self.backend, store=dist.PrefixStore(prefix, self.store),
                                        rank=self.rank, world_size=world_size,
                                        timeout=datetime.timedelta(seconds=timeout))
                self.group = dist.group.WORLD   # held here until the group can die on this thread
                mine = _run_task(self.rank, world_size, fn, kwargs, threads)
            except Exception:
                mine = _error_result(self.rank)
            ok, blob, mine = mine["ok"], _dumps(mine), None
            # The demo's objects that sit in reference cycles (DDP and its reducer, FSDP and
            # DTensor state) die here, on this thread, while their group is still alive.
            gc.collect()
            if not ok and self.group is not None:
                self._leave(clean=False)    # at once: the other ranks' collectives fail now
            self.store.set(f"{prefix}result{self.rank}", blob)
        got = {}
        for r in range(world_size):
            try:
                got[r] = pickle.loads(self.store.get(f"{prefix}result{r}"))
            except Exception:  # that rank never reported within the timeout
                pass
        if self.group is not None:
            self._leave(clean=len(got) == world_size and all(m["ok"] for m in got.values()))
        done = [r for r, m in got.items() if m["ok"]]
        return got, _describe_failure(got, range(world_size), timeout, done[0] if done else None)

    def _leave(self, clean):
        """Destroy the demo's group so that its destructor runs on this thread, never on one of
        the group's own worker threads. When every rank finished the demo (`clean`), a barrier
        on the group first: it returns only once each operation issued before it has finished
        on the worker threads, callbacks included (gloo runs a future's callbacks, releases
        them, and only then marks the operation done). Then the group is dropped once nothing
        else in Python holds it (a callback still being released lets go within moments); a
        group something still holds (an operation of a failed demo that is stuck, say) is
        kept until the end of the build instead, and released there by `close`."""
        import torch.distributed as dist
        if clean:
            try:
                dist.barrier()
            except Exception:       # a rank went away after it reported
                pass
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        _forget_meshes()            # DTensor's caches hold meshes of this group
        if sys.getrefcount(self.group) > 2:   # 2: self.group and getrefcount's argument
            gc.collect()            # what only the caches held
        deadline = time.monotonic() + 1.0
        while sys.getrefcount(self.group) > 2 and time.monotonic() < deadline:
            time.sleep(0.005)       # lets a worker thread take the GIL and release its callback
        if sys.getrefcount(self.group) > 2:
            self.retired.append(self.group)
        self.group = None           # the last reference, here: the group joins its threads

    def close(self):
        """Release the groups kept after failed demos (their operations are long over)."""
        gc.collect()
        self.retired.clear()


_job = None


def _run_in_place(fn, world_size, kwargs, timeout, run):
    """torchrun: this process is one rank of the job; demos for k <= the job's ranks run on
    ranks 0..k-1, larger ones are skipped with the reason."""
    global _job
    have = int(os.environ["WORLD_SIZE"])
    if world_size > have:
        run.status = "skipped"
        run.error = (f"needs {world_size} ranks, but torchrun started {have}; run it with "
                     f"--nproc-per-node/--nnodes giving at least {world_size} ranks, or without torchrun")
        return {}, None
    _job = _job or _Job()
    return _job.run(fn, world_size, kwargs, timeout)
