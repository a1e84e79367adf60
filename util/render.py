"""Rendering: a lecture recording (JSON, schema "course-lecture/1") becomes an offline web page.

    render_lecture("content/lecture_02_communication.json")  -> content/lecture_02_communication.html
    render_index("content")                                   -> content/index.html

A page works from file:// with no network request at all: figures and local images are written
beside it (`<lecture>_files/`), the shared CSS/JS and the Pygments colours live in `static/`,
code is highlighted here (Pygments), Markdown is rendered here (markdown-it-py, raw HTML off, so
a note containing <script> shows as text) and LaTeX math becomes MathML (latex2mathml), which
browsers display natively. Everything that came from a recording is escaped.

Every file is written atomically (temporary file + rename), so a crash never leaves half a page;
files left over from an earlier render of the same lecture are removed once the new page is in.
"""
import html
import json
import math
import os
import re
import shutil
import xml.etree.ElementTree as ET

from util.run import SCHEMA, write_atomic

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
_RESERVED_IDS = {"content", "sidebar", "menu", "toc", "top", "page-header", "intro"}
# The page may load only local files; remote pictures (shown only when online) are the exception.
_CSP = ("default-src 'none'; script-src file: 'self'; style-src file: 'self'; "
        "img-src file: 'self' data: https: http:")

esc = html.escape
_PICTURE_ICON = ('<svg class="card-icon" viewBox="0 0 24 24" width="28" height="28" aria-hidden="true">'
                 '<rect x="2.5" y="4.5" width="19" height="15" rx="2" fill="none" stroke="currentColor"/>'
                 '<circle cx="8" cy="9.5" r="1.8" fill="currentColor"/>'
                 '<path d="M3 18l6-6 4 4 3-3 5 5" fill="none" stroke="currentColor"/></svg>')


# --- small helpers -------------------------------------------------------------------------

def copy_atomic(src, dst):
    with open(src, "rb") as f:
        write_atomic(dst, f.read())


def format_number(v):
    """Ints with thousands separators, floats to about 4 significant digits, the rest as text."""
    if not _is_number(v):
        return "" if v is None else str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "∞" if v > 0 else "−∞"
    if v == 0:
        return "0"
    if 1e4 <= abs(v) < 1e15:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def format_seconds(s):
    if s is None:
        return ""
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 120:
        return f"{s:.2f} s"
    return f"{int(s // 60)} min {s % 60:.0f} s"


def format_built(iso):
    """'2026-11-22T03:49:11+00:00' -> '2026-11-22 03:49 UTC' (as written when not ISO)."""
    m = re.match(r"(\d{4}-\d\d-\d\d)T(\d\d:\d\d)", iso or "")
    if not m:
        return iso or "unknown"
    return f"{m.group(1)} {m.group(2)}" + (" UTC" if (iso.endswith("+00:00") or iso.endswith("Z")) else "")


def _slug(text, used):
    base = re.sub(r"[^\w]+", "-", text.lower()).strip("-_") or "section"
    if base[0].isdigit():
        base = "s-" + base
    slug, n = base, 2
    while slug in used or slug in _RESERVED_IDS:
        slug, n = f"{base}-{n}", n + 1
    used.add(slug)
    return slug


def _host(url):
    return re.sub(r"^https?://([^/]+).*$", r"\1", url)


def _safe_url(url):
    return isinstance(url, str) and url.startswith(("http://", "https://"))


# --- code and math -----------------------------------------------------------------------

def highlight(code, start=1, lang="python", inline_styles=False):
    """Pygments HTML with line numbers starting at `start` (colours as classes for the page's
    pygments.css, or inline where there is no stylesheet, as in a notebook)."""
    from pygments import highlight as pyg
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import get_lexer_by_name
    from pygments.util import ClassNotFound
    try:
        lexer = get_lexer_by_name(lang or "text")
    except ClassNotFound:
        lexer = get_lexer_by_name("text")
    fmt = HtmlFormatter(cssclass="hl", linenos="inline" if start else False, linenostart=start or 1,
                        noclasses=inline_styles)
    return pyg(code, lexer, fmt)


def code_figure(name, file, start, code):
    """Highlighted source under a caption naming it and the lines of the file it came from."""
    end = start + max(0, len(code.rstrip("\n").splitlines()) - 1)
    return (f'<figure class="code"><figcaption><code>{esc(name)}</code> '
            f'<span class="where">{esc(str(file))}:{start}–{end}</span></figcaption>'
            f'{highlight(code, start)}</figure>')


def pygments_css():
    from pygments.formatters import HtmlFormatter

    def scoped(style):
        lines = HtmlFormatter(style=style).get_style_defs(".hl").splitlines()
        return "\n".join(l for l in lines if l.startswith(".hl"))
    return (f"/* generated by util/render.py from Pygments */\n{scoped('default')}\n"
            f"@media (prefers-color-scheme: dark) {{\n{scoped('github-dark')}\n}}\n")


_MATHML = {"math", "mrow", "mi", "mn", "mo", "ms", "mtext", "mspace", "msub", "msup", "msubsup",
           "mfrac", "msqrt", "mroot", "mstyle", "merror", "mpadded", "mphantom", "mfenced",
           "menclose", "munder", "mover", "munderover", "mtable", "mtr", "mtd", "mlabeledtr",
           "mmultiscripts", "mprescripts", "none", "semantics", "annotation"}


def _mathml_clean(tree):
    """Re-serialize latex2mathml's output, keeping only MathML elements and plain attributes
    and escaping all text: latex2mathml copies \\text{...} through unescaped."""
    def walk(el):
        tag = el.tag.rsplit("}", 1)[-1]
        if tag not in _MATHML:
            raise ValueError(f"unexpected element {tag!r} in MathML")
        attrs = "".join(f' {k}="{esc(v)}"' for k, v in el.attrib.items()
                        if re.fullmatch(r"[a-z][a-z-]*", k) and not k.startswith("on")
                        and k not in ("href", "src", "style"))
        if tag == "math":
            attrs = ' xmlns="http://www.w3.org/1998/Math/MathML"' + attrs
        inner = esc(el.text or "", quote=False) + "".join(walk(c) for c in el)
        return f"<{tag}{attrs}>{inner}</{tag}>" + esc(el.tail or "", quote=False)
    return walk(tree)


def latex_to_mathml(latex, display=False):
    """MathML for a LaTeX formula; the escaped source in <code> when it cannot be converted."""
    import latex2mathml.converter
    try:
        out = latex2mathml.converter.convert(latex, display="block" if display else "inline")
        return _mathml_clean(ET.fromstring(out))
    except Exception:
        return f'<code class="math-source" title="could not convert this LaTeX">{esc(latex)}</code>'


_md = None


def markdown(text):
    """Markdown (CommonMark + tables, raw HTML off) with $math$ as MathML, to safe HTML."""
    global _md
    if _md is None:
        from markdown_it import MarkdownIt
        from mdit_py_plugins.dollarmath import dollarmath_plugin

        def fence(code, lang, attrs):
            return highlight(code, start=0, lang=lang) if lang else ""  # "" -> escaped default
        md = MarkdownIt("commonmark", {"html": False, "highlight": fence}).enable("table")
        md.use(dollarmath_plugin, double_inline=True,
               renderer=lambda content, opts: latex_to_mathml(content, opts["display_mode"]))
        _md = md
    out = _md.render(text)
    # raw HTML is off, so every "<table>" here is one markdown-it made: let wide ones scroll
    return out.replace("<table>", '<div class="scroll"><table>').replace("</table>", "</table></div>")


def markdown_inline(text):
    markdown("")  # builds the parser
    return _md.renderInline(text)


# --- the page ----------------------------------------------------------------------------

_HEADING = re.compile(r"^(#{1,2})[ \t]+(.+?)[ \t]*#*[ \t]*$")
_FENCE = re.compile(r"^\s{0,3}(```|~~~)")


def split_note(text):
    """Split a note at its `#`/`##` headings (outside code fences).

    Returns [(level or None, heading text or None, body markdown)]."""
    parts, level, title, body, fence = [], None, None, [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
        h = None if fence or m else _HEADING.match(line)
        if h:
            if level or any(l.strip() for l in body):
                parts.append((level, title, "\n".join(body)))
            level, title, body = len(h.group(1)), h.group(2), []
        else:
            body.append(line)
    if level or any(l.strip() for l in body):
        parts.append((level, title, "\n".join(body)))
    return parts


def _plain_text(md_inline):
    return re.sub(r"[*_`$\\]", "", md_inline)


class Page:
    """Turns the records of one recording into HTML, writing figures/images as it goes."""

    def __init__(self, recording, files_dir_name):
        self.rec = recording
        self.files_name = files_dir_name
        self.files = {}          # file name in <lecture>_files -> bytes
        self.title = None
        self.ids = set()
        self.sections = []       # {"id", "title_html", "title_text", "parts", "keys", "failed"}
        self.demo_count = 0
        self.failed_demos = []   # (id, name)
        self._new_section(None, None)

    # sections
    def _new_section(self, sid, title_html, title_text=""):
        self.sections.append({"id": sid, "title_html": title_html, "title_text": title_text,
                              "parts": [], "keys": [], "failed": False})

    @property
    def cur(self):
        return self.sections[-1]

    def _key(self, key):
        if key and key in self.rec.get("functions", {}) and key not in self.cur["keys"]:
            self.cur["keys"].append(key)

    def add_top(self, r):
        """A record of the lecture's own process: may open sections (notes with headings)."""
        if r.get("kind") != "note":
            self._key((r.get("source") or {}).get("key"))
            self.cur["parts"].append(self.record(r))
            return
        for level, title, body in split_note(r.get("text", "")):
            if level == 1 and self.title is None:
                self.title = title
            elif level:
                sid = _slug(_plain_text(title), self.ids)
                self._new_section(sid, markdown_inline(title), _plain_text(title))
            if body.strip():
                self.cur["parts"].append(f'<div class="note">{markdown(body)}</div>')
        self._key((r.get("source") or {}).get("key"))

    # records
    def record(self, r):
        kind = r.get("kind")
        method = getattr(self, "r_" + str(kind), None)
        if method is None:
            return f'<pre class="unknown">{esc(json.dumps(r, indent=1, default=str))}</pre>'
        return method(r)

    def r_note(self, r):
        return f'<div class="note">{markdown(r.get("text", ""))}</div>'

    def r_span(self, r):
        return ""  # spans are drawn by timeline figures

    def r_output(self, r):
        stream = r.get("stream", "stdout")
        return (f'<div class="output {esc(stream)}"><span class="label">{esc(stream)}</span>'
                f'<pre>{esc(r.get("text", ""))}</pre></div>')

    def r_error(self, r):
        return (f'<div class="error-box"><span class="label">error</span>'
                f'<pre>{esc(r.get("text", ""))}</pre></div>')

    def r_link(self, r):
        url, title = r.get("url", ""), r.get("title") or r.get("url", "")
        if not _safe_url(url):
            return f'<p class="reference">Reference: {esc(title)} <code>{esc(url)}</code></p>'
        return (f'<p class="reference"><span class="label">reference</span> '
                f'<a href="{esc(url)}" rel="noreferrer">{esc(title)}</a> '
                f'<span class="host">{esc(_host(url))}</span></p>')

    def r_code(self, r):
        return code_figure(r.get("name", ""), r.get("file", ""), r.get("start") or 1, r.get("code", ""))

    def r_table(self, r):
        header, rows = r.get("header"), r.get("rows") or []
        ncols = max([len(header or [])] + [len(row) for row in rows])
        numeric = [all(_is_number(row[c]) for row in rows if c < len(row) and row[c] is not None)
                   and any(c < len(row) and _is_number(row[c]) for row in rows)
                   for c in range(ncols)]
        out = ['<figure class="table"><div class="scroll"><table>']
        if header:
            out.append("<thead><tr>" + "".join(
                f'<th{" class=num" if c < ncols and numeric[c] else ""}>{esc(str(h))}</th>'
                for c, h in enumerate(header)) + "</tr></thead>")
        out.append("<tbody>")
        for row in rows:
            cells = []
            for v in row:
                if _is_number(v):
                    cells.append(f'<td class="num" title="{esc(repr(v))}">{esc(format_number(v))}</td>')
                else:
                    cells.append(f"<td>{esc('' if v is None else str(v))}</td>")
            out.append("<tr>" + "".join(cells) + "</tr>")
        out.append("</tbody></table></div>")
        if r.get("caption"):
            out.append(f'<figcaption>{markdown_inline(r["caption"])}</figcaption>')
        out.append("</figure>")
        return "".join(out)

    def _file(self, name, data):
        self.files[name] = data
        return f"{self.files_name}/{name}"

    def r_figure(self, r):
        n = sum(1 for f in self.files if f.startswith("fig-")) + 1
        src = self._file(f"fig-{n:02d}.svg", r.get("svg", "").encode("utf-8"))
        cap = r.get("caption") or ""
        return (f'<figure class="plot"><img src="{esc(src)}" alt="{esc(cap or "figure")}">'
                + (f"<figcaption>{markdown_inline(cap)}</figcaption>" if cap else "") + "</figure>")

    def r_image(self, r):
        src, cap, width = str(r.get("src", "")), r.get("caption") or "", r.get("width")
        wattr = f' width="{int(width)}"' if isinstance(width, (int, float)) and width > 0 else ""
        capt = f"<figcaption>{markdown_inline(cap)}</figcaption>" if cap else ""
        if _safe_url(src):
            data_w = f' data-width="{int(width)}"' if wattr else ""
            return (f'<figure class="image remote" data-src="{esc(src)}" data-alt="{esc(cap)}"{data_w}>'
                    f'<a class="card" href="{esc(src)}" rel="noreferrer">{_PICTURE_ICON}'
                    f'<span class="card-text"><span class="card-title">Picture at {esc(_host(src))}</span>'
                    f'<span class="card-url">{esc(src)}</span><span class="card-note">'
                    f'shown here when you are online; open the link to see it</span></span></a>'
                    f'{capt}</figure>')
        if not os.path.isfile(src):
            return (f'<figure class="image missing"><div class="error-box"><span class="label">'
                    f'missing image</span><pre>{esc(src)}</pre></div>{capt}</figure>')
        n = sum(1 for f in self.files if f.startswith("img-")) + 1
        base = re.sub(r"[^\w.-]+", "_", os.path.basename(src))
        with open(src, "rb") as f:
            rel = self._file(f"img-{n:02d}-{base}", f.read())
        return f'<figure class="image"><img src="{esc(rel)}" alt="{esc(cap)}"{wattr}>{capt}</figure>'

    def r_demo(self, r):
        self.demo_count += 1
        did = f"demo-{self.demo_count}"
        status = r.get("status", "ok")
        self._key(r.get("function"))
        for sub in r.get("records") or []:
            self._key((sub.get("source") or {}).get("key"))
        label = {"ok": "ok", "failed": "failed", "skipped": "skipped",
                 "expected_failure": "expected failure — this is the lesson"}.get(status, status)
        if status == "failed":
            self.cur["failed"] = True
            self.failed_demos.append((did, r.get("name", "")))
        ws = r.get("world_size") or 0
        head = (f'<header class="demo-head"><span class="demo-kind">demo</span> '
                f'<span class="demo-name">{esc(str(r.get("name", "")))}</span>'
                f'<span class="pill">{ws} rank{"s" if ws != 1 else ""}</span>'
                f'<span class="pill">{esc(format_seconds(r.get("elapsed")))}</span>'
                f'<span class="status status-{esc(status)}">{esc(label)}</span></header>')
        parts = [head]
        if r.get("error"):
            cls = {"failed": "error-box", "expected_failure": "expected-box"}.get(status, "skip-box")
            parts.append(f'<div class="{cls}"><pre>{esc(r["error"])}</pre></div>')
        by_rank = {}
        for sub in r.get("records") or []:
            by_rank.setdefault(sub.get("rank"), []).append(sub)
        visible = {k: [s for s in v if s.get("kind") != "span"] for k, v in by_rank.items()}
        nspans = sum(len(v) - len(visible[k]) for k, v in by_rank.items())
        if any(visible.values()):
            ranks = sorted(set(range(ws)) | {k for k in by_rank if isinstance(k, int)})
            cols = []
            for rank in ranks:
                body = "".join(self.record(s) for s in visible.get(rank, []))
                err = any(s.get("kind") == "error" for s in visible.get(rank, []))
                cols.append(f'<section class="rank{" rank-error" if err else ""}">'
                            f'<h4>rank {rank}</h4>{body or "<p class=quiet>nothing recorded</p>"}</section>')
            for k in by_rank:  # records without an integer rank, if any
                if not isinstance(k, int) and visible[k]:
                    cols.append(f'<section class="rank"><h4>{esc(str(k))}</h4>'
                                + "".join(self.record(s) for s in visible[k]) + "</section>")
            parts.append(f'<div class="ranks">{"".join(cols)}</div>')
        elif status in ("ok", "expected_failure"):
            extra = f"; {nspans} timing spans (drawn as timelines)" if nspans else ""
            parts.append(f'<p class="quiet">The ranks printed nothing{extra}.</p>')
        return f'<article class="demo demo-{esc(status)}" id="{did}">{"".join(parts)}</article>'

    # show code
    def code_for(self, keys):
        funcs = self.rec.get("functions", {})
        blocks = []
        for key in keys:
            f = funcs[key]
            if os.path.isabs(str(f.get("file", ""))):
                continue  # library code (e.g. multiprocessing), not the lecture's
            blocks.append(code_figure(f.get("name", ""), f.get("file", ""), f.get("start", 1),
                                      f.get("code", "")))
        if not blocks:
            return ""
        names = ", ".join(esc(funcs[k].get("name", "")) for k in keys
                          if not os.path.isabs(str(funcs[k].get("file", ""))))
        return (f'<details class="show-code"><summary>show code <span class="fnames">{names}'
                f'</span></summary>{"".join(blocks)}</details>')


def _demo_counts(d):
    """'35 demos, 1 failed, ...' (HTML) from a recording's "demos" counts."""
    return (f'{d.get("total", 0)} demos'
            + (f', <b class="bad">{d["failed"]} failed</b>' if d.get("failed") else "")
            + (f', {d["expected_failures"]} failed as expected' if d.get("expected_failures") else "")
            + (f', {d["skipped"]} skipped' if d.get("skipped") else ""))


def _meta_line(rec):
    env = rec.get("environment") or {}
    d = rec.get("demos") or {}
    items = [f'built <time datetime="{esc(rec.get("built", ""))}">{esc(format_built(rec.get("built")))}</time>',
             f'device <b>{esc(str(env.get("device", "unknown")))}</b>',
             f'backend <b>{esc(str(env.get("backend", "?")))}</b>',
             f'launcher <b>{esc(str(env.get("launcher", "?")))}</b>',
             f'{esc(str(env.get("world_size", "?")))} ranks by default',
             "quick sizes" if env.get("quick") else "full sizes",
             f'total {esc(format_seconds(rec.get("elapsed")))}',
             _demo_counts(d),
             f'Python {esc(str(env.get("python", "?")))}, torch {esc(str(env.get("torch", "?")))}']
    return '<p class="meta">' + '<span class="sep"> · </span>'.join(f"<span>{i}</span>" for i in items) + "</p>"


def _head(title, body_class):
    return (f'<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
            f'<meta name="referrer" content="no-referrer">\n'
            f'<title>{esc(title)}</title>\n'
            f'<link rel="stylesheet" href="static/course.css">\n'
            f'<link rel="stylesheet" href="static/pygments.css">\n'
            f'<script src="static/course.js" defer></script>\n'
            f'</head>\n<body class="{body_class}">\n')


def write_static(out_dir):
    """Shared CSS/JS (from util/static/) and the Pygments colours into <out>/static/."""
    dst = os.path.join(out_dir, "static")
    for name in sorted(os.listdir(STATIC)):
        if os.path.isfile(os.path.join(STATIC, name)) and not name.startswith("."):
            copy_atomic(os.path.join(STATIC, name), os.path.join(dst, name))
    write_atomic(os.path.join(dst, "pygments.css"), pygments_css())


def lecture_html(rec, files_dir_name):
    """(page HTML, {file name: bytes}) for a recording."""
    page = Page(rec, files_dir_name)
    for r in rec.get("records") or []:
        page.add_top(r)
    title = page.title or rec.get("title") or rec.get("lecture", "lecture")
    status = rec.get("status", "ok")
    toc = "".join(
        f'<li><a href="#{s["id"]}"{" class=has-failure" if s["failed"] else ""}>{s["title_html"]}</a></li>'
        for s in page.sections if s["id"])
    out = [_head(title, "lecture" + (" build-failed" if status != "ok" else "")),
           '<header class="topbar"><button type="button" id="menu" class="menu-button" '
           'aria-controls="sidebar" aria-expanded="false">☰ Contents</button>'
           f'<span class="topbar-title">{esc(_plain_text(title))}</span></header>\n',
           '<nav id="sidebar" class="sidebar" aria-label="Contents">'
           '<a class="home" href="index.html">← All lectures</a>'
           f'<p class="toc-title"><a href="#top">{markdown_inline(title)}</a></p>'
           f'<ol class="toc" id="toc">{toc}</ol>'
           '<p class="keys">Keys: <kbd>j</kbd> or <kbd>→</kbd> next section, <kbd>k</kbd> or '
           '<kbd>←</kbd> previous, <kbd>t</kbd> contents</p></nav>\n',
           '<main id="content">\n<header class="page-header" id="top">'
           f'<h1>{markdown_inline(title)}</h1>']
    if rec.get("title") and _plain_text(rec["title"]) != _plain_text(title):
        out.append(f'<p class="subtitle">{esc(rec["title"])}</p>')
    out.append(_meta_line(rec))
    out.append(f'<p class="source">from <code>{esc(str(rec.get("file", "")))}</code></p>')
    if status != "ok":
        links = ", ".join(f'<a href="#{i}">{esc(n)}</a>' for i, n in page.failed_demos)
        out.append('<div class="banner-failed"><b>This build failed.</b> '
                   + (f"Failed demos: {links}." if links else "The lecture stopped with an error; see below.")
                   + "</div>")
    out.append("</header>\n")
    for s in page.sections:
        code = page.code_for(s["keys"])
        body = "".join(s["parts"])
        if s["id"] is None:
            if body or code:
                out.append(f'<section class="intro" id="intro">{code}{body}</section>\n')
            continue
        out.append(f'<section class="section{" has-failure" if s["failed"] else ""}" id="{s["id"]}">'
                   f'<h2><a class="anchor" href="#{s["id"]}">{s["title_html"]}</a></h2>'
                   f"{code}{body}</section>\n")
    out.append('<footer class="page-footer">Every number on this page was measured by the run '
               'that built it (see the header for the hardware).</footer>\n</main>\n</body>\n</html>\n')
    return "".join(out), page.files


def render_lecture(json_path):
    """Write <out>/<lecture>.html (+ <lecture>_files/ and static/) for one recording."""
    json_path = os.path.abspath(json_path)
    out_dir = os.path.dirname(json_path)
    with open(json_path, encoding="utf-8") as f:
        rec = json.load(f)
    name = rec.get("lecture") or os.path.splitext(os.path.basename(json_path))[0]
    files_name = f"{name}_files"
    text, files = lecture_html(rec, files_name)
    write_static(out_dir)
    files_dir = os.path.join(out_dir, files_name)
    for fname, data in files.items():
        write_atomic(os.path.join(files_dir, fname), data)
    page = os.path.join(out_dir, f"{name}.html")
    write_atomic(page, text)
    # the new page is in: drop what only the old page used
    if os.path.isdir(files_dir):
        for fname in os.listdir(files_dir):
            if fname not in files:
                p = os.path.join(files_dir, fname)
                shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
        if not files:
            os.rmdir(files_dir)
    return page


# --- the index ---------------------------------------------------------------------------

def _load_recordings(out_dir):
    recs = []
    for fname in sorted(os.listdir(out_dir)):
        if not fname.endswith(".json"):
            continue
        try:
            with open(os.path.join(out_dir, fname), encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("schema") == SCHEMA:
            recs.append((fname[:-5], rec))
    return recs


def render_index(out_dir):
    """Write <out>/index.html listing every lecture recording in <out>."""
    out_dir = os.path.abspath(out_dir)
    write_static(out_dir)
    items = []
    for stem, rec in _load_recordings(out_dir):
        name = rec.get("lecture") or stem
        env, d = rec.get("environment") or {}, rec.get("demos") or {}
        status = rec.get("status", "ok")
        page = f"{name}.html"
        links = [f'<a href="{esc(page)}">read the lecture</a>'] if os.path.isfile(os.path.join(out_dir, page)) else []
        nb = os.path.join("notebooks", f"{name}.html")
        if os.path.isfile(os.path.join(out_dir, nb)):
            links.append(f'<a class="notebook" href="{esc(nb)}">companion notebook</a>')
        title = rec.get("title") or name
        head = (f'<a href="{esc(page)}">{esc(title)}</a>' if links and "read the lecture" in links[0]
                else esc(title))
        items.append(
            f'<li class="lecture-card status-{esc(status)}"><h2>{head}</h2>'
            f'<p class="lecture-name"><code>{esc(name)}</code>'
            + (' <span class="status status-failed">build failed</span>' if status != "ok" else "")
            + "</p>"
            f'<p class="meta"><span>built <time datetime="{esc(rec.get("built", ""))}">'
            f'{esc(format_built(rec.get("built")))}</time></span><span class="sep"> · </span>'
            f'<span>{esc(str(env.get("device", "unknown device")))}</span><span class="sep"> · </span>'
            f'<span>backend {esc(str(env.get("backend", "?")))}</span><span class="sep"> · </span>'
            f'<span>{_demo_counts(d)}</span><span class="sep"> · </span>'
            f'<span>{esc(format_seconds(rec.get("elapsed")))}{" (quick sizes)" if env.get("quick") else ""}</span></p>'
            f'<p class="links">{" · ".join(links)}</p></li>')
    body = ("<ol class=\"lectures\">" + "".join(items) + "</ol>") if items else \
        '<p class="quiet">No lectures built yet: run <code>make</code>.</p>'
    text = (_head("Distributed training, executable course", "index")
            + '<main id="content" class="index-main"><header class="page-header" id="top">'
            '<h1>Distributed training, an executable course</h1>'
            '<p class="subtitle">Every page below was produced by running its lecture; every number '
            'on it was measured by that run.</p></header>' + body + "</main>\n</body>\n</html>\n")
    path = os.path.join(out_dir, "index.html")
    write_atomic(path, text)
    return path
