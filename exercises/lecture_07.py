"""Lecture 07's exercises: mesh coordinates and groups, the memory of a layout, the exposed time
of a gradient all-reduce. The course's answers are computed here, in the notebook's process
(lecture 07 is slow to import: the ranks never need it), and the ranks run the student's code."""
import math

from exercises import exercise, mutant

# (1, 2, 2, 1): pp and cp both > 1, so putting cp outside pp (Megatron-LM's order) shows
MESH_SHAPES = ((2, 1, 1, 3), (1, 3, 1, 2), (2, 2, 1, 2), (2, 1, 2, 2), (3, 2, 1, 2), (1, 2, 2, 1))


def _spread(cases, world_size=3):
    """Cases dealt to the ranks in turn (rank r gets cases r, r + 3, ...)."""
    return [cases[r::world_size] for r in range(world_size)]


def run_cases(rank, world_size, fn, cases):
    """Every case: (label, args, expected); the rank calls the student's function on args."""
    return [(label, expected, fn(*args)) for label, args, expected in cases[rank]]


# --- mesh coordinates and groups ----------------------------------------------------------------

def mesh_cases():
    from lectures.layout import MESH_AXES, axis_groups, mesh_coords
    cases = []
    for shape in MESH_SHAPES:
        world = 1
        for s in shape:
            world *= s
        for r in range(world):
            groups = {a: next(g for g in axis_groups(shape, a) if r in g) for a in MESH_AXES}
            cases.append((f"rank {r} of a (dp, pp, cp, tp) = {shape} mesh: [coordinates, groups]",
                          (r, shape), [mesh_coords(r, shape), groups]))
    return {"cases": _spread(cases)}


def mesh_groups(rank, shape):
    """Reference: row-major (dp, pp, cp, tp), tp fastest; a group varies one coordinate."""
    axes = ("dp", "pp", "cp", "tp")
    coords, rest = {}, rank
    for axis, size in zip(reversed(axes), reversed(shape)):
        coords[axis] = rest % size
        rest //= size
    coords = {a: coords[a] for a in axes}
    strides = [math.prod(shape[k + 1:]) for k in range(4)]
    groups = {}
    for k, axis in enumerate(axes):
        first = rank - coords[axis] * strides[k]
        groups[axis] = [first + i * strides[k] for i in range(shape[k])]
    return [coords, groups]


exercise(
    module=__name__, name="mesh_groups",
    title="mesh coordinates and the process groups of a (dp, pp, cp, tp) mesh",
    statement=(
        "**Exercise: mesh coordinates and groups.** Megatron-LM (Narayanan et al. 2021) lays "
        "ranks on a (dp, pp, cp, tp) grid in row-major order with tp innermost — rank = "
        "((dp·PP + pp)·CP + cp)·TP + tp — so consecutive ranks (one node's GPUs, joined by "
        "NVLink) form the tensor-parallel groups, which talk every layer. Write "
        "`mesh_groups(rank, shape)` returning `[coords, groups]`: `coords` = `{\"dp\": .., "
        "\"pp\": .., \"cp\": .., \"tp\": ..}` of `rank`, and `groups` = for each axis, the ascending "
        "list of ranks that differ from `rank` only in that coordinate (its process group on that "
        "axis). The check deals every rank of 6 meshes (6, 6, 8, 8, 12, 4 ranks) out to 3 real "
        "ranks and compares with the course's `mesh_coords` and `axis_groups`."),
    stub=(
        "def mesh_groups(rank, shape):\n"
        "    \"\"\"[{axis: coordinate}, {axis: [ranks of rank's group on that axis]}]; shape = (dp, pp, cp, tp).\"\"\"\n"
        "    raise NotImplementedError(\"hint: tp varies fastest (stride 1), then cp (stride tp), \"\n"
        "                              \"pp (stride cp*tp), dp (stride pp*cp*tp)\")\n"),
    harness=run_cases, prepare=mesh_cases, solution=mesh_groups,
    wrong={"dp innermost": mutant(mesh_groups, ("zip(reversed(axes), reversed(shape))", "zip(axes, shape)"),
                                  ("shape[k + 1:]", "shape[:k]")),
           "every group consecutive ranks":
               mutant(mesh_groups, ("[math.prod(shape[k + 1:]) for k in range(4)]", "[1] * 4"))},
    hint="a group on axis a is the ranks rank + (i - coords[a]) * stride(a), i = 0 .. size(a) - 1",
    sizes="meshes (2,1,1,3), (1,3,1,2), (2,2,1,2), (2,1,2,2), (3,2,1,2), (1,2,2,1): 44 ranks in all")


# --- the memory estimate of a layout ------------------------------------------------------------

def memory_cases():
    from lectures.layout import LLAMA3_8B, Layout, estimate_memory
    layouts = [Layout(dp=8, zero=0, precision="bf16"), Layout(dp=8, zero=1, precision="bf16"),
               Layout(dp=6, tp=2, zero=2, precision="bf16"), Layout(dp=3, pp=2, zero=3, precision="fp32"),
               Layout(dp=1, tp=4, precision="fp32"), Layout(dp=5, cp=2, zero=1, precision="fp64")]
    cases = []
    for layout in layouts:
        est = estimate_memory(LLAMA3_8B, layout)
        cases.append((f"{layout.label()} ({layout.precision}), {est['params']:,.0f} parameters on "
                      "this rank's stage: bytes", (est["params"], layout),
                      {k: est[k] for k in ("weights", "grads", "optimizer")}))
    return {"cases": _spread(cases)}


def precision_bytes():
    from lectures.layout import PRECISION_BYTES
    return {"PRECISION_BYTES": PRECISION_BYTES}


def memory_estimate(params, layout):
    """Reference: ZeRO-1 shards the optimizer over the dp·cp replicas, ZeRO-2 also the grads,
    ZeRO-3 the weights."""
    B, dp, z = PRECISION_BYTES[layout.precision], layout.dp * layout.cp, layout.zero
    return {"weights": B["weights"] * params / (dp if z >= 3 else 1),
            "grads": B["grads"] * params / (dp if z >= 2 else 1),
            "optimizer": B["optimizer"] * params / (dp if z >= 1 else 1)}


exercise(
    module=__name__, name="memory_estimate",
    title="the memory of a layout: weights, gradients, optimizer state under ZeRO",
    statement=(
        "**Exercise: the memory estimate of a layout.** A rank of a pipeline stage holds "
        "`params` parameters (tp and pp already divided them). With bytes per parameter B from "
        "`PRECISION_BYTES[layout.precision]` (already defined for you: weights, grads, optimizer), "
        "ZeRO (Rajbhandari et al. 2020) shards over the ranks that hold the same weights, the "
        "`layout.dp * layout.cp` data- and context-parallel replicas (context parallelism splits "
        "tokens, not weights): stage 1 the optimizer state, stage 2 also the gradients, stage 3 "
        "also the weights. Write "
        "`memory_estimate(params, layout)` returning `{\"weights\", \"grads\", \"optimizer\"}` in "
        "bytes per rank (`layout.zero` is the stage, 0 for none). The check runs 6 layouts of "
        "Llama 3 8B (ZeRO 0–3, bf16, fp32, fp64, with tp, pp and cp) against the course's "
        "`estimate_memory`, two per rank."),
    stub=(
        "def memory_estimate(params, layout):\n"
        "    \"\"\"Bytes per rank {'weights', 'grads', 'optimizer'} for `params` parameters under `layout`.\"\"\"\n"
        "    B = PRECISION_BYTES[layout.precision]\n"
        "    raise NotImplementedError(\"hint: ZeRO-k divides the first k of optimizer, grads, weights \"\n"
        "                              \"by layout.dp * layout.cp\")\n"),
    harness=run_cases, prepare=memory_cases, given=precision_bytes, solution=memory_estimate,
    wrong={"ZeRO-1 also shards the gradients": mutant(memory_estimate, ("z >= 2", "z >= 1")),
           "shards over every rank, not dp·cp": mutant(memory_estimate, ("layout.dp * layout.cp", "layout.world")),
           "shards over dp only, not dp·cp": mutant(memory_estimate, ("layout.dp * layout.cp", "layout.dp"))},
    hint="the dp·cp ranks hold copies of the same parameters: tp and pp ranks hold different ones",
    sizes="Llama 3 8B, 6 layouts: ZeRO 0-3; bf16, fp32, fp64; dp with tp, pp, cp")


# --- the exposed time of a gradient all-reduce ---------------------------------------------------

def exposed_cases():
    from lectures.layout import all_reduce_time
    cases = []
    for n, nbytes, link, backward, overlap in [
            (8, 16e9, (5e-6, 450e9), 0.2, 1.0), (8, 16e9, (5e-6, 450e9), 0.02, 1.0),
            (64, 16e9, (2e-5, 50e9), 0.3, 0.5), (1, 1e9, (5e-6, 450e9), 0.1, 1.0),
            (3, 3e6 + 7, (3e-5, 1.2e9), 1e-3, 0.0), (3, 3e6 + 7, (3e-5, 1.2e9), 1e-3, 0.8)]:
        expected = max(0.0, all_reduce_time(n, nbytes, link) - overlap * backward)
        cases.append((f"{n} ranks, {nbytes:.3g} bytes, α = {link[0]:g} s, β = {link[1]:.3g} B/s, "
                      f"backward {backward:g} s, overlap {overlap:g}: exposed seconds",
                      (n, nbytes, link[0], link[1], backward, overlap), expected))
    return {"cases": _spread(cases)}


def exposed_all_reduce(n, nbytes, alpha, beta, backward_seconds, overlap):
    """Reference: ring all-reduce time (α–β), minus what backward hides, never below zero."""
    t = 0.0 if n == 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta
    return max(0.0, t - overlap * backward_seconds)


exercise(
    module=__name__, name="exposed_all_reduce",
    title="the exposed time of a gradient all-reduce under backward",
    statement=(
        "**Exercise: the exposed time of a gradient all-reduce.** With the α–β model of lecture "
        "02, a ring all-reduce of `nbytes` on n ranks takes 2(n − 1)·α + 2(n − 1)/n · nbytes/β "
        "(2(n − 1) steps, each rank sending 2(n − 1)/n of the buffer; nothing on one rank). DDP "
        "starts it during backward, so a fraction `overlap` of the `backward_seconds` hides it; "
        "what is left shows up in the step time. Write `exposed_all_reduce(n, nbytes, alpha, "
        "beta, backward_seconds, overlap)` returning the exposed seconds (never negative). The "
        "check runs 6 cases (NVLink and InfiniBand constants, one rank, fully and partly hidden) "
        "against the course's `all_reduce_time`, two per rank."),
    stub=(
        "def exposed_all_reduce(n, nbytes, alpha, beta, backward_seconds, overlap):\n"
        "    \"\"\"Seconds of the gradient all-reduce that backward does not hide.\"\"\"\n"
        "    raise NotImplementedError(\"hint: ring time 2(n-1)·alpha + 2(n-1)/n·nbytes/beta, minus \"\n"
        "                              \"overlap·backward_seconds, at least 0\")\n"),
    harness=run_cases, prepare=exposed_cases, solution=exposed_all_reduce,
    wrong={"can go negative": mutant(exposed_all_reduce, ("max(0.0, ", "(")),
           "reduce-scatter's traffic only": mutant(exposed_all_reduce, ("2 * (n - 1) * alpha + 2 * (n - 1) / n",
                                                                        "(n - 1) * alpha + (n - 1) / n")),
           "one latency instead of 2(n - 1)": mutant(exposed_all_reduce, ("2 * (n - 1) * alpha", "alpha"))},
    hint="a fully hidden all-reduce costs 0 s, not a negative time",
    sizes="6 cases: n = 1, 3, 8, 64; overlap 0 to 1")
