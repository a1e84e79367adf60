"""Execute the companion notebooks and convert them to offline HTML (`make notebooks`).

    python -m util.build_notebooks [--quick] [--world-size N] [--backend gloo|nccl]
                             [--cell-timeout S] [--out DIR] [NAME ...]

NAME is a notebook in lectures/notebooks/ (lecture_02_communication) or a path to an .ipynb;
none means all of lectures/notebooks/*.ipynb. Each runs with papermill on the `course` kernel
(this .venv's Python, registered into the .venv on every run) with the repository root as its
working directory, and is written to DIR/<name>.ipynb and DIR/<name>.html (DIR defaults to
content/notebooks). The HTML embeds its CSS and loads no script: it opens offline.
Exit status: 0 all ran, 1 a notebook failed (its executed copy and page are still written and
show the error), 2 bad command line.
"""
import os
import sys
import time

from util import record
from util.recording import write_atomic
from util.run import Parser

KERNEL = "course"
NOTEBOOKS = os.path.join(record.ROOT, "lectures", "notebooks")

# The lab template without its scripts: require.js, MathJax, mermaid and the widget manager
# would all come from CDNs. Notes are already MathML (util.in_notebook), so nothing is lost.
OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block body_header -%}
{{ super() }}
<nav class="course-nav"><a href="../index.html">&larr; all lectures</a> &middot;
<a href="../{{ resources.lecture }}.html">the lecture page</a> &middot; executed notebook</nav>
{%- endblock body_header -%}
{%- block extra_css -%}
<style type="text/css">
  .course-nav { max-width: 1200px; margin: 8px auto; font: 13px sans-serif; color: #555; }
  main { max-width: 1200px; margin: 0 auto; }
  .course-note h1, .course-note h2 { border-bottom: 1px solid #ddd; }
  .course-demo pre { max-height: 24em; }
</style>
{%- endblock extra_css -%}
"""


def parse_args(argv):
    p = Parser(prog="python -m util.build_notebooks",
                description="Execute the companion notebooks into content/notebooks/ (ipynb + html).")
    p.add_argument("names", nargs="*", metavar="NAME", help="notebooks to run (default: all)")
    p.add_argument("--quick", action="store_true", help="small sizes (tests, CI)")
    p.add_argument("--world-size", type=int, help="ranks (default: each notebook's own)")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl with a GPU per rank, else gloo")
    p.add_argument("--cell-timeout", type=float, default=900.0, help="seconds one cell may run")
    p.add_argument("--out", default=os.path.join(record.ROOT, "content", "notebooks"), help="output folder")
    args = p.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        p.error("--world-size must be at least 1")
    if args.cell_timeout <= 0:
        p.error("--cell-timeout must be positive")
    args.paths = resolve(args.names, p)
    return args


def available():
    if not os.path.isdir(NOTEBOOKS):
        return []
    return sorted(f[:-6] for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb"))


def resolve(names, parser):
    """Names or paths -> notebook paths (all of lectures/notebooks/ when none are given)."""
    if not names:
        found = [os.path.join(NOTEBOOKS, n + ".ipynb") for n in available()]
        if not found:
            parser.error(f"no notebooks in {os.path.relpath(NOTEBOOKS)}")
        return found
    paths = []
    for name in names:
        if name.endswith(".ipynb"):
            if not os.path.isfile(name):
                parser.error(f"no notebook file {name!r}")
            paths.append(os.path.abspath(name))
        elif os.path.isfile(os.path.join(NOTEBOOKS, name + ".ipynb")):
            paths.append(os.path.join(NOTEBOOKS, name + ".ipynb"))
        else:
            parser.error(f"no notebook {name!r}; known: {', '.join(available()) or 'none'}")
    return paths


def register_kernel():
    """Register the `course` kernel in this environment (sys.prefix/share/jupyter/kernels):
    papermill then runs notebooks with exactly this Python, whatever other kernels the machine
    has. Written only when it changed, atomically, so concurrent runs never see it missing.

    The kernel does not capture file-descriptor output: worker processes inherit the kernel's
    stderr, and their terminal progress bars (util.progress) belong on the terminal, not in the
    notebook. What ranks print or record still reaches the page through `spawn`."""
    import json
    folder = os.path.join(sys.prefix, "share", "jupyter", "kernels", KERNEL)
    spec = {
        "argv": [sys.executable, "-Xfrozen_modules=off", "-m", "ipykernel_launcher",
                 "-f", "{connection_file}", "--IPKernelApp.capture_fd_output=False"],
        "display_name": "Python (course .venv)",
        "language": "python",
        "env": {"PYTHONPATH": record.ROOT},
        "metadata": {"debugger": True},
    }
    text = json.dumps(spec, indent=1) + "\n"
    path = os.path.join(folder, "kernel.json")
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return folder
    except OSError:
        pass
    write_atomic(path, text)
    return folder


def _one_line(text):
    lines = [l for l in str(text).strip().splitlines() if l.strip(" -")]
    return lines[-1].strip() if lines else ""


SAVE_EVERY = 30.0    # seconds between saves of a notebook while it runs


def sparse_save_engine():
    """papermill's nbclient engine, registered as "course", that saves the executed notebook at
    most every SAVE_EVERY seconds while it runs. papermill itself saves it as every cell starts
    and ends, and each save encodes every output so far: on lecture 07's notebook (15 MB of
    figures, 37 cells) that is ~0.5 GB of JSON per run, tens of CPU-seconds. However the run
    ends (done, a failed cell, a cell timeout, a dead kernel), papermill's `notebook_complete`
    stamps the end time and saves once more, and that save always goes through."""
    from papermill.engines import NBClientEngine, papermill_engines

    class SparseSaves(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
            save = nb_man.save
            def sparse(**kw):
                since = (nb_man.now() - nb_man.last_save_time).total_seconds()
                if nb_man.end_time is not None or since >= SAVE_EVERY:
                    save(**kw)
            nb_man.save = sparse
            return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)

    papermill_engines.register("course", SparseSaves)
    return "course"


def execute(path, out_ipynb, parameters, cell_timeout):
    """Run one notebook with papermill; the executed copy appears at `out_ipynb` atomically.
    Returns (whether it was written, None or a one-line description of the failure)."""
    import nbformat
    import papermill
    from nbclient.exceptions import CellTimeoutError
    folder = os.path.dirname(os.path.abspath(out_ipynb))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{os.path.basename(out_ipynb)}")
    error, timed_out = None, False
    try:
        # papermill's bar only on a terminal: in a log its carriage returns are garbage
        papermill.execute_notebook(path, tmp, parameters=parameters, kernel_name=KERNEL, engine_name=sparse_save_engine(),
                                   cwd=record.ROOT, progress_bar=sys.stderr.isatty(), start_timeout=180,
                                   execution_timeout=cell_timeout, log_output=False)
    except papermill.PapermillExecutionError as e:
        error = f"cell {e.exec_count}: {e.ename}: {_one_line(e.evalue)}"
    except CellTimeoutError:
        timed_out = True
        error = f"a cell ran longer than the {cell_timeout:g} s cell timeout (--cell-timeout sets it)"
    except Exception as e:  # a dead kernel, a missing kernel: still one line
        error = f"{type(e).__name__}: {_one_line(e)}"
    if not os.path.exists(tmp):
        return False, error or "papermill wrote no notebook"
    nb = nbformat.read(tmp, as_version=4)
    os.unlink(tmp)
    if timed_out:  # papermill marks the stopped cell "completed": say on the page what happened
        started = [c for c in nb.cells if c.cell_type == "code"
                   and c.metadata.get("papermill", {}).get("start_time")]
        if started:
            cell = started[-1]
            error = error.replace("a cell", f"cell {cell.execution_count}", 1)
            why = f"stopped after {cell_timeout:g} s, the cell timeout (--cell-timeout sets it)"
            cell.outputs.append(nbformat.v4.new_output(
                "error", ename="CellTimeoutError", evalue=why, traceback=[f"CellTimeoutError: {why}"]))
    write_atomic(out_ipynb, nbformat.writes(nb))
    return True, error


def to_html(ipynb, out_html, title):
    """Executed notebook -> one self-contained HTML page that makes no network request."""
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter
    exporter = HTMLExporter(template_name="lab", extra_loaders=[
        jinja2.DictLoader({"course_offline.html.j2": OFFLINE_TEMPLATE})])
    exporter.template_file = "course_offline.html.j2"
    nb = nbformat.read(ipynb, as_version=4)
    nb.metadata["title"] = title
    lecture = os.path.basename(out_html)[:-5]
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title},
                                                         "lecture": lecture})
    write_atomic(out_html, body)


def title_of(path):
    """The first Markdown heading of the notebook, else its file name."""
    import nbformat
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return os.path.basename(path)[:-6]


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    register_kernel()
    parameters = {"quick": args.quick}
    if args.world_size:
        parameters["world_size"] = args.world_size
    if args.backend:
        parameters["backend"] = args.backend
    failed = []
    for i, path in enumerate(args.paths, 1):
        name = os.path.basename(path)[:-6]
        out_ipynb = os.path.join(args.out, name + ".ipynb")
        out_html = os.path.join(args.out, name + ".html")
        print(f"[{i}/{len(args.paths)}] {name}: executing (quick={args.quick}, "
              f"cell timeout {args.cell_timeout:g} s)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        os.environ["COURSE_NOTEBOOK"] = name    # the kernel inherits it: where its returns go
        written, error = execute(path, out_ipynb, parameters, args.cell_timeout)
        seconds = time.perf_counter() - start
        if written:
            to_html(out_ipynb, out_html, title_of(path))
        if error:
            failed.append(name)
            print(f"util.build_notebooks: error: {name} failed after {seconds:.1f} s: {error} "
                  f"(see {os.path.relpath(out_ipynb)})", file=sys.stderr, flush=True)
        else:
            print(f"[{i}/{len(args.paths)}] {name}: ok in {seconds:.1f} s -> "
                  f"{os.path.relpath(out_html)}", file=sys.stderr, flush=True)
    refresh_index(args.out)
    if len(failed) > 1:
        print(f"util.build_notebooks: error: {len(failed)} of {len(args.paths)} notebooks failed: "
              f"{', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def refresh_index(out):
    """content/index.html links each lecture's notebook page when it exists: rewrite it now that
    the pages are here (only when writing into a content folder's notebooks/)."""
    content = os.path.dirname(os.path.abspath(out))
    if os.path.basename(os.path.abspath(out)) != "notebooks" or \
            not os.path.isfile(os.path.join(content, "index.html")):
        return
    try:
        from util import render
        render.render_index(content)
    except Exception as e:  # the notebooks are built; a stale index is worth a warning, not a failure
        print(f"util.build_notebooks: warning: could not refresh {content}/index.html: {e}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
