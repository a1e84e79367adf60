"""The device mesh: ranks on a (dp, pp, cp, tp) grid, one process group per axis.

Lecture 07's building block for combining the parallelisms of lectures 03–06. The order is Llama
3's (Llama Team 2024, "The Llama 3 Herd of Models", §3.3.2, https://arxiv.org/abs/2407.21783:
[TP, CP, PP, DP] from the innermost out): tensor parallelism innermost, on the ranks of one node
(as Megatron-LM places it, Narayanan et al. 2021, https://arxiv.org/abs/2104.04473), data
parallelism outermost. torchtitan orders its mesh [pp, dp_replicate, dp_shard, cp, tp]: the
pipeline outermost instead. PyTorch's `init_device_mesh` builds the
same groups (`torch_mesh`; tests/test_lecture_07.py checks they agree rank by rank).
"""
import dataclasses
import itertools
import math
import numbers

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from util import device, mesh_options, new_group

# =========================================================================================
# The device mesh: one process group per axis, tp innermost, dp outermost
# =========================================================================================
# Global rank r sits at coordinates (dp, pp, cp, tp) of a row-major grid whose last axis (tp)
# varies fastest: r = ((dp·PP + pp)·CP + cp)·TP + tp. Consecutive ranks — on a GPU node, the
# GPUs joined by NVLink — form the tensor-parallel groups, which talk the most (every layer);
# the data-parallel groups, which talk once per step, span the farthest ranks.

MESH_AXES = ("dp", "pp", "cp", "tp")


def mesh_coords(rank, shape):
    """{axis: index} of global `rank` on a mesh of `shape` = (dp, pp, cp, tp)."""
    if not isinstance(rank, numbers.Integral) or isinstance(rank, bool):
        raise ValueError(f"rank must be a whole number, not {rank!r}")
    if not 0 <= rank < math.prod(shape):
        raise ValueError(f"rank {rank} is outside 0..{math.prod(shape) - 1} of a {tuple(shape)} mesh")
    coords = {}
    for axis, size in zip(reversed(MESH_AXES), reversed(shape)):
        coords[axis] = rank % size
        rank //= size
    return {a: coords[a] for a in MESH_AXES}


def mesh_rank(coords, shape):
    """The inverse of `mesh_coords`: `coords` is {axis: index}, as mesh_coords returns it."""
    if not isinstance(coords, dict) or set(coords) != set(MESH_AXES):
        raise ValueError(f"coords must be a dict with the axes {MESH_AXES} as keys (as mesh_coords "
                         f"returns), not {coords!r}")
    rank = 0
    for axis, size in zip(MESH_AXES, shape):
        if not 0 <= coords[axis] < size:
            raise ValueError(f"{axis}={coords[axis]} is outside 0..{size - 1}")
        rank = rank * size + coords[axis]
    return rank


def axis_groups(shape, axis):
    """Every group of `axis`: the lists of global ranks that differ only in that coordinate.
    There are world/size(axis) of them, each of size(axis) ranks, in ascending order."""
    if axis not in MESH_AXES:
        raise ValueError(f"axis must be one of {MESH_AXES}, not {axis!r}")
    k = MESH_AXES.index(axis)
    others = [range(s) if i != k else [0] for i, s in enumerate(shape)]
    groups = []
    for fixed in itertools.product(*others):
        coords = dict(zip(MESH_AXES, fixed))
        groups.append([mesh_rank({**coords, axis: i}, shape) for i in range(shape[k])])
    return groups


def replica_groups(shape):
    """Groups of ranks with equal pp and tp coordinates (dp and cp vary): the weight replicas."""
    dp, pp, cp, tp = shape
    return [[mesh_rank({"dp": d, "pp": p, "cp": c, "tp": t}, shape) for d in range(dp) for c in range(cp)]
            for p in range(pp) for t in range(tp)]


@dataclasses.dataclass
class Mesh:
    """This rank's view of the mesh: its coordinates, and for each axis the process group it
    belongs to and the global ranks in it (`group[axis]` is None when the axis has size 1)."""
    shape: tuple
    rank: int
    coords: dict
    ranks: dict
    group: dict

    def size(self, axis):
        return self.shape[MESH_AXES.index(axis)]

    def index(self, axis):
        return self.coords[axis]

    def group_index(self, key):
        """This rank's position in its group `key` (e.g. "ep")."""
        return self.ranks[key].index(self.rank)


_GROUPS = {}   # (mesh shape, ranks) -> process group, per default group: new_group is collective and slow


def _new_group(ranks):
    """util's new_group (the default group's timeout, so a hung collective on a mesh axis is an
    error within the run's timeout), cached for the life of the current default process group."""
    world = dist.distributed_c10d._get_default_group()
    key = (id(world), tuple(ranks))
    if key not in _GROUPS or _GROUPS[key][0] is not world:
        _GROUPS[key] = (world, new_group(list(ranks)))
    return _GROUPS[key][1]


def expert_groups(shape, ep):
    """(expert-parallel groups, expert-replica groups) with ep inside dp: an ep group is ep
    consecutive data-parallel ranks (same pp, cp, tp; dp // ep equal), which share out the
    experts; an expert's replicas are the ranks with the same pp, tp and position in their ep
    group (dp % ep), any cp: they hold the same experts and average their gradients."""
    dp, pp, cp, tp = shape
    if dp % ep:
        raise ValueError(f"ep={ep} must divide dp={dp}")
    at = lambda d, p, c, t: mesh_rank({"dp": d, "pp": p, "cp": c, "tp": t}, shape)
    groups = [[at(g * ep + e, p, c, t) for e in range(ep)]
              for g in range(dp // ep) for p in range(pp) for c in range(cp) for t in range(tp)]
    replicas = [[at(g * ep + e, p, c, t) for g in range(dp // ep) for c in range(cp)]
                for e in range(ep) for p in range(pp) for t in range(tp)]
    return groups, replicas


def make_mesh(dp=1, pp=1, cp=1, tp=1, ep=1):
    """Build the process groups of every axis of a (dp, pp, cp, tp) mesh over all ranks, and
    with ep > 1 the expert-parallel groups inside dp (`expert_groups`).

    `dist.new_group` is collective over the whole world: every rank must create every group, in
    the same order, even the groups it is not in. We walk the axes and their groups in a fixed
    order and keep the one group per axis that contains this rank."""
    shape = (dp, pp, cp, tp)
    world, rank = dist.get_world_size(), dist.get_rank()
    if math.prod(shape) != world:
        raise ValueError(f"mesh dp×pp×cp×tp = {'×'.join(map(str, shape))} = {math.prod(shape)} "
                         f"does not match the {world} ranks of the process group")
    ranks, group = {}, {}
    for axis in MESH_AXES:
        for members in axis_groups(shape, axis):
            g = _new_group(members) if len(members) > 1 else None
            if rank in members:
                ranks[axis], group[axis] = members, g
    # The ranks that hold the same weights and must agree on their gradients: same pp and tp
    # coordinates, any dp and cp (context parallelism splits tokens, not weights).
    for members in replica_groups(shape):
        g = _new_group(members) if len(members) > 1 else None
        if rank in members:
            ranks["replica"], group["replica"] = members, g
    if ep > 1:
        for key, every in zip(("ep", "expert_replica"), expert_groups(shape, ep)):
            for members in every:
                g = _new_group(members) if len(members) > 1 else None
                if rank in members:
                    ranks[key], group[key] = members, g
    return Mesh(shape, rank, mesh_coords(rank, shape), ranks, group)


def torch_mesh(dp=1, pp=1, cp=1, tp=1):
    """PyTorch's DeviceMesh of the same shape and axis names."""
    return init_device_mesh(device().type, (dp, pp, cp, tp), mesh_dim_names=MESH_AXES,
                            backend_override=mesh_options(len(MESH_AXES)))
