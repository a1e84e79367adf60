"""Ring attention under NCCL's rules, without a GPU.

`tests/support/nccl_standin.py` models what NCCL does with `batch_isend_irecv`: one Work per batch, a
receive's data only after that Work is waited for (NaN before), a rank's batches in posting order
on one stream, sends that complete only when their receive runs. Ring attention is run under it
with ranks as threads: it must equal one process at p = 2, 3, 4 (5 and 8 zig-zag causal, and on a
sub-group) and finish (the stand-in raises TimeoutError on a cycle of waits)."""
import collections
import types

import pytest
import torch

from lectures.context_parallel import unshard_sequence
from lectures.context_parallel.demos import attention_inputs
from lectures.context_parallel import ring as ring_attention
from lectures.context_parallel import sharding as sequence_layout
from tests.support.nccl_standin import NcclLikeP2P, run_ranks


class ThreadedNccl(NcclLikeP2P):
    """The stand-in's point-to-point calls, plus what ring attention calls besides them: the
    group queries and one all_gather (every rank's sequence length and signature), which NCCL
    runs as a collective before any of the ring's sends."""

    def __init__(self, world_size, timeout=20.0):
        super().__init__(timeout)
        world = types.SimpleNamespace(ranks=list(range(world_size)))
        self.group = types.SimpleNamespace(WORLD=world)
        self.gathered, self.rounds = {}, collections.Counter()

    def get_rank(self, group=None):
        ranks = (group or self.group.WORLD).ranks
        return ranks.index(self.local.rank) if self.local.rank in ranks else -1

    def get_world_size(self, group=None):
        return len((group or self.group.WORLD).ranks)

    def all_gather(self, out, t, group=None):
        ranks = tuple((group or self.group.WORLD).ranks)
        me = self.local.rank
        with self.cond:
            key = (ranks, self.rounds[me, ranks])
            self.rounds[me, ranks] += 1
            got = self.gathered.setdefault(key, {})
            got[ranks.index(me)] = t.clone()
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: len(got) == len(ranks), timeout=self.timeout):
                raise TimeoutError(f"rank {me}: all_gather never completed")
        for i, o in enumerate(out):
            o.copy_(got[i])


def ring_under_nccl(monkeypatch, world_size, ranks, seq_len, heads, kv_heads, layout, causal):
    """Ring attention forward and backward on threads `ranks` (a group of them) under NCCL's rules;
    returns the unsharded output and gradients, and the stand-in."""
    p2p = ThreadedNccl(world_size)
    monkeypatch.setattr(ring_attention, "dist", p2p)
    monkeypatch.setattr(sequence_layout, "dist", p2p)
    group = None if len(ranks) == world_size else types.SimpleNamespace(ranks=list(ranks))
    n = len(ranks)
    q, _, _, dout = attention_inputs(seq_len, heads)
    _, k, v, _ = attention_inputs(seq_len, kv_heads, seed=1)

    def rank_main(g):
        p2p.local.rank = g
        r = list(ranks).index(g)
        ql, kl, vl = (sequence_layout.shard_sequence(t, r, n, 2, layout).requires_grad_() for t in (q, k, v))
        out = ring_attention.ring_attention(ql, kl, vl, causal=causal, group=group, layout=layout)
        out.backward(sequence_layout.shard_sequence(dout, r, n, 2, layout))
        return [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)]
    got = run_ranks(rank_main, ranks)
    parts = [unshard_sequence([got[g][i] for g in ranks], 2, layout) for i in range(4)]
    groups = heads // kv_heads
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
    ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
    ref.backward(dout)
    fold = lambda g: g.view(g.shape[0], kv_heads, groups, *g.shape[2:]).sum(2)
    return parts, [ref.detach(), qr.grad, fold(kr.grad), fold(vr.grad)], p2p


CASES = ([(p, layout, causal) for p in (2, 3, 4) for layout in ("contiguous", "zigzag") for causal in (False, True)]
         + [(p, "zigzag", True) for p in (5, 8)])   # larger rings finish too


@pytest.mark.parametrize("p,layout,causal", CASES, ids=lambda x: str(x))
def test_ring_attention_equals_one_process_under_nccls_rules(monkeypatch, p, layout, causal):
    got, want, p2p = ring_under_nccl(monkeypatch, p, range(p), seq_len=4 * p + 3, heads=4, kv_heads=2,
                                     layout=layout, causal=causal)
    for name, a, b in zip(("output", "dQ", "dK", "dV"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    assert p2p.works_returned == p2p.batches                   # one Work per batch, as NCCL returns
    # forward: n − 1 K/V hops; backward: n − 1 K/V hops and n dK/dV hops, one batch each per rank
    assert p2p.batches == p * (3 * p - 2)


def test_ring_attention_on_a_sub_group_under_nccls_rules(monkeypatch):
    """Ranks 1..3 of a world of 4 form the ring: peers are named by their global rank."""
    got, want, _ = ring_under_nccl(monkeypatch, 4, (1, 2, 3), seq_len=14, heads=2, kv_heads=2, layout="zigzag",
                                   causal=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_ring_transfer_waits_its_one_work_before_reading(monkeypatch):
    """Under NCCL a batch returns one Work: RingTransfer must not pair ops with Works one to one
    (the second op would never be waited) and must hand out its buffer only after the wait."""
    p2p = ThreadedNccl(2)
    monkeypatch.setattr(ring_attention, "dist", p2p)

    def rank_main(r):
        p2p.local.rank = r
        t = ring_attention.RingTransfer(torch.full((3,), float(r)), (3,), p2p.group.WORLD, 2, r, 0, "test")
        return t.wait()
    got = run_ranks(rank_main, [0, 1])
    for r in (0, 1):
        assert torch.equal(got[r], torch.full((3,), float(1 - r)))
