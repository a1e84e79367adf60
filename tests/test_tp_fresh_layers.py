"""Fresh tensor-parallel layers, built on ranks seeded the way the launcher seeds them (every rank
alike), hold the shards of ONE full layer: the one nn.Linear, nn.Embedding or lecture 01's
attention would draw with that seed, sliced. Drawing each shard from the shared seed instead
would give every rank the same numbers: a fresh model with 1/t of its width."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lectures.model import CausalSelfAttention, GPTConfig
from lectures.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelAttention,
                                      VocabParallelEmbedding)
from util import spawn


def fresh_layers(rank, world_size):
    """{name: largest |fresh shard - slice of the one-process layer|} and how far the shards of
    rank 0 and rank 1 differ, with the launcher's seeding (no seed set here)."""
    g, n, r = dist.group.WORLD, world_size, rank
    seeded = torch.random.get_rng_state()          # the launcher's: the same on every rank
    out = {}

    def again():
        torch.random.set_rng_state(seeded)

    def shards_differ(t):
        full = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(full, t.detach().contiguous())
        return min((full[0] - full[i]).abs().max().item() for i in range(1, n))

    again(); col = ColumnParallelLinear(7, 6 * n, g)
    again(); ref = nn.Linear(7, 6 * n)
    out["column weight"] = (col.weight - ref.weight.chunk(n, 0)[r]).abs().max().item()
    out["column bias"] = (col.bias - ref.bias.chunk(n, 0)[r]).abs().max().item()
    out["column shards differ"] = shards_differ(col.weight)

    again(); row = RowParallelLinear(5 * n, 4, g)
    again(); ref = nn.Linear(5 * n, 4)
    out["row weight"] = (row.weight - ref.weight.chunk(n, 1)[r]).abs().max().item()
    out["row bias"] = (row.bias - ref.bias).abs().max().item()
    out["row shards differ"] = shards_differ(row.weight)

    again(); emb = VocabParallelEmbedding(8 * n, 3, g)
    again(); ref = nn.Embedding(8 * n, 3)
    out["embedding"] = (emb.weight - ref.weight.chunk(n, 0)[r]).abs().max().item()
    out["embedding shards differ"] = shards_differ(emb.weight)

    for kv in (n, 1):                                        # K/V heads split, then replicated
        cfg = GPTConfig(d_model=4 * n, n_heads=2 * n, n_kv_heads=kv, seq_len=8)
        again(); attn = TensorParallelAttention(cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.d_model, g)
        again(); want = TensorParallelAttention.from_full(CausalSelfAttention(cfg), g)
        for name in ("weight", "bias", "o_proj.weight", "o_proj.bias"):
            got, ref_t = attn.get_parameter(name), want.get_parameter(name)
            out[f"attention kv={kv} {name}"] = (got - ref_t).abs().max().item()
        out[f"attention kv={kv} shards differ"] = shards_differ(attn.weight[:attn.q_rows])
        # and a fresh layer runs: its forward is the one-process attention's (it had no attend)
        again(); full = CausalSelfAttention(cfg)
        x = torch.randn(2, cfg.seq_len, cfg.d_model, generator=torch.Generator().manual_seed(3))
        out[f"attention kv={kv} forward"] = (attn(x) - full(x)).abs().max().item()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_fresh_layers_hold_one_full_layer(n):
    runs = spawn(fresh_layers, n, name=f"fresh TP layers, tp={n}").returns
    for rank, out in enumerate(runs):
        for name, value in out.items():
            if name.endswith("shards differ"):
                assert value > 0.01, f"rank {rank}: {name}: the ranks hold the same numbers"
            elif name.endswith("forward"):          # a sum split over ranks: rounding, not 0
                assert value < 1e-5, f"rank {rank}: {name} differs from one process by {value}"
            else:
                assert value == 0, f"rank {rank}: {name} differs from the one-process layer by {value}"


def fresh_mlp_trained(rank, world_size, steps=4):
    """A fresh column -> GELU -> row MLP with sequence parallelism, built and trained with the
    launcher's seeding (the same seed on every rank), against the one-process MLP the same seed
    draws: after SGD steps the replicated row bias is equal on every rank and equals the
    reference's, the shards still differ, and every shard equals its slice of the reference."""
    g, n, r = dist.group.WORLD, world_size, rank
    seeded = torch.random.get_rng_state()
    col, row = ColumnParallelLinear(6, 4 * n, g, sequence_parallel=True), \
        RowParallelLinear(4 * n, 6, g, sequence_parallel=True)
    torch.random.set_rng_state(seeded)
    ref_in, ref_out = nn.Linear(6, 4 * n), nn.Linear(4 * n, 6)
    params, ref_params = [*col.parameters(), *row.parameters()], [*ref_in.parameters(), *ref_out.parameters()]
    opt, ref_opt = torch.optim.SGD(params, lr=0.01), torch.optim.SGD(ref_params, lr=0.01)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, target = torch.randn(2, 2 * n, 6, generator=data), torch.randn(2, 2 * n, 6, generator=data)
        mine = slice(2 * r, 2 * r + 2)
        loss = ((row(torch.nn.functional.gelu(col(x[:, mine]))) - target[:, mine]) ** 2).sum()
        loss.backward()
        ((ref_out(torch.nn.functional.gelu(ref_in(x))) - target) ** 2).sum().backward()
        for o in (opt, ref_opt):
            o.step(), o.zero_grad()
    every = [torch.empty_like(row.bias) for _ in range(n)]
    dist.all_gather(every, row.bias.detach())
    weights = [torch.empty_like(col.weight) for _ in range(n)]
    dist.all_gather(weights, col.weight.detach())
    return {"bias across ranks": max((b - every[0]).abs().max().item() for b in every),
            "bias vs one process": (row.bias - ref_out.bias).abs().max().item(),
            "column vs one process": (col.weight - ref_in.weight.chunk(n, 0)[r]).abs().max().item(),
            "row vs one process": (row.weight - ref_out.weight.chunk(n, 1)[r]).abs().max().item(),
            "shards differ": min((weights[0] - w).abs().max().item() for w in weights[1:])}


@pytest.mark.parametrize("n", [2, 3])
def test_fresh_layers_trained_stay_one_model(n):
    for rank, out in enumerate(spawn(fresh_mlp_trained, n, name=f"fresh SP MLP trained, tp={n}").returns):
        assert out["bias across ranks"] == 0, rank
        assert out["shards differ"] > 0.01, rank
        for name in ("bias vs one process", "column vs one process", "row vs one process"):
            assert out[name] < 1e-5, (rank, name, out[name])
