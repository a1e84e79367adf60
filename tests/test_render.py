"""The renderer on hand-made recordings: escaping, math, sections, assets, atomic writes, index."""
import json
import os
import re

import pytest

from util import render
from util.recording import SCHEMA

SVG = '<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'
EVIL = '<script>alert("x")</script>'
PNG = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x06\x00\x00\x00\x1f"
       b"\x15\xc4\x89\x00\x00\x00\rIDATx\x9cc\xf8\xff\xff?\x00\x05\xfe\x02\xfe\xa7\x35\x81\x84\x00\x00"
       b"\x00\x00IEND\xaeB`\x82")


def src(func, line, file="lectures/lecture_demo.py", start=None):
    key = f"{file}:{start or line - 1}:{func}"
    return {"file": file, "line": line, "function": func, "key": key}


def rank_rec(rank, kind, func="ring_step", **content):
    return {"kind": kind, **content, "source": src(func, 12, start=10), "rank": rank, "t": 0.1}


def functions():
    f = "lectures/lecture_demo.py"
    return {
        f"{f}:29:main": {"file": f, "name": "main", "start": 29, "code": "def main():\n    intro()\n"},
        f"{f}:19:intro": {"file": f, "name": "intro", "start": 19, "code": "def intro():\n    note('## Intro')\n"},
        f"{f}:10:ring_step": {"file": f, "name": "ring_step", "start": 10,
                              "code": "def ring_step(rank, world_size):\n    print(rank)\n"},
        "/usr/lib/python3/multiprocessing/process.py:103:run": {
            "file": "/usr/lib/python3/multiprocessing/process.py", "name": "run", "start": 103,
            "code": "def run(self):\n    pass\n"},
    }


SCRIPTS = ['<script src="static/course.js" defer>', '<script src="static/widgets.js" defer>']


def recording(tmp_path, *, status="ok", figures=1, lecture="lecture_demo", demos=True):
    image = tmp_path / "pic.png"
    image.write_bytes(PNG)
    top = lambda kind, func="intro", line=20, **c: {"kind": kind, **c, "source": src(func, line),
                                                    "rank": None, "t": 0.0}
    records = [
        top("note", "main", 30, text="# Demo lecture\nAn introduction with $x^2$."),
        top("note", text=f"## First section\nRing sends $2(n-1)/n$ of the data.\n\n$$a+b$$\n\n{EVIL}\n\n"
                         "```python\n# not a heading\nx = 1\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |"),
        top("table", header=["n", "time", EVIL], rows=[[1234567, 3.14159, EVIL], [2, 0.000123456, "b"]],
            caption=EVIL),
        top("code", name="ring_step", file="lectures/lecture_demo.py", start=10,
            code="def ring_step(rank, world_size):\n    print(rank)\n"),
        top("link", url="https://example.org/paper", title=f"paper {EVIL}"),
        top("link", url="javascript:alert(1)", title="bad link"),
        top("image", src=str(image), caption=f"local {EVIL}", width=50),
        top("image", src="https://example.invalid/x.png", caption="remote **picture**", width=None),
        top("span", label="hidden", start=0.0, end=1.0),
    ]
    records += [top("figure", svg=SVG.replace("10", str(10 + i)), caption=f"fig {i} {EVIL}")
                for i in range(figures)]
    records.append(top("note", text="## Second section\nMath that cannot be shown as MathML: "
                                    "$\\text{<script>}$ and a broken one $\\frac{$."))
    if demos:
        records += [
            top("demo", name=f"ring {EVIL}", world_size=2, status="ok", elapsed=0.0123, error=None,
                returns=["1.5", None],
                function="lectures/lecture_demo.py:10:ring_step",
                records=[rank_rec(0, "note", text="rank 0 says **hi**"),
                         rank_rec(0, "output", stream="stdout", text=f"out {EVIL}\n"),
                         rank_rec(1, "table", header=["x"], rows=[[1.5]], caption=""),
                         rank_rec(1, "output", stream="stderr", text="warn\n"),
                         rank_rec(0, "span", label="compute", start=0.0, end=0.01)]),
            top("demo", name="broken", world_size=2, status="failed", elapsed=1.5,
                error=f"demo 'broken' failed {EVIL}", function="lectures/lecture_demo.py:10:ring_step",
                records=[rank_rec(1, "error", text=f"Traceback ...\nValueError: {EVIL}")]),
            top("demo", name="lesson", world_size=4, status="expected_failure", elapsed=2.0,
                error="timed out, as it should", function="lectures/lecture_demo.py:10:ring_step",
                records=[]),
            top("demo", name="needs_gpu", world_size=8, status="skipped", elapsed=0.0,
                error="needs 8 GPUs", function="lectures/lecture_demo.py:10:ring_step", records=[]),
        ]
    return {
        "schema": SCHEMA, "lecture": lecture, "title": f"Demo lecture: a test {EVIL}",
        "summary": f"What {lecture} teaches, in one line.",
        "module": f"lectures.{lecture}", "file": f"lectures/{lecture}.py",
        "built": "2026-01-02T03:04:05+00:00", "elapsed": 12.5, "status": status,
        "environment": {"python": "3.11", "torch": "2.13.0", "backend": "gloo", "launcher": "pool",
                        "world_size": 4, "quick": True, "device": "CPU: test, 2 cores", "host": "h"},
        "demos": {"total": 4, "failed": 1 if status == "failed" else 0, "expected_failures": 1, "skipped": 1},
        "functions": functions(),
        "records": records,
    }


def write(tmp_path, rec, out="content"):
    folder = tmp_path / out
    folder.mkdir(exist_ok=True)
    path = folder / f"{rec['lecture']}.json"
    path.write_text(json.dumps(rec))
    return path


@pytest.fixture
def page(tmp_path):
    path = write(tmp_path, recording(tmp_path, status="failed"))
    html_path = render.render_lecture(str(path))
    return tmp_path / "content", open(html_path, encoding="utf-8").read()


def test_everything_from_the_recording_is_escaped(page):
    out, html = page
    # the only script tags are the page's own local scripts
    assert re.findall(r"<script\b[^>]*>", html) == SCRIPTS
    # templates escape " as &#34;, Markdown as &quot;: both are text, never a tag
    escaped = html.replace("&#34;", "&quot;").count("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;")
    # note, table cell/header/caption, link title, image caption, figure caption, demo name,
    # rank stdout, rank error and the demo's error all show it as text
    assert escaped >= 10
    assert 'href="javascript:' not in html
    assert "<mtext><script>" not in html
    assert "<figcaption>remote <strong>picture</strong></figcaption>" in html  # captions: inline Markdown


def test_math_sections_and_toc(page):
    out, html = page
    assert html.count("<math") >= 3                       # inline, display, in the intro
    assert '<h1>Demo lecture</h1>' in html
    assert '<ol class="toc" id="toc"><li><a href="#first-section"' in html
    assert 'href="#second-section"' in html
    assert '<section class="section has-failure" id="second-section">' in html
    assert 'id="not-a-heading"' not in html and "# not a heading" in html  # fenced code stays code
    assert '<div class="scroll"><table>' in html           # markdown tables scroll on phones
    assert 'class="math-source"' in html                   # unconvertible math shown as source
    assert "Keys:" in html and "<kbd>j</kbd>" in html


def test_tables_numbers_and_code(page):
    out, html = page
    assert '<td class="num" title="1234567">1,234,567</td>' in html
    assert ">3.142</td>" in html and ">0.0001235</td>" in html
    assert '<th class=num>n</th>' in html
    # see(): highlighted with the file and line numbers
    assert "lectures/lecture_demo.py:10–11" in html
    assert '<span class="linenos">10</span>' in html
    # show code: the section's functions, including the demo's rank function, not library code
    second = html.split('id="second-section"')[1]
    code = second.split('<details class="show-code">')[1].split("</details>")[0]
    assert "show code" in code and "<code>ring_step</code>" in code and "<code>intro</code>" in code
    assert "multiprocessing" not in html
    # the reference link and the header line
    assert '<a href="https://example.org/paper" rel="noreferrer">' in html
    for text in ("2026-01-02 03:04 UTC", "CPU: test, 2 cores", "gloo", "pool", "quick sizes", "12.50 s"):
        assert text in html


def test_demos_ranks_and_failures(page):
    out, html = page
    ok = html.split('class="demo demo-ok"')[1].split("</article>")[0]
    assert ok.count('<section class="rank') == 2             # a column per rank with something to say
    assert "rank 0 says <strong>hi</strong>" in ok and "12 ms" in ok
    # stray stderr (library warnings) and return values stay off the page
    assert "warn" not in ok and "returned" not in ok and "1.5</code>" not in ok
    failed = html.split('class="demo demo-failed"')[1].split("</article>")[0]
    assert 'status-failed">failed<' in failed and 'class="error-box"' in failed
    # a rank's traceback is shown once, under the demo, naming the rank; no empty rank cards
    assert '<p class="rank-error-label">rank 1 raised:</p>' in failed
    assert '<section class="rank' not in failed and "nothing recorded" not in failed
    # the error's last line shows; the whole traceback opens on demand
    assert '<details class="traceback"><summary><pre>ValueError: &lt;script&gt;' in failed
    # a demo whose ranks neither recorded nor returned anything has no filler text
    lesson_and_skip = html.split('class="demo demo-expected_failure"')[1]
    assert "printed nothing" not in html and "timing spans" not in html
    assert '<div class="ranks">' not in lesson_and_skip.split("</article>")[0]
    lesson = html.split('class="demo demo-expected_failure"')[1].split("</article>")[0]
    assert "expected failure — this is the lesson" in lesson and "expected-box" in lesson
    assert 'class="demo demo-skipped"' in html and "needs 8 GPUs" in html
    assert 'class="banner-failed"' in html and 'href="#demo-2">broken</a>' in html
    after_header = html.split('class="about-numbers"')[1].split("</p>", 1)[1]
    assert "compute" not in after_header                      # spans are not listed


def test_assets_written_beside_the_page(page, tmp_path):
    out, html = page
    files = out / "lecture_demo_files"
    assert (files / "fig-01.svg").read_text() == SVG
    assert 'src="lecture_demo_files/fig-01.svg"' in html
    # every figure links to its full-size picture, opened in a new tab
    assert '<a class="full-size" href="lecture_demo_files/fig-01.svg" target="_blank"' in html
    copied = [f for f in os.listdir(files) if f.startswith("img-")]
    assert len(copied) == 1 and (files / copied[0]).read_bytes() == PNG
    assert f'src="lecture_demo_files/{copied[0]}" alt="local' in html and 'width="50"' in html
    # a remote image is a link card (JS swaps in the picture only when online)
    assert 'class="image remote" data-src="https://example.invalid/x.png"' in html
    assert not re.search(r'\ssrc="https?:', html)
    for name in ("course.css", "course.js", "pygments.css"):
        assert (out / "static" / name).stat().st_size > 100
    # nothing the page loads comes from the network
    for m in re.finditer(r'<(?:link|script|img)\b[^>]*(?:href|src)="([^"]+)"', html):
        assert not re.match(r"[a-z]+:", m.group(1)), m.group(0)
    assert "Content-Security-Policy" in html


def test_rerender_replaces_cleanly(tmp_path):
    path = write(tmp_path, recording(tmp_path, figures=3))
    render.render_lecture(str(path))
    files = tmp_path / "content" / "lecture_demo_files"
    assert sorted(f for f in os.listdir(files) if f.startswith("fig")) == ["fig-01.svg", "fig-02.svg", "fig-03.svg"]
    path.write_text(json.dumps(recording(tmp_path, figures=1)))
    render.render_lecture(str(path))
    assert sorted(f for f in os.listdir(files) if f.startswith("fig")) == ["fig-01.svg"]
    assert not [f for f in os.listdir(tmp_path / "content") if f.startswith(".tmp-")]


def test_a_failed_write_leaves_the_old_page(tmp_path, monkeypatch):
    path = write(tmp_path, recording(tmp_path))
    page = render.render_lecture(str(path))
    before = open(page, "rb").read()
    rec = recording(tmp_path)
    rec["records"].append({"kind": "note", "text": "NEW TEXT", "source": None, "rank": None, "t": 1})
    path.write_text(json.dumps(rec))
    real = os.replace

    def failing(a, b):
        if str(b).endswith(".html"):
            raise OSError("disk full")
        return real(a, b)
    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="disk full"):
        render.render_lecture(str(path))
    monkeypatch.setattr(os, "replace", real)
    assert open(page, "rb").read() == before           # the old page, whole
    out = tmp_path / "content"
    leftovers = [f for d in (out, out / "static", out / "lecture_demo_files") for f in os.listdir(d)
                 if f.startswith(".tmp-")]
    assert leftovers == []
    assert "NEW TEXT" in open(render.render_lecture(str(path)), encoding="utf-8").read()


def test_index_says_how_to_run_a_notebook_not_rendered_yet(tmp_path):
    """`make` does not execute the notebooks: the index names each notebook, what it lets you
    try, and the commands; once rendered, it links it."""
    name = "lecture_02_communication"                 # a lecture with a real notebook
    write(tmp_path, recording(tmp_path, lecture=name))
    out = tmp_path / "content"
    render.render_lecture(str(out / f"{name}.json"))
    html = open(render.render_index(str(out)), encoding="utf-8").read()
    assert f"lectures/notebooks/{name}.ipynb" in html and "make notebooks" in html and "make jupyter" in html
    assert "Write a ring all-reduce" in html and f'href="notebooks/{name}.html"' not in html
    (out / "notebooks").mkdir()
    (out / "notebooks" / f"{name}.html").write_text("<html></html>")
    html = open(render.render_index(str(out)), encoding="utf-8").read()
    assert f'href="notebooks/{name}.html"' in html


def test_index_lists_lectures_and_notebooks(tmp_path):
    write(tmp_path, recording(tmp_path, lecture="lecture_b", status="failed"))
    write(tmp_path, recording(tmp_path, lecture="lecture_a"))
    out = tmp_path / "content"
    render.render_lecture(str(out / "lecture_a.json"))
    render.render_lecture(str(out / "lecture_b.json"))
    (out / "other.json").write_text(json.dumps({"schema": "something-else"}))
    (out / "broken.json").write_text("{not json")
    (out / "notebooks").mkdir()
    (out / "notebooks" / "lecture_a.html").write_text("<html></html>")
    html = open(render.render_index(str(out)), encoding="utf-8").read()
    assert html.index("lecture_a.html") < html.index("lecture_b.html")   # sorted by name
    assert 'href="notebooks/lecture_a.html"' in html
    assert "notebooks/lecture_b.html" not in html                        # none for b
    assert "other.html" not in html and "broken" not in html
    assert "<dt>rank, world size</dt>" in html and "<dt>gloo and NCCL</dt>" in html   # the primer
    assert html.count('class="lecture-card') == 2
    assert "build failed" in html and "min</b> to read" in html
    assert "builds in" not in html                  # a card says what a reader spends, not the build
    # a start: the map of the course, the two commands, what this build took and on what machine
    assert '<svg class="course-map wide"' in html and '<svg class="course-map tall"' in html
    assert "make test" in html and "25.00 s" in html and "CPU: test, 2 cores" in html
    assert "&lt;script&gt;" in html and re.findall(r"<script\b[^>]*>", html) == SCRIPTS
    assert "What lecture_a teaches, in one line." in html          # each lecture's summary
    # every lecture page links its neighbours, even when built one by one
    a = (out / "lecture_a.html").read_text()
    b = (out / "lecture_b.html").read_text()
    assert '<a class="next" href="lecture_b.html" rel="next">' in a and 'class="prev"' not in a
    assert '<a class="prev" href="lecture_a.html" rel="prev">' in b and 'class="next"' not in b


def test_empty_index(tmp_path):
    html = open(render.render_index(str(tmp_path)), encoding="utf-8").read()
    assert "No lectures built yet" in html


def test_number_formatting():
    f = render.format_number
    assert f(0) == "0" and f(-1234) == "-1,234" and f(True) == "True"
    assert f(2.5) == "2.5" and f(1 / 3) == "0.3333" and f(123456.7) == "123,457"
    assert f(1.5e-7) == "1.5e-07" and f(float("nan")) == "NaN" and f(float("inf")) == "∞"


def test_split_note():
    parts = render.split_note("# Title\nintro\n## A\ntext\n```\n## code, not a heading\n```\n## B")
    assert [(lvl, t) for lvl, t, _ in parts] == [(1, "Title"), (2, "A"), (2, "B")]
    assert "## code, not a heading" in parts[1][2]


def test_fenced_text_and_table_cells_render_not_show_their_markup():
    # a ```text fence once came out as literal "<pre><code class=...>" on lecture 02's page
    out = str(render.markdown("Output:\n\n```text\nlscpu <x>\n```\n"))
    assert "&lt;pre" not in out and "&lt;code" not in out and "lscpu &lt;x&gt;" in out
    t = render.Page({"functions": {}}, "f").p_table({"header": ["what", "bytes"],
                                                    "rows": [["**total**", 5], ["`x`", 1]]})
    assert str(t["rows"][0][0]["text"]) == "<strong>total</strong>"
    assert str(t["rows"][1][0]["text"]) == "<code>x</code>"


def test_try_it_yourself_box_lists_the_notebook_exercises(tmp_path):
    rec = recording(tmp_path)
    rec["exercises"] = [{"name": "ring_all_reduce", "title": "a ring all-reduce from send/recv"}]
    write(tmp_path, rec)
    html = open(render.render_lecture(str(tmp_path / "content" / "lecture_demo.json")), encoding="utf-8").read()
    box = html.split('<section class="try-it" id="try-it">')[1].split("</section>")[0]
    assert "<code>ring_all_reduce</code>: a ring" in box and "make jupyter" in box
    assert re.sub(r"<[^>]+>", "", box.split("<code>ring_all_reduce</code>: ")[1]).startswith("a ring all-reduce from send/recv")
    write(tmp_path, recording(tmp_path))                 # a lecture without exercises has no box
    assert "try-it" not in open(render.render_lecture(str(tmp_path / "content" / "lecture_demo.json")),
                                encoding="utf-8").read()


def _recorded(tmp_path, narrate):
    """A recording made by `narrate()` through the real narration API."""
    from util import record
    rec = recording(tmp_path, demos=False)
    recorder = record.Recorder()
    previous = record.use(recorder)
    try:
        narrate(record)
    finally:
        record.use(previous)
    rec["records"] = recorder.records
    rec["functions"] = recorder.functions
    write(tmp_path, rec)
    return tmp_path / "content"


def _lesson_code():
    return 1


def _folded_code():
    return 2


def test_a_first_read_folds_code_moves_deep_dives_and_keeps_a_cheatsheet(tmp_path):
    def narrate(r):
        r.note("# Title\n## Main section")
        r.see(_folded_code)
        r.see(_lesson_code, lesson=True)
        r.cheat("ring all-reduce bytes", "$2(n-1)/n \\cdot S$", 1536, "bytes", what="per rank")
        with r.deep_dive("The gory details", "what a careful reader finds"):
            r.note("## Details\nDeep text.")
            r.cheat("deep number", "$x$", 0.25)
            r.published("A paper says **29%**.", "https://example.org/p", "Someone 2024")
        r.note("Back on the main path.\n## Second main section\nMore.")
        r.table([[i, i * i] for i in range(18)], header=["i", "i²"])
    out = _recorded(tmp_path, narrate)
    html = open(render.render_lecture(str(out / "lecture_demo.json")), encoding="utf-8").read()
    main = html.split('id="main-section"')[1].split("</section>")[0]
    listings = main.split('<details class="show-code">')[0]   # the section's own code folds at its end
    # listings fold unless they are the lesson
    assert '<details class="listing"><summary>show code <code>_folded_code</code>' in main
    assert listings.count('<figure class="code') == 2 and listings.count('<details class="listing">') == 1
    # the deep dive left a pointer here and its text went to the appendix page
    assert 'href="lecture_demo_appendix.html#the-gory-details"' in main and "what a careful reader finds" in main
    assert "<p>Deep text.</p>" not in html and "Back on the main path." in main
    appendix = (out / "lecture_demo_appendix.html").read_text()
    assert "<p>Deep text.</p>" in appendix and "<p>Back on the main path.</p>" not in appendix
    # the dive's first heading titles its section, which keeps the id the pointer links to
    assert '<section class="section dive" id="the-gory-details"><h2><a class="anchor" href="#the-gory-details">Details</a></h2>' in appendix
    assert appendix.count("<h2>") == 1
    assert 'A deep dive of <a href="lecture_demo.html#main-section">this spot in the lecture</a>' in appendix
    assert "published on GPUs · not measured here" in appendix and "<strong>29%</strong>" in appendix
    # a long table shows 8 rows, all 18 one click away
    second = html.split('id="second-main-section"')[1]
    assert "show all 18 rows" in second and second.split("<details")[0].count("<tr>") == 9
    # the cheatsheet: each value beside its formula, linked to its line on the page
    render.render_index(str(out))
    sheet = (out / "cheatsheet.html").read_text()
    assert 'title="1536">1,536</span> bytes' in sheet and 'href="lecture_demo.html#cheat-' in sheet
    assert 'href="lecture_demo_appendix.html#cheat-' in sheet and 'title="0.25">0.25<' in sheet
    anchor = re.search(r'href="lecture_demo.html#(cheat-[^"]+)"', sheet).group(1)
    line = html.split(f'id="{anchor}"')[1].split("</p>")[0]
    assert '<b class="value">1,536</b> bytes' in line
    # a lecture that loses its deep dives loses its appendix page
    out = _recorded(tmp_path, lambda r: r.note("# Title\n## Only"))
    render.render_lecture(str(out / "lecture_demo.json"))
    assert not (out / "lecture_demo_appendix.html").exists()


def test_cheat_takes_measured_numbers_and_plural_never_says_s():
    from util import record
    with pytest.raises(TypeError, match="must be a number"):
        record.cheat("x", "$x$", "16 bytes")
    assert record.plural(1, "head") == "1 head" and record.plural(3, "head") == "3 heads"
    assert record.plural(2, "all-reduce") == "2 all-reduces" and record.plural(0, "copy", "copies") == "0 copies"


def test_a_demo_with_nothing_to_show_draws_no_bar(tmp_path):
    rec = recording(tmp_path)
    rec["records"].append({"kind": "demo", "name": "silent", "world_size": 2, "status": "ok", "elapsed": 0.1,
                           "error": None, "function": None, "records": [], "source": src("intro", 20),
                           "rank": None, "t": 0.0})
    path = write(tmp_path, rec)
    html = open(render.render_lecture(str(path)), encoding="utf-8").read()
    assert "silent" not in html and 'class="demo demo-ok"' in html   # the demo that has a card keeps it



def test_a_wide_figure_has_a_phone_drawing_narrower_than_itself(monkeypatch):
    """record.figure keeps a second, narrower SVG of a wide figure (its text then larger relative
    to the plot on a phone); a figure already phone-sized, or with panels side by side, keeps one."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from util import record
    added = []
    monkeypatch.setattr(record._current, "add", lambda kind, **kw: added.append(kw))
    for width in (9.0, 4.0):
        fig, ax = plt.subplots(figsize=(width, 3))
        ax.plot([0, 1], [0, 1])
        record.figure(fig)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3))      # panels side by side: kept as they are
    record.figure(fig)
    wide, narrow, gallery = added
    assert "phone_svg" not in gallery
    width_pt = lambda svg: float(re.search(r'width="([\d.]+)pt"', svg).group(1))
    assert "phone_svg" not in narrow
    assert width_pt(wide["phone_svg"]) < 0.7 * width_pt(wide["svg"])


def test_the_page_serves_the_phone_drawing_below_600_px(tmp_path):
    rec = recording(tmp_path)
    for r in rec["records"]:
        if r["kind"] == "figure":
            r["phone_svg"] = SVG.replace("10", "5")
    html = open(render.render_lecture(str(write(tmp_path, rec))), encoding="utf-8").read()
    files = tmp_path / "content" / "lecture_demo_files"
    assert '<source media="(max-width: 600px)" srcset="lecture_demo_files/fig-01-phone.svg">' in html
    assert (files / "fig-01-phone.svg").read_text() == SVG.replace("10", "5")
    assert 'src="lecture_demo_files/fig-01.svg"' in html


def test_a_timeline_with_its_legend_under_the_axes_has_a_phone_drawing(monkeypatch):
    """A timeline's legend, marked to hang under its axes, narrows with them (lecture 02's overlap
    timeline was a few pixels tall on a phone); an unmarked legend outside the axes (beside them,
    or under a bar chart whose tick labels would run together) keeps the figure's width."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from util import record
    from util.figures import timeline
    added = []
    monkeypatch.setattr(record._current, "add", lambda kind, **kw: added.append(kw))
    spans = [{"rank": r, "label": label, "start": a, "end": b} for r in (0, 1)
             for label, a, b in (("wait", 0, 0.01), ("all-reduce", 0.012, 0.02), ("wait", 0.02, 0.03))]
    record.figure(timeline(spans, title="two ranks"))
    fig, ax = plt.subplots(figsize=(9, 3))
    ax.plot([0, 1], [0, 1], label="a line")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1))
    record.figure(fig)
    fig, ax = plt.subplots(figsize=(9, 3))
    ax.bar(["formula", "measured"], [1, 2], label="bytes")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25))
    record.figure(fig)
    below, beside, under_bars = added
    assert "phone_svg" in below and "phone_svg" not in beside and "phone_svg" not in under_bars


def test_a_timelines_legend_hangs_just_under_its_x_label_in_both_drawings():
    """The legend sits a fixed distance under the axes, not a share of their height (which left
    a wide gap on the taller phone drawing): just below the x label, never on it, in the wide
    drawing and in the phone one, for a short timeline and a tall one."""
    import matplotlib
    matplotlib.use("Agg")
    from util import record
    from util.figures import timeline

    def gap_inches(fig):
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        ax = fig.axes[0]
        label, legend = ax.xaxis.label.get_window_extent(r), ax.get_legend().get_window_extent(r)
        return (label.y0 - legend.y1) / fig.dpi       # display y grows upwards

    for ranks in (2, 8):
        spans = [{"rank": r, "label": label, "start": a, "end": b} for r in range(ranks)
                 for label, a, b in (("forward", 0, 0.01), ("all-reduce", 0.012, 0.02), ("wait", 0.02, 0.03),
                                     ("backward", 0.03, 0.04), ("step", 0.04, 0.05))]
        fig = timeline(spans, title="a timeline")
        fig.tight_layout()
        assert 0 < gap_inches(fig) < 0.35, (ranks, gap_inches(fig))
        assert record._phone_svg(fig)                   # narrows the figure in place
        assert fig.axes[0].get_legend()._ncols == 1
        assert 0 < gap_inches(fig) < 0.35, (ranks, "phone", gap_inches(fig))
