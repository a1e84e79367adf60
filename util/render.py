"""Rendering: a lecture recording (util/recording.py) becomes an offline web page.

    render_lecture("content/lecture_02_communication.json")  -> content/lecture_02_communication.html
    render_index("content")                                   -> content/index.html

A page works from file:// with no network request at all: figures and local images are written
beside it (`<lecture>_files/`), the shared CSS/JS and the Pygments colours live in `static/`,
code is highlighted here (Pygments), Markdown is rendered here (markdown-it-py, raw HTML off, so
a note containing <script> shows as text) and LaTeX math becomes MathML (latex2mathml), which
browsers display natively. The markup lives in Jinja2 templates (util/templates/) with
autoescaping on: everything that came from a recording is escaped unless this module produced
it as HTML (Markdown, highlighted code, MathML) and marked it safe.

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

from markupsafe import Markup

from util import glossary
from util.record import rank_list
from util.recording import load, trim_build_paths, write_atomic

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)   # where lectures/notebooks/ is
STATIC = os.path.join(HERE, "static")
TEMPLATES = os.path.join(HERE, "templates")
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
    out = pyg(code, lexer, fmt)
    if start and not inline_styles:
        # one element per source line, so a long line wraps under its code, not its number
        head, sep, rest = out.partition("<pre>")
        body, sep2, tail = rest.rpartition("</pre>")
        lines = body.split("\n")
        last = lines.pop() if lines and lines[-1] == "" else None
        body = "".join(f'<span class="line">{line}\n</span>' for line in lines) + (last or "")
        out = head + sep + body + sep2 + tail
    return Markup(out)


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
        return Markup(_mathml_clean(ET.fromstring(out)))
    except Exception:
        return Markup(f'<code class="math-source" title="could not convert this LaTeX">{esc(latex)}</code>')


_md = None


def markdown(text):
    """Markdown (CommonMark + tables, raw HTML off) with $math$ as MathML and `[text]{.spread
    title="..."}` spans, to safe HTML."""
    global _md
    if _md is None:
        from markdown_it import MarkdownIt
        from mdit_py_plugins.attrs import attrs_plugin
        from mdit_py_plugins.dollarmath import dollarmath_plugin

        def fence(self, tokens, idx, options, env):
            # Pygments' own <div class="hl"><pre> block, as a plain str: markdown-it would wrap
            # anything not starting with "<pre" in <pre><code>, and adding a str to Markup
            # escapes the str (both showed as raw HTML on a page)
            token = tokens[idx]
            return str(highlight(token.content, start=0, lang=token.info.strip().split(" ")[0] or "text"))
        md = MarkdownIt("commonmark", {"html": False}).enable("table")
        md.add_render_rule("fence", fence)
        md.add_render_rule("code_block", fence)
        # `[1.23 ms]{.spread title="..."}`: a measured number with its spread on hover
        # (util.measure.with_spread); only spans, only these attributes
        md.use(attrs_plugin, after=("span_close",), spans=True, allowed=("class", "title", "tabindex"))
        md.use(dollarmath_plugin, double_inline=True,
               renderer=lambda content, opts: latex_to_mathml(content, opts["display_mode"]))
        _md = md
    out = _md.render(text)
    # raw HTML is off, so every "<table>" here is one markdown-it made: let wide ones scroll
    return Markup(out.replace("<table>", '<div class="scroll"><table>').replace("</table>", "</table></div>"))


def markdown_inline(text):
    markdown("")  # builds the parser
    return Markup(_md.renderInline(text))


def visible_text(text):
    """What a reader sees of a Markdown sentence: no markup, no hover details."""
    return html.unescape(re.sub(r"<[^>]+>", "", str(markdown_inline(text))))


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
    """Turns the records of one recording into sections of parts (plain dicts the templates
    draw), collecting figure and image files as it goes."""

    def __init__(self, recording, files_dir_name, name="lecture"):
        self.rec = recording
        self.files_name = files_dir_name
        self.name = name
        self.page = f"{name}.html"
        self.appendix_page = f"{name}_appendix.html"
        self.files = {}          # file name in <lecture>_files -> bytes
        self.title = None
        self.ids = set()         # one id space for the page and its appendix
        self.sections = []       # {"id", "title_html", "title_text", "parts", "keys", "failed", "page"}
        self.appendix = []       # the deep dives' sections, for the appendix page
        self.dives = []          # {"id", "title", "teaser", "from"}: each deep dive, in order
        self.cheats = []         # cheat records with the page and section they were recorded in
        self.widgets = []        # (widget name, page, section id)
        self._dive = None        # the deep dive being recorded, or None on the main path
        self.demo_count = 0
        self.failed_demos = []   # {"id", "name", "page"}
        self._linkers = {}       # page -> its glossary Linker: each term links at its first use
        self._new_section(None, None)

    @property
    def _sections(self):
        return self.appendix if self._dive else self.sections

    def _new_section(self, sid, title_html, title_text="", dive=None):
        self._sections.append({"id": sid, "title_html": title_html, "title_text": title_text,
                               "parts": [], "keys": [], "failed": False, "dive": dive,
                               "page": self.appendix_page if self._dive else self.page})

    @property
    def cur(self):
        return self._sections[-1]

    def _prose(self, html, page=None):
        """Prose on the page being written, its glossary terms linked where first used."""
        page = page or self.cur["page"]
        linker = self._linkers.setdefault(page, glossary.Linker())
        return Markup(linker.link(html))

    def here(self):
        """Link to the current section (page#id)."""
        sid = next((s["id"] for s in reversed(self._sections) if s["id"]), None)
        return self.cur["page"] + (f"#{sid}" if sid else "")

    def _deep_dive(self, r):
        if r.get("edge") == "begin":
            if self._dive:
                raise ValueError(f"deep_dive({r.get('title')!r}) inside deep_dive({self._dive['title']!r})")
            back = self.here()
            sid = _slug(_plain_text(r.get("title", "")), self.ids)
            self._dive = {"id": sid, "title": markdown_inline(r.get("title", "")),
                          "teaser": self._prose(markdown_inline(r.get("teaser", ""))), "from": back}
            self.dives.append(self._dive)
            self.sections[-1]["parts"].append({"kind": "dive_link", "href": f"{self.appendix_page}#{sid}",
                                               **self._dive})
            self._new_section(sid, self._dive["title"], _plain_text(r.get("title", "")), dive=self._dive)
            # the appendix repeats the teaser under the dive's title: its first read there
            self._dive["teaser_here"] = self._prose(markdown_inline(r.get("teaser", "")))
        else:
            self._dive = None

    def _key(self, key):
        if key and key in self.rec.get("functions", {}) and key not in self.cur["keys"]:
            self.cur["keys"].append(key)

    def add_top(self, r):
        """A record of the lecture's own process: may open sections (notes with headings)."""
        if r.get("kind") == "deep_dive":
            return self._deep_dive(r)
        if r.get("kind") != "note":
            self._key((r.get("source") or {}).get("key"))
            part = self.part(r)
            if part:
                self.cur["parts"].append(part)
            return
        for level, title, body in split_note(r.get("text", "")):
            if level == 1 and self.title is None:
                self.title = title
            elif level and self._dive and self.cur["id"] == self._dive["id"] and not self.cur["parts"]:
                # a deep dive's first section heading names the dive's own section (one title,
                # not the dive's above the section's); its id stays the one the pointer links to
                self.cur["title_html"], self.cur["title_text"] = markdown_inline(title), _plain_text(title)
            elif level:
                sid = _slug(_plain_text(title), self.ids)
                self._new_section(sid, markdown_inline(title), _plain_text(title))
            if body.strip():
                self.cur["parts"].append({"kind": "note", "html": self._prose(markdown(body))})
        self._key((r.get("source") or {}).get("key"))

    def part(self, r):
        """The template's view of one record (None for records the page does not show)."""
        kind = r.get("kind")
        method = getattr(self, "p_" + str(kind), None)
        if method is None:
            return {"kind": "unknown", "text": json.dumps(r, indent=1, default=str)}
        return method(r)

    def p_note(self, r):
        return {"kind": "note", "html": self._prose(markdown(r.get("text", "")))}

    def p_span(self, r):
        return None  # spans are drawn by timeline figures

    def p_output(self, r):
        return {"kind": "output", "stream": r.get("stream", "stdout"), "text": r.get("text", "")}

    def p_error(self, r):
        return {"kind": "error", "text": r.get("text", "")}

    def p_link(self, r):
        url = r.get("url", "")
        return {"kind": "link", "url": url, "title": r.get("title") or url,
                "safe": _safe_url(url), "host": _host(url)}

    def p_code(self, r):
        return {**code_part(r.get("name", ""), r.get("file", ""), r.get("start") or 1, r.get("code", "")),
                "lesson": bool(r.get("lesson"))}

    def p_cheat(self, r):
        anchor = "cheat-" + _slug(f"{self.name[:10]} {r.get('topic', '')}", self.ids)
        section = next((s for s in reversed(self._sections) if s["id"]), None)
        entry = {"topic": str(r.get("topic", "")), "formula": markdown_inline(r.get("formula", "")),
                 "value": r.get("value"), "text": format_number(r.get("value")), "unit": str(r.get("unit", "")),
                 "what": markdown_inline(r.get("what", "")) if r.get("what") else None, "anchor": anchor,
                 "href": f'{self.cur["page"]}#{anchor}', "section": section["id"] if section else None,
                 "section_title": section["title_html"] if section else None}
        if r.get("rank") is None:
            self.cheats.append(entry)
        return {"kind": "cheat", **entry, "formula": self._prose(entry["formula"]),
                "what": self._prose(entry["what"]) if entry["what"] else None}

    def p_published(self, r):
        url = r.get("url", "")
        return {"kind": "published", "html": self._prose(markdown(r.get("text", ""))), "url": url,
                "safe": _safe_url(url), "cite": markdown_inline(r.get("cite", ""))}

    def p_table(self, r):
        header, rows = r.get("header"), r.get("rows") or []
        ncols = max([len(header or [])] + [len(row) for row in rows])
        numeric = [all(_is_number(row[c]) for row in rows if c < len(row) and row[c] is not None)
                   and any(c < len(row) and _is_number(row[c]) for row in rows)
                   for c in range(ncols)]
        # text cells are inline Markdown, as captions are (`code`, **total**)
        cell = lambda v: ({"num": True, "text": format_number(v), "title": repr(v)} if _is_number(v)
                          else {"num": False, "text": markdown_inline("" if v is None else str(v))})
        return {"kind": "table", "dense": ncols >= 8,
                "header": [{"text": str(h), "num": c < ncols and numeric[c]} for c, h in enumerate(header)]
                if header else None,
                "rows": [[cell(v) for v in row] for row in rows],
                "caption": self._prose(markdown_inline(r["caption"])) if r.get("caption") else None}

    def _file(self, name, data):
        self.files[name] = data
        return f"{self.files_name}/{name}"

    def p_figure(self, r):
        n = sum(1 for f in self.files if f.startswith("fig-") and not f.endswith("-phone.svg")) + 1
        svg = r.get("svg", "")
        cap = r.get("caption") or ""
        phone = r.get("phone_svg")
        return {"kind": "figure", "src": self._file(f"fig-{n:02d}.svg", svg.encode("utf-8")),
                "phone": self._file(f"fig-{n:02d}-phone.svg", phone.encode("utf-8")) if phone else None,
                "caption_text": cap,
                "caption": self._prose(markdown_inline(cap)) if cap else None}

    def p_widget(self, r):
        self.widgets.append((str(r.get("name", "")), self.here()))
        # JSON inside <script type="application/json"> is data, never run; "</" is escaped so
        # nothing in it can close the element
        data = json.dumps(r.get("data"), separators=(",", ":")).replace("</", "<\\/")
        cap = r.get("caption") or ""
        return {"kind": "widget", "name": str(r.get("name", "")), "data": Markup(data),
                "caption": self._prose(markdown_inline(cap)) if cap else None}

    def p_image(self, r):
        src, cap, width = str(r.get("src", "")), r.get("caption") or "", r.get("width")
        part = {"kind": "image", "src": src, "caption_text": cap,
                "caption": self._prose(markdown_inline(cap)) if cap else None,
                "width": int(width) if isinstance(width, (int, float)) and width > 0 else None}
        if _safe_url(src):
            return {**part, "remote": True, "host": _host(src), "icon": Markup(_PICTURE_ICON)}
        if not os.path.isfile(src):
            return {**part, "missing": True}
        n = sum(1 for f in self.files if f.startswith("img-")) + 1
        base = re.sub(r"[^\w.-]+", "_", os.path.basename(src))
        with open(src, "rb") as f:
            part["src"] = self._file(f"img-{n:02d}-{base}", f.read())
        return part

    def p_demo(self, r):
        self.demo_count += 1
        did = f"demo-{self.demo_count}"
        status = r.get("status", "ok")
        self._key(r.get("function"))
        for sub in r.get("records") or []:
            self._key((sub.get("source") or {}).get("key"))
        if status == "failed":
            self.cur["failed"] = True
            self.failed_demos.append({"id": did, "name": r.get("name", ""), "page": self.cur["page"]})
        ws = r.get("world_size") or 0
        # A rank gets a card only when it has something to say: its notes, tables, figures or
        # printed output. What it returned is data for the lecture's own tables, and stray stderr
        # (library warnings) is for the terminal, not the page. A rank's traceback is shown once
        # under the demo, for all the ranks that raised the same one, at the page's full width.
        by_rank, errors = {}, {}
        for sub in r.get("records") or []:
            kind = sub.get("kind")
            if kind == "span" or (kind == "output" and sub.get("stream") == "stderr"):
                continue
            if kind == "error":
                errors.setdefault(sub.get("text", ""), []).append(sub.get("rank"))
                continue
            part = self.part(sub)
            if part:
                by_rank.setdefault(sub.get("rank"), []).append(part)
        columns = [{"title": f"rank {k}" if isinstance(k, int) else str(k), "parts": v}
                   for k, v in sorted(by_rank.items(), key=lambda kv: (not isinstance(kv[0], int), str(kv[0]).zfill(6)))]
        rank_errors = [{"ranks": rank_list(ranks), "text": trim_build_paths(text)} for text, ranks in errors.items()]
        # a demo that ran fine and has nothing to show draws no bar (its results are in the
        # lecture's own tables and figures)
        quiet_ok = status == "ok" and not columns and not rank_errors and not r.get("error")
        return {"kind": "demo", "id": did, "status": status, "name": str(r.get("name", "")), "quiet": quiet_ok,
                "error": trim_build_paths(r.get("error")),
                "world_size": ws, "elapsed": format_seconds(r.get("elapsed")),
                "label": {"ok": "ok", "failed": "failed", "skipped": "skipped",
                          "expected_failure": "expected failure — this is the lesson"}.get(status, status),
                "error_class": {"failed": "error-box", "expected_failure": "expected-box"}.get(status, "skip-box"),
                "columns": columns, "rank_errors": rank_errors}

    def code_for(self, keys):
        """The functions behind a section ("show code"), leaving out library code."""
        funcs = self.rec.get("functions", {})
        return [code_part(f.get("name", ""), f.get("file", ""), f.get("start", 1), f.get("code", ""))
                for f in (funcs[k] for k in keys)
                if not os.path.isabs(str(f.get("file", ""))) and not str(f.get("name", "")).startswith("<")]


def code_part(name, file, start, code):
    end = start + max(0, len(code.rstrip("\n").splitlines()) - 1)
    return {"kind": "code", "name": name, "file": str(file), "start": start, "end": end,
            "html": highlight(code, start)}


def _demo_counts(d):
    """'35 demos, 1 failed, ...' (HTML) from a recording's "demos" counts."""
    total = d.get("total", 0)
    return Markup(f'{total} demo{"" if total == 1 else "s"}'
                  + (f', <b class="bad">{d["failed"]} failed</b>' if d.get("failed") else "")
                  + (f', {d["expected_failures"]} failed as expected' if d.get("expected_failures") else "")
                  + (f', {d["skipped"]} skipped' if d.get("skipped") else ""))


def _built(rec):
    return Markup('built <time datetime="{}">{}</time>').format(rec.get("built", ""),
                                                               format_built(rec.get("built")))


def _meta_line(rec):
    env = rec.get("environment") or {}
    startup = (rec.get("startup") or {}).get("seconds")
    b = lambda label, value: Markup("{} <b>{}</b>").format(label, value)
    return [_built(rec), b("device", env.get("device", "unknown")), b("backend", env.get("backend", "?")),
            b("launcher", env.get("launcher", "?")), f'{env.get("world_size", "?")} ranks by default',
            "quick sizes" if env.get("quick") else "full sizes",
            f'total {format_seconds(rec.get("elapsed"))}'
            + (f" (worker start-up {format_seconds(startup)})" if startup else ""),
            _demo_counts(rec.get("demos") or {}),
            f'Python {env.get("python", "?")}, torch {env.get("torch", "?")}']


def about_numbers(env):
    """The page's one statement of the machine that measured it, and what that means for the
    reader (sentences beside each measurement then say only what differs: the ranks)."""
    device = env.get("device", "an unknown device")
    if env.get("backend") == "nccl":
        meaning = ("Times are this GPU machine's; the equalities with one process and the byte "
                   "counts hold anywhere.")
    else:
        meaning = ("Trust the equalities with one process and the byte counts as they are: they hold "
                   "on any machine. Times show trends and ratios on a small CPU, not GPU speeds: "
                   "gloo moves bytes with CPU threads that compete with the compute, and where a "
                   "demo runs more ranks than there are cores the ranks take turns.")
    return Markup("Every number on this page was measured while building it, on <b>{}</b> "
                  "({} backend). {} A <span class=\"spread\" tabindex=\"0\" title=\"the spread: the middle "
                  "half of the repeats (the interquartile range), or the timings behind a ratio\">"
                  "dashed underline</span> holds a "
                  "measurement's spread and the times behind it: hover over it, or tap it on a "
                  "phone.").format(device, env.get("backend", "?"), meaning)


_env = None


def templates():
    """The Jinja2 environment (autoescape on for every template)."""
    global _env
    if _env is None:
        import jinja2
        _env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES),
                                  autoescape=True,
                                  keep_trailing_newline=True)
        _env.globals["csp"] = _CSP
    return _env


def write_static(out_dir):
    """Shared CSS/JS (from util/static/) and the Pygments colours into <out>/static/."""
    dst = os.path.join(out_dir, "static")
    for name in sorted(os.listdir(STATIC)):
        if os.path.isfile(os.path.join(STATIC, name)) and not name.startswith("."):
            copy_atomic(os.path.join(STATIC, name), os.path.join(dst, name))
    write_atomic(os.path.join(dst, "pygments.css"), pygments_css())


def _neighbours(lectures, name):
    """The lectures before and after `name` in `lectures`, a list of (name, title) in order."""
    stems = [stem for stem, _ in lectures]
    if name not in stems:
        return None, None
    i = stems.index(name)
    link = lambda j: ({"page": f"{stems[j]}.html", "title": lectures[j][1]}
                      if 0 <= j < len(stems) else None)
    return link(i - 1), link(i + 1)


def _titles(recordings):
    return [(stem, rec.get("title") or stem) for stem, rec in recordings]


def reading_minutes(sections):
    """Minutes to study these sections: 130 words a minute of prose and captions (technical text
    dense with numbers reads slower than the 200-250 of plain prose), one minute per figure, table
    or widget, rounded up to 5."""
    words, pictures = 0, 0
    for s in sections:
        for p in s["parts"]:
            if p["kind"] in ("note", "published"):
                words += len(re.sub(r"<[^>]+>", " ", str(p.get("html", ""))).split())
            elif p["kind"] in ("figure", "table", "widget", "image"):
                pictures += 1
                words += len(re.sub(r"<[^>]+>", " ", str(p.get("caption") or "")).split())
    return max(5, 5 * math.ceil((words / 130 + pictures) / 5))


def lecture_page(rec, name):
    """The Page (sections of the main path and of the appendix) of one recording."""
    page = Page(rec, f"{name}_files", name)
    # the header is read first: the terms of its subtitle and its sentence on the numbers link there
    page.full_title = title = page_title(rec)
    page.subtitle = (page._prose(html.escape(rec["title"]), page=page.page)
                     if rec.get("title") and _plain_text(rec["title"]) != _plain_text(title) else None)
    page.about_numbers = page._prose(about_numbers(rec.get("environment") or {}), page=page.page)
    page.about_numbers_appendix = page._prose(about_numbers(rec.get("environment") or {}), page=page.appendix_page)
    for r in rec.get("records") or []:
        page.add_top(r)
    page.exercises = [{**e, "title": page._prose(html.escape(str(e.get("title", ""))), page=page.page)}
                      for e in rec.get("exercises") or []]
    return page


def page_title(rec):
    """A lecture's title before its page is read: its first `#` heading, else its recorded title."""
    first = next((title for r in rec.get("records") or [] if r.get("kind") == "note"
                  for level, title, _ in split_note(r.get("text", "")) if level == 1), None)
    return first or rec.get("title") or rec.get("lecture", "lecture")


def lecture_html(rec, name, previous=None, next=None):
    """(page HTML, appendix HTML or None, {file name: bytes}) for a recording."""
    page = lecture_page(rec, name)
    for s in page.sections + page.appendix:   # here, not in lecture_page: the index makes every
        s["code"] = page.code_for(s["keys"])  # lecture's Page after each build, and needs no code
    title = page.full_title
    status = rec.get("status", "ok")
    subtitle = page.subtitle
    common = dict(title_html=markdown_inline(title), title_text=_plain_text(title),
                  meta=_meta_line(rec), about_numbers=page.about_numbers,
                  file=str(rec.get("file", "")), failed=status != "ok", failed_demos=page.failed_demos,
                  previous=previous, next=next, lecture=name, main_page=page.page, dives=page.dives,
                  appendix_page=page.appendix_page, minutes=reading_minutes(page.sections))
    lecture = templates().get_template("lecture.html")
    text = lecture.render(page_title=title, subtitle=subtitle, sections=page.sections,
                          body_class="lecture" + (" build-failed" if status != "ok" else ""),
                          exercises=page.exercises, appendix=False, **common)
    appendix = None
    if page.appendix:
        appendix = lecture.render(page_title=f"Deep dives: {title}", subtitle=None, sections=page.appendix,
                                  body_class="lecture appendix", exercises=[], appendix=True,
                                  appendix_minutes=reading_minutes(page.appendix),
                                  **{**common, "about_numbers": page.about_numbers_appendix})
    return text, appendix, page.files


def render_lecture(json_path):
    """Write <out>/<lecture>.html (+ <lecture>_appendix.html for its deep dives, <lecture>_files/
    and static/) for one recording."""
    json_path = os.path.abspath(json_path)
    out_dir = os.path.dirname(json_path)
    with open(json_path, encoding="utf-8") as f:
        rec = json.load(f)
    name = rec.get("lecture") or os.path.splitext(os.path.basename(json_path))[0]
    files_name = f"{name}_files"
    text, appendix, files = lecture_html(rec, name, *_neighbours(_titles(_load_recordings(out_dir)), name))
    write_static(out_dir)
    files_dir = os.path.join(out_dir, files_name)
    for fname, data in files.items():
        write_atomic(os.path.join(files_dir, fname), data)
    appendix_path = os.path.join(out_dir, f"{name}_appendix.html")
    if appendix:
        write_atomic(appendix_path, appendix)
    page = os.path.join(out_dir, f"{name}.html")
    write_atomic(page, text)
    # the new page is in: drop what only the old page used
    if not appendix and os.path.exists(appendix_path):
        os.unlink(appendix_path)
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
    """(name, recording) of every lecture recording in `out_dir`, in name order."""
    recs = []
    for fname in sorted(os.listdir(out_dir)):
        if fname.endswith(".json"):
            rec = load(os.path.join(out_dir, fname))
            if rec is not None:
                recs.append((fname[:-5], rec))
    return recs


def notebook_offer(path):
    """What a companion notebook lets you try, from its opening cell ("the last cells ... ."),
    as a sentence; None when the notebook or that phrase is missing."""
    try:
        with open(path, encoding="utf-8") as f:
            cells = json.load(f)["cells"]
        text = " ".join("".join(next(c for c in cells if c["cell_type"] == "markdown")["source"]).split())
    except (OSError, ValueError, KeyError, StopIteration):
        return None
    m = re.search(r"the last cells? (?:are |is )?(.+?)(?: \(change [^)]*\))?\.(?: |$)", text)
    if not m:
        return None
    offer = re.sub(r"^(?:let you |yours: )", "", m.group(1))
    return markdown_inline(offer[0].upper() + offer[1:] + ".")


def render_index(out_dir):
    """Write <out>/index.html (a start: the course's map, setup, and every lecture recording in
    <out> in order, with its reading time, notebook and exercises) and <out>/cheatsheet.html
    (every formula the lectures recorded with cheat(), beside the value this build measured), and
    link each lecture page to its neighbours (re-rendering a page whose previous/next changed, so
    building lectures one by one keeps the links right)."""
    out_dir = os.path.abspath(out_dir)
    write_static(out_dir)
    lectures, cheats, calculator = [], [], None
    recordings = _load_recordings(out_dir)
    for stem, rec in recordings:
        name = rec.get("lecture") or stem
        page = lecture_page(rec, name)
        env = rec.get("environment") or {}
        nb = f"notebooks/{name}.html"
        source = os.path.join("lectures", "notebooks", f"{name}.ipynb")
        html_page = f"{name}.html"
        title = rec.get("title") or name
        lectures.append({
            "name": name, "title": title, "number": re.sub(r"^lecture_(\d+).*", r"\1", name),
            "summary": markdown_inline(rec["summary"]) if rec.get("summary") else None,
            "status": rec.get("status", "ok"),
            "page": html_page if os.path.isfile(os.path.join(out_dir, html_page)) else None,
            "appendix": page.appendix_page if page.appendix else None,
            "minutes": reading_minutes(page.sections),
            "appendix_minutes": reading_minutes(page.appendix) if page.appendix else None,
            "offer": notebook_offer(os.path.join(REPO, source)),
            "notebook": nb if os.path.isfile(os.path.join(out_dir, nb)) else None,
            "notebook_source": source if os.path.isfile(os.path.join(REPO, source)) else None,
            "exercises": rec.get("exercises") or []})
        cheats += [{**c, "lecture": title, "lecture_name": name} for c in page.cheats]
        for widget_name, where in page.widgets:
            if widget_name == "memory-calculator":
                calculator = where
    env = (recordings[0][1].get("environment") or {}) if recordings else {}
    total = sum(r.get("elapsed") or 0 for _, r in recordings)
    common = dict(lectures=lectures, device=env.get("device", "an unknown machine"),
                  build_time=format_seconds(total) if recordings else None, calculator=calculator)
    text = templates().get_template("index.html").render(
        page_title="Distributed training, executable course", body_class="index", **common)
    path = os.path.join(out_dir, "index.html")
    write_atomic(path, text)
    sheet = templates().get_template("cheatsheet.html").render(
        page_title="Cheatsheet: distributed training, executable course", body_class="cheatsheet",
        cheats=cheats, **common)
    write_atomic(os.path.join(out_dir, "cheatsheet.html"), sheet)
    render_glossary(out_dir, lectures)
    _relink(out_dir, _titles(recordings))
    return path


def render_glossary(out_dir, lectures):
    """Write <out>/glossary.html: every term of lectures/glossary.yaml, with the lecture that
    teaches it (linked when that lecture's page is built)."""
    titles = {l["name"]: l for l in lectures}
    terms = [{"id": t.id, "term": t.term, "means": markdown_inline(t.means), "taught": t.taught,
              "taught_title": titles[t.taught]["title"] if t.taught in titles else t.taught.replace("_", " "),
              "taught_page": titles[t.taught]["page"] if t.taught in titles else None}
             for t in glossary.load()]
    text = templates().get_template("glossary.html").render(
        page_title="Glossary: distributed training, executable course", body_class="glossary", terms=terms)
    write_atomic(os.path.join(out_dir, glossary.PAGE), text)


def _relink(out_dir, lectures):
    """Re-render lecture pages whose previous/next links are out of date."""
    for stem, _ in lectures:
        page = os.path.join(out_dir, f"{stem}.html")
        if not os.path.isfile(page):
            continue
        previous, following = _neighbours(lectures, stem)
        with open(page, encoding="utf-8") as f:
            html_text = f.read()
        want = [x["page"] for x in (previous, following) if x]
        have = re.findall(r'<a class="(?:prev|next)" href="([^"]+)"', html_text)
        if have != want:
            render_lecture(os.path.join(out_dir, f"{stem}.json"))
