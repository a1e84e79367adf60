"""The data behind lecture 05's schedule explorer: the action lists `make_schedule` produces for a
grid of (schedule, p, m, chunks), as compact text, with each one's textbook bubble.

The page's JavaScript (util/static/widgets.js) holds only a port of `simulate`; the schedules it
simulates are these lists, so what a student explores is exactly what the executor runs."""
from lectures.schedule_sim import simulate, theory_bubble
from lectures.schedules import SCHEDULES, make_schedule

GRID_P = (2, 3, 4, 6, 8)
GRID_M = (1, 2, 3, 4, 5, 6, 8, 12, 16)   # m below p, m not a multiple of p: the cases the page discusses
GRID_CHUNKS = (1, 2)


# The textbook bubbles theory_bubble evaluates (W = 0, free sends, equal F and B per stage).
FORMULAS = {"naive": "1 − 1/p", "gpipe": "(p−1)/(m+p−1)", "1f1b": "(p−1)/(v·m+p−1)",
            "interleaved-1f1b": "(p−1)/(v·m+p−1)"}


def explorer_entries(names=SCHEDULES, ps=GRID_P, ms=GRID_M, chunks=GRID_CHUNKS):
    """One dict per (name, p, m, chunks) that make_schedule accepts and that runs: the rank's
    actions as "F0 F1 B0 ..." strings (Action's own text: kind, micro-batch, .chunk)."""
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
                    theory = theory_bubble(name, p, m, v)
                    out.append({"name": name, "p": p, "m": m, "chunks": v, "style": sched.layout.style,
                                "ranks": [" ".join(str(a) for a in acts) for acts in sched],
                                "theory": theory, "formula": FORMULAS.get(name) if theory is not None else None})
    return out


def explorer_data(initial=("1f1b", 4, 8, 1), cost=None):
    """The widget's JSON: every grid entry, the costs it starts with (per stage, as the page's
    tables: F = B = W = 1, free sends; a rank with v chunks runs each chunk's action in 1/v),
    the schedule it shows first."""
    name, p, m, v = initial
    return {"schedules": explorer_entries(), "cost": cost or {"F": 1.0, "B": 1.0, "W": 1.0, "send": 0.0},
            "initial": {"name": name, "p": p, "m": m, "chunks": v}}
