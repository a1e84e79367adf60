"""The one-GPU demos' CUDA paths: what lecture 01's roofline, fp8 matmul, attention kernels and
memory meter measure when a GPU is there (lecture 02's streams demo has its own,
`communication_demos.streams_overlap`). On this course's CPU build they are skipped; the tests
that run them (tests/test_gpu_paths.py) are gated on `torch.cuda.is_available()`.

Each returns plain numbers, so a page or a notebook can print them beside the CPU's."""
import torch
import torch.nn.functional as F

from lectures.model.attention import naive_causal_attention
from lectures.model.memory import LiveBytes
from lectures.model.roofline import copy_rate, matmul_rate
from util.measure import measure


def _need_cuda(what):
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA GPU; this machine has none (torch.cuda.is_available() is False)")


def gpu_roofline(sizes=(2048, 4096, 8192), copy_bytes=512 * 2 ** 20):
    """{"peak": bf16 matmul FLOP/s (best size), "bandwidth": bytes/s of a device copy, "ridge":
    FLOP per byte where the two roofs meet}. An H100 SXM publishes 989 TFLOP/s dense bf16 and
    3.35 TB/s, a ridge near 300 FLOP/byte: a GPU needs ~50× the CPU's intensity to be compute-bound."""
    _need_cuda("gpu_roofline")
    peak = max(matmul_rate(n, torch.bfloat16, "cuda")[0] for n in sizes)
    bw, _ = copy_rate(copy_bytes, "cuda")
    return {"peak": peak, "bandwidth": bw, "ridge": peak / bw}


def fp8_matmul(n=4096, repeats=7):
    """A tensor-wise scaled e4m3 matmul (`torch._scaled_mm`, fp8 tensor cores, compute capability
    ≥ 8.9) against bf16 on the same operands: {"error": its relative error against fp32,
    "bf16_error": bf16's, "speedup": bf16 time / fp8 time}. The scales are amax/448, as the
    course's simulated fp8 (`lectures.model.precision`) uses."""
    _need_cuda("fp8_matmul")
    if torch.cuda.get_device_capability() < (8, 9):
        raise RuntimeError("fp8 matmuls need compute capability 8.9 or more (Ada, Hopper, Blackwell)")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", generator=g)
    b = torch.randn(n, n, device="cuda", generator=g)
    ref = a @ b
    fp8 = torch.float8_e4m3fn
    sa, sb = a.abs().max() / 448, b.abs().max() / 448
    a8 = (a / sa).to(fp8)
    b8 = (b / sb).t().contiguous().to(fp8).t()         # _scaled_mm wants the second operand column-major
    run8 = lambda: torch._scaled_mm(a8, b8, scale_a=sa.float(), scale_b=sb.float(), out_dtype=torch.bfloat16)
    a16, b16 = a.bfloat16(), b.bfloat16()
    run16 = lambda: a16 @ b16
    err = lambda y: ((y.float() - ref).norm() / ref.norm()).item()
    t8, t16 = measure(run8, repeats=repeats), measure(run16, repeats=repeats)
    return {"error": err(run8()), "bf16_error": err(run16()), "speedup": t16.median / t8.median}


def gpu_attention(s=8192, heads=16, d=128, repeats=5):
    """Causal attention on the GPU, PyTorch's fused SDPA (FlashAttention's kernel on Ampere and
    later) against the naive s × s version: {"fused_ms", "naive_ms", "fused_bytes", "naive_bytes"},
    the bytes being the most the allocator held beyond q, k and v (torch.cuda.max_memory_allocated)."""
    _need_cuda("gpu_attention")
    q, k, v = (torch.randn(1, heads, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = {}
    for name, fn in (("fused", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
                     ("naive", lambda: naive_causal_attention(q, k, v))):
        fn()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        out[f"{name}_bytes"] = torch.cuda.max_memory_allocated() - base
        out[f"{name}_ms"] = measure(fn, repeats=repeats).median * 1e3
    return out


def gpu_memory_meter(step):
    """Run `step()` (a forward and backward on CUDA tensors) under LiveBytes and under the CUDA
    allocator's own counter: {"live_peak": what LiveBytes saw, "allocator_peak": the allocator's
    peak beyond what was allocated before}. The allocator rounds every block up to 512 bytes and
    counts scratch memory kernels take outside any tensor, so it reads a little more (cuBLAS's
    workspaces, allocated in the warm-up and kept, are in the memory allocated before); the
    caching allocator's reserved memory (`memory_reserved`) more again."""
    _need_cuda("gpu_memory_meter")
    step()                                    # warm-up: cuBLAS workspaces, kernels loaded
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with LiveBytes() as meter:
        step()
    torch.cuda.synchronize()
    return {"live_peak": meter.peak, "allocator_peak": torch.cuda.max_memory_allocated() - base,
            "reserved": torch.cuda.memory_reserved()}


WHAT_A_GPU_SHOWS = {
    "roofline": "`gpu_roofline()`: the ridge near 300 FLOP/byte (H100 SXM: 989 TFLOP/s bf16 over 3.35 TB/s), "
                "so small matmuls and every element-wise kernel are memory-bound",
    "fp8": "`fp8_matmul()`: a real e4m3 GEMM on fp8 tensor cores, its error beside bf16's, and its speed-up",
    "attention": "`gpu_attention()`: the fused kernel's bytes growing with s, not s², and its time far below "
                 "the naive one's",
    "memory": "`gpu_memory_meter(step)`: LiveBytes' peak beside `torch.cuda.max_memory_allocated` (512-byte "
              "rounding, kernels' scratch memory)",
}
