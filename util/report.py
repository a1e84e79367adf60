"""What the terminal (and a notebook) says about demos: a status line per demo, and a short
readable description of what a rank returned."""
import sys

from util.ranks import settings

STATUS_WORDS = {"ok": "ok", "failed": "FAILED", "expected_failure": "failed, as expected",
                "skipped": "skipped"}  # how a demo ended, as the terminal and notebooks say it
NAME_WIDTH = 46                 # the demo-name column of the terminal's status lines


def status_line(run, traceback_text, number):
    """`  demo  12  name ...  ranks=4   0.31 s  ok`; a failure's traceback follows its line
    (an expected failure's only with --verbose: it is the lesson, not a crash)."""
    shown = run.name if len(run.name) <= NAME_WIDTH else run.name[:NAME_WIDTH - 1] + "…"
    print(f"  demo {number:>3}  {shown:<{NAME_WIDTH}}  ranks={run.world_size:<2} "
          f"{run.elapsed:7.2f} s  {STATUS_WORDS[run.status]}", file=sys.stderr, flush=True)
    if run.status == "skipped":
        print(f"           {run.error}", file=sys.stderr, flush=True)
    elif run.status == "failed" or (run.status == "expected_failure" and settings.verbose):
        print("\n".join("           " + line for line in run.error.splitlines()),
              file=sys.stderr, flush=True)
        if traceback_text:
            print(traceback_text, file=sys.stderr, flush=True)


def summarize(value, limit=160):
    """A short, readable description of what a rank returned (the page shows it)."""
    if value is None:
        return None
    if isinstance(value, (bool, int, float)):
        return repr(value)
    name = type(value).__name__
    if hasattr(value, "shape") and hasattr(value, "dtype"):     # a torch tensor, a numpy array or scalar
        size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", 1)
        return f"{name}{tuple(value.shape)} {value.dtype}" if size > 8 else repr(value)
    if isinstance(value, dict):
        keys = ", ".join(str(k) for k in value)
        text = f"dict with keys: {keys}"
    elif isinstance(value, (list, tuple)) and not all(isinstance(v, (bool, int, float, str)) for v in value):
        text = f"{name} of {len(value)}: " + ", ".join(summarize(v, 40) or "None" for v in value[:4]) \
            + (", …" if len(value) > 4 else "")
    else:
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"
