"""Lecture 06: every context-parallel attention equals one-process attention (forward and all
gradients, float64, causal and not, contiguous and zig-zag layouts, sequence lengths that do not
split evenly), the context-parallel GPT equals the GPT, and expert parallelism equals the MoE."""
import functools

import pytest
import torch

from lectures import attention_blocks
from lectures import lecture_06_context_and_expert_parallel as L
from util import spawn
from tests.conftest import built

VARIANTS = ("ring", "all-gather", "ulysses")
LAYOUTS = ("contiguous", "zigzag")
CASES = [(v, layout, causal) for v in VARIANTS for layout in LAYOUTS for causal in (False, True)]
HEADS = 12                                   # divisible by 2, 3 and 4 (Ulysses splits heads)
SEQ = {2: 13, 3: 17, 4: 19}                  # lengths no layout splits evenly


MOE_CASES = {
    # name: (layer, tokens per rank)
    "top-2, drops": (dict(n_experts=6, top_k=2, capacity_factor=0.75), [9, 14, 5, 11]),
    "top-1, drops": (dict(n_experts=5, top_k=1, capacity_factor=1.0), [12, 7, 10, 3]),
    "top-2, no drops": (dict(n_experts=6, top_k=2, capacity_factor=None), [9, 14, 5, 11]),
    "a rank with no tokens": (dict(n_experts=3, top_k=1, capacity_factor=1.0), [8, 0, 6, 5]),
}


GPT_CASES = {2: [("ring", "zigzag"), ("ulysses", "contiguous")], 3: [("ring", "contiguous")],
             4: [("ring", "zigzag"), ("all-gather", "zigzag")]}


def everything(rank, world_size):
    """All of one world size's checks in one spawn (starting ranks is the expensive part)."""
    return {"attention": L.attention_shards(rank, world_size, cases=CASES, seq_len=SEQ[world_size], heads=HEADS),
            "gpt": {case: L.cp_gpt_gradients(rank, world_size, *case) for case in GPT_CASES[world_size]},
            "moe": {name: L.expert_parallel_check(rank, world_size, layer_kw=kw, tokens_per_rank=tokens[:world_size])
                    for name, (kw, tokens) in MOE_CASES.items()},
            "subgroups": L.attention_in_subgroups(rank, world_size, seq_len=11, heads=4) if world_size == 4 else None,
            "pytorch": L.pytorch_context_parallel_attention(rank, world_size, seq_len=8 * world_size, heads=4)
            if world_size != 3 else None}


@pytest.fixture(scope="module")
def runs():
    return {n: spawn(everything, n).returns for n in SEQ}


@pytest.fixture(scope="module")
def shards(runs):
    return {n: [r["attention"] for r in runs[n]] for n in SEQ}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'causal' if c[2] else 'full'}")
@pytest.mark.parametrize("world_size", sorted(SEQ))
def test_attention_equals_one_process(shards, world_size, case):
    variant, layout, causal = case
    q, k, v, dout = L.attention_inputs(SEQ[world_size], HEADS)
    reference = L.reference_attention(q, k, v, dout, causal)
    per_rank = shards[world_size]
    for i, (name, ref) in enumerate(zip(("output", "dQ", "dK", "dV"), reference)):
        got = L.unshard_sequence([per_rank[r][case][i] for r in range(world_size)], 2, layout)
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_zigzag_round_trip_and_balance():
    for n, total in [(1, 5), (2, 8), (3, 17), (4, 19), (4, 8), (3, 4)]:
        x = torch.arange(total * 3).view(3, total)
        shards = [L.zigzag_shard(x, r, n, dim=1) for r in range(n)]
        assert torch.equal(L.zigzag_unshard(shards, dim=1), x)
        lengths = [s.shape[1] for s in shards]
        assert max(lengths) - min(lengths) <= 2
        for r, segs in enumerate(L.layout_segments(lengths, "zigzag")):
            positions = torch.cat([torch.arange(g, g + m) for _, m, g in segs])
            assert torch.equal(positions, L.sequence_positions(total, r, n, "zigzag"))
            assert torch.equal(shards[r][0], positions)
    # rank 0 holds the first and the last chunk
    assert L.sequence_positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    with pytest.raises(ValueError, match="zigzag_shard"):
        L.layout_segments([3, 5], "zigzag")


def test_merge_partials_is_softmax_over_the_union():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    scale = 0.5
    a = L._block_forward(q, k[:, :, :2], v[:, :, :2], scale, None)
    b = L._block_forward(q, k[:, :, 2:], v[:, :, 2:], scale, None)
    out, lse = L.merge_partials(*a, *b)
    s = q @ k.transpose(-1, -2) * scale
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    # a fully masked partial (lse = -inf) changes nothing, and no NaN appears
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    out2, lse2 = L.merge_partials(*empty, out, lse)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_ring_on_subgroups(runs):
    """Two rings of 2 inside 4 ranks, each on its own data: the group argument is honoured."""
    per_rank = [r["subgroups"] for r in runs[4]]
    for half in (0, 1):
        q, k, v, dout = L.attention_inputs(11, 4, seed=half)
        reference = L.reference_attention(q, k, v, dout, causal=True)
        for i, ref in enumerate(reference):
            got = L.zigzag_unshard([per_rank[2 * half + r][i] for r in range(2)], dim=2)
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_misuse_is_refused_or_works():
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="same shape"):
        L.full_attention(q, q[:, :2], q)
    # non-contiguous inputs and no_grad work
    qt = torch.randn(1, 6, 4, 8, dtype=torch.float64).transpose(1, 2)
    with torch.no_grad():
        got = L.full_attention(qt, qt, qt, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(qt, qt, qt, is_causal=True)
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("world_size,case", [(n, c) for n in GPT_CASES for c in GPT_CASES[n]])
def test_context_parallel_gpt_equals_gpt(runs, world_size, case):
    ref = L.reference_gpt_gradients()
    per_rank = [r["gpt"][case] for r in runs[world_size]]
    assert per_rank[0]["loss"] == pytest.approx(ref["loss"], rel=1e-12)
    for r in per_rank:
        torch.testing.assert_close(r["logits"], ref["logits"][:, r["positions"]], rtol=1e-10, atol=1e-12)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(per_rank[0]["grads"][name], g, rtol=1e-9, atol=1e-12, msg=name)



@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_expert_parallel_equals_moe(runs, world_size, case):
    layer_kw, tokens = MOE_CASES[case]
    tokens = tokens[:world_size]
    ref = L.moe_reference(layer_kw, tokens)
    per_rank = [r["moe"][case] for r in runs[world_size]]
    if "no drops" in case:
        assert ref["stats"]["dropped"] == 0
    else:
        assert ref["stats"]["dropped"] > 0, "the case must exercise dropped tokens"
    assert torch.equal(torch.cat([r["keep"] for r in per_rank]), ref["keep"]), "different tokens dropped"
    for name in ("out", "x_grad"):
        torch.testing.assert_close(torch.cat([r[name] for r in per_rank]), ref[name], rtol=1e-10, atol=1e-12)
    assert per_rank[0]["aux"] == pytest.approx(ref["aux"], rel=1e-12)
    seen = {}
    for r in per_rank:
        seen.update(r["grads"])
    assert set(seen) == set(ref["grads"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(seen[name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_moe_routing_and_capacity():
    moe = L.moe_layer(n_experts=4, top_k=2, capacity_factor=0.5)
    x = torch.randn(20, moe.d_model, dtype=torch.float64)
    out = moe(x)
    s = moe.stats
    assert s["capacity"] == 5 and sum(s["tokens_per_expert"]) == 40
    assert all(k <= 5 for k in s["kept_per_expert"])
    assert s["dropped"] == 40 - sum(s["kept_per_expert"]) > 0
    # a token's output is the gate-weighted sum of its kept experts
    probs = torch.softmax(moe.router(x), -1)
    top, idx = probs.topk(2, -1)
    gates = top / top.sum(-1, keepdim=True)
    expect = torch.zeros_like(x)
    for t in range(20):
        for i in range(2):
            if s["keep"][t, i]:
                expect[t] += gates[t, i] * moe.experts[idx[t, i]](x[t])
    torch.testing.assert_close(out, expect)
    # first choices have priority: a dropped first choice means that expert's queue is all first choices
    with pytest.raises(ValueError, match="top_k"):
        L.MoE(8, 8, 2, top_k=3)


def test_balance_loss_has_the_published_form():
    """Switch Transformer eq. 4: α·E·Σ f_i·P_i, f_i the fraction of tokens sent (first choice)
    to expert i, P_i the mean router probability; 1 when routing is uniform, up to E when collapsed."""
    moe = L.moe_layer(n_experts=4, top_k=1, capacity_factor=None)
    x = torch.randn(32, moe.d_model, dtype=torch.float64)
    moe(x)
    probs = torch.softmax(moe.router(x), -1)
    f = torch.bincount(probs.argmax(-1), minlength=4).double() / 32
    assert moe.aux_loss.item() == pytest.approx(4 * (f * probs.mean(0)).sum().item(), rel=1e-12)
    # only P carries a gradient (f is a count)
    moe.router.weight.grad = None
    moe.aux_loss.backward()
    expect = torch.autograd.grad(4 * (f * torch.softmax(moe.router(x), -1).mean(0)).sum(), moe.router.weight)[0]
    torch.testing.assert_close(moe.router.weight.grad, expect)
    # uniform routing -> 1; everything on one expert with certainty -> E
    E = 4
    uniform = L.balance_loss(torch.full((E,), 32 / E, dtype=torch.float64), torch.full((E,), 8), 32, E)
    collapsed = L.balance_loss(torch.tensor([32.0, 0, 0, 0], dtype=torch.float64), torch.tensor([32, 0, 0, 0]), 32, E)
    assert uniform.item() == pytest.approx(1.0) and collapsed.item() == pytest.approx(E)


@pytest.mark.parametrize("world_size", [2, 4])
def test_pytorch_context_parallel_with_the_cpu_shim(runs, world_size):
    """PyTorch's ring (through our shim) equals one process; it merges partials in float32."""
    S = 8 * world_size
    q, k, v, dout = L.attention_inputs(S, 4)
    reference = L.reference_attention(q, k, v, dout, causal=True)
    per_rank = [r["pytorch"] for r in runs[world_size]]
    for i, ref in enumerate(reference):
        got = L.zigzag_unshard([x[i] for x in per_rank], dim=2)   # head-tail = our zig-zag
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_block_math_with_and_without_the_fused_kernel(monkeypatch, fused):
    """Our own block math and PyTorch's fused CPU kernel give the same attention, on segments
    whose causal blocks are square, and on uneven ones that need our mask."""
    monkeypatch.setattr(attention_blocks, "FUSED", fused)
    q, k, v, dout = L.attention_inputs(13, 3)
    for segs in ([(0, 13, 0)], [(0, 5, 0), (5, 4, 5), (9, 4, 9)], [(0, 6, 0), (6, 7, 6)]):
        for causal in (False, True):
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            out = L.SegmentAttention.apply(ql, kl, vl, segs, segs, causal)
            out.backward(dout)
            ref = L.reference_attention(q, k, v, dout, causal)
            for got, want in zip((out, ql.grad, kl.grad, vl.grad), ref):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_quick_build(course_site):
    site = built(course_site, "lecture_06_context_and_expert_parallel")    # the session's one quick build
    assert (site / "lecture_06_context_and_expert_parallel.json").exists()
