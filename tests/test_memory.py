"""The two memory meters against allocations whose size is known to the byte."""
import torch
import torch.nn.functional as F
from torch import nn

from lectures.model import LiveBytes, SavedBytes, saved_bytes


def test_live_bytes_counts_a_linear_output_not_its_weight():
    # F.linear takes aten.t(weight): a view of a parameter that existed before the block. The
    # output (4 × 256 fp32 = 4,096 bytes) is the only new storage; the old meter said 266,240.
    lin, x = nn.Linear(256, 256), torch.randn(4, 256)
    with LiveBytes() as m:
        y = lin(x)
    assert (m.now, m.peak) == (4096, 4096)
    del y
    assert m.now == 0


def test_live_bytes_ignores_views_in_place_and_out_results():
    x, out = torch.randn(8, 16), torch.empty(8, 16)
    with LiveBytes() as m:
        v = x.t()[1:]          # views of an old storage
        x.add_(1.0)            # in place
        torch.mul(x, 2.0, out=out)
        new = x * 3.0          # the one new tensor: 512 bytes
        w = new.view(-1)       # a view of a new storage counts once
    assert m.now == 8 * 16 * 4
    assert v.shape == (15, 8) and w.numel() == 128


def test_live_bytes_peak_sees_freed_temporaries():
    x = torch.randn(1000)
    with LiveBytes() as m:
        tmp = x * 2.0          # 4,000 bytes
        del tmp
        kept = x[:10] + 1.0    # 40 bytes
    assert m.now == 40 and m.peak == 4000
    m.reset_peak()
    assert m.peak == 40 and kept.numel() == 10


def test_live_bytes_counts_new_optimizer_state_not_in_place_updates():
    lin = nn.Linear(64, 32)
    opt = torch.optim.AdamW(lin.parameters(), foreach=False)
    lin(torch.randn(3, 64)).sum().backward()
    psi = sum(p.numel() for p in lin.parameters())
    with LiveBytes() as m:
        opt.step()             # first step allocates exp_avg and exp_avg_sq
    assert m.now == 2 * psi * 4
    with LiveBytes() as m:
        opt.step()             # later steps update them in place
    assert m.now == 0


def test_saved_bytes_of_a_linear_and_gelu_excludes_the_weight():
    lin = nn.Linear(16, 8)
    x = torch.randn(5, 16, requires_grad=True)
    # Linear saves its input (5×16) and weight (excluded); GELU saves its input (5×8).
    _, n = saved_bytes(lambda: F.gelu(lin(x)), exclude=lin.parameters())
    assert n == (5 * 16 + 5 * 8) * 4
    _, with_weight = saved_bytes(lambda: F.gelu(lin(x)))
    assert with_weight == n + 16 * 8 * 4


def test_saved_bytes_counts_shared_storage_once_and_follows_release():
    buf = torch.randn(4, 3 * 8, requires_grad=True)
    meter = SavedBytes()
    with meter:
        q, k, v = (buf * 1.0).split(8, dim=1)   # three views of one new storage
        y = (q * k * v).sum()
    # q * k saves q and k (one storage, 4×24), then (q·k) * v saves the product (4×8) and v
    assert meter.total == meter.live == meter.peak == (4 * 24 + 4 * 8) * 4
    assert [b for _, _, b in meter.tensors] == [4 * 24 * 4, 4 * 8 * 4]
    y.backward()
    assert meter.live == 0 and meter.peak == (4 * 24 + 4 * 8) * 4


def test_saved_bytes_reenters_per_micro_batch():
    lin = nn.Linear(8, 8)
    meter = SavedBytes(exclude=lin.parameters())
    losses = []
    for _ in range(3):
        with meter:
            losses.append(F.relu(lin(torch.randn(2, 8))).sum())
    per = 2 * 8 * 4 * 2          # Linear's input, ReLU's output
    assert meter.live == meter.peak == 3 * per
    for loss in losses:
        loss.backward()
    assert meter.live == 0 and meter.total == 3 * per
