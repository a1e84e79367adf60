"""A real browser opens the built fixture lecture from file:// (headless Debian Chromium through
Playwright): the table of contents and keyboard navigation work, nothing is fetched from the
network, nothing logs an error, and the page fits a phone. Screenshots go to tests/artifacts/."""
import os
import time

import pytest

from tests.conftest import ARTIFACTS, LECTURES, Watched, built

pytestmark = pytest.mark.timeout(900)  # the first test waits for the course to build


def wait_until(page, expression, timeout=10.0):
    """Poll a JavaScript expression until it is true. (Playwright's wait_for_function evaluates
    a string inside the page, which the page's Content-Security-Policy rightly forbids.)"""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {timeout} s: {expression}")
        page.wait_for_timeout(50)


def _url(path):
    return "file://" + os.path.abspath(path)


def test_lecture_page_navigation_offline(browser, fixture_site):
    os.makedirs(ARTIFACTS, exist_ok=True)
    w = Watched(browser, viewport={"width": 1280, "height": 900})
    page = w.page
    try:
        page.goto(_url(fixture_site / "fixture_lecture.html"))
        page.wait_for_load_state("load")

        # the table of contents lists the ## sections of the fixture lecture, in order
        toc = page.locator(".toc a").all_inner_texts()
        assert [t.strip() for t in toc] == ["Narration", "Collectives on 1, 2 and 4 ranks", "Timelines"]
        ids = page.eval_on_selector_all("main section.section", "els => els.map(e => e.id)")
        assert len(ids) == 3

        # every figure and the local image actually loaded from disk
        broken = page.eval_on_selector_all(
            "main img", "imgs => imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)")
        assert not broken, f"images that did not load: {broken}"
        assert page.locator("main img").count() >= 10
        # offline, the remote image is a link card, not an <img>
        assert page.locator("figure.remote .card").is_visible()
        assert page.locator("figure.remote img").count() == 0
        # the note's <script> is text, and math became MathML
        assert '<script>alert("x")</script>' in page.locator("#narration").inner_text()
        assert page.locator("#narration math").count() >= 2

        page.screenshot(path=os.path.join(ARTIFACTS, "lecture_laptop.png"))
        page.screenshot(path=os.path.join(ARTIFACTS, "lecture_laptop_full.png"), full_page=True)

        # clicking a TOC entry moves there
        page.locator(".toc a", has_text="Timelines").click()
        wait_until(page, "location.hash === '#timelines'")
        wait_until(page, 
            "Math.abs(document.getElementById('timelines').getBoundingClientRect().top) < 24")

        # keys: back to the top, then j / ArrowRight / k walk the sections
        page.evaluate("window.scrollTo(0, 0)")
        wait_until(page, "window.scrollY === 0")
        page.keyboard.press("j")
        wait_until(page, f"location.hash === '#{ids[0]}'")
        wait_until(page, 
            f"Math.abs(document.getElementById('{ids[0]}').getBoundingClientRect().top) < 24")
        page.keyboard.press("ArrowRight")
        wait_until(page, f"location.hash === '#{ids[1]}'")
        wait_until(page, 
            f"Math.abs(document.getElementById('{ids[1]}').getBoundingClientRect().top) < 24")
        assert page.locator(f".toc a[href='#{ids[1]}']").get_attribute("class") == "active"
        page.keyboard.press("k")
        wait_until(page, f"location.hash === '#{ids[0]}'")

        # "show code" opens the section's functions, with line numbers
        details = page.locator(f"#{ids[1]} details.show-code")
        details.locator("summary").click()
        assert details.locator(".linenos").first.is_visible()
        assert "def sum_of_ranks" in details.inner_text()
        w.check_clean()
    finally:
        w.close()


def test_phone_layout(browser, fixture_site):
    os.makedirs(ARTIFACTS, exist_ok=True)
    w = Watched(browser, viewport={"width": 390, "height": 844}, device_scale_factor=2,
                is_mobile=True, has_touch=True)
    page = w.page
    try:
        page.goto(_url(fixture_site / "fixture_lecture.html"))
        page.wait_for_load_state("load")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), \
            "the page scrolls sideways on a phone"
        menu = page.locator("#menu")
        assert menu.is_visible()
        assert not page.locator(".toc a").first.is_visible() or \
            page.evaluate("document.querySelector('.sidebar').getBoundingClientRect().right <= 0")
        page.screenshot(path=os.path.join(ARTIFACTS, "lecture_phone.png"))
        # wide content (four rank columns) scrolls inside its box, not the page
        page.locator("#collectives-on-1-2-and-4-ranks .demo").last.scroll_into_view_if_needed()
        page.screenshot(path=os.path.join(ARTIFACTS, "lecture_phone_ranks.png"))
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")

        menu.click()
        wait_until(page, "document.querySelector('.sidebar').getBoundingClientRect().left >= 0")
        page.screenshot(path=os.path.join(ARTIFACTS, "lecture_phone_menu.png"))
        page.locator(".toc a", has_text="Timelines").click()
        wait_until(page, "location.hash === '#timelines'")
        wait_until(page, "!document.body.classList.contains('menu-open')")
        w.check_clean()
    finally:
        w.close()


def test_index_links_the_lecture(browser, fixture_site):
    os.makedirs(ARTIFACTS, exist_ok=True)
    w = Watched(browser, viewport={"width": 1100, "height": 700})
    page = w.page
    try:
        page.goto(_url(fixture_site / "index.html"))
        link = page.locator("a[href='fixture_lecture.html']").first
        assert "Fixture lecture" in link.inner_text()
        page.screenshot(path=os.path.join(ARTIFACTS, "index.png"))
        link.click()
        page.wait_for_url("**/fixture_lecture.html")
        assert page.locator("h1").inner_text().strip() == "Fixture lecture"
        w.check_clean()
    finally:
        w.close()


def test_remote_image_only_when_online(browser, fixture_site):
    """Online, the link card becomes the picture; if the picture fails, the card stays (and no
    broken-image icon is ever in the page). The network is faked with Playwright routes."""
    png = open(os.path.join(os.path.dirname(__file__), "fixture_image.png"), "rb").read()
    for works in (True, False):
        context = browser.new_context(viewport={"width": 1000, "height": 800})
        if works:
            context.route("https://example.invalid/**",
                          lambda route: route.fulfill(status=200, content_type="image/png", body=png))
        else:
            context.route("https://example.invalid/**", lambda route: route.fulfill(status=404, body=b""))
        page = context.new_page()
        try:
            page.goto(_url(fixture_site / "fixture_lecture.html"))
            page.wait_for_load_state("load")
            fig = page.locator("figure.remote")
            if works:
                wait_until(page, "document.querySelector('figure.remote img') !== null")
                assert page.evaluate("document.querySelector('figure.remote img').naturalWidth") > 0
                assert not fig.locator(".card").is_visible()
            else:
                page.wait_for_timeout(300)
                assert fig.locator("img").count() == 0
                assert fig.locator(".card").is_visible()
        finally:
            context.close()


# --- every built page, as a reader sees it ----------------------------------------------------

LAYOUT_CHECKS = """() => {
  const wide = el => el.scrollWidth > el.clientWidth + 1;
  const label = el => el.tagName.toLowerCase() + (el.className ? '.' + String(el.className).split(' ')[0] : '')
                     + ' in #' + (el.closest('section') || {}).id + ': ' + (el.innerText || '').slice(0, 60);
  const scroller = el => { for (let a = el.parentElement; a; a = a.parentElement) {
      const o = getComputedStyle(a).overflowX;
      if ((o === 'auto' || o === 'scroll') && a.clientWidth <= innerWidth) return a; } return null; };
  const out = {pageScrolls: document.documentElement.scrollWidth > innerWidth, codeOrTable: [],
               unscrolled: [], figures: 0, unlinked: [], filler: [], tracebacks: 0};
  for (const el of document.querySelectorAll('main pre, main .scroll'))
    if (wide(el) && !el.closest('.ranks')) out.codeOrTable.push(label(el));
  for (const el of document.querySelectorAll('main pre, main table, main img, main math, main .ranks'))
    if (el.getBoundingClientRect().width > innerWidth + 1 && !scroller(el)) out.unscrolled.push(label(el));
  for (const fig of document.querySelectorAll('figure.plot')) {
    out.figures++;
    const a = fig.querySelector('a.full-size');
    const img = fig.querySelector('img');
    if (!a || a.target !== '_blank' || !img || a.getAttribute('href') !== img.getAttribute('src')
        || !/\\.svg$/.test(a.getAttribute('href'))) out.unlinked.push(label(fig));
  }
  for (const d of document.querySelectorAll('.demo'))
    if (/printed nothing|timing spans/.test(d.innerText)) out.filler.push(label(d));
  out.tracebacks = document.querySelectorAll('.demo details.traceback').length;
  out.widgets = [...document.querySelectorAll('figure.widget')].map(
    f => f.classList.contains('live') ? 'live' : 'failed: ' + f.innerText.slice(-200));
  return out; }"""


def check_layout(page, name, width):
    found = page.evaluate(LAYOUT_CHECKS)
    assert not found["pageScrolls"], f"{name} scrolls sideways at {width} px"
    assert not found["unscrolled"], f"{name} at {width} px: wider than the screen, no scroll box: {found['unscrolled']}"
    assert not found["unlinked"], f"{name}: figures without a full-size link: {found['unlinked']}"
    assert not found["filler"], f"{name}: demo boxes with filler text: {found['filler']}"
    assert all(w == "live" for w in found["widgets"]), f"{name}: interactive figures that did not start: {found['widgets']}"
    return found


def test_the_fixture_page_hides_nothing_at_1280_and_fits_a_phone(browser, fixture_site):
    pages_fit(browser, fixture_site, "fixture_lecture", expect_tracebacks=True)


@pytest.mark.parametrize("name", LECTURES)
def test_every_lecture_page_hides_nothing_at_1280_and_fits_a_phone(browser, course_site, name):
    pages_fit(browser, built(course_site, name), name)


def pages_fit(browser, folder, name, expect_tracebacks=False):
    os.makedirs(ARTIFACTS, exist_ok=True)
    for width, height, phone in ((1280, 800, False), (390, 844, True)):
        extra = {"device_scale_factor": 2, "is_mobile": True, "has_touch": True} if phone else {}
        w = Watched(browser, viewport={"width": width, "height": height}, reduced_motion="reduce", **extra)
        try:
            w.page.goto(_url(folder / f"{name}.html"))
            w.page.wait_for_load_state("load")
            found = check_layout(w.page, name, width)
            if not phone:   # at 1280 px no code listing or table hides anything
                assert not found["codeOrTable"], f"{name}: needs sideways scrolling at 1280 px: {found['codeOrTable']}"
            w.page.screenshot(path=os.path.join(ARTIFACTS, f"{name}_{width}.png"))
            if expect_tracebacks:
                assert found["tracebacks"] > 0
            if found["tracebacks"]:  # a rank's full error text opens on demand
                box = w.page.locator(".demo details.traceback").first
                assert not box.locator("pre").nth(1).is_visible()
                box.locator("summary").click()
                full = box.locator("pre").nth(1)
                assert full.is_visible() and full.inner_text().count("\n") >= 1
            w.check_clean()
        finally:
            w.close()
