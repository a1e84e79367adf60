"""What each rank runs in lecture 07's demos, and the one-process references they are checked
against; the lecture launches them with spawn() and narrates what they return. Also the analysis
of those returns (the calibrated machine, rank correlation and its interval) and the helpers that
put it into words (verdict_of, ties_words, long_context_words)."""
import collections
import dataclasses
import logging
import math
import statistics

import torch
import torch.distributed as dist

from util import device, settings
from util.measure import measure, measure_side_by_side, value_range, with_spread

from lectures.data_parallel.collectives import fit_alpha_beta
from lectures.layout.estimator import Layout, ModelShape, stage_layers
from lectures.layout.mesh import MESH_AXES, make_mesh, mesh_coords, torch_mesh
from lectures.layout.pytorch import pytorch_layout
from lectures.layout.search import attention_rate_needed, causal_discounted, valid_layouts
from lectures.layout.step_time import LLAMA3_405B, Hardware, flops_per_token, p2p_time, step_time
from lectures.layout.trainer import LayoutTrainer, Run, train_layout
from lectures.model.gpt import GPT, batch, loss_fn

_RESULTS = {}   # what the lecture's sections measured, for the sections and deep dives after them


# =========================================================================================
# 1. The device mesh (lectures/layout/mesh.py): checked against PyTorch's
# =========================================================================================

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


# =========================================================================================
# 2. The run every layout trains
# =========================================================================================

def small_run():
    return Run(steps=4 if settings.quick else 6)


# =========================================================================================
# 3. Calibrating the step-time model on this machine
# =========================================================================================

def fit_line(xs, ys):
    """Least-squares y = a + b·x with a ≥ 0 and b > 0. A negative intercept, or a slope that
    does not rise (a loaded machine timed the bigger batch no slower), describes no machine:
    then the line goes through the origin, all of the time proportional to x. (Clamping the
    slope instead once made the compute rate 1/1e-30 FLOP/s.)"""
    import numpy as np
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    b, a = np.polyfit(x, y, 1)
    if a < 0 or b <= 0:
        a, b = 0.0, float((x * y).sum() / (x * x).sum())
    return float(a), float(b)


def model_step_parts(cfg, micro_batch):
    """forward+backward and optimizer-step callables of the one-process GPT on `micro_batch`
    sequences (what every rank of a layout runs a slice of)."""
    model = GPT(cfg).to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = (t.to(device()) for t in batch(cfg, micro_batch, 0))

    def fwd_bwd():
        loss_fn(model(tokens), targets).backward()

    def step():
        opt.step()
        opt.zero_grad(set_to_none=False)
    fwd_bwd()
    return fwd_bwd, step


def calibrate(rank, world_size, cfg, batch_sizes, sizes, repeats=7):
    """The constants of the step-time model, measured with every rank busy at once (as in the
    runs being predicted): matmul throughput, the one-process forward+backward time against
    its FLOPs, the optimizer step, α–β fits of all-reduce and of send/recv, and one block's
    ring attention against the same attention on the rank's shard alone. None of it is a
    training step of a layout: calibration and validation use different runs. Any number of
    ranks: with an odd count the last rank sits out the send/recv pairs."""
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
    peer = rank ^ 1 if (rank ^ 1) < world_size else None      # odd world: the last rank waits
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, device=device())
        ar.append(measure(lambda: dist.all_reduce(x), warmup=2, repeats=repeats))

        def ping():
            if peer is None:
                return
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
    out["ring"] = calibrate_ring(cfg, world_size, repeats) if world_size > 1 else None
    return out


def calibrate_ring(cfg, n, repeats):
    """One block's ring attention over all `n` ranks (zig-zag, micro-batch 1) and the same
    attention on the rank's shard alone, forward and forward + backward: what a ring step adds
    beyond its FLOPs (which the compute term already counts) and its bytes."""
    from lectures.context_parallel.blocks import SegmentAttention
    from lectures.context_parallel.ring import ring_attention
    from lectures.context_parallel.sharding import layout_segments
    hd = cfg.d_model // cfg.n_heads
    local = -(-cfg.seq_len // (2 * n)) * 2            # tokens per rank: two zig-zag chunks
    shape = (1, cfg.n_heads, local, hd)
    q, k, v = (torch.randn(shape, device=device(), requires_grad=True) for _ in range(3))
    segs = layout_segments([local], "zigzag")[0]
    runs = {"ring": lambda: ring_attention(q, k, v, causal=True, layout="zigzag"),
            "alone": lambda: SegmentAttention.apply(q, k, v, segs, segs, True)}
    out = {"n": n, "kv_bytes": 2 * q.numel() * q.element_size()}
    for name, f in runs.items():
        out[name + " forward"] = measure(f, warmup=2, repeats=repeats)
        out[name + " forward+backward"] = measure(lambda: f().sum().backward(), warmup=2, repeats=repeats)
    return out


def this_machine(cal, cfg, world_size):
    """Hardware constants of this machine from `calibrate`'s measurements. The ring all-reduce
    on n ranks is 2(n−1) steps each moving 1/n of the buffer, so the fitted whole-collective
    (α, β) become per-step (α/(2(n−1)), β·2(n−1)/n), the form the model uses; point-to-point messages use the send/recv fit."""
    n = world_size
    link = ring_link(cal, n)[0]
    overhead, per_flop = fit_line([f for _, f, _ in cal["compute"]], [t.median for _, _, t in cal["compute"]])
    return Hardware("this machine", flops=1 / per_flop, memory=float("inf"), ranks_per_node=10 ** 6,
                    intra=link, inter=link, overhead=overhead / cfg.n_layers,
                    step_overhead=cal["optimizer"].median, overlap=0.0, peak=cal["matmul"]["flops"],
                    p2p=cal["fit_p2p"], bucketed=False, ring_step=ring_step_cost(cal), backend="gloo")


def ring_link(cal, n):
    """The per-ring-step (α, β) from the all-reduce fit, and whether β came from send/recv
    instead. A fit over latency-bound sizes only finds no growth with size (β = ∞), which
    would make every byte free: then a ring step, one message of 1/n of the buffer to a
    neighbour, takes the send/recv fit's β. Refuses when neither fit saw bandwidth."""
    alpha_ar, beta_ar = cal["fit_all_reduce"]
    alpha = alpha_ar / (2 * (n - 1))
    if math.isfinite(beta_ar) and beta_ar > 0:
        return (alpha, beta_ar * 2 * (n - 1) / n), False
    beta_p2p = cal["fit_p2p"][1]
    if not (math.isfinite(beta_p2p) and beta_p2p > 0):
        raise ValueError("neither the all-reduce nor the send/recv fit found a finite bandwidth: "
                         "calibrate with larger messages (several MB)")
    return (alpha, beta_p2p), True


def ring_step_cost(cal):
    """(forward, backward) seconds a ring step adds beyond the shard's own attention and the
    K/V bytes it moves (K and V forward; K, V, dK, dV backward), from `calibrate_ring`."""
    ring = cal.get("ring")
    if not ring or ring["n"] < 2:
        return (0.0, 0.0)
    steps = ring["n"] - 1
    send = p2p_time(ring["kv_bytes"], cal["fit_p2p"])
    fwd = ring["ring forward"].median - ring["alone forward"].median
    both = ring["ring forward+backward"].median - ring["alone forward+backward"].median
    return (max(0.0, fwd / steps - send), max(0.0, (both - fwd) / steps - 2 * send))


# =========================================================================================
# 4. Timing the layouts (lectures/layout/trainer.py trains them), and how well the model ranks them
# =========================================================================================

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


def time_layouts(rank, world_size, run, layouts, repeats=5, warmup=2):
    """Measured seconds per training step of every layout (slowest rank, median of `repeats`
    after `warmup` steps), one layout after another in the same processes, without the
    activation meter (its hooks cost 15–20% here, and the calibration runs without them)."""
    out = []
    for lay in layouts:
        trainer = LayoutTrainer(run, lay, make_mesh(lay.dp, lay.pp, lay.cp, lay.tp), track_memory=False)
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


def trivial_prediction(model, layout):
    """A predictor without any constants: micro-batches × blocks on the busiest rank. The cost
    model must beat this to earn its constants."""
    return layout.micro_batches * max(stage_layers(model.layers, layout.pp))


def compute_only_prediction(model, layout, hw):
    """The cost model with every transfer free (links of no latency and unbounded bandwidth,
    no ring-step cost): compute and the pipeline's bubble alone. What the communication terms
    add to the ranking is the cost model's ρ beyond this one's."""
    free = dataclasses.replace(hw, intra=(0.0, math.inf), inter=(0.0, math.inf), p2p=None, ring_step=(0.0, 0.0))
    return step_time(model, layout, free)["total"]


def axes_of(layout):
    """Which axes a layout splits (and its ZeRO stage): the rows of the per-axis error table."""
    parts = [a for a in MESH_AXES if getattr(layout, a) > 1] or ["one rank"]
    return "×".join(parts) + (f" + ZeRO-{layout.zero}" if layout.zero else "")


def rho_interval(rho, n):
    """An approximate 95% interval of a Spearman ρ from n pairs (Fisher's z, standard error
    1.06/√(n − 3), Fieller et al. 1957)."""
    if n <= 3 or abs(rho) >= 1:
        return (float("nan"), float("nan")) if n <= 3 else (rho, rho)
    z, se = math.atanh(rho), 1.06 / math.sqrt(n - 3)
    return math.tanh(z - 1.96 * se), math.tanh(z + 1.96 * se)


def rho_uncertainty(rho, lo, hi):
    """The words for ρ's 95% interval; Fisher's z has none at ρ = ±1 (its z is infinite)."""
    if abs(rho) >= 1:
        return "Fisher's z gives no interval at a perfect ranking, yet a few layouts are a small sample"
    if math.isnan(lo):
        return "too few layouts for an interval"
    return f"95% interval {value_range(lo, hi, decimals=2)}, Fisher's z"


def verdict_of(baseline, lo, hi):
    """How the cost model's ρ compares with a baseline's, given the model's 95% interval."""
    return ("ranks them better than" if baseline < lo else "ranks them worse than" if baseline > hi
            else "cannot be told apart, with this many layouts, from")


def ties_words(predictions):
    """' (4 of its 8 predictions tie, …)' where predictions print alike (ties make a ρ fragile)."""
    tied = sum(c for c in collections.Counter(f"{p:.6g}" for p in predictions).values() if c > 1)
    return f" ({tied} of its {len(predictions)} predictions tie, which makes its ρ fragile)" if tied else ""


def worst_ratios(ratios):
    """An axis's measured-over-predicted ratios for a sentence: two at most in the text ("1.91×
    and 2.40×"), more as their range with each on hover."""
    each = [f"{r:.2f}×" for r in sorted(ratios)]
    if len(each) <= 2:
        return " and ".join(each)
    return with_spread(value_range(min(ratios), max(ratios), decimals=2) + "×", ", ".join(each))


# =========================================================================================
# 5. Llama 3's Table 4 through the model: what a long-context row rests on
# =========================================================================================

def long_context_words(row, best, err, hw):
    """What a long-context row's prediction rests on: attention, at a published rate, and an
    MFU count Meta does not define; each in numbers."""
    shape = dataclasses.replace(LLAMA3_405B, seq=row["seq"])
    share = 12 * shape.seq / (12 * shape.seq + 6 * sum(shape.layer_params()) / shape.hidden)
    rate = attention_rate_needed(row, best, LLAMA3_405B, hw)
    other = causal_discounted(row, LLAMA3_405B)
    return f"""The {row['seq'] // 1024}K row ({100 * err:+.1f}%) rests on attention, {100 * share:.0f}% of
        a block's counted FLOPs at that length. The model runs it at FlashAttention-2's top H100
        figure, {hw.attention / 1e12:.0f} TFLOP/s — the highest panel of its Figure 7, from
        2023, not a bound (FlashAttention-3 is faster) — and would predict Meta's
        {100 * row['mfu']:.0f}% exactly at {rate / 1e12:.0f} TFLOP/s ({rate / hw.attention:.2f}×
        that figure). Two inputs here are not measurements: Meta publishes no attention rate,
        and the report does not define its MFU count. The model assumes PaLM's (12·h·s per token
        and block, no discount for the causal mask); had Meta credited causal attention half,
        its {100 * row['mfu']:.0f}% would be {100 * other:.0f}% in this count and the row
        {100 * (best['mfu'] / other - 1):+.0f}% off."""


# =========================================================================================
# 6. The same layouts from PyTorch's own pieces (lectures/layout/pytorch.py)
# =========================================================================================

def _dp_rows(run, layout, step):
    mesh_dp = mesh_coords(dist.get_rank(), (layout.dp, layout.pp, 1, layout.tp))["dp"]
    tokens, targets = batch(run.cfg, run.global_batch, step)
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
        ours = LayoutTrainer(run, lay, make_mesh(lay.dp, lay.pp, lay.cp, lay.tp), track_memory=False)
        _, theirs = pytorch_layout(run.cfg, lay, run.lr)
        rows = _dp_rows(run, lay, 0)
        t = measure_side_by_side({"ours": lambda: ours.train_step(0), "PyTorch": lambda: theirs(*rows)},
                                 warmup=1, repeats=repeats)
        out.append((t["ours"], t["PyTorch"]))
    return out


# --- experts on the mesh: lecture 06's MoE GPT under ep inside dp -----------------------------

def moe_run():
    """A small dropless MoE GPT (4 experts, top-2) trained on 4 ranks against one process."""
    from lectures.model.gpt import GPTConfig
    return Run(cfg=GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4), global_batch=8,
               steps=3, experts=4, top_k=2)


MOE_LAYOUTS = [("dp4, ep4: one expert per rank", Layout(dp=4, ep=4, micro_batch=1, micro_batches=2)),
               ("dp4, ep2: two groups of two", Layout(dp=4, ep=2, micro_batch=2)),
               ("dp4: experts replicated", Layout(dp=4, micro_batch=2))]


def train_moe_layouts(rank, world_size, run, layouts):
    """Every (name, layout) trained in turn on the same ranks (lecture 07's `train_layout`)."""
    return [train_layout(rank, world_size, run, lay) for _, lay in layouts]
