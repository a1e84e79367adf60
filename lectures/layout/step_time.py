"""Seconds per training step under a (dp, pp, cp, tp) layout: a cost model with measured or
published constants.

Lecture 07's step-time model: the communication costs of the earlier lectures put together.
Collectives follow lecture 02's α–β model per ring step (Hockney 1994; ring all-reduce as in
Patarasuk & Yuan 2009); compute counts 6 FLOPs per matrix parameter and token plus attention,
the convention of the MFU literature (Chowdhery et al. 2022, "PaLM", https://arxiv.org/abs/2204.02311);
the pipeline adds its bubble of pp − 1 slots (Huang et al. 2019, GPipe; Narayanan et al. 2021,
1F1B). The lecture calibrates `Hardware` on the machine that builds it and compares predicted
with measured step times; `h100_cluster()` holds published H100 numbers for the search at scale.

- `Hardware`: FLOP/s, memory and the (α, β) of links inside and across nodes.
- `step_time(model, layout, hw)`: seconds per step and its parts (compute, tp, cp, pp, bubble, dp).
- `flops_per_token`, `mfu`: useful work, and how much of the hardware's peak a step uses.
- `gemm_efficiency`: what the matrix products' shapes waste in tiles and waves on a GPU's SMs.
- `LLAMA3_8B`, `LLAMA3_70B`, `LLAMA3_405B`, `h100_cluster()`: published models and hardware.
"""
import dataclasses
import math

from lectures.layout.estimator import (PRECISION_BYTES, ModelShape, block_params, check_split, rank_blocks, rank_layers,
                                       stage_params)
from lectures.layout.mesh import MESH_AXES

# =========================================================================================
# Step time: a cost model with measured (or published) constants
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
    overlap: float = 0.0         # fraction of the compute that data-parallel traffic can hide under
    peak: float = None           # peak FLOP/s for MFU (defaults to `flops`)
    bucketed: bool = True        # gradients synced in one message (else one per parameter tensor)
    p2p: tuple = None            # (α, β) of one send/recv where it differs from a ring step
    ring_step: tuple = (0.0, 0.0)  # fixed seconds per ring-attention step (forward, backward)
    # FLOP/s of the attention kernel on the FLOPs it runs (`attention_kernel_flops`: its
    # backward recomputes the scores, and a causal kernel skips the masked half). None:
    # attention is charged its counted FLOPs at `flops`, as the fit on this machine's runs does.
    attention: float = None
    # "nccl" or "gloo": gloo's reduce-scatter is a full all-reduce and a copy
    # (ProcessGroupGloo::reduce_scatter_tensor_coalesced), so `dp_traffic` charges it as one
    backend: str = "nccl"
    # HBM bytes/s that memory-bound kernels (norms, activations, softmax, dropout, residual adds,
    # the optimizer) reach; None: not charged apart (this machine's fit folds them into its rates)
    hbm: float = None
    # attention scores written to HBM (softmax, dropout and their backward as separate kernels,
    # as Megatron-LM 2021 ran before FlashAttention); False: a fused FlashAttention kernel
    scores_in_hbm: bool = False
    # fraction of a micro-batch's compute on the rank that hides its expert all-to-alls (0: all
    # exposed; DualPipe's claim, DeepSeek-V3 §3.2.1: "fully hidden", i.e. 1 while they fit under it)
    ep_overlap: float = 0.0
    # fraction of a micro-batch's compute that hides its tensor-parallel collectives (0: all
    # exposed, as the stated model charges them; asynchronous TP, lecture 04, overlaps them)
    tp_overlap: float = 0.0
    # (SMs, tile rows, tile columns): matrix products run in tiles, a wave of one tile per SM
    # (`gemm_efficiency`); None: every product at `flops`, whatever its shape
    gemm_tiles: tuple = None

    def __post_init__(self):
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={self.backend!r}: 'nccl' or 'gloo'")
        positive = {"flops": self.flops, "memory": self.memory, "intra β": self.intra[1], "inter β": self.inter[1],
                    "peak": self.peak, "attention": self.attention, "hbm": self.hbm,
                    "p2p β": None if self.p2p is None else self.p2p[1]}
        for k, v in positive.items():
            if v is not None and not (isinstance(v, (int, float)) and v > 0):   # nan fails v > 0 too
                raise ValueError(f"Hardware.{k}={v!r}: a rate or size must be a number > 0")
        nonnegative = {"intra α": self.intra[0], "inter α": self.inter[0], "overhead": self.overhead,
                       "step_overhead": self.step_overhead, "ring_step": min(self.ring_step),
                       "p2p α": None if self.p2p is None else self.p2p[0]}
        for k, v in nonnegative.items():
            if v is not None and not v >= 0:
                raise ValueError(f"Hardware.{k}={v!r}: a latency must be a number ≥ 0")
        for k in ("overlap", "ep_overlap", "tp_overlap"):
            if not 0 <= getattr(self, k) <= 1:
                raise ValueError(f"Hardware.{k}={getattr(self, k)!r}: a fraction from 0 to 1")
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"Hardware.ranks_per_node={self.ranks_per_node!r}: a whole number ≥ 1")
        if self.gemm_tiles is not None:
            tiles = self.gemm_tiles
            if not (isinstance(tiles, (tuple, list)) and len(tiles) == 3 and all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in tiles)):
                raise ValueError(f"Hardware.gemm_tiles={tiles!r}: (SMs, tile rows, tile columns), whole numbers ≥ 1")
            object.__setattr__(self, "gemm_tiles", tuple(tiles))     # a list would make Hardware unhashable


def group_span(layout, axis):
    """(stride, size) of an axis' groups on the mesh: its ranks are stride apart, the stride
    being the product of the inner axes' sizes. Expert parallelism ("ep") is a group of ep
    consecutive data-parallel ranks (ep inside dp, as Megatron-LM and DeepSeek place it)."""
    sizes = dict(zip(MESH_AXES, (layout.dp, layout.pp, layout.cp, layout.tp)))
    k = MESH_AXES.index("dp" if axis == "ep" else axis)
    stride = math.prod(sizes[a] for a in MESH_AXES[k + 1:])
    return stride, layout.ep if axis == "ep" else sizes[axis]


def axis_link(hw, layout, axis):
    """(α, β) of the links an axis' groups use. A group is inside one node only when its span
    (stride × size) tiles the nodes, i.e. divides the ranks per node: then every group sits
    in one node. Otherwise some group straddles two nodes (tp = 6 on 8-GPU nodes: ranks 6–11),
    and the slowest group sets the pace: the links across nodes."""
    stride, size = group_span(layout, axis)
    return hw.intra if hw.ranks_per_node % (stride * size) == 0 else hw.inter


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


def matmul_params(model):
    """(Ψ_mat, the blocks' part of it). Ψ_mat is the weights a token is multiplied by: every
    block's matrices (a MoE block's router, shared and top-k experts) plus the LM head. An
    embedding lookup and a norm's scale do almost no FLOPs, so they are not counted."""
    dense, moe = model.layers - model.moe_layers(), model.moe_layers()
    blocks = dense * model.matrix_params_per_token() + moe * model.matrix_params_per_token(moe=True)
    return blocks + model.vocab * model.hidden, blocks


def flops_per_token(model, recompute="none"):
    """Training FLOPs per token: 6 per matrix parameter (2 forward, 4 backward) plus the
    attention scores and values, 12·L·h·s (the convention of the MFU literature: no credit
    for causal skipping). Full recomputation runs every block's forward twice (+2 per matrix
    parameter), which costs time but is not counted as useful work in MFU."""
    matrix, blocks = matmul_params(model)
    useful = 6 * matrix + 12 * model.layers * model.hidden * model.seq
    if recompute == "full":
        return useful, useful + 2 * blocks + 4 * model.layers * model.hidden * model.seq
    return useful, useful


def dp_parts(model, layout, hw, stage, compute):
    """The data-parallel collectives of one step on `stage`: (seconds, compute that can hide
    them, times per step, when they end), over the dp·cp ranks that hold the same weights
    (`compute` is one micro-batch's forward + backward on this stage; backward ≈ 2/3 of it,
    forward ≈ 1/3, the FLOP ratio):
      ZeRO-0    one all-reduce of the gradients per step, started in the *last* micro-batch's
                backward (the earlier ones only accumulate): only that backward can hide it;
      ZeRO-1    the same, as a reduce-scatter, then an all-gather of the updated weights after
                the optimizer, which only the next step's first forward can hide;
      ZeRO-2    a reduce-scatter *every* micro-batch (the gradients are sharded, so each
                micro-batch's must be reduced before the next overwrites it; Zero2's hooks do
                this, and DeepSpeed refuses ZeRO-2 with pipelines for this reason), each under
                its own backward, then the all-gather after the optimizer;
      ZeRO-3    every micro-batch gathers the weights for its forward and again for its
                backward (all but the embedding and head, `kept_gathered`) and reduce-scatters
                its gradients; nothing after the optimizer (the updated shards are what the
                next forward gathers).
    When: "after the last backward" (the last reduction: a pipeline's cool-down can hide it,
    `after_the_pipeline`), "after the optimizer", or "in the pipeline" (the earlier micro-batches';
    for ZeRO-3 the last one's too, whose gathers share its backward: a simplification that
    charges ZeRO-3 a little more under a pipeline). On gloo (`hw.backend`) a reduce-scatter costs a full all-reduce, as
    `collective_bytes` counts it."""
    B = PRECISION_BYTES[layout.precision]
    n = layout.dp * layout.cp
    if n == 1:
        return []
    link = axis_link(hw, layout, "dp") if layout.dp > 1 else axis_link(hw, layout, "cp")
    n_layers = rank_layers(model.layers, layout.pp, layout.virtual_stages)[stage]
    # One message for all gradients (bucketed), or one per parameter tensor.
    k = 1 if hw.bucketed else (n_layers * model.tensors_per_layer() + 2 * (stage == 0)
                               + 3 * (stage == layout.pp - 1))
    fwd, bwd = compute / 3, 2 * compute / 3
    m, z = layout.micro_batches, layout.zero
    # the routed experts are replicated over dp·cp/ep ranks only (expert data parallelism)
    experts = block_params(model, layout, stage)[1]
    params = stage_params(model, layout, stage)
    kept = kept_gathered(model, layout, stage)
    last, later, inside = "after the last backward", "after the optimizer", "in the pipeline"
    parts = []
    for count, ranks, kept_here in ((params - experts, n, kept), (experts, n // layout.ep, 0)):
        if ranks == 1 or count == 0:
            continue
        grad_bytes, weight_bytes = count * B["grads"], count * B["weights"]
        ar = lambda nbytes: k * all_reduce_time(ranks, nbytes / k, link)
        ag = lambda nbytes: k * gather_time(ranks, nbytes / k, link)
        rs = ar if hw.backend == "gloo" else ag
        if z == 0:
            parts += [(ar(grad_bytes), bwd, 1, last)]
        elif z == 1:
            parts += [(rs(grad_bytes), bwd, 1, last), (ag(weight_bytes), fwd, 1, later)]
        elif z == 2:   # the last micro-batch's reduce-scatter ends after the last backward
            parts += [(rs(grad_bytes), bwd, m - 1, inside), (rs(grad_bytes), bwd, 1, last),
                      (ag(weight_bytes), fwd, 1, later)]
        else:   # backward gathers all but the embedding and head, kept gathered since forward
            again = weight_bytes - kept_here * B["weights"]
            parts += [(ag(weight_bytes), fwd, m, inside), (ag(again) + rs(grad_bytes), bwd, m, inside)]
    return parts


def dp_traffic(model, layout, hw, stage, compute, when=None):
    """(exposed seconds, seconds before hiding) of `stage`'s data-parallel collectives in one
    step (`dp_parts`; only those that end `when`, if given): a fraction `hw.overlap` of the
    compute each runs beside can hide it."""
    return exposure(dp_parts(model, layout, hw, stage, compute), hw, when)


def exposure(parts, hw, when=None):
    """(exposed seconds, seconds before hiding) of `dp_parts`' `parts` that end `when` (all if None)."""
    parts = [p for p in parts if when in (None, p[3])]
    return (sum(k * max(0.0, t - hw.overlap * under) for t, under, k, _ in parts),
            sum(k * t for t, _, k, _ in parts))


def step_time(model, layout, hw):
    """Predicted seconds per optimizer step and its parts: the pipeline's slots timed on the
    slowest stage, then each stage's gradient reduction in its cool-down, the wait for every
    stage, and the slowest optimizer step (`after_the_pipeline`).

    compute   a micro-batch on one stage: its FLOPs / (tp·cp) at `hw.flops`, the matrix
              products' slowed by what their shapes waste in tiles and waves
              (`gemm_efficiency`, the part `gemm efficiency` of the result), plus a fixed
              cost per block (Python and kernel launches);
              full recomputation adds the forward again; with `hw.attention` set, the
              attention scores and values run apart, the FLOPs a FlashAttention kernel runs
              (`attention_kernel_flops`) at that rate (the part `attention` of the result);
    tp        4 all-reduces of the block's activations per block and micro-batch (2 forward,
              2 backward), 6 with full recomputation (the forward's 2 run again); sequence
              parallelism: 6 all-gathers + 4 reduce-scatters (`tp_collectives`, the counts
              `step_bytes` uses); `hw.tp_overlap` of the compute hides them;
    cp        all-gather CP (`layout.cp_algorithm`, Llama 3's): per block K and V all-gathered
              forward and backward, dK and dV reduce-scattered; ring attention: per block,
              cp−1 ring steps forward (K and V travel) and cp−1
              backward (K, V, dK, dV), each with its bytes and a fixed cost per step
              (`hw.ring_step`: launching a block of attention, merging, waiting); full
              recomputation runs the forward's steps again;
    pp        m slots of one micro-batch each plus the bubble, (pp − 1)/v slots with v
              virtual stages (interleaved 1F1B; lecture 05), and per slot v sends of
              activations forward and v of gradients backward (with sequence parallelism
              each tp rank sends its 1/tp of the sequence, as Megatron-LM does);
    dp        the gradient sync over the dp·cp ranks that hold the same weights, once or
              every micro-batch according to the ZeRO stage (`dp_parts`), partly hidden
              under the compute it runs beside (`hw.overlap`); the once-a-step reduction also
              in the stage's pipeline cool-down (`after_the_pipeline`);
    ep        the experts' dispatch and combine all-to-alls (`hw.ep_overlap` hides them);
    memory    memory-bound work at `hw.hbm` (part of compute), and the optimizer step."""
    check_split(model, layout)
    B = PRECISION_BYTES[layout.precision]
    tokens = layout.micro_batch * model.seq / layout.cp          # per rank per micro-batch
    rc = layout.recompute == "full"
    v = layout.virtual_stages
    sizes = rank_layers(model.layers, layout.pp, v)
    worst = max(range(layout.pp), key=lambda s: sizes[s] + (s == layout.pp - 1) * model.vocab / (12 * model.hidden))
    n_layers = sizes[worst]
    dense, moe = rank_blocks(model, layout.pp, v)[worst]
    # matrix FLOPs per token on this rank's blocks: an MoE block multiplies its active experts only
    matrix_flops = (6 + 2 * rc) * (dense * model.matrix_params_per_token() + moe * model.matrix_params_per_token(True))
    attention_flops = (12 + 4 * rc) * model.hidden * model.seq
    head_flops = 6 * model.vocab * model.hidden if worst == layout.pp - 1 else 0
    flops = tokens * (matrix_flops + n_layers * attention_flops + head_flops) / layout.tp
    # the matrix products at `hw.flops`, less what their shapes waste in tiles and waves
    shapes = rank_gemms(model, layout, dense, moe, worst == layout.pp - 1)
    efficiency = gemm_efficiency(shapes, hw, rc)
    gemms = tokens * (matrix_flops + head_flops) / layout.tp / (hw.flops * efficiency)
    if hw.attention is None:
        attention = 0.0
        compute = gemms + tokens * n_layers * attention_flops / layout.tp / hw.flops + n_layers * hw.overhead
    else:
        attention = tokens * n_layers * attention_kernel_flops(model, rc) / layout.tp / hw.attention
        compute = gemms + attention + n_layers * hw.overhead
    memory = memory_bound_time(model, layout, hw, dense, moe) if hw.hbm else 0.0
    compute += memory
    act = tokens * model.hidden * B["act"]
    tp_link = axis_link(hw, layout, "tp")
    seconds = {"all-reduce": lambda b: all_reduce_time(layout.tp, b, tp_link),
               "all-gather": lambda b: gather_time(layout.tp, b, tp_link),
               "reduce-scatter": lambda b: (all_reduce_time if hw.backend == "gloo" else gather_time)(layout.tp, b, tp_link)}
    tp = sum(k * seconds[kind](b) for kind, b, k in
             tp_collectives(layout, n_layers, worst == 0, worst == layout.pp - 1, act, tokens, rc))
    tp = max(0.0, tp - hw.tp_overlap * compute)          # what the compute beside it does not hide
    cp = 0.0
    if layout.cp > 1 and layout.cp_algorithm == "allgather":
        # per block: K and V all-gathered forward (again under full recomputation) and again
        # backward, dK and dV reduce-scattered; the whole sequence's K and V, cp shards of kv
        kv = 2 * tokens * model.kv_dim * B["act"] / layout.tp
        link = axis_link(hw, layout, "cp")
        cp = n_layers * ((2 + rc) * gather_time(layout.cp, layout.cp * kv, link)
                         + gather_time(layout.cp, layout.cp * kv, link))
    elif layout.cp > 1:
        kv = 2 * tokens * model.kv_dim * B["act"] / layout.tp
        step_fwd, step_bwd = hw.ring_step
        passes = p2p_time(kv, p2p_link(hw, layout, "cp")) * (1 + rc) + 2 * p2p_time(kv, p2p_link(hw, layout, "cp"))
        cp = n_layers * (layout.cp - 1) * (passes + (1 + rc) * step_fwd + step_bwd)
    # a micro-batch's forward and backward on this rank and its sends: with v chunks a
    # micro-batch enters and leaves the rank v times (v sends of activations, v of gradients)
    # with sequence parallelism a stage's output is split over the tp ranks: each sends its part
    boundary = act / layout.tp if layout.sp else act
    sends = 2 * v * p2p_time(boundary, p2p_link(hw, layout, "pp")) if layout.pp > 1 else 0.0
    # expert parallelism: per MoE block a dispatch and a combine all-to-all forward, both again
    # backward (and forward again under full recomputation), each of the k routed copies of
    # this rank's tokens (1/tp of them with sequence parallelism; with node-limited routing
    # `route_nodes` copies), on the ep group's links; `hw.ep_overlap` of the compute hides them
    ep = 0.0
    if moe and layout.ep > 1:
        copies = min(model.top_k, model.route_nodes) if model.route_nodes else model.top_k
        rows = tokens * copies * model.hidden * B["act"] / (layout.tp if layout.sp else 1)
        ep = moe * (4 + 2 * rc) * all_to_all_time(layout.ep, rows, axis_link(hw, layout, "ep"))
        ep = max(0.0, ep - hw.ep_overlap * compute)      # what the compute beside it does not hide
    slot = compute + tp + cp + sends + ep
    m = layout.micro_batches
    bubble = (layout.pp - 1) / v * slot          # (p − 1)/(v·m) of the m slots (lecture 05)
    exposed_dp, optimizer, dp_all = after_the_pipeline(model, layout, hw, compute, chunk_backward(slot, sends, v))
    total = m * slot + bubble + exposed_dp + optimizer + hw.step_overhead
    return {"total": total, "compute": m * compute, "tp": m * tp, "cp": m * cp,
            "bubble": bubble, "pp": m * sends, "dp": exposed_dp, "flops": flops * m,
            "attention": m * attention, "memory": m * memory, "ep": m * ep, "optimizer": optimizer,
            "dp before hiding": dp_all, "gemm efficiency": efficiency}


def chunk_backward(slot, sends, v):
    """One model chunk's backward and the send of its gradient, from a micro-batch's slot on a
    rank (its v chunks' forward and backward with their collectives, and its 2·v sends):
    backward is 2/3 of the work, its FLOPs twice the forward's (3/4 under full recomputation,
    which runs the forward again in backward: a slack a little short)."""
    return (2 * (slot - sends) / 3 + sends / 2) / v


def after_the_pipeline(model, layout, hw, compute, backward):
    """What a step adds after its pipeline: (exposed DP seconds, optimizer seconds, DP seconds
    before hiding).

    In 1F1B the last micro-batch's backward runs from the last stage down to the first, so
    stage s ends its pipeline s chunk backwards (`backward`, each as long as the slowest
    stage's, as the bubble assumes) before stage 0 does, and spends that cool-down on its
    gradient reduction (hidden, like every stage's, under the slowest stage's compute). The
    traffic of the earlier micro-batches (ZeRO-2, ZeRO-3) runs inside the pipeline: the cool-down
    cannot hide it. Then every stage waits for the others: clipping by the global gradient norm
    (lecture 08; every published run here clips) needs every stage's reduced gradients before
    any optimizer step. Then each stage's optimizer step and ZeRO's all-gather of the updated
    weights; the step ends with the slowest."""
    reductions, updates, before, seen = [], [], [], set()
    v = layout.virtual_stages
    sizes, blocks = rank_layers(model.layers, layout.pp, v), rank_blocks(model, layout.pp, v)
    for s in range(layout.pp):
        kind = (sizes[s], blocks[s], s == 0, s == layout.pp - 1)
        if kind in seen:      # a stage like an earlier one: the same collectives, more cool-down
            continue
        seen.add(kind)
        parts = dp_parts(model, layout, hw, s, compute)
        inside, last, (gather, gathered) = (exposure(parts, hw, when) for when in
                                            ("in the pipeline", "after the last backward", "after the optimizer"))
        optimizer = optimizer_time(model, layout, hw, s) if hw.hbm else 0.0
        reductions.append(inside[0] + max(0.0, last[0] - s * backward))
        updates.append((optimizer + gather, gather, gathered))
        before.append(inside[1] + last[1])
    update, gather, gathered = max(updates)
    # before hiding, counted as the exposed seconds are: the largest reduction, the slowest update's gather
    return max(reductions) + gather, update - gather, max(before) + gathered


def all_to_all_time(n, nbytes, link):
    """All-to-all of a buffer of `nbytes` per rank over n ranks: n − 1 steps, (n − 1)/n of it leaves."""
    alpha, beta = link
    return 0.0 if n == 1 else (n - 1) * alpha + (n - 1) / n * nbytes / beta


def elementwise_per_token(model, layout, moe=False):
    """Elements per token that one block's memory-bound kernels read and write in a forward
    pass, (on every tp rank, split over tp): two norms (read, write: 2h each), two residual adds
    (read two, write one: 3h each) — split over tp only with sequence parallelism; the MLP's
    activation (GELU read f write f; SwiGLU read 2f write f), in an MoE block for each active
    expert, plus the dispatch's and combine's permutes (read and write k·h rows, twice); and
    with `scores_in_hbm` the attention scores' softmax and dropout (read and write a·s each)."""
    act = 2 if model.mlp_matrices == 2 else 3
    if moe:
        split = act * model.expert_ffn * (model.top_k + model.shared_experts) + 4 * model.top_k * model.hidden
    else:
        split = act * model.ffn
    return 10 * model.hidden, split


def memory_bound_time(model, layout, hw, dense, moe):
    """Seconds of memory-bound work in one micro-batch on a rank of `dense` + `moe` blocks,
    at `hw.hbm` bytes/s: `elementwise_per_token` for the forward, twice that backward, once
    more under full recomputation; the course's selective recomputation re-runs the norms
    and the MLP's activation. Attention scores (with `hw.scores_in_hbm`) add 4·a·s per token
    forward, each head's on its tp rank."""
    B = PRECISION_BYTES[layout.precision]["act"]
    tokens = layout.micro_batch * model.seq / layout.cp
    passes = 3 + (layout.recompute == "full")
    total = 0.0
    for n, kind in ((dense, False), (moe, True)):
        if not n:
            continue
        stream, split = elementwise_per_token(model, layout, kind)
        scores = 4 * model.heads * model.seq / layout.cp if hw.scores_in_hbm else 0
        per = passes * ((stream / layout.tp if layout.sp else stream) + (split + scores) / layout.tp)
        if layout.recompute == "selective":
            per += (4 * model.hidden / (layout.tp if layout.sp else 1) + split / layout.tp)
        total += n * per
    return tokens * total * B / hw.hbm


def optimizer_time(model, layout, hw, stage):
    """The optimizer step on `hw.hbm`: AdamW reads each parameter's gradient, master weight
    and two moments and writes back the master weight, the moments and the working weight,
    for the parameters this rank updates (1/(dp·cp) of them from ZeRO-1 on; experts 1/(dp·cp/ep))."""
    B = PRECISION_BYTES[layout.precision]
    n, experts = stage_params(model, layout, stage), block_params(model, layout, stage)[1]
    shard = layout.dp * layout.cp if layout.zero else 1
    updated = (n - experts) / shard + experts / (shard // layout.ep if layout.zero else 1)
    return updated * (B["grads"] + 2 * B["optimizer"] + B["weights"]) / hw.hbm


def block_gemms(model, layout, moe=False):
    """[(how many, rows, inputs, outputs, launched together, runs again)]: the matrix products
    of one block on a rank in a micro-batch's forward, rows being its tokens. Q, K and V as one
    product, and the MLP's input matrices as one (as Megatron-LM fuses them), each split over
    tp; in an MoE block the router (replicated on the tp ranks, where the FLOP count of
    `step_time` splits it: a small product either way), the shared experts, and the experts/ep
    routed experts the rank holds, launched as one grouped GEMM (as Megatron-LM's grouped GEMM
    and DeepSeek's DeepGEMM do), each multiplying the tokens routed to it from the ep group's
    ranks (top_k·ep/experts of a rank's tokens each, if the router balances them). Every block
    product runs its forward again under full recomputation."""
    rows = layout.micro_batch * model.seq / layout.cp
    h, tp, up = model.hidden, layout.tp, model.mlp_matrices - 1
    shapes = [(1, rows, h, (h + 2 * model.kv_dim) / tp, 1, True), (1, rows, h / tp, h, 1, True)]
    if not moe:
        return shapes + [(1, rows, h, up * model.ffn / tp, 1, True), (1, rows, model.ffn / tp, h, 1, True)]
    f, shared = model.expert_ffn, model.shared_experts
    shapes.append((1, rows, h, model.experts, 1, True))
    if shared:
        shapes += [(1, rows, h, up * shared * f / tp, 1, True), (1, rows, shared * f / tp, h, 1, True)]
    routed, local = rows * model.top_k * layout.ep / model.experts, model.experts // layout.ep
    return shapes + [(1, routed, h, up * f / tp, local, True), (1, routed, f / tp, h, local, True)]


def rank_gemms(model, layout, dense, moe, last):
    """The matrix products of a rank holding `dense` + `moe` blocks, and the LM head if `last`
    (which full recomputation does not run again: it recomputes blocks)."""
    shapes = [(dense * g[0], *g[1:]) for g in block_gemms(model, layout)] if dense else []
    if moe:
        shapes += [(moe * g[0], *g[1:]) for g in block_gemms(model, layout, True)]
    if last:
        shapes.append((1, layout.micro_batch * model.seq / layout.cp, model.hidden, model.vocab / layout.tp, 1, False))
    return shapes


def wave_efficiency(rows, columns, tiles, group=1):
    """The share of the SMs' time a product with a rows × columns output does useful work
    (NVIDIA, "Matrix Multiplication Background User's Guide", 2023, §3): the output is cut
    into tiles, one per SM at a time, so tiles at the edges run partly empty (tile
    quantization) and the last wave can leave SMs idle (wave quantization). `tiles` = (SMs,
    tile rows, tile columns); `group` products of that shape launched as one grid share waves."""
    sms, tm, tn = tiles
    n_tiles = group * math.ceil(rows / tm) * math.ceil(columns / tn)
    waves = math.ceil(n_tiles / sms)
    return group * rows * columns / (waves * sms * tm * tn)


def gemm_efficiency(shapes, hw, recompute=False):
    """The FLOP-weighted efficiency of `shapes` (rank_gemms), forward and backward: each
    product runs forward (its output rows × outputs), then backward for the input's gradient
    (rows × inputs) and the weight's (inputs × outputs), each with the forward's FLOPs; full
    recomputation runs a block's forward again. 1 on hardware without `gemm_tiles`."""
    if hw.gemm_tiles is None:
        return 1.0
    work = seconds = 0.0
    for n, rows, inputs, outputs, group, again in shapes:
        flops = n * group * rows * inputs * outputs
        forward = wave_efficiency(rows, outputs, hw.gemm_tiles, group)
        for e in [forward] * (1 + (recompute and again)) + [wave_efficiency(rows, inputs, hw.gemm_tiles, group),
                                                            wave_efficiency(inputs, outputs, hw.gemm_tiles, group)]:
            work, seconds = work + flops, seconds + flops / e
    return work / seconds


def attention_kernel_flops(model, recompute=False):
    """FLOPs per token and block that a causal FlashAttention kernel runs, counted as Dao 2023
    (§4.1) counts them for its benchmarks: the forward's two matmuls 4·h·s, the backward 2.5×
    that (five matmuls: it recomputes the scores rather than storing them), half of each
    under a causal mask — 7·h·s, where the MFU convention credits 12·h·s. Full recomputation
    runs the forward once more."""
    forward = 4 * model.hidden * model.seq
    return (forward * (1 + recompute) + 2.5 * forward) / 2


def tp_collectives(layout, n_layers, first, last, act, tokens, recompute=False):
    """[(kind, bytes of the whole tensor, how many)] of one micro-batch's tensor-parallel
    collectives on a rank of `n_layers` blocks, as the trainer runs them — what `step_bytes`
    counts and `step_time` charges. Per block: 2 all-reduces forward and 2 backward; with
    sequence parallelism 2 all-gathers and 2 reduce-scatters forward, their conjugates backward
    and the 2 column-parallel inputs gathered again (Megatron-LM keeps them sharded): 6 + 4.
    Full recomputation runs the forward's again. The first stage's vocabulary-parallel
    embedding, the last stage's LM head and its loss (3 all-reduces of one fp32 per token)."""
    if layout.tp == 1:
        return []
    if layout.sp:
        ops = [("all-gather", act, n_layers * (6 + 2 * recompute)),
               ("reduce-scatter", act, n_layers * (4 + 2 * recompute))]
        ops += [("reduce-scatter", act, first), ("all-gather", act, first)]
        ops += [("all-gather", act, 2 * last), ("reduce-scatter", act, last)]
    else:
        ops = [("all-reduce", act, n_layers * (4 + 2 * recompute) + first + last)]
    return ops + [("all-reduce", tokens * 4, 3 * last)]


def mfu(model, tokens_per_second, peak_flops_total):
    """Model FLOPs utilisation: useful training FLOPs per second / the hardware's peak."""
    return tokens_per_second * flops_per_token(model)[0] / peak_flops_total



# Published hardware and models (the numbers are cited on the page; what is assumed says so).
LLAMA3_8B = ModelShape("Llama 3 8B", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                       vocab=128256, seq=8192, mlp_matrices=3, bias=False, norm_params=1,
                       learned_positions=False)
LLAMA3_70B = ModelShape("Llama 3 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
                        vocab=128256, seq=8192, mlp_matrices=3, bias=False, norm_params=1,
                        learned_positions=False)
# Llama 3 405B (Llama 3 report, Table 3): 126 layers, width 16,384, FFN 53,248, 128 heads and 8
# K/V heads; "405B" parameters, which the shape reproduces (tests/test_lecture_07.py).
LLAMA3_405B = ModelShape("Llama 3 405B", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248,
                         vocab=128256, seq=8192, mlp_matrices=3, bias=False, norm_params=1,
                         learned_positions=False)
LLAMA3_405B_PUBLISHED_PARAMS = 405e9
H100_PEAK_BF16 = 989.4e12        # dense BF16 tensor-core FLOP/s, H100 SXM (NVIDIA datasheet)
H100_MEMORY = 80 * 2 ** 30       # HBM3 bytes: "80 GB" on the datasheet is 80 GiB
NVLINK_BW = 450e9                # NVLink 4: 900 GB/s per GPU, both directions together
IB_BW = 50e9                     # one 400 Gb/s NDR InfiniBand port per GPU (DGX H100)
# What the H100 cluster achieves, as published: each a measurement by others, cited.
# FlashAttention-2's forward + backward on an H100 SXM5: "up to 335 TFLOPs/s" (Dao 2023,
# https://arxiv.org/abs/2307.08691, section 4.1, Figure 7), on the FLOPs its benchmark counts
# (`attention_kernel_flops`); the highest of the figure's panels (causal or not, head dimension
# 64 or 128), FlashAttention-2's own figure from 2023, not a bound (FlashAttention-3 is faster).
FA2_H100 = 335e12
# NCCL's ring on NVLink 4: "an effective NVLink bandwidth of 370GB/s" (the 450 GB/s line rate
# less ~20% protocol overhead; NVIDIA's NCCL team, https://github.com/NVIDIA/nccl-tests/issues/212).
NVLINK_ACHIEVED = 370e9
# A 400 Gb/s NDR NIC: "you should see 46-48GB/s per NIC" (NVIDIA's NCCL team,
# https://github.com/NVIDIA/nccl-tests/issues/290); the middle of that range.
IB_ACHIEVED = 47e9
# HBM3 of an H100 SXM: 3.35 TB/s (NVIDIA H100 datasheet), what memory-bound kernels are charged at
H100_HBM = 3.35e12
ATTENTION = "attention FLOP/s (FlashAttention-2's top figure on an H100)"
NVLINK = "NCCL's bandwidth on NVLink (B/s)"
IB = "NCCL's bandwidth per InfiniBand NIC (B/s)"
HBM = "HBM bandwidth (B/s)"
# An H100 SXM has 132 SMs (NVIDIA H100 datasheet), an A100 108 (NVIDIA A100 datasheet).
SMS = "streaming multiprocessors (SMs)"
TILE = "GEMM tile (rows, columns)"
PUBLISHED = {ATTENTION: FA2_H100, NVLINK: NVLINK_ACHIEVED, IB: IB_ACHIEVED, HBM: H100_HBM, SMS: 132}
ASSUMED = {"sustained fraction of peak for large GEMMs": 0.7,     # assumption, not a citation
           "usable fraction of HBM": 0.9,                          # workspace, fragmentation
           # the tile NVIDIA's GEMM guide (§2.3) names cuBLAS's most efficient, 256 × 128, for
           # every product (an assumption: cuBLAS picks among several per shape)
           TILE: (256, 128),
           # memory-bound kernels (norms, activations, adds, AdamW) reach this share of the HBM
           # datasheet rate (an assumption: a streaming kernel rarely sustains more)
           "fraction of HBM bandwidth that memory-bound kernels reach": 0.8,
           "α per ring step in a node (s)": 3e-6, "α per ring step across nodes (s)": 8e-6,
           # data-parallel traffic hides completely under the compute it runs beside (the
           # best case: NCCL's kernels also take SMs from compute, see PYTORCH_ON_CPU.md)
           "fraction of that compute hiding data-parallel traffic": 1.0}


def _cluster(name, peak, memory, published, changed):
    known = {**published, **ASSUMED}
    unknown = set(changed) - set(known)
    if unknown:
        raise ValueError(f"not a constant of the model: {sorted(unknown)}; choose from {sorted(known)}")
    a = {**known, **changed}
    return Hardware(name, flops=a["sustained fraction of peak for large GEMMs"] * peak,
                    memory=a["usable fraction of HBM"] * memory, ranks_per_node=8,
                    intra=(a["α per ring step in a node (s)"], a[NVLINK]),
                    inter=(a["α per ring step across nodes (s)"], a[IB]),
                    overlap=a["fraction of that compute hiding data-parallel traffic"], peak=peak,
                    attention=a[ATTENTION], hbm=a[HBM] * a["fraction of HBM bandwidth that memory-bound kernels reach"],
                    gemm_tiles=(a[SMS], *a[TILE]))


def h100_cluster(**changed):
    """The H100 cluster with the PUBLISHED and ASSUMED constants, any of them `changed` by name
    (what a calibration fits: `h100_cluster(**{"sustained fraction of peak for large GEMMs": 0.8})`)."""
    return _cluster("DGX H100 cluster (8 GPUs per node)", H100_PEAK_BF16, H100_MEMORY, PUBLISHED, changed)


# DGX A100 80 GB (NVIDIA A100 datasheet): 312 TF/s dense BF16, 2,039 GB/s HBM2e, NVLink 3 at
# 600 GB/s per GPU (300 per direction), 8 × 200 Gb/s HDR InfiniBand per node (25 GB/s per GPU).
# NCCL's achieved rates are not published for it in one place: the H100's achieved/line ratios
# (370/450 on NVLink, 47/50 per NIC) carried over — an assumption, said on the page.
A100_PEAK_BF16, A100_MEMORY, A100_HBM = 312e12, 80 * 2 ** 30, 2.039e12
A100_PUBLISHED = {NVLINK: 300e9 * NVLINK_ACHIEVED / NVLINK_BW, IB: 25e9 * IB_ACHIEVED / IB_BW, HBM: A100_HBM,
                  # FlashAttention-2 "reaching 50-73% of the theoretical maximum FLOPs/s on A100"
                  # (Dao 2023, abstract): the top of that range
                  ATTENTION: 0.73 * A100_PEAK_BF16, SMS: 108}


def a100_cluster(**changed):
    """DGX A100 80 GB nodes, 8 GPUs each, the same ASSUMED constants as the H100 cluster."""
    return _cluster("DGX A100 cluster (8 GPUs per node)", A100_PEAK_BF16, A100_MEMORY, A100_PUBLISHED, changed)


# H800 SXM: an H100 with NVLink cut to 400 GB/s; DeepSeek-V3's report (DeepSeek-AI 2024,
# https://arxiv.org/abs/2412.19437, §3.2.2): "NVLink offers a bandwidth of 160 GB/s, roughly 3.2
# times that of IB (50 GB/s)" — what their kernels see, per GPU. Compute and HBM as the H100's.
H800_PUBLISHED = {**PUBLISHED, NVLINK: 160e9, IB: 50e9}


def h800_cluster(**changed):
    """DeepSeek-V3's H800 nodes: 8 GPUs each, NVLink and InfiniBand at the rates the report gives."""
    return _cluster("H800 cluster (8 GPUs per node)", H100_PEAK_BF16, H100_MEMORY, H800_PUBLISHED, changed)


# =========================================================================================
# Bytes on the wire per step: the communication model, checkable exactly at any rank count
# =========================================================================================

def collective_bytes(kind, n, nbytes, backend="gloo"):
    """Bytes one rank sends in a ring collective over n ranks on a buffer of `nbytes` (the
    whole buffer, not the shard): all-reduce 2(n−1)/n, all-gather and reduce-scatter (n−1)/n.
    gloo's reduce-scatter is a full all-reduce and a copy (ProcessGroupGloo), so on gloo it
    sends an all-reduce's bytes; NCCL sends the ring's (n−1)/n."""
    if n == 1:
        return 0.0
    if kind == "all-reduce" or (kind == "reduce-scatter" and backend == "gloo"):
        return 2 * (n - 1) / n * nbytes
    return (n - 1) / n * nbytes


def kept_gathered(model, layout, stage):
    """Parameters ZeRO-3 keeps gathered from a micro-batch's forward to its backward: the
    stage's embedding and LM head, which sit in FSDP's root unit (not resharded after forward),
    so backward does not gather them again; `estimate_memory` counts them in `gathered`."""
    return stage_params(model, layout, stage) - sum(block_params(model, layout, stage))


def zero3_bytes(sizes, kept, n, m, weight_bytes, grad_bytes, backend="gloo"):
    """Bytes one rank sends in a ZeRO-3 step of m micro-batches over n ranks: every micro-batch
    all-gathers each tensor (element counts `sizes`, padded to a multiple of n) for its forward,
    again for its backward unless it stayed gathered (`kept`), and reduce-scatters its gradient."""
    pad = lambda xs: sum(-(-s // n) * n for s in xs)
    c = lambda kind, nbytes: collective_bytes(kind, n, nbytes, backend)
    return m * (c("all-gather", pad(sizes) * weight_bytes) + c("all-gather", (pad(sizes) - pad(kept)) * weight_bytes)
                + c("reduce-scatter", pad(sizes) * grad_bytes))


def step_bytes(model, layout, stage, backend="gloo", tensor_sizes=None, kept_sizes=None):
    """Bytes one rank of pipeline stage `stage` sends in one training step, by axis, as the
    trainer runs it:
      tp   per block and micro-batch 2 all-reduces forward and 2 backward of the block's
           activations (sequence parallelism: 2 all-gathers and 2 reduce-scatters forward;
           backward the conjugates, plus re-gathering the 2 column-parallel inputs); the first
           stage's vocabulary-parallel embedding (an all-reduce, or a reduce-scatter with SP);
           the last stage's LM head (its input's gradient: an all-reduce; with SP an all-gather
           forward and a reduce-scatter and a re-gather backward) and its vocabulary-parallel
           loss (3 all-reduces of one fp32 number per token);
      cp   ring attention per block and micro-batch: K and V to the next rank cp−1 times
           forward; backward K and V cp−1 times and dK, dV cp times (the last brings them home);
      pp   a micro-batch's activations to the next stage, its gradient to the previous one
           (with sequence parallelism 1/tp of them per rank: the stage's output is split);
      dp   over the dp·cp replicas, per parameter tensor (`tensor_sizes`: element counts of the
           stage's tensors, padded for ZeRO to a multiple of the group): ZeRO-0 an all-reduce;
           ZeRO-1 a reduce-scatter and an all-gather; ZeRO-2 a reduce-scatter per micro-batch
           and an all-gather; ZeRO-3 per micro-batch an all-gather for forward, another for
           backward of all but what stayed gathered (`kept_sizes`; by default the stage's
           embedding and LM head, `kept_gathered`) and a reduce-scatter — `dp_traffic`'s count.
    Element sizes from `layout.precision`: activations at their width, gradients at the
    gradients' (fp32 in mixed precision), gathered weights at the weights' (bf16)."""
    B = PRECISION_BYTES[layout.precision]["act"]
    tokens = layout.micro_batch * model.seq / layout.cp
    m, tp, cp = layout.micro_batches, layout.tp, layout.cp
    first, last = stage == 0, stage == layout.pp - 1
    n_layers = rank_layers(model.layers, layout.pp, layout.virtual_stages)[stage]
    act = tokens * model.hidden * B
    c = lambda kind, n, nbytes: collective_bytes(kind, n, nbytes, backend)
    out = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp": 0.0}
    rc = layout.recompute == "full"
    out["tp"] = m * sum(k * c(kind, tp, b) for kind, b, k in tp_collectives(layout, n_layers, first, last, act, tokens, rc))
    if cp > 1:
        kv_dim = model.hidden if model.kv_expanded else model.kv_dim
        kv = 2 * layout.micro_batch * (model.seq / cp) * kv_dim / tp * B
        if layout.cp_algorithm == "allgather":   # (cp − 1) shards leave per all-gather or reduce-scatter
            out["cp"] = m * n_layers * (3 + rc) * (cp - 1) * kv
        else:
            out["cp"] = m * n_layers * ((cp - 1) * kv * (1 + rc) + (cp - 1) * kv + cp * kv)
    if layout.pp > 1:   # v chunks: every chunk sends forward but the model's last, backward but its first
        v = layout.virtual_stages
        boundary = layout.micro_batch * model.seq * model.hidden * B / (tp if layout.sp else 1)
        out["pp"] = m * boundary * ((v - last) + (v - first))
    n = layout.dp * layout.cp
    if n > 1:
        W, G = PRECISION_BYTES[layout.precision]["weights"], PRECISION_BYTES[layout.precision]["grads"]
        sizes = tensor_sizes if tensor_sizes is not None else [stage_params(model, layout, stage)]
        padded = sum(-(-s // n) * n if layout.zero else s for s in sizes)
        # gradients travel at their width (fp32 in mixed precision), weights at theirs (bf16)
        if layout.zero == 0:
            out["dp"] = c("all-reduce", n, padded * G)
        elif layout.zero == 1:
            out["dp"] = c("reduce-scatter", n, padded * G) + c("all-gather", n, padded * W)
        elif layout.zero == 2:
            out["dp"] = m * c("reduce-scatter", n, padded * G) + c("all-gather", n, padded * W)
        else:   # ZeRO-3: every micro-batch gathers the weights for forward and (most) for backward
            kept = kept_sizes if kept_sizes is not None else [kept_gathered(model, layout, stage)]
            out["dp"] = zero3_bytes(sizes, kept, n, m, W, G, backend)
    out["total"] = sum(out.values())
    return out
