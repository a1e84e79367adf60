"""Font sizes come from one style (util/figures.py): importing util sets it, and no figure of the
course or the engine writes a size in points again."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SIZE_ARGS = {"fontsize", "labelsize", "title_fontsize"}


def _number(node):
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


def sizes_in_points(path):
    """(line, what) for every font size written as a number: fontsize=12 in a call or as a
    parameter's default, tick_params(labelsize=11), title.set_fontsize(11)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            found += [(k.lineno, f"{k.arg}={ast.unparse(k.value)}") for k in node.keywords
                      if k.arg in SIZE_ARGS and _number(k.value)]
            if isinstance(node.func, ast.Attribute) and node.func.attr == "set_fontsize" \
                    and node.args and _number(node.args[0]):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
            args = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults \
                + node.args.kw_defaults
            found += [(node.lineno, f"{a.arg}={ast.unparse(d)}") for a, d in zip(args, defaults)
                      if d is not None and a.arg in SIZE_ARGS and _number(d)]
    return found


def test_no_font_size_is_written_in_points():
    """A figure names a role (nothing for the style's size, "small", "large", NOTE), never 12."""
    files = sorted((ROOT / "lectures").rglob("*.py")) + sorted((ROOT / "util").rglob("*.py"))
    assert len(files) > 40
    found = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in files for line, what in sizes_in_points(p)]
    assert not found, "font sizes in points; use the style in util/figures.py:\n" + "\n".join(found)


def test_the_check_sees_sizes_in_points(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(ax, fontsize=12):\n"
                   "    ax.set_xlabel('x', fontsize=12)\n"
                   "    ax.tick_params(labelsize=9.5)\n"
                   "    ax.title.set_fontsize(11)\n"
                   "    ax.legend(fontsize='small')\n")
    assert sorted(line for line, _ in sizes_in_points(bad)) == [1, 2, 3, 4]


def test_importing_util_applies_the_style():
    import matplotlib
    import util  # noqa: F401
    from util.figures import NOTE, STYLE
    assert {k: matplotlib.rcParams[k] for k in STYLE} == STYLE
    assert STYLE["axes.labelsize"] > NOTE > STYLE["font.size"]
