"""Lectures inside Jupyter: a recorder that shows every record inline as it is made.

A companion notebook starts with

    from util import in_notebook
    in_notebook.setup(quick=quick, world_size=world_size, backend=backend)

and from then on `note`, `table`, `figure`, `see`, `image` and `spawn` display their records in
the cell that made them: notes as Markdown (math as MathML, so no MathJax is needed), tables as
HTML tables, figures as SVG, code as highlighted source, and a demo as one column per rank,
side by side. Every display also carries a plain-text form, so a notebook executed headless
(papermill) has readable outputs and tests can read them.

`checks(**values)` shows a notebook's checkable results and publishes them as JSON
(`application/json`), so a test can assert on what the notebook computed; a False value fails
the cell. `finish()` (a notebook's last cell) stops the worker processes and lists the demos run.
"""
import base64
import html
import json
import mimetypes
import os
import textwrap

from util import launch, measure, record, render

_RANK_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                 "#7f7f7f"]
_BOX = "border:1px solid #d0d7de;border-radius:6px;padding:6px 10px;margin:6px 0;"
_PRE = ("margin:2px 0;padding:4px 6px;background:#f6f8fa;border-radius:4px;white-space:pre-wrap;"
        "font-size:12px;line-height:1.35;overflow-x:auto;")


# --- records as HTML ----------------------------------------------------------------------

# The page renderer's Markdown (raw HTML off, math as MathML) and number formatting, so a
# notebook and its lecture page say the same thing the same way.
markdown_html, inline_html, fmt = render.markdown, render.markdown_inline, render.format_number
_is_number = render._is_number


def table_html(rec):
    cell = "padding:2px 10px;border-bottom:1px solid #e5e7eb;"
    out = ['<table style="border-collapse:collapse;margin:4px 0;font-size:13px;">']
    if rec.get("caption"):
        out.append(f'<caption style="caption-side:bottom;text-align:left;color:#555;'
                   f'font-size:12px;">{inline_html(rec["caption"])}</caption>')
    if rec.get("header"):
        out.append("<thead><tr>" + "".join(
            f'<th style="{cell}text-align:left;border-bottom:2px solid #999;">{html.escape(str(h))}</th>'
            for h in rec["header"]) + "</tr></thead>")
    out.append("<tbody>")
    for row in rec["rows"]:
        out.append("<tr>" + "".join(
            f'<td style="{cell}text-align:{"right" if _is_number(v) else "left"};'
            f'font-variant-numeric:tabular-nums;">{html.escape(fmt(v))}</td>' for v in row) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def table_text(rec):
    rows = [[str(h) for h in rec["header"]]] if rec.get("header") else []
    rows += [[fmt(v) for v in row] for row in rec["rows"]]
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(max(map(len, rows), default=0))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    if rec.get("caption"):
        lines.append(rec["caption"])
    return "\n".join(lines)


def svg_img(svg, max_width="100%"):
    """An SVG as an <img> data URI: figures cannot clash (their ids stay inside the image)."""
    data = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return (f'<img src="data:image/svg+xml;base64,{data}" alt="figure" '
            f'style="max-width:{max_width};height:auto;">')


def figure_html(rec):
    caption = (f'<figcaption style="color:#555;font-size:12px;">{inline_html(rec["caption"])}'
               f'</figcaption>' if rec.get("caption") else "")
    return f'<figure style="margin:4px 0;">{svg_img(rec["svg"])}{caption}</figure>'


def code_html(code, start=1, title=""):
    body = render.highlight(code, start, inline_styles=True)
    head = (f'<div style="font-size:12px;color:#555;">{html.escape(title)}</div>' if title else "")
    return f'<div style="margin:4px 0;font-size:12px;">{head}{body}</div>'


def image_html(rec):
    src, width = rec["src"], rec.get("width")
    caption = inline_html(rec.get("caption") or "")
    if src.startswith(("http://", "https://")):  # offline pages link to remote pictures
        return (f'<div style="{_BOX}">Image: <a href="{html.escape(src)}" target="_blank" '
                f'rel="noopener">{caption or html.escape(src)}</a> (remote image, not loaded)</div>')
    mime = mimetypes.guess_type(src)[0] or "application/octet-stream"
    with open(src, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    size = f' width="{int(width)}"' if width else ""
    alt = html.escape(rec.get("caption") or os.path.basename(src))
    return (f'<figure style="margin:4px 0;"><img src="data:{mime};base64,{data}" alt="{alt}"'
            f'{size}><figcaption style="color:#555;font-size:12px;">{caption}</figcaption></figure>')


def record_html(rec, functions=None):
    """One record as a fragment of HTML (self-contained: inline styles, no scripts)."""
    kind = rec["kind"]
    if kind == "note":
        return f'<div class="course-note">{markdown_html(rec["text"])}</div>'
    if kind == "table":
        return table_html(rec)
    if kind == "figure":
        return figure_html(rec)
    if kind == "code":
        return code_html(rec["code"], rec.get("start", 1), f'{rec["file"]}:{rec["start"]}  {rec["name"]}')
    if kind == "link":
        return (f'<div>Reference: <a href="{html.escape(rec["url"])}" target="_blank" rel="noopener">'
                f'{html.escape(rec["title"])}</a></div>')
    if kind == "image":
        return image_html(rec)
    if kind == "output":
        colour = "color:#9a3412;" if rec.get("stream") == "stderr" else ""
        return f'<pre style="{_PRE}{colour}">{html.escape(rec["text"].rstrip())}</pre>'
    if kind == "error":
        return (f'<pre style="{_PRE}color:#b00020;background:#fff0f0;">'
                f'{html.escape(rec["text"].rstrip())}</pre>')
    if kind == "span":
        return ""
    if kind == "demo":
        return demo_html(rec, functions or {})
    if kind == "deep_dive":
        return (f'<div style="{_BOX}font-size:13px;"><b>Deep dive:</b> {inline_html(rec["title"])} '
                f'(on the lecture\'s appendix page)</div>' if rec.get("edge") == "begin" else "")
    if kind == "cheat":
        return (f'<div style="font-size:13px;"><b>{html.escape(rec["topic"])}</b>: {inline_html(rec["formula"])}'
                f' · measured here: <b>{html.escape(fmt(rec["value"]))}</b> {html.escape(rec.get("unit", ""))}</div>')
    if kind == "published":
        return (f'<div style="{_BOX}"><div style="font-size:11px;color:#8a6d0b;">PUBLISHED ON GPUS · NOT MEASURED HERE'
                f'</div>{markdown_html(rec["text"])}<div style="font-size:12px;"><a href="{html.escape(rec["url"])}" '
                f'target="_blank" rel="noopener">{inline_html(rec["cite"])}</a></div></div>')
    return f"<pre>{html.escape(json.dumps(rec, default=str)[:2000])}</pre>"


def record_text(rec):
    """The plain-text form of a record (headless runs, logs, tests)."""
    kind = rec["kind"]
    if kind == "note":     # a measured number's hover in brackets
        return measure.spreads_in_brackets(rec["text"])
    if kind == "table":
        return table_text(rec)
    if kind == "figure":
        return f"[figure] {rec.get('caption', '')}".rstrip()
    if kind == "code":
        return f"# {rec['file']}:{rec['start']}\n{rec['code'].rstrip()}"
    if kind == "link":
        return f"{rec['title']} <{rec['url']}>"
    if kind == "image":
        return f"[image] {rec.get('caption') or rec['src']}"
    if kind in ("output", "error"):
        return rec["text"].rstrip()
    if kind == "span":
        return f"[span] {rec['label']}"
    if kind == "demo":
        return demo_text(rec)
    if kind == "deep_dive":
        return f"[deep dive] {rec['title']}" if rec.get("edge") == "begin" else ""
    if kind == "cheat":
        return f"{rec['topic']}: {rec['formula']} (measured here: {fmt(rec['value'])} {rec.get('unit', '')})".rstrip()
    if kind == "published":
        return f"[published on GPUs, not measured here] {rec['text']} ({rec['cite']} <{rec['url']}>)"
    return json.dumps(rec, default=str)


_STATUS_COLOURS = {"ok": "#1a7f37", "failed": "#b00020", "expected_failure": "#9a6700"}


def _status_word(status):
    return launch.STATUS_WORDS.get(status, status)


def _demo_header(rec):
    label = _status_word(rec["status"])
    colour = _STATUS_COLOURS.get(rec["status"], "#57606a")
    return (f'<div style="font-size:13px;"><b>demo</b> <code>{html.escape(rec["name"])}</code> · '
            f'{rec["world_size"]} rank{"s" if rec["world_size"] != 1 else ""} · '
            f'{rec["elapsed"]:.2f} s · <span style="color:{colour};font-weight:bold;">{label}</span></div>')


def demo_html(rec, functions):
    """A demo: a header, then what every rank recorded, one column per rank, side by side."""
    parts = [f'<div class="course-demo" style="{_BOX}">', _demo_header(rec)]
    if rec.get("error"):
        parts.append(f'<pre style="{_PRE}color:#b00020;background:#fff0f0;">'
                     f'{html.escape(rec["error"])}</pre>')
    fn = functions.get(rec.get("function") or "")
    if fn:
        parts.append(f'<details style="font-size:12px;"><summary>code that ran on every rank: '
                     f'<code>{html.escape(fn["name"])}</code> ({html.escape(fn["file"])}:{fn["start"]})'
                     f'</summary>{code_html(fn["code"], fn["start"])}</details>')
    shown = [r for r in rec.get("records", []) if r["kind"] != "span"]
    spans = len(rec.get("records", [])) - len(shown)
    if shown:
        n = rec["world_size"]
        columns = f"repeat({n}, minmax(0, 1fr))" if n <= 4 else "repeat(auto-fill, minmax(220px, 1fr))"
        parts.append(f'<div style="display:grid;grid-template-columns:{columns};gap:8px;margin-top:6px;">')
        for rank in range(n):
            mine = [r for r in shown if r["rank"] == rank]
            colour = _RANK_COLOURS[rank % len(_RANK_COLOURS)]
            body = "".join(record_html(r, functions) for r in mine) or \
                '<div style="color:#888;font-size:12px;">(nothing recorded)</div>'
            parts.append(f'<div style="min-width:0;border-top:3px solid {colour};padding-top:2px;">'
                         f'<div style="font-size:12px;font-weight:bold;color:{colour};">rank {rank}</div>'
                         f'{body}</div>')
        parts.append("</div>")
    if spans:
        parts.append(f'<div style="font-size:11px;color:#777;">{spans} timed span{"" if spans == 1 else "s"} recorded '
                     f'(draw them with <code>timeline(run.spans)</code>)</div>')
    parts.append("</div>")
    return "".join(parts)


def demo_text(rec):
    label = _status_word(rec["status"])
    lines = [f"demo {rec['name']} on {rec['world_size']} ranks: {label} ({rec['elapsed']:.2f} s)"]
    if rec.get("error"):
        lines.append(rec["error"])
    for rank in range(rec["world_size"]):
        mine = [r for r in rec.get("records", []) if r["rank"] == rank and r["kind"] != "span"]
        for r in mine:
            lines.append(textwrap.indent(record_text(r), f"[rank {rank}] "))
    return "\n".join(lines)


# --- the recorder that displays -----------------------------------------------------------

def _display(bundle):
    from IPython.display import display
    display(bundle, raw=True)


class NotebookRecorder(record.Recorder):
    """Records like the build does, and shows each record in the notebook as it arrives."""

    def show(self, rec):
        if rec["kind"] == "span" or (rec["kind"] == "deep_dive" and rec.get("edge") == "end"):
            return
        bundle = {"text/plain": record_text(rec), "text/html": record_html(rec, self.functions)}
        if rec["kind"] == "note":
            bundle["text/markdown"] = rec["text"]
        elif rec["kind"] == "figure":
            bundle["image/svg+xml"] = rec["svg"]
        _display(bundle)


def setup(quick=False, world_size=None, backend=None, timeout=None, verbose=False):
    """Apply a notebook's parameters to `util.settings` and show records inline from now on.

    backend: None (or "auto") picks nccl with a GPU per rank, else gloo. Shows the settings in
    use; `util.record.current().records` is everything shown since."""
    if backend in ("", "auto"):
        backend = None
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be None, 'gloo' or 'nccl', not {backend!r}")
    if backend == "nccl":
        import torch
        if not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA GPUs, and none are visible; use 'gloo'")
    s = launch.settings
    s.quick, s.backend = bool(quick), backend
    s.progress = s.verbose = bool(verbose)  # status lines (and expected tracebacks) on stderr
    if world_size is not None:
        if int(world_size) < 1:
            raise ValueError(f"world_size must be at least 1, not {world_size!r}")
        s.world_size = int(world_size)
    if timeout is not None:
        s.timeout = float(timeout)
    recorder = NotebookRecorder()
    record.use(recorder)
    _stop_workers_after_errors()
    chosen = launch.choose_backend(s.world_size)
    line = (f"quick={s.quick}, world_size={s.world_size}, backend={chosen}"
            f"{'' if backend else ' (chosen automatically)'}, collective timeout {s.timeout:g} s")
    _display({"text/plain": line, "text/html": f'<div style="font-size:12px;color:#555;">'
              f'settings: {html.escape(line)}</div>'})


def _stop_workers_after_errors():
    """After a cell fails, stop the worker processes: a failed notebook then leaves nothing
    running, and the kernel's shutdown (which interrupts its whole process group) does not
    make idle workers print KeyboardInterrupt tracebacks. The next demo starts fresh ones."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or getattr(shell, "_course_hook", False):
        return

    def after(result):
        if not result.success:
            launch.shutdown()
    shell.events.register("post_run_cell", after)
    shell._course_hook = True


def finish():
    """Stop the worker processes and show what ran (every demo of this kernel, with its time).
    The last cell of a notebook calls it; a kernel that exits stops them too."""
    launch.shutdown()
    _keep_returns()
    rows = [[name, ws, _status_word(status), round(seconds, 3)]
            for name, ws, status, seconds in launch.demos]
    if rows:
        record.table(rows, header=["demo", "ranks", "status", "seconds"],
                     caption=f"{len(rows)} demos ran in this notebook; worker processes stopped")


def _keep_returns():
    """With COURSE_RETURNS=DIR (the tests set it), what every demo of this kernel returned goes to
    DIR/<notebook>.pkl, to be compared with the same demos of the course build."""
    folder, name = os.environ.get("COURSE_RETURNS"), os.environ.get("COURSE_NOTEBOOK")
    if folder and name:
        import pickle
        from util.recording import write_atomic
        write_atomic(os.path.join(folder, name + ".pkl"), pickle.dumps(launch.returned))


def _plain_value(v):
    if isinstance(v, (list, tuple)):
        return [_plain_value(x) for x in v]
    return record._plain(v)


def checks(**values):
    """Show the notebook's checkable results and publish them as JSON for tests.

    Booleans are checks: any False fails the cell (loudly, with the names that failed).
    Other values (numbers, lists, strings) are shown and published as measured. numpy and
    torch scalars count as the Python numbers and booleans they hold."""
    values = {k: _plain_value(v) for k, v in values.items()}
    rows = "".join(
        f'<tr><td style="padding:2px 10px;text-align:left;"><code>{html.escape(k)}</code></td>'
        f'<td style="padding:2px 10px;text-align:left;">'
        + (('<span style="color:#1a7f37;">✔ yes</span>' if v else '<span style="color:#b00020;">✘ no</span>')
           if isinstance(v, bool) else html.escape(fmt(v) if not isinstance(v, (list, tuple))
                                                   else ", ".join(fmt(x) for x in v)))
        + "</td></tr>" for k, v in values.items())
    data = json.loads(json.dumps(values, default=str))
    _display({"text/plain": json.dumps(data, indent=1),
              "application/json": data,
              "text/html": f'<div style="{_BOX}"><b>checks</b><table style="font-size:13px;">{rows}</table></div>'})
    failed = [k for k, v in values.items() if v is False]
    if failed:
        raise AssertionError(f"{'check' if len(failed) == 1 else 'checks'} failed: {', '.join(failed)}")


def exercise_verdict(verdict):
    """Show an exercise's verdict (util.exercise) and publish {"exercise", "passed", "detail"}
    as JSON for tests. Never raises: a failing exercise is the student's to fix, and the rest
    of the notebook still runs."""
    passed, name = verdict["passed"], verdict["exercise"]
    data = {k: verdict[k] for k in ("exercise", "passed", "detail")}
    head = f"{'✔ passed' if passed else '✘ not yet'}: {name}"
    text = head + "\n" + verdict["detail"]
    if verdict.get("printed"):
        text += "\nwhat your ranks printed:\n" + verdict["printed"].rstrip()
    colour, background = ("#1a7f37", "#f0fff4") if passed else ("#b00020", "#fff5f5")
    printed = (f'<details><summary style="font-size:12px;">what your ranks printed</summary>'
               f'<pre style="{_PRE}">{html.escape(verdict["printed"].rstrip())}</pre></details>'
               if verdict.get("printed") else "")
    _display({"text/plain": text, "application/json": data,
              "text/html": f'<div style="{_BOX}background:{background};">'
                           f'<b style="color:{colour};">{html.escape(head)}</b>'
                           f'<pre style="{_PRE}background:transparent;">{html.escape(verdict["detail"])}</pre>'
                           f'{printed}</div>'})
