"""What a check relies on in the rank a student's function runs on, and what that function
leaves behind there.

A check runs the student's function in a worker that later checks and demos reuse, beside the
course's own code (the reference the answer is compared with) and PyTorch. `Untouched` notes, by
identity, every attribute of the course's modules, the functions and classes of the engine, of
`torch.distributed`, of `torch` itself and of the standard modules the checks use (random,
math, operator, ...), the code, defaults and closures of those functions and the methods of
those classes (and of `torch.Tensor`, `ProcessGroup`, `random.Random`, ...), and names what
differs afterwards (a rebound case list, a reference whose code was replaced, a patched
`dist.all_reduce` or `random.Random.shuffle`). Identity does not see a container changed in
place (a value written into a course's nested table), so around each call of the student's
function it also compares the contents of the course modules' containers (`_contents`). It
also finds the threads and processes the function left running.
"""
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import types
import warnings

COURSE = ("lectures", "exercises")               # every attribute: the cases and the references
CODE = ("util", "torch.distributed")             # functions and classes (their data moves as they run)
# the standard modules a harness computes with: a patched random.Random.shuffle stops a check's
# shuffling, a patched math.isclose or operator.add its comparison or its sums
STDLIB = ("builtins", "math", "random", "operator", "itertools", "functools", "copy")
CODE_OF = ("torch", "torch.nn.functional", *STDLIB)
CLASSES = (("torch", "Tensor"), ("torch.nn", "Module"), ("torch._C._distributed_c10d", "ProcessGroup"),
           ("torch._C._distributed_c10d", "Work"), ("torch._C._distributed_c10d", "Store"),
           ("random", "Random"))


def _scope(name):
    """'all' for a course module, 'code' for the engine's and PyTorch's, None for the rest."""
    if name.split(".")[0] in COURSE:
        return "all"
    if name in CODE_OF or any(name == p or name.startswith(p + ".") for p in CODE):
        return "code"
    return None


def _is_code(value):
    return isinstance(value, types.ModuleType) or callable(value)


def _cells(fn):
    out = []
    for cell in fn.__closure__ or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:          # a cell not filled yet
            out.append(None)
    return tuple(out)


def _insides(label, value, out):
    """The parts of a function or a class a patch could replace without rebinding it."""
    if isinstance(value, types.FunctionType):
        out[f"{label} (its code)"] = (value.__code__, value.__defaults__, value.__kwdefaults__, *_cells(value))
    elif isinstance(value, type):
        for attr, member in list(vars(value).items()):
            out[f"{label}.{attr}"] = member


def _entries(names):
    """{where: what is there} for the modules `names` (see the module's docstring)."""
    out = {}
    with warnings.catch_warnings():     # reading a deprecated name warns (dist.reduce_op)
        warnings.simplefilter("ignore")
        for name in names:
            module, scope = sys.modules.get(name), _scope(name)
            if module is None:
                continue
            out[f"sys.modules[{name!r}]"] = module
            for attr, value in list(vars(module).items()):
                if scope == "all" or _is_code(value):
                    out[f"{name}.{attr}"] = value
                course_class = isinstance(value, type) and (value.__module__ or "").split(".")[0] in COURSE
                if getattr(value, "__module__", None) == name and (isinstance(value, types.FunctionType)
                                                                    or course_class):
                    _insides(f"{name}.{attr}", value, out)
            for cls in (c for m, c in CLASSES if m == name and hasattr(module, c)):
                _insides(cls, getattr(module, cls), out)
    return out


# --- what a course module's containers hold ---------------------------------------------------

CONTENT_BUDGET = 20_000   # items a fingerprint looks at, all containers together: a check calls it often


SCALARS = (int, float, str, bytes, bool, type(None), complex)


def _fingerprint(value, budget, seen, depth=0):
    """What `value` holds, as a tuple to compare with ==: builtin containers and the instances of
    the course's classes item by item (nested ones too), a tensor by its version counter (every
    in-place change bumps it), anything else by identity. Past `budget[0]` items or 6 levels a
    container counts by identity and length only, so a huge table costs no more than that;
    `seen` keeps each container's fingerprint, since modules re-export one table by many names."""
    if isinstance(value, SCALARS):
        return value
    key = id(value)
    if key in seen:
        return seen[key]
    budget[0] -= 1
    if type(value).__name__ in ("Tensor", "Parameter") and hasattr(value, "_version"):
        out = ("tensor", key, value._version)
    elif budget[0] <= 0 or depth > 6:
        out = ("object", key, len(value) if hasattr(value, "__len__") else None)
    elif isinstance(value, (dict, types.MappingProxyType)):
        out = ("dict", key, tuple((_fingerprint(k, budget, seen, depth + 1), _fingerprint(v, budget, seen, depth + 1))
                                  for k, v in list(value.items())))
    elif isinstance(value, (list, tuple, set, frozenset, bytearray)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else list(value)
        out = (type(value).__name__, key, tuple(_fingerprint(v, budget, seen, depth + 1) for v in items))
    elif hasattr(value, "__dict__") and not isinstance(value, type) and \
            (getattr(type(value), "__module__", "") or "").split(".")[0] in COURSE:
        out = ("object", key, _fingerprint(vars(value), budget, seen, depth + 1))
    else:
        out = ("object", key)
    seen[key] = out
    return out


def _contents(names):
    """{where (its contents): fingerprint} of every container a course module among `names`
    holds (the cases, the references' tables)."""
    out, budget, seen = {}, [CONTENT_BUDGET], {}
    for name in sorted(names):
        module = sys.modules.get(name)
        if module is None or _scope(name) != "all":
            continue
        for attr, value in list(vars(module).items()):
            if not attr.startswith("__") and not _is_code(value):     # functions and classes: _entries
                out[f"{name}.{attr} (its contents)"] = _fingerprint(value, budget, seen)
    return out


def _watched_modules():
    return {name for name, m in list(sys.modules.items()) if m is not None and _scope(name)}


def _same(a, b):
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return all(x is y for x, y in zip(a, b))
    return a is b


class Untouched:
    """The rank as a check found it, to tell afterwards what a student's function changed.

    A harness imports the course's modules as it runs, so `before_call` notes the modules that
    appeared since (as the harness imported them: untouched) before each call of the student's
    function; a module first imported during that call may hold what the function did to it,
    so `after_call` lists it in `unvouched` (the worker is then not reused)."""

    def __init__(self):
        self.modules, self.seen, self.unvouched, self.touched, self.contents = set(), {}, [], [], {}
        self.threads, self.children = set(threading.enumerate()), descendants()
        self.before_call()

    def before_call(self):
        new = _watched_modules() - self.modules
        self.modules |= new
        self.seen.update(_entries(new))
        self.contents = _contents(self.modules)

    def after_call(self):
        """Note what the call changed in place in the course's containers: only the student's
        function runs between before_call and here (the harness may fill a cache of the course's
        between calls, which is not a change)."""
        now = _contents(self.modules)
        self.touched += [where for where, held in self.contents.items()
                         if now.get(where) != held and where not in self.touched]
        new = _watched_modules() - self.modules
        self.unvouched += sorted(new)
        self.modules |= new

    def changes(self):
        """What differs from what was noted: [where]. New names (a module imported since) are not
        changes."""
        now = _entries({w.split("'")[1] for w in self.seen if w.startswith("sys.modules[")})
        return self.touched + [where for where, value in self.seen.items()
                               if where not in now or not _same(value, now[where])]

    def started_threads(self):
        return [t for t in threading.enumerate() if t not in self.threads and t.is_alive()]

    def end_children(self):
        end_children(self.children)


# --- processes a function started ------------------------------------------------------------

def adopt_orphans():
    """Make this process the parent of every process its children start and abandon (Linux's
    child subreaper), so `end_children` finds them too; elsewhere a no-op."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER


def _parents():
    """{pid: parent pid} of every process (Linux's /proc; empty elsewhere)."""
    out = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{entry}/stat") as f:
                        out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    return out


def descendants():
    """The pids of this process's children, their children, and so on."""
    parents, found, frontier = _parents(), set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def end_children(before):
    """Kill every descendant not in `before` (a set of pids) and reap them: a killed process
    stays a zombie until its parent waits for it, and an orphan's parent becomes this process."""
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        extra = descendants() - before
        if not extra:
            return
        for pid in extra:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):   # not ours: its own parent reaps it
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.01)
