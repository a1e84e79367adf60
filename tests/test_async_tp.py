"""Asynchronous tensor parallelism (lectures/tensor_parallel/async_tp.py): the decomposed ring equals the plain
all-gather + matmul / matmul + reduce-scatter and one process, and moves what Wang et al.'s
decomposition moves.

One spawn per world size (1, 2, 3, 4) runs every check on the ranks; each rank also computes the
one-process reference from identically seeded tensors. Sizes are awkward on purpose: batch 3,
hidden 7, output 5, sequences of 2t and 3t positions, float64."""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lectures.tensor_parallel import async_tp as A
from lectures.tensor_parallel.ops import _split
from util import spawn

F64 = torch.float64
B, H, OUT = 3, 7, 5


def _diff(a, b):
    return (a - b).abs().max().item()


def _ops(g, t, r, s):
    """The two decomposed ops against their plain definitions, with what they sent."""
    d, counts = {}, {}
    torch.manual_seed(s)
    x = torch.randn(B, s, H, dtype=F64)
    w = torch.randn(OUT, H, dtype=F64)
    with A.counting() as c:
        y, gathered = A.all_gather_matmul(_split(x, 1, g), w, g, return_gathered=True)
    d["all_gather_matmul: output"] = _diff(y, F.linear(x, w))
    d["all_gather_matmul: gathered input"] = _diff(gathered, x)
    counts["all_gather_matmul"] = (c, x[:, : s // t].numel() * 8, x.numel() * 8)
    # matmul_reduce_scatter: every rank holds its own input and its own weight slice
    xs = [torch.randn(B, s, H, dtype=F64) for _ in range(t)]
    ws = [torch.randn(OUT, H, dtype=F64) for _ in range(t)]
    with A.counting() as c:
        y = A.matmul_reduce_scatter(xs[r], ws[r], g)
    want = _split(sum(F.linear(xq, wq) for xq, wq in zip(xs, ws)), 1, g)
    d["matmul_reduce_scatter: output"] = _diff(y, want)
    counts["matmul_reduce_scatter"] = (c, want.numel() * 8, want.numel() * t * 8)
    return d, counts


def _mlp_pair(g, t, seed):
    torch.manual_seed(seed)
    return nn.Linear(H, OUT * t, dtype=F64), nn.Linear(OUT * t, H, dtype=F64)


def _train(g, t, r, s, decomposed, make_opt, steps=2):
    """Two optimizer steps of the SP MLP and of the full MLP on the same batches: the largest
    differences of outputs, every gradient (first step) and every parameter (after the steps)."""
    fc_in, fc_out = _mlp_pair(g, t, 1)
    mlp = A.SequenceParallelMLP(fc_in, fc_out, g, decomposed=decomposed)
    opt, ref_opt = make_opt(mlp.parameters()), make_opt(list(fc_in.parameters()) + list(fc_out.parameters()))
    d = {}
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(B, H, s, dtype=F64).transpose(1, 2)       # non-contiguous (b, s, h)
        G = torch.randn(B, s, H, dtype=F64)
        xr = x.clone().requires_grad_(True)
        ref = fc_out(F.gelu(fc_in(xr)))
        (ref * G).sum().backward()
        xs = _split(x, 1, g).transpose(1, 2).contiguous().transpose(1, 2)   # this rank's positions, non-contiguous
        assert not xs.is_contiguous()
        xs.requires_grad_(True)
        y = mlp(xs)
        (y * _split(G, 1, g)).sum().backward()
        if step == 0:
            d["output"] = _diff(y, _split(ref, 1, g))
            d["input grad"] = _diff(xs.grad, _split(xr.grad, 1, g))
            d["fc_in weight grad"] = _diff(mlp.w_in.grad, _split(fc_in.weight.grad, 0, g))
            d["fc_in bias grad"] = _diff(mlp.b_in.grad, _split(fc_in.bias.grad, 0, g))
            d["fc_out weight grad"] = _diff(mlp.w_out.grad, _split(fc_out.weight.grad, 1, g))
            d["fc_out bias grad"] = _diff(mlp.b_out.grad, fc_out.bias.grad)
            assert min(p.grad.abs().max().item() for p in mlp.parameters()) > 1e-6, "a zero gradient checks nothing"
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    d["parameters after steps"] = max(_diff(mlp.w_in, _split(fc_in.weight, 0, g)), _diff(mlp.b_in, _split(fc_in.bias, 0, g)),
                                      _diff(mlp.w_out, _split(fc_out.weight, 1, g)), _diff(mlp.b_out, fc_out.bias))
    return d


def _misuse(g, t, r):
    """What each misuse raised (None: it worked). Every rank must take the same path."""
    w = torch.randn(OUT, H, dtype=F64)
    cases = {"2-D input": lambda: A.all_gather_matmul(torch.randn(2 * t, H, dtype=F64), w, g),
             "wrong weight": lambda: A.all_gather_matmul(torch.randn(B, 2, H, dtype=F64), w.t(), g),
             "wrong dtype": lambda: A.matmul_reduce_scatter(torch.randn(B, 2 * t, H), w, g),
             "sequence not divisible": lambda: A.matmul_reduce_scatter(torch.randn(B, 2 * t + 1, H, dtype=F64), w, g)}
    leaf = torch.randn(B, 2 * t, H, dtype=F64, requires_grad=True)
    cases["all_gather_matmul with autograd"] = lambda: A.all_gather_matmul(leaf, w, g)
    cases["matmul_reduce_scatter with autograd"] = lambda: A.matmul_reduce_scatter(leaf, w, g)
    if t > 1:   # rank 0 holds one position more than the others
        cases["unequal shards"] = lambda: A.all_gather_matmul(torch.randn(B, 2 + (r == 0), H, dtype=F64), w, g)
        # each rank's weight one row wider than the last: the partial sums that travel differ
        cases["weights of unequal width"] = lambda: A.matmul_reduce_scatter(
            torch.randn(B, 2 * t, H, dtype=F64), torch.randn(OUT + r, H, dtype=F64), g)
    if t == 3:  # the last rank is handed a group it is not in (only it calls: the others would wait)
        pair = dist.new_group([0, 1])
        if r == 2:
            cases["group without this rank"] = lambda: A.all_gather_matmul(torch.randn(B, 2, H, dtype=F64), w, pair)
            cases["MLP on a group without this rank"] = lambda: A.SequenceParallelMLP(*_mlp_pair(g, 2, 0), pair)
    got = {}
    for name, fn in cases.items():
        try:
            fn()
            got[name] = None
        except (ValueError, RuntimeError) as e:
            got[name] = str(e)
    # no_grad forward: works, and equals the forward with autograd
    fc_in, fc_out = _mlp_pair(g, t, 2)
    mlp = A.SequenceParallelMLP(fc_in, fc_out, g)
    x = torch.randn(B, 2, H, dtype=F64)
    with torch.no_grad():
        quiet = mlp(x)
    got["no_grad forward"] = _diff(quiet, mlp(x))
    return got


def checks(rank, world_size):
    g, t, r = dist.group.WORLD, world_size, rank
    out = {"diffs": {}, "counts": {}}
    for s in (2 * t, 3 * t):
        d, counts = _ops(g, t, r, s)
        out["diffs"].update({f"s={s} {k}": v for k, v in d.items()})
        out["counts"].update({f"s={s} {k}": (c.sends, c.bytes, c.matmul_rows, shard, full)
                              for k, (c, shard, full) in counts.items()})
        for decomposed in (True, False):
            for name, opt in (("SGD", lambda p: torch.optim.SGD(p, lr=0.1)), ("AdamW", lambda p: torch.optim.AdamW(p, lr=0.01))):
                d = _train(g, t, r, s, decomposed, opt)
                out["diffs"].update({f"s={s} {'ring' if decomposed else 'plain'} {name}: {k}": v for k, v in d.items()})
    # One forward + backward of the MLP: four decomposed ops and a re-gather, each t-1 sends
    fc_in, fc_out = _mlp_pair(g, t, 3)
    x = torch.randn(B, 2, H, dtype=F64, requires_grad=True)
    mlp = A.SequenceParallelMLP(fc_in, fc_out, g)
    with A.counting() as c:
        mlp(x).sum().backward()
    out["mlp step"] = (c.sends, len(c.matmul_rows))
    # what the column-parallel layer keeps for backward: this rank's slice, not the gathered input
    h = A.column_parallel(x, mlp.w_in, mlp.b_in, g)
    out["kept for backward"] = [tuple(v.shape) for v in h.grad_fn.saved_tensors]
    h.sum().backward()
    out["input shape"] = tuple(x.shape)
    out["misuse"] = _misuse(g, t, r)
    # the lecture's control run: the same ring with every transfer waited for at once
    with A.without_overlap(), A.counting() as c:
        d = _train(g, t, r, 2 * t, True, lambda p: torch.optim.SGD(p, lr=0.1))
    out["diffs"].update({f"ring without overlap: {k}": v for k, v in d.items()})
    out["without overlap sends"] = c.sends
    # the order of what a rank does: a transfer is posted, a partial matmul runs, then it is waited for
    x, w = torch.randn(B, 2 * t, H, dtype=F64), torch.randn(OUT, H, dtype=F64)
    out["events"] = {}
    for overlap in (True, False):
        with torch.no_grad(), A.counting() as c, (contextlib.nullcontext() if overlap else A.without_overlap()):
            A.all_gather_matmul(_split(x, 1, g), w, g)
            A.matmul_reduce_scatter(x, w, g)
        out["events"][overlap] = c.events
    if t == 4:   # two groups of 2: group ranks are not global ranks
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        d = _train(groups[r // 2], 2, r % 2, 6, True, lambda p: torch.optim.SGD(p, lr=0.1))
        out["diffs"].update({f"subgroup of 2: {k}": v for k, v in d.items()})
    return out


@pytest.fixture(scope="module")
def results():
    return {t: spawn(checks, t).returns for t in (1, 2, 3, 4)}


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_equals_plain_collectives_and_one_process(results, t):
    for rank, res in enumerate(results[t]):
        d = res["diffs"]
        assert len(d) >= 50
        bad = {k: v for k, v in d.items() if not v < 1e-12}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_sends_what_the_decomposition_sends(results, t):
    """Per decomposed op and rank: t−1 transfers of one shard each, (t−1)/t of the whole tensor
    (a ring all-gather's or reduce-scatter's bytes), and t partial matmuls of 1/t of the rows."""
    for res in results[t]:
        for name, (sends, sent, rows, shard, full) in res["counts"].items():
            s = int(name.split()[0][2:])
            assert sends == t - 1, name
            assert sent == (t - 1) * shard == (t - 1) * full // t, name
            assert rows == [B * s // t] * t, name
        # four decomposed ops and the backward's re-gather of fc_in's input (it kept only its slice)
        assert res["mlp step"] == (5 * (t - 1), 5 * t)
        assert res["without overlap sends"] == 2 * 5 * (t - 1)   # two steps: the same sends, waited at once


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_column_parallel_keeps_only_its_slice_for_backward(results, t):
    """The decomposed column-parallel layer keeps this rank's slice of the input (and
    re-gathers it in backward), not the gathered input, so SP's activation saving stands."""
    for res in results[t]:
        kept = res["kept for backward"]
        assert res["input shape"] in kept
        assert all(shape[1] <= res["input shape"][1] for shape in kept if len(shape) == 3)


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_misuse_fails_clearly_or_works(results, t):
    for res in results[t]:
        m = res["misuse"]
        assert "(batch, seq, hidden)" in m["2-D input"]
        assert "cannot multiply inputs with 7 features" in m["wrong weight"]
        assert "torch.float32 but the weight is torch.float64" in m["wrong dtype"]
        if t > 1:
            assert "does not split evenly" in m["sequence not divisible"]
            assert "shards differ" in m["unequal shards"]
        else:
            assert m["sequence not divisible"] is None       # one rank: nothing to split
        assert m["no_grad forward"] == 0
        assert "forward ring only" in m["all_gather_matmul with autograd"]
        assert "forward ring only" in m["matmul_reduce_scatter with autograd"]
        if t > 1:
            assert "shards differ" in m["weights of unequal width"]
    last = results[t][-1]["misuse"]
    if t == 3:
        assert "is not a member" in last["group without this rank"]
        assert "is not a member" in last["MLP on a group without this rank"]


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_every_transfer_travels_beside_a_partial_matmul(results, t):
    """Wang et al.'s point: between posting a transfer and waiting for it, the rank runs a partial
    matmul. The control run (without_overlap) waits at once: same sends, nothing beside them."""
    for res in results[t]:
        overlapped, serial = res["events"][True], res["events"][False]
        assert overlapped.count("post") == serial.count("post") == 2 * (t - 1)
        assert overlapped.count("matmul") == serial.count("matmul") == 2 * t
        for i, e in enumerate(overlapped):
            if e == "post":
                assert overlapped[i + 1] == "matmul" and "wait" in overlapped[i + 1:], overlapped
        for i, e in enumerate(serial):
            if e == "post":
                assert serial[i + 1] == "wait", serial
