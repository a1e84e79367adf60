"""The data behind lecture 05's schedule explorer: the action lists `make_schedule` produces for a
grid of (schedule, p, m, chunks), as compact text, each with its paper's bubble formula, or the
reason there is no closed form for it here.

The page's JavaScript (util/static/widgets.js) holds only a port of `simulate` and of
`formula_bubble`; the schedules it simulates are these lists, so what a student explores is
exactly what the executor runs, and the formula beside it is checked against the simulator."""
from lectures.pipeline.simulate import simulate, theory_bubble
from lectures.pipeline.schedules import SCHEDULES, make_schedule

GRID_P = (2, 3, 4, 6, 8)
GRID_M = (1, 2, 3, 4, 5, 6, 8, 12, 16)   # m below p, m not a multiple of p: the cases the page discusses
GRID_CHUNKS = (1, 2)


# The published bubble of each schedule, as the explorer states it beside the timeline. The
# textbook fractions hold at any F, B, W once sends are free; Qi et al.'s ZB-H1 idle time per rank
# is evaluated at the explorer's costs ("idle": coefficients of F, B, W, times p − 1).
PAPERS = {
    "naive": {"text": "1 − 1/p", "source": "one stage busy at a time"},
    "gpipe": {"text": "(p−1)/(m+p−1)", "source": "Huang et al. 2019"},
    "1f1b": {"text": "(p−1)/(v·m+p−1)", "source": "Narayanan et al. 2021"},
    "interleaved-1f1b": {"text": "(p−1)/(v·m+p−1)", "source": "Narayanan et al. 2021"},
    "zb-h1": {"text": "(p−1)(F+B−W) idle per rank", "source": "Qi et al. 2023, Table 2", "idle": [1, 1, -1]},
}
ASSUMES = {"fraction": "free sends", "idle": "m ≥ p, W ≤ F, W ≤ B and free sends"}
NO_CLOSED_FORM = {   # why the explorer shows "no closed form here" for these
    "zb-h2": "Qi et al.'s (p−1)(F+B−2W) is a step's idle time once steps run back to back, not one step's",
    "zb-v": "Qi et al. give none; at F = B = W only the V's head of p−1 half-stage forwards is left",
    "dualpipev": "DeepSeek's (S/2−1)(F&B+B−3W) counts each F&B pair as one unit; this list runs the two in turn",
}


def paper_formula(name, p, m, v):
    """The explorer's formula for (name, p, m, v): {"text", "source", "assumes", and "fraction"
    (a number) or "idle" (coefficients)}; or None where there is no closed form here."""
    paper = PAPERS.get(name)
    if paper is None:
        return None
    if "idle" in paper:
        return dict(paper, assumes=ASSUMES["idle"]) if m >= p and v == 1 else None
    theory = theory_bubble(name, p, m, v)
    return None if theory is None else dict(paper, fraction=theory, assumes=ASSUMES["fraction"])


def no_closed_form_reason(name, p, m, v):
    """Why `paper_formula` gives nothing for these sizes, in words."""
    if name in NO_CLOSED_FORM:
        return NO_CLOSED_FORM[name]
    paper = PAPERS[name]
    one_chunk = paper_formula(name, p, max(m, p), v) is None      # m ≥ p would not help
    return f"{paper['text']} ({paper['source']}) " + ("is for one chunk per rank" if one_chunk else "assumes m ≥ p")


def formula_bubble(formula, p, m, cost):
    """The bubble fraction `formula` states at these per-stage costs ({"F", "B", "W", "send"}),
    or None where its assumptions do not hold (a send that costs time; for Qi et al.'s idle time,
    W above F or B). widgets.js has the same function, line for line."""
    if formula is None or cost.get("send", 0) != 0:
        return None
    if "fraction" in formula:
        return formula["fraction"]
    F, B, W = cost["F"], cost["B"], cost.get("W", 0)
    if W > F or W > B:
        return None
    a, b, c = formula["idle"]
    idle = (p - 1) * (a * F + b * B + c * W)
    work = m * (F + B + W)
    return idle / (work + idle) if work + idle > 0 else 0.0


def explorer_entries(names=SCHEDULES, ps=GRID_P, ms=GRID_M, chunks=GRID_CHUNKS):
    """One dict per (name, p, m, chunks) that make_schedule accepts and that runs: the rank's
    actions as "F0 F1 B0 ..." strings (Action's own text: kind, micro-batch, .chunk), the paper's
    formula (or None, and why)."""
    out = []
    for name in names:
        for p in ps:
            for m in ms:
                for v in chunks:
                    try:
                        sched = make_schedule(name, p, m, v)
                        simulate(sched, {"F": 1, "B": 1, "W": 0})   # a list that deadlocks is left out
                    except ValueError:
                        continue
                    formula = paper_formula(name, p, m, v)
                    out.append({"name": name, "p": p, "m": m, "chunks": v, "style": sched.layout.style,
                                "ranks": [" ".join(str(a) for a in acts) for acts in sched],
                                "formula": formula,
                                "why": None if formula else no_closed_form_reason(name, p, m, v)})
    return out


def explorer_data(initial=("1f1b", 4, 8, 1), cost=None):
    """The widget's JSON: every grid entry, the costs it starts with (per stage, as the page's
    tables: F = B = W = 1, free sends; a rank with v chunks runs each chunk's action in 1/v),
    the schedule it shows first."""
    name, p, m, v = initial
    return {"schedules": explorer_entries(), "cost": cost or {"F": 1.0, "B": 1.0, "W": 1.0, "send": 0.0},
            "initial": {"name": name, "p": p, "m": m, "chunks": v}}
