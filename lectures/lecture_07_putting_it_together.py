"""Putting it together: a 4D mesh, a memory estimator, and a configuration search

Data, pipeline, context and tensor parallelism (and ZeRO on the data axis) on one device mesh;
the same small GPT trained under many layouts and checked against one process; then the
formulas of the earlier lectures turned into a per-rank memory estimator and a step-time model
calibrated on this machine, used to search every valid layout — here, where we can run them,
and at published scale, where we cannot.
"""
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from util import device, figure, note, see, settings, spawn, table
from util.measure import errorbar, machine, measure, measure_side_by_side, timing_ranks

from lectures import lecture_01_memory_and_precision as L1

# =========================================================================================
# 1. The device mesh: one process group per axis, tp innermost, dp outermost
# =========================================================================================
# Global rank r sits at coordinates (dp, pp, cp, tp) of a row-major grid whose last axis (tp)
# varies fastest: r = ((dp·PP + pp)·CP + cp)·TP + tp. Consecutive ranks — on a GPU node, the
# GPUs joined by NVLink — form the tensor-parallel groups, which talk the most (every layer);
# the data-parallel groups, which talk once per step, span the farthest ranks.

MESH_AXES = ("dp", "pp", "cp", "tp")


def mesh_coords(rank, shape):
    """{axis: index} of global `rank` on a mesh of `shape` = (dp, pp, cp, tp)."""
    coords = {}
    for axis, size in zip(reversed(MESH_AXES), reversed(shape)):
        coords[axis] = rank % size
        rank //= size
    return {a: coords[a] for a in MESH_AXES}


def mesh_rank(coords, shape):
    """The inverse of `mesh_coords`."""
    rank = 0
    for axis, size in zip(MESH_AXES, shape):
        if not 0 <= coords[axis] < size:
            raise ValueError(f"{axis}={coords[axis]} is outside 0..{size - 1}")
        rank = rank * size + coords[axis]
    return rank


def axis_groups(shape, axis):
    """Every group of `axis`: the lists of global ranks that differ only in that coordinate.
    There are world/size(axis) of them, each of size(axis) ranks, in ascending order."""
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


_GROUPS = {}   # (mesh shape, ranks) -> process group, per default group: new_group is collective and slow


def _new_group(ranks):
    """dist.new_group, cached for the life of the current default process group."""
    world = dist.distributed_c10d._get_default_group()
    key = (id(world), tuple(ranks))
    if key not in _GROUPS or _GROUPS[key][0] is not world:
        _GROUPS[key] = (world, dist.new_group(list(ranks)))
    return _GROUPS[key][1]


def make_mesh(dp=1, pp=1, cp=1, tp=1):
    """Build the process groups of every axis of a (dp, pp, cp, tp) mesh over all ranks.

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
    return Mesh(shape, rank, mesh_coords(rank, shape), ranks, group)


def torch_mesh(dp=1, pp=1, cp=1, tp=1):
    """PyTorch's DeviceMesh of the same shape and axis names."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device().type, (dp, pp, cp, tp), mesh_dim_names=MESH_AXES)


def compare_meshes(rank, world_size, shape):
    """Ours and init_device_mesh's: the global ranks of this rank's group on every axis."""
    ours = make_mesh(*shape)
    theirs = torch_mesh(*shape)
    out = {"coords": ours.coords, "ours": ours.ranks, "torch": {}}
    for axis in MESH_AXES:
        g = theirs[axis].get_group()
        out["torch"][axis] = sorted(dist.get_process_group_ranks(g))
    # The groups work: a sum over each axis counts its members.
    for axis in MESH_AXES:
        if ours.group[axis] is not None:
            t = torch.ones(1, device=device())
            dist.all_reduce(t, group=ours.group[axis])
            out.setdefault("sums", {})[axis] = int(t.item())
    return out


def draw_mesh(shape, highlight=0):
    """A picture of the mesh: one box per global rank, laid out as tp × cp columns and
    dp × pp rows, with the groups of rank `highlight` outlined."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    dp, pp, cp, tp = shape
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * cp * tp + 3.4), 0.75 * dp * pp + 1.4))
    colours = {"dp": "#4c72b0", "pp": "#dd8452", "cp": "#55a868", "tp": "#c44e52"}
    here = mesh_coords(highlight, shape)
    for rank in range(math.prod(shape)):
        c = mesh_coords(rank, shape)
        x, y = c["cp"] * tp + c["tp"], c["dp"] * pp + c["pp"]
        inside = [a for a in MESH_AXES if all(c[b] == here[b] for b in MESH_AXES if b != a)]
        face = "#fff3c4" if rank == highlight else "white"
        ax.add_patch(Rectangle((x + 0.05, -y - 0.95), 0.9, 0.9, facecolor=face, edgecolor="black", lw=0.8))
        ax.text(x + 0.5, -y - 0.42, f"{rank}", ha="center", va="center", fontsize=11, weight="bold")
        ax.text(x + 0.5, -y - 0.78, f"d{c['dp']} p{c['pp']} c{c['cp']} t{c['tp']}",
                ha="center", va="center", fontsize=6.5)
        for j, axis in enumerate(a for a in MESH_AXES if a in inside and shape[MESH_AXES.index(a)] > 1):
            ax.add_patch(Rectangle((x + 0.05 + 0.04 * j, -y - 0.95 + 0.04 * j), 0.9 - 0.08 * j,
                                   0.9 - 0.08 * j, fill=False, edgecolor=colours[axis], lw=2))
    for j, axis in enumerate(MESH_AXES):
        ax.plot([], [], color=colours[axis], lw=2,
                label=f"{axis} group of rank {highlight} (size {shape[j]})")
    ax.set_xlim(-0.1, cp * tp + 0.1)
    ax.set_ylim(-dp * pp - 0.1, 0.1)
    ax.set_xticks([i + 0.5 for i in range(cp * tp)], [f"c{i // tp} t{i % tp}" for i in range(cp * tp)])
    ax.set_yticks([-i - 0.5 for i in range(dp * pp)], [f"d{i // pp} p{i % pp}" for i in range(dp * pp)])
    ax.tick_params(length=0)
    for s in ax.spines.values():
        s.set_visible(False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(f"mesh dp={dp} × pp={pp} × cp={cp} × tp={tp}: global rank, coordinates", fontsize=9)
    fig.tight_layout()
    return fig


# =========================================================================================
# 2. Per-rank memory: weights, gradients, optimizer state, activations
# =========================================================================================

@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory and time formulas need to know about a decoder-only transformer."""
    name: str
    layers: int            # L
    hidden: int            # h
    heads: int             # a
    kv_heads: int
    ffn: int               # f
    vocab: int             # v
    seq: int               # s
    mlp_matrices: int = 2  # 2: GELU MLP (fc_in, fc_out); 3: SwiGLU (gate, up, down)
    kv_expanded: bool = False  # K/V repeated to every query head before attention (lecture 01's GQA)
    bias: bool = True
    norm_params: int = 2   # LayerNorm: weight + bias per feature; RMSNorm: 1
    learned_positions: bool = True
    tied: bool = False

    @classmethod
    def from_gpt(cls, cfg, name="lecture 01 GPT"):
        return cls(name, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.ff,
                   cfg.vocab_size, cfg.seq_len, tied=cfg.tie_embeddings, kv_expanded=True)

    @property
    def head_dim(self):
        return self.hidden // self.heads

    @functools.cached_property
    def kv_dim(self):
        return self.kv_heads * self.head_dim

    @functools.cache
    def layer_params(self, tp=1):
        """(sharded over tp, replicated) parameters of one block. Column-parallel Q/K/V and the
        MLP's input matrices split their outputs (weights and biases), row-parallel O and the
        MLP's output matrix split their inputs (weights; the bias is added once, replicated);
        the norms are replicated."""
        h, kv, f, b = self.hidden, self.kv_dim, self.ffn, self.bias
        sharded = (h * h + 2 * h * kv) + (h * h) + (self.mlp_matrices - 1) * h * f + f * h
        sharded += b * (h + 2 * kv + (self.mlp_matrices - 1) * f)
        replicated = b * (h + h) + 2 * self.norm_params * h
        return sharded / tp, replicated

    @functools.cache
    def tensors_per_layer(self):
        """Parameter tensors of one block: 4 attention matrices, the MLP's, their biases, norms."""
        return (4 + self.mlp_matrices) * (1 + self.bias) + 2 * (self.norm_params > 0) * self.norm_params

    @functools.cache
    def embedding_params(self):
        return self.vocab * self.hidden + self.learned_positions * self.seq * self.hidden

    @functools.cache
    def head_params(self):
        """The final norm and (untied) LM head."""
        return self.norm_params * self.hidden + (0 if self.tied else self.vocab * self.hidden)

    @functools.cache
    def params(self):
        """Ψ; equals lecture 01's param_count for its GPT (tested)."""
        return self.embedding_params() + self.layers * sum(self.layer_params()) + self.head_params()

    @functools.cache
    def act_elements_per_token(self, tp=1, sp=False):
        """Elements autograd keeps per token in one block (measured below, in float32):
        the block input x, the first norm's output, Q, K, V, the attention output and its
        log-sum-exp (flash attention: no s×s matrix), the residual after attention, the second
        norm's output, and the MLP's intermediate tensors (GELU: its input and output, 2f;
        SwiGLU: gate, up, silu(gate), product, 4f), plus the norms' mean and 1/σ (4).
        Tensor parallelism splits heads and the MLP width; sequence parallelism also splits
        the residual-stream tensors along the sequence."""
        h, f, a = self.hidden, self.ffn, self.heads
        kv = h if self.kv_expanded else self.kv_dim        # what attention receives and saves
        mlp = (2 if self.mlp_matrices == 2 else 4) * f
        split = (2 * h + 2 * kv + a + mlp) / tp               # Q, attention out, K, V, lse, MLP
        stream = 4 * h + 4                                     # x, norm out, x2, norm out, stats
        return split + (stream / tp if sp else stream)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a training step: the mesh and everything that changes memory or time."""
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    zero: int = 0                  # ZeRO stage on the dp axis (0: plain data parallelism)
    micro_batch: int = 1           # sequences per micro-batch on one dp rank
    micro_batches: int = 1         # m: micro-batches per step (pipeline / accumulation)
    recompute: str = "none"        # "none" or "full" (keep only each block's input)
    precision: str = "fp32"        # "fp32", "bf16" (mixed: bf16 weights/grads, fp32 master + Adam), "fp64"
    sp: bool = False               # sequence parallelism with tp
    schedule: str = "1f1b"         # "1f1b" or "gpipe"
    vocab_parallel: bool = True    # the LM head split over tp (vocab-parallel cross-entropy)

    @property
    def world(self):
        return self.dp * self.pp * self.cp * self.tp

    @property
    def global_batch(self):
        return self.dp * self.micro_batch * self.micro_batches

    def label(self):
        parts = [f"{k}{getattr(self, k)}" for k in MESH_AXES if getattr(self, k) > 1] or ["1 rank"]
        if self.zero:
            parts.append(f"ZeRO-{self.zero}")
        if self.sp:
            parts.append("SP")
        if self.recompute != "none":
            parts.append("recompute")
        if self.pp > 1 and self.schedule != "1f1b":
            parts.append(self.schedule)
        parts.append(f"mb{self.micro_batch}×{self.micro_batches}")
        return " ".join(parts)


PRECISION_BYTES = {  # bytes per parameter (weights, grads, optimizer state) and per activation
    "fp64": {"weights": 8, "grads": 8, "optimizer": 16, "act": 8},   # the tests' exact runs
    # float32 AdamW: fp32 weights and grads, two fp32 moments; no separate master copy.
    "fp32": {"weights": 4, "grads": 4, "optimizer": 8, "act": 4},
    # mixed precision (ZeRO paper's accounting): bf16 weights and grads; fp32 master weights
    # and the two moments, K = 12.
    "bf16": {"weights": 2, "grads": 2, "optimizer": 12, "act": 2},
}


def stage_layers(layers, pp):
    """How many blocks each pipeline stage holds: lecture 05's GPTStage cuts at k·L/pp, so
    sizes differ by at most one and the later stages take the extra."""
    return [(k + 1) * layers // pp - k * layers // pp for k in range(pp)]


def in_flight(layout, stage):
    """Micro-batches whose activations a stage holds at its peak: all m under GPipe, at most
    pp − stage under 1F1B (the first stage waits longest for its backward)."""
    if layout.pp == 1:
        return 1
    return layout.micro_batches if layout.schedule == "gpipe" else min(layout.pp - stage, layout.micro_batches)


def stage_params(model, layout, stage):
    """Parameters held by one rank of pipeline stage `stage` (before ZeRO). With
    `vocab_parallel` the token embedding and the LM head are split by vocabulary rows."""
    tp, first, last = layout.tp, stage == 0, stage == layout.pp - 1
    sharded, replicated = model.layer_params(tp)
    n = stage_layers(model.layers, layout.pp)[stage] * (sharded + replicated)
    if first:
        n += model.embedding_params()
        if layout.vocab_parallel:
            n -= model.vocab * model.hidden * (1 - 1 / tp)
    if last:
        head = model.head_params()
        if layout.vocab_parallel and not model.tied:
            head = model.norm_params * model.hidden + model.vocab * model.hidden / tp
        n += head
    return n


def activation_bytes(model, layout, stage):
    """(stored, transient) bytes of saved activations on one rank of `stage` at the peak of a
    step: stored = (per micro-batch) × (micro-batches in flight); transient = one block's full
    activations while it is recomputed during backward (full recomputation only). Tokens per
    micro-batch on this rank: micro_batch · s / cp."""
    B = PRECISION_BYTES[layout.precision]["act"]
    tokens = layout.micro_batch * model.seq / layout.cp
    n_layers = stage_layers(model.layers, layout.pp)[stage]
    per_layer = model.act_elements_per_token(layout.tp, layout.sp) * B
    if layout.recompute == "full":
        stored = n_layers * model.hidden * B * (1 / layout.tp if layout.sp else 1)
        transient = per_layer * tokens
    else:
        stored, transient = n_layers * per_layer, 0
    if stage == 0:
        stored += 8                                            # the int64 token ids
    if stage == layout.pp - 1:
        v = model.vocab / layout.tp if layout.vocab_parallel else model.vocab
        stored += (2 * model.hidden + 2) * B + v * 4 + 8      # final norm in/out, fp32 log-probs, targets
    return tokens * stored * in_flight(layout, stage), transient


@functools.cache
def estimate_memory(model, layout, stage=None):
    """Per-rank bytes {weights, grads, optimizer, activations, total} for the most loaded
    pipeline stage (or `stage`). ZeRO-1 shards the optimizer state over dp, ZeRO-2 also the
    gradients, ZeRO-3 also the weights (lecture 03); tp divides the matrices (lecture 04); pp
    divides the layers (lecture 05); cp divides the tokens (lecture 06)."""
    if stage is None:   # the first stage holds the most micro-batches, the last the LM head
        return max((estimate_memory(model, layout, s) for s in {0, layout.pp - 1}), key=lambda m: m["total"])
    B = PRECISION_BYTES[layout.precision]
    n = stage_params(model, layout, stage)
    dp, z = layout.dp, layout.zero
    out = {"stage": stage, "params": n,
           "weights": B["weights"] * n / (dp if z >= 3 else 1),
           "grads": B["grads"] * n / (dp if z >= 2 else 1),
           "optimizer": B["optimizer"] * n / (dp if z >= 1 else 1),
           "activations": sum(activation_bytes(model, layout, stage)),
           "stored activations": activation_bytes(model, layout, stage)[0]}
    out["total"] = out["weights"] + out["grads"] + out["optimizer"] + out["activations"]
    return out


# =========================================================================================
# 3. Step time: a cost model with measured (or published) constants
# =========================================================================================

@dataclasses.dataclass(frozen=True)
class Hardware:
    """The constants of the step-time model. Links follow the α–β model of lecture 02 per ring
    step: a collective over n ranks costs (steps)·α + (fraction of the bytes each rank
    moves)/β. `intra` links join the ranks of a node, `inter` links cross nodes."""
    name: str
    flops: float                 # sustained matmul FLOP/s per rank
    memory: float                # bytes per rank available for training state
    ranks_per_node: int
    intra: tuple                 # (α seconds, β bytes/s) within a node
    inter: tuple                 # (α, β) across nodes
    overhead: float = 0.0        # fixed seconds per block per micro-batch (forward + backward)
    step_overhead: float = 0.0   # fixed seconds per step (optimizer, Python)
    overlap: float = 0.0         # fraction of backward that data-parallel traffic can hide under
    peak: float = None           # peak FLOP/s for MFU (defaults to `flops`)
    bucketed: bool = True        # gradients synced in one message (else one per parameter tensor)
    p2p: tuple = None            # (α, β) of one send/recv where it differs from a ring step


def axis_link(hw, layout, axis):
    """(α, β) of the links an axis' groups use: a group is inside one node when its span
    (stride × size, the stride being the product of the inner axes) fits in a node."""
    sizes = dict(zip(MESH_AXES, (layout.dp, layout.pp, layout.cp, layout.tp)))
    k = MESH_AXES.index(axis)
    stride = math.prod(sizes[a] for a in MESH_AXES[k + 1:])
    return hw.intra if stride * sizes[axis] <= hw.ranks_per_node else hw.inter


def p2p_link(hw, layout, axis):
    return hw.p2p or axis_link(hw, layout, axis)


def all_reduce_time(n, nbytes, link):
    """Ring all-reduce: 2(n−1) steps, each rank sends 2(n−1)/n of the buffer."""
    alpha, beta = link
    return 0.0 if n == 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


def gather_time(n, nbytes, link):
    """Ring all-gather or reduce-scatter of a full buffer of `nbytes`."""
    alpha, beta = link
    return 0.0 if n == 1 else (n - 1) * alpha + (n - 1) / n * nbytes / beta


def p2p_time(nbytes, link):
    alpha, beta = link
    return alpha + nbytes / beta


def flops_per_token(model, recompute="none"):
    """Training FLOPs per token: 6 per matrix parameter (2 forward, 4 backward) plus the
    attention scores and values, 12·L·h·s (the convention of the MFU literature: no credit
    for causal skipping). Full recomputation runs every block's forward twice (+2 per matrix
    parameter), which costs time but is not counted as useful work in MFU."""
    sharded, _ = model.layer_params()
    matrix = model.layers * sharded + model.vocab * model.hidden
    useful = 6 * matrix + 12 * model.layers * model.hidden * model.seq
    if recompute == "full":
        return useful, useful + 2 * model.layers * sharded + 4 * model.layers * model.hidden * model.seq
    return useful, useful


def step_time(model, layout, hw):
    """Predicted seconds per optimizer step and its parts, for the slowest pipeline stage.

    compute   a micro-batch on one stage: its FLOPs / (tp·cp) at `hw.flops`, plus a fixed
              cost per block (Python and kernel launches: what dominates tiny models);
    tp        4 all-reduces of the block's activations per block and micro-batch (2 forward,
              2 backward; sequence parallelism moves the same bytes as reduce-scatter +
              all-gather);
    cp        ring attention: cp−1 passes of K and V forward, of K, V, dK, dV backward;
    pp        (m + pp − 1) slots of one micro-batch each (the bubble is pp − 1 of them), plus
              a send of activations forward and of gradients backward per slot;
    dp        one gradient all-reduce over the dp·cp ranks that hold the same weights
              (ZeRO-1/2: reduce-scatter + all-gather; ZeRO-3 also gathers weights for every
              micro-batch's forward and backward), partly hidden under backward (`overlap`)."""
    B = PRECISION_BYTES[layout.precision]
    tokens = layout.micro_batch * model.seq / layout.cp          # per rank per micro-batch
    sizes = stage_layers(model.layers, layout.pp)
    worst = max(range(layout.pp), key=lambda s: sizes[s] + (s == layout.pp - 1) * model.vocab / (12 * model.hidden))
    n_layers = sizes[worst]
    sharded, _ = model.layer_params()
    layer_flops = 6 * sharded + 12 * model.hidden * model.seq
    if layout.recompute == "full":
        layer_flops += 2 * sharded + 4 * model.hidden * model.seq
    head_flops = 6 * model.vocab * model.hidden if worst == layout.pp - 1 else 0
    flops = tokens * (n_layers * layer_flops + head_flops) / layout.tp
    compute = flops / hw.flops + n_layers * hw.overhead
    act = tokens * model.hidden * B["act"]
    tp_link = axis_link(hw, layout, "tp")
    tp = 4 * n_layers * all_reduce_time(layout.tp, act, tp_link)
    if layout.tp > 1 and worst == layout.pp - 1:   # vocabulary-parallel head and loss
        tp += 2 * all_reduce_time(layout.tp, act, tp_link) + 3 * all_reduce_time(layout.tp, tokens * 4, tp_link)
    kv = 2 * tokens * model.kv_dim * B["act"] / layout.tp
    cp = 3 * n_layers * (layout.cp - 1) * p2p_time(kv, p2p_link(hw, layout, "cp")) if layout.cp > 1 else 0.0
    # a pipeline slot: one micro-batch's forward and backward on this stage, and its sends
    sends = 2 * p2p_time(act, p2p_link(hw, layout, "pp")) if layout.pp > 1 else 0.0
    slot = compute + tp + cp + sends
    m = layout.micro_batches
    pipeline = (m + layout.pp - 1) * slot
    # Data-parallel traffic: the dp·cp ranks of one (pp, tp) position hold the same weights.
    n_sync = layout.dp * layout.cp
    link = axis_link(hw, layout, "dp") if layout.dp > 1 else axis_link(hw, layout, "cp")
    grad_bytes = stage_params(model, layout, worst) * B["grads"]
    # One message for all gradients (bucketed), or one per parameter tensor.
    messages = 1 if hw.bucketed else (n_layers * model.tensors_per_layer() + 2 * (worst == 0) + 3 * (worst == layout.pp - 1))
    if layout.zero == 0:
        dp = messages * all_reduce_time(n_sync, grad_bytes / messages, link)
    else:
        dp = 2 * messages * gather_time(n_sync, grad_bytes / messages, link)
    # Gradient traffic can hide under backward (≈ 2/3 of the compute), ZeRO-3's forward
    # gathers under forward (≈ 1/3), as far as `hw.overlap` allows.
    exposed_dp = max(0.0, dp - hw.overlap * m * compute * 2 / 3)
    if layout.zero >= 3:
        gather = m * gather_time(n_sync, stage_params(model, layout, worst) * B["weights"], link)
        exposed_dp = (max(0.0, dp + gather - hw.overlap * m * compute * 2 / 3)
                      + max(0.0, gather - hw.overlap * m * compute / 3))
    total = pipeline + exposed_dp + hw.step_overhead
    return {"total": total, "compute": m * compute, "tp": m * tp, "cp": m * cp,
            "bubble": (layout.pp - 1) * slot, "pp": (m + layout.pp - 1) * sends,
            "dp": exposed_dp, "flops": flops * m}


def mfu(model, tokens_per_second, peak_flops_total):
    """Model FLOPs utilisation: useful training FLOPs per second / the hardware's peak."""
    return tokens_per_second * flops_per_token(model)[0] / peak_flops_total


# =========================================================================================
# 4. Every valid configuration, ranked
# =========================================================================================

def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_layouts(model, world, global_batch, zero_stages=(0, 1), recompute=("none",),
                  precision="fp32", max_tp=None, micro_batch_sizes=None, sp=(False,)):
    """Every Layout with dp·pp·cp·tp = world that can run this model:
      tp divides the heads and the K/V heads (each rank holds whole heads), at most `max_tp`;
      pp divides the layers (equal stages) — and a pipeline needs m ≥ pp micro-batches;
      cp: the sequence splits into 2·cp equal zig-zag chunks;
      dp divides the global batch; the rest of each dp rank's batch is m micro-batches of
      `micro_batch` sequences; ZeRO stages > 0 only when dp > 1; sequence parallelism only
      with tp > 1."""
    out = []
    for dp, pp, cp, tp in itertools.product(divisors(world), repeat=4):
        if dp * pp * cp * tp != world:
            continue
        if model.heads % tp or model.kv_heads % tp or (max_tp and tp > max_tp):
            continue
        if model.layers % pp or model.seq % (2 * cp) or global_batch % dp:
            continue
        per_rank = global_batch // dp
        for mb in divisors(per_rank):
            if micro_batch_sizes and mb not in micro_batch_sizes:
                continue
            m = per_rank // mb
            if pp > 1 and m < pp:
                continue
            for zero, rc, s in itertools.product(zero_stages, recompute, sp):
                if (zero and dp == 1) or (s and tp == 1):
                    continue
                out.append(Layout(dp, pp, cp, tp, zero=zero, micro_batch=mb, micro_batches=m,
                                  recompute=rc, precision=precision, sp=s))
    return out


def search(model, world, global_batch, hw, **space):
    """All valid layouts with their predicted memory and step time, fastest first; the ones
    whose memory exceeds `hw.memory` are kept but marked as not fitting."""
    rows = []
    for layout in valid_layouts(model, world, global_batch, **space):
        mem = estimate_memory(model, layout)
        t = step_time(model, layout, hw)
        rows.append({"layout": layout, "memory": mem, "time": t, "fits": mem["total"] <= hw.memory})
    rows.sort(key=lambda r: (not r["fits"], r["time"]["total"]))
    return rows


def decision_procedure(model, world, global_batch, hw, seq_threshold=32768):
    """The syllabus' rule of thumb, step by step, returning (layout, reasons):
    1. fits on one device with plain data parallelism (+ ZeRO-1/2)? → DP.
    2. else split the model: ZeRO-3, or TP within a node (up to its size) and then PP across
       nodes, until it fits;
    3. long sequences (activations) → CP;
    4. then choose the micro-batch and accumulation for the target global batch."""
    reasons = []
    base = dict(precision="bf16", recompute="none")

    def fits(**kw):
        lay = Layout(**{**base, **kw})
        return estimate_memory(model, lay)["total"] <= hw.memory, lay

    dp = world
    for zero in (0, 1, 2):
        ok, lay = fits(dp=dp, zero=zero, micro_batch=1, micro_batches=global_batch // dp)
        if ok and global_batch % dp == 0:
            reasons.append(f"fits with data parallelism alone (ZeRO-{zero}) on {dp} ranks")
            return lay, reasons
    reasons.append("does not fit with DP + ZeRO-1/2: split the model")
    cp = 1
    if model.seq >= seq_threshold:
        cp = 2
        reasons.append(f"sequence {model.seq} ≥ {seq_threshold}: context parallelism cp={cp}")
    tps = [t for t in (2, 4, 8) if t <= hw.ranks_per_node and model.heads % t == 0 and model.kv_heads % t == 0]
    tries = [(t, 1) for t in tps] + [(tps[-1], p) for p in divisors(model.layers) if p > 1]
    for rc in ("none", "full"):
        for tp, pp in tries:
            if world % (tp * pp * cp) or global_batch % (world // (tp * pp * cp)):
                continue
            dp = world // (tp * pp * cp)
            m = global_batch // dp
            if m < pp:
                continue
            ok, lay = fits(dp=dp, pp=pp, cp=cp, tp=tp, zero=1, sp=True, micro_batch=1,
                           micro_batches=m, recompute=rc)
            if ok:
                reasons.append(f"tensor parallelism (+ sequence parallelism) within a node: tp={tp}")
                if pp > 1:
                    reasons.append(f"TP at the node's size is not enough: pipeline across nodes, pp={pp}")
                if rc == "full":
                    reasons.append("activations still too large: full recomputation")
                reasons.append(f"the rest is data parallelism (ZeRO-1): dp={dp}; "
                               f"micro-batch 1, m={m} micro-batches per step")
                return lay, reasons
    reasons.append("nothing fits")
    return None, reasons


# Published hardware and models (the numbers are cited on the page; what is assumed says so).
LLAMA3_8B = ModelShape("Llama 3 8B", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                       vocab=128256, seq=8192, mlp_matrices=3, bias=False, norm_params=1,
                       learned_positions=False)
LLAMA3_70B = ModelShape("Llama 3 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
                        vocab=128256, seq=8192, mlp_matrices=3, bias=False, norm_params=1,
                        learned_positions=False)
H100_PEAK_BF16 = 989.4e12        # dense BF16 tensor-core FLOP/s, H100 SXM (NVIDIA datasheet)
H100_MEMORY = 80e9               # HBM3 bytes
NVLINK_BW = 450e9                # NVLink 4: 900 GB/s per GPU, both directions together
IB_BW = 50e9                     # one 400 Gb/s NDR InfiniBand port per GPU (DGX H100)
ASSUMED = {"sustained fraction of peak for large GEMMs": 0.7,     # assumption, not a citation
           "usable fraction of HBM": 0.9,                          # workspace, fragmentation
           "achieved fraction of link bandwidth": 0.8,             # nccl-tests-like busbw / nominal
           "α per ring step in a node (s)": 3e-6, "α per ring step across nodes (s)": 8e-6}


def h100_cluster():
    a = ASSUMED
    return Hardware("DGX H100 cluster (8 GPUs per node)", flops=a["sustained fraction of peak for large GEMMs"] * H100_PEAK_BF16,
                    memory=a["usable fraction of HBM"] * H100_MEMORY, ranks_per_node=8,
                    intra=(a["α per ring step in a node (s)"], a["achieved fraction of link bandwidth"] * NVLINK_BW),
                    inter=(a["α per ring step across nodes (s)"], a["achieved fraction of link bandwidth"] * IB_BW),
                    overlap=1.0, peak=H100_PEAK_BF16)


# =========================================================================================
# 5. Measuring what a rank holds: parameters, gradients, optimizer state, saved activations
# =========================================================================================

class ActivationMeter:
    """Bytes of tensors autograd saves for backward, live and at their peak.

    A saved-tensors hook wraps every saved tensor (not parameters: those are counted as
    weights) in a small holder; the holder dies when autograd releases the saved tensor, so
    `live` follows the tensors actually kept, across micro-batches and pipeline slots. Tensors
    that share storage are counted once."""

    def __init__(self, params=()):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.refs, self.live, self.peak = {}, 0, 0

    class _Held:
        __slots__ = ("t", "key", "meter")

        def __init__(self, t, key, meter):
            self.t, self.key, self.meter = t, key, meter

        def __del__(self):
            self.meter._release(self.key)

    def _pack(self, t):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key[0] in self.params or key[1] == 0:
            return t
        if key not in self.refs:
            self.refs[key] = 0
            self.live += key[1]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        return ActivationMeter._Held(t, key, self)

    @staticmethod
    def _unpack(x):
        return x.t if isinstance(x, ActivationMeter._Held) else x

    def _release(self, key):
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= key[1]

    def __call__(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


def held_bytes(params, optimizer_state=()):
    """Bytes of parameters, their gradients and optimizer state tensors (scalars like Adam's
    step counter left out) that this rank holds."""
    nbytes = lambda t: t.numel() * t.element_size()
    params = list(params)
    return {"weights": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(nbytes(t) for t in optimizer_state if t.dim() > 0)}


# =========================================================================================
# 6. Calibrating the step-time model on this machine
# =========================================================================================

def fit_line(xs, ys):
    """Least-squares y = a + b·x, both non-negative."""
    import numpy as np
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    b, a = np.polyfit(x, y, 1)
    if a < 0:
        a, b = 0.0, float((x * y).sum() / (x * x).sum())
    return float(a), float(max(b, 1e-30))


def model_step_parts(cfg, micro_batch):
    """forward+backward and optimizer-step callables of the one-process GPT on `micro_batch`
    sequences (what every rank of a layout runs a slice of)."""
    model = L1.GPT(cfg).to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = (t.to(device()) for t in L1.batch(cfg, micro_batch, 0))

    def fwd_bwd():
        L1.loss_fn(model(tokens), targets).backward()

    def step():
        opt.step()
        opt.zero_grad(set_to_none=False)
    fwd_bwd()
    return fwd_bwd, step


def calibrate(rank, world_size, cfg, batch_sizes, sizes, repeats=7):
    """The constants of the step-time model, measured with every rank busy at once (as in the
    runs being predicted): matmul throughput, the one-process forward+backward time against
    its FLOPs, the optimizer step, and α–β fits of all-reduce and of send/recv."""
    from lectures.lecture_02_communication import fit_alpha_beta
    out = {}
    n = 512 if not settings.quick else 256
    a, b = torch.randn(n, n, device=device()), torch.randn(n, n, device=device())
    t = measure(lambda: a @ b, warmup=2, repeats=repeats)
    out["matmul"] = {"n": n, "flops": 2 * n ** 3 / t.median, "timing": t}
    model = ModelShape.from_gpt(cfg)
    rows = []
    for mb in batch_sizes:
        fwd_bwd, step = model_step_parts(cfg, mb)
        t = measure(fwd_bwd, warmup=2, repeats=repeats)
        flops = mb * model.seq * flops_per_token(model)[0]
        rows.append((mb, flops, t))
    out["compute"] = rows
    out["optimizer"] = measure(step, warmup=1, repeats=repeats)
    ar, p2p = [], []
    peer = rank ^ 1 if (rank ^ 1) < world_size else rank
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=device())
        ar.append(measure(lambda: dist.all_reduce(x), warmup=2, repeats=repeats))

        def ping():
            if rank % 2 == 0:
                dist.send(x, peer)
                dist.recv(x, peer)
            else:
                dist.recv(x, peer)
                dist.send(x, peer)
        p2p.append(measure(ping, warmup=2, repeats=repeats))
    out["all_reduce"] = list(zip(sizes, ar))
    out["p2p"] = [(s, t) for s, t in zip(sizes, p2p)]          # a round trip: two messages
    out["fit_all_reduce"] = fit_alpha_beta(sizes, [t.median for t in ar])
    out["fit_p2p"] = fit_alpha_beta(sizes, [t.median / 2 for t in p2p])
    return out


def this_machine(cal, cfg, world_size):
    """Hardware constants of this machine from `calibrate`'s measurements. The ring all-reduce
    on n ranks is 2(n−1) steps each moving 1/n of the buffer, so the fitted whole-collective
    (α, β) become per-step (α/(2(n−1)), β·2(n−1)/n), the form the model uses; point-to-point messages use the send/recv fit."""
    n = world_size
    alpha_ar, beta_ar = cal["fit_all_reduce"]
    link = (alpha_ar / (2 * (n - 1)), beta_ar * 2 * (n - 1) / n)
    overhead, per_flop = fit_line([f for _, f, _ in cal["compute"]], [t.median for _, _, t in cal["compute"]])
    return Hardware("this machine", flops=1 / per_flop, memory=float("inf"), ranks_per_node=10 ** 6,
                    intra=link, inter=link, overhead=overhead / cfg.n_layers,
                    step_overhead=cal["optimizer"].median, overlap=0.0, peak=cal["matmul"]["flops"],
                    p2p=cal["fit_p2p"], bucketed=False)


# =========================================================================================
# 7. One model, many layouts: the combined training step
# =========================================================================================
# The pieces come from the earlier lectures, applied to lecture 01's GPT in a fixed order
# (torchtitan's): tensor parallelism (lecture 04's parallelize_gpt on the mesh's tp group) →
# context parallelism (lecture 06's ring attention on the cp group, zig-zag token shards) →
# pipeline stages (lecture 05's GPTStage and executor on the pp group) → the gradient sync over
# the weight replicas (dp × cp) and the optimizer, plain AdamW or ZeRO-1/2 (lecture 03).

from lectures import lecture_03_data_parallel as L3          # noqa: E402
from lectures import zero as Z                                 # noqa: E402


class GroupCollectives(L3.Collectives):
    """Adapter: lecture 03's byte-counting collectives run on the whole world; on a mesh they
    must run on one axis' group. Same counting, explicit `group` (lecture 03's ZeRO takes its
    shard index from it)."""

    def __init__(self, group):
        super().__init__(dist.get_world_size(group))
        self.group = group

    def all_reduce(self, t, async_op=False, label="all-reduce"):
        self.sent += 2 * (self.n - 1) * t.numel() * t.element_size() // self.n
        return self._async(dist.all_reduce(t, group=self.group, async_op=async_op), label, 0)

    def reduce_scatter(self, out, full, async_op=False, label="reduce-scatter"):
        self.sent += (self.n - 1) * full.numel() * full.element_size() // self.n
        return self._async(dist.reduce_scatter_single(out, full, group=self.group, async_op=async_op), label, 0)

    def all_gather(self, full, shard, async_op=False, label="all-gather"):
        self.sent += (self.n - 1) * full.numel() * full.element_size() // self.n
        return self._async(dist.all_gather_single(full, shard, group=self.group, async_op=async_op), label, 0)


@dataclasses.dataclass(frozen=True)
class Run:
    """A small training run: the model, the global batch, steps and learning rate."""
    cfg: L1.GPTConfig = L1.GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=4)
    global_batch: int = 8
    steps: int = 4
    lr: float = 3e-3
    weight_decay: float = 0.01     # AdamW's default, spelled out: ZeRO's optimizer needs it


def reference_run(run):
    """One process, the whole global batch, torch.optim.AdamW: what every layout must equal."""
    model = L1.GPT(run.cfg).to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=run.weight_decay)
    losses = []
    for step in range(run.steps):
        tokens, targets = (t.to(device()) for t in L1.batch(run.cfg, run.global_batch, step))
        loss = L1.loss_fn(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: p.detach().cpu().clone() for k, p in model.named_parameters()}}


class LayoutTrainer:
    """Lecture 01's GPT trained under `layout` on this rank's place in `mesh`."""

    def __init__(self, run, layout, mesh):
        from lectures import lecture_04_tensor_parallel as L4
        from lectures import lecture_05_pipeline_parallel as L5
        self.run, self.layout, self.mesh = run, layout, mesh
        cfg = run.cfg
        if layout.global_batch != run.global_batch:
            raise ValueError(f"layout {layout.label()} makes a global batch of {layout.global_batch}, "
                             f"the run wants {run.global_batch}")
        model = L1.GPT(cfg).to(device())              # the same seeded weights on every rank
        self.tp_group = mesh.group["tp"]
        if layout.tp > 1:
            model = L4.parallelize_gpt(model, self.tp_group, sequence_parallel=layout.sp)
        if layout.cp > 1:
            from lectures.lecture_06_context_and_expert_parallel import ring_attention
            attend = _RingAttend(ring_attention, mesh.group["cp"])
            for block in model.blocks:
                block.attn.attend = attend
        self.model = model
        if layout.pp > 1:
            if layout.cp > 1 or layout.sp:
                raise ValueError("pipeline stages with context or sequence parallelism are not wired up here")
            stage = mesh.index("pp")
            self.stage = L5.GPTStage(model, stage, layout.pp)
            sched = L5.make_schedule(layout.schedule, layout.pp, layout.micro_batches)
            self.executor = L5.PipelineExecutor(
                sched, {0: self.stage}, stage, (layout.micro_batch, cfg.seq_len, cfg.d_model),
                group=mesh.group["pp"], loss_fn=self._loss, dtype=cfg.torch_dtype)
            self.module = self.stage
        else:
            self.stage, self.executor, self.module = None, None, model
        self.params = list(self.module.parameters())
        replica = mesh.group["replica"]
        self.comm = GroupCollectives(replica) if replica is not None else None
        if layout.zero:
            if layout.zero not in (1, 2) or replica is None:
                raise ValueError(f"ZeRO-{layout.zero}: this trainer implements ZeRO-1 and ZeRO-2 on a "
                                 "data-parallel axis of 2 or more ranks (lecture 03 builds ZeRO-3)")
            # Lecture 03's ZeRO on the replica group; ZeRO-2's hooks reduce-scatter each
            # gradient as backward (a pipeline's, too) produces it, micro-batch by micro-batch.
            self.zero = (Z.Zero1 if layout.zero == 1 else Z.Zero2)(self.module, self.comm, run)
            self.opt = None
        else:
            self.zero = None
            self.opt = torch.optim.AdamW(self.params, lr=run.lr, weight_decay=run.weight_decay)
        self.meter = ActivationMeter(self.params)

    def _loss(self, logits, targets):
        if self.layout.tp > 1:
            from lectures.lecture_04_tensor_parallel import vocab_parallel_cross_entropy
            return vocab_parallel_cross_entropy(logits, targets, self.tp_group)
        return L1.loss_fn(logits, targets)

    def local_batch(self, step):
        """This rank's rows (its dp slice) and tokens (its zig-zag cp slice) of the global batch,
        cut into m micro-batches, and the global positions of its tokens."""
        from lectures.lecture_06_context_and_expert_parallel import sequence_positions, zigzag_shard
        lay, mesh, cfg = self.layout, self.mesh, self.run.cfg
        tokens, targets = L1.batch(cfg, self.run.global_batch, step)
        rows = self.run.global_batch // lay.dp
        d = mesh.index("dp")
        tokens, targets = tokens[d * rows:(d + 1) * rows], targets[d * rows:(d + 1) * rows]
        positions = None
        if lay.cp > 1:
            c = mesh.index("cp")
            tokens, targets = (zigzag_shard(t, c, lay.cp, dim=1) for t in (tokens, targets))
            positions = sequence_positions(cfg.seq_len, c, lay.cp, "zigzag").to(device())
        return (list(tokens.to(device()).chunk(lay.micro_batches)),
                list(targets.to(device()).chunk(lay.micro_batches)), positions)

    def forward_backward(self, step):
        """Gradients of the mean loss over this rank's share; returns (local mean loss or None,
        peak bytes of saved activations)."""
        tokens, targets, positions = self.local_batch(step)
        m = self.layout.micro_batches
        self.meter.peak = self.meter.live
        if self.executor is not None:
            with self.meter():      # the executor counts the stages' saves, the meter the loss's
                out = self.executor.step(tokens, targets)
            return out["loss"], out["peak_saved_bytes"] + self.meter.peak - self.meter.live
        total = 0.0
        for x, y in zip(tokens, targets):
            with self.meter():
                model = self.model
                h = model.embed(x, positions)
                for block in model.blocks:
                    h = block(h)
                loss = self._loss(model.head(h), y) / m
            loss.backward()
            total += loss.item()
        return total, self.meter.peak

    def sync_and_step(self):
        """Average the gradients over the weight replicas, then the optimizer."""
        if self.zero is not None:
            self.zero.step()                      # reduce-scatter, sharded AdamW, all-gather
            return
        if self.comm is not None:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self.comm.all_reduce(p.grad)
                p.grad.div_(self.comm.n)
        self.opt.step()
        self.opt.zero_grad()

    def held(self):
        """Bytes of weights, gradients and optimizer state this rank holds at the step."""
        if self.zero is not None:   # ZeRO counts them itself: under ZeRO-2 the gradients are shards
            h = self.zero.held
            return {"weights": h["params"], "grads": h["grads"], "optimizer": h["optimizer"]}
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return held_bytes(self.params, state)

    def train_step(self, step):
        loss, act = self.forward_backward(step)
        if self.zero is None:
            held = self.held()
            self.sync_and_step()
        else:                       # ZeRO measures what it holds during its step
            self.sync_and_step()
            held = self.held()
        return loss, act, held

    def full_parameters(self):
        """{name of the unsplit GPT's parameter: full tensor} for the parameters this rank's
        stage holds (tensor-parallel slices gathered; every rank calls it)."""
        from lectures import lecture_04_tensor_parallel as L4
        module = self.module
        named = L4.full_parameters(module) if self.layout.tp > 1 else {
            k: p.detach().clone() for k, p in module.named_parameters()}
        if self.stage is not None:
            named = {self.stage.global_name(k): v for k, v in named.items()}
        return {k: v.cpu() for k, v in named.items()}


class _RingAttend:
    """CausalSelfAttention.attend on zig-zag sequence shards: lecture 06's ring attention."""

    def __init__(self, ring_attention, group):
        self.fn, self.group = ring_attention, group

    def __call__(self, q, k, v):
        return self.fn(q, k, v, causal=True, group=self.group, layout="zigzag")


def global_loss(trainer, loss):
    """The step's loss over the whole global batch, on every rank: the replicas' local means
    averaged (equal token counts), taken from one tensor-parallel rank of the last stage."""
    lay, mesh = trainer.layout, trainer.mesh
    counts = loss is not None and mesh.index("tp") == 0 and mesh.index("pp") == lay.pp - 1
    t = torch.tensor([loss if counts else 0.0], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / (lay.dp * lay.cp)


def train_layout(rank, world_size, run, layout):
    """Train `run` under `layout`; returns the loss of every step, this rank's coordinates and
    full parameters (by name), and its measured memory (bytes held, peak saved activations)."""
    mesh = make_mesh(layout.dp, layout.pp, layout.cp, layout.tp)
    trainer = LayoutTrainer(run, layout, mesh)
    losses, act, held = [], 0, None
    for step in range(run.steps):
        loss, a, held = trainer.train_step(step)
        act = max(act, a)
        losses.append(global_loss(trainer, loss))
    return {"losses": losses, "coords": mesh.coords, "params": trainer.full_parameters(),
            "memory": {**held, "activations": act}}


def time_layouts(rank, world_size, run, layouts, repeats=5, warmup=2):
    """Measured seconds per training step of every layout (slowest rank, median of `repeats`
    after `warmup` steps), one layout after another in the same processes."""
    out = []
    for lay in layouts:
        trainer = LayoutTrainer(run, lay, make_mesh(lay.dp, lay.pp, lay.cp, lay.tp))
        out.append(measure(lambda: trainer.train_step(0), warmup=warmup, repeats=repeats))
    return out


def rank_correlation(xs, ys):
    """Spearman's ρ: the Pearson correlation of the ranks (ties get their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    a, b = ranks(xs), ranks(ys)
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return cov / var if var else float("nan")


# =========================================================================================
# 8. Narration
# =========================================================================================

LAYOUTS_4 = [  # (name, Layout) trained on 4 ranks; global batch 8 sequences in every one
    ("dp×tp", Layout(dp=2, tp=2, micro_batch=4)),
    ("dp×pp", Layout(dp=2, pp=2, micro_batch=2, micro_batches=2)),
    ("tp×pp", Layout(pp=2, tp=2, micro_batch=2, micro_batches=4)),
    ("dp×cp", Layout(dp=2, cp=2, micro_batch=4)),
    ("dp×tp + ZeRO-1", Layout(dp=2, tp=2, zero=1, micro_batch=2, micro_batches=2)),
    ("dp×tp + SP", Layout(dp=2, tp=2, sp=True, micro_batch=4)),
    ("dp + ZeRO-1", Layout(dp=4, zero=1, micro_batch=2)),
    ("dp×pp + ZeRO-2", Layout(dp=2, pp=2, zero=2, micro_batch=2, micro_batches=2)),
    ("pp (1F1B)", Layout(pp=4, micro_batch=1, micro_batches=8)),
    ("pp (GPipe)", Layout(pp=4, micro_batch=1, micro_batches=8, schedule="gpipe")),
]
LAYOUT_8 = ("dp×pp×tp", Layout(dp=2, pp=2, tp=2, micro_batch=2, micro_batches=2))
QUICK_SKIPS = ("dp + ZeRO-1", "dp×tp + SP")
ACT_TOLERANCE = 0.08      # saved activations: the formula leaves out a few bytes per token,
ACT_SLACK_PER_TOKEN = 32  # which matter only on a stage that holds almost nothing (no blocks)
_RESULTS = {}             # what the sections measured, for the ones after them


def small_run():
    return Run(steps=4 if settings.quick else 6)


def max_param_diff(returns, reference):
    params = {}
    for r in returns:
        params.update(r["params"])
    if set(params) != set(reference):
        raise AssertionError(f"parameters missing or extra: {set(params) ^ set(reference)}")
    return max((params[k] - v).abs().max().item() for k, v in reference.items())


def intro():
    note("""
        # Putting it together: 4D parallelism, memory, and choosing a layout
        The earlier lectures each split one thing: the batch (data parallelism and ZeRO,
        lecture 03), the matrices (tensor parallelism, lecture 04), the layers (pipelines,
        lecture 05), the sequence (context parallelism, lecture 06). Real training runs use
        several at once, on one *device mesh*. This lecture builds the mesh, trains lecture 01's
        GPT under many combinations — each checked against one process — and then turns the
        formulas of those lectures into two predictions: **how many bytes each rank holds** and
        **how long a step takes**. Both are checked where we can run them and then used where we
        cannot: an 8B and a 70B model on 64 to 512 H100s.
    """)


def the_mesh():
    note("""
        ## The device mesh
        Lay the ranks out on a grid of shape (dp, pp, cp, tp). Global rank
        $r = ((d\\cdot PP + p)\\cdot CP + c)\\cdot TP + t$: the tensor-parallel index varies
        fastest, so a tensor-parallel group is a run of consecutive ranks — on a GPU cluster,
        GPUs of one node joined by NVLink, because tensor parallelism talks in every layer.
        Context parallelism comes next (a ring exchange per attention layer), then the
        pipeline (one activation per micro-batch and stage boundary), and data parallelism,
        which talks once per step, spans the farthest ranks. An axis' *groups* are the sets of
        ranks that differ only in that coordinate; every rank belongs to exactly one group of
        each axis, and `dist.new_group` must be called by every rank for every group, in the
        same order.
    """)
    see(mesh_coords)
    see(axis_groups)
    see(make_mesh)
    shape = (2, 2, 1, 2)
    figure(draw_mesh(shape, highlight=5),
           caption="8 ranks as dp=2 × pp=2 × cp=1 × tp=2. Rank 5's groups are outlined: its tp "
                   "group {4, 5} (neighbours), its pp group {5, 7}, its dp group {1, 5} (the "
                   "farthest apart).")
    rows, agree = [], True
    for shape in [(2, 1, 1, 2), (1, 2, 1, 2), (2, 1, 2, 1), (1, 1, 2, 2)]:
        got = spawn(compare_meshes, 4, shape=shape,
                    name=f"mesh dp{shape[0]} pp{shape[1]} cp{shape[2]} tp{shape[3]}: ours vs init_device_mesh").returns
        for r, g in enumerate(got):
            same = all(g["ours"][a] == g["torch"][a] for a in MESH_AXES)
            counted = all(g.get("sums", {}).get(a, 1) == len(g["ours"][a]) for a in MESH_AXES)
            agree &= same and counted
            rows.append(["×".join(map(str, shape)), r, " ".join(f"{a}{g['coords'][a]}" for a in MESH_AXES)]
                        + [str(g["ours"][a]) + ("" if g["ours"][a] == g["torch"][a] else f" ≠ {g['torch'][a]}")
                           for a in MESH_AXES])
    assert agree, "our groups differ from init_device_mesh's"
    table(rows, header=["dp×pp×cp×tp", "rank", "coordinates", "dp group", "pp group", "cp group", "tp group"],
          caption="Each rank's group on every axis, from our make_mesh; PyTorch's init_device_mesh "
                  "with mesh_dim_names=('dp', 'pp', 'cp', 'tp') gives the same lists on every rank "
                  "(checked, and an all-reduce over each group counts its members).")
    _RESULTS["mesh_agrees"] = agree


def many_layouts():
    import matplotlib.pyplot as plt
    run = small_run()
    cfg = run.cfg
    note(f"""
        ## One model, many layouts
        Lecture 01's GPT ({cfg.n_layers} layers, h = {cfg.d_model}, {cfg.n_heads} heads,
        sequences of {cfg.seq_len} tokens, vocabulary {cfg.vocab_size}; Ψ = {L1.param_count(cfg):,})
        on its Markov-chain task, global batch {run.global_batch} sequences, AdamW, {run.steps}
        steps. Each layout applies the earlier lectures' pieces to the same seeded model, in a
        fixed order: tensor parallelism (lecture 04's `parallelize_gpt` on the mesh's tp group;
        vocabulary-parallel embedding, head and loss), context parallelism (lecture 06's ring
        attention on zig-zag token shards, the cp group), pipeline stages (lecture 05's
        `GPTStage` and executor with the pp group), then the gradient average over the *weight
        replicas* — the dp × cp ranks with the same pp and tp coordinates, since context
        parallelism splits tokens, not weights — and AdamW or lecture 03's ZeRO-1 or ZeRO-2 on
        that group. One thin adapter is written here: lecture 03's collectives run on the whole
        world, so `GroupCollectives` gives them an explicit group (and ZeRO its shard index).
    """)
    see(LayoutTrainer)
    see(GroupCollectives)
    ref = reference_run(run)
    runs = []
    cases = list(LAYOUTS_4) + [LAYOUT_8]
    if settings.quick:     # the tests run the rest; the quick build keeps one of each kind
        cases = [c for c in LAYOUTS_4 if c[0] not in QUICK_SKIPS]
    for name, lay in cases:
        got = spawn(train_layout, lay.world, run=run, layout=lay,
                    name=f"layout {name}: {lay.label()}, {lay.world} ranks").returns
        runs.append((name, lay, got))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    steps = range(1, run.steps + 1)
    ax.plot(steps, ref["losses"], color="black", lw=6, alpha=0.25, label="one process")
    markers = "os^vD<>xP*"
    rows = []
    for (name, lay, got), mk in zip(runs, markers):
        ax.plot(steps, got[0]["losses"], marker=mk, ms=4, lw=0.8, label=f"{name} ({lay.world} ranks)")
        loss_diff = max(abs(a - b) for a, b in zip(got[0]["losses"], ref["losses"]))
        pdiff = max_param_diff(got, ref["params"])
        rows.append([name, lay.label(), lay.world, got[0]["losses"][-1], loss_diff, pdiff])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (whole global batch)")
    ax.legend(fontsize=7, ncol=2)
    figure(fig, caption="Every layout's loss curve on the single-process one (the wide grey line).")
    table(rows, header=["layout", "mesh and micro-batching", "ranks", "last loss",
                        "max |Δ loss| vs one process", "max |Δ parameter| vs one process"],
          caption=f"After {run.steps} AdamW steps, every parameter (tensor-parallel slices gathered, "
                  f"pipeline stages merged) against the one-process run; float32, so differences of "
                  f"~1e-6 are summation order. One-process last loss {ref['losses'][-1]:.6f}.")
    worst = max(r[-1] for r in rows)
    assert worst < 1e-4, f"a layout drifted from one process: {worst}"
    _RESULTS["layouts"] = runs
    _RESULTS["layout_worst_diff"] = worst
    return runs


def memory_estimator():
    import matplotlib.pyplot as plt
    runs = _RESULTS.get("layouts") or many_layouts()
    cfg = small_run().cfg
    shape = ModelShape.from_gpt(cfg)
    note("""
        ## Memory per rank: the formulas together
        For each rank, from the earlier lectures:

        * **weights** $= b_w\\,\\Psi_\\text{stage}/\\text{tp}$ for the split matrices plus the
          replicated norms and row-parallel biases; the first stage adds the embeddings
          (vocabulary-parallel: $v h/\\text{tp}$), the last the final norm and head; ZeRO-3
          divides by dp;
        * **gradients** the same count at $b_g$ bytes, divided by dp under ZeRO-2/3;
        * **optimizer** $K$ bytes per parameter (AdamW in fp32: two moments, $K = 8$; mixed
          precision: master weights too, $K = 12$), divided by dp under ZeRO-1/2/3;
        * **activations** per block and token: the block input, both norm outputs, the residual
          after attention and the norm statistics stay whole ($4h + 4$ elements), while Q, K, V,
          the attention output and log-sum-exp and the MLP's $2f$ split over tp
          ($(2h + 2h_{kv} + a + 2f)/\\text{tp}$; sequence parallelism splits the rest too); times
          $b\\cdot s/\\text{cp}$ tokens per micro-batch, times the micro-batches a stage holds at
          once (all $m$ under GPipe, $\\text{pp} - \\text{stage}$ under 1F1B); full
          recomputation keeps only each block's input, plus one block while it is recomputed.

        Measured on every rank of every run above: the bytes of the parameters, gradients and
        optimizer-state tensors the rank holds, and the peak bytes autograd kept for backward
        (a saved-tensors hook, counting each storage once and releasing it when autograd does;
        the pipeline executor of lecture 05 counts its stages' own).
    """)
    see(ModelShape.act_elements_per_token)
    see(estimate_memory)
    rows, worst = [], {"weights": 0, "grads": 0, "optimizer": 0, "activations": 0}
    for name, lay, got in runs:
        seen = set()
        for r in got:
            key = r["coords"]["pp"]
            if key in seen:
                continue              # equal ranks (replicas, tp peers) say the same
            seen.add(key)
            est = estimate_memory(shape, lay, r["coords"]["pp"])
            m = r["memory"]
            errs = {}
            for k in worst:
                e = est["stored activations" if k == "activations" else k]
                errs[k] = (m[k] - e) / e
                worst[k] = max(worst[k], abs(errs[k]))
            rows.append([name, f"pp stage {r['coords']['pp']}" if lay.pp > 1 else "every rank"]
                        + [x for k in worst for x in (m[k], est["stored activations" if k == "activations" else k])]
                        + [f"{100 * errs['activations']:+.1f}%"])
    table(rows, header=["layout", "rank", "weights measured", "predicted", "grads measured", "predicted",
                        "optimizer measured", "predicted", "activations measured", "predicted",
                        "activation error"],
          caption="Bytes per rank, measured vs the estimator (float32 runs).")
    note(f"""
        Weights, gradients and optimizer state are predicted to within
        {100 * max(worst['weights'], worst['grads'], worst['optimizer']):.2f}% (exact counts:
        the tensors are what the formulas say). Saved activations are within
        {100 * worst['activations']:.1f}% (tolerance {100 * ACT_TOLERANCE:.0f}%): what the
        formula leaves out are a few bytes per token — the vocabulary-parallel loss's masks and
        indices, a stage's received input.
    """)
    _RESULTS["memory_worst"] = worst
    sp_shown = any(lay.sp for _, lay, _ in runs)
    note(f"""
        **Sequence parallelism**: the estimator follows Megatron-LM, which splits every
        residual-stream tensor over tp and re-gathers the norm outputs in backward; lecture
        04's version keeps an all-gathered input for backward
        ({"the dp×tp + SP row's error above" if sp_shown else "the full build's dp×tp + SP run shows the gap; the tests bound it"}).
        **Full recomputation** is not among the layouts, so it is checked here in one process
        with lecture 01's `Recomputed` blocks: only each block's input stays saved between
        forward and backward.
    """)
    rows = []
    for mode in ("none", "full"):
        model = L1.with_recomputation(cfg, mode)
        meter = ActivationMeter(model.parameters())
        tokens, targets = L1.batch(cfg, 4, 0)
        with meter():
            loss = L1.loss_fn(model(tokens), targets)
        loss.backward()
        est = estimate_memory(shape, Layout(micro_batch=4, recompute=mode))
        rows.append([mode, meter.peak, est["stored activations"], est["activations"] - est["stored activations"],
                     f"{100 * (meter.peak - est['stored activations']) / est['stored activations']:+.1f}%"])
    table(rows, header=["recomputation", "saved (measured)", "saved (predicted)",
                        "+ one block while recomputed (predicted)", "error"],
          caption="One process, micro-batch of 4 sequences, float32.")
    # How the parts scale, for a model we cannot run: the estimator at published scale.
    lays = [("dp", Layout(dp=64, micro_batch=1, precision="bf16")),
            ("dp + ZeRO-1", Layout(dp=64, zero=1, micro_batch=1, precision="bf16")),
            ("dp + ZeRO-3", Layout(dp=64, zero=3, micro_batch=1, precision="bf16")),
            ("tp8 + SP", Layout(dp=8, tp=8, sp=True, zero=1, micro_batch=1, precision="bf16")),
            ("tp8 pp4 + SP", Layout(dp=2, tp=8, pp=4, sp=True, zero=1, micro_batch=1, micro_batches=8, precision="bf16")),
            ("tp8 pp4 + SP + recompute", Layout(dp=2, tp=8, pp=4, sp=True, zero=1, micro_batch=1, micro_batches=8,
                                                recompute="full", precision="bf16"))]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colours = {"weights": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52"}
    for i, (label, lay) in enumerate(lays):
        est = estimate_memory(LLAMA3_70B, lay)
        bottom = 0
        for k, c in colours.items():
            ax.bar(i, est[k] / 1e9, bottom=bottom, color=c, label=k if i == 0 else None)
            bottom += est[k] / 1e9
    ax.axhline(H100_MEMORY / 1e9, color="black", ls="--", lw=1, label="H100: 80 GB")
    ax.set_yscale("log")
    ax.set_xticks(range(len(lays)), [l for l, _ in lays], fontsize=8, rotation=15)
    ax.set_ylabel("GB per GPU (log)")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title("Llama 3 70B, 64 GPUs, bf16 mixed precision, sequences of 8192, micro-batch 1")
    figure(fig, caption="The same estimator at published scale: each split removes one of the bars.")


def runnable(layouts):
    """The layouts this lecture's trainer wires up (pipelines with context parallelism and
    ZeRO-3 on a mesh are left out)."""
    return [l for l in layouts if not (l.pp > 1 and l.cp > 1) and l.zero in (0, 1, 2) and not l.sp
            and l.recompute == "none"]


def timing_layouts(run, ranks):
    layouts = runnable(valid_layouts(ModelShape.from_gpt(run.cfg), ranks, run.global_batch))
    if settings.quick:     # per mesh the fewest micro-batches; both extremes for tp and pp: ≥ 6
        keep, seen = [], {}
        for l in layouts:
            seen.setdefault((l.dp, l.pp, l.cp, l.tp, l.zero), []).append(l)
        for (dp, pp, cp, tp, zero), group in seen.items():
            keep += [group[-1]] if (tp == 1 and pp == 1) or len(group) == 1 else [group[0], group[-1]]
        layouts = keep
    return layouts


def step_time_model():
    import matplotlib.pyplot as plt
    run = small_run()
    ranks = timing_ranks(4)
    shape = ModelShape.from_gpt(run.cfg)
    quick = settings.quick
    note(f"""
        ## Predicting the step time
        The cost model adds up, for the slowest pipeline stage: compute (its FLOPs over the
        measured rate, plus a fixed cost per block that dominates a model this small), the
        tensor-parallel all-reduces (4 per block and micro-batch), the ring-attention
        transfers, the pipeline's $m + \\text{{pp}} - 1$ slots (the bubble is $\\text{{pp}}-1$
        of them), and the gradient sync over the weight replicas. Collectives use lecture 02's
        α–β model per ring step. Every constant is measured in this build, {machine(ranks)}:
        one rank per core, every rank busy at once, as in the runs being predicted.
    """)
    see(step_time)
    sizes = [4096 * 4 ** k for k in range(4 if quick else 6)]
    cal = spawn(calibrate, ranks, cfg=run.cfg, batch_sizes=[1, 2, 4, 8], sizes=sizes,
                repeats=5 if quick else 9, name=f"calibration: matmul, model compute, all-reduce and send/recv, {ranks} ranks").returns[0]
    hw = this_machine(cal, run.cfg, ranks)
    a_ar, b_ar = cal["fit_all_reduce"]
    a_p, b_p = cal["fit_p2p"]
    table([["matmul FLOP/s (one rank, {0}×{0} fp32)".format(cal["matmul"]["n"]), f"{cal['matmul']['flops'] / 1e9:.2f} GFLOP/s", cal["matmul"]["timing"].ms()],
           ["model compute rate (fit over micro-batches 1–8)", f"{hw.flops / 1e9:.2f} GFLOP/s", ""],
           ["fixed cost per block and micro-batch", f"{hw.overhead * 1e3:.3f} ms", ""],
           ["optimizer step (whole model)", f"{hw.step_overhead * 1e3:.3f} ms", cal["optimizer"].ms()],
           [f"all-reduce on {ranks} ranks: α, β", f"{a_ar * 1e6:.0f} µs, {b_ar / 1e9:.2f} GB/s", ""],
           ["send/recv: α, β", f"{a_p * 1e6:.0f} µs, {b_p / 1e9:.2f} GB/s", ""]],
          header=["constant", "value", "measured (median, IQR)"],
          caption="The cost model's constants, all measured by this build.")
    layouts = timing_layouts(run, ranks)
    # The full build times every valid layout (17 on 2 ranks), the quick one at least 6; one
    # warm-up step is enough here (the first step builds AdamW's state, later ones are alike).
    times = spawn(time_layouts, ranks, run=run, layouts=layouts, repeats=3, warmup=1,
                  name=f"step time of {len(layouts)} layouts, {ranks} ranks").returns[0]
    pred = [step_time(shape, l, hw)["total"] for l in layouts]
    meas = [t.median for t in times]
    rho = rank_correlation(pred, meas)
    rows = []
    for l, p, t in sorted(zip(layouts, pred, times), key=lambda x: x[1]):
        parts = step_time(shape, l, hw)
        rows.append([l.label(), p * 1e3, t.ms(), t.median / p,
                     ", ".join(f"{k} {parts[k] * 1e3:.1f}" for k in ("compute", "tp", "cp", "pp", "bubble", "dp") if parts[k] > 0)])
    table(rows, header=["layout", "predicted (ms)", "measured (median, IQR)", "measured / predicted",
                        "predicted parts (ms)"],
          caption=f"Every valid layout{' (quick build: a subset)' if quick else ''} of the "
                  f"{ranks}-rank search, predicted and measured; Spearman rank correlation "
                  f"ρ = {rho:.2f}.")
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for l, p, t in zip(layouts, pred, times):
        ax.errorbar([p * 1e3], [t.median * 1e3], yerr=[[(t.median - t.q1) * 1e3], [(t.q3 - t.median) * 1e3]],
                    fmt="o", ms=4, capsize=2, color="#4c72b0")
    lo, hi = min(pred + meas) * 1e3 * 0.8, max(pred + meas) * 1e3 * 1.2
    ax.plot([lo, hi], [lo, hi], color="0.6", ls="--", lw=1, label="measured = predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("measured step time (ms)")
    ax.legend(fontsize=8)
    figure(fig, caption=f"Predicted vs measured, {len(layouts)} layouts (median and IQR), {machine(ranks)}. "
                        f"Rank correlation ρ = {rho:.2f}.")
    best_pred, best_meas = layouts[pred.index(min(pred))], layouts[meas.index(min(meas))]
    note(f"""
        The model ranks the layouts with Spearman ρ = **{rho:.2f}**. It predicts
        **{best_pred.label()}** fastest; the fastest measured was **{best_meas.label()}**. On a
        model this small the step is mostly fixed costs — per block, per message — which is
        why the cost model carries a per-block term and counts messages, not only bytes; at
        published scale the FLOP and byte terms take over.
    """)
    _RESULTS.update(hw=hw, cal=cal, rho=rho, timed=list(zip(layouts, pred, times)))
    return rho


def search_here():
    run = small_run()
    shape = ModelShape.from_gpt(run.cfg)
    note(f"""
        ## Every valid configuration
        A configuration is valid when the four axes multiply to the rank count and each
        axis can split what it splits: tp divides the heads and the K/V heads, pp divides the
        layers (equal stages), the sequence splits into 2·cp zig-zag chunks, dp divides the
        global batch, and a pipeline gets at least pp micro-batches. For this GPT
        ({shape.layers} layers, {shape.heads} heads, sequence {shape.seq}, global batch
        {run.global_batch}):
    """)
    see(valid_layouts)
    rows = []
    for world in (1, 2, 4, 8):
        ls = valid_layouts(shape, world, run.global_batch)
        meshes = sorted({(l.dp, l.pp, l.cp, l.tp) for l in ls})
        rows.append([world, len(meshes), len(ls), ", ".join("×".join(map(str, m)) for m in meshes)])
    table(rows, header=["ranks", "meshes", "configurations (with micro-batching, ZeRO-1)", "meshes dp×pp×cp×tp"],
          caption="The search space grows fast: each mesh multiplies by the ways to cut the batch.")


def published_scale():
    import matplotlib.pyplot as plt
    hw = h100_cluster()
    a = ASSUMED
    note(f"""
        ## At published scale: an 8B and a 70B model on 64–512 H100s
        The same estimator and cost model, with published hardware numbers instead of
        measured ones: an H100 SXM does {H100_PEAK_BF16 / 1e12:.0f} TFLOP/s of dense BF16 and
        holds {H100_MEMORY / 1e9:.0f} GB; NVLink 4 gives each GPU 900 GB/s counting both
        directions ({NVLINK_BW / 1e9:.0f} GB/s each way); a DGX H100 node has 8 GPUs and one
        400 Gb/s InfiniBand NDR port per GPU ({IB_BW / 1e9:.0f} GB/s). Assumed, not cited:
        {', '.join(f'{k} {v}' for k, v in a.items())}. Models: Llama 3 8B and 70B (grouped-query
        attention with 8 K/V heads, SwiGLU, vocabulary 128,256), sequences of 8192, a global
        batch of 512 sequences (4M tokens, Llama 3's batch early in training), bf16 mixed
        precision. The search covers tp ≤ 8 (one node), any pp dividing the layers, cp, ZeRO
        0–3, full recomputation or none, sequence parallelism or not, micro-batches of 1, 2
        (and 4 in the full build).
    """)
    see(decision_procedure)
    rows, agree = [], []
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, model in zip(axes, (LLAMA3_8B, LLAMA3_70B)):
        for world in (64, 512):
            found = search(model, world, 512, hw, zero_stages=(0, 1, 2, 3), recompute=("none", "full"),
                           precision="bf16", max_tp=8, sp=(False, True),
                           micro_batch_sizes=(1, 2) if settings.quick else (1, 2, 4))
            fitting = [r for r in found if r["fits"]]
            rule, why = decision_procedure(model, world, 512, hw)
            agree.append(bool(fitting) and rule == fitting[0]["layout"])
            tokens = 512 * model.seq
            for tag, r in [("search: fastest that fits", fitting[0] if fitting else None),
                           ("search: runner-up", fitting[1] if len(fitting) > 1 else None)]:
                if r is None:
                    continue
                t = r["time"]["total"]
                rows.append([model.name, world, tag, r["layout"].label(), r["memory"]["total"] / 1e9, t,
                             mfu(model, tokens / t, world * H100_PEAK_BF16), ""])
            if rule is not None:
                t = step_time(model, rule, hw)["total"]
                rows.append([model.name, world, "decision procedure", rule.label(),
                             estimate_memory(model, rule)["total"] / 1e9, t,
                             mfu(model, tokens / t, world * H100_PEAK_BF16), "; ".join(why)])
            if world == 512:
                xs = [r["memory"]["total"] / 1e9 for r in found]
                ys = [r["time"]["total"] for r in found]
                ax.scatter(xs, ys, s=3, c=["#4c72b0" if r["fits"] else "#c0c0c0" for r in found])
                if fitting:
                    ax.scatter([fitting[0]["memory"]["total"] / 1e9], [fitting[0]["time"]["total"]],
                               marker="*", s=150, color="#c44e52", label="fastest that fits")
                if rule is not None:
                    ax.scatter([estimate_memory(model, rule)["total"] / 1e9], [step_time(model, rule, hw)["total"]],
                               marker="D", s=50, color="#55a868", label="decision procedure")
                ax.axvline(hw.memory / 1e9, color="black", ls="--", lw=1)
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.set_xlabel("predicted GB per GPU")
                ax.set_ylabel("predicted s per step")
                ax.set_title(f"{model.name}, 512 GPUs: {len(found)} configurations", fontsize=9)
                ax.legend(fontsize=7)
    figure(fig, caption="Every configuration of the search at 512 GPUs: grey ones exceed the memory "
                        "limit (dashed line).")
    table(rows, header=["model", "GPUs", "chosen by", "layout", "GB per GPU", "s per step", "MFU", "why"],
          caption="The search's best layouts beside the syllabus' decision procedure, predicted.")
    note(f"""
        The rule of thumb picks the search's fastest layout in {sum(agree)} of the {len(agree)} cases. Where
        they differ, the rule stopped at the first layout that fits, while the search weighs, for instance, ZeRO-2
        or -3 (free in bandwidth when the gradient traffic hides under backward) against
        tensor parallelism (which pays an all-reduce per block that cannot hide). Its value is
        that it needs no cost model; the search's is that it can compare the thousands of
        configurations that fit. The predicted MFU is an upper bound: the model knows nothing
        of kernel efficiency below the assumed GEMM rate, memory-bound operations, stragglers
        or failures.
    """)
    _RESULTS["published"] = rows


def mfu_section():
    run = small_run()
    shape = ModelShape.from_gpt(run.cfg)
    hw, timed = _RESULTS.get("hw"), _RESULTS.get("timed")
    note("""
        ## Model FLOPs utilisation
        MFU (Chowdhery et al. 2022, PaLM) divides the FLOPs a step *must* do — about $6\\Psi$
        per token for forward and backward, plus $12 L h s$ for attention — by what the
        hardware could do in that time. Recomputation does not count: it is work the model
        did not need.
    """)
    see(flops_per_token)
    if hw is not None and timed:
        ranks = timing_ranks(4)
        tokens = run.global_batch * shape.seq
        best = min(timed, key=lambda x: x[2].median)
        u = mfu(shape, tokens / best[2].median, ranks * hw.peak)
        note(f"""
            Here: {flops_per_token(shape)[0]:,} FLOPs per token; the fastest layout measured
            ({best[0].label()}) trains {tokens / best[2].median:,.0f} tokens/s, against
            a peak of {ranks} × {hw.peak / 1e9:.2f} GFLOP/s (the measured {cal_n()}² matmul) —
            **MFU {100 * u:.2f}%**, {machine(ranks)}. A model this small spends its time in
            fixed per-operation costs, not in matmuls.
        """)
        _RESULTS["mfu_here"] = u
    published = _RESULTS.get("published") or []
    if published:
        best = [r for r in published if r[2] == "search: fastest that fits"]
        table([[r[0], r[1], r[3], f"{100 * r[6]:.0f}%"] for r in best],
              header=["model", "GPUs", "layout", "predicted MFU"],
              caption="Predicted at published scale (bounded by the assumed GEMM efficiency).")
    note("""
        Public reference points: PaLM 540B trained at 46.2% MFU on 6144 TPU v4 chips
        (Chowdhery et al. 2022); Megatron-LM reached 52% of A100 peak for a 1T-parameter model
        on 3072 GPUs (Narayanan et al. 2021); Llama 3 405B ran at 38–43% BF16 MFU on 8K–16K
        H100s (Llama 3 report, table 4); small open 4D frameworks report roughly 38–50% for
        1–7B models on 8–64 H100s, and the Ultrascale Playbook swept more than 4,000
        configurations up to 512 GPUs to find theirs.
    """)
    for url, title in [
        ("https://arxiv.org/abs/2204.02311", "Chowdhery et al. 2022, PaLM: Scaling Language Modeling with Pathways (MFU)"),
        ("https://arxiv.org/abs/2104.04473", "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"),
        ("https://arxiv.org/abs/2407.21783", "Llama Team 2024, The Llama 3 Herd of Models"),
        ("https://huggingface.co/spaces/nanotron/ultrascale-playbook", "Tazi et al. 2025, The Ultra-Scale Playbook: Training LLMs on GPU Clusters"),
        ("https://arxiv.org/abs/2205.05198", "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models"),
        ("https://www.nvidia.com/en-us/data-center/h100/", "NVIDIA H100 Tensor Core GPU (datasheet: 989 TFLOP/s dense BF16, 80 GB, NVLink 900 GB/s)"),
        ("https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html", "NVIDIA DGX H100 User Guide (8 GPUs, ConnectX-7 400 Gb/s InfiniBand)"),
    ]:
        see(url, title=title)


def cal_n():
    cal = _RESULTS.get("cal")
    return cal["matmul"]["n"] if cal else 0


# =========================================================================================
# 9. The same layouts from PyTorch's own pieces
# =========================================================================================

def pytorch_tp_plan():
    """parallelize_module's plan for lecture 01's GPT: Megatron's column → row pairs, the
    embedding split by vocabulary (RowwiseParallel on an Embedding), the LM head column-wise
    with its output left as a vocabulary-sharded DTensor for loss_parallel()."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    block = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
             "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
             "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel()}
    return plan, block


def pytorch_layout(cfg, layout, lr):
    """(module, step function) of `layout` built from PyTorch's pieces:
    parallelize_module on the tp mesh dimension, fully_shard (FSDP2) on dp, and for pp a
    PipelineStage per rank driven by Schedule1F1B: any of dp, tp, pp, together or alone."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    mesh = torch_mesh(layout.dp, layout.pp, 1, layout.tp)
    model = L1.GPT(cfg).to(device())
    if layout.tp > 1:
        plan, block_plan = pytorch_tp_plan()
        parallelize_module(model, mesh["tp"], plan)
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], block_plan)
            # Adapter: lecture 01's attention reads its head count from the projection's
            # out_features, which a Colwise-sharded nn.Linear keeps at the global width.
            for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                proj.out_features //= layout.tp
    if layout.pp > 1:
        from lectures.lecture_05_pipeline_parallel import GPTStage
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        stage_idx = mesh["pp"].get_local_rank()
        module = GPTStage(model, stage_idx, layout.pp)
    else:
        module = model
    if layout.dp > 1:
        for block in getattr(module, "blocks", []):
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    loss_ctx = loss_parallel if layout.tp > 1 else contextlib.nullcontext

    def loss_of(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    if layout.pp > 1:
        stage = PipelineStage(module, stage_idx, layout.pp, device(), group=mesh["pp"].get_group())
        sched = Schedule1F1B(stage, n_microbatches=layout.micro_batches, loss_fn=loss_of)

    def step(tokens, targets):
        with loss_ctx():
            if layout.pp > 1:
                losses = []
                if stage_idx == 0:
                    sched.step(tokens)
                elif stage_idx == layout.pp - 1:
                    sched.step(target=targets, losses=losses)
                else:
                    sched.step()
                loss = torch.stack(losses).mean().item() if losses else None
            else:
                loss = 0.0
                for x, y in zip(tokens.chunk(layout.micro_batches), targets.chunk(layout.micro_batches)):
                    l = loss_of(module(x), y) / layout.micro_batches
                    l.backward()
                    loss += l.item()
        opt.step()
        opt.zero_grad()
        return loss
    return module, step


def _dp_rows(run, layout, step):
    mesh_dp = mesh_coords(dist.get_rank(), (layout.dp, layout.pp, 1, layout.tp))["dp"]
    tokens, targets = L1.batch(run.cfg, run.global_batch, step)
    rows = run.global_batch // layout.dp
    return (tokens[mesh_dp * rows:(mesh_dp + 1) * rows].to(device()),
            targets[mesh_dp * rows:(mesh_dp + 1) * rows].to(device()))


def train_pytorch_layout(rank, world_size, run, layout):
    """`run` under `layout` from PyTorch's pieces; returns the losses and full parameters."""
    module, step = pytorch_layout(run.cfg, layout, run.lr)
    losses = []
    for s in range(run.steps):
        loss = step(*_dp_rows(run, layout, s))
        t = torch.tensor([loss if loss is not None and mesh_coords(rank, (layout.dp, layout.pp, 1, layout.tp))["tp"] == 0 else 0.0],
                         dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(t.item() / layout.dp)
    params = {}
    # Gathering a 2D (FSDP2 on TP) parameter takes two all-gathers in a row, and DTensor logs a
    # warning per parameter saying so: for a one-off check after training, that is fine.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for k, p in module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        name = module.global_name(k) if hasattr(module, "global_name") else k
        params[name] = full.detach().cpu().clone()
    return {"losses": losses, "params": params}


def time_ours_vs_pytorch(rank, world_size, run, layouts, repeats=5):
    """Seconds per step of each layout, ours and PyTorch's, alternating in the same processes."""
    out = []
    for lay in layouts:
        ours = LayoutTrainer(run, lay, make_mesh(lay.dp, lay.pp, lay.cp, lay.tp))
        _, theirs = pytorch_layout(run.cfg, lay, run.lr)
        batch = _dp_rows(run, lay, 0)
        t = measure_side_by_side({"ours": lambda: ours.train_step(0), "PyTorch": lambda: theirs(*batch)},
                                 warmup=1, repeats=repeats)
        out.append((t["ours"], t["PyTorch"]))
    return out


PYTORCH_LAYOUTS = [("dp×pp", Layout(dp=2, pp=2, micro_batch=2, micro_batches=2)),
                   ("tp×pp", Layout(pp=2, tp=2, micro_batch=2, micro_batches=4)),
                   ("dp×tp", Layout(dp=2, tp=2, micro_batch=2, micro_batches=2))]
PYTORCH_3D = ("dp×tp×pp", Layout(dp=2, pp=2, tp=2, micro_batch=2, micro_batches=2))  # 8 ranks: full build


def pytorch_pieces():
    run = Run(steps=3)     # enough steps for AdamW's state to matter; PyTorch's pieces start slowly
    note("""
        ## The same layouts from PyTorch's own pieces
        PyTorch ships every piece: `init_device_mesh` for the mesh, `parallelize_module`
        with `ColwiseParallel` / `RowwiseParallel` for tensor parallelism (DTensor
        parameters; `loss_parallel()` computes the loss on vocabulary-sharded logits),
        `fully_shard` (FSDP2) on the dp dimension, and `PipelineStage` with `Schedule1F1B`
        on the pp dimension's group. Built on the same lecture-01 GPT (lecture 05's
        `GPTStage` cuts the stages), with one adapter: the attention module reads its head
        count from its projections' `out_features`, which a column-sharded `nn.Linear`
        keeps at the global width. On top of tensor parallelism, FSDP2 shards parameters that
        are already DTensors over the tp dimension, so they become 2D DTensors (sharded on
        both mesh dimensions). The full build also runs all three together on 8 ranks.
    """)
    see(pytorch_layout)
    ref = reference_run(run)
    rows = []
    every = PYTORCH_LAYOUTS + [PYTORCH_3D]
    cases = every[:2] if settings.quick else every   # the tests check all three 4-rank layouts
    for name, lay in cases:
        got = spawn(train_pytorch_layout, lay.world, run=run, layout=lay,
                    name=f"PyTorch pieces: {name}, {lay.label()}").returns
        diff = max_param_diff(got, ref["params"])
        rows.append([name, lay.label(), lay.world, got[0]["losses"][-1], diff])
        assert diff < 1e-4, (name, diff)
    for name, lay in every[len(cases):]:
        rows.append([name, lay.label(), lay.world, "full build only", ""])
    table(rows, header=["layout", "mesh", "ranks", "last loss", "max |Δ parameter| vs one process"],
          caption=f"PyTorch's pieces train the same model to the same parameters (one process: "
                  f"last loss {ref['losses'][-1]:.6f}).")
    ranks = 4
    timed = PYTORCH_LAYOUTS[:1] if settings.quick else PYTORCH_LAYOUTS[:2]   # dp×pp, tp×pp
    times = spawn(time_ours_vs_pytorch, ranks, run=run, layouts=[l for _, l in timed],
                  repeats=3 if settings.quick else 5, name="step time: ours vs PyTorch's pieces").returns[0]
    table([[name, lay.label(), a.ms(), b.ms(), a.median / b.median]
           for (name, lay), (a, b) in zip(timed, times)],
          header=["layout", "mesh", "ours", "PyTorch's pieces", "ours / PyTorch"],
          caption=f"Seconds per step, median and IQR, ours and PyTorch's taking turns, {machine(ranks)}.")
    _RESULTS["vs_pytorch"] = [(name, a.median / b.median) for (name, _), (a, b) in zip(timed, times)]


def notes():
    note("""
        ## Notes: launching across nodes, NCCL, and what to check first
        **Launch.** Every rank runs the same program; `torchrun` starts one process per GPU on
        each node and they meet at a rendezvous endpoint:
        `torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $MASTER:29500
        --rdzv-id $JOB -m util.run lecture_07_putting_it_together --world-size 16`. Under Slurm,
        one `srun` task per node runs that command with `$MASTER` taken from
        `scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1` (the course README has the
        script). The mesh's order matters then: with 8 GPUs per node, tp = 8 keeps every
        tensor-parallel group inside a node.

        **NCCL's environment.** `NCCL_DEBUG=INFO` prints the transports and rings it picked
        (check that InfiniBand, not TCP sockets, carries inter-node traffic);
        `NCCL_SOCKET_IFNAME` / `NCCL_IB_HCA` choose the interfaces; `NCCL_ALGO` and
        `NCCL_PROTO` force ring/tree and LL/LL128/Simple for experiments;
        `TORCH_NCCL_ASYNC_ERROR_HANDLING=1` and a process-group timeout turn a hang into an
        error.

        **A big run is slow: check, in order,** (1) the MFU against the 35–50% that published
        runs reach; (2) one node alone at the same per-GPU batch — if it is fast, the network
        or the layout across nodes is the problem (run nccl-tests across nodes and compare
        bus bandwidth with the link's); (3) the profile of one step: exposed communication
        (tensor parallelism crossing nodes, data-parallel traffic not overlapped), the pipeline
        bubble ((pp − 1)/m), recomputation you do not need; (4) stragglers: one slow GPU or
        link sets everyone's pace, so compare per-rank step times; (5) the data loader and
        host-side stalls.
    """)


def main():
    intro()
    the_mesh()              # where each rank sits, and its group on each axis
    many_layouts()          # the same training under every combination, against one process
    memory_estimator()      # bytes per rank predicted, checked on every run above
    search_here()           # the space of valid configurations
    step_time_model()       # time per step predicted from measured constants, checked on ≥ 6 layouts
    published_scale()       # the same search for an 8B and a 70B model on H100s
    mfu_section()           # how much of the hardware a step uses
    pytorch_pieces()        # the same layouts from PyTorch's own building blocks
    notes()                 # multi-node launch, NCCL, and what to check first


def bench():
    """Predicted vs measured step time (rank correlation) and ours vs PyTorch's pieces."""
    rho = step_time_model()
    pytorch_pieces()
    lines = [f"lecture_07: step-time model vs measured over {len(_RESULTS['timed'])} layouts: "
             f"rank correlation {rho:.2f} (target >= 0.8)"]
    for name, ratio in _RESULTS["vs_pytorch"]:
        lines.append(f"lecture_07: {name} step, ours / PyTorch's pieces: ratio {ratio:.2f} (target <= 1.2)")
    return lines
