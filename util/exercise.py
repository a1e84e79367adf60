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
that raises, hangs or cannot be shipped is a verdict too.

A check grades what the statement asks, not only the numbers: it runs at every world size in
`world_size` (a tuple), and with `subgroup` once more on ranks 1..n-1 (group rank != global
rank: a function that ignores its `group` fails there). While the student's function runs, each
dotted name in `watch` is replaced: mapped to a reason, calling it fails with that reason (the
built-in collective an exercise asks you to write, the course's own solution); mapped to None, it
works and is recorded in `calls` for the harness. With `keeps_inputs`, changing a tensor
argument in place is an error too. `show(verdict)` displays it in the
notebook and publishes `{"exercise", "passed", "detail"}` as JSON (util.in_notebook).

`mutant(reference, (old, new), ...)` is a correct function with a line changed, defined as a
cell defines one: the plausible mistakes a check must catch, written as what they change.
"""
import contextlib
import importlib
import inspect
import linecache
import math
import numbers
import sys
import textwrap
import time

from util import launch, record

CHECK_TIMEOUT = 10.0   # seconds a rank may wait in a collective before the check calls it a hang
CHECK_DEADLINE = 30.0  # seconds a whole check may run (a student's endless loop ends here)


class NoSource(ValueError):
    """The function cannot be shipped to the ranks."""


class StudentError(Exception):
    """The student's function did something the statement rules out (the verdict is its message)."""


calls = []   # (short name, elements of its first tensor) of each watched call, on this rank
refused = []  # the refusal of each forbidden call during the student's function, caught or not


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


def load(name, source, given=None, filename=None):
    """Exec `source` in a fresh namespace and return the function `name` it defines. The text is
    registered with linecache (as `filename`), so a traceback shows the student's own lines."""
    filename = filename or f"<your {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    ns = {**namespace(), **(given or {})}
    exec(compile(source, filename, "exec"), ns)
    return ns[name]


_mutants = {}   # name -> source of every mutant defined in this process (their linecache entries)


def mutant(reference, *changes, name=None):
    """`reference` with each `(old, new)` text of `changes` applied in turn: a plausible mistake
    one line away from a correct function, for a check to catch. It is defined as a notebook
    cell defines a function (its source in linecache, under a name of its own), so it ships to
    the ranks like a student's, and sees what the ranks see (namespace()), not the reference's
    module. Each old text must occur exactly once when it is replaced, so a change to the
    reference cannot silently turn a mutant into a copy of it or a no-op."""
    if not changes:
        raise ValueError(f"a mutant of {reference.__name__} needs at least one (old, new) change")
    original = source_of(reference)
    if name is None:
        name = next(f"{reference.__name__}_mutant{n}" for n in range(1, len(_mutants) + 2)
                    if f"{reference.__name__}_mutant{n}" not in _mutants)
    head = f"def {reference.__name__}("
    if not original.startswith(head):
        raise ValueError(f"the source of {reference.__name__} does not start with {head!r}")
    renamed = source = original.replace(head, f"def {name}(", 1)
    for old, new in changes:
        count = source.count(old)
        if count != 1:
            raise ValueError(f"mutant {name}: {old!r} occurs {count} times in the source of "
                             f"{reference.__name__}, not once")
        source = source.replace(old, new)
    if source == renamed:
        raise ValueError(f"mutant {name} is the same as {reference.__name__}")
    if _mutants.get(name, source) != source:
        raise ValueError(f"a different mutant is already named {name}")
    _mutants[name] = source
    return load(name, source, filename=f"<mutant {name}>")


def short(dotted):
    """'torch.distributed.all_reduce' -> 'dist.all_reduce'; the course's functions by module."""
    module, attr = dotted.rsplit(".", 1)
    if module == "torch.distributed":
        return f"dist.{attr}"
    return f"{attr} (from {module})"


def _replacement(dotted, original, reason):
    name = short(dotted)

    def forbidden(*args, **kwargs):
        refused.append(f"your function called {name}, which this exercise does not allow: {reason}")
        raise StudentError(refused[-1])

    def counted(*args, **kwargs):
        first = next((a for a in args if hasattr(a, "numel")), None)
        calls.append((name, first.numel() if first is not None else None))
        return original(*args, **kwargs)
    return forbidden if reason else counted


def _loaded(top):
    """Every loaded module of the package `top` (lectures, exercises)."""
    return [m for name, m in list(sys.modules.items()) if m is not None and name.split(".")[0] == top]


def _spellings(module_name, attr, original):
    """Every (module, name) a student could reach `original` by: the module itself; for
    torch.distributed, distributed_c10d too; for a course function, every loaded module of
    its package that imported it (a lecture file, a demos module), under any name."""
    import torch.distributed.distributed_c10d as c10d
    top = module_name.split(".")[0]
    if module_name == "torch.distributed":
        return [(importlib.import_module(module_name), attr), (c10d, attr)]
    module = importlib.import_module(module_name)
    return [(module, attr)] + [(m, a) for m in _loaded(top) if m is not module
                               for a, v in list(vars(m).items()) if v is original]


@contextlib.contextmanager
def watching(watch):
    """Replace each dotted name of `watch` for the duration (restored even on error), wherever
    it can be reached (_spellings). Two spellings of one function each refuse with their own
    name. A module the student imports during the call takes a replacement from its source,
    so every replacement left in a course module afterwards is put back to the real function."""
    saved, real = [], {}    # id(replacement) -> (replacement, the function it stands for)
    try:
        for dotted, reason in watch.items():
            module_name, attr = dotted.rsplit(".", 1)
            found = getattr(importlib.import_module(module_name), attr)
            original = real.get(id(found), (None, found))[1]   # a second spelling of one replaced
            new = _replacement(dotted, original, reason)
            real[id(new)] = (new, original)
            for m, a in _spellings(module_name, attr, original):
                before = getattr(m, a, None)
                if before is original or before is found:
                    saved.append((m, a, before))
                    setattr(m, a, new)
        yield
    finally:
        for m, attr, before in reversed(saved):
            setattr(m, attr, before)
        tops = {d.split(".")[0] for d in watch if not d.startswith("torch")}   # the course's packages
        for m in [m for top in tops for m in _loaded(top)]:
            for a, v in list(vars(m).items()):
                if id(v) in real and real[id(v)][0] is v:
                    setattr(m, a, real[id(v)][1])


def _tensors(args, names):
    import torch
    return [(n, a, a.detach().clone()) for n, a in zip(names, args) if isinstance(a, torch.Tensor)]


def guarded(fn, watch, keeps_inputs):
    """`fn` as the harness calls it: watched names replaced while it runs, its tensor arguments
    compared after the call when it must keep them, a generator refused by name."""
    import torch
    names = list(inspect.signature(fn).parameters)

    def call(*args, **kwargs):
        before = _tensors(args, names) if keeps_inputs else []
        refused.clear()
        with watching(watch):
            result = fn(*args, **kwargs)
        if refused:     # a try/except in the student's code swallowed the refusal
            raise StudentError(f"{refused[0]} (the error was caught inside your function, which then "
                               "went on; the exercise asks for a solution without that call)")
        for n, a, copy in before:
            same = a.shape == copy.shape and bool(((a == copy) | (a.isnan() & copy.isnan())).all()) \
                if a.dtype.is_floating_point else torch.equal(a, copy)
            if not same:
                raise StudentError(f"your function changed its input {n} in place; the statement "
                                   "asks for a new tensor (clone before an in-place operation)")
        if inspect.isgenerator(result):
            raise StudentError(f"{fn.__name__} returned a generator; return a list (wrap it in list(...))")
        return result
    call.__name__ = fn.__name__
    return call


def on_rank(rank, world_size, harness, sources, given, kwargs, watch=None, keeps_inputs=False,
            subgroup=False):
    """The rank function `spawn` runs: rebuild the shipped functions, run the harness, and with
    `subgroup` run it again on ranks 1..n-1 (rank 0 stands aside)."""
    import torch.distributed as dist
    fns = [guarded(load(name, src, given), watch or {}, keeps_inputs) for name, src in sources]
    out = harness(rank, world_size, *fns, **kwargs)
    if subgroup:
        members = list(range(1, world_size))
        group = dist.new_group(members)          # every rank joins the call, members or not
        if rank in members:
            try:
                sub = harness(rank - 1, len(members), *fns, group=group, **kwargs)
            except Exception as e:
                e.add_note(f"(on the sub-group of ranks {members}: your function must use the group "
                           f"it is given, where this rank is rank {rank - 1}, not the default group)")
                raise
            out += [(f"on the sub-group of ranks {members}, group rank {rank - 1}: {case}", e, g)
                    for case, e, g in sub]
            dist.destroy_process_group(group)
    return out


# --- comparing what a rank computed with what the course computes -----------------------

def _fmt(x):
    if isinstance(x, float):   # the shortest text that reads back as x: two different numbers never look equal
        text = repr(x)
        return text[:-2] if text.endswith(".0") else text
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
        if expected.dtype.is_floating_point != got.dtype.is_floating_point or (
                expected.dtype.is_floating_point and expected.dtype != got.dtype):
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
        # numbers.Real takes numpy's scalars (np.int64, np.float32) too; a 1-element tensor counts
        if isinstance(got, bool) or not isinstance(got, numbers.Real) and not (
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
    """(rank, excerpt) of the failing rank to show: one whose traceback passes through the
    student's own lines if any does (another rank's error may be an echo in the course's code),
    its frames in the student's code kept, then the exception."""
    errors = [rec for rec in run.records if rec["kind"] == "error"]
    if not errors:
        return None, ""
    rec = next((r for r in errors if '"<your ' in r["text"]), errors[0])
    lines = rec["text"].strip().splitlines()
    theirs = [i for i, line in enumerate(lines) if '"<your ' in line]
    if not theirs:
        return rec["rank"], "\n".join(lines[-4:])
    keep = sorted({j for i in theirs for j in (i, i + 1) if j < len(lines)} | set(range(len(lines) - 3, len(lines))))
    return rec["rank"], "\n".join(lines[j] for j in keep)


def _failure(name, run, error, world_size, hint_line):
    """The verdict's text when the ranks did not all return."""
    rank, tail = _rank_error(run) if run is not None else (None, "")
    refused = [line for line in tail.splitlines() if "StudentError: " in line]
    if refused:
        return f"rank {rank}: {refused[-1].split('StudentError: ', 1)[1]}"
    if "NotImplementedError" in tail:
        return f"not written yet (rank {rank} raised NotImplementedError):\n{tail}{hint_line}"
    if "NameError" in tail:
        return (f"rank {rank} of {world_size} raised:\n{tail}\n(your function is sent to the ranks alone: define "
                "the helpers and constants it uses inside it)")
    detail = f"rank {rank} of {world_size} raised:\n{tail}" if tail else error.replace(f"demo 'check {name}'", "the check")
    if "died" in error:
        detail += ("\n(a rank crashed inside PyTorch: often a message to a rank that is not in the "
                   "group; the check runs at more than one world size)")
    elif "deadline" in error:
        detail += "\n(an endless loop? a loop whose counter never changes, or a wait for a message never sent)"
    elif "did not finish" in error or "imed out" in error:
        detail += (f"\n(a rank waited more than {CHECK_TIMEOUT:g} s: every send needs its "
                   "matching recv, and every rank must call the same collectives)")
    return detail + hint_line


def _run_once(name, harness, sources, world_size, kwargs, given, watch, keeps_inputs, subgroup):
    """(run, error) of the harness on `world_size` ranks, recorded out of sight."""
    quiet = record.Recorder()          # the check shows its verdict, not a demo box
    previous = record.use(quiet)
    try:
        run = launch.spawn(on_rank, world_size, name=f"check {name}", timeout=CHECK_TIMEOUT,
                           deadline=CHECK_DEADLINE, harness=harness, sources=sources, given=given,
                           kwargs=kwargs, watch=watch, keeps_inputs=keeps_inputs,
                           subgroup=subgroup and world_size > 1)
        return run, None
    except launch.DemoFailed as e:
        return e.run, e.run.error
    except Exception as e:             # the launcher itself failed: still a verdict
        return None, f"{type(e).__name__}: {e}"
    finally:
        record.use(previous)


def _judge(name, run, error, world_size, rtol, atol, hint_line):
    """(passed, detail or number of cases) of one run."""
    if error:
        return False, _failure(name, run, error, world_size, hint_line)
    if run.status == "skipped" or not run.returns or any(r is None for r in run.returns):
        return False, f"not checked: {run.error or 'a rank returned nothing'}"
    cases = 0
    for rank, got in enumerate(run.returns):
        for case, expected, value in got:
            cases += 1
            diff = first_difference(expected, value, rtol, atol)
            if diff:
                return False, f"rank {rank} of {world_size}, {case}: {diff}{hint_line}"
    return True, cases


def evaluate(name, harness, fns, world_size=3, kwargs=None, given=None, rtol=1e-7, atol=1e-9,
             hint="", sizes="", watch=None, keeps_inputs=False, subgroup=False):
    """Run `harness` with the shipped `fns` on real ranks, at each size of `world_size` (an int
    or a tuple), and judge what came back. Returns a verdict dict {exercise, passed, detail,
    seconds, printed}; never raises."""
    start = time.perf_counter()
    hint_line = f"\nhint: {hint}" if hint else ""
    try:
        sources = [(getattr(fn, "__name__", ""), source_of(fn)) for fn in fns]
    except NoSource as e:
        return _verdict(name, False, f"not checked: {e}", time.perf_counter() - start)
    sizes_run = world_size if isinstance(world_size, tuple) else (world_size,)
    printed, cases = "", 0
    for n in sizes_run:
        run, error = _run_once(name, harness, sources, n, kwargs or {}, given or {}, watch or {},
                               keeps_inputs, subgroup)
        if run is not None:
            printed += "".join(f"[rank {r['rank']} of {n}] {line}\n" for r in run.records
                               if r["kind"] == "output" for line in r["text"].splitlines())
        passed, result = _judge(name, run, error, n, rtol, atol, hint_line)
        if not passed:
            return _verdict(name, False, result, time.perf_counter() - start, printed)
        cases += result
    seconds = time.perf_counter() - start
    on = " and ".join(map(str, sizes_run)) + " real ranks" + (" and a sub-group" if subgroup else "")
    return _verdict(name, True, f"passed on {on}, {cases} case{'' if cases == 1 else 's'}"
                    + (f" ({sizes})" if sizes else "") + f", in {seconds:.1f} s", seconds, printed)


def show(verdict):
    """Display a verdict in the notebook and publish its JSON; returns whether it passed."""
    from util import in_notebook
    in_notebook.exercise_verdict(verdict)
    return verdict["passed"]
