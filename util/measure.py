"""Measuring honestly on a small machine: repeated timings with their spread, rank counts that
fit the cores, and bytes actually written to the network.

    from util.measure import measure, timing_ranks, machine, bytes_sent

    ranks = timing_ranks(4)                 # at most the cores this process may run on
    t = measure(lambda: dist.all_reduce(x), warmup=2, repeats=9)
    t.median, t.q1, t.q3                    # seconds; t.ms() -> "1.23 ms (IQR 1.10–1.41)"
    t.brief()                               # "1.23 ms" for a sentence, the spread on hover
    with bytes_sent() as sent:              # bytes this process handed to write()/writev()
        dist.all_reduce(x)
    sent.bytes

Inside a process group (a demo's rank), `measure` lines the ranks up with a barrier before each
repeat and keeps the slowest rank's time, so every rank returns the same `Timing`: a collective
is finished when its last rank is.
"""
import contextlib
import dataclasses
import os
import re
import statistics
import time


def usable_cores():
    """CPU cores this process may run on (the affinity mask, which containers and taskset set;
    os.cpu_count() would count the whole host)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def timing_ranks(wanted=4, minimum=2):
    """How many ranks a timing demo should use: `wanted`, but no more than the usable cores, so
    it measures the algorithm rather than the operating system time-slicing ranks on a core.
    Never below `minimum` (a collective needs two ranks; `oversubscribed` then says so)."""
    return max(minimum, min(wanted, usable_cores()))


def oversubscribed(ranks):
    return ranks > usable_cores()


def machine(ranks=None):
    """What a sentence beside a measurement says about where it ran. The page's header names the
    machine once (util/render.about_numbers); here only what differs per measurement: how many
    ranks, and whether they had to take turns on too few cores."""
    import torch
    if ranks is None:
        return "one process"
    text = f"{ranks} rank{'s' if ranks != 1 else ''}"
    if oversubscribed(ranks) and not torch.cuda.is_available():
        cores = usable_cores()
        text += (f", taking turns on {cores} core{'s' if cores != 1 else ''} (times include the "
                 "operating system switching between them)")
    return text


@dataclasses.dataclass
class Timing:
    """Repeated measurements of one thing, in seconds."""
    samples: list

    @property
    def median(self):
        return statistics.median(self.samples)

    @property
    def q1(self):
        return self._quantiles()[0]

    @property
    def q3(self):
        return self._quantiles()[2]

    @property
    def min(self):
        return min(self.samples)

    @property
    def max(self):
        return max(self.samples)

    @property
    def spread(self):
        """The interquartile range, q3 − q1 (seconds)."""
        return self.q3 - self.q1

    def _quantiles(self):
        if len(self.samples) < 2:
            return [self.samples[0]] * 3
        return statistics.quantiles(self.samples, n=4, method="inclusive")

    def ms(self, digits=3):
        """"1.23 ms (IQR 1.10–1.41)", for tables: more digits where the quartiles would print
        alike, and "IQR 0" where they are equal, never "279–279"."""
        median, q1, q3 = self._ms_parts(digits)
        return f"{median} ms (IQR {q1}–{q3})" if q1 != q3 else f"{median} ms (IQR 0)"

    def brief(self, digits=3):
        """The median alone, for a sentence: "1.23 ms", with the spread on hover (`with_spread`).
        A sentence on a page's main path carries at most two measured numbers."""
        median, q1, q3 = self._ms_parts(digits)
        spread = f"{q1}–{q3} ms" if q1 != q3 else "0"
        return with_spread(f"{median} ms", f"median of {len(self.samples)}; interquartile range {spread}")

    def _ms_parts(self, digits):
        for d in range(digits, digits + 4):
            f = lambda s: f"{s * 1e3:.{d}g}"
            if f(self.q1) != f(self.q3):
                return f(self.median), f(self.q1), f(self.q3)
        f = lambda s: f"{s * 1e3:.{digits}g}"
        return f(self.median), f(self.q1), f(self.q1)

    def __str__(self):
        return self.ms()


def value_range(lo, hi, unit="", decimals=1):
    """"23.8–26.6 GB/s": with as many more decimals as it takes (up to 3 more) for the two ends
    to read differently, and one number when they are equal, never "1.0–1.0"."""
    for d in range(decimals, decimals + 4):
        a, b = f"{lo:.{d}f}", f"{hi:.{d}f}"
        if a != b:
            return f"{a}–{b}{' ' + unit if unit else ''}"
    return f"{lo:.{decimals}f}{' ' + unit if unit else ''}"


def spreads_overlap(a, b):
    """Whether two timings' interquartile ranges overlap: then this machine cannot tell them apart."""
    return a.q1 <= b.q3 and b.q1 <= a.q3


def with_spread(text, detail):
    """Markdown for `text` with `detail` shown on hover, or on a tap on a phone (the renderer's
    `[text]{.spread title=...}` span): how a sentence keeps to its one or two numbers and still
    lets a reader check the spread."""
    if "]" in text or '"' in detail:
        raise ValueError(f"with_spread: no ']' in the text or '\"' in the detail ({text!r}, {detail!r})")
    return f'[{text}]{{.spread tabindex=0 title="{detail}"}}'


def spreads_in_brackets(markdown_text):
    """`with_spread`'s spans as plain text, the detail in brackets ("1.2 ms (q1-q3 ...)"), for
    a terminal or a notebook's text output. The page's renderer reads the spans itself."""
    return re.sub(r'\[([^\]]*)\]\{\.spread[^}]*title="([^"]*)"\}', r"\1 (\2)", markdown_text)


def compare(a, b, a_name="ours", b_name="theirs"):
    """The words a page uses for two timings (`Timing`s): "no measurable difference here" when
    their interquartile ranges overlap and their medians are close (a median 1.5× lower with
    overlapping spreads is said as such, never as a tie), otherwise which is faster and by how
    much (the ratio of medians). One number in the sentence; both timings, with their spreads,
    on hover. One function, so no sentence can contradict the table beside it."""
    fast, slow, fn, sn = (a, b, a_name, b_name) if a.median < b.median else (b, a, b_name, a_name)
    ranked = f"{fn} {fast.ms()}, {sn} {slow.ms()}"      # in the sentence's order
    ratio = slow.median / fast.median
    if spreads_overlap(a, b) and ratio >= 1.5:          # a wide spread, not a tie
        return f"{fn}'s median is {with_spread(f'{ratio:.2f}× lower', ranked)}, but the spreads overlap: no firm ranking"
    if spreads_overlap(a, b):
        both = f"{a_name} {a.ms()}, {b_name} {b.ms()}"
        return f"no {with_spread('measurable difference', both)} here (the interquartile ranges overlap)"
    return f"{fn} is {with_spread(f'{ratio:.2f}× faster', ranked)} than {sn}"


def _in_a_demo_group():
    """True on a rank of a demo (a process util's launchers started, inside its demo) while a
    process group is up. Outside a demo the timings are this process's alone, even where a group
    is alive: under torchrun rank 0 narrates in the process that holds the demos' group, and its
    own timings must not wait at a barrier for ranks that are not timing anything."""
    import torch.distributed as dist
    from util import record
    return record.current().rank is not None and dist.is_available() and dist.is_initialized()


def _slowest_rank(seconds, group):
    """Every rank gets the slowest rank's time (a no-op outside a demo's process group)."""
    import torch
    import torch.distributed as dist
    if not _in_a_demo_group():
        return seconds
    # NCCL reduces only tensors on this rank's GPU; gloo only CPU ones
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor([seconds], dtype=torch.float64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


# Set when this process timed something or counted bytes: what a demo then returns differs from
# run to run, and a comparison of two builds must not expect the same numbers.
used = False


def measure(fn, *, warmup=2, repeats=9, group=None, synchronize=True):
    """Time `fn()`: `warmup` untimed calls, then `repeats` timed ones. In a demo's process group
    each repeat starts after a barrier and counts the slowest rank. On a GPU, CUDA is synchronized
    before the clock stops (`synchronize`). Returns a `Timing`."""
    global used
    used = True
    import torch
    import torch.distributed as dist
    distributed = _in_a_demo_group()
    cuda = synchronize and torch.cuda.is_available() and torch.cuda.is_initialized()
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if distributed:
            dist.barrier(group=group)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(_slowest_rank(time.perf_counter() - start, group) if distributed
                       else time.perf_counter() - start)
    return Timing(samples)


def measure_side_by_side(fns, *, warmup=2, repeats=9, group=None):
    """Time several things against each other ({name: fn} -> {name: Timing}): after each one's
    warm-up, `repeats` rounds in which every fn runs once, the order rotating from round to
    round, so a noisy machine's drift hits them all alike instead of whichever ran last. Every
    rank must pass the same names in the same order (the rounds are collective)."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    samples = {name: [] for name in names}
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            samples[name] += measure(fns[name], warmup=0, repeats=1, group=group).samples
    return {name: Timing(v) for name, v in samples.items()}


def errorbar(ax, x, timings, scale=1e3, **kwargs):
    """Plot medians with interquartile error bars (times in ms by default)."""
    med = [t.median * scale for t in timings]
    low = [(t.median - t.q1) * scale for t in timings]
    high = [(t.q3 - t.median) * scale for t in timings]
    kwargs.setdefault("capsize", 3)
    return ax.errorbar(x, med, yerr=[low, high], **kwargs)


# --- bytes on the wire --------------------------------------------------------------------

def _written():
    """Bytes this process has passed to write()-family system calls (Linux /proc/self/io
    `wchar`); gloo's TCP transport sends with writev, so its traffic is counted here."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def can_count_bytes():
    try:
        _written()
        return True
    except (OSError, RuntimeError):
        return False


@dataclasses.dataclass
class Sent:
    bytes: int = None


@contextlib.contextmanager
def bytes_sent():
    """Count the bytes this process writes inside the block (all threads: gloo's I/O threads
    too). It counts every write, so keep files and printing out of the block; the overhead
    beyond the payload is the transport's own headers. `.bytes` stays None where the kernel
    does not provide the counter (not Linux)."""
    global used
    used = True
    sent = Sent()
    if not can_count_bytes():
        yield sent
        return
    before = _written()
    try:
        yield sent
    finally:
        sent.bytes = _written() - before
