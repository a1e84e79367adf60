"""The interactive figures, in a real browser: lecture 05's schedule explorer simulates every
embedded schedule exactly as Python's `simulate` does, redraws within a frame, and answers its
controls; offline, from file://, at laptop and phone widths."""
import json
import random

import pytest

from lectures.schedule_explorer import explorer_data
from lectures.schedules import make_schedule, simulate
from tests.conftest import Watched
from util import render


@pytest.fixture(scope="module")
def explorer_page(tmp_path_factory):
    out = tmp_path_factory.mktemp("widgets")
    rec = {"schema": "course-lecture/1", "lecture": "lecture_widgets", "title": "Widgets",
           "status": "ok", "environment": {"device": "CPU: test", "backend": "gloo"}, "functions": {},
           "records": [{"kind": "note", "text": "# Widgets\n## The explorer", "source": None, "rank": None},
                       {"kind": "widget", "name": "schedule-explorer", "data": explorer_data(),
                        "caption": "explore", "source": None, "rank": None}]}
    (out / "lecture_widgets.json").write_text(json.dumps(rec))
    return render.render_lecture(str(out / "lecture_widgets.json"))


def test_javascript_simulator_equals_python_for_every_embedded_schedule(browser, explorer_page):
    w = Watched(browser, viewport={"width": 1280, "height": 800})
    try:
        w.page.goto("file://" + explorer_page)
        keys = w.page.evaluate("window.course.scheduleKeys()")
        assert len(keys) >= 150
        rng = random.Random(0)
        cases = []
        for key in keys:
            name, p, m, v = key.split("|")
            cost = {"F": rng.uniform(0.2, 3), "B": rng.uniform(0.2, 3), "W": rng.uniform(0, 2),
                    "send": rng.choice([0, rng.uniform(0, 1)])}
            cases.append((name, int(p), int(m), int(v), cost))
        got = w.page.evaluate("cases => cases.map(c => window.course.simulate(...c))", cases)
        for (name, p, m, v, cost), js in zip(cases, got):
            py = simulate(make_schedule(name, p, m, v), cost)
            assert js["makespan"] == pytest.approx(py.makespan, rel=1e-9), (name, p, m, v)
            assert js["bubble"] == pytest.approx(py.bubble, rel=1e-9, abs=1e-12), (name, p, m, v)
        w.check_clean()
    finally:
        w.close()


@pytest.mark.parametrize("width,height", [(1280, 800), (390, 844)])
def test_controls_redraw_within_a_frame(browser, explorer_page, width, height):
    w = Watched(browser, viewport={"width": width, "height": height})
    try:
        pg = w.page
        pg.goto("file://" + explorer_page)
        fig = pg.locator("figure.widget.live")
        assert fig.count() == 1
        before = pg.locator(".widget-readout").text_content()
        rects_before = pg.locator(".widget-svg svg").first.locator("rect").count()
        pg.select_option(".widget-controls select >> nth=0", "gpipe")
        after = pg.locator(".widget-readout").text_content()
        assert after != before and after.startswith("gpipe")
        # the largest embedded schedule, with a cost change: recomputed and redrawn in < 16 ms
        pg.select_option(".widget-controls select >> nth=0", "interleaved-1f1b")
        pg.select_option(".widget-controls select >> nth=1", "8")
        pg.select_option(".widget-controls select >> nth=2", "16")
        pg.select_option(".widget-controls select >> nth=3", "2")
        pg.fill(".widget-controls input >> nth=2", "0.5")
        assert pg.locator(".widget-svg svg").first.locator("rect").count() > rects_before
        times = []
        for value in ("1.5", "2.5", "0.7", "1.1", "3"):
            pg.fill(".widget-controls input >> nth=0", value)
            times.append(float(fig.get_attribute("data-redraw-ms")))
        assert sorted(times)[len(times) // 2] < 16, times
        # nothing sticks out of the page at this width
        assert pg.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
        fig.screenshot(path=f"tests/artifacts/explorer_{width}.png")
        w.check_clean()
    finally:
        w.close()


def test_without_javascript_the_widget_stays_hidden(browser, explorer_page):
    ctx = browser.new_context(java_script_enabled=False, offline=True)
    try:
        pg = ctx.new_page()
        pg.goto("file://" + explorer_page)
        assert not pg.locator("figure.widget").is_visible()
    finally:
        ctx.close()
