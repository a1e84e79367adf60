"""Lecture 03: every data-parallel and ZeRO variant equals single-process AdamW training.

One spawn per (world size, task) trains every variant on the same ranks and sends back the
final parameters; the single-process reference runs here. Awkward sizes on purpose: Ψ = 2441
is divisible by neither 2 nor 4, and the tiny task has tensors smaller than the world size
(some ranks own nothing but padding)."""
import pytest
import torch

from lectures import lecture_03_data_parallel as L
from util import spawn
from tests.conftest import build

VARIANTS = {
    "naive": (L.train_data_parallel, {}),
    "overlapped": (L.train_data_parallel, {"grad_sync": "overlapped"}),
    "bucketed": (L.train_data_parallel, {"grad_sync": "bucketed", "bucket_mb": 0.002}),
    "accumulation (overlapped)": (L.train_data_parallel, {"grad_sync": "overlapped", "micro_batches": 3}),
    "accumulation (bucketed)": (L.train_data_parallel, {"grad_sync": "bucketed", "micro_batches": 2,
                                                        "bucket_mb": 0.001}),
    "zero1": (L.train_zero, {"stage": 1}),
    "zero2": (L.train_zero, {"stage": 2}),
    "zero3": (L.train_zero, {"stage": 3}),
    "pytorch ddp": (L.train_pytorch, {"kind": "ddp"}),
    "pytorch fsdp2": (L.train_pytorch, {"kind": "fsdp2"}),
}


def train_all_variants(rank, world_size, task):
    return {name: fn(rank, world_size, task, **kw) for name, (fn, kw) in VARIANTS.items()}


TASKS = {
    "float64": (L.Task(dtype="float64", steps=5), 1e-10),
    "float32": (L.Task(steps=5), 1e-5),
    "tiny": (L.Task(sizes=(5, 3, 11, 2), batch=24, steps=5, dtype="float64"), 1e-10),
}
CASES = [(2, "float64"), (4, "float64"), (4, "float32"), (2, "tiny"), (4, "tiny")]


@pytest.fixture(scope="module")
def results():
    """Train everything once per case (each case: one spawn)."""
    out = {}
    for world_size, name in CASES:
        task, _ = TASKS[name]
        out[world_size, name] = (L.reference_train(task),
                                 spawn(train_all_variants, world_size, task=task).returns)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("world_size,task_name", CASES)
def test_variant_equals_single_process(results, world_size, task_name, variant):
    ref, per_rank = results[world_size, task_name]
    tol = TASKS[task_name][1]
    ours = [r[variant] for r in per_rank]
    for p, q in zip(ours[0]["params"], ref["params"]):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol)
    for rank in range(1, world_size):          # replicas (or gathered shards) identical
        for p, q in zip(ours[rank]["params"], ours[0]["params"]):
            assert torch.equal(p, q), f"rank {rank} differs from rank 0"
    torch.testing.assert_close(torch.tensor(ours[0]["losses"]), torch.tensor(ref["losses"]),
                               rtol=tol, atol=tol)
    for i, (p, p0) in enumerate(zip(ours[0]["params"], ref["initial"])):
        assert not torch.equal(p, p0), f"parameter tensor {i} never changed: that layer did not train"


def test_checksums_agree_every_step(results):
    _, per_rank = results[4, "float64"]
    for variant in ("naive", "bucketed", "zero1", "zero2"):
        sums = [r[variant]["checksums"] for r in per_rank]
        assert all(s == sums[0] for s in sums), variant


def test_without_broadcast_replicas_differ():
    """The check above can fail: skip the broadcast and the replicas never agree."""
    run = spawn(L.train_data_parallel, 2, task=L.Task(steps=2), broadcast=False)
    a, b = run.returns
    assert max((p - q).abs().max().item() for p, q in zip(a["params"], b["params"])) > 1e-3


def test_traffic_and_memory_follow_the_formulas():
    task = L.Task(sizes=(16,) + (48,) * 6 + (4,), batch=8, steps=2)
    n, psi = 4, L.param_count(task)
    got = spawn(L.measure_stages, n, task=task).returns[0]
    ring = 2 * (n - 1) / n * 4 * psi
    assert got["DP"]["bytes_per_step"] == pytest.approx(ring, rel=0.01)
    assert got["ZeRO-1"]["bytes_per_step"] == pytest.approx(ring, rel=0.02)
    assert got["ZeRO-2"]["bytes_per_step"] == pytest.approx(ring, rel=0.02)
    assert ring * 1.3 < got["ZeRO-3"]["bytes_per_step"] < ring * 1.5  # 2L-1 gathers + reduce-scatter
    held = {s: got[s]["held"] for s in got}
    assert held["DP"]["optimizer"] == 8 * psi
    assert held["ZeRO-1"]["optimizer"] == pytest.approx(8 * psi / n, rel=0.02)
    assert held["ZeRO-2"]["grads"] == pytest.approx(4 * psi / n, rel=0.02)
    assert held["ZeRO-3"]["params"] == pytest.approx(4 * psi / n, rel=0.02)
    assert held["ZeRO-3"]["transient"] < 4 * psi / 2      # never the whole model at once


def test_quick_build(tmp_path):
    build("lecture_03_data_parallel", tmp_path, "--quick")
    assert (tmp_path / "lecture_03_data_parallel.json").exists()
