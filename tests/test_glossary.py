"""The glossary: every term a page uses without explaining it links, at its first use on every
page (main path and appendix), to its entry on glossary.html; no page uses a term in its prose
before that link; the glossary page lists every term with the lecture that teaches it, and the
index and every lecture page link to it."""
import re

import pytest

from lectures import LECTURES
from tests.conftest import built
from util import glossary
from util.glossary import Linker

# Text under these is not prose a reader meets as a sentence: code, formulas, titles, the table
# of contents, table cells (numbers and labels), the build's own metadata.
NOT_PROSE = {"code", "pre", "math", "svg", "script", "style", "h1", "h2", "h3", "h4", "nav", "td", "th",
             "kbd", "summary", "title"}


def test_the_first_use_links_once_and_code_math_headings_and_links_are_left_alone():
    linker = Linker()
    html = linker.link("<h2>ZeRO</h2><p>Use <code>ZeRO</code>, see <a href='x'>ZeRO</a>, "
                       "<math><mi>ZeRO</mi></math>; ZeRO-2 shards; ZeRO again.</p>")
    assert html.count('class="term"') == 1
    assert '<a class="term" href="glossary.html#term-zero-stages-1-2-3-fsdp"' in html
    assert html.index('class="term"') > html.index("</math>")          # the prose's use, not the others
    assert ">ZeRO-2</a> shards" in html
    assert linker.link("<p>ZeRO once more</p>") == "<p>ZeRO once more</p>"  # linked once per page


def test_terms_match_whole_words_only():
    linker = Linker()
    assert linker.link("<p>DPO, TPU, SPMD, ranked, micro-batching, pre-ZeRO</p>").count("term") == 0
    assert linker.link("<p>the ranks, two micro-batches, DDP's hooks</p>").count('class="term"') == 3


def test_the_hover_text_is_the_definition_escaped():
    html = Linker().link("<p>an all-to-all</p>")
    assert 'title="Every rank sends a different piece' in html and "<a class=\"term\"" in html


def test_every_entry_names_a_lecture_that_teaches_it_and_matches_its_own_name():
    terms = glossary.load()
    assert len({t.id for t in terms}) == len(terms)
    for t in terms:
        assert t.taught in LECTURES, (t.term, t.taught)
        names = [n for n in re.split(r",\s*|\s*\(|\)", t.term) if n]
        assert any(t.pattern.search(n) for n in names), f"{t.term!r}: its patterns match none of its names"
        assert len(t.means) > 60, f"{t.term!r}: a definition of a few words explains nothing"


def prose_uses(html_text):
    """[(text node, the <a class=term> around it or None)] of the page's prose, in reading order."""
    from bs4 import BeautifulSoup
    soup = BeautifulSoup(html_text, "html.parser")
    main = soup.find("main")
    for node in main.find_all(string=True):
        names = {p.name for p in node.parents}
        classes = {c for p in node.parents if p.name for c in (p.get("class") or [])}
        if names & NOT_PROSE or classes & {"build-meta", "code"}:     # metadata, code listings
            continue
        link = next((p for p in node.parents if p.name == "a"), None)
        if link is not None and "term" not in (link.get("class") or []):
            continue                                # another link's text: a title, not a use
        yield str(node), link


@pytest.mark.parametrize("name", LECTURES)
def test_no_page_uses_a_term_before_it_links_to_the_glossary(course_site, name):
    folder = built(course_site, name)
    pages = [folder / f"{name}.html"] + ([folder / f"{name}_appendix.html"]
                                         if (folder / f"{name}_appendix.html").exists() else [])
    used = set()
    for path in pages:
        first = {}
        for text, link in prose_uses(path.read_text()):
            for t in glossary.load():
                if t.id not in first and t.pattern.search(text):
                    first[t.id] = (text, link)
        for tid, (text, link) in first.items():
            assert link is not None and link["href"].endswith(f"glossary.html#{tid}"), (
                f"{path.name}: '{text.strip()[:80]}' uses {tid} before any link to the glossary")
        used |= set(first)
    assert used, f"{name} uses none of the glossary's terms"


def test_the_glossary_page_lists_every_term_and_the_pages_link_to_it(course_site):
    folder = built(course_site, LECTURES[-1])
    page = (folder / "glossary.html").read_text()
    for t in glossary.load():
        assert f'id="{t.id}"' in page, t.term
    assert 'href="glossary.html"' in (folder / "index.html").read_text()
    for name in LECTURES:
        if (folder / f"{name}.html").exists():
            assert 'href="glossary.html"' in (folder / f"{name}.html").read_text(), name
    # every term is used somewhere: the glossary carries no word the course never says
    text = " ".join((folder / f"{n}.html").read_text() for n in LECTURES if (folder / f"{n}.html").exists())
    unused = [t.term for t in glossary.load() if f"glossary.html#{t.id}" not in text]
    assert not unused, unused
