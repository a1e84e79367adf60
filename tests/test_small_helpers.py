"""Small building blocks refuse arguments outside their range: otherwise each would return a
plausible wrong value (another rank's coordinates, an empty shard, a negative bubble, a negative
capacity) that a caller could not tell from a right one."""
import re

import pytest
import torch

from lectures.context_parallel import capacity, route_logits
from lectures.data_parallel import shard_size, take_shard
from lectures.data_parallel.zero import padded
from lectures.layout import Layout, ModelShape, axis_groups, estimate_memory, mesh_coords, mesh_rank
from lectures.pipeline import theory_bubble

SMALL = ModelShape("small", heads=4, kv_heads=4, layers=2, seq=32, hidden=64, ffn=256, vocab=100)


@pytest.mark.parametrize("call, says", [
    (lambda: mesh_coords(6, (2, 1, 1, 3)), "rank 6 is outside 0..5"),
    (lambda: mesh_coords(-1, (2, 1, 1, 3)), "rank -1 is outside 0..5"),
    (lambda: take_shard(torch.arange(7.0), 3, 3), "rank 3 is outside 0..2"),
    (lambda: take_shard(torch.arange(7.0), -1, 3), "rank -1 is outside 0..2"),
    (lambda: theory_bubble("1f1b", 0, 4), "p=0"),
    (lambda: theory_bubble("gpipe", 4, 0), "m=0"),
    (lambda: capacity(-1, 8, 2, 4), "factor >= 0"),
    (lambda: capacity(1.0, 8, 0, 4), "top_k and n_experts >= 1"),
    # values that were returned silently
    (lambda: theory_bubble("xx", 4, 8), "unknown schedule 'xx'"),
    (lambda: theory_bubble("1f1b", 4.5, 8), "whole numbers"),
    (lambda: mesh_coords(2.5, (2, 1, 1, 3)), "rank must be a whole number, not 2.5"),
    (lambda: shard_size(-7, 3), "numel >= 0"),
    (lambda: route_logits(torch.zeros(3, 4), 0), "top_k=0: every token picks 1 to 4 experts"),
    (lambda: estimate_memory(SMALL, Layout(tp=8)), "tp=8 must divide the heads (4)"),
    (lambda: estimate_memory(SMALL, Layout(pp=4, micro_batches=4)), "must not exceed the layers (2)"),
    (lambda: estimate_memory(SMALL, Layout(cp=64)), "2·cp = 128 zig-zag chunks"),
    # errors that did not say what was wrong
    (lambda: axis_groups((2, 1, 1, 3), "xx"), "axis must be one of"),
    (lambda: axis_groups((2, 1, 1, 3), 5), "axis must be one of"),
    (lambda: shard_size(7, 0), "world_size >= 1"),
    (lambda: padded(torch.zeros(3), 0), "world_size >= 1"),
    (lambda: capacity(float("nan"), 8, 2, 4), "factor >= 0"),
    (lambda: route_logits(torch.zeros(3, 4), 5), "top_k=5: every token picks 1 to 4 experts"),
    (lambda: mesh_rank((0, 0, 0, 3), (2, 1, 1, 3)), "coords must be a dict"),
])
def test_out_of_range_arguments_are_refused(call, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        call()


def test_the_range_itself_still_works():
    assert mesh_coords(5, (2, 1, 1, 3)) == {"dp": 1, "pp": 0, "cp": 0, "tp": 2}
    assert take_shard(torch.arange(7.0), 2, 3).tolist() == [6.0, 0.0, 0.0]
    assert theory_bubble("gpipe", 4, 1) == pytest.approx(0.75)
    assert capacity(1.0, 8, 2, 4) == 4 and capacity(None, 8, 2, 4) == 16
