"""What runs on a rank, whoever started it (a pooled worker or torchrun), and the settings
every launcher reads.

`run_task` makes a reused process look fresh to the demo (seeded, default dtype, threads), runs
`fn(rank, world_size, **kwargs)` with its own recorder, and returns what the rank did as a
picklable dict; `describe_failure` turns the ranks' results into one sentence.
"""
import contextlib
import dataclasses
import io
import os
import pickle
import random
import sys
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
def in_torchrun():
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def choose_backend(world_size):
    if settings.backend:
        return settings.backend
    import torch
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


_device = None


def use_device(torch_device):
    """Set by the launcher that placed this rank on a GPU."""
    global _device
    _device = torch_device


def device():
    """The torch device of this rank (cuda:<local rank> under NCCL, else cpu)."""
    import torch
    return _device or torch.device("cpu")


def group_timeout():
    """The timeout of the default process group (what the launcher set from the run's
    `--timeout`, and lecture 02's hang lesson sets). None where the backend does not say."""
    import torch.distributed as dist
    try:
        return dist.distributed_c10d._get_default_group()._get_backend(device()).options._timeout
    except (AttributeError, RuntimeError):
        return None


def mesh_options(ndim):
    """`init_device_mesh(..., backend_override=mesh_options(len(shape)))`: the mesh's groups with
    the default group's timeout. A DeviceMesh makes its groups with the timeout its options carry,
    30 minutes on gloo without them, as `dist.new_group` does."""
    import torch.distributed as dist
    backend = dist.get_backend()
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = group_timeout()
    return {dim: (backend, options) for dim in range(ndim)}


def new_group(ranks=None, **kwargs):
    """`dist.new_group` with the default group's timeout. `new_group` does not inherit it: a
    group waits PyTorch's default (30 minutes on gloo), so without this a collective that one
    member of a subgroup never joins is not an error within the run's timeout. Collective:
    every rank of the default group calls it, in the same order."""
    import torch.distributed as dist
    kwargs.setdefault("timeout", group_timeout())
    return dist.new_group(ranks, **kwargs)


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


_CLOCKS = ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns", "process_time")


@contextlib.contextmanager
def _watching_clocks():
    """While a demo runs, reading a clock (time.perf_counter() and the like) marks it as timed:
    what it returns then differs from run to run, and a comparison of two builds must not expect
    the same numbers (util/measure.py's timings and bytes mark it too)."""
    from util import measure
    real = {name: getattr(time, name) for name in _CLOCKS}

    def watched(clock):
        def read():
            measure.used = True
            return clock()
        return read
    for name, clock in real.items():
        setattr(time, name, watched(clock))
    try:
        yield
    finally:
        for name, clock in real.items():
            setattr(time, name, clock)


retire = False   # set by a demo whose worker must not run another (see retire_this_worker)


def retire_this_worker():
    """After this demo, the launcher replaces this worker with a fresh process: what ran here
    changed it in ways nobody can vouch for (an exercise check that imported the course's
    modules under a student's function)."""
    global retire
    retire = True


def run_task(rank, world_size, fn, kwargs, threads):
    global retire
    import torch.distributed as dist
    from util import measure
    _reset(0, threads)
    measure.used, retire = False, False
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
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _watching_clocks():
            result["returns"] = fn(rank, world_size, **kwargs)
    except KeyboardInterrupt:   # Ctrl-C stops the build, not just this demo (torchrun's rank 0)
        raise
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
    result["left_group"] = not dist.is_initialized()     # the demo destroyed its group
    result["records"], result["functions"] = recorder.records, recorder.functions
    result["timed"] = measure.used or any(rec["kind"] == "span" for rec in recorder.records)
    result["retire"] = retire
    return result


def run_task_or_error(rank, world_size, fn, kwargs, threads):
    try:
        return run_task(rank, world_size, fn, kwargs, threads)
    except Exception:
        return error_result(rank)


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def dumps(result):
    try:
        return pickle.dumps(result)
    except Exception as e:  # an unpicklable return value must not kill the worker silently
        result.update(ok=False, returns=None, error=f"return value cannot be sent back: {e!r}")
        return pickle.dumps(result)


def error_result(rank):
    return {"rank": rank, "ok": False, "returns": None, "records": [], "functions": {},
            "start": 0, "end": 0, "error": traceback.format_exc()}


def forget_meshes():
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


def describe_failure(got, ranks, timeout, first_done, dead_of=None, exitcode=None, ran=None):
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
        exited = [r for r in dead if exitcode(r) == 0]     # the rank's own sys.exit / os._exit: no crash
        crashed = [r for r in dead if r not in exited]
        if exited:
            parts.append(f"{record.rank_list(exited)} exited (exit code 0) before finishing")
        if crashed:
            parts.append(f"{record.rank_list(crashed)} died (exit codes {[exitcode(r) for r in crashed]})")
        if stuck:
            parts.append(f"{record.rank_list(stuck)} " + (
                f"{'was' if len(stuck) == 1 else 'were'} stopped after {record.rank_list(dead)} "
                f"{'died' if crashed else 'exited'}"
                + (f", {ran:.1f} s into the demo" if ran is not None else "") if dead else
                f"did not finish within {timeout:g} s of rank {first_done} finishing; a rank probably "
                "skipped a collective" if first_done is not None and not failed else
                f"{'was' if len(stuck) == 1 else 'were'} stopped"))
    return "; ".join(parts)
