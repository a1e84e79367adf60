"""The notebooks' exercises, checked directly in Python (no notebook): for every exercise the
stub fails its check, the course's reference solution passes it, and every plausible wrong
solution is caught. Each check runs on real ranks (util.exercise)."""
import linecache

import nbformat
import pytest

import exercises
from util import build_notebooks, exercise as engine

pytestmark = pytest.mark.timeout(300)

ALL = [(lecture, name) for lecture in exercises.LECTURES for name, _ in exercises.listing(lecture)]


def stub_functions(ex):
    """The notebook's stub, defined as IPython defines a cell (its text in linecache)."""
    filename = f"<stub of {ex.name}>"
    linecache.cache[filename] = (len(ex.stub), None, ex.stub.splitlines(True), filename)
    ns = engine.namespace()
    exec(compile(ex.stub, filename, "exec"), ns)
    return [ns[f.__name__] for f in ex.solution]


def test_every_lecture_has_three_exercises():
    assert set(exercises.LECTURES) == set(build_notebooks.available())
    for lecture in exercises.LECTURES:
        listed = exercises.listing(lecture)
        assert len(listed) >= 3, (lecture, listed)
        assert all(title and len(title.splitlines()) == 1 for _, title in listed)


@pytest.mark.parametrize("lecture,name", ALL, ids=[n for _, n in ALL])
def test_exercise(lecture, name):
    ex = exercises.get(name)
    assert ex.wrong, f"{name} has no plausible wrong solution to catch"
    stub = exercises.evaluate(name, *stub_functions(ex))
    assert stub["passed"] is False and "NotImplementedError" in stub["detail"], stub
    assert "hint:" in stub["detail"], stub
    right = exercises.evaluate(name, *ex.solution)
    assert right["passed"] is True, right["detail"]
    assert right["seconds"] < 10, f"{name}'s check took {right['seconds']} s"
    for what, fns in ex.wrong.items():
        verdict = exercises.evaluate(name, *fns)
        assert verdict["passed"] is False, f"{name}: the check missed '{what}'"
        # caught by a comparison (rank, case, expected vs got), not by a crash of the shipped code
        assert verdict["detail"].startswith("rank ") and " raised" not in verdict["detail"].split("\n")[0], \
            (what, verdict["detail"])


@pytest.mark.parametrize("lecture", list(exercises.LECTURES))
def test_notebook_has_the_exercises(lecture):
    """Every registered exercise has its statement, stub and check cells in the notebook (written
    by `python -m exercises.notebook_cells`), and the parameters cell has `solutions`."""
    nb = nbformat.read(f"{build_notebooks.NOTEBOOKS}/{lecture}.ipynb", as_version=4)
    assert "solutions = False" in nb.cells[0].source
    stubs = [c.source for c in nb.cells if "exercise" in c.metadata.get("tags", [])]
    checks = [c.source for c in nb.cells if "check" in c.metadata.get("tags", [])]
    names = [n for n, _ in exercises.listing(lecture)]
    assert len(stubs) == len(checks) == len(names)
    for name, stub, check in zip(names, stubs, checks):
        ex = exercises.get(name)
        assert stub.startswith(ex.stub.rstrip()) and "if solutions:" in stub, name
        assert check.startswith(f"exercises.check({name!r}"), check


def test_function_without_source_is_refused():
    verdict = exercises.evaluate("bus_bandwidth", lambda *a: (0, 0))
    assert verdict["passed"] is False and "lambda" in verdict["detail"]
    verdict = exercises.evaluate("bus_bandwidth", max)
    assert verdict["passed"] is False and "not a function written with def" in verdict["detail"]


def test_first_difference_names_the_element():
    import torch
    e = torch.zeros(2, 3, dtype=torch.float64)
    g = e.clone()
    g[1, 2] = 5.0
    assert engine.first_difference(e, g) == "element [1, 2]: expected 0, got 5 (1 of 6 elements differ)"
    assert engine.first_difference([1, e], [1, g]).startswith("result[1]: element [1, 2]")
    assert engine.first_difference({"a": 1}, {"a": 1, "b": 2}) == "unexpected key ['b']"
    assert engine.first_difference([1, 2], [1]) == "length: expected 2 items, got 1"
    assert engine.first_difference(e, g[:1]) == "shape: expected (2, 3), got (1, 3)"
    assert engine.first_difference(float("nan"), float("nan")) is None
