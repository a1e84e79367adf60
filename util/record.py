"""Recording: everything a lecture says or shows becomes a plain, JSON-ready record.

A record is a dict with at least:

    kind     one of note, image, figure, table, widget, code, link, output, error, span, demo
    source   {"file", "line", "function", "key"}: where in the lecture code it was made
    rank     the rank that made it (None for the lecture's own process)
    t        seconds since the recorder started

`key` names an entry of the recorder's `functions` table, which keeps the source of every
function that produced a record, so a page can show the code beside what it produced.
The file that wraps these records (the recording) is documented in `util/recording.py`.
"""
import contextlib
import inspect
import io
import os
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_UTIL = os.path.dirname(os.path.abspath(__file__))
# The recorder's own clock: when a record was made is not a number a demo computed (a demo
# that reads time.* itself is marked as timed, util/ranks.py).
_clock = time.perf_counter
_LECTURES = (os.path.join(ROOT, "lectures") + os.sep, os.path.join(ROOT, "tests") + os.sep)
_SKIP = (_UTIL + os.sep, os.path.abspath(contextlib.__file__))


def relpath(path):
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


class Recorder:
    """Collects records. One lives in the lecture process; each rank gets its own per demo."""

    def __init__(self, rank=None):
        self.rank = rank
        self.records = []
        self._functions, self._codes = {}, {}   # see remember() and functions
        self.demo_names = None  # a build sets a set() here: demo names must then be unique
        self.exercises = []     # [{"name", "title"}]: the page's "Try it yourself" box (try_it_yourself)
        self.t0 = _clock()

    def add(self, kind, source=None, **content):
        rec = {"kind": kind, **content, "source": source or self._where(), "rank": self.rank,
               "t": round(_clock() - self.t0, 6)}
        self.records.append(rec)
        self.show(rec)
        return rec

    def show(self, rec):
        """Hook for live display (the notebook recorder overrides it)."""

    def _where(self):
        # The first frame outside util/ is the lecture code that asked for the record.
        frame = sys._getframe(1)
        while frame and os.path.abspath(frame.f_code.co_filename).startswith(_SKIP):
            frame = frame.f_back
        if frame is None:
            return None
        code = frame.f_code
        where = {"file": relpath(code.co_filename), "line": frame.f_lineno, "function": code.co_name,
                 "key": self.remember(code) if code.co_name != "<module>" else None}
        section = _section(frame)
        if section:
            where["section"] = section
        return where

    def remember(self, code):
        """Note the function with this code object for `functions`; returns its key. Its source
        is read later, when `functions` is asked for: reading it costs milliseconds, which would
        otherwise land inside the first timed span of every demo."""
        key = f"{relpath(code.co_filename)}:{code.co_firstlineno}:{code.co_name}"
        if key not in self._functions:
            self._codes.setdefault(key, code)
        return key

    @property
    def functions(self):
        """key -> {file, name, start, code} of every function that made a record (those whose
        source cannot be read are left out; a record's key then points nowhere, harmlessly)."""
        while self._codes:
            key, code = self._codes.popitem()
            try:
                lines, start = inspect.getsourcelines(code)
            except (OSError, TypeError):
                continue
            self._functions[key] = {"file": relpath(code.co_filename), "name": code.co_name,
                                    "start": start, "code": "".join(lines)}
        return self._functions

    def absorb(self, functions):
        self._functions.update(functions)


_current = Recorder()


def _section(frame):
    """The lecture section a record was made in: the function that the lecture's main() called
    (so a test can tell that every section recorded something, whichever helper made the record)."""
    while frame is not None and frame.f_back is not None:
        caller = frame.f_back.f_code
        if caller.co_name == "main" and os.path.abspath(caller.co_filename).startswith(_LECTURES):
            return frame.f_code.co_name
        frame = frame.f_back
    return None


def current():
    return _current


def use(recorder):
    """Make `recorder` the one that note(), table(), ... write to; returns the previous one."""
    global _current
    previous, _current = _current, recorder
    return previous


# --- the narration API -------------------------------------------------------------------

def note(markdown):
    """Markdown narration. `## Heading` lines start page sections; $...$ is LaTeX math."""
    _current.add("note", text=textwrap.dedent(markdown).strip())


def image(path_or_url, caption="", width=None):
    """A picture: local files are copied beside the page; a URL degrades to a link offline."""
    if not str(path_or_url).startswith(("http://", "https://")):
        path = os.path.abspath(path_or_url)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"image(): no such file {path_or_url!r}")
        path_or_url = path
    _current.add("image", src=str(path_or_url), caption=caption, width=width)


PHONE_INCHES = 5.0  # a phone's figure: drawn this wide, its 10 pt text is ~10 px at 390 px


def _svg(fig):
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    return buf.getvalue()


def _phone_svg(fig):
    """The same figure drawn narrower, so that on a phone its text is not shrunk to a few pixels
    (the page shows it below 600 px; "full size" still opens the wide one). Fonts keep their
    point sizes, so they grow relative to the plot."""
    import warnings
    from matplotlib.transforms import IdentityTransform
    w, h = fig.get_size_inches()
    axes = [ax for ax in fig.axes if ax.get_visible()]
    columns = len({round(ax.get_position().x0, 2) for ax in axes})
    # Only plain charts: one column of panels with their axes drawn and legends inside them.
    # Side-by-side panels, diagrams (text placed in data coordinates) and legends outside the
    # axes keep their width, and would run into each other or be cut when narrowed.
    # A legend marked to hang under its axes (a timeline's) narrows with them and stays whole.
    legend_outside = fig.legends or any(ax.get_legend() is not None and ax.get_legend()._bbox_to_anchor is not None
                                        and not _hangs(ax.get_legend()) for ax in axes)
    if w <= PHONE_INCHES * 1.05 or columns > 1 or not all(ax.axison for ax in axes) or legend_outside:
        return None
    hanging = []
    for ax in axes:     # a hanging legend: one entry per line, so it is no wider than the phone
        legend = ax.get_legend()
        if legend is not None and _hangs(legend) and legend._ncols > 1:
            texts = [t.get_text() for t in legend.get_texts()]
            # the same anchor, live (in display units: it follows the axes when the figure is resized)
            hanging.append(ax.legend(handles=legend.legend_handles, labels=texts, loc="upper center",
                                     bbox_to_anchor=legend.get_bbox_to_anchor(), bbox_transform=IdentityTransform(),
                                     ncol=1, frameon=False))
            hanging[-1].set_in_layout(False)    # re-fitting the labels must not squeeze the axes
    f = max(PHONE_INCHES / w, 0.5)
    # under a hanging legend the bars keep their full height; the legend hangs below them, a
    # fixed distance under the axes, and the saved drawing grows to hold it (bbox "tight")
    fig.set_size_inches(w * f, h if hanging else h * max(f, 0.75))
    if fig.get_layout_engine() is None:     # re-fit labels to the smaller canvas
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fig.tight_layout()
    for legend in hanging:      # ... but the saved drawing holds it whole
        legend.set_in_layout(True)
    return _svg(fig)


HANGING = "legend-under-the-axes"    # the gid of a legend drawn to be narrowed with its axes


def _hangs(legend):
    """Whether a legend was drawn to hang under its axes and narrow with them (`util.figures.
    timeline` marks its legend so); other legends outside their axes keep the figure's width,
    where narrowing would cut them or run tick labels together."""
    return legend.get_gid() == HANGING


def figure(fig, caption=""):
    """A matplotlib figure, kept as SVG text (the renderer writes it beside the page), and a
    narrower drawing of it for phones."""
    import matplotlib
    import matplotlib.pyplot as plt
    matplotlib.rcParams["svg.hashsalt"] = "course"  # stable ids: rebuilding changes nothing
    svg = _svg(fig)
    phone = _phone_svg(fig)
    plt.close(fig)
    _current.add("figure", svg=svg, caption=caption, **({"phone_svg": phone} if phone else {}))


def widget(name, data, caption=""):
    """An interactive figure drawn in the page by util/static/widgets.js from `data` (JSON-ready).
    Without JavaScript it stays hidden: put the static figure that tells the same story beside it."""
    import json
    json.dumps(data, allow_nan=False)   # refuse what JSON cannot carry (inf, NaN, objects) here, loudly
    _current.add("widget", name=name, data=data, caption=caption)


def _plain(x):
    """Numbers from numpy/torch become Python numbers so they serialize and format alike."""
    if hasattr(x, "item") and getattr(x, "ndim", 0) == 0:
        return x.item()
    return x if isinstance(x, (int, float, str, bool, type(None))) else str(x)


def table(rows, header=None, caption=""):
    """A table of results; numbers stay numbers in the recording and are formatted on the page."""
    rows = [[_plain(v) for v in row] for row in rows]
    _current.add("table", header=list(header) if header else None, rows=rows, caption=caption)


def see(obj, title=None, *, lesson=False):
    """Show a function's or class's source (with file and line), or cite a URL.

    A listing is folded behind "show code" on the page unless `lesson=True`: keep that for the
    few lines whose code *is* the lesson (the f/g operators, a ring's step), after a picture."""
    if isinstance(obj, str):
        _current.add("link", url=obj, title=title or obj)
        return
    obj = inspect.unwrap(obj)
    lines, start = inspect.getsourcelines(obj)
    _current.add("code", name=getattr(obj, "__qualname__", str(obj)),
                 file=relpath(inspect.getsourcefile(obj)), start=start, code="".join(lines),
                 lesson=bool(lesson))


@contextlib.contextmanager
def deep_dive(title, teaser):
    """Sections recorded inside go to the lecture's appendix page; the main path keeps a one-line
    pointer (`teaser`: what the reader finds there) at this spot. The narration is unchanged:

        with deep_dive("Dropout under tensor parallelism", "why masks must agree on copies"):
            dropout_and_random_numbers()
    """
    _current.add("deep_dive", edge="begin", title=title, teaser=teaser)
    try:
        yield
    finally:
        _current.add("deep_dive", edge="end", title=title)


def try_it_yourself(listing):
    """The lecture's notebook exercises, [(name, title)] in the notebook's order, for its page's
    "Try it yourself" box. The lecture hands them over (the engine imports no course package)."""
    _current.exercises = [{"name": name, "title": title} for name, title in listing]


def cheat(topic, formula, value, unit="", *, what=""):
    """An entry of the course's cheatsheet: a formula the lecture teaches (Markdown with $math$)
    beside the value this run measured for it. It links back to the section it was recorded in.
    `value` must be a number this run produced (it is shown on the lecture page as well)."""
    value = _plain(value)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"cheat(): the measured value must be a number, got {value!r}")
    _current.add("cheat", topic=topic, formula=formula, value=value, unit=unit, what=what)


def published(text, url, cite):
    """A figure published on GPUs, shown beside a measurement this CPU cannot make pay off; the
    page marks it as not measured here. `text` says what was reported (Markdown), `cite` names
    the paper or post (authors, year, title) at `url`."""
    _current.add("published", text=textwrap.dedent(text).strip(), url=url, cite=cite)


def rank_list(ranks):
    """'rank 2', 'ranks 0, 1 and 3' (never 'rank(s) [0, 1, 3]')."""
    ranks = sorted(r for r in ranks if isinstance(r, int))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}" if ranks else "a rank"


def plural(n, word, many=None):
    """'1 head', '3 heads', '2 all-reduces' (`many` for irregular plurals): never 'head(s)'."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


@contextlib.contextmanager
def span(label):
    """Time a block on this rank; a demo's spans become its timeline (see util.figures)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        span_at(label, start, time.perf_counter())


def span_at(label, start, end):
    """A span measured by other means (time.perf_counter() values), e.g. an async collective
    from its launch to the callback that saw it complete."""
    _current.add("span", label=label, start=start, end=end)


@contextlib.contextmanager
def quiet():
    """Records made inside are dropped: warm-up and timing loops leave nothing on the page."""
    previous = use(Recorder(_current.rank))
    try:
        yield
    finally:
        use(previous)
