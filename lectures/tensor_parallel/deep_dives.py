"""The appendix page of lecture 04: its deep dives, each a section function that main() calls
inside `with deep_dive(...)` (dropout and random numbers under TP; asynchronous tensor
parallelism), with the rank functions and helpers only they use."""
import copy
import warnings
from statistics import mean

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lectures.model.roofline import threads
from lectures.tensor_parallel.async_tp import (SequenceParallelMLP, all_gather_matmul, counting, matmul_reduce_scatter,
                                               without_overlap)
from lectures.tensor_parallel.demos import _seeded, rank0
from lectures.tensor_parallel.figures import async_tp_figure, dropout_mask_figure
from lectures.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from lectures.tensor_parallel.ops import _all_gather, _reduce_scatter, _split, shard_checks, traced
from lectures.tensor_parallel.rng import TPRandom, dropout, keep_mask
from util import device, figure, note, published, quiet, see, settings, span, spawn, table


# =========================================================================================
# 1. Dropout and random numbers under TP (lectures/tensor_parallel/rng.py)
# =========================================================================================

def dropout_and_random_numbers():
    dropout_two_kinds_of_activation()   # replicated masks must agree, split masks must not
    dropout_two_streams_measured()      # four ways of drawing masks on 2 ranks, and DTensor's
    dropout_under_recomputation()       # why a mask should be a function of a key, not of a state
    dropout_exact_one_process()         # the single-process mask, and what it costs


def dropout_two_kinds_of_activation():
    note("""
        ## Dropout and random numbers
        Lecture 01's GPT has no dropout, but the models tensor parallelism was built for had it:
        the original Transformer dropped each sub-layer's output with $P_{drop} = 0.1$, and
        megatron-core's `TransformerConfig` still defaults to `hidden_dropout = attention_dropout = 0.1`.
        Under tensor parallelism a dropout mask meets two kinds of activation:

        - **replicated**, whole on every rank: the residual stream after g's all-reduce
          (without SP). Its mask must be the *same* on every rank. If it is not, every rank adds a
          different $y \\odot m_r$ to its copy of the residual stream, and the copies silently stop
          being copies: different LayerNorm inputs, different gradients for the weights every rank
          holds, no error anywhere.
        - **split**, a shard per rank: the attention probabilities of this rank's heads, a
          column-parallel layer's output, and with SP the residual stream's sequence shard. Its
          mask must *differ* from rank to rank. Drawn from the same generator state everywhere,
          every shard gets the same pattern: masks repeated across heads or positions, which no
          single process would draw.

        Two independent masks with drop probability $p$ agree on a fraction $p^2 + (1-p)^2$ of
        their elements (both dropped or both kept); two identical masks on all of them.

        Megatron-LM keeps two CUDA generator states (and a third for MoE experts).
        `model_parallel_cuda_manual_seed(seed)`
        seeds the default one with `seed` on every tensor-parallel rank and adds a tracked
        "model-parallel" state seeded with `seed + 2718 + tp_rank`. Dropout of a split activation
        runs inside `get_cuda_rng_tracker().fork()`, which swaps the tracked state in and back
        out: the attention-probability dropout does, and with sequence parallelism the whole
        `TransformerBlock` runs inside the fork (its hidden dropout then acts on sequence shards).
        Without SP the hidden dropout (`bias_dropout_add`) uses the default state, alike on every
        rank. Data-parallel replicas see different samples, so sharing masks across them does
        no harm.
    """)
    see("https://arxiv.org/abs/1706.03762", "Vaswani et al. 2017, Attention Is All You Need (section 5.4, residual dropout)")
    see("https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/tensor_parallel/random.py",
        "Megatron-LM: megatron/core/tensor_parallel/random.py (model_parallel_cuda_manual_seed, CudaRNGStatesTracker, CheckpointFunction)")
    see("https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/transformer/dot_product_attention.py",
        "Megatron-LM: megatron/core/transformer/dot_product_attention.py (attention dropout inside fork() unless SP)")
    see("https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/transformer/transformer_block.py",
        "Megatron-LM: megatron/core/transformer/transformer_block.py (with SP the whole block runs inside fork())")
    note("""
        Ours keeps the two streams but no generator state: a mask is a *function of a key*
        (seed, stream, step, site, and for the split stream the rank), drawn from a fresh
        generator seeded with a hash of the key. That is the idea of counter-based generators
        such as Philox (the one behind PyTorch's CUDA dropout): the numbers for a given key and
        position are computed, not read from a state that moves on. `one_process` keys draw
        the whole tensor's mask from the shared seed and keep this rank's slice.
    """)
    see("https://doi.org/10.1145/2063384.2063405", "Salmon et al. 2011, Parallel Random Numbers: As Easy as 1, 2, 3 (Philox)")
    see(TPRandom)
    see(dropout)


def dropout_two_streams_measured():
    p, steps, n = 0.3, 4, 2
    expected = p ** 2 + (1 - p) ** 2
    every = {}
    for setup in DROPOUT_SETUPS:
        run = spawn(dropout_block, n, setup=setup, p=p, steps=steps, name=f"dropout masks under TP: {setup}, {n} ranks")
        if not run.skipped:     # skipped under torchrun with fewer ranks: the page says so, here and below
            every[setup] = run.returns
    note(f"""
        The demo: an MLP block split over {n} ranks (LayerNorm, column-parallel `fc_in`, GELU,
        dropout of the hidden, which is **split**; row-parallel `fc_out`, dropout of its output
        after g, which is **replicated**; the residual add and a final LayerNorm), float64,
        $p = {p}$, trained {steps} SGD steps from the same weights. Megatron drops the attention
        probabilities rather than the MLP hidden; both are split activations, and the tests
        check both. Four ways to draw the masks: torch's default generator seeded with
        `seed + rank` on each rank, or with the same seed everywhere; `TPRandom`'s two streams;
        its one-process masks.
    """)
    if every:
        dropout_masks_four_ways(every, p, steps, n, expected)
    dropout_under_sp(p, n, expected)
    dropout_under_dtensor(p, n, expected)


def dropout_masks_four_ways(every, p, steps, n, expected):
    """The four ways of drawing masks (`dropout_block`'s returns per setup): agreement, drift, verdicts."""
    runs = {setup: returns[0] for setup, returns in every.items()}
    rows = []
    for setup, r in runs.items():
        vs = r.get("vs one process")
        rows.append([setup, mean(r["hidden agreement"]), mean(r["residual agreement"]), r["spread"]["block output"],
                     r["spread"]["LayerNorm weights"], r["spread"]["row-parallel bias"],
                     "—" if vs is None else vs])
    table(rows, header=["masks from", f"split hidden: agree (independent {expected:.2f})", "replicated output: agree",
                        "max |rank 0 − rank 1|: output", "… LayerNorm weights", "… row-parallel bias", "max |Δ| vs one process"],
          caption=f"{n} ranks, float64, p = {p}, {steps} SGD steps; agree = fraction of mask elements equal on the two "
                  "ranks (mean over the steps); max |rank 0 − rank 1| of replicated tensors after the steps; "
                  "vs one process: outputs and parameters")
    figure(dropout_mask_figure({setup: [r["first masks"] for r in returns] for setup, returns in every.items()}), caption="the masks of step 1, batch element 0, on each rank (dark = dropped): "
           "the split hidden's shard (positions × this rank's hidden units) and the replicated output (positions × features)")
    note("\n".join(f"- {_dropout_verdict(setup, r, expected, steps)}" for setup, r in runs.items()))
    right = [setup for setup, r in runs.items() if r["spread"]["block output"] == 0
             and abs(mean(r["hidden agreement"]) - expected) < 0.1]
    note(f"Both right: {', '.join(right) or 'none of them'}." if len(right) != len(runs) else "All four got both right.")


def dropout_under_sp(p, n, expected):
    sp = rank0(spawn(sp_residual_dropout, n, p=p, name=f"dropout of the residual's sequence shards under SP, {n} ranks"))
    if sp is None:
        return
    table([[k, a] for k, a in sp["agreement"].items()],
          header=["residual-stream masks under SP, from", f"agree across the {n} ranks (independent {expected:.2f})"],
          caption=f"{n} ranks, each holding a shard of the positions (4 × {8 // n} × 16), p = {p}")
    rep = sp["agreement"]["replicated stream (TP without SP)"]
    note(f"""
        **Under sequence parallelism** the residual stream is split too, by positions, so its
        dropout must move to the split stream, as Megatron's SP does by running the whole block
        inside `fork()`. Kept on the replicated stream, as TP without SP keeps it, every rank's
        shard gets the same mask ({rep:.0%} agreement): position $i$ of every shard dropped
        alike, a pattern one process never draws. The split stream's masks agree on
        {sp['agreement']["split stream (Megatron's fork under SP)"]:.0%} (independent: {expected:.0%}),
        and the one-process stream's, gathered along the sequence,
        {"equal" if sp["one process equal"] else "do NOT equal"} the single process's whole mask.
    """)


def dropout_under_dtensor(p, n, expected):
    dt = rank0(spawn(dtensor_dropout_agreement, n, p=p, name=f"DTensor dropout of a sharded tensor, {n} ranks"))
    if dt is None:
        return
    note(f"""
        **DTensor** (torch 2.13) keeps the two kinds apart with offsets into the default
        generator's Philox stream, which every rank must seed alike: for a random op on a
        DTensor, its `OffsetBasedRNGTracker` starts each shard at offset (shard index × shard
        size), gives replicas of a shard the same offset, and then moves every rank's offset on
        by the whole tensor's size. It exists only for CUDA-like devices: on CPU it refuses to
        be built, and the dispatcher runs the op on each rank's local shard with that rank's
        own default generator. Measured here ({device().type}, tracker:
        `{dt['tracker'].replace('NoneType', 'none')}`): `F.dropout` of a DTensor sharded on its
        last dimension gave the {n} shards masks that agree on {dt['agreement']:.0%} of their
        elements (independent masks: {expected:.0%}){"; DTensor warned: *" + dt['warnings'][0] + "*"
        if dt['warnings'] else ""}. {_dtensor_dropout_verdict(dt['agreement'], expected)}
    """)


def _dtensor_dropout_verdict(agreement, expected):
    if agreement == 1:
        return ("Every shard got the same mask: the *same seed* failure of the table above, "
                "because this course's launcher seeds every rank's default generator alike. A "
                "split activation must not get that.")
    if abs(agreement - expected) < 0.05:
        return "The shards' masks are as independent as they should be."
    return "The shards' masks are neither identical nor independent."


def _dropout_verdict(setup, r, expected, steps):
    """One sentence per way of drawing masks, its words chosen by the measured numbers."""
    hidden, residual, spread = mean(r["hidden agreement"]), mean(r["residual agreement"]), r["spread"]
    split = ("as independent masks do" if abs(hidden - expected) < 0.1 else
             "identical on both ranks" if hidden == 1 else "not as independent masks do")
    copies = ("and the copies stayed identical" if spread["block output"] == 0 else
              f"and after {steps} steps the copies of the block output differ by up to {spread['block output']:.2g}, "
              f"the LayerNorm weights by {spread['LayerNorm weights']:.2g}")
    exact = "" if "vs one process" not in r else f"; {r['vs one process']:.1g} from one process"
    return (f"**{setup}**: the split hidden's masks agree on {hidden:.0%} ({split}); the replicated "
            f"output's on {residual:.0%}, {copies}{exact}.")


def recompute_gradients(source, p=0.3, b=3, s=5, h=8):
    """max |gradient with torch.utils.checkpoint − gradient without| of a dropout MLP whose
    mask comes from `source`."""
    from torch.utils.checkpoint import checkpoint
    with torch.random.fork_rng():   # the lecture's own random state is left as it was
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).double()
        x = torch.randn(b, s, h, dtype=torch.float64)
        grads = []
        for recompute in (False, True):
            torch.manual_seed(1)   # each run starts from the same generator states
            if source == "TPRandom key":
                streams = TPRandom.single_process(7)
                drop = lambda t: dropout(t, p, streams.split("hidden"))
            elif source == "torch's default generator":
                drop = lambda t: F.dropout(t, p)
            else:   # a generator of its own, as a stream tracker keeps one
                g = torch.Generator().manual_seed(7)
                drop = lambda t: t * (torch.rand(t.shape, generator=g, dtype=t.dtype) >= p) / (1 - p)
            forward = lambda t: mlp[2](drop(mlp[1](mlp[0](t))))
            xi = x.clone().requires_grad_(True)
            y = checkpoint(forward, xi, use_reentrant=False) if recompute else forward(xi)
            mlp.zero_grad()
            y.pow(2).sum().backward()
            grads.append([q.grad.clone() for q in mlp.parameters()] + [xi.grad])
    return max((a - c).abs().max().item() for a, c in zip(*grads))


def dropout_under_recomputation():
    note("""
        **Recomputation.** Activation checkpointing (lecture 01) runs a layer's forward again
        during backward, and the recomputed forward must draw the same masks as the first one.
        `torch.utils.checkpoint` saves the CPU generator's state and those of the devices its
        inputs live on, and restores them before recomputing; it knows nothing of other
        generators. That is why Megatron's own `CheckpointFunction` saves and restores the
        tracker's states too. A mask that is a function of a key needs neither. Measured, for
        one dropout MLP with and without `checkpoint`:
    """)
    sources = ("TPRandom key", "torch's default generator", "a torch.Generator of its own")
    rows = [[src, recompute_gradients(src)] for src in sources]
    table(rows, header=["mask drawn from", "max |gradient with checkpoint − without|"],
          caption="float64, one process; torch.utils.checkpoint(use_reentrant=False)")
    bad = [r[0] for r in rows if r[1] > 0]
    note(f"""
        {"With " + " and ".join(bad) + " the gradients change: the recomputation drew the next mask, "
         "and backward used a mask the forward never saw, silently." if bad else
         "No source changed the gradients here."}
    """)


def dropout_exact_one_process():
    from util.measure import compare, machine, timing_ranks
    n = timing_ranks(2)
    shape = (4, 128, 512) if settings.quick else (8, 256, 1024)
    t = rank0(spawn(mask_draw_times, n, shape=shape, repeats=5 if settings.quick else 9,
                    name=f"dropout mask draw times, {n} ranks"))
    measured = ""       # the demo was skipped under torchrun with fewer ranks: the page says so
    if t is not None:
        split, whole = t["split stream: this shard"], t["one-process mask: whole tensor, sliced"]
        numel = shape[0] * shape[1] * shape[2]
        table([["split stream: this shard", numel, split.ms()],
               ["one-process mask: whole tensor, sliced", numel * n, whole.ms()]],
              header=["this rank's mask", "random numbers drawn per rank", "time, median (IQR)"],
              caption=f"a shard of {shape} per rank, {machine(n)}, one thread each")
        measured = f"; measured: {compare(whole, split, 'whole-and-slice', 'drawing the shard alone')}"
    note(f"""
        **Exactly one process?** The split stream's masks are as random as one process's but
        not the same numbers, so a tensor-parallel run with dropout no longer equals one process
        bit for bit (Megatron says as much beside its attention dropout: one iteration's output
        depends on the number of partitions, only its average does not). One-process masks
        restore the equality (the tests use them to check TP and SP with dropout against one
        process) at the price of drawing the whole tensor on every rank: {n}× the random numbers
        of its shard, a price that grows with tp. Drawing costs time in proportion to the
        count, so the two should differ by about {n}×{measured}.
    """)


# --- what its ranks run ----------------------------------------------------------------------

DROPOUT_SETUPS = ("per-rank seeds", "same seed", "two streams", "one-process masks")


def _default_generator_masks(seed):
    """Masks from torch's default generator seeded with `seed`: code that never thought about TP."""
    torch.manual_seed(seed)
    return lambda kind, site, shape, p: torch.rand(shape, dtype=torch.float64) >= p


def _mask_source(setup, seed, group):
    """(the mask function (kind, site, shape, p) -> keep mask, the TPRandom or None) of a setup.
    kind is "replicated" (the activation is whole on every rank) or "split" (this rank's shard)."""
    if setup in ("per-rank seeds", "same seed"):
        return _default_generator_masks(seed + (dist.get_rank(group) if setup == "per-rank seeds" else 0)), None
    streams = TPRandom(seed, group) if group is not None else TPRandom.single_process(seed)
    split = (streams.split if setup == "two streams" else
             lambda *site: streams.one_process(-1, *site))   # the hidden is split on its last dim

    def masks(kind, site, shape, p):
        return keep_mask(streams.replicated(*site) if kind == "replicated" else split(*site), shape, p)
    return masks, streams


def _dropout_mlp(h):
    torch.manual_seed(0)   # the same full weights on every rank
    return nn.ModuleDict(dict(ln=nn.LayerNorm(h), fc_in=nn.Linear(h, 4 * h), fc_out=nn.Linear(4 * h, h),
                              ln_f=nn.LayerNorm(h))).double()


def _train_dropout_mlp(m, masks, streams, p, steps, lr, b, s, group=None):
    """SGD on out = LayerNorm(x + drop(fc_out(drop(GELU(fc_in(LayerNorm(x))))))) vs a target: the
    hidden's mask is split (fc_in is column-parallel), the output's replicated (after g).
    Returns the last output, each step's two keep-masks, and the agreement of each across ranks."""
    data = torch.Generator().manual_seed(1)   # not the default generator: some setups draw masks from it
    x = torch.randn(b, s, m["ln"].weight.numel(), dtype=torch.float64, generator=data)
    target = torch.randn(x.shape, dtype=torch.float64, generator=data)
    out, log = None, []
    for step in range(steps):
        hidden = F.gelu(m["fc_in"](m["ln"](x)))
        keep_h = masks("split", ("mlp hidden", 0), hidden.shape, p)
        y = m["fc_out"](hidden * keep_h / (1 - p))
        keep_r = masks("replicated", ("residual", 0), y.shape, p)
        out = m["ln_f"](x + y * keep_r / (1 - p))
        F.mse_loss(out, target).backward()
        with torch.no_grad():
            for q in m.parameters():
                q -= lr * q.grad
                q.grad = None
        log.append({"hidden": keep_h, "residual": keep_r} if group is None else
                   {"hidden": keep_h, "residual": keep_r, "hidden agreement": _agreement(keep_h, group),
                    "residual agreement": _agreement(keep_r, group)})
        if streams is not None:
            streams.next_step()
    return out.detach(), log


def _gather(t, group):
    """Every rank's `t`, gathered through this rank's collective device (the GPU under NCCL)."""
    on = t.to(device()).contiguous()
    every = [torch.empty_like(on) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, on, group=group)
    return [e.to(t.device) for e in every]


def _agreement(keep, group):
    """The fraction of elements where another rank's mask equals rank 0's (mean over the others)."""
    every = _gather(keep.to(torch.uint8), group)
    return sum((e == every[0]).double().mean().item() for e in every[1:]) / (len(every) - 1)


def _largest_spread(t, group):
    """max over ranks of |t on that rank − t on rank 0|: 0 for a tensor that is truly replicated."""
    every = _gather(t.detach(), group)
    return max((e - every[0]).abs().max().item() for e in every)


def dropout_block(rank, world_size, setup, p=0.3, steps=4, b=4, s=8, h=16, lr=0.5, seed=1234):
    """The dropout MLP split over the ranks (tensor parallelism, no SP) and trained `steps` SGD
    steps with masks drawn the `setup` way: how often the ranks' masks agree, how far apart the
    replicated tensors end up, and (one-process masks) the difference from one process."""
    group = dist.group.WORLD
    full = _dropout_mlp(h)
    m = nn.ModuleDict(dict(ln=copy.deepcopy(full["ln"]), fc_in=ColumnParallelLinear.from_full(full["fc_in"], group),
                           fc_out=RowParallelLinear.from_full(full["fc_out"], group, input_is_parallel=True),
                           ln_f=copy.deepcopy(full["ln_f"])))
    masks, streams = _mask_source(setup, seed, group)
    out, log = _train_dropout_mlp(m, masks, streams, p, steps, lr, b, s, group)
    result = {"hidden agreement": [r["hidden agreement"] for r in log],
              "residual agreement": [r["residual agreement"] for r in log],
              "first masks": {k: log[0][k][0].tolist() for k in ("hidden", "residual")},
              "spread": {"block output": _largest_spread(out, group),
                         "LayerNorm weights": _largest_spread(torch.cat([m["ln"].weight, m["ln_f"].weight]), group),
                         "row-parallel bias": _largest_spread(m["fc_out"].bias, group)}}
    if setup == "one-process masks":   # the same run in one process, with the whole masks
        ref_masks, ref_streams = _mask_source(setup, seed, None)
        ref_out, _ = _train_dropout_mlp(full, ref_masks, ref_streams, p, steps, lr, b, s)
        ours = {"fc_in": m["fc_in"].full_tensors(), "fc_out": m["fc_out"].full_tensors()}
        result["vs one process"] = max(
            [(out - ref_out).abs().max().item()] +
            [(ours[name][k] - getattr(full[name], k)).abs().max().item() for name in ours for k in ("weight", "bias")] +
            [(getattr(m[n], k) - getattr(full[n], k)).abs().max().item() for n in ("ln", "ln_f") for k in ("weight", "bias")])
    return result


def sp_residual_dropout(rank, world_size, p=0.3, b=4, s=8, h=16, seed=1234):
    """Dropout of the residual stream under sequence parallelism, where each rank holds a shard of
    the positions (b, s/t, h): the keep-masks drawn from the replicated stream (what TP without SP
    uses for this activation), from the split stream, and from the one-process stream, against
    the single process's whole mask. Returns how often each agrees across the ranks, and whether
    the gathered one-process masks are the single process's mask."""
    group = dist.group.WORLD
    streams, shard = TPRandom(seed, group), (b, s // world_size, h)
    masks = {"replicated stream (TP without SP)": keep_mask(streams.replicated("residual"), shard, p),
             "split stream (Megatron's fork under SP)": keep_mask(streams.split("residual"), shard, p),
             "one-process stream": keep_mask(streams.one_process(1, "residual"), shard, p)}
    whole = keep_mask(TPRandom.single_process(seed).one_process(1, "residual"), (b, s, h), p)
    gathered = torch.cat(_gather(masks["one-process stream"], group), dim=1)
    return {"agreement": {k: _agreement(m, group) for k, m in masks.items()},
            "one process equal": bool(torch.equal(gathered, whole))}


def dtensor_dropout_agreement(rank, world_size, p=0.3, shape=(4, 8, 64)):
    """F.dropout of a DTensor sharded on its last dim, on this machine's device: how often the
    ranks' shard masks agree, and what DTensor said about it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor import _random as dtensor_random
    mesh = init_device_mesh(device().type, (world_size,))
    ones = distribute_tensor(torch.ones(shape, device=device()), mesh, [Shard(len(shape) - 1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dropped = F.dropout(ones, p)
    return {"agreement": _agreement(dropped.to_local() != 0, dist.group.WORLD),
            "tracker": type(dtensor_random._rng_tracker).__name__,
            "warnings": sorted({str(w.message) for w in caught})}


def mask_draw_times(rank, world_size, shape, p=0.1, repeats=9):
    """Drawing this rank's mask of a split activation (`shape` is the shard): from the split
    stream (the shard only) vs one_process (the whole tensor, then a slice)."""
    from util.measure import measure_side_by_side
    streams = TPRandom(0, dist.group.WORLD)
    draws = {"split stream: this shard": lambda: keep_mask(streams.split("hidden"), shape, p),
             "one-process mask: whole tensor, sliced": lambda: keep_mask(streams.one_process(-1, "hidden"), shape, p)}
    with threads(1):   # one core per rank
        return measure_side_by_side(draws, warmup=2, repeats=repeats)


# =========================================================================================
# 2. Asynchronous tensor parallelism (lectures/tensor_parallel/async_tp.py)
# =========================================================================================

def async_tensor_parallelism():
    b, s, h = (4, 256, 64) if settings.quick else (8, 512, 64)   # matmuls and collectives take similar times
    async_tp_idea()                         # why the SP collectives block, and the ring that hides them
    r = async_tp_timeline(b, s, h)          # measured: partial matmuls beside transfers, and the bytes
    if r is not None:                       # None: skipped under torchrun with fewer ranks, as the timing would be
        async_tp_timing(b, s, h, r["bytes"], r["overlap"])   # measured: plain vs decomposed, fwd + bwd
    async_tp_pytorch(r)                     # PyTorch's version, and where it runs


def async_tp_idea():
    note("""
        ## Hiding the collectives: asynchronous tensor parallelism
        Under sequence parallelism a column-parallel layer starts with an all-gather of its input
        along the sequence, and a row-parallel layer ends with a reduce-scatter of its output.
        Neither can run beside its matmul: the matmul needs the whole gathered input, and the
        reduce-scatter needs the whole product. The core computes, then waits, then computes.

        But a matmul works position by position: output position $j$ needs only input position
        $j$. Wang et al. (2022) use this to split each pair into $t$ steps on a ring of $t$
        ranks. **All-gather + matmul:** at step $k$ rank $r$ multiplies the chunk of positions it
        holds (rank $r-k$'s) while it sends that chunk on to $r+1$ and receives $r-k-1$'s. After
        $t$ steps it has multiplied every chunk, and the all-gather happened along the way.
        **Matmul + reduce-scatter:** at step $k$ rank $r$ computes its term for chunk $r-k-1$, adds
        the running sum that arrived from $r-1$, and passes it on. After $t$ steps it holds the
        full sum for its own chunk. Every transfer has a partial matmul beside it. Each op makes
        $t-1$ transfers of one chunk, $(t-1)/t$ of the tensor per rank: the bytes of a ring
        all-gather or reduce-scatter. The matmul is split into $t$ pieces of $s/t$ positions.
    """)
    see("https://doi.org/10.1145/3567955.3567959", "Wang et al. 2022, Overlap Communication with Dependent "
        "Computation via Decomposition in Large Deep Learning Models (ASPLOS 2023)")
    see(all_gather_matmul)
    see(matmul_reduce_scatter)
    note("""
        Backward uses the same two ops the other way round. The input gradient of all-gather +
        matmul, $dY\\,W$, is a sum over ranks that each rank needs only for its own positions: a
        matmul + reduce-scatter. The input gradient of matmul + reduce-scatter needs $dY$ for
        every position: an all-gather + matmul, whose gathered $dY$ also gives the row-parallel
        weight gradient. The column-parallel weight gradient $dY^T X$ needs the gathered input,
        which a plain all-gather + matmul would keep from forward to backward, giving back part of
        sequence parallelism's saving ($(1 - 1/t)\\,bsh$ more per layer). `AllGatherMatmul`
        keeps only its slice, as `ColumnParallelLinear` and Megatron-LM do, and re-gathers it in
        backward in a second ring, adding each chunk's share $dY_c^T X_c$ while the next chunk
        travels: one more ring of the same bytes, and 5 ops per MLP instead of 4
        (`lectures/tensor_parallel/async_tp.py`).
        `tests/test_async_tp.py` checks outputs, all gradients and parameters after SGD and AdamW
        steps against the plain collectives and one process (1–4 ranks, float64). It also checks
        the counts: $t-1$ sends and $t$ partial matmuls per op; and
        `tests/test_async_tp_nccl.py` runs the rings under NCCL's point-to-point rules (one Work
        per batch, a receive's data only after its wait), with ranks as threads.
    """)


def async_tp_timeline(b, s, h):
    run = spawn(async_tp_trace, 2, b=b, s=s, h=h, name="async TP: one SP MLP forward traced, 2 ranks")
    if run.skipped:
        return None
    r = run.returns[0]
    figure(async_tp_figure(run.spans), caption=f"one SP MLP forward (b = {b}, s = {s}, h = {h}), measured on 2 "
           "ranks. A transfer's bar ends when wait() returned (gloo's send/receive reports no earlier "
           "completion), so it may have finished sooner; red is time spent waiting for it")
    overlap = r["overlap"] = async_tp_overlap(run.spans)
    note(f"""
        In the plain forward, rank 0 spent {overlap['plain collectives'] * 1e3:.2f} ms in the two
        collectives and ran no matmul during them. In the decomposed forward it spent
        {overlap['posting'] * 1e3:.2f} ms *posting* its transfers (handing them to gloo takes
        the rank's own time), then had a transfer in
        flight for {overlap['in flight'] * 1e3:.2f} ms, of which {overlap['hidden'] * 1e3:.2f} ms
        overlapped a partial matmul, and it waited {overlap['waiting'] * 1e3:.2f} ms in all.
        {same_output(r['max |plain - decomposed|'])}
    """)
    t, act = 2, r["activation bytes"]
    ops = {"decomposed": 5, "plain": 4}    # the decomposed layer re-gathers its input in backward
    formula = {name: n * (t - 1) / t * act for name, n in ops.items()}
    table([[name, v["sends"] if name == "decomposed" else "—", v["counted"] if name == "decomposed" else "—",
            v["written"], formula[name]] for name, v in r["bytes"].items()],
          header=["forward + backward", "sends (counted)", "bytes (counted)", "bytes on sockets (measured)",
                  "ring formula"],
          caption=f"the SP MLP on 2 ranks, b = {b}, s = {s}, h = {h}, float32: one activation is {act} bytes; "
                  "the ring formula is (t−1)/t of one activation per op: 5 ops decomposed (the backward "
                  "re-gathers the kept slice), 4 plain (it keeps the gathered input)")
    dec, plain = r["bytes"]["decomposed"], r["bytes"]["plain"]
    ring = formula["decomposed"]
    more = plain["written"] / dec["written"]
    why = (": gloo's reduce-scatter is an all-reduce followed by a slice, as the sequence-parallelism "
           "section measured") if more > 1.1 else ""
    note(f"""
        The decomposed ops {"sent exactly" if dec["counted"] == ring else "did not send exactly"} the ring formula's
        bytes, in {dec['sends']} transfers of one chunk; what reached the sockets is
        {dec['written'] / dec['counted']:.3f}× that (gloo's headers, and the all-reduce of the
        bias gradient). The plain collectives, one op fewer, wrote {more:.2f}× the decomposed ring's bytes{why}.
    """)
    return r


def async_tp_timing(b, s, h, sent, traced):
    from util.measure import machine, timing_ranks
    ranks = timing_ranks(2)
    times = spawn(async_tp_times, ranks, b=b, s=s, h=h, repeats=5 if settings.quick else 21,
                  name=f"async TP: SP MLP step times, {ranks} ranks").returns[0]
    table([[k, v.ms()] for k, v in times.items()], header=["SP MLP forward + backward", "median (IQR)"],
          caption=f"b = {b}, s = {s}, h = {h}, float32, {machine(ranks)}, one thread each")
    async_tp_verdict(times, sent["plain"]["written"] / sent["decomposed"]["written"], traced, ranks)


def same_output(diff):
    if diff == 0:
        return ("The two outputs are bit for bit equal: with 2 ranks each sum has two terms, and "
                "float addition of two numbers does not depend on their order.")
    return (f"The two outputs differ by at most {diff:.1e} (float32: the ring adds the partial sums "
            "in another order than gloo's reduce-scatter).")


def async_tp_overlap(spans):
    """Rank 0's seconds in the plain forward's collectives, and in the decomposed forward: a
    transfer in flight, the part of it beside a partial matmul, and the waiting."""
    mine = [sp for sp in spans if sp["rank"] == 0]
    total = lambda label: sum(sp["end"] - sp["start"] for sp in mine if sp["label"] == label)
    matmuls = [sp for sp in mine if sp["label"] == "partial matmul"]
    hidden = sum(max(0.0, min(tr["end"], mm["end"]) - max(tr["start"], mm["start"]))
                 for tr in mine if tr["label"] == "transfer (posted → done)" for mm in matmuls)
    return {"plain collectives": total("all-gather") + total("reduce-scatter"),
            "posting": total("posting a transfer"),
            "in flight": total("transfer (posted → done)"), "hidden": hidden,
            "waiting": total("waiting for the transfer")}


def async_tp_verdict(times, more_bytes, traced, ranks):
    """The timing table's conclusion, worded from the measurements: the overlap's effect is the
    ring against itself without overlap; the ring's sends against gloo's collectives apart; the
    reasons from the traced forward (`traced`: async_tp_overlap's seconds)."""
    from util.measure import compare, spreads_overlap, usable_cores
    plain, dec, serial = times["plain"], times["decomposed"], times["decomposed, no overlap"]
    mm, coll = times["matmuls alone"], times["collectives alone"]
    most, gain = min(mm.median, coll.median), serial.median - dec.median   # most: perfect overlap's win
    if spreads_overlap(dec, serial):
        how = "Here the overlap won nothing this machine can measure."
    elif gain > 0:
        how = (f"Here it won {gain * 1e3:.2f} ms of the {most * 1e3:.2f} ms it could"
               + (", about all of it." if gain >= 0.8 * most else "."))
    else:
        how = "Here the overlapped ring was slower than the same ring waiting at once."
    rest = plain.median - mm.median - coll.median
    gloo = (f" (gloo's reduce-scatter is an all-reduce and a slice: the plain step wrote {more_bytes:.2f}× "
            "the ring's bytes, above)" if more_bytes > 1.1 and serial.median < plain.median
            and not spreads_overlap(serial, plain) else "")
    spare = ("; with one core per rank, that copying competes with the matmul it should hide behind"
             if usable_cores() <= ranks else "")
    note(f"""
        Three runs separate two effects. **The overlap**, the ring against the same ring whose
        transfers are waited for at once: {compare(dec, serial, 'overlapped', 'not overlapped')}.
        Apart, the matmuls take {mm.median * 1e3:.2f} ms and the plain collectives
        {coll.median * 1e3:.2f} ms, so perfect overlap could win at most {most * 1e3:.2f} ms
        {f"(the plain step's other {rest * 1e3:.2f} ms are neither: GELU, autograd's bookkeeping, the bias gradient's all-reduce)" if rest > 0 else ""}.
        {how} **The collectives**, the ring without overlap against gloo's all-gather and
        reduce-scatter: {compare(serial, plain, 'ring sends', 'plain collectives')}{gloo}.
        Together, decomposed against plain: {compare(dec, plain, 'decomposed', 'plain')}.

        What limits the overlap on this machine, from the traced forward above: posting the
        transfers took {traced['posting'] * 1e3:.2f} ms of the rank's own time, and of
        {traced['in flight'] * 1e3:.2f} ms in flight only {traced['hidden'] * 1e3:.2f} ms ran beside a
        partial matmul. gloo moves the bytes with the CPU, its I/O thread and the kernel's TCP
        stack copying them{spare}. The ring also cuts each matmul into $t$ shorter ones, each
        paying its own call overhead. On GPUs a copy engine or NVLink moves the bytes while the
        tensor cores compute, which is where PyTorch reports its gains (below).
    """)


def async_tp_pytorch(traced):
    """PyTorch's async TP; `traced` is the traced forward's rank 0, which also tried PyTorch's op on
    CPU (None where that demo was skipped)."""
    import torch.distributed as torch_dist
    tried = "" if traced is None else ": called on CPU tensors here, the op " + (
        "runs" if traced["pytorch on CPU"] is None else f"raises `{traced['pytorch on CPU']}`")
    note(f"""
        **PyTorch's async TP** is the same decomposition: `torch.ops.symm_mem.fused_all_gather_matmul`
        and `fused_matmul_reduce_scatter` (in `torch.distributed._symmetric_memory`). Each rank
        puts its chunk in *symmetric memory*, a buffer every GPU of the group can read directly.
        At step $k$ rank $r$ copies rank $r+k$'s chunk from it and multiplies, alternating two CUDA
        streams; there is no send/receive pair and no ring. The reduce-scatter side works the
        same way in reverse: each rank writes its term for another rank's chunk into its buffer,
        that rank copies it, and each rank sums its $t$ terms at the end.

        You need not call these ops yourself: with `torch._inductor.config._micro_pipeline_tp = True`,
        a pass of `torch.compile` replaces an all-gather followed by matmuls, or a matmul followed
        by a reduce-scatter, with them. torchtitan has an `enable_async_tensor_parallel` option
        for it (its section of the config has moved between versions), and refuses it without
        compiling the model. Ours is the simplest form of the decomposition: one direction
        around the ring, one send and one receive per step.
        In torch {torch.__version__} the ops have CUDA kernels only{tried}. The compiler pass also returns early when NCCL
        is not available ({"it is" if torch_dist.is_nccl_available() else "it is not, in this build"}).
    """)
    published("""
        "up to ~29% forward pass speedup and ~8% E2E speedup in Llama3 8B, and up to ~20% forward
        pass speedup and ~8% E2E speedup in Llama3 70B" (64 H100s, 8 per host with NVSwitch, bf16,
        torch.compile; the post notes these H100s are HBM2e parts at a lower power limit).
        torchtitan's later benchmark (June 2025): 1.09× tokens/s on Llama3 70B with 256 H100s
        (597.3 → 652.4 tokens/s).
    """, "https://discuss.pytorch.org/t/distributed-w-torchtitan-introducing-async-tensor-parallelism-in-pytorch/209487",
        "PyTorch, \"[Distributed w/ TorchTitan] Introducing Async Tensor Parallelism in PyTorch\" (2024)")
    note("""
        This CPU cannot show that gain: gloo moves every byte with the same cores that run the
        partial matmuls, where an H100 moves them over NVLink with copy engines while its tensor
        cores compute.
    """)
    see("https://github.com/pytorch/torchtitan/blob/main/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md",
        "torchtitan benchmark: async TP on Llama3 70B, 256 H100s (June 2025)")
    see("https://github.com/pytorch/torchtitan", "torchtitan")


# --- what its ranks run ----------------------------------------------------------------------

def _async_tp_mlp(h, group, seed):
    """An MLP (h -> 4h -> h) split both ways for the async-TP demos: the plain SP layers and the ring."""
    _seeded(seed)
    fc_in, fc_out = nn.Linear(h, 4 * h).to(device()), nn.Linear(4 * h, h).to(device())
    return {"plain": SequenceParallelMLP(fc_in, fc_out, group, decomposed=False),
            "decomposed": SequenceParallelMLP(fc_in, fc_out, group, decomposed=True)}


def async_tp_trace(rank, world_size, b, s, h):
    """One SP MLP forward, plain then decomposed, traced for the timeline; what one forward +
    backward of each sends (our count and the bytes written to sockets); and what PyTorch's own
    fused ops do on CPU tensors."""
    from util.measure import bytes_sent
    group = dist.group.WORLD
    mlps = _async_tp_mlp(h, group, seed=4)
    x = _split(torch.randn(b, s, h, device=device()), 1, group).requires_grad_(True)
    out = {"bytes": {}, "activation bytes": b * s * h * 4}
    with shard_checks(False):   # count and trace what the algorithms need, not the safety check
        for name, mlp in mlps.items():
            with quiet():
                mlp(x).sum().backward()   # warm-up
            dist.barrier()                # both ranks start the traced forward together
            with traced(), span(f"{name} forward"):
                out[name] = mlp(x).detach()
        for name, mlp in mlps.items():
            with counting() as c, bytes_sent() as sent:
                mlp(x).sum().backward()
            out["bytes"][name] = {"sends": c.sends, "counted": c.bytes, "written": sent.bytes}
    out["max |plain - decomposed|"] = (out.pop("plain") - out.pop("decomposed")).abs().max().item()
    out["pytorch on CPU"] = _fused_ops_on_cpu(group)
    return out


def _fused_ops_on_cpu(group):
    """Call PyTorch's async-TP op on CPU tensors: None if it ran, else the error's first sentence."""
    import torch.distributed._symmetric_memory  # noqa: F401  (defines torch.ops.symm_mem)
    x, w = torch.randn(2, 2, 4), torch.randn(4, 3)
    try:
        torch.ops.symm_mem.fused_all_gather_matmul(x, [w], 1, group.group_name)
    except Exception as e:   # what it raises is the lesson; the page quotes it
        return f"{type(e).__name__}: {str(e).split('. ')[0]}"
    return None


def async_tp_times(rank, world_size, b, s, h, repeats=9):
    """SP MLP forward + backward, plain vs decomposed vs the same ring with each transfer waited
    for at once (no overlap), interleaved (util.measure), with two ingredients timed apart: this
    rank's matmuls on the whole sequence with no communication, and the plain step's four
    collectives with no matmul."""
    from util.measure import measure_side_by_side
    group = dist.group.WORLD
    mlps = _async_tp_mlp(h, group, seed=5)
    x, G = (torch.randn(b, s, h, device=device()) for _ in range(2))
    xs, Gs = _split(x, 1, group).requires_grad_(True), _split(G, 1, group)
    steps = {name: (lambda m=m: (m(xs) * Gs).sum().backward()) for name, m in mlps.items()}
    ring = steps["decomposed"]

    def ring_without_overlap():
        with without_overlap():
            ring()
    steps["decomposed, no overlap"] = ring_without_overlap
    m, xf, whole = mlps["plain"], x.clone().requires_grad_(True), torch.randn(b, s, h, device=device())
    steps["matmuls alone"] = lambda: (F.linear(F.gelu(F.linear(xf, m.w_in, m.b_in)), m.w_out) * G).sum().backward()
    steps["collectives alone"] = lambda: (_all_gather(xs.detach(), 1, group), _reduce_scatter(whole, 1, group),
                                          _all_gather(Gs, 1, group), _reduce_scatter(whole, 1, group))
    with threads(1), quiet(), shard_checks(False):   # one core per rank
        return measure_side_by_side(steps, warmup=2, repeats=repeats)
