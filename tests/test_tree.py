"""The tree shows the course: seven lecture files beside one package of building blocks per
topic; the blocks never import a lecture file, and the engine (util/) imports no course package."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LECTURES = ROOT / "lectures"
PACKAGES = {"model", "data_parallel", "tensor_parallel", "pipeline", "context_parallel", "layout"}


def imported_modules(path):
    """Every module a file imports, at any depth ('from a import b' counts a and a.b)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            names.append(n.module)
            names += [f"{n.module}.{a.name}" for a in n.names]
    return names


def test_lectures_holds_seven_lecture_files_and_the_topic_packages():
    files = sorted(p.name for p in LECTURES.glob("*.py") if p.name != "__init__.py")
    assert len(files) == 7 and all(f.startswith("lecture_0") for f in files), files
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


PUBLIC = {  # names readers import from a lecture file; the blocks live in the topic packages
    "lecture_01_memory_and_precision": ["GPT", "GPTConfig", "online_softmax_attention", "quantize_fp8"],
    "lecture_02_communication": ["ring_all_reduce", "pipelined_ring_all_reduce"],
    "lecture_03_data_parallel": ["Zero3", "plan_buckets", "PowerSGD"],
    "lecture_04_tensor_parallel": ["ColumnParallelLinear", "RowParallelLinear", "parallelize_gpt"],
    "lecture_05_pipeline_parallel": ["make_schedule", "simulate", "split_gpt"],
    "lecture_06_context_and_expert_parallel": ["GPT", "GPTConfig", "ring_attention", "zigzag_unshard"],
    "lecture_07_putting_it_together": ["GPT", "estimate_memory", "pytorch_layout"],
}


def test_public_building_blocks_stay_importable_from_their_lecture_files():
    import importlib
    for lecture, names in PUBLIC.items():
        module = importlib.import_module(f"lectures.{lecture}")
        missing = [n for n in names if not hasattr(module, n)]
        assert not missing, (lecture, missing)


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
