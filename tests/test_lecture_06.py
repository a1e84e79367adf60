"""Lecture 06: every context-parallel attention equals one-process attention (forward and all
gradients, float64, causal and not, contiguous and zig-zag layouts, sequence lengths that do not
split evenly), the context-parallel GPT equals the GPT, and expert parallelism equals the MoE."""
import functools

import pytest
import torch
import torch.distributed as dist

from lectures.context_parallel import blocks as attention_blocks
from lectures.context_parallel import (ATTENTION, ExpertParallelMoE, MoE, RankCapacityMoE, SegmentAttention,
                                       balance_loss, context_parallel_gpt, full_attention, layout_segments,
                                       route_logits, sequence_positions, ulysses_attention, unshard_sequence,
                                       zigzag_shard)
from lectures.context_parallel.blocks import _block_forward
from lectures.context_parallel.demos import (AUX_WEIGHT, attention_inputs, attention_shards, balance_ceiling,
                                             cp_gpt_gradients, ep_dp_groups, expert_data_parallel,
                                             expert_parallel_check, moe_inputs, moe_layer, moe_reference, rank_compute,
                                             reference_attention, reference_gpt_gradients, ring_trace, ring_work,
                                             share_spread, train_moe_gpt, whole_diagonal_ceiling)
from lectures.model import merge_attention
from lectures.context_parallel import deep_dives, demos
from lectures.context_parallel import moe as moe_layers
from lectures.context_parallel import sharding as sequence_layout
from lectures import lecture_06_context_and_expert_parallel as L
from lectures.model import gpt as gpt_model
from util import spawn
from tests.conftest import built

VARIANTS = ("ring", "all-gather", "ulysses")
LAYOUTS = ("contiguous", "zigzag")
CASES = [(v, layout, causal) for v in VARIANTS for layout in LAYOUTS for causal in (False, True)]
HEADS = 12                                   # divisible by 2, 3 and 4 (Ulysses splits heads)
SEQ = {2: 13, 3: 17, 4: 19}                  # lengths no layout splits evenly


MOE_CASES = {
    # name: (layer, tokens per rank, whether choices are dropped)
    "top-2, drops": (dict(n_experts=6, top_k=2, capacity_factor=0.75), [9, 14, 5, 11], True),
    "top-1, drops": (dict(n_experts=5, top_k=1, capacity_factor=1.0), [12, 7, 10, 3], True),
    "top-2, dropless": (dict(n_experts=6, top_k=2, capacity_factor=None), [9, 14, 5, 11], False),
    "a rank with no tokens": (dict(n_experts=3, top_k=1, capacity_factor=1.0), [8, 0, 6, 5], True),
    "shared experts, drops": (dict(n_experts=4, top_k=2, capacity_factor=0.75, n_shared=2), [9, 14, 5, 11], True),
    "no tokens anywhere": (dict(n_experts=3, top_k=2, capacity_factor=1.0, n_shared=1), [0, 0, 0, 0], False),
}
CAPACITY = ("global", "rank")          # ExpertParallelMoE, RankCapacityMoE


GPT_CASES = {2: [("ring", "zigzag"), ("ulysses", "contiguous")], 3: [("ring", "contiguous")],
             4: [("ring", "zigzag"), ("all-gather", "zigzag")]}


def everything(rank, world_size):
    """All of one world size's checks in one spawn (starting ranks is the expensive part)."""
    return {"attention": attention_shards(rank, world_size, cases=CASES, seq_len=SEQ[world_size], heads=HEADS),
            "gpt": {case: cp_gpt_gradients(rank, world_size, *case) for case in GPT_CASES[world_size]},
            "moe": {(name, cap): expert_parallel_check(rank, world_size, layer_kw=kw, tokens_per_rank=tokens[:world_size],
                                                       capacity=cap)
                    for name, (kw, tokens, _) in MOE_CASES.items() for cap in CAPACITY},
            "subgroups": demos.attention_in_subgroups(rank, world_size, seq_len=11, heads=4) if world_size == 4 else None,
            "pytorch": {how: deep_dives.pytorch_context_parallel_attention(rank, world_size, seq_len=8 * world_size, heads=4,
                                                                  rotate=how) for how in ("allgather", "alltoall")}
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
    q, k, v, dout = attention_inputs(SEQ[world_size], HEADS)
    reference = reference_attention(q, k, v, dout, causal)
    per_rank = shards[world_size]
    for i, (name, ref) in enumerate(zip(("output", "dQ", "dK", "dV"), reference)):
        got = unshard_sequence([per_rank[r][case][i] for r in range(world_size)], 2, layout)
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_zigzag_round_trip_and_balance():
    for n, total in [(1, 5), (2, 8), (3, 17), (4, 19), (4, 8), (3, 4)]:
        x = torch.arange(total * 3).view(3, total)
        shards = [zigzag_shard(x, r, n, dim=1) for r in range(n)]
        assert torch.equal(sequence_layout.zigzag_unshard(shards, dim=1), x)
        lengths = [s.shape[1] for s in shards]
        assert max(lengths) - min(lengths) <= 2
        for r, segs in enumerate(layout_segments(lengths, "zigzag")):
            positions = torch.cat([torch.arange(g, g + m) for _, m, g in segs])
            assert torch.equal(positions, sequence_positions(total, r, n, "zigzag"))
            assert torch.equal(shards[r][0], positions)
    # rank 0 holds the first and the last chunk
    assert sequence_positions(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    with pytest.raises(ValueError, match="zigzag_shard"):
        layout_segments([3, 5], "zigzag")


def test_merge_partials_is_softmax_over_the_union():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    scale = 0.5
    a = _block_forward(q, k[:, :, :2], v[:, :, :2], scale, None)
    b = _block_forward(q, k[:, :, 2:], v[:, :, 2:], scale, None)
    out, lse = merge_attention(*a, *b)
    s = q @ k.transpose(-1, -2) * scale
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    # a fully masked partial (lse = -inf) changes nothing, and no NaN appears
    empty = (torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    out2, lse2 = merge_attention(*empty, out, lse)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_ring_on_subgroups(runs):
    """Two rings of 2 inside 4 ranks, each on its own data: the group argument is honoured."""
    per_rank = [r["subgroups"] for r in runs[4]]
    for half in (0, 1):
        q, k, v, dout = attention_inputs(11, 4, seed=half)
        reference = reference_attention(q, k, v, dout, causal=True)
        for i, ref in enumerate(reference):
            got = sequence_layout.zigzag_unshard([per_rank[2 * half + r][i] for r in range(2)], dim=2)
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_misuse_is_refused_or_works():
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="same shape"):
        full_attention(q, q[:, :2], q)
    # non-contiguous inputs and no_grad work
    qt = torch.randn(1, 6, 4, 8, dtype=torch.float64).transpose(1, 2)
    with torch.no_grad():
        got = full_attention(qt, qt, qt, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(qt, qt, qt, is_causal=True)
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("world_size,case", [(n, c) for n in GPT_CASES for c in GPT_CASES[n]])
def test_context_parallel_gpt_equals_gpt(runs, world_size, case):
    ref = reference_gpt_gradients()
    per_rank = [r["gpt"][case] for r in runs[world_size]]
    assert per_rank[0]["loss"] == pytest.approx(ref["loss"], rel=1e-12)
    for r in per_rank:
        torch.testing.assert_close(r["logits"], ref["logits"][:, r["positions"]], rtol=1e-10, atol=1e-12)
    for name, g in ref["grads"].items():
        torch.testing.assert_close(per_rank[0]["grads"][name], g, rtol=1e-9, atol=1e-12, msg=name)



@pytest.mark.parametrize("capacity", CAPACITY)
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_expert_parallel_equals_moe(runs, world_size, case, capacity):
    """ExpertParallelMoE equals MoE on all ranks' tokens together; RankCapacityMoE (capacity per
    rank, no count all-gather) equals MoE on each rank's tokens as a batch of its own. Shared
    experts, dropless routing and ranks without tokens included; the balance loss is never NaN."""
    layer_kw, tokens, drops = MOE_CASES[case]
    tokens = tokens[:world_size]
    ref = moe_reference(layer_kw, tokens, capacity=capacity)
    per_rank = [r["moe"][case, capacity] for r in runs[world_size]]
    assert (ref["dropped"] > 0) == drops, "the case must (not) exercise dropped tokens"
    assert torch.equal(torch.cat([r["keep"] for r in per_rank]), ref["keep"]), "different tokens dropped"
    for name in ("out", "x_grad"):
        torch.testing.assert_close(torch.cat([r[name] for r in per_rank]), ref[name], rtol=1e-10, atol=1e-12)
    assert per_rank[0]["aux"] == pytest.approx(ref["aux"], rel=1e-12) and ref["aux"] == ref["aux"]   # not NaN
    seen = {}
    for r in per_rank:
        seen.update(r["grads"])
    assert set(seen) == set(ref["grads"])
    for name, g in ref["grads"].items():
        torch.testing.assert_close(seen[name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_moe_routing_and_capacity():
    moe = moe_layer(n_experts=4, top_k=2, capacity_factor=0.5)
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
        MoE(8, 8, 2, top_k=3)


def test_balance_loss_has_the_published_form():
    """Switch Transformer eq. 4: α·E·Σ f_i·P_i, f_i the fraction of tokens sent (first choice)
    to expert i, P_i the mean router probability; 1 when routing is uniform, up to E when collapsed."""
    moe = moe_layer(n_experts=4, top_k=1, capacity_factor=None)
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
    uniform = balance_loss(torch.full((E,), 32 / E, dtype=torch.float64), torch.full((E,), 8), 32, E)
    collapsed = balance_loss(torch.tensor([32.0, 0, 0, 0], dtype=torch.float64), torch.tensor([32, 0, 0, 0]), 32, E)
    assert uniform.item() == pytest.approx(1.0) and collapsed.item() == pytest.approx(E)


@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_pytorch_context_parallel_with_the_cpu_shim(runs, world_size, rotate):
    """PyTorch's context_parallel (through our shim), with either rotate method, equals one
    process; it merges partials in float32."""
    S = 8 * world_size
    q, k, v, dout = attention_inputs(S, 4)
    reference = reference_attention(q, k, v, dout, causal=True)
    per_rank = [r["pytorch"][rotate] for r in runs[world_size]]
    for i, ref in enumerate(reference):
        got = sequence_layout.zigzag_unshard([x[i] for x in per_rank], dim=2)   # head-tail = our zig-zag
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_block_math_with_and_without_the_fused_kernel(monkeypatch, fused):
    """Our own block math and PyTorch's fused CPU kernel give the same attention, on segments
    whose causal blocks are square, and on uneven ones that need our mask."""
    monkeypatch.setattr(attention_blocks, "FUSED", fused)
    q, k, v, dout = attention_inputs(13, 3)
    for segs in ([(0, 13, 0)], [(0, 5, 0), (5, 4, 5), (9, 4, 9)], [(0, 6, 0), (6, 7, 6)]):
        for causal in (False, True):
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            out = SegmentAttention.apply(ql, kl, vl, segs, segs, causal)
            out.backward(dout)
            ref = reference_attention(q, k, v, dout, causal)
            for got, want in zip((out, ql.grad, kl.grad, vl.grad), ref):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)



# --- Misuse and edge cases found by trying ----------------------------------------------------

def one_rank_groups(rank, world_size):
    """Every variant on a group of one rank (each rank its own), forward and backward; the
    context-parallel GPT on a group of one."""
    groups = [dist.new_group([r]) for r in range(world_size)]
    q, k, v, dout = attention_inputs(10, 4)
    out = {}
    for variant in VARIANTS:
        for causal in (False, True):
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            o = ATTENTION[variant](ql, kl, vl, causal=causal, group=groups[rank], layout="zigzag")
            o.backward(dout)
            out[variant, causal] = [t.detach() for t in (o, ql.grad, kl.grad, vl.grad)]
    cfg = demos.gpt_config("float64")
    model = context_parallel_gpt(gpt_model.GPT(cfg), group=groups[rank])
    tokens, targets = gpt_model.batch(cfg, 2, step=0)
    gpt_model.loss_fn(model(tokens), targets).backward()
    out["gpt"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


def test_a_group_of_one_rank_is_plain_attention():
    runs = spawn(one_rank_groups, 2).returns
    q, k, v, dout = attention_inputs(10, 4)
    for variant in VARIANTS:
        for causal in (False, True):
            for got, want in zip(runs[1][variant, causal], reference_attention(q, k, v, dout, causal)):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"{variant} {causal}")
    cfg = demos.gpt_config("float64")
    model = gpt_model.GPT(cfg)
    tokens, targets = gpt_model.batch(cfg, 2, step=0)
    gpt_model.loss_fn(model(tokens), targets).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(runs[0]["gpt"][n], p.grad, rtol=1e-10, atol=1e-12, msg=n)


def outside_the_group(rank, world_size):
    """Rank 1 calls every building block with a group it does not belong to: each must refuse."""
    group = dist.new_group([0])
    if rank == 0:
        return None
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    errors = {}
    for variant in VARIANTS:
        try:
            errors[variant] = repr(ATTENTION[variant](q, q, q, causal=True, group=group))
        except Exception as e:                                          # noqa: BLE001
            errors[variant] = f"{type(e).__name__}: {e}"
    moe = moe_layer(n_experts=4, top_k=1)
    try:
        ep = ExpertParallelMoE.from_full(moe, group=group)
        errors["moe"] = repr(ep(torch.randn(5, moe.d_model, dtype=torch.float64)))
    except Exception as e:                                              # noqa: BLE001
        errors["moe"] = f"{type(e).__name__}: {e}"
    return errors


def test_a_rank_outside_the_group_is_refused():
    errors = spawn(outside_the_group, 2).returns[1]
    for what, msg in errors.items():
        assert msg.startswith("ValueError") and "not a member" in msg, (what, msg)


def test_a_rank_beyond_the_group_is_refused():
    x = torch.arange(16)
    for fn in (lambda: zigzag_shard(x, 2, 2, 0), lambda: sequence_positions(16, 2, 2, "zigzag"),
               lambda: sequence_positions(16, 4, 2, "contiguous"), lambda: zigzag_shard(x, -1, 2, 0)):
        with pytest.raises(ValueError, match="group rank|not in a group"):
            fn()


# --- Grouped-query attention: K/V travel with their own heads ---------------------------------

def gqa_shards(rank, world_size, seq_len, heads, kv_heads):
    """Every variant with kv_heads < heads (causal, zig-zag): local outputs and gradients, and the
    bytes this rank sent with kv_heads and with the K/V repeated to every head first."""
    from util.measure import bytes_sent
    q, _, _, dout = attention_inputs(seq_len, heads, head_dim=16)
    _, k, v, _ = attention_inputs(seq_len, kv_heads, head_dim=16, seed=1)
    shard = lambda t: sequence_layout.shard_sequence(t, rank, world_size, 2, "zigzag")
    out, sent = {}, {}
    for variant in VARIANTS:
        for name, (kk, vv) in {"gqa": (k, v), "repeated": (k.repeat_interleave(heads // kv_heads, 1),
                                                          v.repeat_interleave(heads // kv_heads, 1))}.items():
            ql, kl, vl = (shard(t).requires_grad_() for t in (q, kk, vv))
            dist.barrier()
            with bytes_sent() as s:
                o = ATTENTION[variant](ql, kl, vl, causal=True, layout="zigzag")
                o.backward(shard(dout))
            sent[variant, name] = s.bytes
            if name == "gqa":
                out[variant] = [t.detach() for t in (o, ql.grad, kl.grad, vl.grad)]
    try:                                   # Ulysses needs the K/V heads to split over the ranks too
        ulysses_attention(shard(q), shard(k[:, :1]), shard(v[:, :1]), causal=True, layout="zigzag")
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return {"out": out, "sent": sent, "refusal": refusal}


def test_grouped_query_attention_sends_kv_heads():
    heads, kv_heads, S = 8, 2, 64
    runs = spawn(gqa_shards, 2, seq_len=S, heads=heads, kv_heads=kv_heads).returns
    q, _, _, dout = attention_inputs(S, heads, head_dim=16)
    _, k, v, _ = attention_inputs(S, kv_heads, head_dim=16, seed=1)
    kr, vr = (t.repeat_interleave(heads // kv_heads, 1).detach().requires_grad_() for t in (k, v))
    qr = q.clone().requires_grad_()
    ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    ref.backward(dout)
    fold = lambda g: g.view(g.shape[0], kv_heads, heads // kv_heads, *g.shape[2:]).sum(2)
    for variant in VARIANTS:
        for i, want in enumerate((ref.detach(), qr.grad, fold(kr.grad), fold(vr.grad))):
            got = sequence_layout.zigzag_unshard([r["out"][variant][i] for r in runs], 2)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"{variant} {i}")
    sent = runs[0]["sent"]
    # ring and all-gather move only K/V (and dK/dV): a quarter of the bytes, headers aside
    for variant in ("ring", "all-gather"):
        assert sent[variant, "gqa"] < 0.3 * sent[variant, "repeated"], (variant, sent)
    assert sent["ulysses", "gqa"] < 0.8 * sent["ulysses", "repeated"], sent
    assert "K/V heads" in runs[0]["refusal"]


def test_pytorch_default_rotation_is_all_gather():
    """torch 2.13's context_parallel all-gathers K/V unless told otherwise; rotate_method restores."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    assert cp._cp_options.rotate_method == cp._RotateMethod.ALL_GATHER
    with deep_dives.rotate_method("alltoall"):
        assert cp._cp_options.rotate_method == cp._RotateMethod.ALL_TO_ALL
    assert cp._cp_options.rotate_method == cp._RotateMethod.ALL_GATHER


def traced_work(rank, world_size, seq_len):
    return {layout: ring_trace(rank, world_size, seq_len, heads=2, head_dim=8, layout=layout, causal=True,
                               repeats=1)["work"] for layout in ("contiguous", "zigzag")}


def test_causal_work_counts_skipped_entries_and_zigzag_balances_it():
    """Contiguous chunks: (2n − 1) : 1 once the masked half of the diagonal block is skipped; zig-zag
    and striped: equal shares. The ring's own count of the entries its blocks computed (segment
    planner) equals the position formula (a query at p sees p + 1 keys)."""
    S = 4096
    for n in (2, 4, 8):
        c = ring_work(S, n, "contiguous")
        assert max(c) / min(c) == pytest.approx(2 * n - 1, rel=0.01)
        assert ring_work(S, n, "zigzag") == [ring_work(S, n, "zigzag")[0]] * n
        st = ring_work(S, n, "striped")
        assert max(st) / min(st) < 1.01
    assert sum(ring_work(S, 4, "contiguous")) == S * (S + 1) // 2
    runs = spawn(traced_work, 2, seq_len=30).returns
    for rank, got in enumerate(runs):
        for layout in ("contiguous", "zigzag"):
            assert got[layout] == 2 * ring_work(30, 2, layout)[rank]        # forward + backward


def test_expert_gradients_reduce_over_their_groups():
    """EP = 2 inside DP = 2: router over all ranks, experts over their expert-data-parallel group
    equals one process; either mistake does not."""
    kw = dict(d_model=8, d_ff=12, n_experts=4, top_k=2, capacity_factor=None)
    runs = spawn(expert_data_parallel, 4, ep=2, layer_kw=kw, tokens=7).returns
    moe = moe_layer(**kw)
    xs, ws = moe_inputs(4, [7] * 4, moe.d_model)
    (moe(torch.cat(xs)) * torch.cat(ws)).sum().backward()
    assert ep_dp_groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    for way in ("right", "router over EP only", "experts over all ranks"):
        got = {}
        for r in runs:
            got.update(r[way])
        assert set(got) == {n for n, _ in moe.named_parameters()}
        err = max((got[n] - p.grad).abs().max().item() for n, p in moe.named_parameters())
        assert (err < 1e-12) == (way == "right"), (way, err)


def test_bias_balancing_moves_the_choice_not_the_gate_and_z_loss():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]], dtype=torch.float64)
    probs, idx, gates = route_logits(logits, 1)
    assert idx[:, 0].tolist() == [0, 2]
    bias = torch.tensor([0.0, 1.0, 0.0])
    probs_b, idx_b, gates_b = route_logits(logits, 1, bias)
    assert idx_b[:, 0].tolist() == [1, 1]                           # the bias changes the choice ...
    torch.testing.assert_close(gates_b[:, 0], probs[:, 1])          # ... the gate is the unbiased probability
    moe = moe_layer(n_experts=3, top_k=1, capacity_factor=None)
    moe.bias_update = 0.5
    moe(torch.randn(30, moe.d_model, dtype=torch.float64))
    load = torch.tensor(moe.stats["tokens_per_expert"], dtype=torch.float64)
    moe.update_bias()
    torch.testing.assert_close(moe.expert_bias, 0.5 * torch.sign(load.mean() - load))
    torch.testing.assert_close(moe_layers.z_loss(logits), torch.logsumexp(logits, -1).pow(2).mean())


def biased_expert_parallel(rank, world_size, steps=3):
    """MoE with DeepSeek-V3's bias (set and moving) against its expert-parallel copy: outputs and
    the bias after each `update_bias`, per step."""
    moe = moe_layer(n_experts=4, top_k=1, capacity_factor=None)
    moe.bias_update = 0.01
    moe.expert_bias.copy_(torch.tensor([1.0, -1.0, 0.0, 0.0]))
    ep = ExpertParallelMoE.from_full(moe)
    out = []
    for step in range(steps):
        xs, _ = moe_inputs(world_size, [7] * world_size, moe.d_model, seed=step)
        with torch.no_grad():
            y = ep(xs[rank])
        ep.update_bias()
        out.append({"out": y, "bias": ep.expert_bias.clone()})
    return out


def test_expert_parallel_keeps_deepseek_bias():
    """from_full keeps expert_bias and bias_update: without them the EP copy routes differently
    (max |Δ output| 0.3 on one rank). The copy must route with the bias and move it by the global load."""
    runs = spawn(biased_expert_parallel, 2).returns
    moe = moe_layer(n_experts=4, top_k=1, capacity_factor=None)
    moe.bias_update = 0.01
    moe.expert_bias.copy_(torch.tensor([1.0, -1.0, 0.0, 0.0]))
    for step in range(3):
        xs, _ = moe_inputs(2, [7, 7], moe.d_model, seed=step)
        with torch.no_grad():
            want = moe(torch.cat(xs))
        moe.update_bias()
        torch.testing.assert_close(torch.cat([r[step]["out"] for r in runs]), want, rtol=1e-10, atol=1e-12)
        for r in runs:                                    # every rank's copy moved like the one process's
            torch.testing.assert_close(r[step]["bias"], moe.expert_bias.to(r[step]["bias"].dtype))


def test_rank_shares_are_timed_on_one_thread_and_noise_is_flagged(monkeypatch):
    """The zig-zag shares were timed with every core's threads on a loaded machine: contiguous rank
    3 read 750 ms (IQR 19.7–916) and the page called an 89× spread a measurement against 6.98×
    counted. The shares run on one thread, and a spread work cannot produce is flagged."""
    from util.measure import Timing
    seen = []
    real = SegmentAttention.apply
    monkeypatch.setattr(SegmentAttention, "apply", lambda *a: (seen.append(torch.get_num_threads()), real(*a))[1])
    before = torch.get_num_threads()
    rank_compute(0, 1, seq_len=16, heads=2, head_dim=4, ranks=2, repeats=2)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == before
    counted = ring_work(1024, 4, "contiguous")
    ms = lambda *xs: Timing([x / 1e3 for x in xs])
    quiet = [ms(8.3, 8.4, 8.6), ms(12.1, 12.2, 12.5), ms(15.9, 16.0, 16.3), ms(18.2, 18.4, 18.9)]
    timed, why = share_spread(counted, quiet)
    assert why is None and 2.1 < timed < 2.3
    loaded = [ms(9, 10, 11), ms(9.5, 10, 11), ms(10, 10.5, 11), ms(600, 750, 800)]   # 75x > 7x counted
    timed, why = share_spread(counted, loaded)
    assert timed is None and "exceeds the counted" in why
    timed, why = share_spread(counted, [ms(10, 10, 10)] * 3 + [ms(19.7, 20, 750, 900, 916)])
    assert timed is None and "quartiles" in why


def test_balancing_loss_words_follow_the_sign():
    """The page called 2.145 and 2.089 against 2.155 'the price in loss': a lower loss is no price,
    and single runs within 5% are not ranked."""
    assert "no clear difference" in deep_dives.loss_words(2.089, 2.155, "α = 0.1")
    assert "lower" in deep_dives.loss_words(1.8, 2.155, "α = 0.1")
    assert "higher" in deep_dives.loss_words(2.5, 2.155, "α = 0.1")
    import inspect
    assert "price" not in inspect.getsource(L.mixture_of_experts)


def test_balanced_shares_within_their_own_noise_are_not_flagged():
    """Zig-zag counts exactly 1.00x: a 1.09x timed spread inside the shares' own IQR is noise to
    report, not a run to discard."""
    from util.measure import Timing
    ms = lambda *xs: Timing([x / 1e3 for x in xs])
    counted = ring_work(1024, 4, "zigzag")
    timed, why = share_spread(counted, [ms(10, 10.4, 12), ms(10.5, 10.8, 12.4), ms(10.9, 11, 12.5), ms(10.2, 10.3, 12)])
    assert why is None and 1.0 < timed < 1.1


def test_zigzag_speedups_are_read_against_the_balance_ceiling():
    """Balance alone allows zig-zag at most (2n − 1)/n = 1.5× at 2 ranks, so a measured "2.25×
    faster" (80.2 vs 180 ms) cannot be read as balance: the ceiling is counted, and a ratio above it
    is said to be something else."""
    from util.measure import Timing
    for n in (2, 3, 4, 8):
        assert balance_ceiling(4096, n) == pytest.approx((2 * n - 1) / n, rel=2e-3)
        assert balance_ceiling(4096, n) < whole_diagonal_ceiling(n) < 2
    ms = lambda *xs: Timing([x / 1e3 for x in xs])
    ceiling = balance_ceiling(1024, 2)
    within = L.speedup_words(ms(20, 21, 22), ms(26, 27, 28), 2, ceiling)
    assert "balance allows at most 1.50× at 2 ranks" in within and "more than" not in within
    review = L.speedup_words(ms(79, 80.2, 81), ms(178, 180, 182), 2, ceiling)
    assert "more than balance can give" in review and "not read as zig-zag's gain" in review
    between = L.speedup_words(ms(10, 10, 10), ms(15.5, 15.5, 15.5), 2, ceiling)   # 1.55: above 1.5, below 1.6
    assert "diagonal block" in between and "more than" not in between
    # the full build's shares on a loaded machine: 2.28x between medians, but quartiles 82-150 vs 175-244
    loaded = L.speedup_words(ms(82.1, 86.1, 150), ms(175, 196, 244), 4, balance_ceiling(2048, 4))
    assert "inside the repetitions' spread" in loaded and "not read as zig-zag's gain" in loaded


def test_the_router_z_loss_is_trained_and_lowers_the_logits():
    """The z-loss is trained on, not only measured: with it in the loss the routers' z-loss and
    each token's largest logit end lower than in the same run without it."""
    runs = {z: train_moe_gpt(0, 1, [{"aux": AUX_WEIGHT, "z": z}], steps=10, batch_size=4) for z in (0.0, 1e-2)}
    without, with_z = runs[0.0], runs[1e-2]
    assert with_z["z"][0] == pytest.approx(without["z"][0])          # the same start: only the loss differs
    assert with_z["z"][-1] < 0.8 * without["z"][-1]
    assert with_z["max_logit"][-1] < without["max_logit"][-1]
    mean = lambda xs: sum(xs) / len(xs)
    assert "did what it is for" in deep_dives.z_words(without, with_z, mean)
    assert "not yet" in deep_dives.z_words(with_z, without, mean)


def test_rank_capacity_drops_what_each_rank_alone_would_and_refuses_the_bias():
    """Real EP sizes capacity per rank, with no exchange of counts. Then which tokens drop
    depends on the grouping (so it differs from one batch of all tokens), and DeepSeek-V3's bias,
    which needs the global load, is refused rather than moved differently on every rank."""
    kw, tokens, _ = MOE_CASES["top-2, drops"]
    every, alone = (moe_reference(kw, tokens, capacity=c) for c in CAPACITY)
    assert not torch.equal(every["keep"], alone["keep"])
    moe = moe_layer(**kw)
    moe.bias_update = 0.01
    with pytest.raises(ValueError, match="bias"):
        RankCapacityMoE(moe.router, moe.experts, moe.n_experts, moe.top_k, moe.capacity_factor, None,
                        bias_update=moe.bias_update)


def test_no_tokens_give_a_zero_balance_loss_not_nan():
    """A batch without tokens has a balance loss of 0, not 0/0 = NaN (a NaN would poison the
    whole step's loss)."""
    moe = moe_layer(n_experts=3, top_k=1, n_shared=1)
    out = moe(torch.zeros(0, moe.d_model, dtype=torch.float64))
    assert out.shape == (0, moe.d_model) and moe.aux_loss.item() == 0.0


def test_shared_experts_see_every_token_ungated():
    moe = moe_layer(n_experts=4, top_k=1, capacity_factor=0.5, n_shared=2)
    x = torch.randn(10, moe.d_model, dtype=torch.float64)
    routed = moe_layer(n_experts=4, top_k=1, capacity_factor=0.5)         # the same routed experts, no shared
    torch.testing.assert_close(moe(x), routed(x) + moe.shared[0](x) + moe.shared[1](x))


# --- Ranks that disagree: one agreed check at entry, the same ValueError on every rank -------------

DISAGREEMENTS = {   # what rank 1 changes: (q heads, K/V heads, head dim, batch, dtype, causal, layout)
    "heads": dict(heads=2, kv_heads=2), "K/V heads": dict(kv_heads=1), "head dim": dict(head_dim=4),
    "batch size": dict(batch=1), "dtype": dict(dtype=torch.float32), "causal": dict(causal=False),
    "layout": dict(layout="contiguous"),
}


def disagreeing_ranks(rank, world_size, what):
    """Every variant with rank 1 calling differently from rank 0 in `what`: each rank's error."""
    args = dict(heads=4, kv_heads=2, head_dim=8, batch=2, dtype=torch.float64, causal=True, layout="zigzag")
    if rank == 1:
        args.update(DISAGREEMENTS[what])
    g = torch.Generator().manual_seed(rank)
    make = lambda h: torch.randn(args["batch"], h, 6, args["head_dim"], generator=g, dtype=args["dtype"])
    q, k, v = make(args["heads"]), make(args["kv_heads"]), make(args["kv_heads"])
    errors = {}
    for variant in VARIANTS:
        try:
            ATTENTION[variant](q, k, v, causal=args["causal"], layout=args["layout"])
            errors[variant] = None
        except ValueError as e:
            errors[variant] = str(e)
    return errors


@pytest.mark.parametrize("what", list(DISAGREEMENTS))
def test_ranks_that_disagree_get_one_clear_error(what):
    """Ring attention with 2 heads on rank 0 and 4 on rank 1 (or float32 against float64) would
    abort gloo ('op.preamble.length <= op.nbytes'), and a different mask or layout would give a
    silent wrong answer: every variant refuses on every rank instead, naming what differs."""
    runs = spawn(disagreeing_ranks, 2, what=what).returns
    for rank, errors in enumerate(runs):
        for variant, msg in errors.items():
            assert msg is not None and f"disagree on {what} " in msg, (rank, variant, msg)


def test_wait_and_rotation_words_claim_only_what_the_numbers_show():
    """A wait ratio of 0.8× is not evidence that the waits are not the wire, so the words do not
    say so; and at 2 ranks PyTorch's two rotate methods move the same bytes, which the page says."""
    assert "cannot say" in L.wait_words(0.8, 1.0) and "not the wire" not in L.wait_words(0.8, 1.0)
    assert "excess is not the transfers" in L.wait_words(1.5, 1.0)
    same = {"PyTorch, all-gather (default)": 2.001 * 2**20, "PyTorch, all-to-all rotation (a ring)": 2.0 * 2**20}
    assert "differ by timing only" in deep_dives.rotate_words(same, 2)
    other = dict(same, **{"PyTorch, all-gather (default)": 3.0 * 2**20})
    assert "timing only" not in deep_dives.rotate_words(other, 4)


def test_cp_throughput_drop_is_split_into_work_and_cp_cost():
    """Review W1: torchtitan's 7.1× drop from 32K (CP 1) to 256K (CP 8) is 3.5× more work per
    token (attention grows, the matmuls do not) and about 2× CP's own cost."""
    from lectures.model.gpu_evidence import TORCHTITAN_CP, flops_per_token
    linear, attention = flops_per_token(32768)
    assert linear / 1e9 == pytest.approx(45.0, abs=0.5) and attention / 1e9 == pytest.approx(25.8, abs=0.5)
    points = dict(TORCHTITAN_CP.series["tokens/s per GPU"])
    work = sum(flops_per_token(262144)) / sum(flops_per_token(32768))
    assert work == pytest.approx(3.55, abs=0.01)
    assert points[32768] / points[262144] / work == pytest.approx(2.0, abs=0.05)
    import inspect
    assert "8× the work per token" not in inspect.getsource(L)


def test_ep_bytes_formula_names_both_directions():
    """Review M3: the cheatsheet's formula is what the code computes, dispatched plus returned rows."""
    import inspect
    source = inspect.getsource(L)
    assert "remote rows × $h$" not in source and "rows returned" in source
