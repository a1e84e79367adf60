"""Ranks that disagree (dtype, head count, width, input shape) are refused on every rank with an
error naming what differs, before any collective could abort gloo or run on mismatched data
(float32 against float64 kills gloo with SIGABRT; 4 against 8 heads runs silently). Ranks are seeded alike, as the launcher seeds them. The
check is one all-gather when a layer is built and one on every call (a later call with another
shape on one rank is refused, never a SIGABRT: review N5); shard_checks(False) skips it."""
import pytest
import torch
import torch.distributed as dist

from lectures.tensor_parallel import ops as tp_ops
from lectures.model import GPT, GPTConfig, batch
from lectures.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelAttention,
                                      VocabParallelEmbedding, parallelize_gpt, tp_loss, vocab_parallel_cross_entropy)

from lectures.tensor_parallel import vocab as vocab_parallel
from util import spawn


def _outcome(fn):
    try:
        fn()
        return None
    except ValueError as e:
        return str(e)


def mismatches(rank, world_size):
    g, odd = dist.group.WORLD, rank % 2 == 1
    f64 = torch.float64 if odd else torch.float32
    x = torch.randn(2, 4, 8)
    cases = {   # 12: every layer splits over 2 and 3 ranks, so only the disagreement can refuse
        "column dtype": lambda: ColumnParallelLinear(12, 12, g, dtype=f64),
        "row width": lambda: RowParallelLinear(12, 12 + 2 * odd, g),
        "attention heads": lambda: TensorParallelAttention(6 + 6 * odd, 6 + 6 * odd, 24 // (6 + 6 * odd), 24, g),
        "embedding dtype": lambda: VocabParallelEmbedding(12, 4, g, dtype=f64),
        "column input rows": lambda: ColumnParallelLinear(12, 12, g)(torch.randn(2, 4 + odd, 12)),
        "row input dtype": lambda: RowParallelLinear(12, 12, g)(torch.randn(2, 4, 12 // world_size, dtype=f64)),
        "loss logits dtype": lambda: vocab_parallel_cross_entropy(torch.randn(2, 4, 3, dtype=f64),
                                                                   torch.zeros(2, 4, dtype=torch.long), dist.new_group()),
        "GPT dtype": lambda: parallelize_gpt(GPT(GPTConfig(dtype="float64" if odd else "float32")), g),
        "GPT heads": lambda: parallelize_gpt(GPT(GPTConfig(n_heads=8 if odd else 4)), g),
        # the odd ranks alone could not split one head: refused on every rank all the same
        "GPT heads, one rank cannot split": lambda: parallelize_gpt(GPT(GPTConfig(n_heads=1 if odd else 4)), g),
    }
    return {name: _outcome(fn) for name, fn in cases.items()}


def agreed_once(rank, world_size):
    """A whole TP GPT on ranks that agree: the loss equals on every rank, and a second step checks
    every call again, as many checks as the first (the build's ran before counting)."""
    g, cfg = dist.group.WORLD, GPTConfig()
    model = parallelize_gpt(GPT(cfg), g)
    tokens, targets = batch(cfg, 4, 0)
    calls, real = [], tp_ops._check_agreed
    counted = lambda *a: (calls.append(a[-1]), real(*a))
    tp_ops._check_agreed = vocab_parallel._check_agreed = counted   # the layers' and the loss's
    try:
        first = tp_loss(model, tokens, targets)
        first.backward()
        n_first = len(calls)
        tp_loss(model, tokens, targets).backward()
    finally:
        tp_ops._check_agreed = vocab_parallel._check_agreed = real
    return first.item(), n_first, len(calls) - n_first


def second_call_other_shape(rank, world_size):
    """Review N5: a matching first call, then rank 1 passes 4 positions where rank 0 passes 8."""
    layer = ColumnParallelLinear(8, 8, dist.group.WORLD)
    layer(torch.randn(2, 8, 8))
    return _outcome(lambda: layer(torch.randn(2, 4 if rank == 1 else 8, 8)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_disagreeing_ranks_are_refused_on_every_rank(world_size):
    run = spawn(mismatches, world_size)
    for rank, got in enumerate(run.returns):
        for name, message in got.items():
            assert message is not None, f"rank {rank}: {name} ran"
            assert "disagree" in message, (rank, name, message)
    words = run.returns[0]
    assert "dtype=torch.float32" in words["column dtype"] and "dtype=torch.float64" in words["column dtype"]
    assert "out_features=12" in words["row width"] and "out_features=14" in words["row width"]
    assert "n_heads=6" in words["attention heads"] and "n_heads=12" in words["attention heads"]
    assert "input size 1=4" in words["column input rows"] and "input size 1=5" in words["column input rows"]
    assert "logits dtype" in words["loss logits dtype"]
    assert "n_heads=1" in words["GPT heads, one rank cannot split"]


def test_agreeing_ranks_check_every_call_and_train():
    losses, first, second = zip(*spawn(agreed_once, 2).returns)
    assert losses[0] == losses[1]
    assert first == second and first[0] > 1


def test_a_later_call_with_another_shape_is_refused_not_aborted():
    """Review N5: the check runs on every call, so a ragged batch on one rank is a ValueError on
    every rank, not gloo's SIGABRT."""
    got = spawn(second_call_other_shape, 2).returns
    assert all(m is not None and "input size 1=8" in m and "input size 1=4" in m for m in got), got
