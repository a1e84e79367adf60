"""The tree shows the course: eight lecture files beside one package of building blocks per
topic; the blocks never import a lecture file, and the engine (util/) imports no course package.
A lecture file imports only what its page uses; everyone else imports a building block from its
topic package (`from lectures.pipeline import make_schedule`)."""
import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LECTURES = ROOT / "lectures"
PACKAGES = {"model", "data_parallel", "tensor_parallel", "pipeline", "context_parallel", "layout", "checkpoint"}


def imported_modules(path):
    """Every module a file imports, at any depth ('from a import b' counts a and a.b)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            names.append(n.module)
            names += [f"{n.module}.{a.name}" for a in n.names]
    return names


def test_lectures_holds_eight_lecture_files_and_the_topic_packages():
    files = sorted(p.name for p in LECTURES.glob("*.py") if p.name != "__init__.py")
    assert len(files) == 8 and all(f.startswith("lecture_0") for f in files), files
    packages = {p.name for p in LECTURES.iterdir() if (p / "__init__.py").exists()}
    assert packages == PACKAGES
    for package in PACKAGES:
        assert not [p for p in (LECTURES / package).iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_no_building_block_imports_a_lecture_file():
    for path in LECTURES.glob("*/*.py"):
        lectures = [m for m in imported_modules(path) if m.startswith("lectures.lecture_")]
        assert not lectures, (path.relative_to(ROOT), lectures)


def test_no_lecture_imports_another():
    for path in LECTURES.glob("lecture_*.py"):
        others = [m for m in imported_modules(path) if m.startswith("lectures.lecture_")]
        assert not others, (path.name, others)


def test_the_engine_imports_no_course_package():
    for path in (ROOT / "util").glob("*.py"):
        course = [m for m in imported_modules(path) if m.split(".")[0] in ("lectures", "exercises")]
        assert not course, (path.name, course)


def test_each_lecture_file_defines_its_sections_in_the_order_main_calls_them():
    """A lecture file reads top to bottom as its page: the section functions it defines appear
    in the order main() first calls them (deep dives are imported, so they do not count)."""
    for path in sorted(LECTURES.glob("lecture_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {n.name: n.lineno for n in tree.body if isinstance(n, ast.FunctionDef)}
        main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
        calls = []
        for node in sorted((n for n in ast.walk(main) if isinstance(n, ast.Call)), key=lambda n: n.lineno):
            if isinstance(node.func, ast.Name) and node.func.id in defined and node.func.id not in calls:
                calls.append(node.func.id)
        lines = [defined[c] for c in calls]
        assert len(calls) >= 5 and lines == sorted(lines), (path.name, calls)


def test_each_lecture_file_reads_in_one_sitting():
    """The issue's aim (~800 lines): what only the pages need lives in the topic packages."""
    for path in sorted(LECTURES.glob("lecture_*.py")):
        n = len(path.read_text(encoding="utf-8").splitlines())
        assert n <= 900, f"{path.name} has {n} lines: move its demos, deep dives or drawings to its package"


PAGE_MODULES = {"demos", "figures", "deep_dives", "communication_demos", "communication_deep_dives"}


@functools.lru_cache(maxsize=None)      # each module is asked about once per name it exports
def top_level_names(path):
    """What a module file defines or imports at its top level (a static `dir()`)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_a_lecture_file_imports_only_what_its_page_uses():
    """Its import block reads as the list of what the page calls: a name imported and never used
    would be an export the reader cannot tell apart (building blocks are imported from their
    topic package instead)."""
    for path in sorted(LECTURES.glob("lecture_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        imported = [(a.asname or a.name).split(".")[0] for n in tree.body
                    if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names]
        unused = [name for name in imported if name not in used]
        assert not unused, (path.name, unused)
        assert "noqa" not in path.read_text(encoding="utf-8"), path.name


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_each_topic_package_names_its_building_blocks(package):
    """`from lectures.<topic> import X` is how notebooks, exercises and tests reach a building
    block: every name of the package's __all__ is there, once, and is the mechanism (defined
    in the package, not in its demos, figures or deep dives)."""
    import importlib
    module = importlib.import_module(f"lectures.{package}")
    names = module.__all__
    assert names and len(names) == len(set(names)), package
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, (package, missing)
    for name in names:
        where = getattr(getattr(module, name), "__module__", None)
        if where and where.startswith("lectures."):
            assert where.split(".")[1] == package and where.split(".")[2] not in PAGE_MODULES, (name, where)


def _course_names_used(tree, where):
    """(module, name, where) for every course name `tree` reaches: `from lectures.X import n`,
    and `alias.n` for a lecture module imported as `alias`."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "lectures":
            for a in node.names:
                if node.module == "lectures" or (LECTURES / node.module.split(".", 1)[1].replace(".", "/")
                                                 / f"{a.name}.py").exists():
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"     # a module
                else:
                    yield node.module, a.name, where
        elif isinstance(node, ast.Import):
            aliases.update({a.asname: a.name for a in node.names if a.asname and a.name.startswith("lectures.")})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            if aliases[node.value.id].startswith("lectures.lecture_"):
                yield aliases[node.value.id], node.attr, where


def _sources_outside_lectures():
    import json
    for path in sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "exercises").glob("*.py")):
        yield path.relative_to(ROOT), path.read_text(encoding="utf-8")
    for path in sorted((LECTURES / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        yield path.relative_to(ROOT), "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_names_that_notebooks_exercises_and_tests_use_resolve():
    """Every `from lectures.X import n` and every `lec.n` of the notebooks, exercises and tests
    names something its module defines or imports; a name is looked up in the file (no import),
    so a renamed building block fails here, not in a rank of a notebook run."""
    bad = []
    for where, source in _sources_outside_lectures():
        for module, name, _ in _course_names_used(ast.parse(source), where):
            path = ROOT / (module.replace(".", "/") + ".py")
            if not path.exists():
                path = ROOT / module.replace(".", "/") / "__init__.py"
            if name not in top_level_names(path):
                bad.append((str(where), module, name))
    assert not bad, bad


def _string_constants(code):
    for c in code.co_consts:
        if isinstance(c, str):
            yield c
        elif hasattr(c, "co_consts"):
            yield from _string_constants(c)


def _course_modules():
    return sorted(".".join(p.relative_to(LECTURES).with_suffix("").parts) for p in LECTURES.rglob("*.py")
                  if p.name != "__init__.py")


@pytest.mark.parametrize("module", _course_modules())
def test_no_control_characters_in_page_text(module):
    """'$t\\times$' in a non-raw string put a TAB on the page ('times' instead of t×): no string
    in a lecture, nor in the modules that hold its demos, deep dives and drawings, holds a
    control character other than a newline."""
    import importlib
    import re
    mod = importlib.import_module(f"lectures.{module}")
    bad = [(fn.__name__, s[:60]) for fn in vars(mod).values() if callable(fn) and hasattr(fn, "__code__")
           and fn.__module__ == mod.__name__ for s in _string_constants(fn.__code__)
           if re.search(r"[\x00-\x09\x0b-\x1f]", s)]
    assert not bad, bad
