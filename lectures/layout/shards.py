"""Where each of a rank's tensors sits in the unsplit model, and the gradient norm that counts
every element once (lecture 08's building blocks; the trainer clips with it).

A rank of `LayoutTrainer` holds tensor-parallel slices of some pipeline stage's parameters:
rows of a column-parallel weight, columns of a row-parallel one, a vocabulary range of the
embedding, the fused [W_q; W_k; W_v] of its heads, whole copies of the norms and of the
row-parallel bias; under expert parallelism (ep), the experts of its ep group's share, which
keep the unsplit model's names (local expert j of a rank whose first expert is f is expert f + j,
one whole tensor each). `local_pieces` names, for every local tensor, the boxes of the global
tensors it holds: `Piece(name, rows, offset, shape)` says that the local rows [rows) are the box
of global tensor `name` that starts at `offset` and has `shape`. The same boxes are what a
distributed checkpoint writes (lectures/checkpoint) and what a global norm must count once.

- `Piece`, `local_pieces`: the boxes of every local parameter.
- `flat_boxes`: the boxes of a flat range of a local tensor (a ZeRO shard's elements).
- `Owners`, `global_grad_norm`, `clip_grads_`: the norm over every rank, each element counted by
  one rank only (replicas, dense or expert: the lowest rank that holds it), and clipping by it.
- `first_expert`, `global_expert_name`: the model's name of a rank's local expert.
"""
import dataclasses
import math

import torch
import torch.distributed as dist

from lectures.context_parallel.moe import expert_owners, moe_gpt
from lectures.model.gpt import GPT


@dataclasses.dataclass(frozen=True)
class Piece:
    """Local rows [rows[0], rows[1]) of a tensor = the box of global tensor `name` at `offset`
    (one index per dimension) of size `shape`."""
    name: str
    rows: tuple
    offset: tuple
    shape: tuple


def global_shapes(cfg, experts=0, top_k=1):
    """{name: shape} of the unsplit GPT's parameters, or with `experts` of lecture 06's MoE GPT
    (the trainer's `build_model`), built on the meta device: no memory. moe_gpt reseeds the
    global RNG, so it is built inside fork_rng: a checkpoint's RNG state is the trainer's."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = moe_gpt(cfg, experts, top_k, capacity_factor=None) if experts else GPT(cfg)
        return {k: tuple(p.shape) for k, p in model.named_parameters()}


def first_expert(trainer):
    """The model's index of this rank's first local expert (0 without expert parallelism)."""
    if trainer.layout.ep == 1:
        return 0
    return expert_owners(trainer.run.experts, trainer.layout.ep)[1][trainer.mesh.group_index("ep")]


def global_expert_name(name, first):
    """'blocks.0.mlp.experts.1.fc_in.weight' on a rank whose first expert is `first` → the model's
    name (expert first + 1); any other name unchanged."""
    parts = name.split(".")
    if len(parts) > 4 and parts[2:4] == ["mlp", "experts"]:
        parts[4] = str(first + int(parts[4]))
    return ".".join(parts)


def _global_name(trainer, local):
    """The unsplit GPT's name of a parameter of the module this rank trains."""
    name = trainer.stage.global_name(local) if trainer.stage is not None else local
    name = global_expert_name(name, first_expert(trainer))    # an expert held under ep: its own tensor
    if name == "lm_head.weight" and trainer.run.cfg.tie_embeddings:
        name = "tok_emb.weight"    # one tensor in the unsplit model: its two copies are one entry
    return name


def _module_pieces(module, leaf, p, name):
    """The boxes of parameter `leaf` of `module` (a layer of lecture 04's tensor parallelism, or
    an ordinary one kept whole); `name` is its global name."""
    shape = tuple(p.shape)
    whole = lambda n=name: [Piece(n, (0, shape[0]), (0,) * len(shape), shape)]
    if hasattr(module, "q_heads_held"):               # TensorParallelAttention: fused Q, K, V rows
        d = module.head_dim
        prefix = name.rsplit(".", 1)[0]
        out, row = [], 0
        for proj, heads in (("q_proj", module.q_heads_held), ("k_proj", module.kv_held), ("v_proj", module.kv_held)):
            if heads != list(range(heads[0], heads[0] + len(heads))):
                raise ValueError(f"{name}: heads {heads} are not contiguous")
            n = len(heads) * d
            out.append(Piece(f"{prefix}.{proj}.{leaf}", (row, row + n), (heads[0] * d,) + (0,) * (len(shape) - 1),
                             (n,) + shape[1:]))
            row += n
        return out
    group = getattr(module, "group", None)
    r = dist.get_rank(group) if group is not None else 0
    if hasattr(module, "full_out_features"):          # ColumnParallelLinear: output rows split
        return [Piece(name, (0, shape[0]), (r * shape[0],) + (0,) * (len(shape) - 1), shape)]
    if hasattr(module, "full_in_features") and leaf == "weight":   # RowParallelLinear: input columns
        return [Piece(name, (0, shape[0]), (0, r * shape[1]), shape)]
    if hasattr(module, "start") and hasattr(module, "num_embeddings"):   # VocabParallelEmbedding
        return [Piece(name, (0, shape[0]), (module.start, 0), shape)]
    return whole()


def local_pieces(trainer):
    """[(local parameter, [Piece, ...])] for every parameter this rank trains, in the order of
    `trainer.params`. Refuses a piece that does not fit inside its global tensor."""
    shapes = global_shapes(trainer.run.cfg, trainer.run.experts, trainer.run.top_k)
    by_id = {}
    for mname, module in trainer.module.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            if id(p) in by_id:
                continue
            local = f"{mname}.{leaf}" if mname else leaf
            by_id[id(p)] = _module_pieces(module, leaf, p, _global_name(trainer, local))
    out = []
    for p in trainer.params:
        pieces = by_id[id(p)]
        for piece in pieces:
            full = shapes.get(piece.name)
            if full is None or len(full) != len(piece.shape) or any(
                    o + s > f for o, s, f in zip(piece.offset, piece.shape, full)):
                raise ValueError(f"{piece.name}: a box {piece.shape} at {piece.offset} does not fit the global "
                                 f"shape {full}: a module type local_pieces does not know?")
        out.append((p, pieces))
    return out


def flat_boxes(piece, start, stop):
    """The boxes of the global tensor that elements [start, stop) of `piece` (counted row-major
    inside the piece) cover: at most three for a matrix (a partial row, whole rows, a partial
    row), one for a vector. Yields (offset in the global tensor, shape, start, stop)."""
    shape = piece.shape
    if len(shape) == 1:
        if start < stop:
            yield (piece.offset[0] + start,), (stop - start,), start, stop
        return
    if len(shape) != 2:
        raise ValueError(f"{piece.name}: flat ranges of {len(shape)}-D tensors are not supported")
    cols = shape[1]
    while start < stop:
        r0, c0 = divmod(start, cols)
        if c0 or stop - start < cols:                 # a partial row
            end = min(stop, (r0 + 1) * cols)
            yield (piece.offset[0] + r0, piece.offset[1] + c0), (1, end - start), start, end
        else:                                         # whole rows
            rows = (stop - start) // cols
            end = start + rows * cols
            yield (piece.offset[0] + r0, piece.offset[1]), (rows, cols), start, end
        start = end


# =========================================================================================
# The global gradient norm: every element counted once
# =========================================================================================

class Owners:
    """Which rank counts which box: every rank lists the keys of the boxes it holds, and a box
    held by several ranks (data-parallel replicas, tensor-parallel copies of a norm, the replicas
    of an expert in the other ep groups) is counted by the lowest of them. One all_gather_object, at the first use."""

    def __init__(self, keys):
        lists = [None] * dist.get_world_size()
        dist.all_gather_object(lists, sorted(keys))
        first = {}
        for rank, ks in enumerate(lists):
            for k in ks:
                first.setdefault(k, rank)
        me = dist.get_rank()
        self.mine = {k for k in keys if first[k] == me}


def grad_boxes(trainer):
    """[(key, flat gradient tensor of the box)] of this rank: whole local gradients cut into
    their pieces, or (ZeRO) this rank's gradient shards cut by the pieces they cross."""
    out = []
    zero = trainer.zero
    for i, (p, pieces) in enumerate(local_pieces(trainer)):
        cols = p[0].numel() if p.dim() > 1 else 1
        if zero is None:
            g = p.grad
            for piece in pieces:
                part = g[piece.rows[0]:piece.rows[1]].reshape(-1) if g is not None else None
                out.append(((piece.name, piece.offset, piece.shape), part))
            continue
        s, r = zero.shards[i].numel(), dist.get_rank(zero.comm.group)
        for piece in pieces:
            f0, f1 = piece.rows[0] * cols, piece.rows[1] * cols
            a, b = max(f0, r * s), min(f1, (r + 1) * s)
            if a < b:
                out.append(((piece.name, piece.offset, piece.shape, a - f0, b - f0), (i, a - r * s, b - r * s)))
    return out


def global_grad_norm(trainer, zero_grads=None, count_once=True):
    """The 2-norm of the whole model's gradient, the same on every rank: each rank sums the
    squares of the boxes it owns, one all-reduce adds them up. `zero_grads`: ZeRO's gradient
    shards (their padding is zero and counts nothing). `count_once=False` is the classic bug:
    every rank counts everything it holds, so replicas and replicated norms count many times."""
    boxes = grad_boxes(trainer)
    if getattr(trainer, "_owners", None) is None:
        trainer._owners = Owners([k for k, _ in boxes])
    total = torch.zeros((), dtype=torch.float64)
    for key, part in boxes:
        if count_once and key not in trainer._owners.mine:
            continue
        if zero_grads is not None:
            i, a, b = part
            part = zero_grads[i][a:b]
        if part is not None:
            total += part.detach().double().pow(2).sum().cpu()
    dist.all_reduce(total)
    return math.sqrt(total.item())


def clip_coefficient(norm, max_norm):
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), never above 1."""
    return min(1.0, max_norm / (norm + 1e-6))


def clip_grads_(trainer, max_norm, zero_grads=None):
    """Scale this rank's gradients (or ZeRO's shards) by the global clipping factor; returns the
    global norm before clipping."""
    norm = global_grad_norm(trainer, zero_grads)
    coef = clip_coefficient(norm, max_norm)
    if coef < 1.0:
        for g in (zero_grads if zero_grads is not None else [p.grad for p in trainer.params]):
            if g is not None:
                g.mul_(coef)
    return norm
