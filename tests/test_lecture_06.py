"""Lecture 06: every context-parallel attention equals one-process attention (forward and all
gradients, float64, causal and not, contiguous and zig-zag layouts, sequence lengths that do not
split evenly), the context-parallel GPT equals the GPT, and expert parallelism equals the MoE."""
import functools

import pytest
import torch

from lectures import lecture_06_context_and_expert_parallel as L
from util import spawn
from tests.conftest import build

VARIANTS = ("ring", "all-gather", "ulysses")
LAYOUTS = ("contiguous", "zigzag")
CASES = [(v, layout, causal) for v in VARIANTS for layout in LAYOUTS for causal in (False, True)]
HEADS = 12                                   # divisible by 2, 3 and 4 (Ulysses splits heads)
SEQ = {2: 13, 3: 17, 4: 19}                  # lengths no layout splits evenly


@pytest.fixture(scope="module")
def shards():
    """Every case once per world size (one spawn each)."""
    return {n: spawn(L.attention_shards, n, cases=CASES, seq_len=SEQ[n], heads=HEADS).returns
            for n in SEQ}


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


def test_ring_on_subgroups():
    """Two rings of 2 inside 4 ranks, each on its own data: the group argument is honoured."""
    per_rank = spawn(L.attention_in_subgroups, 4, seq_len=11, heads=4).returns
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


@pytest.mark.parametrize("world_size,attention,layout", [(2, "ring", "zigzag"), (4, "ring", "contiguous"),
                                                         (2, "ulysses", "zigzag")])
def test_context_parallel_gpt_equals_gpt(world_size, attention, layout):
    ref = L.reference_gpt_gradients()
    per_rank = spawn(L.cp_gpt_gradients, world_size, attention=attention, layout=layout).returns
    assert per_rank[0]["loss"] == pytest.approx(ref["loss"], rel=1e-12)
    for r in per_rank:
        torch.testing.assert_close(r["logits"], ref["logits"][:, r["positions"]], rtol=1e-10, atol=1e-12)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(per_rank[0]["grads"][name], g, rtol=1e-9, atol=1e-12, msg=name)
