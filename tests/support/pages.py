"""Checks of a built page in a real browser, shared by the page tests."""
import os

from tests.conftest import ARTIFACTS, Watched


def _url(path):
    return "file://" + os.path.abspath(path)


# `screen` is the width the page was opened at: a phone's browser widens its layout viewport
# (innerWidth) to content that overflows and zooms out, so innerWidth alone cannot tell.
LAYOUT_CHECKS = """(screen) => {
  const innerWidth = Math.min(window.innerWidth, screen);
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
    found = page.evaluate(LAYOUT_CHECKS, width)
    assert not found["pageScrolls"], f"{name} scrolls sideways at {width} px"
    assert not found["unscrolled"], f"{name} at {width} px: wider than the screen, no scroll box: {found['unscrolled']}"
    assert not found["unlinked"], f"{name}: figures without a full-size link: {found['unlinked']}"
    assert not found["filler"], f"{name}: demo boxes with filler text: {found['filler']}"
    assert all(w == "live" for w in found["widgets"]), f"{name}: interactive figures that did not start: {found['widgets']}"
    return found


def check_page(page, name, width, expect_tracebacks=False):
    """A loaded page hides nothing at `width`: the layout checks, no code listing or table that
    needs sideways scrolling at 1280 px, and a rank's full error text that opens on demand."""
    found = check_layout(page, name, width)
    if width >= 1280:
        assert not found["codeOrTable"], f"{name}: needs sideways scrolling at 1280 px: {found['codeOrTable']}"
    if expect_tracebacks:
        assert found["tracebacks"] > 0
    if found["tracebacks"]:
        box = page.locator(".demo details.traceback").first
        assert not box.locator("pre").nth(1).is_visible()
        box.locator("summary").click()
        full = box.locator("pre").nth(1)
        assert full.is_visible() and full.inner_text().count("\n") >= 1
    return found


def pages_fit(browser, folder, name, expect_tracebacks=False):
    """Open `name`'s page at 1280x800 and as a 390-px phone, check each, and take a screenshot."""
    os.makedirs(ARTIFACTS, exist_ok=True)
    for width, height, phone in ((1280, 800, False), (390, 844, True)):
        extra = {"device_scale_factor": 2, "is_mobile": True, "has_touch": True} if phone else {}
        w = Watched(browser, viewport={"width": width, "height": height}, reduced_motion="reduce", **extra)
        try:
            w.page.goto(_url(folder / f"{name}.html"))
            w.page.wait_for_load_state("load")
            w.page.screenshot(path=os.path.join(ARTIFACTS, f"{name}_{width}.png"))
            check_page(w.page, name, width, expect_tracebacks)
            w.check_clean()
        finally:
            w.close()
