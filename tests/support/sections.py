"""What a lecture's main() calls, read from its source."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NARRATION = ("note", "table", "figure", "see", "image", "try_it_yourself", "deep_dive", "widget",
             "cheat", "published")


def sections_of(name):
    """Every section function the lecture's main() calls, those inside `with deep_dive(...)`
    blocks included, in the order they are written."""
    with open(os.path.join(ROOT, "lectures", name + ".py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    # a section called for its own sake, or one whose result a later section takes (fit = ...)
    calls = [c for c in ast.walk(main) if isinstance(c, (ast.Expr, ast.Assign)) and isinstance(c.value, ast.Call)
             and isinstance(c.value.func, ast.Name) and c.value.func.id not in NARRATION]
    return [c.value.func.id for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]
