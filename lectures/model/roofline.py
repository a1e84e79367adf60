"""What this machine does per second: matmul FLOP/s, copy bandwidth, element-wise rates, the
numbers of the roofline model (Williams, Waterman & Patterson 2009, "Roofline: an insightful
visual performance model"), attainable FLOP/s = min(peak, intensity × bandwidth).
"""
import contextlib

import torch

from util.measure import measure, measure_side_by_side


@contextlib.contextmanager
def threads(n):
    """Run a block with `n` intra-op threads. The demos use one: their tensors are small, and
    on a shared machine extra threads mostly wait for each other."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def matmul_rate(n, dtype=torch.float32, dev="cpu", repeats=7):
    """(FLOP/s, Timing) of an n×n by n×n matmul: 2n³ floating-point operations."""
    a, b = torch.randn(n, n, dtype=dtype, device=dev), torch.randn(n, n, dtype=dtype, device=dev)
    t = measure(lambda: a @ b, warmup=2, repeats=repeats)
    return 2 * n ** 3 / t.median, t


def largest_cache_bytes(cpu="/sys/devices/system/cpu/cpu0/cache"):
    """The size of this CPU's largest cache (its last level, usually L3) in bytes, read from
    Linux's sysfs (`index*/size`, such as "32768K"); None where the machine does not say."""
    import glob
    sizes = []
    for path in glob.glob(f"{cpu}/index*/size"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        unit = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if unit > 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


def copy_bytes_beyond_cache(cache_bytes=None, fallback=64 * 2 ** 20):
    """How many bytes to copy so that a copy measures memory, not cache: source and destination
    together at least 4× the largest cache (so each buffer 2×). Without a known cache size,
    `fallback` per buffer."""
    cache_bytes = largest_cache_bytes() if cache_bytes is None else cache_bytes
    if cache_bytes is None:
        return fallback
    if cache_bytes <= 0:
        raise ValueError(f"cache size must be positive, not {cache_bytes}")
    return 2 * cache_bytes


def copy_rate(nbytes, dev="cpu", repeats=7):
    """(bytes/s, Timing) of copying `nbytes` between two buffers: each byte is read and written."""
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=2, repeats=repeats)
    return 2 * nbytes / t.median, t


def elementwise_rate(n, op="add", dev="cpu", repeats=7):
    """(FLOP/s, Timing, FLOP per byte) of x + y (1 FLOP per 12 bytes moved in fp32) or
    GELU (an assumed count of 8 FLOP per element, per 8 bytes moved: the real count depends
    on how the kernel evaluates erf or tanh). Both write into a buffer allocated once, as
    `copy_rate` does: a fresh output per call would time the allocator mapping, faulting
    and zeroing new pages, not the kernel's traffic."""
    x, y, out = torch.randn(n, device=dev), torch.randn(n, device=dev), torch.empty(n, device=dev)
    fn, flops, moved = {"add": (lambda: torch.add(x, y, out=out), n, 12 * n),
                        "gelu": (lambda: torch.ops.aten.gelu.out(x, out=out), 8 * n, 8 * n)}[op]
    t = measure(fn, warmup=2, repeats=repeats)
    return flops / t.median, t, flops / moved


# Bytes per element each kernel is counted with, and what a CPU really moves: a store to a line
# that is not in cache first reads it (write-allocate), so every written element costs 4 more.
COUNTED_BYTES = {"copy": 8, "add": 12, "gelu": 8}
MOVED_BYTES = {"copy": 12, "add": 16, "gelu": 12}


def write_allocate_rate(copy_rate, kind):
    """The counted rate `kind` reaches if it moves its real bytes (write-allocate included) as fast
    as the copy moves its own: add's is (12/16)/(8/12) = 1.125× the copy's."""
    return copy_rate * (COUNTED_BYTES[kind] / MOVED_BYTES[kind]) / (COUNTED_BYTES["copy"] / MOVED_BYTES["copy"])


def bandwidths(nbytes, dev="cpu", repeats=7):
    """{"copy" | "add" | "gelu": (bytes moved per second, Timing)} on three buffers of `nbytes`
    each, every kernel writing into one preallocated output, timed side by side (the rounds
    rotate, so a busy machine's drift hits all three alike instead of whichever ran last)."""
    a, b, out = (torch.randn(nbytes // 4, device=dev) for _ in range(3))
    n = a.numel()
    ops = {"copy": (lambda: out.copy_(a), 8 * n), "add": (lambda: torch.add(a, b, out=out), 12 * n),
           "gelu": (lambda: torch.ops.aten.gelu.out(a, out=out), 8 * n)}
    times = measure_side_by_side({name: fn for name, (fn, _) in ops.items()}, repeats=repeats)
    return {name: (moved / times[name].median, times[name]) for name, (_, moved) in ops.items()}
