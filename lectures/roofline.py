"""What this machine does per second: matmul FLOP/s, copy bandwidth, element-wise rates, the
numbers of the roofline model (Williams, Waterman & Patterson 2009, "Roofline: an insightful
visual performance model"), attainable FLOP/s = min(peak, intensity × bandwidth).
"""
import contextlib

import torch
import torch.nn.functional as F

from util.measure import measure


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


def copy_rate(nbytes, dev="cpu", repeats=7):
    """(bytes/s, Timing) of copying `nbytes` between two buffers: each byte is read and written."""
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=2, repeats=repeats)
    return 2 * nbytes / t.median, t


def elementwise_rate(n, op="add", dev="cpu", repeats=7):
    """(FLOP/s, Timing, FLOP per byte) of x + y (1 FLOP per 12 bytes moved in fp32) or
    GELU (counted as ~8 FLOP per 8 bytes moved)."""
    x, y = torch.randn(n, device=dev), torch.randn(n, device=dev)
    fn, flops, moved = {"add": (lambda: x + y, n, 12 * n), "gelu": (lambda: F.gelu(x), 8 * n, 8 * n)}[op]
    t = measure(fn, warmup=2, repeats=repeats)
    return flops / t.median, t, flops / moved
