"""Dropout under tensor and sequence parallelism (lectures/tensor_parallel/rng.py).

One spawn per world size (1, 2, 3, 4) runs every check on the ranks; float64, awkward sizes
(batch 3, sequence 5 or 3·tp, width 7). What is checked: replicated masks are identical across
ranks and split masks are not (their agreement is p² + (1 − p)², as for independent masks, while
one seed everywhere agrees 100%); with one-process masks, a tensor-parallel MLP, a
sequence-parallel MLP and a head-split attention with dropout equal one process (outputs, every
gradient, parameters after SGD steps); torch.utils.checkpoint gives the gradients of no
recomputation with key-drawn masks, and not with a generator of its own; misuse is refused."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lectures.tensor_parallel import ColumnParallelLinear, MaskKey, RowParallelLinear, TPRandom, dropout, keep_mask
from lectures.tensor_parallel.ops import _all_gather
from util import spawn

F64 = torch.float64
P = 0.3
INDEPENDENT = P ** 2 + (1 - P) ** 2   # both dropped or both kept


def _gather(t, group):
    every = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, t.contiguous(), group=group)
    return every


def _agreements(keep, group):
    """Fraction of elements where each other rank's mask equals rank 0's."""
    every = _gather(keep.to(torch.uint8), group)
    return [(e == every[0]).double().mean().item() for e in every[1:]]


def _error(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


# -- the streams -------------------------------------------------------------------------

def stream_checks(group, n, r):
    out = {}
    streams = TPRandom(11, group)
    small, big = (3, 5, 7), (8, 50, 50)
    rep = keep_mask(streams.replicated("residual", 2), small, P)
    out["replicated identical on every rank"] = all(torch.equal(e, rep) for e in _gather(rep, group))
    out["same key, same mask"] = torch.equal(rep, keep_mask(streams.replicated("residual", 2), small, P))
    streams.next_step()
    out["next step, another mask"] = not torch.equal(rep, keep_mask(streams.replicated("residual", 2), small, P))
    split = keep_mask(streams.split("attention", 0), big, P)
    out["split agreements"] = _agreements(split, group) if n > 1 else []
    out["kept fraction"] = split.double().mean().item()
    ones = torch.ones(big, dtype=F64, requires_grad=True)
    dropped = dropout(ones, P, streams.split("attention", 0))
    dropped.sum().backward()
    scaled = split.double() / (1 - P)      # inverted dropout: kept values are scaled by 1/(1 - p)
    out["inverted dropout, forward and backward"] = torch.equal(dropped, scaled) and torch.equal(ones.grad, scaled)
    torch.manual_seed(5)   # the naive way: one seed everywhere, torch's default generator
    out["same-seed agreements"] = _agreements(torch.rand(big) >= P, group) if n > 1 else []
    # one_process slices: put together, they are the whole mask one process draws
    whole = keep_mask(TPRandom.single_process(11).one_process(1, "mlp", 0), (3, 6 * n, 7), P)
    streams.step = 0
    mine = keep_mask(streams.one_process(1, "mlp", 0), (3, 6, 7), P)
    out["one-process slices make the whole mask"] = torch.equal(torch.cat(_gather(mine, group), 1), whole)
    return out


# -- tensor- and sequence-parallel layers with dropout against one process ------------------

def _mlp(h, ff):
    torch.manual_seed(0)   # the same full weights on every rank
    return nn.Linear(h, ff, dtype=F64), nn.Linear(ff, h, dtype=F64)


def _run_mlp(fc_in, fc_out, x, G, streams, resid_key, steps=2, lr=0.1, recompute=False, drop=None):
    """`steps` SGD steps of out = x + drop(fc_out(drop(GELU(fc_in(x))))), loss sum(out · G).
    Returns the first step's output and gradients, and the parameters after the steps."""
    drop = drop or (lambda t, kind: dropout(t, P, streams.one_process(-1, "mlp hidden") if kind == "hidden"
                                            else resid_key(streams)))
    params = [fc_in.weight, fc_in.bias, fc_out.weight, fc_out.bias]
    first = None

    def block(xx):
        return xx + drop(fc_out(drop(F.gelu(fc_in(xx)), "hidden")), "residual")
    for _ in range(steps):
        xi = x.clone().requires_grad_(True)
        out = checkpoint(block, xi, use_reentrant=False) if recompute else block(xi)
        (out * G).sum().backward()
        if first is None:
            first = {"out": out.detach(), "x grad": xi.grad, "grads": [q.grad.clone() for q in params]}
        with torch.no_grad():
            for q in params:
                q -= lr * q.grad
                q.grad = None
        streams.next_step()
    return first, [q.detach().clone() for q in params]


def _full(col, row, grad=False):
    c, r = col.full_tensors(grad), row.full_tensors(grad)
    return [c["weight"], c["bias"], r["weight"], r["bias"]]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def mlp_checks(group, n, r, sequence_parallel):
    """TP (or SP) MLP with one-process dropout masks vs the same MLP in one process."""
    b, s, h, ff = 3, (3 * n if sequence_parallel else 5), 7, 6 * n
    fc_in, fc_out = _mlp(h, ff)
    gen = torch.Generator().manual_seed(1)
    x, G = torch.randn(b, s, h, dtype=F64, generator=gen), torch.randn(b, s, h, dtype=F64, generator=gen)
    # replicated residual without SP; with SP the residual is this rank's sequence shard
    resid = (lambda st: st.one_process(1, "residual")) if sequence_parallel else (lambda st: st.replicated("residual"))
    ref_first, ref_params = _run_mlp(fc_in, fc_out, x, G, TPRandom.single_process(3), resid)
    fc_in, fc_out = _mlp(h, ff)
    col = ColumnParallelLinear.from_full(fc_in, group, sequence_parallel=sequence_parallel)
    row = RowParallelLinear.from_full(fc_out, group, sequence_parallel=sequence_parallel)
    shard = (lambda t: t.chunk(n, 1)[r]) if sequence_parallel else (lambda t: t)
    whole = (lambda t: _all_gather(t, 1, group)) if sequence_parallel else (lambda t: t)
    streams = TPRandom(3, group)
    params = [col.weight, col.bias, row.weight, row.bias]
    first = None
    for _ in range(2):   # the same loop as _run_mlp, on the split layers
        xi = shard(x).clone().requires_grad_(True)
        hid = dropout(F.gelu(col(xi)), P, streams.one_process(-1, "mlp hidden"))
        out = xi + dropout(row(hid), P, resid(streams))
        (out * shard(G)).sum().backward()
        if first is None:
            first = {"out": whole(out.detach()), "x grad": whole(xi.grad), "grads": _full(col, row, grad=True)}
        with torch.no_grad():
            for q in params:
                q -= 0.1 * q.grad
                q.grad = None
        streams.next_step()
    return {"output": (first["out"] - ref_first["out"]).abs().max().item(),
            "input gradient": (first["x grad"] - ref_first["x grad"]).abs().max().item(),
            "parameter gradients": _max_diff(first["grads"], ref_first["grads"]),
            "parameters after 2 SGD steps": _max_diff(_full(col, row), ref_params)}


def _attention(q, k, v, o, x, heads, d, probs_dropout):
    """Causal attention with dropout on the probabilities; q, k, v, o are (column- or row-
    parallel) linears and `heads` the heads this rank holds."""
    b, s, _ = x.shape
    split = lambda t: t.view(b, s, heads, d).transpose(1, 2)
    scores = split(q(x)) @ split(k(x)).transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    probs = probs_dropout(scores.softmax(-1))
    return o((probs @ split(v(x))).transpose(1, 2).reshape(b, s, heads * d))


def attention_checks(group, n, r):
    """Heads split over the ranks, dropout on the attention probabilities (split on dim 1)."""
    b, s, h, d, heads = 3, 5, 7, 3, 2 * n
    torch.manual_seed(0)
    q, k, v = (nn.Linear(h, heads * d, dtype=F64) for _ in range(3))
    o = nn.Linear(heads * d, h, dtype=F64)
    gen = torch.Generator().manual_seed(2)
    x, G = torch.randn(b, s, h, dtype=F64, generator=gen), torch.randn(b, s, h, dtype=F64, generator=gen)
    one = TPRandom.single_process(4)
    xr = x.clone().requires_grad_(True)
    ref = _attention(q, k, v, o, xr, heads, d, lambda t: dropout(t, P, one.one_process(1, "attention", 0)))
    (ref * G).sum().backward()
    streams = TPRandom(4, group)
    qs, ks, vs = (ColumnParallelLinear.from_full(m, group) for m in (q, k, v))
    os_ = RowParallelLinear.from_full(o, group)
    xt = x.clone().requires_grad_(True)
    out = _attention(qs, ks, vs, os_, xt, heads // n, d, lambda t: dropout(t, P, streams.one_process(1, "attention", 0)))
    (out * G).sum().backward()
    grads = [m.full_tensors(grad=True)[p] for m in (qs, ks, vs, os_) for p in ("weight", "bias")]
    ref_grads = [getattr(m, p).grad for m in (q, k, v, o) for p in ("weight", "bias")]
    return {"output": (out - ref).abs().max().item(), "input gradient": (xt.grad - xr.grad).abs().max().item(),
            "parameter gradients": _max_diff(grads, ref_grads)}


# -- recomputation ---------------------------------------------------------------------------

def recompute_checks(group, n, r):
    """TP MLP gradients with and without torch.utils.checkpoint, masks from three sources."""
    h, ff = 7, 6 * n
    gen = torch.Generator().manual_seed(1)
    x, G = torch.randn(3, 5, h, dtype=F64, generator=gen), torch.randn(3, 5, h, dtype=F64, generator=gen)
    out = {}
    for source in ("TPRandom keys", "default generator", "a generator of its own"):
        firsts = []
        for recompute in (False, True):
            fc_in, fc_out = _mlp(h, ff)
            col, row = ColumnParallelLinear.from_full(fc_in, group), RowParallelLinear.from_full(fc_out, group)
            streams = TPRandom(9, group)
            torch.manual_seed(100 + r)   # the default generator: the same state for both runs
            own = torch.Generator().manual_seed(200 + r)
            if source == "TPRandom keys":
                drop = lambda t, kind: dropout(t, P, streams.split("hidden") if kind == "hidden" else streams.replicated("residual"))
            elif source == "default generator":   # (replicated masks would differ here: only the recomputation is checked)
                drop = lambda t, kind: F.dropout(t, P)
            else:
                drop = lambda t, kind, g=own: t * (torch.rand(t.shape, generator=g, dtype=t.dtype) >= P) / (1 - P)
            first, _ = _run_mlp(col, row, x, G, streams, None, steps=1, recompute=recompute, drop=drop)
            firsts.append(first)
        out[source] = max((firsts[0]["x grad"] - firsts[1]["x grad"]).abs().max().item(),
                          _max_diff(firsts[0]["grads"], firsts[1]["grads"]))
    return out


# -- misuse ----------------------------------------------------------------------------------

def misuse_checks(group, n, r):
    x = torch.randn(4, 6, dtype=F64)
    key = TPRandom(1, group).split("a")
    out = {f"p = {p!r}": _error(lambda p=p: dropout(x, p, key)) for p in (1.0, -0.1, True, "0.1")}
    out["float in a key"] = _error(lambda: MaskKey(("site", 1.5)))
    out["not a key"] = _error(lambda: dropout(x, P, 12345))
    out["integer tensor"] = _error(lambda: dropout(torch.ones(3, dtype=torch.int64), P, key))
    out["seed not an int"] = _error(lambda: TPRandom(1.0, group))
    out["non-contiguous works"] = torch.equal(dropout(x.t(), P, key), dropout(x.t().contiguous(), P, key))
    with torch.no_grad():
        out["no_grad works"] = torch.equal(dropout(x, P, key), dropout(x.clone().requires_grad_(True), P, key).detach())
    out["eval and p = 0 are the identity"] = dropout(x, P, key, training=False) is x and dropout(x, 0.0, key) is x
    if n > 1:
        out["different seeds"] = _error(lambda: TPRandom(r, group))
        outside = dist.new_group([0])          # every rank takes part in creating it
        out["a group this rank is not in"] = _error(lambda: TPRandom(1, outside)) if r > 0 else "not checked on rank 0"
        checked = TPRandom(1, group, check=True)
        if r == 0:
            checked.next_step()                # rank 0's step runs ahead of the others'
        out["steps out of step (check=True)"] = _error(lambda: checked.replicated("residual"))
    return out


def everything(rank, world_size):
    from lectures.tensor_parallel import deep_dives as L
    group, n, r = dist.group.WORLD, world_size, rank
    return {"streams": stream_checks(group, n, r), "TP MLP": mlp_checks(group, n, r, False),
            "SP MLP": mlp_checks(group, n, r, True), "attention": attention_checks(group, n, r),
            "recompute": recompute_checks(group, n, r), "misuse": misuse_checks(group, n, r),
            # the page's demo, at this world size
            "demo": {setup: L.dropout_block(rank, world_size, setup, steps=2, h=12) for setup in L.DROPOUT_SETUPS}
            if n > 1 else {}}


WORLD_SIZES = (1, 2, 3, 4)


@pytest.fixture(scope="module")
def results():
    return {n: spawn(everything, n).returns for n in WORLD_SIZES}


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_replicated_masks_agree_and_split_masks_are_independent(results, n):
    for s in (rank["streams"] for rank in results[n]):
        assert s["replicated identical on every rank"] and s["same key, same mask"] and s["next step, another mask"]
        assert abs(s["kept fraction"] - (1 - P)) < 0.02
        assert s["one-process slices make the whole mask"]
        assert s["inverted dropout, forward and backward"]
    if n > 1:
        for agreement in results[n][0]["streams"]["split agreements"]:
            assert abs(agreement - INDEPENDENT) < 0.02, (agreement, INDEPENDENT)
        assert results[n][0]["streams"]["same-seed agreements"] == [1.0] * (n - 1)


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("case", ["TP MLP", "SP MLP", "attention"])
def test_one_process_masks_make_tp_with_dropout_equal_one_process(results, n, case):
    for rank in results[n]:
        for what, diff in rank[case].items():
            assert diff < 1e-12, (case, what, diff)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_recomputation_redraws_key_masks_but_not_a_private_generator(results, n):
    for rank in results[n]:
        got = rank["recompute"]
        assert got["TPRandom keys"] < 1e-14, got
        assert got["default generator"] < 1e-14, got      # checkpoint restores this one
        assert got["a generator of its own"] > 1e-3, got  # and not this one: silently wrong gradients


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_misuse_is_refused_clearly(results, n):
    for r, rank in enumerate(results[n]):
        m = rank["misuse"]
        for p in ("1.0", "-0.1", "True", "'0.1'"):
            assert m[f"p = {p}"].startswith("ValueError") and "[0, 1)" in m[f"p = {p}"]
        assert m["float in a key"].startswith("TypeError") and "ints and strings" in m["float in a key"]
        assert m["not a key"].startswith("TypeError") and "MaskKey" in m["not a key"]
        assert m["integer tensor"].startswith("TypeError") and "floating-point" in m["integer tensor"]
        assert m["seed not an int"].startswith("TypeError")
        assert m["non-contiguous works"] and m["no_grad works"] and m["eval and p = 0 are the identity"]
        if n > 1:
            assert "different seeds" in m["different seeds"], m["different seeds"]
            if r > 0:
                assert "not a member" in m["a group this rank is not in"], m["a group this rank is not in"]
            assert "disagree" in m["steps out of step (check=True)"], m["steps out of step (check=True)"]


@pytest.mark.parametrize("n", WORLD_SIZES[1:])
def test_the_pages_demo_shows_each_failure_and_the_fix(results, n):
    demo = results[n][0]["demo"]
    mean = lambda xs: sum(xs) / len(xs)
    per, same, two, one = (demo[s] for s in ("per-rank seeds", "same seed", "two streams", "one-process masks"))
    assert per["spread"]["block output"] > 1e-3 and per["spread"]["LayerNorm weights"] > 0   # copies diverge
    assert abs(mean(per["residual agreement"]) - INDEPENDENT) < 0.1
    assert same["hidden agreement"] == [1.0, 1.0] and same["spread"]["block output"] == 0   # shards alike
    for right in (two, one):
        assert right["residual agreement"] == [1.0, 1.0] and max(right["spread"].values()) == 0
        assert abs(mean(right["hidden agreement"]) - INDEPENDENT) < 0.1
    assert one["vs one process"] < 1e-12
