"""Every valid (dp, pp, cp, tp) layout of a model on a number of ranks, ranked by predicted step
time; and the rule of thumb that picks one without a cost model.

Lecture 07's configuration search: what the Ultra-Scale Playbook (Tazi et al. 2025,
https://huggingface.co/spaces/nanotron/ultrascale-playbook) did by running thousands of
configurations, done here with the memory estimator (`lectures.layout.estimator`) and the step-time
model (`lectures.layout.step_time`). `decision_procedure` is the syllabus' step-by-step rule (fit with
data parallelism and ZeRO; else tensor parallelism within a node, then pipelines across nodes;
context parallelism for long sequences), compared with the search on the page.
`reproduce_table4` runs Llama 3 405B's published layouts (Llama 3 report, Table 4) through the
same model: the knobs the table leaves open chosen by the search, the GEMM fraction of peak
fitted on one row and the other rows predicted; `near_ties` groups the layouts the model
cannot tell apart.
"""
import dataclasses
import itertools
import math

from lectures.layout.estimator import Layout, estimate_memory
from lectures.layout.step_time import flops_per_token, mfu, step_time

# =========================================================================================
# Every valid configuration, ranked
# =========================================================================================

def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_layouts(model, world, global_batch, zero_stages=(0, 1), recompute=("none",),
                  precision="fp32", max_tp=None, micro_batch_sizes=None, sp=(False,), virtual_stages=(1,),
                  expert_parallel=(1,)):
    """Every Layout with dp·pp·cp·tp = world that can run this model:
      tp divides the heads and the K/V heads (each rank holds whole heads), at most `max_tp`;
      pp divides the layers (equal stages) — and a pipeline needs m ≥ pp micro-batches; with
      v > 1 virtual stages pp·v divides the layers (equal chunks);
      cp: the sequence splits into 2·cp equal zig-zag chunks;
      dp divides the global batch; the rest of each dp rank's batch is m micro-batches of
      `micro_batch` sequences; ZeRO stages > 0 only when dp·cp > 1 (ZeRO shards over the
      ranks that hold the same weights); sequence parallelism only with tp > 1;
      ep (from `expert_parallel`) divides dp and the routed experts (dense models: ep = 1)."""
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
            for zero, rc, s, v, ep in itertools.product(zero_stages, recompute, sp, virtual_stages, expert_parallel):
                if (zero and dp * cp == 1) or (s and tp == 1) or (v > 1 and (pp == 1 or model.layers % (pp * v))):
                    continue
                if dp % ep or (model.experts % ep if model.experts else ep > 1):
                    continue
                out.append(Layout(dp, pp, cp, tp, zero=zero, micro_batch=mb, micro_batches=m,
                                  recompute=rc, precision=precision, sp=s, virtual_stages=v, ep=ep))
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


def _gib(n):
    return f"{n / 2**30:.0f} GiB" if n >= 10 * 2**30 else f"{n / 2**30:.2g} GiB"


def decision_procedure(model, world, global_batch, hw, seq_threshold=32768):
    """The syllabus' rule of thumb, step by step, returning (layout, reasons):
    1. fits with plain data parallelism (+ ZeRO-1/2) on every rank? → DP.
    2. else, for sequences of `seq_threshold` tokens or more, cp = 2 in every split below;
    3. split the model, trying in order until it fits: ZeRO-3 on every rank (FSDP);
       TP within a node (2, 4, 8 — the sizes that divide the heads and K/V heads); then
       the largest such TP with PP across nodes; the whole chain first without, then with
       full recomputation;
    4. micro-batch 1, and as many micro-batches as the global batch leaves per dp rank.
    Returns (None, reasons) when nothing fits. The reasons name each split passed over before
    the pick: too large (with the memory it needed), or not possible with these ranks and this
    batch; so the pick reads as the first that fits."""
    reasons, too_large, skipped, ruled_out = [], [], [], set()
    base = dict(precision="bf16", recompute="none")

    def name(zero=0, tp=1, pp=1, recompute="none"):
        split = [f"tp={tp}"] * (tp > 1) + [f"pp={pp}"] * (pp > 1) or [f"ZeRO-{zero}"]
        return " ".join(split) + " + full recomputation" * (recompute == "full")

    def fits(**kw):
        lay = Layout(**{**base, **kw})
        need = estimate_memory(model, lay)["total"]
        if need > hw.memory:
            called = name(lay.zero, lay.tp, lay.pp, lay.recompute)
            ruled_out.add(called)
            too_large.append(f"{called} {_gib(need)}")
        return need <= hw.memory, lay

    def passed_over():
        if too_large:
            reasons.append(f"too large for {_gib(hw.memory)}: " + ", ".join(too_large))
        if skipped:
            reasons.append(f"not possible with {world} GPUs and a batch of {global_batch}: " + ", ".join(skipped))

    dp = world
    if global_batch % dp == 0:
        for zero in (0, 1, 2):
            ok, lay = fits(dp=dp, zero=zero, micro_batch=1, micro_batches=global_batch // dp)
            if ok:
                reasons.append(f"fits with data parallelism alone (ZeRO-{zero}) on {dp} ranks")
                return lay, reasons
    reasons.append(f"does not fit with DP ({', '.join(too_large)} per GPU, over {_gib(hw.memory)}): split the model"
                   if too_large else f"a global batch of {global_batch} does not divide over {world} data-parallel "
                   "ranks: use fewer, and split the model over the rest")
    too_large.clear()
    cp = 1
    if model.seq >= seq_threshold:
        cp = 2
        reasons.append(f"sequence {model.seq} ≥ {seq_threshold}: context parallelism cp={cp}")
    tps = [t for t in (2, 4, 8) if t <= hw.ranks_per_node and model.heads % t == 0 and model.kv_heads % t == 0]
    widest = tps[-1] if tps else 1
    if not tps:
        reasons.append("no tensor-parallel size of 2, 4 or 8 divides the heads: no TP")
    tries = [("zero3", 1, 1)] + [("tp", t, 1) for t in tps] + [("pp", widest, p) for p in divisors(model.layers) if p > 1]
    for rc in ("none", "full"):
        for kind, tp, pp in tries:
            dp = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else 0
            if not dp or global_batch % dp or global_batch // dp < pp or (kind == "zero3" and dp * cp == 1):
                if rc == "none":          # the ranks and the batch decide it, not the recomputation
                    skipped.append(name(3 if kind == "zero3" else 1, tp, pp))
                continue
            m = global_batch // dp
            ok, lay = fits(dp=dp, pp=pp, cp=cp, tp=tp, zero=3 if kind == "zero3" else 1, sp=tp > 1,
                           micro_batch=1, micro_batches=m, recompute=rc)
            if ok:
                passed_over()
                if kind == "zero3":
                    reasons.append(f"ZeRO-3 (FSDP) shards weights, gradients and optimizer over all {dp * cp} ranks")
                else:
                    if tp > 1:
                        reasons.append(f"tensor parallelism (+ sequence parallelism) within a node: tp={tp}")
                    if pp > 1:
                        widest_too_large = (f"tp={widest}" + " + full recomputation" * (rc == "full")) in ruled_out
                        reasons.append(f"pipeline across nodes, pp={pp}"
                                       + ", since TP at the node's size is not enough" * widest_too_large)
                if rc == "full":
                    reasons.append("activations still too large: full recomputation")
                reasons.append(f"the rest is data parallelism (ZeRO-{lay.zero}): dp={dp}; "
                               f"micro-batch 1, m={m} micro-batches per step")
                return lay, reasons
    passed_over()
    reasons.append("nothing fits")
    return None, reasons


# =========================================================================================
# Published runs through the model: Llama 3's Table 4, fitted on one row, predicting the rest
# =========================================================================================

# Llama 3 report (Llama Team 2024, https://arxiv.org/abs/2407.21783), Table 4: Llama 3 405B
# pre-training on H100s, BF16 MFU as Meta measured it. Global batch 16M tokens in every row.
LLAMA3_TABLE4 = [
    dict(gpus=8192, tp=8, cp=1, pp=16, dp=64, seq=8192, per_dp=32, mfu=0.43),
    dict(gpus=16384, tp=8, cp=1, pp=16, dp=128, seq=8192, per_dp=16, mfu=0.41),
    # §3.3.2: "the all-gather based method" of context parallelism, not ring attention
    dict(gpus=16384, tp=8, cp=16, pp=16, dp=8, seq=131072, per_dp=16, mfu=0.38, cp_algorithm="allgather"),
]
GEMM = "sustained fraction of peak for large GEMMs"


def open_knobs(model, mesh, per_dp, micro_batch_sizes=(1, 2), virtual_stages=(1, 2, 3, 4, 6, 8), cp_algorithm="ring"):
    """Every Layout on a fixed (dp, pp, cp, tp) mesh: what a published table leaves open —
    micro-batch size, virtual stages (each chunk at least one block), ZeRO stage,
    recomputation, sequence parallelism — in bf16 mixed precision."""
    out = []
    for mb, v, zero, rc, sp in itertools.product(micro_batch_sizes, virtual_stages, (0, 1, 2, 3),
                                                  ("none", "selective", "full"), (False, True)):
        m = per_dp // mb
        if per_dp % mb or (mesh["pp"] == 1 and v > 1) or mesh["pp"] * v > model.layers or m < mesh["pp"]:
            continue
        if (zero and mesh["dp"] * mesh["cp"] == 1) or (sp and mesh["tp"] == 1):
            continue
        out.append(Layout(**mesh, zero=zero, micro_batch=mb, micro_batches=m, recompute=rc,
                          precision="bf16", sp=sp, virtual_stages=v, cp_algorithm=cp_algorithm))
    return out


def table4_row(row, model, hw, **knobs):
    """The search's fastest layout that fits on the row's mesh, with its predicted MFU
    (`knobs` narrow `open_knobs`, e.g. virtual_stages=(1,))."""
    shape = dataclasses.replace(model, seq=row["seq"])
    mesh = {k: row[k] for k in ("dp", "pp", "cp", "tp")}
    best = None
    for lay in open_knobs(shape, mesh, row["per_dp"], cp_algorithm=row.get("cp_algorithm", "ring"), **knobs):
        mem = estimate_memory(shape, lay)["total"]
        if mem > hw.memory:
            continue
        t = step_time(shape, lay, hw)
        if best is None or t["total"] < best["time"]["total"]:
            best = {"layout": lay, "memory": mem, "time": t}
    if best is not None:
        best["mfu"] = row_mfu(shape, best["layout"], best["time"]["total"], row, hw)
    return best


def row_mfu(shape, layout, seconds, row, hw):
    """The MFU of a step of `seconds` on `layout`, over the row's GPUs."""
    return mfu(shape, layout.global_batch * shape.seq / seconds, row["gpus"] * hw.peak)


def reach(predicted, target, lo, hi, steps, middle=lambda lo, hi: (lo + hi) / 2):
    """The x in [lo, hi] where `predicted(x)`, growing with x, reaches `target` (bisection; a
    None prediction counts as too low)."""
    for _ in range(steps):
        mid = middle(lo, hi)
        got = predicted(mid)
        lo, hi = (mid, hi) if got is None or got < target else (lo, mid)
    return middle(lo, hi)


def fit_gemm_fraction(row, model, make_hw, lo=0.3, hi=1.0, steps=30):
    """The sustained GEMM fraction of peak at which the model predicts `row`'s measured MFU
    (bisection: predicted MFU grows with it), every other constant as `make_hw` sets it."""
    def predicted(fraction):
        got = table4_row(row, model, make_hw(**{GEMM: fraction}))
        return None if got is None else got["mfu"]
    return reach(predicted, row["mfu"], lo, hi, steps)


def reproduce_table4(model, make_hw, fit_on=0, rows=LLAMA3_TABLE4):
    """Fit the GEMM fraction on row `fit_on`, predict every row with it: (fraction, [(row,
    best, relative error)])."""
    frac = fit_gemm_fraction(rows[fit_on], model, make_hw)
    hw = make_hw(**{GEMM: frac})
    out = []
    for row in rows:
        best = table4_row(row, model, hw)
        out.append((row, best, None if best is None else best["mfu"] / row["mfu"] - 1))
    return frac, out


def attention_rate_needed(row, best, model, hw, steps=60):
    """The attention FLOP/s (on the FLOPs the kernel runs, as `hw.attention` counts them) at
    which the model predicts `row`'s measured MFU with `best`'s layout: a bisection that
    re-times the step at each rate (the predicted MFU grows with it)."""
    shape, lay = dataclasses.replace(model, seq=row["seq"]), best["layout"]

    def predicted(rate):
        return row_mfu(shape, lay, step_time(shape, lay, dataclasses.replace(hw, attention=rate))["total"], row, hw)
    return reach(predicted, row["mfu"], hw.attention / 100, hw.attention * 100, steps,
                 middle=lambda lo, hi: math.sqrt(lo * hi))


def causal_discounted(row, model):
    """`row`'s measured MFU in this model's count (PaLM's: 12·h·s of attention per token and
    block) if Meta had credited causal attention only half (6·h·s): the same tokens per
    second, more FLOPs credited."""
    shape = dataclasses.replace(model, seq=row["seq"])
    palm = flops_per_token(shape)[0]
    return row["mfu"] * palm / (palm - 6 * shape.layers * shape.hidden * shape.seq)


def near_ties(rows, band):
    """The fitting rows within `band` (relative) of the fastest, and what separates them:
    {field: sorted values} for the knobs that differ, and those all of them share."""
    fitting = [r for r in rows if r["fits"]]
    best = fitting[0]["time"]["total"]
    group = [r for r in fitting if r["time"]["total"] <= best * (1 + band)]
    fields = ("dp", "pp", "cp", "tp", "virtual_stages", "zero", "recompute", "sp", "micro_batch")
    values = {f: sorted({getattr(r["layout"], f) for r in group}, key=lambda x: (str(type(x)), x)) for f in fields}
    return group, {f: v for f, v in values.items() if len(v) > 1}, {f: v[0] for f, v in values.items() if len(v) == 1}
