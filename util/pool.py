"""The worker pool: one set of processes reused by every demo of a build (or a notebook).

A demo on k ranks runs on workers 0..k-1 in a process group of its own, formed anew (in
milliseconds) when the world size or timeout changes. Workers are forked from a server process
that imported PyTorch once, so a start-up costs milliseconds after the first; the project's own
modules are imported fresh by each worker, and `SourceWatch` restarts the workers when one of
those files changes on disk (a notebook user who edits a lecture gets the new code on the ranks).
A rank that raises ends the demo within seconds, a rank that never finishes is stopped, and a
dead worker is noticed at once.
"""
import contextlib
import datetime
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time

from util import record
from util.ranks import (alive, describe_failure, dumps, error_result, forget_meshes, run_task_or_error,
                        settings, use_device)

startups = []                   # (workers, seconds): worker start-ups, reported apart from demos

def _worker(rank, port, backend, tasks, results, parent=None, stack_file=None):
    """A rank that lives across demos. Each task names the group it runs in (world size and
    timeout); when that changes, the rank leaves its old process group and joins the new one,
    which costs milliseconds where a new process costs seconds. It exits when the lecture's
    process (`parent`) is gone, however that ended, and writes its Python stack to `stack_file`
    on SIGUSR1 (what a rank was doing when its demo ran out of time)."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.setpgid(0, 0)    # a process group of its own: closing the pool ends what a demo started too
    if stack_file:
        import faulthandler
        import signal
        faulthandler.register(signal.SIGUSR1, file=open(stack_file, "w"), all_threads=False)
    import torch
    import torch.distributed as dist
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        use_device(torch.device("cuda", torch.cuda.current_device()))
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
                    forget_meshes()
                dist.init_process_group(backend, store=dist.PrefixStore(f"group{generation}", store),
                                        rank=rank, world_size=world_size,
                                        timeout=datetime.timedelta(seconds=timeout))
                joined = generation
            fn, kwargs = pickle.loads(blob)
        except Exception:
            results.put(pickle.dumps(error_result(rank)))
            continue
        threads = max(1, (os.cpu_count() or 1) // world_size)  # 4 ranks on 2 cores: no thrashing
        result = run_task_or_error(rank, world_size, fn, kwargs, threads)
        # The demo destroyed the group (a tutorial's last line): the pool forms the next group
        # under a new name, since the store still holds this one's addresses.
        result["left_group"] = not dist.is_initialized()
        results.put(dumps(result))
        if result["left_group"]:
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
        while alive(parent) and os.getppid() == born_of:
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
        if any(m.get("left_group") for m in got.values()):
            self.group = None           # every rank joins a group of a new generation next time
        error = describe_failure(got, ranks, timeout, first_done and first_done[0],
                                  self._dead, lambda r: self.procs[r].exitcode, time.monotonic() - start)
        late = [r for r in ranks if r not in got]
        # past the demo's deadline, that is what stopped them, even if a rank had finished (its
        # timeout would have come later): a check's deadline left for its last world size is short
        if late and time.monotonic() >= end and not self._dead(ranks) and all(m["ok"] for m in got.values()):
            at = self.where(late)
            error = (f"{record.rank_list(late)} did not finish within the demo's deadline of {deadline:g} s "
                     "(an endless loop or a very long wait?) and were stopped"
                     + "".join(f"; rank {r} was at {w}" for r, w in sorted(at.items())))
        return got, error

    def close(self):
        """Stop the workers (2 s to leave, then killed), and whatever they started and left."""
        shutil.rmtree(self.stacks, ignore_errors=True)
        for q in self.tasks:
            with contextlib.suppress(Exception):
                q.put(None)
        started = [p for p in self.procs if p.pid is not None]   # a signal may stop a start half-way
        end = time.monotonic() + 2            # 2 s for all of them to leave, not 2 s each
        for p in started:
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in started:
            if p.is_alive():
                p.kill()
                p.join()
            with contextlib.suppress(OSError):    # the worker's process group (see _worker)
                os.killpg(p.pid, signal.SIGKILL)


_pools = {}                     # backend -> Pool

def close_all():
    while _pools:
        _pools.popitem()[1].close()


def discard(backend, pool):
    """Throw a pool away (after a failure its ranks may be stuck in a collective)."""
    if _pools.get(backend) is pool:
        del _pools[backend]
    pool.close()


def pooled(backend, world_size):
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
