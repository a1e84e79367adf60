"""The course as a first read, measured in a real browser on the quick-built pages:
each lecture's main path as it opens (folded code and deep dives closed) is at most 25 screens
at 1280x800, shows a picture before the first visible code listing in at least 80% of the
sections that show code, leaks no template text and says "every number on this page" once;
its deep dives are on an appendix page that links back; the index is a start (the commands, a
map, reading times); the cheatsheet's every value is the one its lecture's recording holds and
the one its section shows. Screenshots of each page's first three screens go to tests/artifacts/."""
import json
import os
import re

import pytest

from tests.conftest import ARTIFACTS, LECTURES, Watched, built, walk
from tests.support.pages import check_page

MAX_SCREENS, PICTURE_FIRST = 25, 0.8
LEAKS = [(r"\b[a-z]{3,}\(s\)", "a pluralisation placeholder"),
         (r"<(?:dictcomp|listcomp|setcomp|lambda|genexpr|module)>", "Python internals"),
         (r"status: ?expected_failure", "a status enum"),
         (r"\b(\d[\d.,]*)× and \1×", "the same number twice"),
         (r"\b(\d[\d.,]*)[–-]\1(?![\d.,]*\d)", "an empty range"),
         (r"\b(\d[\d.,]*\d) and \1(?![\d.,]*\d)", "the same number twice")]
SECTIONS = """() => {
  const vis = e => !e.closest('details:not([open])') && !!(e.offsetWidth || e.offsetHeight);
  return [...document.querySelectorAll('main section.section')].map(s => {
    const els = [...s.querySelectorAll('figure.code, img, svg, canvas, .widget')].filter(vis);
    const code = els.findIndex(e => e.matches('figure.code'));
    const pic = els.findIndex(e => !e.matches('figure.code') && !e.closest('figure.code'));
    return {id: s.id, code, pic};
  });
}"""


def _url(path):
    return "file://" + os.path.abspath(path)


def leaks(text):
    return [f"{what}: {m.group(0)!r}" for rx, what in LEAKS for m in re.finditer(rx, text)]


def screenshots(page, stem, width):
    """The first three screens, as a reader scrolls."""
    os.makedirs(ARTIFACTS, exist_ok=True)
    height = page.viewport_size["height"]
    for i in range(3):
        page.evaluate(f"window.scrollTo(0, {i * height})")
        page.wait_for_timeout(50)
        page.screenshot(path=os.path.join(ARTIFACTS, f"first_read_{stem}_{width}_{i + 1}.png"))


@pytest.mark.parametrize("name", LECTURES)
def test_the_main_path_is_a_first_read_and_hides_nothing(browser, course_site, name):
    folder = built(course_site, name)
    w = Watched(browser, viewport={"width": 1280, "height": 800}, reduced_motion="reduce")
    try:
        page = w.page
        page.goto(_url(folder / f"{name}.html"))
        page.wait_for_load_state("load")
        screens = page.evaluate("document.documentElement.scrollHeight") / 800
        assert screens <= MAX_SCREENS, f"{name}: {screens:.1f} screens at 1280x800 (at most {MAX_SCREENS})"
        sections = page.evaluate(SECTIONS)
        with_code = [s for s in sections if s["code"] >= 0]
        first = [s for s in with_code if 0 <= s["pic"] < s["code"]]
        assert len(first) >= PICTURE_FIRST * len(with_code), \
            f"{name}: a picture before the code in {len(first)} of {len(with_code)} sections: " \
            f"{[s['id'] for s in with_code if s not in first]}"
        text = page.inner_text("body")
        assert not leaks(text), f"{name}: template text on the page: {leaks(text)[:5]}"
        assert len(re.findall(r"[Ee]very number on this page", text)) == 1
        screenshots(page, name, 1280)
        check_page(page, name, 1280)     # and it hides nothing: one load serves both checks

        # the deep dives: each pointer on the main path opens its section of the appendix page,
        # which links back to the spot that pointed there
        dives = page.eval_on_selector_all("aside.dive-link a", "as => as.map(a => a.getAttribute('href'))")
        assert dives, f"{name}: no deep dive on an appendix page"
        appendix = folder / f"{name}_appendix.html"
        page.goto(_url(appendix))
        page.wait_for_load_state("load")
        for href in dives:
            file, _, anchor = href.partition("#")
            assert file == appendix.name and page.locator(f"section#{anchor}").count() == 1, href
            back = page.locator(f"section#{anchor} p.dive-from a:not(.term)").get_attribute("href")
            assert back.startswith(f"{name}.html")
        text = page.inner_text("body")
        assert not leaks(text), f"{name}'s appendix: template text on the page: {leaks(text)[:5]}"
        assert len(re.findall(r"[Ee]very number on this page", text)) == 1
        w.check_clean()
    finally:
        w.close()
    phone = Watched(browser, viewport={"width": 390, "height": 844}, device_scale_factor=2,
                    is_mobile=True, has_touch=True, reduced_motion="reduce")
    try:
        phone.page.goto(_url(folder / f"{name}.html"))
        phone.page.wait_for_load_state("load")
        screenshots(phone.page, name, 390)
        check_page(phone.page, name, 390)
        phone.check_clean()
    finally:
        phone.close()



@pytest.mark.parametrize("name", LECTURES)
def test_the_main_path_gives_at_most_two_measured_numbers_a_sentence(course_site, name):
    """Issue 43: idea first, numbers behind it. A sentence of the main path's prose carries at
    most two measured numbers; spreads and the rest go to tables, figures and hovers
    (tests/support/density.py says what counts as a measured number)."""
    from tests.support.density import MAX_PER_SENTENCE, dense_sentences
    folder = built(course_site, name)
    dense = dense_sentences((folder / f"{name}.html").read_text())
    assert not dense, (f"{name}: {len(dense)} sentences with more than {MAX_PER_SENTENCE} measured numbers: "
                       + " | ".join(f"{nums}: {s[:160]}" for nums, s in dense[:6]))


def _all_built(course_site):
    for name in LECTURES:
        built(course_site, name)     # skips under COURSE_ONLY, fails with a build's error
    return course_site[0]


def test_the_index_is_a_start(browser, course_site):
    folder = _all_built(course_site)
    for width, height in ((1280, 800), (390, 844)):
        w = Watched(browser, viewport={"width": width, "height": height}, reduced_motion="reduce")
        try:
            page = w.page
            page.goto(_url(folder / "index.html"))
            page.wait_for_load_state("load")
            text = page.inner_text("body")
            assert "make test" in text and re.search(r"^make\b", text, re.M), "the two setup commands"
            # one picture of the course, visible at this width, each box a link to its lecture
            maps = page.locator("svg.course-map:visible")
            assert maps.count() == 1
            links = maps.first.locator("a").evaluate_all("as => as.map(a => a.getAttribute('href'))")
            assert links == [f"{n}.html" for n in LECTURES]
            # a reading time per lecture (what a reader spends, not what the build took), and a
            # link to its notebook in the list that says what each lets you try and how to open it
            cards = page.locator(".lecture-card")
            assert cards.count() == len(LECTURES)
            for i in range(len(LECTURES)):
                card = cards.nth(i).inner_text()
                assert re.search(r"about \d+ min to read", card) and "builds in" not in card, card
                assert "notebook" in card, card
            notebooks = page.locator("#notebooks").inner_text()
            assert "make jupyter" in notebooks and all(f"lectures/notebooks/{n}.ipynb" in notebooks for n in LECTURES)
            assert page.locator("a[href='glossary.html']").count() >= 1
            assert page.locator("a[href='cheatsheet.html']").count() >= 1
            calc = page.locator("#rules-of-thumb a").first.get_attribute("href")
            assert calc.startswith("lecture_07_putting_it_together.html#")
            assert not leaks(text)
            screenshots(page, "index", width)
            w.check_clean()
        finally:
            w.close()
    # the rules of thumb link to the section of lecture 07 that holds the calculator
    w = Watched(browser, viewport={"width": 1280, "height": 800})
    try:
        w.page.goto(_url(folder / calc))
        anchor = calc.partition("#")[2]
        assert w.page.locator(f"section#{anchor} figure.widget[data-widget='memory-calculator']").count() == 1
    finally:
        w.close()


def test_the_cheatsheet_shows_what_each_lecture_measured(browser, course_site):
    """Every row's value is the value its lecture's recording holds for that formula, and the same
    number stands in the section it links to; every lecture teaches at least three formulas."""
    folder = _all_built(course_site)
    recorded = {}
    for name in LECTURES:
        rec = json.loads((folder / f"{name}.json").read_text())
        cheats = [r for r in walk(rec["records"]) if r["kind"] == "cheat"]
        assert len(cheats) >= 3, f"{name} records {len(cheats)} cheatsheet entries"
        recorded.update({(name, r["topic"]): r["value"] for r in cheats})
    w = Watched(browser, viewport={"width": 1280, "height": 800}, reduced_motion="reduce")
    try:
        page = w.page
        page.goto(_url(folder / "cheatsheet.html"))
        page.wait_for_load_state("load")
        rows = page.eval_on_selector_all("table.cheats tbody tr", """rs => rs.map(r => ({
            lecture: r.closest('section').id, topic: r.cells[0].childNodes[0].textContent.trim(),
            value: r.querySelector('.value').getAttribute('title'), shown: r.querySelector('.value').innerText,
            href: r.cells[3].querySelector('a').getAttribute('href')}))""")
        assert len(rows) == len(recorded)
        screenshots(page, "cheatsheet", 1280)
        by_page = {}
        for row in rows:
            value = recorded[(row["lecture"], row["topic"])]
            assert float(row["value"]) == value, row
            page_name, _, anchor = row["href"].partition("#")
            assert page_name.startswith(row["lecture"]), row
            by_page.setdefault(page_name, []).append((row, anchor))
        for page_name, linked in by_page.items():       # each lecture page opened once
            other = w.context.new_page()
            try:
                other.goto(_url(folder / page_name))
                for row, anchor in linked:
                    shown = other.locator(f"#{anchor}").text_content()
                    assert row["shown"] in shown, f"{row}: the lecture's line says {shown!r}"
            finally:
                other.close()
        w.check_clean()
    finally:
        w.close()
    phone = Watched(browser, viewport={"width": 390, "height": 844}, device_scale_factor=2,
                    is_mobile=True, has_touch=True)
    try:
        phone.page.goto(_url(folder / "cheatsheet.html"))
        assert phone.page.evaluate("document.documentElement.scrollWidth <= 390")
        screenshots(phone.page, "cheatsheet", 390)
    finally:
        phone.close()
