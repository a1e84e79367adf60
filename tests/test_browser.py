"""A real browser opens the built fixture lecture from file:// (headless Debian Chromium through
Playwright): the table of contents and keyboard navigation work, nothing is fetched from the
network, nothing logs an error, and the page fits a phone. Screenshots go to tests/artifacts/."""
import os
import time

import pytest

from tests.conftest import ARTIFACTS, Watched
from tests.support.pages import pages_fit

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
        assert page.evaluate("document.documentElement.scrollWidth <= 390"), \
            "the page scrolls sideways on a phone"
        menu = page.locator("#menu")
        assert menu.is_visible()
        assert not page.locator(".toc a").first.is_visible() or \
            page.evaluate("document.querySelector('.sidebar').getBoundingClientRect().right <= 0")
        page.screenshot(path=os.path.join(ARTIFACTS, "lecture_phone.png"))
        # wide content (four rank columns) scrolls inside its box, not the page
        page.locator("#collectives-on-1-2-and-4-ranks .demo").last.scroll_into_view_if_needed()
        page.screenshot(path=os.path.join(ARTIFACTS, "lecture_phone_ranks.png"))
        assert page.evaluate("document.documentElement.scrollWidth <= 390")

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
    png = open(os.path.join(os.path.dirname(__file__), "support", "fixture_image.png"), "rb").read()
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

def test_the_fixture_page_hides_nothing_at_1280_and_fits_a_phone(browser, fixture_site):
    """The same checks every lecture page gets in test_first_read, on the fixture's tracebacks."""
    pages_fit(browser, fixture_site, "fixture_lecture", expect_tracebacks=True)
