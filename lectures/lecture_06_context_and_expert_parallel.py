"""Context parallelism and expert parallelism: split the sequence, split the experts

Long sequences: every rank holds a slice of the sequence for the whole model, and only attention
needs the other ranks' keys and values — passed around a ring (ring attention), gathered at once,
or swapped for a split of the heads (DeepSpeed-Ulysses). Mixtures of experts: a router sends each
token to a few expert MLPs, and the experts live on different ranks (expert parallelism), with
tokens dispatched and combined by all-to-all. Every version is checked against one process.

The building blocks live in modules: `lectures/attention_blocks.py` (attention on segments, its
block backward), `lectures/sequence_layout.py` (contiguous and zig-zag shards),
`lectures/ring_attention.py`, `lectures/context_parallel.py` (all-gather, Ulysses, the GPT swap,
the CPU shim for PyTorch's `context_parallel`) and `lectures/moe.py`. This file narrates them,
and holds the demos the ranks run.
"""
import functools
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lectures.attention import merge_attention as merge_partials
from lectures.attention_blocks import _block_backward, pair_kind
from lectures.attention_blocks import (SegmentAttention, _block_forward, full_attention,  # noqa: F401
                                       segments_backward, segments_forward)  # noqa: F401
from lectures.context_parallel import (ATTENTION, AllGatherAttention, SeqToHeads, context_parallel_gpt,
                                       install_cpu_context_parallel_shim, ulysses_attention)
from lectures.context_parallel import HeadsToSeq, allgather_attention  # noqa: F401
from lectures.gpt import GPT, GPTConfig, batch, loss_fn
from lectures.memory import saved_bytes
from lectures.moe import AllToAll, ExpertParallelMoE, MoE, balance_loss, expert_owners, moe_gpt, route
from lectures.moe import Expert, capacity, positions_in_expert, slot_counts  # noqa: F401
from lectures.ring_attention import RingAttention, RingTransfer, ring_attention, tracing
from lectures.sequence_layout import (group_info, layout_segments, sequence_positions, shard_sequence, split_sizes,
                                      unshard_sequence, zigzag_shard, zigzag_unshard)
from lectures.sequence_layout import contiguous_shard, zigzag_chunks  # noqa: F401
from util import device, figure, note, see, settings, span_at, spawn, table, timeline

# =========================================================================================
# Demos: context-parallel attention and the GPT, against one process
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


def pytorch_context_parallel_attention(rank, world_size, seq_len, heads, head_dim=8, batch=2,
                                       dtype="float64", causal=True):
    """PyTorch's `context_parallel` around plain F.scaled_dot_product_attention (its head-tail
    layout, i.e. zig-zag, for causal); returns this rank's output and gradients in our zig-zag
    order, to compare with one process exactly as our own variants are."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    if device().type == "cpu":
        install_cpu_context_parallel_shim()
    mesh = init_device_mesh(device().type, (world_size,), mesh_dim_names=("cp",))
    q, k, v, dout = (t.to(device()) for t in attention_inputs(seq_len, heads, head_dim, batch, dtype))
    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
        ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)
        out.backward(dout)
    return [t.detach().cpu() for t in (out, ql.grad, kl.grad, vl.grad)]


def attention_in_subgroups(rank, world_size, seq_len, heads, layout="zigzag"):
    """Ring attention on two independent rings at once (ranks split in halves), as a context-
    parallel group inside a larger job would run; returns the local output and gradients."""
    half = world_size // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world_size)))]
    group, cp_rank = groups[rank // half], rank % half
    q, k, v, dout = attention_inputs(seq_len, heads, seed=rank // half)
    ql, kl, vl = (shard_sequence(t, cp_rank, half, 2, layout).requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, causal=True, group=group, layout=layout)
    out.backward(shard_sequence(dout, cp_rank, half, 2, layout))
    return [t.detach() for t in (out, ql.grad, kl.grad, vl.grad)]


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


# =========================================================================================
# Demos: the mixture of experts and expert parallelism, against one process
# =========================================================================================

def moe_layer(d_model=16, d_ff=24, n_experts=6, top_k=2, capacity_factor=1.0, seed=0, dtype="float64"):
    torch.manual_seed(seed)
    return MoE(d_model, d_ff, n_experts, top_k, capacity_factor).to(getattr(torch, dtype))


def moe_inputs(world_size, tokens_per_rank, d_model, seed=0, dtype="float64"):
    """Every rank's tokens (a list, rank order) and a fixed upstream weight for the loss."""
    g = torch.Generator().manual_seed(100 + seed)
    xs = [torch.randn(n, d_model, generator=g, dtype=getattr(torch, dtype)) for n in tokens_per_rank]
    ws = [torch.randn(n, d_model, generator=g, dtype=getattr(torch, dtype)) for n in tokens_per_rank]
    return xs, ws


AUX_WEIGHT = 0.1


def moe_reference(layer_kw, tokens_per_rank, seed=0):
    """One process, all ranks' tokens together: outputs, gradients, which choices were dropped."""
    moe = moe_layer(**layer_kw)
    xs, ws = moe_inputs(len(tokens_per_rank), tokens_per_rank, moe.d_model, seed)
    x = torch.cat(xs).requires_grad_()
    out = moe(x)
    loss = (out * torch.cat(ws)).sum() + AUX_WEIGHT * moe.aux_loss
    loss.backward()
    return {"out": out.detach(), "x_grad": x.grad, "aux": moe.aux_loss.item(), "keep": moe.stats["keep"],
            "stats": moe.stats, "grads": {n: p.grad for n, p in moe.named_parameters()}}


def expert_parallel_check(rank, world_size, layer_kw, tokens_per_rank, seed=0):
    """The expert-parallel layer on this rank's tokens; returns what moe_reference returns, local."""
    moe = moe_layer(**layer_kw)
    ep = ExpertParallelMoE.from_full(moe).to(device())
    xs, ws = moe_inputs(world_size, tokens_per_rank, moe.d_model, seed)
    x = xs[rank].to(device()).requires_grad_()
    out = ep(x)
    loss = (out * ws[rank].to(device())).sum() + AUX_WEIGHT * ep.aux_loss
    loss.backward()
    aux = ep.aux_loss.detach().clone()
    dist.all_reduce(aux)
    dist.all_reduce(ep.router.weight.grad)               # the router is replicated: sum its gradients
    counts, starts = expert_owners(moe.n_experts, world_size)
    grads = {"router.weight": ep.router.weight.grad.cpu()}
    for j, expert in enumerate(ep.experts):
        for name, p in expert.named_parameters():
            grads[f"experts.{starts[rank] + j}.{name}"] = p.grad.cpu()
    return {"out": out.detach().cpu(), "x_grad": x.grad.cpu(), "aux": aux.item(),
            "keep": ep.stats["keep"].cpu(), "stats": {k: v for k, v in ep.stats.items() if k != "keep"},
            "grads": grads}


# =========================================================================================
# Rank functions for the measurements
# =========================================================================================

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
                    "waiting": total(lambda l: l == "waiting"),
                    "work": sum(w for label, _, _, w in events if label.startswith("block compute"))})
    for label, start, end, _ in events:
        span_at(label, start, end)
    med = lambda key: sorted(p[key] for p in per)[len(per) // 2]
    return {key: med(key) for key in per[0]}


def transfer_alone(rank, world_size, seq_len, heads, head_dim):
    """One K/V block sent around the ring with nothing else to do: what the transfers cost alone."""
    from util.measure import measure
    group, n, r = group_info(None)
    kv = torch.randn(1, heads, seq_len // world_size, 2 * head_dim, device=device())
    t = measure(lambda: RingTransfer(kv, kv.shape, group, n, r, 0, "alone").wait(), warmup=2, repeats=9)
    return t


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


def ulysses_refusal(rank, world_size, heads):
    """Ulysses with fewer heads than ranks: the error it gives."""
    q = torch.randn(1, heads, 4, 8, device=device())
    try:
        ulysses_attention(q, q, q)
    except ValueError as e:
        return str(e)
    return None


def pytorch_vs_ours(rank, world_size, seq_len, heads, head_dim, repeats=7):
    """PyTorch's context_parallel (ring, head-tail layout) vs our zig-zag ring, same shapes, float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from util.measure import measure_side_by_side
    if device().type == "cpu":
        install_cpu_context_parallel_shim()
    mesh = init_device_mesh(device().type, (world_size,), mesh_dim_names=("cp",))
    full = [t.to(device()) for t in attention_inputs(seq_len, heads, head_dim, 1, "float32")]
    q, k, v, dout = (t.clone() for t in full)
    mine = [zigzag_shard(t, rank, world_size, 2) for t in full]
    run_theirs = lambda: fwd_bwd(functools.partial(F.scaled_dot_product_attention, is_causal=True), q, k, v, dout)
    run_ours = lambda: fwd_bwd(functools.partial(ring_attention, causal=True, layout="zigzag"), *mine)
    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers={q, k, v, dout}):
        # the two take turns, so drift on a busy machine hits both alike
        t = measure_side_by_side({"theirs": run_theirs, "ours": run_ours}, warmup=2, repeats=repeats)
        ql = q.detach().requires_grad_()
        their_out = F.scaled_dot_product_attention(ql, k, v, is_causal=True).detach()
    our_out = ring_attention(*mine[:3], causal=True, layout="zigzag")
    return {"theirs": t["theirs"], "ours": t["ours"], "same_layout": bool(torch.equal(q, mine[0])),
            "max_diff": (their_out - our_out).abs().max().item()}


def pytorch_cp_demo(rank, world_size, check_len, seq_len, heads, head_dim):
    """Both PyTorch comparisons in one run: equality with one process, then speed against ours."""
    return {"check": pytorch_context_parallel_attention(rank, world_size, check_len, 4),
            "timing": pytorch_vs_ours(rank, world_size, seq_len, heads, head_dim)}


def train_moe_gpt(rank, world_size, aux_weights, steps, n_experts=4, top_k=1, capacity_factor=1.25,
                  batch_size=16, lr=3e-3):
    """Rank r trains its own copy with balance-loss weight aux_weights[r] (independent runs side by
    side, no communication). Returns per-step loss, expert load and dropped fraction."""
    cfg = gpt_config("float32")
    model = moe_gpt(cfg, n_experts, top_k, capacity_factor).to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    alpha = aux_weights[rank]
    log = {"loss": [], "aux": [], "max_load": [], "dropped": [], "tokens_per_expert": None}
    for step in range(steps):
        tokens, targets = batch(cfg, batch_size, step)
        loss = loss_fn(model(tokens.to(device())), targets.to(device()))
        moes = [b.mlp for b in model.blocks]
        aux = sum(m.aux_loss for m in moes) / len(moes)
        (loss + alpha * aux).backward()
        opt.step()
        opt.zero_grad()
        counts = torch.tensor([m.stats["tokens_per_expert"] for m in moes], dtype=torch.float64)
        log["loss"].append(loss.item())
        log["aux"].append(aux.item())
        log["max_load"].append((counts.max(1).values / counts.mean(1)).mean().item())
        log["dropped"].append(sum(m.stats["dropped"] for m in moes) / sum(m.stats["assignments"] for m in moes))
        if step == 0:
            log["first_tokens_per_expert"] = [m.stats["tokens_per_expert"] for m in moes]
    log["tokens_per_expert"] = [m.stats["tokens_per_expert"] for m in moes]
    return log


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


# =========================================================================================
# The lecture
# =========================================================================================

def attention_sizes():
    """Shapes for the timings: (sequence, heads, head dim)."""
    return (512, 4, 32) if settings.quick else (1024, 4, 32)


def intro():
    note("""
        # Context parallelism and expert parallelism
        Two ways to split a transformer that the earlier lectures did not cover. **Context
        parallelism** (CP) splits the *sequence*: every rank holds all the weights and a slice of
        the tokens, for the whole model, so activation memory per rank falls as 1/n and sequences
        longer than one device's memory become trainable. **Expert parallelism** (EP) splits a
        mixture-of-experts layer's experts across ranks and moves the tokens to them.

        Both are built here from `send`/`recv` and `all_to_all_single`, as `torch.autograd.Function`s
        with hand-written backward passes, and every one is compared with one process: the same
        outputs and the same gradients. The model is lecture 01's GPT.
    """)


def what_needs_other_ranks():
    note("""
        ## Only attention needs the other ranks
        Split a sequence of s tokens over n ranks. Embeddings, LayerNorms, the MLPs, the LM head
        and the loss act on each token by itself: rank r computes them for its tokens alone, with
        its copy of the weights (each token embeds at its *global* position, which lecture 01's
        `GPT.embed(tokens, positions)` allows). Attention is the exception: a query at position i
        needs the keys and values of every position j ≤ i, and most of those live on other ranks.
        So context parallelism replaces one function, `CausalSelfAttention.attend`, and the
        weights' gradients are summed over the ranks, as in data parallelism.
    """)
    see(context_parallel_gpt)
    see(sequence_positions)
    ref = reference_gpt_gradients()
    rows = []
    for n, attention, layout in [(2, "ring", "zigzag"), (4, "ring", "contiguous"), (4, "ulysses", "zigzag")]:
        r = spawn(cp_gpt_gradients, n, attention=attention, layout=layout,
                  name=f"context-parallel GPT, {attention} attention, {layout}, {n} ranks").returns
        logit_diff = max((x["logits"] - ref["logits"][:, x["positions"]]).abs().max().item() for x in r)
        grad_diff = max((r[0]["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items())
        rows.append([n, attention, layout, r[0]["loss"], logit_diff, grad_diff])
    table(rows, header=["ranks", "attention", "layout", "loss", "max |Δ logits|", "max |Δ gradient|"],
          caption=f"lecture 01's GPT (float64) with the sequence split over the ranks, against one process "
                  f"(loss {ref['loss']:.10f})")
    lens = [64, 128, 256] if settings.quick else [64, 128, 256, 512]
    one = spawn(activation_memory, 1, seq_lens=lens, name="activation memory, whole sequence").returns[0]
    per = {n: spawn(activation_memory, n, seq_lens=lens, name=f"activation memory, CP over {n} ranks").returns
           for n in (2, 4)}
    table([[S, one[S] / 2**20] + [max(x[S] for x in per[n]) / 2**20 for n in (2, 4)] +
           [one[S] / max(x[S] for x in per[4])] for S in lens],
          header=["sequence length", "1 rank (MiB)", "CP=2, per rank", "CP=4, per rank", "1 rank / CP=4"],
          caption="activation bytes the GPT (batch 2, float32) keeps for backward per rank (weights "
                  "excluded), measured with a saved-tensors hook; attention here never stores the s×s "
                  "score matrix (backward recomputes it block by block, as FlashAttention does), so the "
                  "activations scale as s/n")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(lens, [one[S] / 2**20 for S in lens], "o-", label="1 rank")
    for n in (2, 4):
        ax.plot(lens, [max(x[S] for x in per[n]) / 2**20 for S in lens], "o-", label=f"CP = {n}, per rank")
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("activations kept for backward (MiB)")
    ax.legend()
    figure(fig, caption="activation memory per rank falls as 1/n: the point of context parallelism")


def ring_attention_section():
    note(r"""
        ## Ring attention
        Ring attention (Liu et al. 2023) never gathers the whole sequence. At step t, rank r attends
        with its queries to the K/V block of rank r−t, while it already sends that block on to
        rank r+1 and receives the next one from r−1: after n steps every query has seen every
        block, and the transfer of the next block hides under the compute of the current one.

        The partial results combine exactly, because softmax over a union of key sets can be
        assembled from its parts: keep, for every query row, the output `o` and the log-sum-exp
        $\ell = \log\sum_j e^{s_j}$ of its block; two partials merge as
        $\ell = \log(e^{\ell_1} + e^{\ell_2})$ and $o = o_1 e^{\ell_1-\ell} + o_2 e^{\ell_2-\ell}$ —
        the online softmax of Milakov & Gimelshein, the heart of FlashAttention, and lecture 01's
        `merge_attention`, which this lecture imports.
    """)
    see("https://arxiv.org/abs/2310.01889", "Liu, Zaharia, Abbeel 2023: Ring Attention with Blockwise Transformers for Near-Infinite Context")
    see("https://arxiv.org/abs/1805.02867", "Milakov & Gimelshein 2018: Online normalizer calculation for softmax")
    see(merge_partials)
    note(r"""
        Backward needs, for each block, dQ (which stays with the queries) and dK, dV (which belong
        to the block's owner). With the final ℓ and $D = \mathrm{rowsum}(dO \circ O)$ saved from
        forward, each block's gradients follow without the other blocks (FlashAttention-2's
        backward). So the K/V blocks go around the ring once more, and each block's dK/dV
        accumulator travels one hop behind it, picking up every rank's contribution, and arrives
        home after n hops. Autograd never sees the communication: the backward is written out.
    """)
    see("https://arxiv.org/abs/2307.08691", "Dao 2023: FlashAttention-2 (the block backward)")
    see(_block_backward)
    see(RingAttention)
    rows = []
    S, h = (24, 4) if settings.quick else (37, 4)
    cases = [("ring", layout, causal) for layout in ("contiguous", "zigzag") for causal in (False, True)]
    q, k, v, dout = attention_inputs(S, h)
    for n in (2, 4):
        r = spawn(attention_shards, n, cases=cases, seq_len=S, heads=h, name=f"ring attention vs one process, {n} ranks").returns
        for case in cases:
            ref = reference_attention(q, k, v, dout, case[2])
            diffs = [(unshard_sequence([x[case][i] for x in r], 2, case[1]) - ref[i]).abs().max().item() for i in range(4)]
            rows.append([n, case[1], "causal" if case[2] else "full"] + diffs)
    table(rows, header=["ranks", "layout", "mask", "max |Δ output|", "|Δ dQ|", "|Δ dK|", "|Δ dV|"],
          caption=f"ring attention against PyTorch's scaled_dot_product_attention on the whole sequence "
                  f"(float64, s = {S}: no layout splits it evenly)")
    from util.measure import machine, timing_ranks
    n = timing_ranks(4)
    S, h, d = attention_sizes()
    run = spawn(ring_trace, n, seq_len=S, heads=h, head_dim=d, name=f"ring attention timeline, {n} ranks")
    alone = spawn(transfer_alone, n, seq_len=S, heads=h, head_dim=d, name=f"K/V block transfer alone, {n} ranks").returns[0]
    figure(timeline(run.spans, title=f"ring attention forward + backward, s = {S}, {h} heads, head dim {d}"),
           caption="measured spans per rank: block compute, the K/V (and dK/dV) transfers from posting to "
                   "when `wait` saw them done, and the time actually spent waiting")
    st = run.returns
    comp = max(x["compute"] for x in st)
    wait = max(x["waiting"] for x in st)
    wall = max(x["wall"] for x in st)
    transfers = (n - 1) + (n - 1) + n      # K/V forward, K/V backward, dK/dV backward
    note(f"""
        Medians of the repetitions on {machine(n)}: one forward+backward takes
        {wall * 1e3:.1f} ms, of which {comp * 1e3:.1f} ms is block compute and {wait * 1e3:.2f} ms is
        waiting for transfers. One K/V block sent around the ring *alone* takes {alone.ms()}, so the
        {transfers} transfers of a step would cost about {transfers * alone.median * 1e3:.1f} ms if
        they were not overlapped; the waits show how much of that was not hidden. On GPUs NCCL
        moves the data on its own engines; on this CPU gloo's threads compete with the compute for
        the same cores, so hiding is less perfect.
    """)


def ring_work(lengths, layout, causal):
    """Score entries each rank computes in the ring (the planner the implementation uses)."""
    segs = layout_segments(lengths, layout)
    return [sum(qs[1] * ks[1] for src in range(len(lengths)) for qs in segs[r] for ks in segs[src]
                if pair_kind(qs, ks, causal) != "empty") for r in range(len(lengths))]


def load_balance_section():
    import matplotlib.pyplot as plt
    from util.measure import machine, timing_ranks
    note("""
        ## Causal masking unbalances the ring; zig-zag fixes it
        With causal attention, a query sees only earlier keys. Split the sequence into contiguous
        chunks and rank 0's queries need only its own block, while the last rank's need all n:
        rank 0 idles most of the ring, and the step lasts as long as the busiest rank. Cut the
        sequence into 2n chunks instead and give rank r chunks r and 2n−1−r, one early and one
        late (the "zig-zag" or head-tail layout of Llama 3 and ring-flash-attention): every rank
        now does the same work.
    """)
    see(zigzag_shard)
    see(layout_segments)
    see(pair_kind)
    n = timing_ranks(4)
    S, h, d = attention_sizes()
    rows, measured = [], {}
    for layout in ("contiguous", "zigzag"):
        counted = ring_work(split_sizes(S, n) if layout == "contiguous" else
                            [len(sequence_positions(S, r, n, layout)) for r in range(n)], layout, True)
        st = spawn(ring_trace, n, seq_len=S, heads=h, head_dim=d, layout=layout, causal=True,
                   name=f"causal ring, {layout}, {n} ranks").returns
        measured[layout] = (counted, st)
        for r in range(n):
            flops = 14 * d * h * st[r]["work"] // 2      # fwd 4·d, bwd 10·d per score entry (work counts both passes)
            rows.append([layout, r, counted[r], st[r]["work"] // 2, flops / 1e6, st[r]["compute"] * 1e3])
    table(rows, header=["layout", "rank", "score entries (planner)", "score entries (counted in the run)",
                        "MFLOP fwd+bwd", "compute time (ms)"],
          caption=f"causal ring attention, s = {S}, {h} heads, head dim {d}; {machine(n)}")
    ratio = lambda xs: max(xs) / max(min(xs), 1e-12)
    summary = [[layout, ratio(c), ratio([x["compute"] for x in st]), max(x["wall"] for x in st) * 1e3]
               for layout, (c, st) in measured.items()]
    table(summary, header=["layout", "max/min work (counted)", "max/min compute time (measured)", "step time (ms)"],
          caption="the imbalance, counted and measured")
    note(f"""
        The counts are exact: with contiguous chunks the busiest rank computes {summary[0][1]:.2f}× the
        score entries of the idlest, with zig-zag {summary[1][1]:.2f}×. Measured ({machine(n)}), the
        compute times differ by {summary[0][2]:.2f}× and {summary[1][2]:.2f}×, and the zig-zag step took
        {summary[1][3] / summary[0][3]:.2f}× the contiguous one's. Times on a shared CPU are noisier
        than counts; the gap grows with the number of ranks (contiguous: the last rank does n blocks
        while rank 0 does one).
    """)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, (layout, (c, st)) in zip(axes, measured.items()):
        ax.bar([r - 0.2 for r in range(n)], [x / max(c) for x in c], width=0.4, label="work counted")
        ax.bar([r + 0.2 for r in range(n)], [x["compute"] / max(y["compute"] for y in st) for x in st],
               width=0.4, label="compute time measured")
        ax.set_title(layout)
        ax.set_xlabel("rank")
        ax.set_xticks(range(n))
    axes[0].set_ylabel("relative to the busiest rank")
    axes[0].legend()
    figure(fig, caption="per-rank work of causal ring attention: contiguous chunks vs zig-zag")
    note("""
        The zig-zag layout is a different order of the tokens, nothing more: the model embeds each
        token at its true position and the loss is a sum over tokens, so training is unchanged
        (the GPT check above ran with zig-zag).
    """)


def allgather_section():
    from util.measure import machine, timing_ranks
    note("""
        ## The all-gather variant: simpler, more memory
        Instead of a ring, every rank can all-gather all keys and values first and then attend
        locally (backward: reduce-scatter dK, dV to their owners). Two collectives, no ring
        bookkeeping — Llama 3 trained long context this way — but every rank holds the whole
        sequence's K/V during attention and for backward, where the ring holds its own block plus
        one in flight.
    """)
    see("https://arxiv.org/abs/2407.21783", "Llama Team 2024: The Llama 3 Herd of Models (all-gather context parallelism, §3.3.2)")
    see(AllGatherAttention)
    n = timing_ranks(4)
    S, h, d = attention_sizes()
    r = spawn(compare_variants, n, seq_len=S, heads=h, head_dim=d, variants=["ring", "all-gather"],
              name=f"ring vs all-gather, {n} ranks").returns
    table([[name, r[0][name]["time"].ms(), max(x[name]["held"] for x in r) / 2**20,
            r[0][name]["shard_bytes"] / 2**20] for name in ("ring", "all-gather")],
          header=["variant", "forward+backward", "held for backward per rank (MiB)", "one q shard (MiB)"],
          caption=f"causal attention, s = {S}, {h} heads, head dim {d}, float32, zig-zag; {machine(n)}. "
                  "Held bytes measured with a saved-tensors hook")


def ulysses_section():
    from util.measure import machine, timing_ranks
    note("""
        ## Ulysses: trade the sequence split for a head split
        DeepSpeed-Ulysses (Jacobs et al. 2023) notices that attention heads are independent. One
        all-to-all turns each rank's (all heads, s/n positions) into (h/n heads, all s positions);
        each rank then runs ordinary attention on its heads, and a second all-to-all turns the
        output back. Per rank it sends 3 + 1 tensors of (n−1)/n of its shard in forward — a volume
        that does not grow with n — where the ring sends its K/V shard n−1 times. The limit: the
        heads must split over the ranks, so CP degree ≤ heads (fewer still with grouped-query
        attention's K/V heads).
    """)
    see("https://arxiv.org/abs/2309.14509", "Jacobs et al. 2023: DeepSpeed Ulysses")
    see(SeqToHeads)
    see(ulysses_attention)
    n = timing_ranks(4)
    S, h, d = attention_sizes()
    rows, shards = [], {}
    for ranks in sorted({2, 4, n}):
        r = spawn(compare_variants, ranks, seq_len=S, heads=h, head_dim=d, variants=["ring", "ulysses", "all-gather"],
                  repeats=3, name=f"bytes: ring vs Ulysses vs all-gather, {ranks} ranks").returns
        shard = shards[ranks] = r[0]["ring"]["shard_bytes"]
        for name in ("ring", "ulysses", "all-gather"):
            model = {"ring": (2 * (ranks - 1) + 2 * (ranks - 1) + 2 * ranks) * shard,
                     "ulysses": 2 * 4 * (ranks - 1) / ranks * shard,
                     "all-gather": (2 * (ranks - 1) + 2 * (ranks - 1)) * shard}[name]
            rows.append([ranks, name, r[0][name]["sent_forward"] / 2**20, r[0][name]["sent"] / 2**20, model / 2**20,
                         r[0][name]["time"].ms() + ("" if ranks <= n else " (oversubscribed)")])
    table(rows, header=["ranks", "variant", "sent in forward (MiB, measured)", "forward+backward (MiB, measured)",
                        "forward+backward (model)", "time"],
          caption=f"bytes rank 0 wrote to its sockets (/proc/self/io), s = {S}, {h} heads, head dim {d}, float32; "
                  f"model: ring 2(n−1) K/V forward + 2(n−1) K/V and 2n dK/dV backward shards; Ulysses 4 all-to-alls "
                  f"each way of (n−1)/n shard; all-gather and reduce-scatter as rings. {machine(n)}")
    extra = [(row[0], (row[3] - row[2]) / (2 * (row[0] - 1) * shards[row[0]] / 2**20)) for row in rows if row[1] == "all-gather"]
    note(f"""
        The ring and Ulysses send what the model says, plus small headers. The all-gather
        variant's backward sent {", ".join(f"{x:.1f}× ({n} ranks)" for n, x in extra)} the bytes a
        ring reduce-scatter of dK/dV needs: gloo's reduce-scatter on CPU sends more than the ring
        bound (NCCL's is a ring). Ulysses' volume per rank falls as n grows, the ring's grows:
        at large n that is Ulysses' advantage, and its head limit is the price.
    """)
    msg = spawn(ulysses_refusal, 4, heads=2, name="Ulysses with 2 heads on 4 ranks").returns[0]
    note(f"With 2 heads on 4 ranks Ulysses refuses: *{msg}*")


def pytorch_context_parallel():
    from util.measure import machine, timing_ranks
    note("""
        ## PyTorch's own: `context_parallel`
        `torch.distributed.tensor.experimental.context_parallel(mesh, buffers=..., buffer_seq_dims=...)`
        shards the given tensors along the sequence (head-tail order for causal attention: the
        same zig-zag) and patches `F.scaled_dot_product_attention` to run a ring. In torch 2.13 its
        handlers cover the CUDA kernels only; on CPU it fails with "aten._scaled_dot_product_flash_
        attention_for_cpu.default does not have a sharding strategy registered". The shim below
        registers that op (and its backward) with PyTorch's own ring functions; on a GPU it is not
        used. It is tested against one process like our variants.
    """)
    see(install_cpu_context_parallel_shim)
    n = timing_ranks(4)
    S, h, d = attention_sizes()
    Sc = 24
    q, k, v, dout = attention_inputs(Sc, 4)
    ref = reference_attention(q, k, v, dout, True)
    r = spawn(pytorch_cp_demo, n, check_len=Sc, seq_len=S, heads=h, head_dim=d,
              name=f"PyTorch context_parallel vs one process and vs our ring, {n} ranks").returns
    diffs = [(zigzag_unshard([x["check"][i] for x in r], 2) - ref[i]).abs().max().item() for i in range(4)]
    t = r[0]["timing"]
    table([["max |Δ| vs one process (float64, s=24): output, dQ, dK, dV", ", ".join(f"{x:.1e}" for x in diffs)],
           ["PyTorch's layout equals our zig-zag", t["same_layout"]],
           ["max |Δ| PyTorch vs ours (float32 outputs)", t["max_diff"]],
           ["PyTorch context_parallel, forward+backward", t["theirs"].ms()],
           ["our ring (zig-zag), forward+backward", t["ours"].ms()],
           ["ours / PyTorch", t["ours"].median / t["theirs"].median]],
          header=["what", "value"], caption=f"causal attention, s = {S}, {h} heads, head dim {d}; {machine(n)}; "
                                            "the two alternate, repetition by repetition. PyTorch merges partials in "
                                            "float32 (`convert_to_f32`), hence ~1e-7 in float64")
    ratio = t["ours"].median / t["theirs"].median
    verdict = ("that extra bookkeeping shows" if ratio > 1.05 else
               "about the same, so at this size the kernel's work dominates both" if ratio >= 0.95 else
               "PyTorch's path around the kernel (context_parallel's dispatch, and on CPU this "
               "lecture's shim) costs more than our calls at this size; we did not time its parts")
    note(f"""
        Both run the same fused CPU kernel on the blocks, so they differ in bookkeeping, not in
        arithmetic. Ours calls the kernel once per pair of segments (up to four per step under
        zig-zag, where PyTorch halves the query or key block instead: one call) and merges the
        partials with a few tensor operations per pair, in Python. Here ours takes
        {ratio:.2f}× PyTorch's time: {verdict}.
    """)


def mixture_of_experts():
    import matplotlib.pyplot as plt
    note(r"""
        ## Mixture of experts: router, capacity, balance loss
        A mixture-of-experts layer replaces the MLP by E expert MLPs and a router, a linear layer
        giving each token a probability for each expert. A token goes to its top-k experts (Switch
        Transformer: k = 1; GShard: k = 2) and its output is their gate-weighted sum, so the
        parameters grow E-fold while the compute per token grows k-fold.

        Experts run on fixed-size buffers, so each takes at most C = ⌈capacity factor · T · k / E⌉
        of the T tokens; the rest of its queue is **dropped** (that choice contributes nothing and
        the residual connection carries the token on). First choices queue before second choices.
        Left alone, routers collapse onto a few experts; the **auxiliary balance loss** of the
        Switch Transformer, $E \sum_e f_e P_e$ with $f_e$ the fraction of tokens whose first choice
        is e and $P_e$ the mean router probability of e, is 1 when routing is uniform and grows as
        it concentrates; only $P$ carries a gradient.
    """)
    see("https://arxiv.org/abs/2101.03961", "Fedus, Zoph, Shazeer 2021: Switch Transformers")
    see("https://arxiv.org/abs/2006.16668", "Lepikhin et al. 2020: GShard")
    see(route)
    see(balance_loss)
    see(MoE)
    torch.manual_seed(0)
    moe = moe_layer(d_model=32, d_ff=64, n_experts=8, top_k=2, capacity_factor=None, dtype="float32")
    x = torch.randn(512, 32)
    rows = []
    for cf in (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, None):
        moe.capacity_factor = cf
        with torch.no_grad():
            moe(x)
        st = moe.stats
        rows.append(["no limit" if cf is None else cf, st["capacity"], st["dropped"], st["dropped"] / st["assignments"]])
    counts = st["tokens_per_expert"]
    table(rows, header=["capacity factor", "capacity C (slots per expert)", "dropped choices", "fraction dropped"],
          caption="an untrained top-2 router over 8 experts, 512 tokens: dropped choices vs capacity factor")
    steps = 40 if settings.quick else 200
    weights = [0.0, 0.1]
    r = spawn(train_moe_gpt, 2, aux_weights=weights, steps=steps, batch_size=8,
              name="MoE GPT training: rank 0 without, rank 1 with the balance loss").returns
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    axes[0].bar(range(8), counts)
    axes[0].set_xlabel("expert")
    axes[0].set_ylabel("tokens routed (both choices)")
    axes[0].set_title("untrained router, 512 tokens")
    for w, log in zip(weights, r):
        axes[1].plot(log["max_load"], label=f"balance weight {w}")
        axes[2].plot(log["loss"], label=f"balance weight {w}")
    axes[1].axhline(1, color="gray", lw=0.5)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("busiest expert / mean load")
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("training loss")
    axes[1].legend()
    figure(fig, caption=f"lecture 01's GPT with 4-expert top-1 MoE MLPs (capacity factor 1.25), {steps} steps "
                        "of AdamW; each setting trained on its own rank, side by side")
    tail = max(1, steps // 10)
    mean = lambda xs: sum(xs[-tail:]) / tail
    table([[w, mean(log["loss"]), mean(log["aux"]), mean(log["max_load"]), mean(log["dropped"]),
            str(log["tokens_per_expert"])] for w, log in zip(weights, r)],
          header=["balance weight α", "loss", "balance loss", "busiest / mean load", "dropped fraction",
                  "tokens per expert (last step, per layer)"],
          caption=f"means over the last {tail} steps")


def expert_parallelism():
    from util.measure import machine, timing_ranks
    note("""
        ## Expert parallelism: all-to-all dispatch and combine
        Put E/n experts on each of n ranks; each rank routes its own tokens. Two rounds of
        `all_to_all_single` move the tokens: *dispatch* sends each kept (token, choice) row to the
        rank owning that expert, the experts run, and *combine* sends the results back, to be
        weighted by the gates. The splits are uneven and change every step, so the ranks first
        exchange how many rows each will send (a small all-to-all of counts) to size the buffers.
        Here the choice counts are also all-gathered first, so every rank knows the global queue
        positions and drops exactly the tokens one process would; the layer then equals the
        one-process `MoE` on all ranks' tokens: outputs, gradients, dropped tokens.
    """)
    see(AllToAll)
    see(ExpertParallelMoE)
    tokens, d_model, d_ff, E, k = (256, 64, 128, 8, 2) if settings.quick else (1024, 64, 256, 8, 2)
    rows, imbalance = [], []
    for n in (2, 4):
        r = spawn(expert_parallel_traffic, n, tokens=tokens, d_model=d_model, d_ff=d_ff, n_experts=E, top_k=k,
                  capacity_factor=1.25, name=f"expert parallelism, {n} ranks").returns
        ref = moe_reference(dict(d_model=d_model, d_ff=d_ff, n_experts=E, top_k=k, capacity_factor=1.25),
                            [tokens] * n)
        out = torch.cat([x["check"]["out"] for x in r])
        same_drops = torch.equal(torch.cat([x["check"]["keep"] for x in r]), ref["keep"])
        for rank, x in enumerate(r):
            st = x["stats"]
            remote = sum(c for j, c in enumerate(st["rows_sent"]) if j != rank)       # dispatch out
            returned = sum(c for j, c in enumerate(st["rows_received"]) if j != rank)  # combine out
            rows.append([n, rank, st["rows_sent"], st["rows_received"], sum(st["rows_received"]), x["sent"] / 2**10,
                         2 * (remote + returned) * d_model * 4 / 2**10])
        recv = [sum(x["stats"]["rows_received"]) for x in r]
        imbalance.append([n, (out - ref["out"]).abs().max().item(), same_drops, max(recv) / (sum(recv) / n),
                          r[0]["time"].ms() + ("" if n <= timing_ranks(4) else " (oversubscribed)")])
    table(rows, header=["ranks", "rank", "rows sent to each rank", "rows received from each", "expert rows on this rank",
                        "KiB sent fwd+bwd (measured)", "KiB model: remote rows × 2 passes × 2 all-to-alls"],
          caption=f"{tokens} tokens per rank, d_model {d_model}, {E} experts, top-{k}, capacity factor 1.25, float32")
    table(imbalance, header=["ranks", "max |Δ output| vs one process (float64)", "same tokens dropped",
                             "busiest rank's rows / mean", "layer forward+backward"],
          caption=f"equality and imbalance; {machine(timing_ranks(4))}")
    note("""
        Measured bytes include the backward pass, which repeats both all-to-alls in reverse, and
        the small count exchanges. The busiest rank sets the pace: the balance loss that evens
        out experts also evens out the ranks.

        **Why DeepSeek-V3 limits each token to 4 nodes.** With hundreds of fine-grained experts
        and top-8 routing, a token's experts could sit on up to 8 different nodes, and every copy
        crosses the slow inter-node network (InfiniBand) both ways. DeepSeek-V3 first picks at
        most 4 nodes per token (by the best expert scores on each node), then the experts within
        them, so each token crosses IB at most 4 times and is forwarded to its experts over the
        fast intra-node NVLink — bounding the all-to-all traffic that dominates EP's cost.
    """)
    see("https://arxiv.org/abs/2412.19437", "DeepSeek-AI 2024: DeepSeek-V3 Technical Report (node-limited routing)")


def main():
    intro()                      # what the two splits are
    what_needs_other_ranks()     # CP touches only attention; memory per rank ~ s/n
    ring_attention_section()     # the ring, its merge, its backward, the overlap measured
    load_balance_section()       # causal masking unbalances contiguous chunks; zig-zag
    allgather_section()          # the simpler variant and what it costs in memory
    ulysses_section()            # all-to-all to head shards: bytes compared, its limit
    pytorch_context_parallel()   # PyTorch's own ring, with a small CPU shim
    mixture_of_experts()         # router, capacity, balance loss, in training
    expert_parallelism()         # experts across ranks, tokens by all-to-all


def bench():
    """Ring vs all-gather vs Ulysses (fwd+bwd) side by side; zig-zag's work balance vs contiguous."""
    from util.measure import timing_ranks
    n = timing_ranks(4)
    S, h, d = 1024, 8, 32
    r = spawn(compare_variants, n, seq_len=S, heads=h, head_dim=d, variants=["ring", "all-gather", "ulysses"],
              name="bench: ring vs all-gather vs Ulysses").returns[0]
    t = {k: v["time"].median for k, v in r.items()}
    balance = {}
    for layout in ("contiguous", "zigzag"):
        st = spawn(ring_trace, n, seq_len=S, heads=h, head_dim=d, layout=layout, causal=True,
                   name=f"bench: causal ring, {layout}").returns
        c = [x["compute"] for x in st]
        work = ring_work([len(sequence_positions(S, r, n, layout)) for r in range(n)], layout, True)
        balance[layout] = (max(c) / min(c), max(x["wall"] for x in st), max(work) / min(work))
    return [f"lecture_06: ring {t['ring'] * 1e3:.1f} ms vs all-gather {t['all-gather'] * 1e3:.1f} ms: ratio "
            f"{t['ring'] / t['all-gather']:.2f}; vs Ulysses {t['ulysses'] * 1e3:.1f} ms: ratio {t['ring'] / t['ulysses']:.2f} "
            f"(causal fwd+bwd, s={S}, {n} ranks)",
            f"lecture_06: causal ring max/min work per rank counted: contiguous {balance['contiguous'][2]:.2f}, zig-zag "
            f"{balance['zigzag'][2]:.2f}; measured compute: contiguous {balance['contiguous'][0]:.2f}, zig-zag "
            f"{balance['zigzag'][0]:.2f}; step {balance['contiguous'][1] * 1e3:.1f} ms vs {balance['zigzag'][1] * 1e3:.1f} ms "
            f"(zig-zag / contiguous {balance['zigzag'][1] / balance['contiguous'][1]:.2f})"]
