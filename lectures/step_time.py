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
- `LLAMA3_8B`, `LLAMA3_70B`, `h100_cluster()`: published models and hardware.
"""
import dataclasses
import math

from lectures.estimator import PRECISION_BYTES, ModelShape, stage_layers, stage_params
from lectures.mesh import MESH_AXES

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
