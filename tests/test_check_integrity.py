"""A check a student's function cannot fool: it starts from a clean rank and leaves one, the rule
it states is the rule it enforces, it is bounded in time, processes and printed output, and its
feedback names what went wrong. Each student function below is one a check must get right; they
are module functions so that their source can be shipped to the ranks."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import exercises
from tests.test_exercises import HANG_TIMEOUT, bubble_first_and_last
from util import exercise as engine, launch

pytestmark = pytest.mark.timeout(300)


def verdict(name, *fns):
    return exercises.evaluate(name, *fns)


def passes(name, *fns):
    got = verdict(name, *fns)
    assert got["passed"] is True, got["detail"]
    return got


def fails(name, *fns, says=()):
    """The verdict failed, and its text holds each of `says`."""
    got = verdict(name, *fns)
    assert got["passed"] is False, got["detail"]
    for words in (says if isinstance(says, tuple) else (says,)):
        assert words in got["detail"], got["detail"]
    return got


# --- a clean rank: nothing a function does carries into the next check -----------------------

def ring_emptying_the_cases(x):
    import exercises.lecture_02 as L
    L.RING_LENGTHS[:] = []
    return x * 3          # what 3 ranks of identical inputs would sum to: wrong here


def ring_rebinding_the_cases(x):
    import exercises.lecture_02 as L
    L.RING_LENGTHS = ()
    return x * 0


def ring_times_zero(x):
    return x * 0


def test_a_check_whose_cases_were_emptied_fails_and_the_next_check_runs_every_case():
    fails("ring_all_reduce", ring_emptying_the_cases)
    fails("ring_all_reduce", ring_rebinding_the_cases, says="exercises.lecture_02.RING_LENGTHS")
    fails("ring_all_reduce", ring_times_zero, says="sent 0 bytes")
    assert " 25 cases " in passes("ring_all_reduce", exercises.solution("ring_all_reduce"))["detail"]


def no_cases(rank, world_size, fn):
    return []


def test_a_check_that_ran_no_case_fails_and_says_so():
    got = engine.evaluate("ring_all_reduce", no_cases, [exercises.solution("ring_all_reduce")], world_size=2)
    assert got["passed"] is False and "ran no case" in got["detail"], got["detail"]


def bubble_patching_the_reference(events):
    import lectures.pipeline.demos as L
    L.measured_bubble.__code__ = (lambda timeline: 0.5).__code__
    return 0.5


def bus_bandwidth_patching_dist(collective, nbytes, seconds, n):
    torch.distributed.all_reduce = lambda t, *a, **k: None
    algbw = nbytes / seconds
    factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}.get(collective, (n - 1) / n)
    return algbw, algbw * factor


def test_a_function_that_patches_the_reference_or_pytorch_fails_and_leaves_later_checks_right():
    for _ in range(2):      # the second run of the same wrong function must not find it patched
        fails("bubble", bubble_patching_the_reference, says="lectures.pipeline.demos.measured_bubble (its code)")
    passes("bubble", exercises.solution("bubble"))
    fails("bus_bandwidth", bus_bandwidth_patching_dist, says="torch.distributed.all_reduce")
    passes("bubble", exercises.solution("bubble"))


def bus_bandwidth_patching_a_module_it_imports(collective, nbytes, seconds, n):
    import lectures.pipeline.demos as L                 # not imported by this check's harness
    L.measured_bubble.__code__ = (lambda timeline: 0.5).__code__
    algbw = nbytes / seconds
    factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}.get(collective, (n - 1) / n)
    return algbw, algbw * factor


def test_a_module_first_imported_by_the_function_is_not_trusted_afterwards():
    """What the function did to a module it imported itself cannot be told from how the module
    came: the workers are replaced after the check, so the next check finds the module new."""
    from util import pool
    pool.close_all()                                    # workers that never imported it
    verdict("bus_bandwidth", bus_bandwidth_patching_a_module_it_imports)
    passes("bubble", exercises.solution("bubble"))


def bus_bandwidth_destroying_the_group(collective, nbytes, seconds, n):
    if n == 16 and collective == "reduce":       # rank 2's last case
        dist.destroy_process_group()
    algbw = nbytes / seconds
    factor = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}.get(collective, (n - 1) / n)
    return algbw, algbw * factor


def test_destroying_the_group_fails_that_check_not_the_next():
    fails("bus_bandwidth", bus_bandwidth_destroying_the_group, says="destroyed the process group")
    passes("bus_bandwidth", exercises.solution("bus_bandwidth"))


def bubble_leaving_a_thread(events):
    import threading
    import time
    threading.Thread(target=time.sleep, args=(60,), name="left-running").start()
    return 0.0


def test_a_thread_left_running_fails_the_check_and_ends_with_it():
    fails("bubble", bubble_leaving_a_thread, says=("threads running (left-running", "join every thread"))
    passes("bubble", exercises.solution("bubble"))


def bytes_writing_the_table(recipe):
    """A wrong bf16 count (no fp32 master copy) written into the table the check compares with."""
    from lectures.layout import PRECISION_BYTES
    PRECISION_BYTES["bf16"]["optimizer"] = 8
    return {"fp32": {"weights": 4, "grads": 4, "optimizer": 8}, "bf16": {"weights": 2, "grads": 4, "optimizer": 8},
            "fp64": {"weights": 8, "grads": 8, "optimizer": 16}}[recipe]


def test_a_table_changed_in_place_fails_its_check_and_not_the_next():
    """Identity sees no change when a nested dict of the course is written into: the first run
    of the wrong count failed and the second passed, and then the right count failed."""
    for _ in range(2):
        fails("bytes_per_parameter", bytes_writing_the_table,
              says="lectures.layout.estimator.PRECISION_BYTES (its contents)")
    passes("bytes_per_parameter", exercises.solution("bytes_per_parameter"))


def bubble_unshuffling(events):
    import random
    random.Random.shuffle = lambda self, x: None
    return 0.5


def test_a_patched_standard_module_fails_its_check_and_not_the_next():
    """A patched random.Random.shuffle left the next check's events sorted, where an answer that
    assumes their order passed."""
    fails("bubble", bubble_unshuffling, says="Random.shuffle")
    fails("bubble", bubble_first_and_last)      # assumes the events sorted


# --- the rule a check states is the rule it enforces ---------------------------------------

def ring_by_the_process_group(x):
    import torch.distributed.distributed_c10d as c
    c._get_default_group().allreduce([x]).wait()
    return x


def ring_by_functional_collectives(x):
    import torch.distributed._functional_collectives as fc
    return fc.all_reduce(x, "sum", dist.group.WORLD)


def ring_through_the_store(x):
    import pickle
    import torch.distributed.distributed_c10d as c
    store, n, rank = c._get_default_store(), dist.get_world_size(), dist.get_rank()
    store.set(f"ring-{x.numel()}-{rank}", pickle.dumps(x))
    return sum(pickle.loads(store.get(f"ring-{x.numel()}-{r}")) for r in range(n))


def ring_through_files(x):
    import os
    import time
    n, rank = dist.get_world_size(), dist.get_rank()
    folder = f"/tmp/course-ring-through-files-{os.getuid()}"
    os.makedirs(folder, exist_ok=True)
    torch.save(x, f"{folder}/{n}-{x.numel()}-{rank}.tmp")
    os.replace(f"{folder}/{n}-{x.numel()}-{rank}.tmp", f"{folder}/{n}-{x.numel()}-{rank}.pt")
    total = torch.zeros_like(x)
    for r in range(n):
        while not os.path.exists(f"{folder}/{n}-{x.numel()}-{r}.pt"):
            time.sleep(0.01)
        total += torch.load(f"{folder}/{n}-{x.numel()}-{r}.pt")
    return total


def ring_reading_the_checker(x):
    import sys
    return sys._getframe(2).f_locals["expected"].clone()


def ring_rebuilding_the_inputs(x):
    import inspect
    length = inspect.currentframe().f_back.f_back.f_locals["length"]
    total = torch.zeros_like(x)
    for r in range(dist.get_world_size()):
        g = torch.Generator().manual_seed(1000 * r + 17 * length + 1)
        total += torch.randn(x.shape, generator=g, dtype=torch.float64)
    return total


def ring_hiding_the_refusal(x):
    import torch.distributed.distributed_c10d as c
    try:
        dist.all_reduce(x)
    except Exception:
        c._get_default_group().allreduce([x]).wait()
    return x


def ring_direct(x):
    """Real messages, but every rank sends its whole buffer to every other: not a ring."""
    n, rank = dist.get_world_size(), dist.get_rank()
    incoming = [torch.empty_like(x) for _ in range(n)]
    ops = [op for r in range(n) if r != rank for op in (dist.P2POp(dist.isend, x, r),
                                                        dist.P2POp(dist.irecv, incoming[r], r))]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return x + sum(incoming[r] for r in range(n) if r != rank)


def ring_sending_twice(x):
    """The reference ring, with every step's message sent twice."""
    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = x.view(-1).tensor_split(n)
    right, left = (rank + 1) % n, (rank - 1) % n

    def exchange(send, recv):
        spare = torch.empty_like(recv)
        ops = [dist.P2POp(dist.isend, send.contiguous(), right), dist.P2POp(dist.irecv, recv, left),
               dist.P2POp(dist.isend, send.contiguous(), right), dist.P2POp(dist.irecv, spare, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    for step in range(n - 1):
        send_i, recv_i = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv_i])
        exchange(chunks[send_i], incoming)
        chunks[recv_i].add_(incoming)
    for step in range(n - 1):
        send_i, recv_i = (rank + 1 - step) % n, (rank - step) % n
        incoming = torch.empty_like(chunks[recv_i])
        exchange(chunks[send_i], incoming)
        chunks[recv_i].copy_(incoming)
    return x


def all_gather_through_the_store(x):
    import pickle
    import torch.distributed.distributed_c10d as c
    store, n, rank = c._get_default_store(), dist.get_world_size(), dist.get_rank()
    store.set(f"gather-{x.numel()}-{rank}", pickle.dumps(x))
    return [pickle.loads(store.get(f"gather-{x.numel()}-{r}")) for r in range(n)]


def vocab_ce_by_the_process_group(local_logits, targets, group):
    parts = [torch.empty_like(local_logits) for _ in range(dist.get_world_size(group))]
    group.allgather([parts], [local_logits.contiguous()]).wait()
    full = torch.cat(parts, -1)
    return torch.nn.functional.cross_entropy(full.reshape(-1, full.shape[-1]), targets.reshape(-1))


SEND_RECV_ONLY = [
    ("ring_all_reduce", ring_by_the_process_group, "your function called ProcessGroup.allreduce"),
    ("ring_all_reduce", ring_by_functional_collectives,
     "called all_reduce (from torch.distributed._functional_collectives)"),
    ("ring_all_reduce", ring_through_the_store, "your function called Store.set"),
    ("ring_all_reduce", ring_through_files, "besides its 0 point-to-point messages"),
    ("ring_all_reduce", ring_reading_the_checker, "your function called sys._getframe"),
    ("ring_all_reduce", ring_rebuilding_the_inputs, "your function called sys._getframe"),
    ("ring_all_reduce", ring_hiding_the_refusal, "your function called ProcessGroup.allreduce"),
    ("ring_all_reduce", ring_direct, "sends only to its right neighbour"),
    ("ring_all_reduce", ring_sending_twice, "the statement's ring sends"),
    ("ring_all_reduce", ring_times_zero, "your function sent 0 bytes"),
    ("all_gather", all_gather_through_the_store, "your function called Store.set"),
    ("vocab_parallel_ce", vocab_ce_by_the_process_group, "your function called ProcessGroup.allgather"),
]


@pytest.mark.parametrize("name,fn,says", SEND_RECV_ONLY, ids=[f.__name__ for _, f, _ in SEND_RECV_ONLY])
def test_a_check_enforces_its_rule_on_what_the_function_does(name, fn, says):
    try:
        fails(name, fn, says=says)
    finally:
        import shutil
        shutil.rmtree(f"/tmp/course-ring-through-files-{os.getuid()}", ignore_errors=True)


def bytes_reading_the_traceback(recipe):
    try:
        raise ValueError("a frame of my own")
    except ValueError as e:
        frame = e.__traceback__.tb_frame
    while "expected" not in frame.f_locals:      # up to the harness's frame
        frame = frame.f_back
    return dict(frame.f_locals["expected"])


def bytes_by_a_profiler(recipe):
    import sys
    found = []

    def profile(frame, event, arg):
        while frame is not None and "expected" not in frame.f_locals:
            frame = frame.f_back
        if frame is not None and not found:
            found.append(dict(frame.f_locals["expected"]))
    sys.setprofile(profile)
    len(found)                                    # a call: the profiler sees this frame
    sys.setprofile(None)
    return found[0]


def bytes_by_a_tracer(recipe):
    import sys
    found = []

    def trace(frame, event, arg):
        while frame is not None and "expected" not in frame.f_locals:
            frame = frame.f_back
        if frame is not None and not found:
            found.append(dict(frame.f_locals["expected"]))
    sys.settrace(trace)
    (lambda: None)()
    sys.settrace(None)
    return found[0]


def bytes_by_a_generator(recipe):
    holder = []

    def walk():
        yield holder[0].gi_frame.f_back           # while it runs, a generator's caller is this frame
    holder.append(walk())
    frame = next(holder[0])
    while "expected" not in frame.f_locals:
        frame = frame.f_back
    return dict(frame.f_locals["expected"])


def bytes_by_gc_referents(recipe):
    import gc
    try:
        raise ValueError("a frame of my own")
    except ValueError as e:
        frame = next(o for o in gc.get_referents(e.__traceback__) if hasattr(o, "f_locals"))
    while "expected" not in frame.f_locals:
        frame = frame.f_back
    return dict(frame.f_locals["expected"])


def bytes_by_code_compiled_elsewhere(recipe):
    """The traceback's route again, from code compiled under a file name that is not a shipped
    function's."""
    source = ("def peek():\n"
              "    try:\n"
              "        raise ValueError('a frame of my own')\n"
              "    except ValueError as e:\n"
              "        frame = e.__traceback__.tb_frame\n"
              "    while 'expected' not in frame.f_locals:\n"
              "        frame = frame.f_back\n"
              "    return dict(frame.f_locals['expected'])\n")
    scope = {}
    exec(compile(source, "helper.py", "exec"), scope)
    return scope["peek"]()


FRAMES = [(bytes_reading_the_traceback, "your function read traceback.tb_frame"),
          (bytes_by_code_compiled_elsewhere, "your function read traceback.tb_frame"),
          (bytes_by_a_profiler, "your function called sys.setprofile"),
          (bytes_by_a_tracer, "your function called sys.settrace"),
          (bytes_by_a_generator, "your function read generator.gi_frame"),
          (bytes_by_gc_referents, "your function called gc.get_referents")]


@pytest.mark.parametrize("fn,says", FRAMES, ids=[f.__name__ for f, _ in FRAMES])
def test_the_checkers_frames_are_out_of_reach(fn, says):
    """A frame of the function's own (a caught exception's, a generator's, one a profiler or
    tracer is handed) leads up to the harness's, where `expected` is."""
    fails("bytes_per_parameter", fn, says=says)


def gradients_forging_the_count(params, bucket_mb):
    """One all-reduce per parameter, and the call record rewritten to the planned buckets'."""
    from lectures.data_parallel import plan_buckets
    from util import exercise
    n = dist.get_world_size()
    for p in params:
        dist.all_reduce(p.grad)
        p.grad /= n
    forged = [("dist.all_reduce", sum(p.numel() for p in b)) for b in plan_buckets(params, bucket_mb)]
    records = [getattr(exercise, "calls", None)] + [c.cell_contents for c in dist.all_reduce.__closure__ or ()]
    for record in records:          # the engine's record, wherever the counting wrapper keeps it
        if isinstance(record, list):
            record[:] = forged


def test_the_call_record_cannot_be_forged():
    fails("all_reduce_gradients", gradients_forging_the_count, says="elements per dist.all_reduce call")
    passes("all_reduce_gradients", exercises.solution("all_reduce_gradients"))


# --- bounded: results, processes, printed output, time ---------------------------------------

def zigzag_meta(x, rank, world_size, dim):
    return torch.empty(x.shape, device="meta", dtype=x.dtype)


def zigzag_sparse(x, rank, world_size, dim):
    return x.to_sparse()


@pytest.mark.parametrize("fn,says", [(zigzag_meta, "expected a tensor on cpu, got one on meta"),
                                     (zigzag_sparse, "expected a dense tensor, got layout torch.sparse_coo")],
                         ids=["meta", "sparse"])
def test_a_meta_or_sparse_result_gets_a_verdict(fn, says, capsys):
    fails("zigzag_shard", fn, says=says)
    exercises.check("zigzag_shard", fn)               # the notebook's cell: a verdict, no traceback
    assert says in capsys.readouterr().out


def test_a_comparison_that_fails_is_a_verdict():
    class Odd:
        def __eq__(self, other):
            raise RuntimeError("no comparing me")
    got = engine._judge("x", launch.Run("x", 1, returns=[[("a case", "text", Odd())]]), None, 1, 1e-7, 1e-9, "")
    assert got[0] is False and "could not compare" in got[1] and "no comparing me" in got[1], got


def _processes(words):
    """Pids of the processes whose command line is `words`."""
    found = []
    for entry in (e for e in os.listdir("/proc") if e.isdigit()):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().split(b"\0")[:-1] == [w.encode() for w in words]:
                    found.append(int(entry))
        except OSError:
            pass
    return found


def ring_starting_processes(x):
    import subprocess
    subprocess.Popen(["sleep", "777.25"])
    subprocess.Popen(["sh", "-c", "sleep 777.5 &"])     # abandoned by its parent at once
    return x * 0


def test_the_processes_a_function_starts_end_with_its_check():
    try:
        fails("ring_all_reduce", ring_starting_processes)
        assert not _processes(["sleep", "777.25"]) and not _processes(["sleep", "777.5"])
    finally:
        _end_sleepers()


def _end_sleepers():
    """Kill what ring_starting_processes started, if the check did not (the test failed)."""
    for pid in _processes(["sleep", "777.25"]) + _processes(["sleep", "777.5"]):
        os.kill(pid, signal.SIGKILL)


def bus_bandwidth_printing(collective, nbytes, seconds, n):
    print("y" * 200_000)
    return 0.0, 0.0


def test_printed_output_is_capped_in_the_verdict():
    got = fails("bus_bandwidth", bus_bandwidth_printing)
    assert len(got["printed"]) < 25_000, len(got["printed"])      # not the 7 MB printed
    assert got["printed"].rstrip().endswith("MB more not shown"), got["printed"][-200:]


bubble_sleeping = engine.mutant(exercises.solution("bubble"), ("    t = torch.tensor(", "    import time\n"
                                 "    time.sleep(1.5)\n    t = torch.tensor("), name="bubble_sleeping")


def test_the_deadline_covers_the_whole_check(monkeypatch):
    """Three calls of 1.5 s on each world size: 4.5 s each, under a deadline of 6 s per run
    but not for both together."""
    monkeypatch.setattr(engine, "CHECK_DEADLINE", 6.0)
    fails("bubble", bubble_sleeping, says="6 s")


# --- feedback that teaches ------------------------------------------------------------------

def bus_bandwidth_exiting(collective, nbytes, seconds, n):
    import os
    os._exit(0)


def test_a_rank_that_exits_cleanly_is_not_called_a_crash():
    got = fails("bus_bandwidth", bus_bandwidth_exiting, says="exited (exit code 0)")
    assert "crash" not in got["detail"] and "sys.exit or os._exit" in got["detail"], got["detail"]


def vocab_ce_own_group(local_logits, targets, group):
    group = dist.new_group(list(range(dist.get_world_size(group))))
    m = local_logits.amax(dim=-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    return m.mean()


def test_a_function_that_makes_its_own_group_gets_the_group_hint():
    fails("vocab_parallel_ce", vocab_ce_own_group, says=("called dist.new_group", "use the group your function is given"))


def all_gather_deadlocked(x):
    n, rank = dist.get_world_size(), dist.get_rank()
    out = [torch.empty_like(x) for _ in range(n)]
    dist.recv(out[(rank - 1) % n], (rank - 1) % n)      # every rank receives first: nobody sends
    return out


def test_a_deadlock_gets_the_deadlock_note_not_the_exercises_hint(monkeypatch):
    monkeypatch.setattr(engine, "CHECK_TIMEOUT", HANG_TIMEOUT)
    got = fails("all_gather", all_gather_deadlocked,
                says=("every send needs its matching recv", f"waited more than {HANG_TIMEOUT:g} s"))
    assert exercises.get("all_gather").hint not in got["detail"], got["detail"]


def test_a_value_never_written_is_named():
    e = torch.ones(3, dtype=torch.float64)
    g = e.clone()
    g[1] = 6.946539417161e-310
    assert "memory never written" in engine.first_difference(e, g)
    assert "memory never written" not in engine.first_difference(e, e * 2)


# --- all of it in one process ----------------------------------------------------------------

def test_sabotage_then_correct_and_wrong_solutions_get_every_verdict_right():
    """As one notebook kernel (or one test session) meets them: each sabotaging function fails,
    and every correct and plainly wrong function after it gets its own verdict; no process
    a check started is left."""
    sequence = [
        ("ring_all_reduce", ring_emptying_the_cases, False),
        ("ring_all_reduce", ring_times_zero, False),
        ("ring_all_reduce", ring_rebinding_the_cases, False),
        ("bubble", bubble_patching_the_reference, False),
        ("bubble", bubble_patching_the_reference, False),
        ("bus_bandwidth", bus_bandwidth_patching_dist, False),
        ("bus_bandwidth", bus_bandwidth_destroying_the_group, False),
        ("bubble", bubble_leaving_a_thread, False),
        ("ring_all_reduce", ring_starting_processes, False),
        ("ring_all_reduce", ring_by_the_process_group, False),
        ("ring_all_reduce", exercises.solution("ring_all_reduce"), True),
        ("ring_all_reduce", ring_times_zero, False),
        ("bubble", exercises.solution("bubble"), True),
        ("bus_bandwidth", exercises.solution("bus_bandwidth"), True),
        ("vocab_parallel_ce", exercises.solution("vocab_parallel_ce"), True),
    ] + [(name, fns[0], False) for name in ("bubble", "bus_bandwidth") for fns in exercises.get(name).wrong.values()]
    wrong = []
    # what this session ran before (a browser, a course build in the background) is not a check's
    before = {pid for pid in _children() - _workers() if "multiprocessing" not in (_cmdline(pid) or "")}
    try:
        for name, fn, right in sequence:
            got = verdict(name, fn)
            if got["passed"] is not right:
                wrong.append((name, fn.__name__, got["detail"]))
            assert not _strays(before), (fn.__name__, _strays(before))
    finally:
        _end_sleepers()
    assert not wrong, wrong
    workers = _workers()
    launch.shutdown()
    assert workers and not [pid for pid in workers if os.path.exists(f"/proc/{pid}")], "a worker outlived the pool"


def _workers():
    from util import pool
    return {p.pid for each in pool._pools.values() for p in each.procs}


def _parents():
    parents = {}
    for entry in (e for e in os.listdir("/proc") if e.isdigit()):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return parents


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:             # gone meanwhile
        return None


def _children():
    return {pid for pid, parent in _parents().items() if parent == os.getpid()}


def _descendants(apart=()):
    """This process's descendants, leaving out the subtrees of the children in `apart`."""
    parents = _parents()
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found - set(apart)
        found |= frontier
    return found


def _strays(apart=()):
    """This process's descendants that are neither pooled workers nor multiprocessing's helpers
    (the fork server and the resource tracker), with their command lines; the subtrees of the
    children in `apart` are left out."""
    out = {}
    for pid in _descendants(apart) - _workers():
        line = _cmdline(pid)
        if line is not None and "multiprocessing" not in line:
            out[pid] = line
    return out


CONNECT_MARKER = os.path.join("/tmp", f"course-test-connect-{os.getuid()}")


def tp_mlp_whose_first_group_cannot_connect(x, w1, b1, w2, b2, group):
    import os
    import torch.distributed as dist
    import torch.nn.functional as F
    marker = os.path.join("/tmp", f"course-test-connect-{os.getuid()}")

    def new_group():    # fails as gloo's does when a peer's socket closes during the connect
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:27300")
    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        new_group()
    partial = F.gelu(x @ w1.T + b1) @ w2.T
    dist.all_reduce(partial, group=group)
    return partial + b2


def test_a_check_whose_ranks_could_not_connect_runs_once_more():
    """The machine's failure (gloo's connect, in the check's own new_group) is not the verdict;
    a function that fails that way every time still fails."""
    if os.path.exists(CONNECT_MARKER):
        os.remove(CONNECT_MARKER)
    try:
        passes("tp_mlp", tp_mlp_whose_first_group_cannot_connect)
        assert os.path.exists(CONNECT_MARKER)           # the first run did fail
    finally:
        if os.path.exists(CONNECT_MARKER):
            os.remove(CONNECT_MARKER)
