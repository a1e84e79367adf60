"""What each rank runs in lecture 06's demos, and the one-process references they are checked
against; the lecture launches them with spawn() and narrates what they return."""
import functools
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lectures.context_parallel.blocks import SegmentAttention
from lectures.context_parallel.moe import ExpertParallelMoE, MoE, RankCapacityMoE, expert_owners, moe_gpt
from lectures.context_parallel.ring import RingTransfer, released, ring_attention, tracing
from lectures.data_parallel.overlap import agreed_wait, measured_against_model, release_core
from util.measure import Timing, measure, measure_side_by_side
from lectures.context_parallel.sharding import (causal_work, group_info, layout_segments, sequence_positions,
                                                shard_sequence, striped_positions)
from lectures.context_parallel.variants import ATTENTION, SeqToHeads, context_parallel_gpt, ulysses_attention
from lectures.model.gpt import GPT, GPTConfig, batch, loss_fn
from lectures.model.memory import saved_bytes
from lectures.model.roofline import threads
from util import device, new_group, settings, span_at


# =========================================================================================
# Only attention needs the other ranks: the GPT with its sequence split, against one process
# =========================================================================================

def gpt_config(dtype="float32", seq_len=32):
    return GPTConfig(seq_len=seq_len, dtype=dtype)


def cp_gpt_gradients(rank, world_size, attention="ring", layout="zigzag", batch_size=4, dtype="float64"):
    """One forward/backward of lecture 01's GPT with the sequence split over the ranks. Each rank's
    loss is its tokens' share of the mean; gradients are summed over ranks (the parameters are
    replicated, as in data parallelism). Returns the loss, local logits and the summed gradients."""
    cfg = gpt_config(dtype)
    model = context_parallel_gpt(GPT(cfg).to(device()), attention=attention, layout=layout)
    tokens, targets = batch(cfg, batch_size, step=0)
    pos = sequence_positions(cfg.seq_len, rank, world_size, layout).to(device())
    logits = model(tokens.to(device())[:, pos], positions=pos)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.to(device())[:, pos].reshape(-1),
                           reduction="sum") / targets.numel()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[name] = p.grad.cpu()
    return {"loss": total.item(), "logits": logits.detach().cpu(), "positions": pos.cpu(), "grads": grads}


def reference_gpt_gradients(batch_size=4, dtype="float64"):
    cfg = gpt_config(dtype)
    model = GPT(cfg)
    tokens, targets = batch(cfg, batch_size, step=0)
    logits = model(tokens)
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))
    loss.backward()
    return {"loss": loss.item(), "logits": logits.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()}}


def activation_memory(rank, world_size, seq_lens, layout="zigzag", batch_size=2):
    """Bytes a context-parallel GPT step keeps for backward on this rank, for each sequence length.
    One rank = the whole sequence (ring attention on a group of one is plain block attention)."""
    rows = {}
    for S in seq_lens:
        cfg = gpt_config("float32", seq_len=S)
        model = context_parallel_gpt(GPT(cfg).to(device()), layout=layout)
        tokens = torch.randint(cfg.vocab_size, (batch_size, S), generator=torch.Generator().manual_seed(S))
        pos = sequence_positions(S, rank, world_size, layout).to(device())
        _, held = saved_bytes(lambda: model(tokens.to(device())[:, pos], positions=pos), model.parameters())
        rows[S] = held
    return rows


# =========================================================================================
# Ring attention: against one process, and its timeline
# =========================================================================================

def attention_inputs(seq_len, heads, head_dim=8, batch=2, dtype="float64", seed=0):
    """q, k, v and an upstream gradient for the whole sequence, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq_len, head_dim, generator=g, dtype=getattr(torch, dtype))
            for _ in range(4)]


def reference_attention(q, k, v, dout, causal):
    """PyTorch's scaled_dot_product_attention on the whole sequence, and its gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def attention_shards(rank, world_size, cases, seq_len, heads, head_dim=8, batch=2, dtype="float64"):
    """Run each (variant, layout, causal) in `cases` on this rank's shard; returns the local
    output and the local gradients of q, k, v (to be unsharded and compared with one process)."""
    q, k, v, dout = (t.to(device()) for t in attention_inputs(seq_len, heads, head_dim, batch, dtype))
    results = {}
    for variant, layout, causal in cases:
        ql, kl, vl = (shard_sequence(t, rank, world_size, 2, layout).requires_grad_() for t in (q, k, v))
        out = ATTENTION[variant](ql, kl, vl, causal=causal, layout=layout)
        out.backward(shard_sequence(dout, rank, world_size, 2, layout))
        results[variant, layout, causal] = [t.detach().cpu() for t in (out, ql.grad, kl.grad, vl.grad)]
    return results


def attention_in_subgroups(rank, world_size, seq_len, heads, layout="zigzag"):
    """Ring attention on two independent rings at once (ranks split in halves), as a context-
    parallel group inside a larger job would run; returns the local output and gradients."""
    half = world_size // 2
    groups = [new_group(list(range(half))), new_group(list(range(half, world_size)))]
    group, cp_rank = groups[rank // half], rank % half
    q, k, v, dout = attention_inputs(seq_len, heads, seed=rank // half)
    ql, kl, vl = (shard_sequence(t, cp_rank, half, 2, layout).requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, causal=True, group=group, layout=layout)
    out.backward(shard_sequence(dout, cp_rank, half, 2, layout))
    return [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)]


def attention_sizes():
    """Shapes for the timings: (sequence, heads, head dim)."""
    return (512, 4, 32) if settings.quick else (1024, 4, 32)


def _inputs(seq_len, heads, head_dim, rank, world_size, layout, dtype="float32", batch=1):
    full = attention_inputs(seq_len, heads, head_dim, batch, dtype)
    return [shard_sequence(t, rank, world_size, 2, layout).to(device()).contiguous() for t in full]


def fwd_bwd(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fn(q, k, v).backward(dout)


def ring_trace(rank, world_size, seq_len, heads, head_dim, layout="contiguous", causal=False, repeats=5):
    """Ring attention forward+backward with its compute blocks, waits and transfers traced: the last
    repetition goes on the timeline; medians over the repetitions are returned, per rank."""
    q, k, v, dout = _inputs(seq_len, heads, head_dim, rank, world_size, layout)
    fn = functools.partial(ring_attention, causal=causal, layout=layout)
    fwd_bwd(fn, q, k, v, dout)                                       # warm-up
    per = []
    for i in range(repeats):
        dist.barrier()
        with tracing() as events:
            t0 = time.perf_counter()
            fwd_bwd(fn, q, k, v, dout)
            wall = time.perf_counter() - t0
        total = lambda pred: sum(e - s for label, s, e, _ in events if pred(label))
        per.append({"wall": wall, "compute": total(lambda l: l.startswith("block compute")),
                    "forward_compute": total(lambda l: l == "block compute"),
                    "waiting": total(lambda l: l == "waiting"),
                    "work": sum(w for label, _, _, w in events if label.startswith("block compute"))})
    for label, start, end, _ in events:
        span_at(label, start, end)
    med = lambda key: sorted(p[key] for p in per)[len(per) // 2]
    return dict({key: med(key) for key in per[0]}, samples={key: [p[key] for p in per] for key in per[0]})


def transfer_alone(rank, world_size, seq_len, heads, head_dim):
    """One hop of a K/V block (every rank sends its block to the next and receives from the
    previous) with nothing else to do: what one transfer of the ring costs alone."""
    from util.measure import measure
    group, n, r = group_info(None)
    kv = torch.randn(1, heads, seq_len // world_size, 2 * head_dim, device=device())
    t = measure(lambda: RingTransfer(kv, kv.shape, group, n, r, 0, "alone").wait(), warmup=2, repeats=9)
    return t


def released_ring(rank, world_size, seq_len=16, heads=128, head_dim=512, reps=7, min_wait=0.004, real_shape=None):
    """Ring attention's forward in release-the-core mode (`ring.released`): each block's compute is
    followed by a timed wait as long as one K/V hop; without overlap every hop is waited for as
    soon as it is posted. Few positions and many wide heads: K/V blocks of megabytes, small real
    matmuls. "compute" sums the traced blocks of the run without overlap, "comm" times the hops
    alone, "waiting" what the overlapped run still waited for its hops. Returns the timings read
    against the model (pattern "consume": the rank's own block needs no transfer), and with
    `real_shape` (sequence, heads, head dim) under "real" the forward at that shape with its real
    compute and no stand-in, each hop waited for at once or overlapped, timed taking turns."""
    group, n, r = group_info(None)
    q, k, v, _ = _inputs(seq_len, heads, head_dim, rank, world_size, "contiguous")
    kv = torch.cat([k, v], dim=-1)
    send = lambda: [RingTransfer(kv, kv.shape, group, n, r, 0, "alone").wait() for _ in range(n - 1)]
    wait = agreed_wait(measure(send, warmup=2, repeats=reps).median, max(1, n - 1), min_wait)
    blocks, waiting = [], []

    def run(overlap):
        with torch.no_grad(), released(wait, overlap), tracing() as events:
            ring_attention(q, k, v)
        total = lambda name: sum(e - s for label, s, e, _ in events if label == name)
        (waiting if overlap else blocks).append(total("waiting" if overlap else "block compute"))

    t = measure_side_by_side({"comm": send, "sequential": lambda: run(False), "overlapped": lambda: run(True)},
                             warmup=1, repeats=reps)
    t["compute"], t["waiting"] = Timing(blocks[1:]), Timing(waiting[1:])   # "waiting": hops not hidden
    out = {**measured_against_model(t, n, "consume", first_held=True), "block": (seq_len // n, heads, head_dim),
           "kv_bytes": kv.numel() * kv.element_size()}
    if real_shape:
        rq, rk, rv, _ = _inputs(*real_shape, rank, world_size, "contiguous")

        def plain(overlap):
            with torch.no_grad(), released(0.0, overlap):
                ring_attention(rq, rk, rv)
        out["real"] = measure_side_by_side({"sequential": lambda: plain(False), "overlapped": lambda: plain(True)},
                                           warmup=1, repeats=reps)
        out["real_shape"] = tuple(real_shape)
    return out


# =========================================================================================
# Load balance: counted work, each rank's share timed alone, the whole ring under both layouts
# =========================================================================================

def ring_work(seq_len, world_size, layout):
    """Score entries each rank computes in causal attention (masked entries skipped), per layout."""
    pos = (lambda r: striped_positions(seq_len, r, world_size)) if layout == "striped" else \
        (lambda r: sequence_positions(seq_len, r, world_size, layout))
    return [causal_work(pos(r)) for r in range(world_size)]


LAYOUTS = ("contiguous", "zigzag", "striped")


def rank_compute(rank, world_size, seq_len, heads, head_dim, ranks, layouts=("contiguous", "zigzag"), repeats=7):
    """Each ring rank's attention work, measured alone: for every layout and every rank r of `ranks`,
    forward+backward of r's queries over all keys with exactly the segment pairs the ring computes
    over its steps (the same kernel calls), minus the communication. One rank's share at a time, in
    one process, all shares taking turns: so the ranks do not compete for the cores, and drift on a
    shared machine hits every share alike. One thread: a second thread on a shared core mostly
    waits, and its stalls dominated the shares (a 1-ms share once timed at 750 ms). Returns
    {(layout, r): Timing}."""
    with threads(1):
        return _rank_compute(seq_len, heads, head_dim, ranks, layouts, repeats)


def _rank_compute(seq_len, heads, head_dim, ranks, layouts, repeats):
    from util.measure import measure_side_by_side
    q, k, v, dout = (t.to(device()) for t in attention_inputs(seq_len, heads, head_dim, 1, "float32"))
    fns = {}
    for layout in layouts:
        lengths = [len(sequence_positions(seq_len, r, ranks, layout)) for r in range(ranks)]
        segs = layout_segments(lengths, layout)
        starts = [sum(lengths[:j]) for j in range(ranks)]
        ksegs = [(starts[j] + a, ln, g) for j in range(ranks) for a, ln, g in segs[j]]
        kall, vall = (torch.cat([shard_sequence(t, j, ranks, 2, layout) for j in range(ranks)], 2) for t in (k, v))
        for r in range(ranks):
            ql, dl = (shard_sequence(t, r, ranks, 2, layout).contiguous() for t in (q, dout))

            def share(ql=ql, dl=dl, qsegs=segs[r]):
                qq, kk, vv = (t.detach().requires_grad_() for t in (ql, kall, vall))
                SegmentAttention.apply(qq, kk, vv, qsegs, ksegs, True).backward(dl)
            fns[layout, r] = share
    return measure_side_by_side(fns, warmup=1, repeats=repeats)


def share_spread(counted, timings):
    """Whether timed shares can be read against counted work: the timed busiest/idlest ratio (of
    the lower quartiles, the least disturbed repetitions) and None, or None and the reason it is
    noise. A timed spread above the counted one, by more than the shares' own q3/q1, cannot be
    the work (fixed costs only narrow it), and a share whose q3/q1 exceeds 3 was mostly waiting
    for the cores."""
    low = [t.q1 for t in timings]
    noisy = [i for i, t in enumerate(timings) if t.q3 > 3 * t.q1]
    if noisy:
        return None, (f"rank {noisy[0]}'s repetitions range over {timings[noisy[0]].q3 / timings[noisy[0]].q1:.1f}× "
                      "between quartiles")
    timed, work = max(low) / min(low), max(counted) / min(counted)
    slack = max(1.05, max(t.q3 / t.q1 for t in timings))          # the shares' own repeat-to-repeat spread
    if timed > work * slack:
        return None, f"the timed spread ({timed:.2f}×) exceeds the counted one ({work:.2f}×), which work cannot do"
    return timed, None


def balance_ceiling(seq_len, n):
    """The most zig-zag can gain over contiguous chunks by balance alone: the busiest rank's
    counted work under each. Per ring step the busiest contiguous rank does a full block (half a
    block at step 0), a zig-zag rank half a block: (n − ½)/(n/2) = (2n − 1)/n, below 2 for any n."""
    return max(ring_work(seq_len, n, "contiguous")) / max(ring_work(seq_len, n, "zigzag"))


def whole_diagonal_ceiling(n):
    """The ceiling if a kernel computed every diagonal block whole (masked half included):
    contiguous n blocks against zig-zag's 2n + 1 quarter-blocks, 4n/(2n + 1)."""
    return 4 * n / (2 * n + 1)


def layout_steps(rank, world_size, seq_len, heads, head_dim, repeats=7):
    """The causal ring's forward+backward under each layout, the two taking turns repetition by
    repetition (so a busy machine's drift hits both alike), each repetition the slowest rank's."""
    from util.measure import measure_side_by_side
    fns = {}
    for layout in ("contiguous", "zigzag"):
        q, k, v, dout = _inputs(seq_len, heads, head_dim, rank, world_size, layout)
        fns[layout] = functools.partial(fwd_bwd, functools.partial(ring_attention, causal=True, layout=layout),
                                        q, k, v, dout)
    return measure_side_by_side(fns, warmup=1, repeats=repeats)


# =========================================================================================
# All-gather and Ulysses: time, bytes and memory of the variants
# =========================================================================================

def compare_variants(rank, world_size, seq_len, heads, head_dim, variants, causal=True, repeats=7):
    """For each attention variant on the same shapes: forward+backward time (slowest rank), the bytes
    this rank sent, and the bytes autograd saved for backward on this rank."""
    from util.measure import bytes_sent, measure
    out = {}
    for name in variants:
        layout = "zigzag" if causal and name != "ulysses" else "contiguous"
        q, k, v, dout = _inputs(seq_len, heads, head_dim, rank, world_size, layout)
        fn = functools.partial(ATTENTION[name], causal=causal, layout=layout)
        fwd_bwd(fn, q, k, v, dout)
        dist.barrier()
        with bytes_sent() as sent:
            _, held = saved_bytes(lambda: fn(*(t.detach().requires_grad_() for t in (q, k, v))))
        dist.barrier()
        with bytes_sent() as sent_all:
            fwd_bwd(fn, q, k, v, dout)
        timing = measure(lambda: fwd_bwd(fn, q, k, v, dout), warmup=1, repeats=repeats)
        out[name] = {"time": timing, "held": held, "sent_forward": sent.bytes, "sent": sent_all.bytes,
                     "shard_bytes": q.numel() * q.element_size()}
    return out


def gqa_bytes(rank, world_size, seq_len, heads, kv_heads, head_dim):
    """Bytes this rank sent in one causal forward+backward of each variant, with K/V of `kv_heads`
    heads (grouped-query attention) and with K/V repeated to all `heads` before the call."""
    from util.measure import bytes_sent
    out = {}
    for kvh in (kv_heads, heads):
        q, _, _, dout = _inputs(seq_len, heads, head_dim, rank, world_size, "zigzag")
        _, k, v, _ = _inputs(seq_len, kvh, head_dim, rank, world_size, "zigzag")
        for name in ATTENTION:
            fn = functools.partial(ATTENTION[name], causal=True, layout="zigzag")
            dist.barrier()
            with bytes_sent() as sent:
                fwd_bwd(fn, q, k, v, dout)
            out[name, kvh] = sent.bytes
    return out


def ulysses_layouts(rank, world_size, heads=4, positions_per_rank=2):
    """What each rank holds before and after Ulysses' first all-to-all, each entry the rank that
    held it before: (heads × its positions) in, (its heads × every position) out."""
    x = torch.full((1, heads, positions_per_rank, 1), float(rank))
    y = SeqToHeads.apply(x, [positions_per_rank] * world_size, None)
    return {"before": x[0, :, :, 0].tolist(), "after": y[0, :, :, 0].tolist()}


def ulysses_refusal(rank, world_size, heads):
    """Ulysses with fewer heads than ranks: the error it gives."""
    q = torch.randn(1, heads, 4, 8, device=device())
    try:
        ulysses_attention(q, q, q)
    except ValueError as e:
        return str(e)
    return None


# =========================================================================================
# The mixture of experts, trained
# =========================================================================================

def moe_layer(d_model=16, d_ff=24, n_experts=6, top_k=2, capacity_factor=1.0, seed=0, dtype="float64", n_shared=0):
    torch.manual_seed(seed)
    return MoE(d_model, d_ff, n_experts, top_k, capacity_factor, n_shared=n_shared).to(getattr(torch, dtype))


AUX_WEIGHT = 0.1       # the balance loss's weight α (the deep dive shows why)
BIAS_STEP = 0.01       # γ, the speed of DeepSeek-V3's bias update (balancing without a loss)
_TRAINING = {}         # the balancing runs of mixture_of_experts(), reported again by its deep dive


def train_moe_gpt(rank, world_size, configs, steps, n_experts=4, top_k=1, capacity_factor=1.25,
                  batch_size=16, lr=3e-3):
    """Rank r trains its own copy with configs[r] = {"aux": balance-loss weight, "bias": DeepSeek-V3's
    bias step γ (0 = off), "z": router z-loss weight} (independent runs side by side, no
    communication). Returns per-step loss, balance loss, z-loss, the mean largest router logit, expert load
    and dropped fraction."""
    cfg = gpt_config("float32")
    model = moe_gpt(cfg, n_experts, top_k, capacity_factor).to(device())
    alpha, gamma, zeta = (configs[rank].get(key, 0.0) for key in ("aux", "bias", "z"))
    moes = [b.mlp for b in model.blocks]
    logits = []                                # every router's mean largest logit, this step
    for m in moes:
        m.bias_update = gamma
        m.router.register_forward_hook(lambda mod, inp, out: logits.append(out.detach().amax(-1).mean().item()))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    log = {"loss": [], "aux": [], "z": [], "max_logit": [], "max_load": [], "dropped": [], "tokens_per_expert": None}
    for step in range(steps):
        tokens, targets = batch(cfg, batch_size, step)
        logits.clear()
        loss = loss_fn(model(tokens.to(device())), targets.to(device()))
        aux = sum(m.aux_loss for m in moes) / len(moes)
        z = sum(m.z_loss for m in moes) / len(moes)
        (loss + alpha * aux + zeta * z).backward()
        opt.step()
        opt.zero_grad()
        if gamma:
            for m in moes:
                m.update_bias()
        counts = torch.tensor([m.stats["tokens_per_expert"] for m in moes], dtype=torch.float64)
        log["loss"].append(loss.item())
        log["aux"].append(aux.item())
        log["z"].append(z.item())
        log["max_logit"].append(sum(logits) / len(logits))
        log["max_load"].append((counts.max(1).values / counts.mean(1)).mean().item())
        log["dropped"].append(sum(m.stats["dropped"] for m in moes) / sum(m.stats["assignments"] for m in moes))
    log["tokens_per_expert"] = [m.stats["tokens_per_expert"] for m in moes]
    return log


# =========================================================================================
# Expert parallelism, against one process
# =========================================================================================

def moe_inputs(world_size, tokens_per_rank, d_model, seed=0, dtype="float64"):
    """Every rank's tokens (a list, rank order) and a fixed upstream weight for the loss."""
    g = torch.Generator().manual_seed(100 + seed)
    xs = [torch.randn(n, d_model, generator=g, dtype=getattr(torch, dtype)) for n in tokens_per_rank]
    ws = [torch.randn(n, d_model, generator=g, dtype=getattr(torch, dtype)) for n in tokens_per_rank]
    return xs, ws


def moe_reference(layer_kw, tokens_per_rank, seed=0, capacity="global"):
    """One process, all ranks' tokens together: outputs, gradients, which choices were dropped.
    capacity="rank": each rank's tokens as a batch of their own (GShard's groups), the balance
    loss averaged over the groups: what `RankCapacityMoE` must equal."""
    moe = moe_layer(**layer_kw)
    xs, ws = moe_inputs(len(tokens_per_rank), tokens_per_rank, moe.d_model, seed)
    x = torch.cat(xs).requires_grad_()
    groups = [x] if capacity == "global" else torch.split(x, tokens_per_rank)
    outs, auxes, stats = [], [], []
    for part in groups:
        outs.append(moe(part))
        auxes.append(moe.aux_loss)
        stats.append(moe.stats)
    out, aux = torch.cat(outs), sum(auxes) / len(auxes)
    dropped = sum(st["dropped"] for st in stats)
    loss = (out * torch.cat(ws)).sum() + AUX_WEIGHT * aux
    loss.backward()
    return {"out": out.detach(), "x_grad": x.grad, "aux": aux.item(), "keep": torch.cat([st["keep"] for st in stats]),
            "dropped": dropped, "stats": stats[0] if len(stats) == 1 else stats,    # per group under capacity="rank"
            "grads": {n: p.grad for n, p in moe.named_parameters()}}


def expert_parallel_check(rank, world_size, layer_kw, tokens_per_rank, seed=0, capacity="global"):
    """The expert-parallel layer on this rank's tokens, capacity counted over all ranks' tokens
    (`ExpertParallelMoE`) or per rank (`RankCapacityMoE`); returns what moe_reference returns, local."""
    moe = moe_layer(**layer_kw)
    ep = {"global": ExpertParallelMoE, "rank": RankCapacityMoE}[capacity].from_full(moe).to(device())
    xs, ws = moe_inputs(world_size, tokens_per_rank, moe.d_model, seed)
    x = xs[rank].to(device()).requires_grad_()
    out = ep(x)
    loss = (out * ws[rank].to(device())).sum() + AUX_WEIGHT * ep.aux_loss
    loss.backward()
    aux = ep.aux_loss.detach().clone()
    dist.all_reduce(aux)
    grads = {}
    for name, p in [("router.weight", ep.router.weight)] + [("shared." + n, p) for n, p in ep.shared.named_parameters()]:
        dist.all_reduce(p.grad)                          # replicated (router, shared experts): sum the gradients
        grads[name] = p.grad.cpu()
    counts, starts = expert_owners(moe.n_experts, world_size)
    for j, expert in enumerate(ep.experts):
        for name, p in expert.named_parameters():
            grads[f"experts.{starts[rank] + j}.{name}"] = p.grad.cpu()
    return {"out": out.detach().cpu(), "x_grad": x.grad.cpu(), "aux": aux.item(),
            "keep": ep.stats["keep"].cpu(), "stats": {k: v for k, v in ep.stats.items() if k != "keep"},
            "grads": grads}


def expert_parallel_traffic(rank, world_size, tokens, d_model, d_ff, n_experts, top_k, capacity_factor,
                            repeats=5):
    """The expert-parallel layer on `tokens` tokens per rank: equality with the one-process layer on
    all ranks' tokens, the bytes this rank sent in one forward+backward, rows sent and received, time."""
    from util.measure import bytes_sent, measure
    kw = dict(d_model=d_model, d_ff=d_ff, n_experts=n_experts, top_k=top_k, capacity_factor=capacity_factor,
              dtype="float32")
    check = expert_parallel_check(rank, world_size, dict(kw, dtype="float64"), [tokens] * world_size)
    moe = moe_layer(**kw)
    ep = ExpertParallelMoE.from_full(moe).to(device())
    xs, ws = moe_inputs(world_size, [tokens] * world_size, d_model, dtype="float32")
    x, w = xs[rank].to(device()), ws[rank].to(device())

    def step():
        xx = x.detach().requires_grad_()
        ((ep(xx) * w).sum() + AUX_WEIGHT * ep.aux_loss).backward()
    step()
    dist.barrier()
    with bytes_sent() as sent:
        step()
    stats = {k: v for k, v in ep.stats.items() if k != "keep"}
    t = measure(step, warmup=1, repeats=repeats)
    return {"check": check, "sent": sent.bytes, "stats": stats, "time": t}


def capacity_scopes(rank, world_size, layer_kw, tokens):
    """The same tokens through expert parallelism three ways: capacity over all ranks' tokens
    (ExpertParallelMoE), per rank (RankCapacityMoE), and dropless (no capacity)."""
    return {"all ranks": expert_parallel_check(rank, world_size, layer_kw, [tokens] * world_size),
            "per rank": expert_parallel_check(rank, world_size, layer_kw, [tokens] * world_size, capacity="rank"),
            "dropless": expert_parallel_check(rank, world_size, dict(layer_kw, capacity_factor=None),
                                              [tokens] * world_size)}


def ep_dp_groups(world_size, ep):
    """Rank r = dp_index · ep + ep_index: the expert-parallel groups (consecutive ranks, which
    split the experts) and the expert-data-parallel groups (ranks holding the same experts)."""
    ep_groups = [list(range(i * ep, (i + 1) * ep)) for i in range(world_size // ep)]
    edp_groups = [list(range(j, world_size, ep)) for j in range(ep)]
    return ep_groups, edp_groups


def expert_data_parallel(rank, world_size, ep, layer_kw, tokens):
    """EP inside DP: experts split over `ep` ranks, replicated over world_size/ep data-parallel
    copies, every rank with its own tokens. After backward, gradients are summed (a) the right way
    (router over all ranks = DP×EP, each expert over its expert-data-parallel group) and (b) two
    wrong ways; returns each way's gradients, named as in the one-process MoE, and the bytes each
    right reduction sent."""
    from util.measure import bytes_sent
    ep_groups, edp_groups = ep_dp_groups(world_size, ep)
    pgs = {tuple(g): new_group(g) for g in ep_groups + edp_groups}
    my_ep = next(g for g in ep_groups if rank in g)
    my_edp = next(g for g in edp_groups if rank in g)
    moe = moe_layer(**layer_kw)
    layer = ExpertParallelMoE.from_full(moe, group=pgs[tuple(my_ep)])
    xs, ws = moe_inputs(world_size, [tokens] * world_size, moe.d_model)
    (layer(xs[rank]) * ws[rank]).sum().backward()
    counts, starts = expert_owners(moe.n_experts, ep)
    first = starts[my_ep.index(rank)]
    names = {f"experts.{first + j}.{n}": p for j, e in enumerate(layer.experts) for n, p in e.named_parameters()}
    names["router.weight"] = layer.router.weight
    local = {n: p.grad.clone() for n, p in names.items()}

    def reduced(router_group, expert_group):
        out = {}
        for n, g in local.items():
            g = g.clone()
            group = router_group if n == "router.weight" else expert_group
            dist.all_reduce(g, group=None if group is None else pgs[tuple(group)])
            out[n] = g.cpu()
        return out
    dist.barrier()
    with bytes_sent() as router_bytes:
        dist.all_reduce(local["router.weight"].clone())
    with bytes_sent() as expert_bytes:
        for n, g in local.items():
            if n != "router.weight":
                dist.all_reduce(g.clone(), group=pgs[tuple(my_edp)])
    return {"right": reduced(None, my_edp), "router over EP only": reduced(my_ep, my_edp),
            "experts over all ranks": reduced(None, None),
            "bytes": {"router": router_bytes.bytes, "experts": expert_bytes.bytes},
            "numel": {"router": local["router.weight"].numel(),
                      "experts": sum(g.numel() for n, g in local.items() if n != "router.weight")}}
