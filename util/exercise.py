"""Checking a student's function on real ranks (the notebooks' exercises).

A worker process imports a rank function by module and name, and a function written in a
notebook cell lives in `__main__`, where no worker can import it. So a check ships the
function's SOURCE: `inspect.getsource` finds it (IPython keeps every cell's text in
`linecache`), each rank execs it in a fresh namespace where torch, dist, math, F and nn are
already imported, and calls the exercise's harness with it:

    verdict = evaluate(name, harness, [student_fn], world_size=3, kwargs={...})

`harness(rank, world_size, *fns, **kwargs)` runs on every rank and returns a list of
`(case, expected, got)`; `evaluate` compares them, rank by rank, and says the first thing that
differs (which rank, which case, which element, expected vs got). It never raises: a function
that raises, hangs or cannot be shipped is a verdict too. `show(verdict)` displays it in the
notebook and publishes `{"exercise", "passed", "detail"}` as JSON (util.in_notebook).
"""
import inspect
import linecache
import math
import textwrap
import time

from util import launch, record

CHECK_TIMEOUT = 10.0   # seconds a rank may wait in a collective before the check calls it a hang
CHECK_DEADLINE = 30.0  # seconds a whole check may run (a student's endless loop ends here)


class NoSource(ValueError):
    """The function cannot be shipped to the ranks."""


def source_of(fn):
    """The source text of a function written with `def` (in a file or a notebook cell)."""
    name = getattr(fn, "__name__", repr(fn))
    if not inspect.isfunction(fn):
        raise NoSource(f"{name} is not a function written with def (got {type(fn).__name__}): "
                       "the ranks need its source")
    if name == "<lambda>":
        raise NoSource("a lambda cannot be shipped to the ranks: write it with def")
    try:
        text = inspect.getsource(fn)
    except (OSError, TypeError) as e:
        raise NoSource(f"cannot find the source of {name} ({e}): define it with def in a cell "
                       "or a file, and run that cell") from None
    return textwrap.dedent(text)


def namespace():
    """What a shipped function sees already imported."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    return {"torch": torch, "dist": dist, "math": math, "F": F, "nn": nn, "__name__": "exercise"}


def load(name, source, given=None):
    """Exec `source` in a fresh namespace and return the function `name` it defines. The text is
    registered with linecache, so a traceback shows the student's own lines."""
    filename = f"<your {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    ns = {**namespace(), **(given or {})}
    exec(compile(source, filename, "exec"), ns)
    return ns[name]


def on_rank(rank, world_size, harness, sources, given, kwargs):
    """The rank function `spawn` runs: rebuild the shipped functions, then run the harness."""
    fns = [load(name, src, given) for name, src in sources]
    return harness(rank, world_size, *fns, **kwargs)


# --- comparing what a rank computed with what the course computes -----------------------

def _fmt(x):
    if isinstance(x, float):
        return f"{x:.6g}"
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


def first_difference(expected, got, rtol=1e-7, atol=1e-9, where=""):
    """None when `got` matches `expected`, else one sentence saying where they first differ.
    Tensors elementwise (shape and NaN/inf included), numbers with tolerance, lists, tuples
    and dicts item by item, everything else with ==."""
    import torch
    at = f"result{where}: " if where else ""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{at}expected a tensor, got {type(got).__name__}: {_fmt(got)}"
        if tuple(got.shape) != tuple(expected.shape):
            return f"{at}shape: expected {tuple(expected.shape)}, got {tuple(got.shape)}"
        if expected.dtype.is_floating_point != got.dtype.is_floating_point:
            return f"{at}dtype: expected {expected.dtype}, got {got.dtype}"
        e, g = expected.detach().cpu(), got.detach().cpu()
        if e.dtype.is_floating_point:
            e, g = e.double(), g.double()
            ok = torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
        else:
            ok = g == e
        if bool(ok.all()):
            return None
        bad = [int(i) for i in (~ok).nonzero()[0]] if ok.dim() else []
        index = f"{at}element {bad}" if bad else f"{at}the value"
        wrong = int((~ok).sum())
        return (f"{index}: expected {_fmt(e[tuple(bad)].item())}, got {_fmt(g[tuple(bad)].item())}"
                f" ({wrong} of {ok.numel()} elements differ)")
    if isinstance(expected, bool) or expected is None or isinstance(expected, str):
        return None if got == expected else f"{at}expected {_fmt(expected)}, got {_fmt(got)}"
    if isinstance(expected, (int, float)):
        if isinstance(got, bool) or not isinstance(got, (int, float)) and not (
                hasattr(got, "item") and getattr(got, "numel", lambda: 0)() == 1):
            return f"{at}expected the number {_fmt(expected)}, got {type(got).__name__}: {_fmt(got)}"
        got = float(got.item() if hasattr(got, "item") else got)
        if math.isclose(got, expected, rel_tol=rtol, abs_tol=atol) or (math.isnan(got) and math.isnan(expected)):
            return None
        return f"{at}expected {_fmt(float(expected))}, got {_fmt(got)}"
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"{at}expected a dict, got {type(got).__name__}: {_fmt(got)}"
        for key in expected:
            if key not in got:
                return f"{at}missing key {key!r}"
            diff = first_difference(expected[key], got[key], rtol, atol, f"{where}[{key!r}]")
            if diff:
                return diff
        extra = [k for k in got if k not in expected]
        return f"{at}unexpected {'key' if len(extra) == 1 else 'keys'} {extra}" if extra else None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return f"{at}expected a {type(expected).__name__}, got {type(got).__name__}: {_fmt(got)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            diff = first_difference(e, g, rtol, atol, f"{where}[{i}]")
            if diff:
                return diff
        if len(got) != len(expected):
            return f"{at}length: expected {len(expected)} items, got {len(got)}"
        return None
    return None if got == expected else f"{at}expected {_fmt(expected)}, got {_fmt(got)}"


# --- one check -----------------------------------------------------------------------------

def _verdict(name, passed, detail, seconds, printed=""):
    return {"exercise": name, "passed": bool(passed), "detail": detail,
            "seconds": round(seconds, 2), "printed": printed}


def _rank_error(run):
    """The end of the first failing rank's traceback: its exception and the student's lines."""
    for rec in run.records:
        if rec["kind"] == "error":
            lines = rec["text"].strip().splitlines()
            theirs = [i for i, l in enumerate(lines) if '"<your ' in l]
            start = theirs[0] if theirs else max(0, len(lines) - 3)
            return rec["rank"], "\n".join(lines[start:][-8:])
    return None, ""


def evaluate(name, harness, fns, world_size=3, kwargs=None, given=None, rtol=1e-7, atol=1e-9,
             hint="", sizes=""):
    """Run `harness` with the shipped `fns` on `world_size` real ranks and judge what came back.
    Returns a verdict dict {exercise, passed, detail, seconds, printed}; never raises."""
    start = time.perf_counter()
    hint_line = f"\nhint: {hint}" if hint else ""
    try:
        sources = [(fn.__name__, source_of(fn)) for fn in fns]
    except NoSource as e:
        return _verdict(name, False, f"not checked: {e}", time.perf_counter() - start)
    quiet = record.Recorder()          # the check shows its verdict, not a demo box
    previous = record.use(quiet)
    run, error = None, None
    try:
        run = launch.spawn(on_rank, world_size, name=f"check {name}", timeout=CHECK_TIMEOUT, deadline=CHECK_DEADLINE,
                           harness=harness, sources=sources, given=given or {}, kwargs=kwargs or {})
    except launch.DemoFailed as e:
        run, error = e.run, e.run.error
    except Exception as e:             # the launcher itself failed: still a verdict
        error = f"{type(e).__name__}: {e}"
    finally:
        record.use(previous)
    seconds = time.perf_counter() - start
    printed = ""
    if run is not None:
        printed = "".join(f"[rank {r['rank']}] {line}\n" for r in run.records if r["kind"] == "output"
                          for line in r["text"].splitlines())
    if error:
        rank, tail = _rank_error(run) if run is not None else (None, "")
        if "NotImplementedError" in tail:
            detail = f"not written yet (rank {rank} raised NotImplementedError):\n{tail}"
        elif tail:
            detail = f"rank {rank} raised:\n{tail}"
        else:
            detail = error.replace(f"demo 'check {name}'", "the check")
        if "deadline" in error:
            detail += "\n(an endless loop? a loop whose counter never changes, or a wait for a message never sent)"
        elif "did not finish" in error or "imed out" in error:
            detail += (f"\n(a rank waited more than {CHECK_TIMEOUT:g} s: every send needs its "
                       "matching recv, and every rank must call the same collectives)")
        return _verdict(name, False, detail + hint_line, seconds, printed)
    if run.status == "skipped" or not run.returns or any(r is None for r in run.returns):
        return _verdict(name, False, f"not checked: {run.error or 'a rank returned nothing'}",
                        seconds, printed)
    cases = 0
    for rank, got in enumerate(run.returns):
        for case, expected, value in got:
            cases += 1
            diff = first_difference(expected, value, rtol, atol)
            if diff:
                return _verdict(name, False, f"rank {rank}, {case}: {diff}{hint_line}", seconds, printed)
    return _verdict(name, True, f"passed on {world_size} real ranks, {cases} case{'' if cases == 1 else 's'}"
                    + (f" ({sizes})" if sizes else "") + f", in {seconds:.1f} s", seconds, printed)


def show(verdict):
    """Display a verdict in the notebook and publish its JSON; returns whether it passed."""
    from util import in_notebook
    in_notebook.exercise_verdict(verdict)
    return verdict["passed"]
