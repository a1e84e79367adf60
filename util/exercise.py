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
dotted name in `watch` (a module's function or a class's method) is replaced: mapped to a
reason, calling it fails with that reason (the built-in collective an exercise asks you to
write, the course's own solution); mapped to None, it works and is recorded for the harness
(`calls_of(fn)`), where the function cannot write. With `keeps_inputs`, changing a tensor argument in place is an error too. With `ring`
(n -> how many times its input a rank sends), the function may pass point-to-point messages to
its ring neighbours only, that many bytes of them, and write nothing else: a collective, the
rendezvous store or a file fails the check. Reaching a frame of the checker, where the expected
answer is (sys._getframe, a traceback's tb_frame, gc, a tracer: FRAME_EVENTS), is refused.

Every check starts from a clean rank and leaves one: what the function changes in the course's
modules, the engine or PyTorch (util.rank_state), a thread it leaves running or a process group
it destroys fails the check, and the workers are thrown away (as after any error on a rank, and
after a function that imported course modules the harness had not); a process it starts ends
with the check. A check that ran no case fails. The deadline covers the whole check, and
what the function prints is capped in the verdict. `show(verdict)` displays it in the notebook
and publishes `{"exercise", "passed", "detail"}` as JSON (util.in_notebook).

`mutant(reference, (old, new), ...)` is a correct function with a line changed, defined as a
cell defines one: the plausible mistakes a check must catch, written as what they change.
"""
import contextlib
import importlib
import inspect
import linecache
import math
import numbers
import os
import re
import sys
import textwrap
import threading
import time
import types

from util import launch, measure, rank_state, ranks, record

CHECK_TIMEOUT = 10.0   # seconds a rank may wait in a collective before the check calls it a hang
CHECK_DEADLINE = 30.0  # seconds a whole check may run, every world size together (an endless loop ends here)
PRINTED_LIMIT = 20_000  # characters of what the function printed that a verdict keeps


class NoSource(ValueError):
    """The function cannot be shipped to the ranks."""


class StudentError(Exception):
    """The student's function did something the statement rules out (the verdict is its message)."""


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
    """'torch.distributed.all_reduce' -> 'dist.all_reduce'; a class's method by its class
    ('ProcessGroup.allreduce'); the course's functions by module."""
    module, attr = dotted.rsplit(".", 1)
    if module == "torch.distributed":
        return f"dist.{attr}"
    if module.rsplit(".", 1)[-1][:1].isupper():
        return f"{module.rsplit('.', 1)[-1]}.{attr}"
    return f"{attr} (from {module})"


def resolve(dotted):
    """(module or class, attribute name) of a dotted name."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:-1]:
            owner = getattr(owner, part)
        return owner, parts[-1]
    raise ImportError(f"cannot import {dotted}")


def _get(owner, attr):
    """What `owner` holds under `attr`: a class's own entry (a method as stored, so that putting it
    back keeps it a method), a module's attribute."""
    return vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr, None)


def _replacement(dotted, reason, refused):
    name = short(dotted)

    def forbidden(*args, **kwargs):
        refused.append(f"your function called {name}, which this exercise does not allow: {reason}")
        raise StudentError(refused[-1])

    def counted(*args, **kwargs):
        # The record and the real function are locals of the outermost guarded call on the stack
        # (the harness's), which the student's function cannot reach (frames are refused to it):
        # an entry is written only here, by a real call, and nothing in this closure can be
        # swapped to make a call that is not one.
        frame, private = sys._getframe(1), None
        while frame is not None:
            if frame.f_code is _CALL_CODE:
                private = frame.f_locals["private"]
            frame = frame.f_back
        if private is None:
            raise StudentError(f"your function called {name} from a thread it started: the check "
                               "counts the calls your function makes itself")
        first = next((a for a in args if hasattr(a, "numel")), None)
        private["record"].append((name, first.numel() if first is not None else None))
        return private["originals"][dotted](*args, **kwargs)
    return forbidden if reason else counted


def _loaded(top):
    """Every loaded module of the package `top` (lectures, exercises)."""
    return [m for name, m in list(sys.modules.items()) if m is not None and name.split(".")[0] == top]


def _spellings(owner, attr, original):
    """Every (module or class, name) a student could reach `original` by: where it is defined;
    for torch.distributed, distributed_c10d too; for a course function, every loaded module of
    its package that imported it (a lecture file, a demos module), under any name."""
    import torch.distributed.distributed_c10d as c10d
    if isinstance(owner, type):
        return [(owner, attr)]
    if owner.__name__ == "torch.distributed":
        return [(owner, attr), (c10d, attr)]
    if owner.__name__.startswith("torch."):
        return [(owner, attr)]
    return [(owner, attr)] + [(m, a) for m in _loaded(owner.__name__.split(".")[0]) if m is not owner
                              for a, v in list(vars(m).items()) if v is original]


@contextlib.contextmanager
def watching(watch, refused, private=None):
    """Replace each dotted name of `watch` for the duration (restored even on error), wherever
    it can be reached (_spellings); each refusal is appended to `refused`, each counted call to
    `private["record"]` (the real functions go in `private["originals"]`, see `_replacement`). Two spellings of one
    function each refuse with their own name. A module the student imports during the call
    takes a replacement from its source, so every replacement left in a course module
    afterwards is put back to the real function."""
    saved, real = [], {}    # id(replacement) -> (replacement, the function it stands for)
    private = {"record": [], "originals": {}} if private is None else private
    try:
        for dotted, reason in watch.items():
            owner, attr = resolve(dotted)
            found = _get(owner, attr)
            original = real.get(id(found), (None, found))[1]   # a second spelling of one replaced
            new = _replacement(dotted, reason, refused)
            private["originals"][dotted] = original
            real[id(new)] = (new, original)
            for m, a in _spellings(owner, attr, original):
                before = _get(m, a)
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


# --- what the function may not look at, and what it sends --------------------------------

# How code reaches a frame, where the expected answer is (a local of the harness, a few frames up):
# each is an audit event of CPython, raised however it is spelled. Patching sys._getframe missed a
# caught exception's traceback (tb_frame), a generator's frame, gc.get_referents of a traceback,
# a tracer (sys.settrace, sys.setprofile) and Python's own C functions through ctypes.
FRAME_EVENTS = frozenset({"sys._getframe", "sys._current_frames", "sys._current_exceptions",
                          "gc.get_objects", "gc.get_referrers", "gc.get_referents"})
FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
TRACING_EVENTS = frozenset({"sys.settrace", "sys.setprofile", "sys.monitoring.register_callback", "ctypes.dlsym"})
_peeking = {"hooked": False, "refused": None, "busy": threading.local()}


def _students(frame):
    """Whether `frame`, or the code that called into inspect or traceback to reach it, is a
    shipped function's ("<your ...>"), or code compiled from a string (no module file behind it)
    while a shipped function runs: a function could compile its peeking under another name."""
    import traceback
    helpers = {inspect.__file__, traceback.__file__}
    while frame is not None and frame.f_code.co_filename in helpers:
        frame = frame.f_back
    if frame is None:
        return False
    name = frame.f_code.co_filename
    return name.startswith("<your ") or (not _from_a_module_file(name) and _under_students(frame))


def _from_a_module_file(name):
    """Whether code named `name` was loaded from a file (PyTorch's, Python's, frozen or not, the
    course's), not compiled from a string by whoever called compile()."""
    return name.startswith("<frozen ") or (not name.startswith("<") and os.path.isfile(name))


def _under_students(frame):
    """Whether a shipped function's frame is anywhere on the stack from `frame` up."""
    while frame is not None and not frame.f_code.co_filename.startswith("<your "):
        frame = frame.f_back
    return frame is not None


def _peeks(event, args):
    """What a watched audit event hands out, in words, or None for an event that hands out no
    frame. A tracer sees every frame, so setting one is refused wherever the student's code is
    on the stack; the frame-giving events only when the student's code asked (PyTorch's and
    Python's own uses go through)."""
    if event == "object.__getattr__":
        return f"read {type(args[0]).__name__}.{args[1]}" if len(args) > 1 and args[1] in FRAME_ATTRIBUTES else None
    if event == "ctypes.dlsym":
        symbol = str(args[-1]) if args else ""
        return f"looked up {symbol} through ctypes" if symbol.lstrip("_").startswith("Py") else None
    return f"called {event}" if event in FRAME_EVENTS or event in TRACING_EVENTS else None


def _audit(event, args):
    """The audit hook (see FRAME_EVENTS): raise StudentError when the student's code asks for a
    frame, and note it for `guarded`, which fails the check even if the function caught it."""
    if event not in FRAME_EVENTS and event not in TRACING_EVENTS and event != "object.__getattr__":
        return
    busy = _peeking["busy"]
    if getattr(busy, "on", False):       # this hook's own sys._getframe raises the event too
        return
    busy.on = True
    try:
        what = _peeks(event, args)
        if what is None:
            return
        asker = sys._getframe(1)
        if not (_under_students(asker) if event in TRACING_EVENTS else _students(asker)):
            return
    finally:
        busy.on = False
    message = (f"your function {what}: a check gives your function its inputs and nothing else "
               "(the expected answer is the checker's)" + (
                   "; printing a traceback inside your function reads its frames too: let the error "
                   "propagate" if "tb_frame" in what else ""))
    if _peeking["refused"] is not None:
        _peeking["refused"].append(message)
    raise StudentError(message)


@contextlib.contextmanager
def no_peeking(refused):
    """Refuse the student's code the frames and objects of the checker while it runs, and note
    each refusal in `refused`. An audit hook cannot be removed, so it is added once per process
    and refuses only code from a shipped function ("<your ...>"): only checks run that."""
    if not _peeking["hooked"]:
        sys.addaudithook(_audit)
        _peeking["hooked"] = True
    previous, _peeking["refused"] = _peeking["refused"], refused
    try:
        yield
    finally:
        _peeking["refused"] = previous


PEER = {"isend": "dst", "send": "dst", "irecv": "src", "recv": "src"}


@contextlib.contextmanager
def point_to_point(messages):
    """Append (kind, peer, bytes) to `messages` for every isend, irecv, send and recv while it
    runs, whichever spelling (P2POp and batch_isend_irecv call them); yields a dict whose
    'written' is, afterwards, every byte this process wrote meanwhile (None where the kernel
    does not count them)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    real = {kind: getattr(c10d, kind) for kind in PEER}

    def recording(kind):
        def call(tensor, *args, **kwargs):
            peer = args[0] if args else kwargs.get(PEER[kind], kwargs.get("group_" + PEER[kind]))
            messages.append((kind, peer, tensor.nbytes))
            return real[kind](tensor, *args, **kwargs)
        return call
    wire = {"written": None}
    before = measure._written() if measure.can_count_bytes() else None
    try:
        for kind in PEER:
            new = recording(kind)
            setattr(dist, kind, new)
            setattr(c10d, kind, new)
        yield wire
    finally:
        for kind, fn in real.items():
            setattr(dist, kind, fn)
            setattr(c10d, kind, fn)
        if before is not None:
            wire["written"] = measure._written() - before


HEADER_BYTES = 128   # what the transport adds to a message, at most (gloo's header, a little spare)


def check_ring(ring, x, messages, written):
    """Raise StudentError unless the messages of one call are a ring's: sent right, received
    from the left, nothing else written (a collective, the store, a file), and `ring(n)` times
    the input's bytes sent, give or take the two elements that uneven chunks shift."""
    import torch.distributed as dist
    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    for kind, peer, _ in messages:
        sends = kind in ("isend", "send")
        if peer != (right if sends else left):
            raise StudentError(
                f"your function {'sent to' if sends else 'received from'} "
                f"{'any rank' if peer is None else f'rank {peer}'}: in a ring of {n} ranks, rank {rank} "
                f"sends only to its right neighbour, rank {right}, and receives only from its left, rank {left}")
    sent = sum(size for kind, _, size in messages if kind in ("isend", "send"))
    if written is not None and written - sent > HEADER_BYTES * (len(messages) + 1):
        raise StudentError(
            f"your function wrote {written - sent:,} bytes besides its {len(messages)} point-to-point "
            f"messages' {sent:,}: a collective (a process group's method, a functional collective), "
            "the rendezvous store or a file carried data; the exercise asks for dist.isend/dist.irecv only")
    want, slack = ring(n) * x.nbytes, 2 * x.element_size()
    if abs(sent - want) > slack:
        raise StudentError(
            f"your function sent {sent:,} bytes for an input of {x.nbytes:,} bytes on {n} ranks; the "
            f"statement's ring sends {want:,.0f} from each rank (give or take {slack} bytes of uneven chunks)")


def _tensors(args, names):
    import torch
    return [(n, a, a.detach().clone()) for n, a in zip(names, args) if isinstance(a, torch.Tensor)]


def _kept(before):
    """Raise StudentError if a tensor argument differs from its copy in `before`."""
    import torch
    for n, a, copy in before:
        same = a.shape == copy.shape and bool(((a == copy) | (a.isnan() & copy.isnan())).all()) \
            if a.dtype.is_floating_point else torch.equal(a, copy)
        if not same:
            raise StudentError(f"your function changed its input {n} in place; the statement "
                               "asks for a new tensor (clone before an in-place operation)")


def guarded(fn, watch, keeps_inputs, ring, untouched):
    """`fn` as the harness calls it: watched names replaced and the checker's frames refused
    while it runs, its messages checked against a ring's (`ring`), its tensor arguments
    compared after the call when it must keep them, a generator refused by name; `untouched`
    (rank_state) notes the modules around each call."""
    import torch
    names = list(inspect.signature(fn).parameters)

    def call(*args, **kwargs):
        before = _tensors(args, names) if keeps_inputs else []
        refused, messages = [], []
        private = {"record": [], "originals": {}}     # the watched calls: see _replacement
        counting = point_to_point(messages) if ring else contextlib.nullcontext({"written": None})
        untouched.before_call()
        try:
            with watching(watch, refused, private), no_peeking(refused), counting as wire:
                result = fn(*args, **kwargs)
        finally:
            untouched.after_call()
            call.calls = tuple(private["record"])
        if refused:     # a try/except in the student's code swallowed the refusal
            raise StudentError(f"{refused[0]} (the error was caught inside your function, which then "
                               "went on; the exercise asks for a solution without that call)")
        if ring:
            check_ring(ring, next(a for a in args if isinstance(a, torch.Tensor)), messages, wire["written"])
        _kept(before)
        if inspect.isgenerator(result):
            raise StudentError(f"{fn.__name__} returned a generator; return a list (wrap it in list(...))")
        return result
    call.__name__, call.calls = fn.__name__, ()
    return call


# the code of guarded's `call`, by which a counted call finds the harness's record (_replacement)
_CALL_CODE = next(c for c in guarded.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "call")


def calls_of(fn):
    """[(short name, elements of its first tensor)] of each watched call (mapped to None) that the
    last call of `fn`, a function the harness was given, made. The list is the harness's own: a
    student's function can neither reach nor write it."""
    return list(getattr(fn, "calls", ()))


def _left_as_found(untouched):
    """Raise StudentError if the rank is not as the check found it; a worker whose modules the
    function may have changed unseen (it imported them) is not reused."""
    import torch.distributed as dist
    if untouched.unvouched:
        ranks.retire_this_worker()
    changed = untouched.changes()
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        raise StudentError(f"your function changed {shown}: a check's function must leave the "
                           "course's code and PyTorch as it found them (the check compares your "
                           "answer with the course's own code, on ranks that later checks reuse)")
    if not dist.is_initialized():
        raise StudentError("your function destroyed the process group (dist.destroy_process_group): "
                           "the ranks still need it after your function returns; leave that to the caller")
    left = untouched.started_threads()
    if left:
        raise StudentError(f"your function left {len(left)} thread{'s' if len(left) > 1 else ''} running "
                           f"({', '.join(t.name for t in left)}): join every thread it starts before it returns")


def _harness_runs(rank, world_size, harness, fns, kwargs, subgroup):
    """The harness's cases on every rank, and with `subgroup` those of ranks 1..n-1 on a group
    of their own (rank 0 stands aside)."""
    import torch.distributed as dist
    out = harness(rank, world_size, *fns, **kwargs)
    if subgroup:
        members = list(range(1, world_size))
        group = ranks.new_group(members)    # every rank joins the call, members or not
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


def on_rank(rank, world_size, harness, sources, given, kwargs, watch=None, keeps_inputs=False,
            subgroup=False, ring=None):
    """The rank function `spawn` runs: rebuild the shipped functions, run the harness (and the
    sub-group pass), end the processes the functions started, and fail if they left the rank
    changed."""
    rank_state.adopt_orphans()
    untouched = rank_state.Untouched()
    fns = [guarded(load(name, src, given), watch or {}, keeps_inputs, ring, untouched) for name, src in sources]
    try:
        return _harness_runs(rank, world_size, harness, fns, kwargs, subgroup)
    finally:
        untouched.end_children()
        _left_as_found(untouched)


# --- comparing what a rank computed with what the course computes -----------------------

def _fmt(x):
    if isinstance(x, float):   # the shortest text that reads back as x: two different numbers never look equal
        text = repr(x)
        return text[:-2] if text.endswith(".0") else text
    text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


def _unlike(expected, got):
    """How `got` is not the kind of tensor `expected` is (layout, device, shape, dtype), or None."""
    if got.layout != expected.layout:
        return f"expected a dense tensor, got layout {got.layout}"
    if got.device.type != expected.device.type:
        meta = " (a meta tensor has a shape but no values)" if got.device.type == "meta" else ""
        return f"expected a tensor on {expected.device.type}, got one on {got.device}{meta}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"shape: expected {tuple(expected.shape)}, got {tuple(got.shape)}"
    if expected.dtype.is_floating_point != got.dtype.is_floating_point or (
            expected.dtype.is_floating_point and expected.dtype != got.dtype):
        return f"dtype: expected {expected.dtype}, got {got.dtype}"
    return None


def _tensor_difference(expected, got, rtol, atol, at):
    import torch
    if not isinstance(got, torch.Tensor):
        return f"{at}expected a tensor, got {type(got).__name__}: {_fmt(got)}"
    unlike = _unlike(expected, got)
    if unlike:
        return at + unlike
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
    return (f"{index}: expected {_fmt(e[tuple(bad)].item())}, got {_fmt(g[tuple(bad)].item())}"
            f" ({int((~ok).sum())} of {ok.numel()} elements differ){_never_written(g[tuple(bad)].item())}")


def _never_written(value):
    """A note when a float looks like memory nobody wrote: torch.empty's leftovers are often
    denormals (6.9e-310) or absurdly large."""
    if isinstance(value, float) and math.isfinite(value) and value != 0 and not 1e-300 < abs(value) < 1e300:
        return (" — a value like that is usually memory never written (torch.empty): a slot your "
                "function did not fill")
    return ""


def first_difference(expected, got, rtol=1e-7, atol=1e-9, where=""):
    """None when `got` matches `expected`, else one sentence saying where they first differ.
    Tensors elementwise (shape and NaN/inf included), numbers with tolerance, lists, tuples
    and dicts item by item, everything else with ==."""
    import torch
    at = f"result{where}: " if where else ""
    if isinstance(expected, torch.Tensor):
        return _tensor_difference(expected, got, rtol, atol, at)
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
        return f"{at}expected {_fmt(float(expected))}, got {_fmt(got)}{_never_written(got)}"
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


# How the ranks failed, read from the launcher's error or the rank's traceback, and a note on what
# to look for: it replaces the exercise's hint, which is about the arithmetic.
SITUATIONS = (
    (("exited (exit code 0)",), "\n(a rank's process ended before its function returned: sys.exit or "
                                "os._exit ends the worker; return the result instead)"),
    (("died",), "\n(a rank crashed inside PyTorch: often a message to a rank that is not in the group; "
                "the check runs at more than one world size)"),
    (("deadline",), "\n(an endless loop? a loop whose counter never changes, or a wait for a message never sent)"),
    (("did not finish", "imed out"), "\n(a rank waited more than {timeout:g} s: every send needs its "
                                     "matching recv, and every rank must call the same collectives)"),
)


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
    detail = f"rank {rank} of {world_size} raised:\n{tail}" if tail else re.sub(
        r"the demo's deadline of [0-9.]+ s", f"the check's deadline of {CHECK_DEADLINE:g} s (every world size "
        "together)", error.replace(f"demo 'check {name}'", "the check"))
    said = f"{error}\n{tail}"
    situation = next((note for words, note in SITUATIONS if any(w in said for w in words)), None)
    return detail + (situation.format(timeout=CHECK_TIMEOUT) if situation else hint_line)


def _run_once(name, harness, sources, world_size, kwargs, given, rules, deadline):
    """(run, error) of the harness on `world_size` ranks, recorded out of sight. A check whose
    ranks could not connect to each other (gloo's connectFullMesh, where the check forms its
    sub-group, fails now and then on a loaded machine) runs once more on fresh workers: that
    failure is the machine's, not the function's, and must not become its verdict."""
    start = time.perf_counter()
    run, error = _run_quietly(name, harness, sources, world_size, kwargs, given, rules, deadline)
    if error and _could_not_connect(run):
        left = deadline - (time.perf_counter() - start)
        if left > 0:
            run, error = _run_quietly(name, harness, sources, world_size, kwargs, given, rules, left)
    return run, error


def _could_not_connect(run):
    """Whether a rank failed inside the check's own `new_group` with gloo's transport error."""
    return run is not None and any(r["kind"] == "error" and "in new_group" in r["text"]
                                   and re.search(r"connectFullMesh|Connection (closed|reset) by peer", r["text"])
                                   for r in run.records)


def _run_quietly(name, harness, sources, world_size, kwargs, given, rules, deadline):
    quiet = record.Recorder()          # the check shows its verdict, not a demo box
    previous = record.use(quiet)
    try:
        run = launch.spawn(on_rank, world_size, name=f"check {name}", timeout=CHECK_TIMEOUT,
                           deadline=deadline, harness=harness, sources=sources, given=given,
                           kwargs=kwargs, **{**rules, "subgroup": rules["subgroup"] and world_size > 1})
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
            try:
                diff = first_difference(expected, value, rtol, atol)
            except Exception as e:          # a result no comparison foresaw: a verdict all the same
                diff = f"the check could not compare your result ({type(value).__name__}): {type(e).__name__}: {e}"
            if diff:
                return False, f"rank {rank} of {world_size}, {case}: {diff}{hint_line}"
    if not cases:
        return False, (f"the check ran no case on {world_size} ranks: its harness returned none, so "
                       "nothing was compared (were the check's cases changed?)")
    return True, cases


def _printed(run, world_size):
    return "".join(f"[rank {r['rank']} of {world_size}] {line}\n" for r in run.records
                   if r["kind"] == "output" for line in r["text"].splitlines())


def _capped(text):
    """The first PRINTED_LIMIT characters of `text`, and how much more there was."""
    if len(text) <= PRINTED_LIMIT:
        return text
    more = len(text) - PRINTED_LIMIT
    size = f"{more / 1e6:.1f} MB" if more >= 1e6 else f"{more / 1e3:.1f} kB" if more >= 1e3 else f"{more} characters"
    return text[:PRINTED_LIMIT] + f"\n… {size} more not shown\n"


# a function checked on a sub-group must use the group it is given
_OWN_GROUPS = {f"torch.distributed.{fn}": "use the group your function is given: making a group is a "
               "collective of every rank of the default group, and in the check's sub-group pass rank 0 "
               "is not there to join it" for fn in ("new_group", "new_subgroups")}


def _sizes(world_size):
    return world_size if isinstance(world_size, tuple) else (world_size,)


def evaluate(name, harness, fns, world_size=3, kwargs=None, given=None, rtol=1e-7, atol=1e-9,
             hint="", sizes="", watch=None, keeps_inputs=False, subgroup=False, ring=None):
    """Run `harness` with the shipped `fns` on real ranks, at each size of `world_size` (an int
    or a tuple), and judge what came back. Returns a verdict dict {exercise, passed, detail,
    seconds, printed}; never raises."""
    start = time.perf_counter()
    try:
        sources = [(getattr(fn, "__name__", ""), source_of(fn)) for fn in fns]
    except NoSource as e:
        return _verdict(name, False, f"not checked: {e}", time.perf_counter() - start)
    rules = {"watch": {**(watch or {}), **(_OWN_GROUPS if subgroup else {})}, "keeps_inputs": keeps_inputs,
             "subgroup": subgroup, "ring": ring}
    try:
        passed, detail, printed = _check(name, harness, sources, world_size, kwargs or {}, given or {}, rules,
                                         rtol, atol, f"\nhint: {hint}" if hint else "", start)
    except Exception as e:              # the engine's own failure is a verdict too, never a traceback
        passed, detail, printed = False, f"the check failed: {type(e).__name__}: {e}", ""
    seconds = time.perf_counter() - start
    if passed:
        on = " and ".join(map(str, _sizes(world_size))) + " real ranks" + (" and a sub-group" if subgroup else "")
        detail = (f"passed on {on}, {detail} case{'' if detail == 1 else 's'}"
                  + (f" ({sizes})" if sizes else "") + f", in {seconds:.1f} s")
    return _verdict(name, passed, detail, seconds, _capped(printed))


def _check(name, harness, sources, world_size, kwargs, given, rules, rtol, atol, hint_line, start):
    """(passed, detail or number of cases, printed) of the runs at every world size, within
    CHECK_DEADLINE of `start` all together (starting workers does not count)."""
    printed, cases, startups = "", 0, len(launch.startups)
    for n in _sizes(world_size):
        starting = sum(seconds for _, seconds in launch.startups[startups:])   # the workers', not the function's
        left = CHECK_DEADLINE - (time.perf_counter() - start - starting)
        if left <= 0:
            return False, (f"the check ran out of its {CHECK_DEADLINE:g} s before its run on {n} ranks "
                           "(the deadline covers every world size together)"), printed
        run, error = _run_once(name, harness, sources, n, kwargs, given, rules, left)
        printed += _printed(run, n) if run is not None else ""
        passed, result = _judge(name, run, error, n, rtol, atol, hint_line)
        if not passed:
            return False, result, printed
        cases += result
    return True, cases, printed


def show(verdict):
    """Display a verdict in the notebook and publish its JSON; returns whether it passed."""
    from util import in_notebook
    in_notebook.exercise_verdict(verdict)
    return verdict["passed"]
