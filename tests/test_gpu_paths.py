"""Ready for a GPU (issue 39): every one-GPU demo has a CUDA path, run here only where a GPU is
(skipped on the CPU build), and each path refuses clearly without one."""
import pytest
import torch

from lectures.model import gpu_paths
from lectures.data_parallel.communication_demos import streams_overlap
from util import spawn

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the course's CPU build has none)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
@pytest.mark.parametrize("fn", [gpu_paths.gpu_roofline, gpu_paths.fp8_matmul, gpu_paths.gpu_attention,
                                lambda: gpu_paths.gpu_memory_meter(lambda: None)])
def test_gpu_paths_refuse_without_a_gpu(fn):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        fn()


def test_the_page_says_what_each_path_would_show():
    assert set(gpu_paths.WHAT_A_GPU_SHOWS) == {"roofline", "fp8", "attention", "memory"}
    import inspect
    from lectures import lecture_01_memory_and_precision as L
    assert "WHAT_A_GPU_SHOWS" in inspect.getsource(L)


@cuda
def test_gpu_roofline_has_a_ridge_far_above_a_cpus():
    r = gpu_paths.gpu_roofline(sizes=(2048, 4096), copy_bytes=256 * 2 ** 20)
    assert r["peak"] > 1e13 and r["bandwidth"] > 1e11
    assert r["ridge"] == pytest.approx(r["peak"] / r["bandwidth"]) and r["ridge"] > 20


@cuda
def test_fp8_matmul_errs_like_e4m3_and_runs():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9")
    r = gpu_paths.fp8_matmul(n=2048, repeats=3)
    assert r["bf16_error"] < r["error"] < 0.1         # e4m3 keeps 3 mantissa bits, bf16 7
    assert r["speedup"] > 0


@cuda
def test_gpu_attention_fused_holds_less_than_naive():
    r = gpu_paths.gpu_attention(s=4096, heads=8, d=64, repeats=3)
    assert r["fused_bytes"] < r["naive_bytes"] / 4      # s × s scores only in the naive one
    assert r["fused_ms"] > 0 and r["naive_ms"] > 0


@cuda
def test_gpu_memory_meter_agrees_with_the_allocator():
    """On the step lecture 01's GPU deep dive meters."""
    from lectures import lecture_01_memory_and_precision as L
    r = gpu_paths.gpu_memory_meter(L.gpt_step_on_cuda())
    assert r["live_peak"] > 0
    assert r["live_peak"] <= r["allocator_peak"] <= 1.25 * r["live_peak"] + 32 * 2 ** 20   # rounding, kernels' scratch memory


@cuda
def test_streams_overlap_hides_the_copy():
    r = spawn(streams_overlap, 1, n=4096, copy_bytes=256 * 2 ** 20, reps=5, name="streams").returns[0]
    assert r["overlapped"].median < r["sequential"].median


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: ring attention on real NCCL")
def test_ring_attention_on_real_nccl_equals_one_process(monkeypatch):
    """Review 05/06 X1: the ring, posted as the NCCL stand-in was told NCCL behaves, on NCCL
    itself (util.ranks picks nccl once every rank has a GPU), against one process."""
    from util import launch
    from lectures.context_parallel import unshard_sequence
    from lectures.context_parallel.demos import attention_inputs, attention_shards, reference_attention
    monkeypatch.setattr(launch.settings, "backend", "nccl")
    cases = [("ring", "zigzag", True), ("ring", "contiguous", False)]
    per_rank = spawn(attention_shards, 2, cases=cases, seq_len=16, heads=2).returns
    q, k, v, dout = attention_inputs(16, 2)
    for case in cases:
        reference = reference_attention(q, k, v, dout, case[2])
        for i, ref in enumerate(reference):
            got = unshard_sequence([per_rank[r][case][i] for r in range(2)], 2, case[1])
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
