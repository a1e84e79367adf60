"""Async TP's rings (lectures/tensor_parallel/async_tp.py) under NCCL's point-to-point rules, without a GPU.

`tests/support/nccl_standin.py` runs ranks as threads with NCCL's contract: one Work per
batch_isend_irecv, a receive's data only once that Work is waited for (NaN before), batches in
posting order on one stream, sends that complete only when their receive runs. The decomposed
ops must give the same results as one process at t = 2, 3, 4, forward and backward."""
import types

import pytest
import torch
import torch.nn.functional as F

from lectures.tensor_parallel import async_tp as A
from tests.support.nccl_standin import NcclLikeP2P, run_ranks

F64 = torch.float64
B, H, OUT = 3, 7, 5


def _chunk(x, t, r):
    return x.chunk(t, 1)[r].contiguous()


@pytest.mark.parametrize("t", [2, 3, 4])
def test_async_tp_rings_equal_one_process_under_nccls_rules(t, monkeypatch):
    p2p = NcclLikeP2P()
    monkeypatch.setattr(A, "dist", p2p)
    group = types.SimpleNamespace(ranks=list(range(t)))
    monkeypatch.setattr(A, "_size_rank", lambda g: (len(g.ranks), g.ranks.index(p2p.local.rank)))
    monkeypatch.setattr(A, "_check_same_shard", lambda *args: None)   # a collective the stand-in lacks
    g = torch.Generator().manual_seed(t)
    x, w = torch.randn(B, 2 * t, H, generator=g, dtype=F64), torch.randn(OUT, H, generator=g, dtype=F64)
    xs = [torch.randn(B, 2 * t, H, generator=g, dtype=F64) for _ in range(t)]
    ws = [torch.randn(OUT, H, generator=g, dtype=F64) for _ in range(t)]
    dy = torch.randn(B, 2 * t, OUT, generator=g, dtype=F64)
    w_in = torch.randn(OUT * t, H, generator=g, dtype=F64)
    b_in = torch.randn(OUT * t, generator=g, dtype=F64)

    def rank_main(r):
        p2p.local.rank = r
        out = {}
        with torch.no_grad():
            out["all_gather_matmul"] = A.all_gather_matmul(_chunk(x, t, r), w, group)
            out["matmul_reduce_scatter"] = A.matmul_reduce_scatter(xs[r], ws[r], group)
            out["weight grad"] = A.all_gather_weight_grad(dy, _chunk(x, t, r), group)
        # the column-parallel layer with autograd: forward ring, backward reduce-scatter ring and re-gather
        xr = _chunk(x, t, r).requires_grad_(True)
        wr = w_in.chunk(t, 0)[r].clone().requires_grad_(True)
        (A.column_parallel(xr, wr, b_in.chunk(t, 0)[r], group) * dy).sum().backward()   # dY: dy on every rank
        out["column grads"] = (xr.grad, wr.grad)
        return out

    got = run_ranks(rank_main, range(t))
    assert p2p.works_returned == p2p.batches                       # one Work per batch, as NCCL returns
    x_ref = x.clone().requires_grad_(True)
    for r in range(t):
        torch.testing.assert_close(got[r]["all_gather_matmul"], F.linear(x, w))
        torch.testing.assert_close(got[r]["matmul_reduce_scatter"],
                                   _chunk(sum(F.linear(a, b) for a, b in zip(xs, ws)), t, r))
        torch.testing.assert_close(got[r]["weight grad"], dy.flatten(0, 1).t() @ x.flatten(0, 1))
    # the column-parallel layer: rank r holds rows r of w_in; the reference is one Linear
    w_ref = w_in.clone().requires_grad_(True)
    (F.linear(x_ref, w_ref, b_in) * torch.cat([dy] * t, -1)).sum().backward()
    for r in range(t):
        xg, wg = got[r]["column grads"]
        torch.testing.assert_close(xg, _chunk(x_ref.grad, t, r))
        torch.testing.assert_close(wg, w_ref.grad.chunk(t, 0)[r])
