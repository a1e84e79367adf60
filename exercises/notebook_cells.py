"""Write each lecture's exercises into its companion notebook (`python -m exercises.notebook_cells`).

The "Exercises" part goes after the notebook's own "Your turn" cells and before its **Checks**
cell: an introduction, then per exercise its statement (Markdown), its stub (a code cell tagged
`exercise`: the student's function, and under `if solutions:` the course's reference) and its
check (a code cell tagged `check`). Every cell written here is also tagged `exercises`, so
running this again replaces them; the parameters cell gets `solutions = False`.
"""
import hashlib
import os

import nbformat

import exercises
from util import build_notebooks

PARAMETER = "solutions = False             # True: every exercise uses the course's reference solution\n"

INTRO = """## Exercises

Write each function below yourself, then run the cell under it: the check runs your function
**on real ranks** (3 of them, and 2 as well where the world size matters, in their own process
group), at sizes it chooses, against the course's own implementation, and says either *passed* or
the first thing that differs (which rank, which case, which element, expected vs got) with a hint.
It also checks what the statement asks: where it says "send/recv only" or "without gathering", a
collective the exercise forbids fails the check by name, and a ring's messages are counted (only to
its neighbours, the ring's bytes, nothing through the store or a file); a function given a `group`
also runs on a sub-group. A failing check does not stop the notebook; run it again after each
change (each check answers within seconds). Your function is sent to the ranks as source text: keep
it self-contained (`torch`, `dist`, `math`, `F` and `nn` are imported for you there; define helpers
inside it). Set `solutions = True` in the first cell to run every check on the course's reference
solutions instead (they live in `exercises/`)."""


def _id(*parts):
    return hashlib.sha1("/".join(parts).encode()).hexdigest()[:12]


def cells_for(lecture):
    ex_module = exercises.LECTURES[lecture]
    out = [nbformat.v4.new_markdown_cell(INTRO, id=_id(lecture, "intro"), metadata={"tags": ["exercises"]}),
           nbformat.v4.new_code_cell("import exercises   # the checks; the reference solutions stay out of sight",
                                     id=_id(lecture, "import"), metadata={"tags": ["exercises"]})]
    for name, _ in exercises.listing(lecture):
        ex = exercises.get(name)
        fns = [f.__name__ for f in ex.solution]
        assert all(f"def {f}(" in ex.stub for f in fns), (name, fns)
        assert ex.module == ex_module
        use = f"{', '.join(fns)} = exercises.solution({name!r})"
        stub = ex.stub.rstrip() + f"\n\n\nif solutions:\n    {use}\n"
        out += [nbformat.v4.new_markdown_cell(ex.statement, id=_id(name, "statement"),
                                              metadata={"tags": ["exercises"]}),
                nbformat.v4.new_code_cell(stub, id=_id(name, "stub"), metadata={"tags": ["exercise", "exercises"]}),
                nbformat.v4.new_code_cell(f"exercises.check({name!r}, {', '.join(fns)})", id=_id(name, "check"),
                                          metadata={"tags": ["check", "exercises"]})]
    return out


def rewrite(path):
    lecture = os.path.basename(path)[:-6]
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for c in nb.cells if "exercises" not in c.metadata.get("tags", [])]
    params = nb.cells[0]
    if "solutions =" not in params.source:
        params.source = params.source.rstrip("\n") + "\n" + PARAMETER
    checks = next(i for i, c in enumerate(nb.cells) if "checks" in c.metadata.get("tags", []))
    at = checks - 1 if nb.cells[checks - 1].cell_type == "markdown" else checks  # before "**Checks.**"
    nb.cells[at:at] = cells_for(lecture)
    nbformat.validate(nb)
    nbformat.write(nb, path)


def main():
    for name in build_notebooks.available():
        if name in exercises.LECTURES:
            rewrite(os.path.join(build_notebooks.NOTEBOOKS, name + ".ipynb"))
            print(f"wrote the exercises of {name}")


if __name__ == "__main__":
    main()
