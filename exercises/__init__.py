"""The notebooks' exercises: what to write, how it is checked on real ranks, and (out of the
student's way) the course's reference solutions and the plausible wrong ones the tests use.

One module per lecture (exercises/lecture_02.py, ...) registers its exercises with `exercise(...)`.
A notebook uses three names:

    exercises.check("ring_all_reduce", ring_all_reduce)   # the check cell: shows a verdict
    exercises.solution("ring_all_reduce")                  # solutions=True: the reference
    exercises.listing("lecture_02_communication")          # [(name, title)], for the lecture page

Each check runs the student's function on real ranks (util.exercise) at sizes the student did
not choose, against the course's own implementation, and never raises.
"""
import dataclasses
import importlib
import importlib.util
import typing

from lectures import LECTURES as course_lectures
from util import exercise as engine

mutant = engine.mutant   # the lecture modules' wrong solutions: mutant(reference, (old, new), ...)

# lecture -> the module of its exercises: lecture_02_communication -> exercises.lecture_02
LECTURES = {name: "exercises." + name[:len("lecture_NN")] for name in course_lectures}


@dataclasses.dataclass
class Exercise:
    name: str                      # what the student's function is called, unique in the course
    title: str                     # one line, for the lecture page's "Try it yourself" box
    statement: str                 # the notebook's Markdown: what to write, the formula or paper
    stub: str                      # the notebook's code: a def that raises NotImplementedError("hint: ...")
    harness: typing.Callable       # harness(rank, world_size, *fns, **kwargs) -> [(case, expected, got)]
    solution: tuple                # the reference function(s), in the order the student writes them
    wrong: dict                    # {what is wrong: function(s)}: plausible mistakes the check must catch,
                                   # mostly mutant(reference, (old, new)): the reference with one line changed
    hint: str                      # shown under a failing verdict
    sizes: str                     # what the check runs, in words (shown when it passes)
    ranks: typing.Union[int, tuple] = 3   # world sizes the check runs at: (3, 2) catches a hard-coded 3
    watch: dict = dataclasses.field(default_factory=dict)   # {dotted name: reason it is forbidden, or None: counted}
    keeps_inputs: bool = False       # the statement says the function must not change its tensors
    subgroup: bool = False           # harness takes group=: run it on ranks 1..n-1 too
    ring: typing.Callable = None     # n -> how many times its input a rank sends: point-to-point to its
                                     # ring neighbours only (a module-level function: the ranks import it)
    prepare: typing.Callable = None  # () -> kwargs for the harness, computed in this process
    given: typing.Callable = None    # () -> {name: object} also defined where the function runs
    rtol: float = 1e-7
    atol: float = 1e-9
    module: str = ""


_REGISTRY = {}

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
               "all_to_all_single", "broadcast", "reduce", "gather")

# The other spellings of each collective a student finds: the process group's own method (what
# dist.all_reduce calls) and PyTorch's functional collectives.
PROCESS_GROUP = "torch._C._distributed_c10d.ProcessGroup."
FUNCTIONAL = "torch.distributed._functional_collectives."
SPELLINGS = {
    "all_reduce": [PROCESS_GROUP + m for m in ("allreduce", "allreduce_coalesced")]
    + [FUNCTIONAL + f for f in ("all_reduce", "all_reduce_coalesced", "all_reduce_inplace")],
    "all_gather": [PROCESS_GROUP + m for m in ("allgather", "_allgather_base", "all_gather_single",
                                               "allgather_coalesced", "allgather_into_tensor_coalesced")]
    + [FUNCTIONAL + f for f in ("all_gather_tensor", "all_gather_tensor_autograd", "all_gather_inplace")],
    "reduce_scatter": [PROCESS_GROUP + m for m in ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
                                                   "reduce_scatter_tensor_coalesced")]
    + [FUNCTIONAL + f for f in ("reduce_scatter_tensor", "reduce_scatter_tensor_autograd")],
    "all_to_all": [PROCESS_GROUP + m for m in ("alltoall", "alltoall_base", "all_to_all_single")]
    + [FUNCTIONAL + f for f in ("all_to_all_single", "all_to_all_single_autograd", "permute_tensor")],
    "broadcast": [PROCESS_GROUP + "broadcast", FUNCTIONAL + "broadcast"],
    "reduce": [PROCESS_GROUP + "reduce"],
    "gather": [PROCESS_GROUP + "gather"],
}


# The rendezvous store's methods: ranks find each other through it, and a ring's data must not
# travel through it instead of the messages.
STORE = tuple(f"torch._C._distributed_c10d.Store.{m}" for m in (
    "set", "get", "add", "compare_set", "multi_set", "multi_get", "append", "queue_push", "queue_pop"))


def forbid(reason, *names):
    """{dotted name: reason} for Exercise.watch: names the student's function may not call."""
    return {name: reason for name in names}


def built_in(*collectives):
    """torch.distributed's own collectives, as dotted names for forbid(), with the other
    spellings (SPELLINGS) this PyTorch has of each."""
    names = [f"torch.distributed.{c}" for c in collectives]
    for family in {_family(c) for c in collectives} - {None}:
        names += [n for n in SPELLINGS[family] if n not in names and _exists(n)]
    return names


def _family(collective):
    """'reduce_scatter_tensor' -> 'reduce_scatter': the longest SPELLINGS key it starts with."""
    return next((f for f in sorted(SPELLINGS, key=len, reverse=True)
                 if collective == f or collective.startswith(f + "_")), None)


def _exists(dotted):
    try:
        owner, attr = engine.resolve(dotted)
    except (ImportError, AttributeError):
        return False
    return hasattr(owner, attr)


def exercise(**fields):
    """Register an exercise (called by the lecture modules)."""
    ex = Exercise(**fields)
    ex.solution = ex.solution if isinstance(ex.solution, tuple) else (ex.solution,)
    ex.wrong = {k: (v if isinstance(v, tuple) else (v,)) for k, v in ex.wrong.items()}
    if ex.name in _REGISTRY:
        raise ValueError(f"exercise {ex.name!r} is registered twice")
    _REGISTRY[ex.name] = ex
    return ex


def _load_all():
    for module in LECTURES.values():
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)


def listing(lecture_name):
    """[(name, title)] of a lecture's exercises, in the notebook's order."""
    module = importlib.import_module(LECTURES[lecture_name])
    return [(ex.name, ex.title) for ex in _REGISTRY.values() if ex.module == module.__name__]


def get(name):
    if name not in _REGISTRY:
        _load_all()
    if name not in _REGISTRY:
        raise KeyError(f"no exercise named {name!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def solution(name):
    """The course's reference solution (one function, or a tuple when the exercise asks for several)."""
    fns = get(name).solution
    return fns[0] if len(fns) == 1 else fns


def evaluate(name, *fns):
    """Run exercise `name`'s check on `fns`; the verdict dict (util.exercise), never raises."""
    ex = get(name)
    if len(fns) != len(ex.solution):
        wanted = len(ex.solution)
        return engine._verdict(name, False, f"the check needs {wanted} function{'' if wanted == 1 else 's'}: "
                               + ", ".join(f.__name__ for f in ex.solution), 0.0)
    try:
        kwargs = ex.prepare() if ex.prepare else {}
        given = ex.given() if ex.given else {}
    except Exception as e:  # the course's side failed (a lecture mid-edit): say so, do not raise
        return engine._verdict(name, False, f"the check could not prepare its cases: {type(e).__name__}: {e}", 0.0)
    return engine.evaluate(name, ex.harness, fns, world_size=ex.ranks, kwargs=kwargs, given=given,
                           rtol=ex.rtol, atol=ex.atol, hint=ex.hint, sizes=ex.sizes, watch=ex.watch,
                           keeps_inputs=ex.keeps_inputs, subgroup=ex.subgroup, ring=ex.ring)


def check(name, *fns):
    """The check cell: run the check, show the verdict and publish it as JSON (returns nothing,
    so the cell shows only the verdict)."""
    engine.show(evaluate(name, *fns))
