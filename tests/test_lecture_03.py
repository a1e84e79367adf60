"""Lecture 03: every data-parallel and ZeRO variant equals single-process AdamW training.

One spawn per (world size, task) trains every variant on the same ranks and sends back the
final parameters; the single-process reference runs here. Awkward sizes on purpose: Ψ = 2441
is divisible by neither 2 nor 4, and the tiny task has tensors smaller than the world size
(some ranks own nothing but padding)."""
import math

import pytest
import torch

from lectures import lecture_03_data_parallel as L
from lectures.data_parallel import (AllReduceAfterBackward, Collectives, OverlappedAllReduce, PowerSGD, Zero3,
                                    plan_buckets)
from lectures.data_parallel.demos import (Task, best_rules, budget_probe, lr_scaling, make_batches, make_model,
                                          measure_stages, merge_in_flight, param_count, published_scale,
                                          reference_train, sampler_epochs, shard_rows, strided_batches, train_at_batch,
                                          train_data_parallel, train_pytorch, train_zero, uneven_with_join, zero2_words)
from lectures.data_parallel import deep_dives
from util import spawn
from util.render import visible_text
from tests.conftest import built, walk

VARIANTS = {
    "naive": (train_data_parallel, {}),
    "overlapped": (train_data_parallel, {"grad_sync": "overlapped"}),
    "bucketed": (train_data_parallel, {"grad_sync": "bucketed", "bucket_mb": 0.002}),
    "accumulation (overlapped)": (train_data_parallel, {"grad_sync": "overlapped", "micro_batches": 3}),
    "accumulation (bucketed)": (train_data_parallel, {"grad_sync": "bucketed", "micro_batches": 2,
                                                      "bucket_mb": 0.001}),
    "zero1": (train_zero, {"stage": 1}),
    "zero2": (train_zero, {"stage": 2}),
    "zero3": (train_zero, {"stage": 3}),
    "zero1 accumulation": (train_zero, {"stage": 1, "micro_batches": 3}),
    "zero2 accumulation": (train_zero, {"stage": 2, "micro_batches": 3}),
    "zero3 accumulation": (train_zero, {"stage": 3, "micro_batches": 3}),
    "zero3 no_grad loss between backward and step": (train_zero, {"stage": 3, "eval_between": True}),
    "zero2 no_grad loss between backward and step": (train_zero, {"stage": 2, "eval_between": True}),
    "pytorch ddp": (train_pytorch, {"kind": "ddp"}),
    "pytorch fsdp2": (train_pytorch, {"kind": "fsdp2"}),
}


# The misuse variants (accumulation and a no_grad forward under ZeRO) run on fewer cases.
MISUSE = [name for name in VARIANTS if "accumulation" in name and "zero" in name or "no_grad" in name]


def train_all_variants(rank, world_size, task, names):
    return {name: VARIANTS[name][0](rank, world_size, task, **VARIANTS[name][1]) for name in names}


TASKS = {
    "float64": (Task(dtype="float64", steps=5), 1e-10),
    "float32": (Task(steps=5), 1e-5),
    "tiny": (Task(sizes=(5, 3, 11, 2), batch=24, steps=5, dtype="float64"), 1e-10),
}
CASES = [(2, "float64"), (4, "float64"), (4, "float32"), (2, "tiny"), (4, "tiny")]
MISUSE_CASES = [(2, "float64"), (4, "float32"), (4, "tiny")]
COMBOS = [(ws, name, v) for ws, name in CASES for v in VARIANTS
          if v not in MISUSE or (ws, name) in MISUSE_CASES]


@pytest.fixture(scope="module")
def results():
    """Train everything once per case (each case: one spawn)."""
    out = {}
    for world_size, name in CASES:
        task, _ = TASKS[name]
        names = [v for c_ws, c_name, v in COMBOS if (c_ws, c_name) == (world_size, name)]
        out[world_size, name] = (reference_train(task),
                                 spawn(train_all_variants, world_size, task=task, names=names).returns)
    return out


@pytest.mark.parametrize("world_size,task_name,variant", COMBOS)
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
    run = spawn(train_data_parallel, 2, task=Task(steps=2), broadcast=False)
    a, b = run.returns
    assert max((p - q).abs().max().item() for p, q in zip(a["params"], b["params"])) > 1e-3


def test_traffic_and_memory_follow_the_formulas():
    task = Task(sizes=(16,) + (48,) * 6 + (4,), batch=8, steps=2)
    n, psi = 4, param_count(task)
    got = spawn(measure_stages, n, task=task).returns[0]
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
    # Never the whole model at once: two gathered layers and one layer's full gradients in
    # flight (the meter counts both), whatever the depth.
    layer = 4 * (48 * 48 + 48)
    assert held["ZeRO-3"]["transient"] <= 3 * layer < 4 * psi


# --- misuse: each building block works, or refuses loudly ----------------------------------

def train_with_unused_parameter(rank, world_size, task, used_on=None):
    """Naive DDP on a model with one extra parameter that no forward uses (`used_on`: the ranks
    on which it *does* get a gradient, through a term that adds zero to the loss... but not to
    its gradient: 0.1·sum(extra) has gradient 0.1 everywhere)."""
    comm = Collectives(world_size)
    model = make_model(task, seed=task.seed)
    extra = torch.nn.Parameter(torch.ones(3, dtype=task.torch_dtype))
    sync = AllReduceAfterBackward(model, comm)
    sync.params.append(extra)
    opt = torch.optim.AdamW(list(model.parameters()) + [extra], lr=task.lr, weight_decay=task.weight_decay)
    for x, y in make_batches(task):
        loss = torch.nn.functional.mse_loss(model(shard_rows(x, rank, world_size)),
                                            shard_rows(y, rank, world_size))
        if used_on is not None and rank in used_on:
            loss = loss + 0.1 * extra.sum()
        loss.backward()
        sync.finish()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], extra.detach().clone()


def reference_with_unused(task, world_size, used_on):
    """One process: the extra parameter's gradient is the mean over ranks of 0.1 (or 0)."""
    model = make_model(task, seed=task.seed)
    extra = torch.nn.Parameter(torch.ones(3, dtype=task.torch_dtype))
    opt = torch.optim.AdamW(list(model.parameters()) + [extra], lr=task.lr, weight_decay=task.weight_decay)
    for x, y in make_batches(task):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if used_on is not None:
            loss = loss + 0.1 * len(used_on) / world_size * extra.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()], extra.detach()


@pytest.mark.parametrize("used_on", [None, (0,)])
def test_naive_ddp_with_a_parameter_without_gradient(used_on):
    task = Task(dtype="float64", steps=3)
    run = spawn(train_with_unused_parameter, 2, task=task, used_on=used_on)
    ref_params, ref_extra = reference_with_unused(task, 2, used_on)
    for params, extra in run.returns:
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(extra, ref_extra, rtol=1e-10, atol=1e-10)
    if used_on is None:      # never had a gradient: untouched, as AdamW leaves grad=None alone
        assert torch.equal(run.returns[0][1], torch.ones(3, dtype=torch.float64))


def overlapped_with_unused(rank, world_size):
    task = Task(steps=1)
    model = make_model(task, seed=0)
    model.register_parameter("unused", torch.nn.Parameter(torch.zeros(2)))
    sync = OverlappedAllReduce(model, Collectives(world_size))
    x, y = make_batches(task)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    try:
        sync.finish()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_overlapped_sync_refuses_a_parameter_without_gradient():
    msgs = spawn(overlapped_with_unused, 2).returns
    assert all("got no gradient" in m for m in msgs), msgs


def zero3_on(rank, world_size, module):
    task = Task(sizes=(4, 6, 3))
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), module, torch.nn.Linear(6, 3))
    try:
        Zero3(model, Collectives(world_size), task)
    except TypeError as e:
        return str(e)
    return "accepted"


def test_zero3_refuses_modules_it_cannot_shard():
    msg = spawn(zero3_on, 2, module=torch.nn.LayerNorm(6)).returns[0]
    assert "LayerNorm" in msg and "neither synchronised nor stepped" in msg
    assert spawn(zero3_on, 2, module=torch.nn.Tanh()).returns[0] == "accepted"


# --- bucketing, sharding, scaling ---------------------------------------------------------

def test_bucket_count_comes_from_the_real_bucketing():
    """A bucket never splits a tensor: three 4 MB weights make three buckets whether the limit is
    0.25, 1 or 4 MB; small tensors share buckets; every parameter lands in exactly one."""
    big = [torch.nn.Parameter(torch.zeros(2 ** 20)) for _ in range(3)]        # 4 MB each
    for mb in (0.25, 1.0, 4.0):
        assert len(plan_buckets(big, mb)) == 3
    assert len(plan_buckets(big, 25.0)) == 1
    task = Task(sizes=(32,) + (128,) * 24 + (10,))
    params = list(make_model(task, 0).parameters())
    counts = [len(plan_buckets(params, mb)) for mb in (1e-6, 0.03, 0.25, 1.0, 25.0)]
    assert counts[0] == len(params) and counts[-1] == 1
    assert counts == sorted(counts, reverse=True) and len(set(counts)) == len(counts)
    for mb in (1e-6, 0.03, 0.25):
        buckets = plan_buckets(params, mb)
        flat = [id(p) for b in buckets for p in b]
        assert sorted(flat) == sorted(id(p) for p in params)           # each exactly once
        assert flat == [id(p) for p in reversed(params)]               # in backward's order
        assert all(sum(p.numel() * 4 for p in b) >= mb * 2 ** 20 for b in buckets[:-1])


@pytest.mark.parametrize("world_size,rows", [(2, 9), (3, 10)])
def test_sampler_indices_are_disjoint_and_reshuffled(world_size, rows):
    drop = spawn(sampler_epochs, world_size, n_rows=rows, epochs=3, drop_last=True).returns
    pad = spawn(sampler_epochs, world_size, n_rows=rows, epochs=1, drop_last=False).returns
    for epoch in range(3):
        lists = [r[epoch] for r in drop]
        seen = [i for l in lists for i in l]
        assert len(seen) == len(set(seen)) == rows // world_size * world_size   # disjoint
        assert set(seen) <= set(range(rows))
        assert len({len(l) for l in lists}) == 1                              # equal counts
    assert drop[0][0] != drop[0][1]                                          # set_epoch reshuffles
    padded = [i for r in pad for i in r[0]]
    assert set(padded) == set(range(rows)) and len(padded) == -(-rows // world_size) * world_size
    same = spawn(sampler_epochs, world_size, n_rows=rows, epochs=2, drop_last=True,
                 set_epoch=False).returns
    assert all(r[0] == r[1] for r in same)                                   # forgot set_epoch


def test_join_finishes_uneven_batches_with_equal_models():
    rows, n, batch = 17, 4, 2
    counts = [len(strided_batches(r, n, rows, batch)) for r in range(n)]
    assert len(set(counts)) > 1                                              # really uneven
    run = spawn(uneven_with_join, n, n_rows=rows, batch=batch)
    assert [x["batches"] for x in run.returns] == counts
    assert len({x["checksum"] for x in run.returns}) == 1


def test_learning_rate_rules_and_budget_probe():
    got = train_at_batch(32, "linear", base_batch=8, base_lr=0.05, samples=8 * 20)
    none = train_at_batch(32, "none", base_batch=8, base_lr=0.05, samples=8 * 20)
    assert math.isfinite(got) and got < none          # bigger steps help with few steps
    parts = spawn(lr_scaling, 2, configs=[(8, "none"), (16, "sqrt"), (16, "linear")],
                  base_batch=8, base_lr=0.05, samples=32).returns
    assert sorted(k for p in parts for k in p) == sorted([(8, "none"), (16, "sqrt"), (16, "linear")])
    probe = spawn(budget_probe, 2, task=Task()).returns
    for key in ("forward", "forward+backward", "all-reduce"):
        assert probe[0][key].samples == probe[1][key].samples and probe[0][key].median > 0


# --- compression ------------------------------------------------------------------------

def powersgd_full_rank(rank, world_size):
    """With rank = rows the projection P Pᵀ is the identity: PowerSGD must give the exact mean."""
    torch.manual_seed(rank)
    w = torch.nn.Parameter(torch.zeros(3, 5, dtype=torch.float64))
    b = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    w.grad, b.grad = torch.randn(3, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    exact = [w.grad.clone(), b.grad.clone()]
    for t in exact:
        torch.distributed.all_reduce(t)
        t.div_(world_size)
    comp = PowerSGD([w, b], Collectives(world_size), rank=3, start_iter=0, min_rate=0)
    comp.sync()
    return [w.grad, b.grad], exact, comp.error[w]


def test_powersgd_is_exact_at_full_rank():
    for got, exact, error in spawn(powersgd_full_rank, 3).returns:
        for g, e in zip(got, exact):
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


def test_powersgd_ours_close_to_pytorch_hook_and_cheaper_than_exact():
    task = Task(sizes=(32, 128, 128, 10), batch=16)
    runs = {impl: spawn(deep_dives.powersgd_train, 2, task=task, impl=impl, steps=20, every=10).returns
            for impl in ("exact", "pytorch", "ours")}
    for impl, r in runs.items():
        assert len({x["checksum"] for x in r}) == 1, impl           # replicas stay identical
    loss = {impl: r[0]["curve"][-1][1] for impl, r in runs.items()}
    assert all(math.isfinite(v) for v in loss.values())
    assert loss["ours"] < 1.5 * loss["exact"] and loss["pytorch"] < 1.5 * loss["exact"]
    assert abs(loss["ours"] - loss["pytorch"]) < 0.25 * loss["exact"]
    bytes_ = {impl: r[0]["wire_per_step"] for impl, r in runs.items()}
    assert bytes_["ours"] < 0.5 * bytes_["exact"] and bytes_["pytorch"] < 0.5 * bytes_["exact"]


def test_local_sgd_and_diloco_keep_ranks_identical():
    task = Task(batch=16)
    run = spawn(deep_dives.local_sgd_sweep, 2, task=task, variants=[(4, "", None), (4, "int8", "nesterov")],
                steps=8).returns
    for k in run[0]:
        assert len({r[k]["checksum"] for r in run}) == 1, k


def test_quick_build(course_site):
    import json
    from util.measure import usable_cores
    site = built(course_site, "lecture_03_data_parallel")    # the session's one quick build
    page = json.loads((site / "lecture_03_data_parallel.json").read_text())
    assert page["status"] == "ok" and page["demos"]["failed"] == 0
    records = list(walk(page["records"]))
    notes = " ".join(" ".join(r["text"] for r in records if r["kind"] == "note").split())
    for heading in ["## Data sharding", "## Can data parallelism hide the all-reduce?",
                    "## Batch size and learning rate", "## FSDP2's knobs", "PowerSGD"]:
        assert heading in notes, heading
    # the machine is named once, in the page header (from the environment), not in every note
    assert "2 cores" not in notes and "measured on a CPU" not in notes and page["environment"]["device"]
    assert "74.7 seconds" in notes and "Goyal et al. 2017" in notes and "Shard(0)" in notes
    demos = [r for r in page["records"] if r["kind"] == "demo"]
    names = [d["name"] for d in demos]
    assert len(names) == len(set(names)), names
    for d in demos:                     # timing demos never oversubscribe the cores
        if d["name"].startswith(("step time", "bucket-size sweep", "timeline of", "overlap budget")):
            assert d["world_size"] <= max(2, usable_cores()), d["name"]
    tables = [r for r in records if r["kind"] == "table"]
    buckets = next(t for t in tables if "buckets (counted)" in t["header"])
    counts = [row[1] for row in buckets["rows"]]
    assert counts[-1] == 1 and len(set(counts)) >= 4          # the sweep really varies the count
    traffic = next(t for t in tables if "measured: written to sockets" in t["header"])
    for row in traffic["rows"]:
        assert row[3] >= row[2] > 0                            # measured includes headers


# --- what the bytes on the wire say -----------------------------------------------------------

def test_measured_bytes_match_gloo_count_and_zero_excess_is_exactly_gloos_reduce_scatter():
    """gloo's reduce-scatter is a full all-reduce plus a copy, so against ring counts ZeRO-1/2
    write 3/2 and ZeRO-3 about 4/3 at any size; against the count of gloo's own algorithms every
    stage is within a few percent (headers, padding)."""
    task = Task(sizes=(32, 256, 256, 10), batch=12, steps=2)
    n = 3
    got = spawn(measure_stages, n, task=task).returns[0]
    for stage in ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"):
        ratio = got[stage]["wire_per_step"] / got[stage]["gloo_per_step"]
        assert ratio >= 1.0 and ratio < 1.05, stage
    for stage in ("ZeRO-1", "ZeRO-2"):
        assert got[stage]["gloo_per_step"] / got[stage]["bytes_per_step"] == pytest.approx(1.5, rel=0.02)
    zero3 = got["ZeRO-3"]["gloo_per_step"] / got["ZeRO-3"]["bytes_per_step"]
    assert zero3 > 1.3 and zero3 <= 4 / 3 + 0.01
    assert got["DP"]["gloo_per_step"] == pytest.approx(got["DP"]["bytes_per_step"], rel=0.01)


def test_published_scale_overlap_verdict_follows_the_numbers():
    """0.56 s of all-reduce under 2.32 s of backward hides ~4x over: not 'on the edge'; and DP
    sends about 4Ψ bytes per rank in bf16 (2 x the 2Ψ-byte gradient)."""
    text = published_scale()
    assert "0.56 s" in text and "2.32 s" in text
    assert "on the edge" not in text and "4.1×" in text
    assert "28 GB per GPU" in text
    assert "doubles to 1.12 s and backward is 2.1× it" in text   # fp32 gradients, as lecture 07 charges
    equal = published_scale(tokens=int(32768 / 4.14))      # a 4.1x smaller batch per GPU
    assert "on the edge" in equal


def test_critical_batch_size_claim_is_not_that_a_rule_takes_over():
    import inspect
    source = inspect.getsource(L.batch_and_learning_rate)
    assert "take over" not in source and "McCandlish" in source


def test_merge_in_flight_gives_one_bar_per_stretch():
    spans = [{"rank": 0, "label": "backward", "start": 0.0, "end": 1.0},
             {"rank": 0, "label": "all-reduce (async)", "start": 0.1, "end": 0.5},
             {"rank": 0, "label": "all-reduce (async)", "start": 0.2, "end": 0.6},
             {"rank": 0, "label": "all-reduce (async)", "start": 0.9, "end": 1.2},
             {"rank": 1, "label": "all-reduce (async)", "start": 0.3, "end": 0.4}]
    merged, count = merge_in_flight(spans)
    bars = sorted((s["rank"], s["start"], s["end"]) for s in merged if "in flight" in s["label"])
    assert bars == [(0, 0.1, 0.6), (0, 0.9, 1.2), (1, 0.3, 0.4)] and count == 3
    assert [s for s in merged if s["label"] == "backward"] == spans[:1]
    alone, count = merge_in_flight(spans[:2])
    assert count == 0 and alone == spans[:2]


def test_step_times_are_measured_once_and_reused(monkeypatch):
    calls = []

    class Fake:
        returns = [{"bucketed": "t"}]
    monkeypatch.setattr(L, "spawn", lambda *a, **k: calls.append(k) or Fake())
    monkeypatch.setattr(L, "_STEP_TIMES", {})
    assert L.step_times() is L.step_times()
    assert len(calls) == 1 and set(calls[0]["kinds"]) >= {"bucketed", "ddp", "zero3", "fsdp2"}


def zero3_after_backward(rank, world_size, layers=8, width=64):
    task = Task(sizes=(16,) + (width,) * layers + (4,), batch=8, steps=1)
    z = Zero3(make_model(task, seed=task.seed), Collectives(world_size), task)
    x, y = next(iter(make_batches(task)))
    torch.nn.functional.mse_loss(z(shard_rows(x, rank, world_size)), shard_rows(y, rank, world_size)).backward()
    pending = len(z.pending)
    z.step()
    return {"pending": pending, "transient": z.held["transient"], "layer bytes": (width * width + width) * 4,
            "psi bytes": 4 * param_count(task)}


def test_zero3_retires_reduce_scatters_during_backward():
    """A gloo Work keeps a full-size copy of its input, so a reduce-scatter left pending until
    step() keeps a layer's full gradient alive: ZeRO-3 retires them during backward, at most one
    layer's reduce-scatters (weight and bias) stay in flight after it, and the 'transient' meter
    counts full gradients as well as gathered weights: two gathered layers plus one layer's full
    gradient at the peak."""
    for got in spawn(zero3_after_backward, 2).returns:
        assert got["pending"] <= 2, got
        assert got["transient"] >= 3 * got["layer bytes"], got
        assert got["transient"] < got["psi bytes"] / 2, got


class _GroupComm(Collectives):
    """Lecture 03's Collectives on one process group (as lecture 07's trainer uses them)."""

    def __init__(self, group):
        import torch.distributed as dist
        super().__init__(dist.get_world_size(group))
        self.group = group

    def reduce_scatter(self, out, full, async_op=False, label="reduce-scatter"):
        import torch.distributed as dist
        return dist.reduce_scatter_single(out, full, group=self.group, async_op=async_op)

    def all_gather(self, full, shard, async_op=False, label="all-gather"):
        import torch.distributed as dist
        return dist.all_gather_single(full, shard, group=self.group, async_op=async_op)


def zero3_on_subgroups(rank, world_size, task):
    """Ranks {0, 1} and {2, 3} each train ZeRO-3 on their own group, on the whole batch."""
    import torch.distributed as dist
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    comm, r, n = _GroupComm(group), dist.get_rank(group), 2
    z = Zero3(make_model(task, seed=task.seed), comm, task)
    for x, y in make_batches(task):
        torch.nn.functional.mse_loss(z(shard_rows(x, r, n)), shard_rows(y, r, n)).backward()
        z.step()
    out = z.full_parameters()
    outside = None
    if rank == 3:                       # a group this rank is not in
        try:
            Zero3(make_model(task, seed=task.seed), _GroupComm(groups[0]), task)
        except ValueError as e:
            outside = str(e)
    return {"params": out, "outside": outside}


def test_zero3_shards_by_the_rank_in_its_group():
    """Zero3Layer took its shard by the GLOBAL rank: on a sub-group, ranks 2 and 3 took pieces
    past the end of each tensor (zeros) and trained silently wrong. It uses the rank in comm's
    group now, and refuses a group without this rank."""
    task = Task(dtype="float64", steps=3)
    ref = reference_train(task)
    got = spawn(zero3_on_subgroups, 4, task=task).returns
    for rank, r in enumerate(got):
        for p, q in zip(r["params"], ref["params"]):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10), rank
    assert "is not in the group" in got[3]["outside"]


def test_best_rule_at_the_base_batch_is_a_tie():
    """At the base batch all three rules are the same run; the page said '8: none' (list order)."""
    rules = ["none", "sqrt", "linear"]
    got = {(8, r): 0.25 for r in rules} | {(32, "none"): 0.4, (32, "sqrt"): 0.3, (32, "linear"): 0.28}
    text = best_rules(got, [8, 32], rules, base_batch=8)
    assert "8: all equal" in text and "8: none" not in text and "32: linear" in text


def test_shard_rows_refuses_with_value_error():
    with pytest.raises(ValueError, match="does not split evenly"):
        shard_rows(torch.zeros(5, 2), 0, 2)
    with pytest.raises(ValueError, match="not in"):
        shard_rows(torch.zeros(4, 2), 2, 2)


def test_zero2_timing_is_said_from_the_numbers():
    from util.measure import Timing
    t = {"zero1": Timing([10e-3, 10.5e-3, 11e-3]), "zero2": Timing([15e-3, 15.5e-3, 16e-3]),
         "zero3": Timing([9e-3, 9.5e-3, 10e-3])}
    text = visible_text(zero2_words(t))
    assert "ZeRO-1 is 1.48× faster than ZeRO-2" in text and "in_flight=1" in text
    t["zero2"] = Timing([10e-3, 10.4e-3, 11e-3])
    assert "no measurable difference" in visible_text(zero2_words(t)) and "in_flight" not in zero2_words(t)


def test_local_sgd_does_not_rank_single_runs_within_noise():
    """'Lowest: H=16 nesterov 0.1786' against 0.1818 and 0.1826, one run each, had no caveat."""
    final = {"H=1 fp32": (96, 1, 0.1826), "H=16 fp32": (96, 1, 0.1818), "H=16 fp32 nesterov": (96, 1, 0.1786)}
    text = deep_dives.local_sgd_words(final)
    assert "H=16 fp32 nesterov (0.1786)" in text and "another seed" in text
    assert "about the same" in text


class PooledJob:
    """A torchrun job of `ranks` ranks, as rank 0's demos see it, with the pool's workers as its
    other ranks."""

    def __init__(self, ranks):
        self.ranks = ranks

    def run(self, fn, world_size, kwargs, timeout, deadline=None):
        from util import pool
        return pool.pooled("gloo", world_size).run(fn, kwargs, world_size, timeout, deadline)


def test_under_torchrun_with_fewer_ranks_the_sections_skip_what_did_not_run(monkeypatch):
    """Two torchrun ranks: the 4-rank demos are skipped with their reason, and the sections
    that read their results show what the other demos did instead of crashing."""
    from util import launch, record, torchrun_job
    monkeypatch.setattr(launch, "in_torchrun", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torchrun_job, "job", lambda: PooledJob(2))
    recorder = record.Recorder()
    previous = record.use(recorder)
    try:
        L.ddp_from_scratch()
    finally:
        record.use(previous)
    demos = {r["name"]: r for r in recorder.records if r["kind"] == "demo"}
    assert demos["DDP from scratch, 4 ranks"]["status"] == "skipped"
    assert "torchrun started 2" in demos["DDP from scratch, 4 ranks"]["error"]
    assert any("on 1, 2 ranks" in r.get("caption", "") for r in recorder.records if r["kind"] == "figure")


def test_overlap_bars_call_a_slower_overlapped_run_slower():
    """'0.87× faster' reads as a gain; below 1 the label says how much slower."""
    import matplotlib
    matplotlib.use("Agg")
    from lectures.data_parallel.figures import overlap_bars
    from util.measure import Timing
    fig = overlap_bars({"lost": {"sequential": Timing([0.080]), "overlapped": Timing([0.0926])},
                        "won": {"sequential": Timing([0.080]), "overlapped": Timing([0.060])}})
    labels = [t.get_text() for t in fig.axes[0].texts if "\n" in t.get_text()]
    assert labels == ["lost\n1.16× slower", "won\n1.33× faster"], labels
