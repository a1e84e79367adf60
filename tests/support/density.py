"""How many measured numbers a sentence of a page's main path carries (issue 43: at most two;
the spread goes to the tables, figures and hovers).

A number counts when it reads as a measurement: it has a unit of time, rate, size, ratio or
share (ms, GB/s, MB, ×, %, ...), or decimals, thousands separators, an exponent or a sign.
Every interquartile range in the prose ("IQR 389–402") counts as one more. A number does not
count when it names a thing ("Llama 3.1": no unit, a capitalised word just before it; a model's
size, "1.7B"), when it is a size the run was given ("a 4 MB bucket", "at 64 MB", "one 400 Gb/s port"),
and a range ("74–90 ms") counts once. Sentences end at '.', '!' or '?'; code, math (formulas),
hover details and published figures quoted in their own boxes are not counted."""
import re

from bs4 import BeautifulSoup

MAX_PER_SENTENCE = 2
_SIZES = r"KB|kB|MB|GB|TB|KiB|MiB|GiB|bytes|Gb/s"
_UNIT = (r"(?:\s?(?:ms|µs|ns|s|min|TFLOP/s|PFLOP/s|GFLOP/s|GB/s|MB/s|GiB/s|TB/s|tokens/s|" + _SIZES
         + r")(?![\w/])|×|%)")
# a sign only where it cannot be a hyphen ("-8.8%" after a space, never "ZeRO-3")
_NUMBER = re.compile(r"(?<![\w.^§/\-−])((?:[-−+](?=\d))?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)(" + _UNIT + r")?")
_GIVEN = re.compile(r"\b(?:at|a|an|one|each|per|every)\s$")
_NAME = re.compile(r"[A-Z][\w.-]*\s$")
_IQR = re.compile(r"IQR\s*[-−]?\d[\d.,]*\s*[–-]\s*[-−]?\d[\d.,]*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"“*])")


def measured_numbers(sentence):
    """The numbers in one sentence that read as measurements."""
    spreads = [m.group(0) for m in _IQR.finditer(sentence)]
    sentence = _IQR.sub("IQR", sentence)
    found = []
    for m in _NUMBER.finditer(sentence):
        digits, unit = m.group(1), m.group(2)
        if not unit and not re.search(r"[.,e]|^[-−+]", digits.rstrip(".,")):
            continue                              # a count or a size: "4 ranks", "v = 32768"
        if digits.endswith(","):
            continue                              # "at 1, 2 and 4 ranks"
        if re.match(r"[BMTK]\b", sentence[m.end():]):
            continue                              # a model's size: "1.7B", "1T"
        before = sentence[:m.start()][-30:]
        given = unit and re.fullmatch(r"\s?(?:" + _SIZES + ")", unit) and _GIVEN.search(before)
        if given or (not unit and _NAME.search(before)):
            continue
        found.append((m.group(0), m.end()))
    # a range counts once: "1.7–3.9 ms" is found as "1.7" and "3.9 ms"
    out, last_end = [], -2
    for text, end in found:
        start = end - len(text)
        if out and sentence[last_end:start] in ("–", "-", "−"):
            last_end = end
            continue
        out.append(text)
        last_end = end
    return out + spreads


def sentences(text):
    return [s for s in _SENTENCE_END.split(re.sub(r"\s+", " ", text)) if s.strip()]


def main_path_prose(html):
    """The visible prose of a page's main path: each note's paragraphs and list items (a list
    item without the lists nested in it), outside folded blocks, code, math and hover details."""
    soup = BeautifulSoup(html, "html.parser")
    for el in soup.select("pre, figure, table, details"):
        el.decompose()
    for el in soup.select("code, math"):
        el.replace_with("Code")       # a word, not its numbers: a sentence may start with one
    for note in soup.select("main div.note"):
        for el in note.find_all(["p", "li"]):
            if el.find("p"):
                continue                          # its paragraphs are read one by one
            yield "".join(c.get_text(" ") if hasattr(c, "get_text") else str(c)
                          for c in el.children if getattr(c, "name", None) not in ("ul", "ol"))


def dense_sentences(html, limit=MAX_PER_SENTENCE):
    """[(numbers, sentence)] for every sentence of the main path with more than `limit`."""
    return [(nums, s) for para in main_path_prose(html) for s in sentences(para)
            if len(nums := measured_numbers(s)) > limit]
