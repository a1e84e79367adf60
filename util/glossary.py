"""The glossary (lectures/glossary.yaml): its entries, and the links from each term's first use
on a page to its entry.

    terms = load()                       # [Term], in the glossary's order
    linker = Linker(terms)               # one per page: it remembers what it has linked
    html = linker.link(html)             # the first use of each term in this fragment, linked

The renderer passes every piece of prose (notes, captions, published boxes) through its page's
linker in reading order, so the first use on the page is the one that links. Code, math,
headings and existing links are left alone.
"""
import dataclasses
import functools
import html as htmllib
import os
import re

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lectures", "glossary.yaml")
PAGE = "glossary.html"
# Text inside these elements is never linked: code is code, a link is already a link, MathML is
# a formula, a heading is a title.
_SKIP = {"code", "pre", "a", "math", "script", "style", "svg", "h1", "h2", "h3", "h4", "kbd"}
_TAG = re.compile(r"<(/?)([a-zA-Z][\w-]*)[^>]*?(/?)>")


@dataclasses.dataclass(frozen=True)
class Term:
    term: str
    id: str
    pattern: re.Pattern
    means: str
    taught: str


def _id(term):
    return "term-" + re.sub(r"[^a-z0-9]+", "-", term.lower()).strip("-")


@functools.lru_cache(maxsize=None)
def load(path=PATH):
    import yaml
    with open(path, encoding="utf-8") as f:
        entries = yaml.safe_load(f)
    terms = []
    for e in entries:
        alternatives = "|".join(f"(?:{m})" for m in e["match"])
        terms.append(Term(e["term"], _id(e["term"]), re.compile(rf"(?<![\w-])(?:{alternatives})(?![\w-])"),
                          " ".join(e["means"].split()), e["taught"]))
    return tuple(terms)


def _plain(markdown_text):
    """The definition as hover text: Markdown's emphasis and code marks dropped."""
    return re.sub(r"[*_`]", "", markdown_text)


class Linker:
    """Links each term's first use, once per page (`href` is where the glossary page is, seen
    from the page)."""

    def __init__(self, terms=None, href=PAGE):
        self.terms = load() if terms is None else terms
        self.href = href
        self.linked = set()

    def link(self, fragment):
        fragment = str(fragment)
        if len(self.linked) == len(self.terms):
            return fragment
        out, depth, pos = [], 0, 0
        for m in _TAG.finditer(fragment):
            out.append(self._text(fragment[pos:m.start()]) if depth == 0 else fragment[pos:m.start()])
            out.append(m.group(0))
            closing, name, selfclosing = m.group(1), m.group(2).lower(), m.group(3)
            if name in _SKIP and not selfclosing:
                depth += -1 if closing else 1
                depth = max(depth, 0)
            pos = m.end()
        out.append(self._text(fragment[pos:]) if depth == 0 else fragment[pos:])
        return "".join(out)

    def _text(self, text):
        """Link the first use of each term not linked yet in a run of text (HTML-escaped)."""
        out, pos = [], 0
        while text[pos:].strip() and len(self.linked) < len(self.terms):
            hits = [(m.start(), -m.end(), t) for t in self.terms if t.id not in self.linked
                    for m in [t.pattern.search(text, pos)] if m]
            if not hits:
                break
            start, end, t = min(hits, key=lambda h: h[:2])
            self.linked.add(t.id)
            title = htmllib.escape(_plain(t.means), quote=True)
            out += [text[pos:start], f'<a class="term" href="{self.href}#{t.id}" title="{title}">',
                    text[start:-end], "</a>"]
            pos = -end
        out.append(text[pos:])
        return "".join(out)
