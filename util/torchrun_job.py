"""Demos under torchrun: this process is one rank of a job that may span nodes.

Rank 0 runs the lecture (narration, figures, searches) and, at each `spawn`, tells the other
ranks through the job's rendezvous store which importable function to run with which
arguments; the other ranks do nothing but serve those demos, as pooled workers do, until rank 0
says the build is over. So a cluster does not run matplotlib or a layout search on every rank.

A demo runs in a process group formed over the store on the first k ranks (the rest wait for
the next demo), kept for the next demo on the same ranks; a demo that fails — even one that leaves a collective hanging —
stays inside that demo. Results travel through the store, not through a process group a demo
might have broken.
"""
import atexit
import contextlib
import dataclasses
import datetime
import gc
import os
import pickle
import sys
import threading
import time

from util.ranks import (choose_backend, describe_failure, dumps, error_result, forget_meshes, run_task,
                        settings, use_device)

# How long a serving rank waits for rank 0's next demo: rank 0 may narrate for minutes between
# two demos (a full-size layout search), so the bound is rank 0's heartbeat, not the wait: rank
# 0 beats every BEAT seconds from a thread of its own, and a serving rank that saw no beat for
# SILENCE seconds leaves with an error (rank 0 died where its exit could not say "done": killed,
# out of memory, on another node whose agent went away without telling this one).
BEAT = 5.0
SILENCE = float(os.environ.get("COURSE_RANK0_SILENCE", 120))
DONE = b"done"


class Rank0Gone(RuntimeError):
    pass


def wait_for_task(store, key, silence=SILENCE, poll=None):
    """A serving rank's wait for `key`, bounded by rank 0's heartbeat (the count at
    `course/heartbeat`): returns once the key is there, raises Rank0Gone after `silence` seconds
    in which the count did not move."""
    poll = poll or min(30.0, silence / 4)
    last, since = None, time.monotonic()
    while True:
        try:
            store.wait([key], datetime.timedelta(seconds=poll))
            return
        except Exception as e:          # the wait timed out, or the store itself went away
            if "imeout" not in str(e) and "imed out" not in str(e):
                raise Rank0Gone(f"rank 0's store went away while this rank waited for its next demo ({e})") from e
        beats = store.add("course/heartbeat", 0)
        if beats != last:
            last, since = beats, time.monotonic()
        elif time.monotonic() - since > silence:
            raise Rank0Gone(f"rank 0 has not beaten for {silence:g} s: it probably died without "
                            "saying the build is over; this rank leaves")


def _beat_until(stop):
    """Rank 0's heartbeat, over a store client of its own: the main thread's client may be
    held for minutes by a wait (a demo's results). It beats until `stop` is set, and the build's
    end waits for it: a daemon thread still inside the store's C++ call when Python shuts down
    is ended by the interpreter mid-call, and that aborts the process ('terminate called
    without an active exception') after the page is written, so torchrun calls the job failed."""
    import torch.distributed as dist
    store = next(dist.rendezvous("env://"))[0]
    while True:
        store.add("course/heartbeat", 1)
        if stop.wait(BEAT):
            return


class DeadlinePassed(BaseException):   # not caught by a demo's own `except Exception`
    pass


@contextlib.contextmanager
def deadline_alarm(seconds):
    """Interrupt the demo with DeadlinePassed after `seconds` (SIGALRM, main thread only): a
    rank in an endless Python loop cannot be stopped from outside under torchrun, as the pool
    stops its workers, so it stops itself. A rank blocked in a collective ends at the
    collective's own timeout instead."""
    import signal
    import threading
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def passed(signum, frame):
        raise DeadlinePassed(f"the demo did not finish within its deadline of {seconds:g} s on this rank")
    previous = signal.signal(signal.SIGALRM, passed)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def rank():
    return int(os.environ["RANK"])


@contextlib.contextmanager
def _narration_kept(narrating):
    """On rank 0 a demo runs inside the process that narrates: what the demo changes (random
    states, the default dtype, grad mode) must not reach the narration, as it cannot in a pool."""
    if not narrating:
        yield
        return
    import random
    import numpy as np
    import torch
    states = random.getstate(), np.random.get_state(), torch.get_default_dtype(), torch.is_grad_enabled()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_default_dtype(states[2])
            torch.set_grad_enabled(states[3])


class Job:
    """This process's place in the torchrun job.

    Consecutive demos on the same ranks with the same timeout share a process group, as the
    pool's do: forming and ending one costs 1-2 s. Rank 0 decides after each demo whether its
    group is kept for the next one (only after a clean demo) and publishes the verdict, so the
    members of a group end it together.

    A group is taken down with care (`_leave`): PyTorch objects a demo made — a DDP comm
    hook's callbacks, FSDP or DTensor state, a pipeline schedule — hold the group, and some of
    them run on, and are released by, the group's own worker threads. Had one of those threads
    dropped the group's last reference, the group's destructor would join that very thread:
    `std::system_error: Resource deadlock avoided`, and the rank aborts."""

    def __init__(self):
        import torch
        import torch.distributed as dist
        self.rank, self.size = rank(), int(os.environ["WORLD_SIZE"])
        self.store = next(dist.rendezvous("env://"))[0]
        self.backend = choose_backend(int(os.environ.get("LOCAL_WORLD_SIZE", self.size)))
        if self.backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            use_device(torch.device("cuda", int(os.environ["LOCAL_RANK"])))
        self.demo = 0
        self.group = None       # the process group this rank is in, kept between clean demos
        self.group_for = None   # (world size, timeout) of the demos it serves
        self.retired = []       # groups something still held when they were taken down
        self.ended = False
        self.stop_beating = threading.Event()
        self.heartbeat = None
        if self.rank == 0:
            self.heartbeat = threading.Thread(target=_beat_until, args=(self.stop_beating,),
                                              name="rank 0 heartbeat", daemon=True)
            self.heartbeat.start()

    # --- rank 0: the lecture's side -----------------------------------------------------------

    def run(self, fn, world_size, kwargs, timeout, deadline=None):
        """Rank 0: hand the demo to the other ranks, take part, and gather every rank's result."""
        # The header (ranks, timeout, settings) is plain data, decodable even where the demo's
        # function cannot be unpickled; the call is a blob of its own.
        chosen = {**dataclasses.asdict(settings), "deadline": deadline or settings.deadline}
        task = pickle.dumps((world_size, timeout, chosen, pickle.dumps((fn, kwargs))))
        self.store.set(f"course/task{self.demo + 1}", task)
        self._before(world_size, timeout)
        return self._take_part(fn, world_size, kwargs, timeout, chosen["deadline"])

    def end(self):
        """Rank 0: the build is over; the serving ranks leave, and so does this one."""
        if self.rank == 0 and not self.ended:
            self.ended = True
            with contextlib.suppress(Exception):
                self.store.set(f"course/task{self.demo + 1}", DONE)
                self._before(None, None)
            self.stop_beating.set()
            self.heartbeat.join(timeout=30)     # a beat in flight ends with the store's reply

    # --- every other rank ---------------------------------------------------------------------

    def serve(self):
        """Ranks other than 0: run the demos rank 0 hands out until it says the build is over
        (rank 0 records how each demo ended)."""
        while True:
            key = f"course/task{self.demo + 1}"
            wait_for_task(self.store, key)
            blob = self.store.get(key)
            if blob == DONE:
                self._before(None, None)
                return
            world_size, timeout, chosen, call = pickle.loads(blob)
            for name, value in chosen.items():
                setattr(settings, name, value)
            deadline = settings.deadline            # this demo's (chosen by rank 0's spawn)
            settings.progress = False               # rank 0 reports
            try:
                fn, kwargs = pickle.loads(call)
            except Exception:                       # rank 0 pickled it, so this is rare: say so
                import traceback
                traceback.print_exc()
                fn, kwargs = None, {}               # _take_part reports the failure as this rank's
            self._before(world_size, timeout)
            if self.rank < world_size:
                self._take_part(fn, world_size, kwargs, timeout, deadline)
            else:
                self.demo += 1                      # not needed for this one: wait for the next

    # --- a demo, on every rank that takes part --------------------------------------------------

    def _before(self, world_size, timeout):
        """Every rank, before each task: end the group it is in unless the task needs the same
        one (same ranks, same timeout). The group's members all do this at the same task."""
        import torch.distributed as dist
        if self.group is not None and (self.group_for != (world_size, timeout) or not dist.is_initialized()):
            self._leave(clean=True)

    def _take_part(self, fn, world_size, kwargs, timeout, deadline):
        import torch
        import torch.distributed as dist
        narrating_threads = torch.get_num_threads()     # rank 0 narrates with every core again
        self.demo += 1
        prefix = f"course/demo{self.demo}/"
        self.store.set_timeout(datetime.timedelta(seconds=timeout + 30))
        threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        try:
            if fn is None:
                raise RuntimeError(f"rank {self.rank} could not unpickle the demo rank 0 sent")
            if self.group is None:
                dist.init_process_group(self.backend, store=dist.PrefixStore(prefix, self.store),
                                        rank=self.rank, world_size=world_size,
                                        timeout=datetime.timedelta(seconds=timeout))
                self.group = dist.group.WORLD   # held here until the group can die on this thread
                self.group_for = (world_size, timeout)
            with _narration_kept(self.rank == 0), deadline_alarm(deadline):
                mine = run_task(self.rank, world_size, fn, kwargs, threads)
        except Exception:
            mine = error_result(self.rank)
        ok, blob, mine = mine["ok"], dumps(mine), None
        if not ok and self.group is not None:
            self._leave(clean=False)    # at once: the other ranks' collectives fail now
        self.store.set(f"{prefix}result{self.rank}", blob)
        got = {}
        for r in range(world_size):
            try:
                got[r] = pickle.loads(self.store.get(f"{prefix}result{r}"))
            except Exception:  # that rank never reported within the timeout
                pass
        clean = len(got) == world_size and all(m["ok"] for m in got.values())
        # Rank 0 alone decides whether the group serves the next demo, and the others follow:
        # a rank that missed a slow rank's result, or a demo that destroyed the group on some
        # ranks only, must not split the members between an old group and a new one.
        verdict = f"{prefix}keep"
        if self.rank == 0:
            # Kept after a clean demo. Rank 0 then narrates in a process that holds a live group:
            # util.measure counts the slowest rank only inside a demo, so the narration's own
            # timings do not wait at a barrier for ranks that are not timing anything.
            keep = clean
            self.store.set(verdict, b"keep" if keep else b"end")
        else:
            try:
                keep = self.store.get(verdict) == b"keep"
            except Exception:               # rank 0 is gone: nothing more to keep a group for
                keep = False
        if self.group is not None and not dist.is_initialized():
            self.group = None           # the demo destroyed the group itself (a tutorial's last line)
        if self.group is not None and not keep:
            self._leave(clean=clean)    # a failed demo may leave the group broken: never reuse it
        forget_meshes()                 # DTensor's caches must not hand the next demo this demo's meshes
        done = [r for r, m in got.items() if m["ok"]]
        torch.set_num_threads(narrating_threads)
        return got, describe_failure(got, range(world_size), timeout, done[0] if done else None)

    def _leave(self, clean):
        """Destroy the group so that its destructor runs on this thread, never on one of the
        group's own worker threads. When every rank finished cleanly (`clean`), a barrier on
        the group first: it returns only once each operation issued before it has finished on
        the worker threads, callbacks included (gloo runs a future's callbacks, releases them,
        and only then marks the operation done). Then the group is dropped once nothing else in
        Python holds it (a callback still being released lets go within moments); a group
        something still holds (an operation of a failed demo that is stuck, say) is kept until
        the end of the build instead, and released there by `close`."""
        import torch.distributed as dist
        # The demos' objects that sit in reference cycles (DDP and its reducer, FSDP and
        # DTensor state) die here, on this thread, while their group is still alive.
        gc.collect()
        if clean:
            try:
                dist.barrier()
            except Exception:       # a rank went away after it reported
                pass
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        forget_meshes()             # DTensor's caches hold meshes of this group
        if sys.getrefcount(self.group) > 2:   # 2: self.group and getrefcount's argument
            gc.collect()            # what only the caches held
        deadline = time.monotonic() + 1.0
        while sys.getrefcount(self.group) > 2 and time.monotonic() < deadline:
            time.sleep(0.005)       # lets a worker thread take the GIL and release its callback
        if sys.getrefcount(self.group) > 2:
            self.retired.append(self.group)
        self.group, self.group_for = None, None   # the last reference, here: the group joins its threads

    def close(self):
        """Release the groups kept after failed demos (their operations are long over)."""
        gc.collect()
        self.retired.clear()


_job = None


def job():
    """This process's Job (made on first use: the rendezvous happens then)."""
    global _job
    _job = _job or Job()
    return _job


def close():
    if _job is not None:
        _job.close()


@atexit.register
def end():
    """Rank 0 tells the serving ranks the build is over (called when the build ends, and at
    exit whatever happened, so no rank waits for a demo that will never come) — even when no
    demo ran in place, since the serving ranks are waiting all the same."""
    if _job is not None:
        _job.end()
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ and rank() == 0:
        with contextlib.suppress(Exception):
            job().end()


def run_in_place(fn, world_size, kwargs, timeout, run, deadline=None):
    """Rank 0 of a torchrun job: demos for k <= the job's ranks run on ranks 0..k-1, larger
    ones are skipped with the reason."""
    have = int(os.environ["WORLD_SIZE"])
    if world_size > have:
        run.status = "skipped"
        run.error = (f"needs {world_size} ranks, but torchrun started {have}; run it with "
                     f"--nproc-per-node/--nnodes giving at least {world_size} ranks, or without torchrun")
        return {}, None
    return job().run(fn, world_size, kwargs, timeout, deadline)
