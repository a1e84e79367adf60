"""Small building blocks refuse arguments outside their range: otherwise each would return a
plausible wrong value (another rank's coordinates, an empty shard, a negative bubble, a negative
capacity) that a caller could not tell from a right one."""
import pytest
import torch

from lectures.context_parallel import capacity
from lectures.data_parallel import take_shard
from lectures.layout import mesh_coords
from lectures.pipeline import theory_bubble


@pytest.mark.parametrize("call, says", [
    (lambda: mesh_coords(6, (2, 1, 1, 3)), "rank 6 is outside 0..5"),
    (lambda: mesh_coords(-1, (2, 1, 1, 3)), "rank -1 is outside 0..5"),
    (lambda: take_shard(torch.arange(7.0), 3, 3), "rank 3 is outside 0..2"),
    (lambda: take_shard(torch.arange(7.0), -1, 3), "rank -1 is outside 0..2"),
    (lambda: theory_bubble("1f1b", 0, 4), "p=0"),
    (lambda: theory_bubble("gpipe", 4, 0), "m=0"),
    (lambda: capacity(-1, 8, 2, 4), "factor >= 0"),
    (lambda: capacity(1.0, 8, 0, 4), "top_k and n_experts >= 1"),
])
def test_out_of_range_arguments_are_refused(call, says):
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        call()


def test_the_range_itself_still_works():
    assert mesh_coords(5, (2, 1, 1, 3)) == {"dp": 1, "pp": 0, "cp": 0, "tp": 2}
    assert take_shard(torch.arange(7.0), 2, 3).tolist() == [6.0, 0.0, 0.0]
    assert theory_bubble("gpipe", 4, 1) == pytest.approx(0.75)
    assert capacity(1.0, 8, 2, 4) == 4 and capacity(None, 8, 2, 4) == 16
