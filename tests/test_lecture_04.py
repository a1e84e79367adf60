"""Lecture 04: every tensor-parallel building block, and the split GPT, equal one process.

One spawn per world size runs every block check on the ranks (each rank also computes the
unsplit reference, seeded identically, and returns the largest difference) and trains the split
GPT under several configurations; the single-process GPT reference runs here. Sizes are awkward
on purpose: batch 3 and 5, sequence 7 (and 6 / 12 where sequence parallelism needs tp to divide
it), input widths of 7."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lectures import lecture_04_tensor_parallel as L
from lectures.model import GPT, GPTConfig, batch
from lectures.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      all_gather_sequence, copy_to_region, gather_from_region, parallelize_gpt,
                                      reduce_from_region, reduce_scatter_sequence, scatter_to_region, tp_loss,
                                      vocab_parallel_cross_entropy)
from lectures.tensor_parallel.demos import (RING_UNITS, activation_formula, activation_memory,
                                            replicated_grad_reduction, sequence_units, sp_traffic, traced_block,
                                            train_dtensor, train_reference, train_tp, training_state_bytes)
from lectures.tensor_parallel.figures import cut_figure
from util import spawn
from tests.conftest import built

F64 = torch.float64


def _slice(t, dim, rank, n):
    return t.chunk(n, dim)[rank]


def _grad_of(fn, *tensors):
    """Run fn on fresh leaf copies of `tensors`; return (output, [the leaves]) (their .grad after backward)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    return out, leaves


def block_checks(rank, world_size):
    """{check name: largest |ours - reference|} for every building block on these ranks."""
    g, n, r = dist.group.WORLD, world_size, rank
    torch.manual_seed(0)                         # the same tensors on every rank
    d = {}
    diff = lambda a, b: (a - b).abs().max().item()
    b, s, h_in = 3, 5, 7
    x = torch.randn(b, s, h_in, dtype=F64)

    # -- the operators ------------------------------------------------------------------
    up = torch.randn(b, s, h_in, dtype=F64)      # upstream gradient, different on each rank:
    ups = [up * (k + 1) for k in range(n)]
    xi = x.clone().requires_grad_(True)
    copy_to_region(xi, g).backward(ups[r])
    d["f: identity forward, all-reduce backward"] = diff(xi.grad, sum(ups))
    xi = x.clone().requires_grad_(True)
    out = reduce_from_region(xi * (r + 1), g)
    out.backward(up)
    d["g: all-reduce forward"] = diff(out, x * sum(range(1, n + 1)))
    d["g: identity backward"] = diff(xi.grad, up * (r + 1))
    assert torch.equal(x, xi.detach()), "an operator modified its input"
    wide = torch.randn(b, s, 4 * n, dtype=F64)
    wi = _slice(wide, -1, r, n).clone().requires_grad_(True)
    out = gather_from_region(wi, g)
    out.backward(torch.ones_like(out) * (r + 1))
    d["gather last dim: forward"] = diff(out, wide)
    d["gather last dim: backward keeps my slice"] = diff(wi.grad, torch.full_like(wi, r + 1.0))
    wi = wide.clone().requires_grad_(True)
    out = scatter_to_region(wi, g)
    out.backward(torch.ones_like(out))
    d["scatter last dim"] = diff(out, _slice(wide, -1, r, n)) + diff(wi.grad, torch.ones_like(wide))
    seq = torch.randn(b, 3 * n, h_in, dtype=F64)
    si = _slice(seq, 1, r, n).clone().requires_grad_(True)
    out = all_gather_sequence(si, g)
    out.backward(seq * (r + 1))                  # each rank's partial gradient of the whole
    d["SP all-gather: forward"] = diff(out, seq)
    d["SP all-gather: reduce-scatter backward"] = diff(si.grad, _slice(seq, 1, r, n) * sum(range(1, n + 1)))
    si = seq.clone().requires_grad_(True)
    out = reduce_scatter_sequence(si * (r + 1), g)
    out.backward(torch.ones_like(out) * (r + 1))
    d["SP reduce-scatter: forward"] = diff(out, _slice(seq, 1, r, n) * sum(range(1, n + 1)))
    d["SP reduce-scatter: all-gather backward"] = diff(
        si.grad, (r + 1) * torch.cat([torch.full_like(_slice(seq, 1, k, n), k + 1.0) for k in range(n)], 1))

    # -- column- and row-parallel linear --------------------------------------------------
    col_full = nn.Linear(h_in, 3 * n, dtype=F64)
    row_full = nn.Linear(3 * n, 5, dtype=F64)
    G_col = torch.randn(b, s, 3 * n, dtype=F64)
    ref_y, (ref_x,) = _grad_of(col_full, x)
    (ref_y * G_col).sum().backward()
    for gather in (True, False):
        layer = ColumnParallelLinear.from_full(col_full, g, gather_output=gather)
        y, (xx,) = _grad_of(layer, x)
        G = G_col if gather else _slice(G_col, -1, r, n)
        (y * G).sum().backward()
        want = ref_y if gather else _slice(ref_y, -1, r, n)
        d[f"column gather_output={gather}: output"] = diff(y, want)
        d[f"column gather_output={gather}: input grad"] = diff(xx.grad, ref_x.grad)
        d[f"column gather_output={gather}: weight grad"] = diff(layer.weight.grad, _slice(col_full.weight.grad, 0, r, n))
        d[f"column gather_output={gather}: bias grad"] = diff(layer.bias.grad, _slice(col_full.bias.grad, 0, r, n))
    col_full.zero_grad()

    h = torch.randn(b, s, 3 * n, dtype=F64)
    G_row = torch.randn(b, s, 5, dtype=F64)
    ref_y, (ref_h,) = _grad_of(row_full, h)
    (ref_y * G_row).sum().backward()
    for parallel_in in (True, False):
        layer = RowParallelLinear.from_full(row_full, g, input_is_parallel=parallel_in)
        y, (hh,) = _grad_of(layer, _slice(h, -1, r, n) if parallel_in else h)
        (y * G_row).sum().backward()
        d[f"row input_is_parallel={parallel_in}: output"] = diff(y, ref_y)
        want = _slice(ref_h.grad, -1, r, n) if parallel_in else ref_h.grad
        d[f"row input_is_parallel={parallel_in}: input grad"] = diff(hh.grad, want)
        d[f"row input_is_parallel={parallel_in}: weight grad"] = diff(layer.weight.grad, _slice(row_full.weight.grad, 1, r, n))
        d[f"row input_is_parallel={parallel_in}: bias grad"] = diff(layer.bias.grad, row_full.bias.grad)
    row_full.zero_grad()

    # The Megatron MLP, with and without sequence parallelism, non-contiguous input,
    # accumulated over two backward passes, and a no_grad forward.
    s_sp = 3 * n
    xs = torch.randn(b, h_in, s_sp, dtype=F64).transpose(1, 2)      # non-contiguous (b, s, h)
    G = torch.randn(b, s_sp, 5, dtype=F64)
    mlp_ref = lambda t: row_full(torch.nn.functional.gelu(col_full(t)))
    ref_y, (ref_x,) = _grad_of(mlp_ref, xs)
    for _ in range(2):
        (mlp_ref(ref_x) * G).sum().backward()
    for sp in (False, True):
        col = ColumnParallelLinear.from_full(col_full, g, sequence_parallel=sp)
        row = RowParallelLinear.from_full(row_full, g, sequence_parallel=sp)
        mlp = lambda t: row(torch.nn.functional.gelu(col(t)))
        inp = _slice(xs, 1, r, n) if sp else xs
        xx = inp.detach().clone().requires_grad_(True)
        for _ in range(2):
            y = mlp(xx)
            (y * (_slice(G, 1, r, n) if sp else G)).sum().backward()
        with torch.no_grad():
            y_ng = mlp(inp)
        want = _slice(ref_y, 1, r, n) if sp else ref_y
        tag = "SP on" if sp else "SP off"
        d[f"MLP {tag}: output"] = diff(y, want) + diff(y_ng, want)
        d[f"MLP {tag}: input grad (2 accumulated)"] = diff(xx.grad, _slice(ref_x.grad, 1, r, n) if sp else ref_x.grad)
        d[f"MLP {tag}: weight grads"] = (diff(col.weight.grad, _slice(col_full.weight.grad, 0, r, n))
                                         + diff(row.weight.grad, _slice(row_full.weight.grad, 1, r, n)))
        d[f"MLP {tag}: bias grads"] = (diff(col.bias.grad, _slice(col_full.bias.grad, 0, r, n))
                                       + diff(row.bias.grad, row_full.bias.grad))

    # -- vocabulary-parallel embedding and cross-entropy ----------------------------------
    V = 4 * n
    emb_full = nn.Embedding(V, 6, dtype=F64)
    tokens = torch.randint(V, (b, s_sp))
    Ge = torch.randn(b, s_sp, 6, dtype=F64)
    (emb_full(tokens) * Ge).sum().backward()
    for sp in (False, True):
        emb = VocabParallelEmbedding.from_full(emb_full, g, sequence_parallel=sp)
        y = emb(tokens)
        (y * (_slice(Ge, 1, r, n) if sp else Ge)).sum().backward()
        want = emb_full(tokens).detach()
        d[f"vocab embedding SP={sp}: output"] = diff(y, _slice(want, 1, r, n) if sp else want)
        d[f"vocab embedding SP={sp}: weight grad"] = diff(emb.weight.grad, _slice(emb_full.weight.grad, 0, r, n))
    logits = torch.randn(b, s, V, dtype=F64) * 3
    targets = torch.randint(V, (b, s))
    ref_loss, (ref_l,) = _grad_of(lambda t: torch.nn.functional.cross_entropy(t.reshape(-1, V), targets.reshape(-1)), logits)
    ref_loss.backward()
    loss, (ll,) = _grad_of(lambda t: vocab_parallel_cross_entropy(t, targets, g), _slice(logits, -1, r, n))
    loss.backward()
    d["vocab-parallel cross-entropy: loss"] = diff(loss, ref_loss)
    d["vocab-parallel cross-entropy: logits grad"] = diff(ll.grad, _slice(ref_l.grad, -1, r, n))
    return d


# The split GPT: (name, world size, GPTConfig overrides, train_tp options, batch size)
GPT_CASES = [
    ("tp=2, seq 7, batch 3", 2, dict(seq_len=7), dict(), 3),
    ("tp=2, SP, seq 6, batch 5", 2, dict(seq_len=6), dict(sequence_parallel=True), 5),
    ("tp=2, GQA 1 KV head (replicated), SP", 2, dict(seq_len=6, n_kv_heads=1), dict(sequence_parallel=True), 3),
    ("tp=2, tied embeddings, 3 layers", 2, dict(seq_len=7, tie_embeddings=True, n_layers=3), dict(), 5),
    ("tp=4, seq 7, batch 5", 4, dict(seq_len=7), dict(), 5),
    ("tp=4, SP, seq 12, batch 3", 4, dict(seq_len=12), dict(sequence_parallel=True), 3),
    ("tp=4, GQA 4 KV of 8 heads (split), SP", 4, dict(seq_len=8, n_heads=8, n_kv_heads=4), dict(sequence_parallel=True), 3),
    ("tp=4, GQA 2 KV of 8 heads (replicated)", 4, dict(seq_len=7, n_heads=8, n_kv_heads=2), dict(), 3),
    ("two tp=2 groups on 4 ranks, SP", 4, dict(seq_len=6), dict(sequence_parallel=True, tp=2), 3),
]


def _cfg(overrides):
    return GPTConfig(dtype="float64", d_model=32, **overrides)


def everything(rank, world_size, gpt_cases):
    out = {"blocks": block_checks(rank, world_size), "gpt": {}}
    for name, cfg, options, batch_size in gpt_cases:
        out["gpt"][name] = train_tp(rank, world_size, cfg, steps=2, batch_size=batch_size, **options)
    return out


@pytest.fixture(scope="module")
def results():
    out = {}
    for world_size in (2, 4):
        cases = [(name, _cfg(over), opts, bs) for name, ws, over, opts, bs in GPT_CASES if ws == world_size]
        out[world_size] = spawn(everything, world_size, gpt_cases=cases).returns
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_building_blocks_equal_one_process(results, world_size):
    for rank, d in enumerate(r["blocks"] for r in results[world_size]):
        assert len(d) > 30
        bad = {k: v for k, v in d.items() if not v < 1e-12}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("case", GPT_CASES, ids=[c[0] for c in GPT_CASES])
def test_split_gpt_equals_one_process(results, case):
    name, world_size, overrides, _, batch_size = case
    ref = train_reference(_cfg(overrides), steps=2, batch_size=batch_size)
    for rank, ours in enumerate(r["gpt"][name] for r in results[world_size]):
        torch.testing.assert_close(ours["logits"], ref["logits"], rtol=1e-12, atol=1e-12)
        assert set(ours["grads"]) >= set(ref["grads"])
        for k in ref["grads"]:
            if not k.endswith("k_proj.bias"):   # softmax ignores a key bias: its gradient is 0
                assert ref["grads"][k].abs().max() > 1e-6, f"{k}: a zero gradient checks nothing"
            torch.testing.assert_close(ours["grads"][k], ref["grads"][k], rtol=1e-10, atol=1e-12, msg=k)
        for k in ref["params"]:
            torch.testing.assert_close(ours["params"][k], ref["params"][k], rtol=1e-9, atol=1e-10, msg=k)
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-12, atol=1e-12)


def test_shards_are_smaller(results):
    ours = results[4][0]["gpt"]["tp=4, seq 7, batch 5"]["local_shapes"]
    assert ours["blocks.0.mlp.fc_in.weight"] == (128 // 4, 32)
    assert ours["blocks.0.attn.o_proj.weight"] == (32, 32 // 4)
    assert ours["tok_emb.weight"] == (64 // 4, 32)


def refuse(rank, world_size, overrides):
    try:
        parallelize_gpt(GPT(GPTConfig(**overrides)), dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return None


def test_refuses_what_it_cannot_split():
    msgs = spawn(refuse, 4, overrides=dict(n_heads=2, d_model=32)).returns
    assert msgs[0] and "tp=4 must divide the 2 attention heads" in msgs[0]
    msgs = spawn(refuse, 4, overrides=dict(vocab_size=50)).returns
    assert msgs[0] and "vocabulary of 50" in msgs[0]


def misuse(rank, world_size):
    """Each misuse must raise a ValueError that names the problem."""
    g, msgs = dist.group.WORLD, []
    model = parallelize_gpt(GPT(GPTConfig(seq_len=7)), g, sequence_parallel=True)
    tokens, targets = batch(model.cfg, 2, 0)
    for fn in (lambda: tp_loss(model, tokens, targets),                        # 7 positions, 2 ranks
               lambda: ColumnParallelLinear.from_full(nn.Linear(4, 4), g, sequence_parallel=True)(torch.randn(3, 4)),
               lambda: vocab_parallel_cross_entropy(torch.randn(3, 2), torch.tensor([0, 1, 9]), g),
               lambda: ColumnParallelLinear.from_full(nn.Linear(4, 3), g)):
        try:
            fn()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_misuse_is_refused_clearly():
    msgs = spawn(misuse, 2).returns[0]
    assert "divide the sequence length 7" in msgs[0]
    assert "(batch, seq, hidden)" in msgs[1]
    assert "targets must lie in [0, 4)" in msgs[2]
    assert "3 output features do not split over 2 ranks" in msgs[3]


def test_inputs_are_not_modified():
    """parallelize_gpt returns a copy: the model it was given is unchanged."""
    model = GPT(GPTConfig(d_model=32))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert spawn(parallelize_leaves_original, 2, model=model).returns[0]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def parallelize_leaves_original(rank, world_size, model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tp = parallelize_gpt(model, dist.group.WORLD)
    types = {type(m).__name__ for m in model.modules()}
    return (tp is not model and "ColumnParallelLinear" not in types
            and all(torch.equal(before[k], v) for k, v in model.state_dict().items()))



def both(rank, world_size, cfg, sequence_parallel, batch_size):
    return {"dtensor": train_dtensor(rank, world_size, cfg, batch_size=batch_size, sequence_parallel=sequence_parallel),
            "ours": train_tp(rank, world_size, cfg, batch_size=batch_size, sequence_parallel=sequence_parallel)}


@pytest.mark.parametrize("world_size,sp,overrides", [(2, False, dict(seq_len=7)), (4, True, dict(seq_len=8, n_heads=8, n_kv_heads=4))])
def test_dtensor_parallelize_module_equals_ours(world_size, sp, overrides):
    cfg = _cfg(overrides)
    ref = train_reference(cfg, steps=3, batch_size=3)
    run = spawn(both, world_size, cfg=cfg, sequence_parallel=sp, batch_size=3).returns[0]
    for k in ref["params"]:
        torch.testing.assert_close(run["dtensor"]["grads"][k], ref["grads"][k], rtol=1e-10, atol=1e-12, msg=k)
        torch.testing.assert_close(run["dtensor"]["params"][k], run["ours"]["params"][k], rtol=1e-9, atol=1e-10, msg=k)
    torch.testing.assert_close(run["dtensor"]["logits"], run["ours"]["logits"], rtol=1e-12, atol=1e-12)


def collective_warnings(rank, world_size):
    """Every warning the building blocks raise in an MLP forward and backward, with and without
    sequence parallelism (all-reduce, all-gather, reduce-scatter, and the async ones in the
    column-parallel backward)."""
    import warnings
    g = dist.group.WORLD
    torch.manual_seed(0)
    col_full, row_full = nn.Linear(4, 4 * world_size), nn.Linear(4 * world_size, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for sp in (False, True):
            col = ColumnParallelLinear.from_full(col_full, g, sequence_parallel=sp)
            row = RowParallelLinear.from_full(row_full, g, sequence_parallel=sp)
            x = torch.randn(2, world_size, 4, requires_grad=True)
            row(torch.nn.functional.gelu(col(x))).sum().backward()
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_collectives_raise_no_warnings():
    """torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor with a FutureWarning
    on every call; the building blocks use their successors (all_gather_single, reduce_scatter_single)."""
    assert spawn(collective_warnings, 2).returns == [[], []]


# -- fixes: initialisation, misuse, GQA layouts, overlap ------------------------------------

def fresh_row_std(rank, world_size, h_in=1024, h_out=256):
    torch.manual_seed(rank)
    layer = RowParallelLinear(h_in, h_out, dist.group.WORLD)
    return layer.full_tensors()["weight"].std().item()


def test_fresh_row_parallel_initialises_like_nn_linear():
    """A fresh RowParallelLinear draws from nn.Linear(in, out)'s U(±1/√in), not from the shard's
    fan-in (which was √t too wide: std 0.0255 vs 0.0181 at t=2)."""
    want = nn.Linear(1024, 256).weight.std().item()
    for std in spawn(fresh_row_std, 2).returns:
        assert abs(std / want - 1) < 0.03, (std, want)


def misuse_more(rank, world_size):
    """{misuse: the error message} for misuses that would otherwise give a silent wrong answer or
    a crash far from the cause."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    g = dist.group.WORLD
    cfg = GPTConfig(vocab_size=48, seq_len=6, d_model=36, n_heads=3)
    model = parallelize_gpt(GPT(cfg), g)
    tokens, targets = batch(cfg, 2, 0)
    bad = lambda v: torch.cat([torch.full_like(tokens[:, :1], v), tokens[:, 1:]], 1)
    attempt("token id = vocab", lambda: tp_loss(model, bad(50), targets))
    attempt("token id < 0", lambda: model(bad(-1)))
    attempt("parallelize twice", lambda: parallelize_gpt(model, g))
    attempt("GQA neither divides", lambda: parallelize_gpt(
        GPT(GPTConfig(vocab_size=66, d_model=36, n_heads=6, n_kv_heads=2)), g))
    seq = torch.randn(2, 3 + rank, 4)   # unequal sequence shards
    attempt("unequal shards", lambda: all_gather_sequence(seq, g))
    attempt("unequal dtypes", lambda: reduce_scatter_sequence(
        torch.randn(2, 6, 4, dtype=torch.float64 if rank else torch.float32), g))
    col = ColumnParallelLinear(4, 6, g, sequence_parallel=True)
    attempt("unequal shards into a column-parallel layer", lambda: col(torch.randn(2, 2 + rank, 4)))
    sub = dist.new_group([0, 1])   # every rank creates it; the last rank is not in it
    if rank == world_size - 1:
        attempt("group without this rank: layer", lambda: ColumnParallelLinear(4, 6, sub))
        attempt("group without this rank: f", lambda: copy_to_region(torch.ones(3), sub))
    dist.barrier()
    return out


def test_misuse_fails_loudly():
    got = spawn(misuse_more, 3).returns
    for rank, msgs in enumerate(got):
        assert "token ids must lie in [0, 48)" in msgs["token id = vocab"], msgs
        assert "token ids must lie in [0, 48)" in msgs["token id < 0"]
        assert "already tensor-parallel" in msgs["parallelize twice"]
        assert "must divide the 2 K/V heads" in msgs["GQA neither divides"]
        assert "shards differ" in msgs["unequal shards"] and "rank 1: (2, 4, 4)" in msgs["unequal shards"]
        assert "shards differ" in msgs["unequal dtypes"] and "float64" in msgs["unequal dtypes"]
        # refused at the layer's first call, where the ranks agree on their inputs
        assert "disagree" in msgs["unequal shards into a column-parallel layer"]
        assert "input size 1=2; rank 1: input size 1=3" in msgs["unequal shards into a column-parallel layer"]
    assert "is not a member" in got[2]["group without this rank: layer"]
    assert "is not a member" in got[2]["group without this rank: f"]


def gqa_layouts(rank, world_size, cases):
    out = []
    for over in cases:
        cfg = GPTConfig(d_model=32, seq_len=8, **over)
        attn = parallelize_gpt(GPT(cfg), dist.group.WORLD).blocks[0].attn
        out.append((attn.kv_layout, attn.q_heads_held, attn.kv_held, tuple(attn.weight.shape)))
    return out


def test_gqa_holds_each_kv_head_once_per_rank_that_reads_it():
    """K/V heads split when tp divides them; else each rank holds the ONE K/V head its query
    heads read (not the whole K/V weight, computing one head per query head)."""
    cases = [dict(n_heads=8, n_kv_heads=4), dict(n_heads=8, n_kv_heads=2), dict(n_heads=4, n_kv_heads=1)]
    got = spawn(gqa_layouts, 4, cases=cases).returns
    d32 = lambda heads: 32 // heads
    for rank, per in enumerate(got):
        (k1, q1, kv1, w1), (k2, q2, kv2, w2), (k3, q3, kv3, w3) = per
        assert (k1, q1, kv1, w1) == ("split", [2 * rank, 2 * rank + 1], [rank], ((2 + 2) * d32(8), 32))
        assert (k2, q2, kv2, w2) == ("replicated", [2 * rank, 2 * rank + 1], [rank // 2], ((2 + 2) * d32(8), 32))
        assert (k3, q3, kv3, w3) == ("replicated", [rank], [0], ((1 + 2) * d32(4), 32))


def test_attention_backward_overlaps_like_the_mlp():
    """Q, K, V are one column-parallel matmul: each block's backward starts BOTH its input-gradient
    all-reduces (attention's and the MLP's) asynchronously, and waits on no blocking all-reduce."""
    cfg = GPTConfig(seq_len=8, d_model=32)
    run = spawn(traced_block, 2, cfg=cfg, b=2, steps=2)
    spans = [s for s in run.spans if s["rank"] == 0]
    backward = [s for s in spans if s["label"] == "backward"]
    inside = lambda s: any(b["start"] <= s["start"] <= b["end"] for b in backward)
    labels = [s["label"] for s in spans if inside(s)]
    assert labels.count("all-reduce (async)") == 2 * 2, labels
    assert labels.count("all-reduce") == 0, labels


def fresh_replicated(rank, world_size):
    """A fresh layer of each kind built with a different seed on every rank: its replicated
    parameters as this rank holds them."""
    from lectures.tensor_parallel import SequenceParallelPositions
    from lectures.tensor_parallel import TensorParallelAttention
    g = dist.group.WORLD
    torch.manual_seed(100 + rank)   # each rank draws differently, as separate processes may
    row = RowParallelLinear(8, 4, g)
    pos = SequenceParallelPositions(6, 4, g)
    attn = TensorParallelAttention(n_heads=4, n_kv_heads=1, head_dim=2, d_model=8, group=g)
    return {"row bias": row.bias.detach(), "positions": pos.weight.detach(),
            "K/V rows": attn.weight[attn.q_rows:].detach(), "K/V bias": attn.bias[attn.q_rows:].detach(),
            "o_proj bias": attn.o_proj.bias.detach(), "row weight": row.weight.detach()}


def test_fresh_layers_agree_on_replicated_parameters():
    """Layers built without from_full broadcast their replicated parameters (a row-parallel bias,
    the positions, a K/V head held by several ranks) from the first rank: initialised per rank,
    they would differ across ranks, a silent wrong model."""
    got = spawn(fresh_replicated, 4).returns
    for name in ("row bias", "positions", "K/V rows", "K/V bias", "o_proj bias"):
        for r in range(1, 4):
            assert torch.equal(got[r][name], got[0][name]), (name, r)
    assert not torch.equal(got[1]["row weight"], got[0]["row weight"])   # shards stay per rank


def test_activation_memory_equals_sixteen_over_t_with_sequence_parallelism():
    """The column-parallel layers (fused QKV, fc_in) save only their sequence slice, so with SP a
    block saves 16/t units of b·s·h plus per-token statistics, exactly (the page used 1 + 15/t and
    printed 'measured / formula 0.94' without a word)."""
    cfg = GPTConfig(seq_len=16, d_model=32, n_heads=4)
    for t in (2, 4):
        m = spawn(activation_memory, t, cfg=cfg, b=2).returns[0]
        assert m[True] == activation_formula(cfg, 2, t, True), (t, m)
        assert m[False] == activation_formula(cfg, 2, t, False), (t, m)


def test_cut_figure_names_both_matrices():
    """The row-parallel panel is B (it said 'A is 12×8'), and its formula is mathtext, not
    literal underscores."""
    import matplotlib
    matplotlib.use("Agg")
    fig = cut_figure(2, {"column weight": (6, 8), "row weight": (8, 6)})
    left, right = fig.axes
    assert left.get_title().startswith("column-parallel: A is 8×12"), left.get_title()
    assert right.get_title().startswith("row-parallel: B is 12×8"), right.get_title()
    texts = [t.get_text() for ax in fig.axes for t in ax.texts if "=" in t.get_text()]
    assert texts and all(t.startswith("$") for t in texts), texts


def test_training_state_per_rank_is_split_over_t_plus_what_stays_whole():
    """Weights, gradients and Adam's moments per rank, measured from storages, are
    16·(S/t + R) bytes (float32) at tp = 1, 2, 3, 4, with sequence parallelism off and on; the
    parameters kept whole are exactly the norms, the positions and the row-parallel biases."""
    cfg = GPTConfig(vocab_size=48, seq_len=12, d_model=24, n_heads=12, n_layers=2)
    full = dict(GPT(cfg).named_parameters())
    whole = {k for k in full if any(w in k for w in ("ln1.", "ln2.", "ln_f.", "pos_emb.", "o_proj.bias", "fc_out.bias"))}
    S, R = sum(full[k].numel() for k in full if k not in whole), sum(full[k].numel() for k in whole)
    for t in (1, 2, 3, 4):
        for sp in ((False, True) if t > 1 else (False,)):
            got = spawn(training_state_bytes, t, cfg=cfg, sequence_parallel=sp).returns
            for m in got:
                assert m == got[0]
            m = got[0]
            assert m["sharded parameters"] + m["replicated parameters"] == 4 * (S / t + R), (t, sp, m)
            assert m["replicated parameters"] == (4 * R if t > 1 else 0), (t, sp, m)
            assert m["gradients"] == 4 * (S / t + R) and m["Adam moments"] == 8 * (S / t + R), (t, sp, m)
            if t > 1:
                assert set(m["replicated names"]) == {k.split(".", 2)[-1] if k.startswith("blocks.") else k
                                                      for k in whole}, m["replicated names"]


def test_sequence_parallel_bytes_are_counted_with_the_backward_regather():
    """With SP a block moves 10 ring units, not TP's 8: the column-parallel layers keep
    their slice and all-gather it again in backward. The page's ratio is the counted one."""
    r = spawn(sp_traffic, 2, cfg=L.demo_cfg()).returns[0]
    assert sequence_units(r) == RING_UNITS == {False: 8, True: 10}
    assert r[True]["backward"]["all-gather"] == 4           # dY's all-gather twice, the re-gathers twice


def test_sp_replicated_gradients_are_all_reduced_one_by_one_and_counted():
    """The page states what our per-tensor f costs beside Megatron's one flattened
    all-reduce per step; the count it states is the backward's (10 LayerNorm tensors, 4
    row-parallel biases, 1 position table in the 2-layer GPT, plus the loss's)."""
    r = spawn(replicated_grad_reduction, 2, cfg=L.demo_cfg(), repeats=2).returns[0]
    cfg = L.demo_cfg()
    assert r["tensors"] == 2 * (4 + 2) + 2 + 1                    # 2 LNs × (w, b) and 2 biases per block, ln_f, positions
    assert r["bytes"] == 4 * (cfg.n_layers * 6 * cfg.d_model + 2 * cfg.d_model + cfg.seq_len * cfg.d_model)
    assert r["backward all-reduces"] >= r["tensors"]
    assert set(r["times"]) == {"one by one", "once, flattened"}


def _ce_saved(rank, world_size, dtype):
    from lectures.model.memory import saved_bytes
    torch.manual_seed(0)
    logits = torch.randn(4, 64, 4096, dtype=dtype, requires_grad=True)
    targets = torch.randint(4096 * world_size, (4, 64))
    _, ours = saved_bytes(lambda: vocab_parallel_cross_entropy(logits, targets, dist.group.WORLD))
    _, torch_ce = saved_bytes(lambda: torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                                        targets.flatten() % 4096))
    return ours, torch_ce


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_parallel_loss_saves_its_logits_once(dtype):
    """Review N4: the loss keeps one fp32 copy of the local logits (the softmax, as Megatron's
    _VocabParallelCrossEntropy), not two: about F.cross_entropy's bytes on the same slice."""
    for ours, torch_ce in spawn(_ce_saved, 2, dtype=dtype).returns:
        slice_fp32 = 4 * 64 * 4096 * 4
        assert slice_fp32 <= ours <= 1.01 * torch_ce, (ours, torch_ce)


def _sp_backward_traced(rank, world_size):
    from lectures.tensor_parallel.ops import traced
    torch.manual_seed(0)
    layer = ColumnParallelLinear(8, 8, dist.group.WORLD, sequence_parallel=True)
    y = layer(torch.randn(2, 4, 8, requires_grad=True))
    with traced():
        y.sum().backward()


def test_sp_backward_regathers_while_the_input_gradient_is_computed():
    """Review (PARTLY/NOT): SP's backward re-gather of the column-parallel input is posted before
    the input gradient's matmul and waited for only by the weight gradient, as Megatron-LM does."""
    import inspect
    from lectures.tensor_parallel.layers import ColumnParallelLinearFunction
    src = inspect.getsource(ColumnParallelLinearFunction.backward)
    assert src.index("_all_gather_async") < src.index("grad @ weight") < src.index("gathering.wait()") \
        < src.index("grad_weight =")
    spans = [sp for sp in spawn(_sp_backward_traced, 2).spans if sp["rank"] == 0]
    first = {label: min(sp["start"] for sp in spans if sp["label"] == label)
             for label in ("all-gather (async)", "input gradient (overlapped)", "weight gradient (overlapped)")}
    assert first["all-gather (async)"] <= first["input gradient (overlapped)"] < first["weight gradient (overlapped)"]


def test_dropout_under_sp_needs_the_split_stream():
    """Review C5: the residual's sequence shards under SP get one mask on every rank from the
    replicated stream, independent masks from the split one, and the one process's from its own."""
    from lectures.tensor_parallel.deep_dives import sp_residual_dropout
    for world_size in (2, 4):
        r = spawn(sp_residual_dropout, world_size, p=0.3).returns[0]
        a = r["agreement"]
        assert a["replicated stream (TP without SP)"] == 1.0
        assert abs(a["split stream (Megatron's fork under SP)"] - (0.3 ** 2 + 0.7 ** 2)) < 0.15
        assert r["one process equal"]


def test_tp1_and_the_largest_tp_are_timed_in_one_run_taking_turns(course_site):
    """The page's tp=1 against tp=2 (or more): one demo times both, their repeats interleaved
    (measure_side_by_side), so the machine's drift between two runs cannot set them apart."""
    from tests.conftest import demo_returns
    demos = [d for d in demo_returns(course_site, "lecture_04_tensor_parallel")
             if d["name"].startswith("TP step time, tp=1 and tp=")]
    assert len(demos) == 1 and demos[0]["status"] == "ok", demos
    both = demos[0]["returns"][0]
    assert set(both) == {"one process", "ours"}
    assert len(both["one process"].samples) == len(both["ours"].samples) >= 3


def test_hidden_share_counts_the_comm_time_compute_runs_beside():
    """The 'overlap 7%' of the page's async-TP timeline: comm time with compute running, over
    comm time, on one rank's spans."""
    from lectures.tensor_parallel.demos import hidden_share
    span = lambda label, start, end: {"label": label, "start": start, "end": end}
    spans = [span("all-reduce (async)", 0, 10), span("weight gradient", 2, 5), span("weight gradient", 8, 12),
             span("all-reduce (async)", 20, 30), span("forward", 21, 29)]
    got = hidden_share(spans, "all-reduce (async)", "weight gradient")
    assert got == {"comm": 20, "hidden": 5, "share": 0.25}
    assert hidden_share(spans, "all-reduce", "weight gradient")["share"] == 0.0     # no such comm: nothing hidden
