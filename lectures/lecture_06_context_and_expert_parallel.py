"""Context parallelism and expert parallelism: split the sequence, split the experts

Long sequences: every rank holds a slice of the sequence for the whole model, and only attention
needs the other ranks' keys and values — passed around a ring (ring attention), gathered at once,
or swapped for a split of the heads (DeepSpeed-Ulysses). Mixtures of experts: a router sends each
token to a few expert MLPs, and the experts live on different ranks (expert parallelism), with
tokens dispatched and combined by all-to-all. Every version is checked against one process.

The building blocks live in `lectures/context_parallel/`: `blocks` (attention on segments, its
block backward), `sharding` (contiguous and zig-zag shards), `ring`, `variants` (all-gather,
Ulysses, the GPT swap, the CPU shim for PyTorch's `context_parallel`) and `moe`; what the ranks
run in the demos is in `demos`, the deep dives (the appendix page) in `deep_dives`, the drawings in
`figures`. This file narrates them: its sections, main() and bench().
"""
import torch

from exercises import listing as notebook_exercises
from lectures.model.attention import merge_attention as merge_partials
from lectures.context_parallel.blocks import _block_backward
from lectures.context_parallel.variants import (ATTENTION, AllGatherAttention, SeqToHeads, context_parallel_gpt,
                                                ulysses_attention)
from lectures.context_parallel.moe import (AllToAll, ExpertParallelMoE, MoE, RankCapacityMoE, balance_loss,
                                           expert_owners, route, capacity)
from lectures.context_parallel.ring import RingAttention
from lectures.context_parallel.sharding import (causal_work, layout_segments, sequence_positions, striped_positions,
                                                unshard_sequence, zigzag_shard)
from lectures.context_parallel.demos import (AUX_WEIGHT, BIAS_STEP, activation_memory, attention_inputs,
                                             attention_shards, attention_sizes, balance_ceiling, capacity_scopes,
                                             compare_variants, cp_gpt_gradients, ep_dp_groups, expert_data_parallel,
                                             expert_parallel_traffic, gqa_bytes, layout_steps, moe_inputs, moe_layer,
                                             moe_reference, rank_compute, reference_attention, reference_gpt_gradients,
                                             released_ring, ring_trace, ring_work, share_spread, train_moe_gpt, transfer_alone,
                                             ulysses_layouts, ulysses_refusal, whole_diagonal_ceiling, _TRAINING)
from lectures.context_parallel.deep_dives import (balancing_deep_dive, node_limited_deep_dive,
                                                  pytorch_context_parallel, usp_deep_dive)
from lectures.context_parallel.figures import (ring_steps_figure, held_bytes_picture, ulysses_picture,
                                               dispatch_figure, activation_memory_figure, moe_figure,
                                               expert_groups_figure, attention_blocks_figure,
                                               work_imbalance_figure, share_bars_figure)
from lectures.data_parallel.figures import overlap_bars
from lectures.data_parallel.overlap import gain_words, real_compute_words
from lectures.model.figures import published_figure
from lectures.model.gpu_evidence import TORCHTITAN_CP, flops_per_token
from util import cheat, deep_dive, figure, note, see, settings, spawn, table, timeline
from util import try_it_yourself
from util.measure import value_range, with_spread


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

        **What you will learn.** Why only attention needs the other ranks; ring attention (the
        ring's steps, the log-sum-exp merge, its written-out backward, when its transfers hide);
        why causal masking unbalances contiguous chunks and how zig-zag and striped layouts fix
        it; the all-gather variant and Ulysses, and what each sends (grouped-query attention
        included); what PyTorch's `context_parallel` really does; a mixture of experts with
        capacity, shared experts and balancing (the router z-loss trained); expert parallelism's
        dispatch and combine by all-to-all, capacity per rank and dropless, and which gradients
        reduce over which group.

        **What you need.** Lecture 01 (the GPT, attention and FlashAttention's online softmax),
        lecture 02 (send/recv, all-gather, reduce-scatter, all-to-all) and lecture 03 (summing
        gradients over data-parallel ranks); in PyTorch, `torch.autograd.Function` with a
        custom backward and `F.scaled_dot_product_attention`.
    """)


def what_needs_other_ranks():
    note("## Only attention needs the other ranks")
    ref = reference_gpt_gradients()
    rows = []
    for n, attention, layout in [(2, "ring", "zigzag"), (4, "ring", "contiguous"), (4, "ulysses", "zigzag")]:
        r = spawn(cp_gpt_gradients, n, attention=attention, layout=layout,
                  name=f"context-parallel GPT, {attention} attention, {layout}, {n} ranks").returns
        logit_diff = max((x["logits"] - ref["logits"][:, x["positions"]]).abs().max().item() for x in r)
        grad_diff = max((r[0]["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items())
        rows.append([n, attention, layout, r[0]["loss"], logit_diff, grad_diff])
    lens = [64, 128, 256] if settings.quick else [64, 128, 256, 512]
    one = spawn(activation_memory, 1, seq_lens=lens, name="activation memory, whole sequence").returns[0]
    per = {n: spawn(activation_memory, n, seq_lens=lens, name=f"activation memory, CP over {n} ranks").returns
           for n in (2, 4)}
    fig = activation_memory_figure(lens, one, per)
    figure(fig, caption="activation memory per rank falls as 1/n: the point of context parallelism")
    note("""
        Split a sequence of s tokens over n ranks. Embeddings, LayerNorms, the MLPs, the LM head
        and the loss act on each token by itself: rank r computes them for its tokens alone, with
        its copy of the weights (each token embeds at its *global* position, which lecture 01's
        `GPT.embed(tokens, positions)` allows). Attention is the exception: a query at position i
        needs the keys and values of every position j ≤ i, and most of those live on other ranks.
        So context parallelism replaces one function, `CausalSelfAttention.attend`, and the
        weights' gradients are summed over the ranks, as in data parallelism. The check: the
        GPT's logits and gradients against one process (first table); the memory (second).
    """)
    table(rows, header=["ranks", "attention", "layout", "loss", "max |Δ logits|", "max |Δ gradient|"],
          caption=f"lecture 01's GPT (float64) with the sequence split over the ranks, against one process "
                  f"(loss {ref['loss']:.10f})")
    table([[S, one[S] / 2**20] + [max(x[S] for x in per[n]) / 2**20 for n in (2, 4)] +
           [one[S] / max(x[S] for x in per[4])] for S in lens],
          header=["sequence length", "1 rank (MiB)", "CP=2, per rank", "CP=4, per rank", "1 rank / CP=4"],
          caption="activation bytes the GPT (batch 2, float32) keeps for backward per rank (weights "
                  "excluded), measured with a saved-tensors hook; attention here never stores the s×s "
                  "score matrix (backward recomputes it block by block, as FlashAttention does), so the "
                  "activations scale as s/n")
    top = lens[-1]
    ratio4 = one[top] / max(x[top] for x in per[4])
    cheat("CP activation memory", "activations per rank $\\propto s/n$", round(ratio4, 2), "×",
          what=f"one rank's saved activations over CP = 4's per rank, s = {top}, measured")
    (s0, tps0), (s1, tps1), grew = torchtitan_cp_drop()
    note(f"""
        At published scale, torchtitan trained Llama 3.1 8B on 8 H100s with CP 8 at {s1:,}
        tokens, a length one GPU's memory could not hold at all. Per GPU it processed
        {tps0 / tps1:.1f}× fewer tokens/s than with CP 1 at {s0:,} tokens. Attention's extra work
        per token explains {grew:.2f}×; the remaining {tps0 / tps1 / grew:.1f}× is what CP 8 and the
        kernels at these lengths cost (the deep dive below). Here the sequences are a
        few hundred tokens and the machine's memory is never the limit, so this page can show
        the 1/n but not what it buys.
    """)
    cp_published_figure()
    see(context_parallel_gpt)
    see(sequence_positions)


def torchtitan_cp_drop():
    """torchtitan's shortest and longest points ((seq, tokens/s per GPU) each) and the work per
    token's growth between them."""
    points = TORCHTITAN_CP.series["tokens/s per GPU"]
    first, last = points[0], points[-1]
    return first, last, sum(flops_per_token(last[0])) / sum(flops_per_token(first[0]))


def cp_published_figure():
    """torchtitan's throughput per GPU from 32K to 256K tokens (CP 1 to 8), beside what the extra
    attention work per token alone would leave."""
    pub = TORCHTITAN_CP
    points = pub.series["tokens/s per GPU"]
    (s0, tps0) = points[0]
    work = {s: sum(flops_per_token(s)) for s, _ in points}
    figure(published_figure(pub, height=2.8, computed={"if only the work per token grew (computed)":
                                                       [(s, tps0 * work[s0] / work[s]) for s, _ in points]}),
           caption=pub.caption("Throughput per GPU as the sequence grows 8× and CP with it; dashed: what the "
                               "extra attention work per token alone would leave (computed here from Llama 3.1 "
                               "8B's shapes)."))


def cp_at_published_scale():
    """torchtitan's Llama 3.1 8B at 32K–256K tokens with CP 1–8: the throughput drop split into
    attention's extra work and what CP costs."""
    note("## Deep dive: context parallelism at published scale")
    pub = TORCHTITAN_CP
    points = pub.series["tokens/s per GPU"]
    (s0, tps0), (s1, tps1) = points[0], points[-1]
    work = {s: sum(flops_per_token(s)) for s, _ in points}
    linear, attn0 = flops_per_token(s0)
    _, attn1 = flops_per_token(s1)
    grew, fell = work[s1] / work[s0], tps0 / tps1
    note(f"""
        torchtitan trained Llama 3.1 8B on 8 H100s at sequence lengths up to {s1:,} with CP 8
        ({tps1:,} tokens/s per GPU), where {s0:,} with CP 1 gave {tps0:,}: {fell:.1f}× fewer. Part
        of it is work: causal attention's FLOPs per token grow with the sequence, the matmuls'
        do not. Forward and backward, the matmuls cost {linear / 1e9:.0f} GFLOP per token and
        attention {attn0 / 1e9:.0f} at {s0 // 1024}K, {attn1 / 1e9:.0f} at {s1 // 1024}K (computed
        from the model's shapes, `flops_per_token`): {grew:.2f}× the work per token, the dashed
        line of the main page's figure. The other
        {fell / grew:.1f}× is what CP 8 costs there — the K/V passing that is not hidden,
        imbalance, and kernels at these lengths — and what it buys is a length that one GPU's
        memory could not hold at all.
    """)
    see(pub.url, title="torchtitan, Llama 3 on H100s, December 2024 (Table 2)")


def ring_attention_section():
    note("## Ring attention")
    ring_steps_figure(4)
    note(r"""
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
        to the block's owner). Given the final ℓ (saved from forward) and
        $D = \mathrm{rowsum}(dO \circ O)$ (computed once at the start of backward from the incoming
        gradient and the saved output), each block's gradients follow without the other blocks
        (FlashAttention-2's backward). So the K/V blocks go around the ring once more, and each block's dK/dV
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
    alone = spawn(transfer_alone, n, seq_len=S, heads=h, head_dim=d, name=f"one hop of a K/V block alone, {n} ranks").returns[0]
    figure(timeline(run.spans, title=f"ring attention forward + backward, s = {S}, {h} heads, head dim {d}"),
           caption="measured spans per rank: block compute, the K/V (and dK/dV) transfers from posting to "
                   "when `wait` saw them done, and the time actually spent waiting")
    st = run.returns
    comp = max(x["compute"] for x in st)
    wait = max(x["waiting"] for x in st)
    wall = max(x["wall"] for x in st)
    block = max(x["forward_compute"] for x in st) / n            # one forward block, on average
    transfers = (n - 1) + (n - 1) + n      # K/V forward, K/V backward, dK/dV backward
    alone_total = transfers * alone.median
    ratio = block / alone.median
    untraced = max(0.0, wall - comp - wait)
    note(f"""
        Medians of the repetitions, {machine(n)}: one forward+backward takes {wall * 1e3:.1f} ms.
        Of that, {comp * 1e3:.1f} ms is block compute and {wait * 1e3:.2f} ms is waiting in
        `wait()`. The other {untraced * 1e3:.1f} ms or so is not traced (Python and autograd between
        the blocks, allocating and merging the partial results, the switch from forward to backward:
        the gaps between spans in the figure). One hop of a K/V block *alone* takes {alone.brief()}, so the {transfers} hops
        of a step cost about {alone_total * 1e3:.1f} ms of wire time. The waits add up to
        {wait / alone_total:.1f}× that. {wait_words(wait, alone_total)} What a wait is follows from how the ring
        runs: a rank waits for its neighbour, which posts the next block only when it reaches
        that step. So the waits also measure **skew** between the ranks (one rank delayed by the
        other processes sharing these cores, or by having more work) and **contention** (gloo's
        I/O threads run on the same cores as the compute), not only the bytes. On GPUs the same
        holds in another form: NCCL runs its transfers as kernels on the GPU's SMs, competing
        with the compute kernels (DeepSeek-V3 reserves 20 of its SMs for communication).

        **When can the ring hide its transfers?** A step computes a block of (s/n)² score entries
        and sends s/n positions of K/V: compute grows with the square of the block, the transfer
        linearly. The transfer hides when block compute ≥ transfer time, which sets a minimum
        block size; Liu et al. derive it from the device's FLOP/s and bandwidth. Here one forward
        block took {with_spread(f"{ratio:.1f}×", f"{block * 1e3:.2f} ms against {alone.median * 1e3:.2f} ms")}
        as long as its transfer alone, so at s/n = {S // n} positions the condition
        {"holds" if ratio >= 1 else "fails"}; scaling both as above, compute and transfer would be
        equal at about {S / n / ratio:.0f} positions per rank, the break-even block here. With a GPU's much larger FLOP/s per byte of bandwidth the minimum is
        thousands of tokens per rank, which is why a ring needs long sequences per device.
        On this CPU the compute and gloo's copies share the cores; the deep dive below gives each
        block a stand-in that leaves its core to gloo, and measures how much of a hop then hides.
    """)


def ring_released():
    """Ring attention's forward with a compute stand-in that leaves the core to gloo."""
    note("## Deep dive: ring attention with the core released")
    S, h, d = attention_sizes()
    freed = spawn(released_ring, 2, real_shape=(S, h, d),
                  name="ring attention forward with a compute stand-in that releases the core, 2 ranks")
    r = freed.returns[0]
    figure(overlap_bars({f"ring forward, real compute (s = {S}, {h} heads of {d})": r["real"],
                         "ring forward, compute stand-in (core released)": r}),
           caption="ring attention's forward on 2 ranks without and with overlap: at the main page's sequence, heads "
                   "and head dim with its real compute (top), and with each block followed by a stand-in that waits "
                   "as long as one K/V hop (below); without overlap each hop is waited for as soon as it is posted: "
                   "medians (bars: interquartile range); red: the stand-in's model")
    note(f"""
        Give each block a stand-in that keeps the rank
        busy as long as one K/V hop takes but leaves the core to gloo (`released`, a timed
        wait, lecture 05's sleep mode), on a shape whose K/V blocks of
        {r['kv_bytes'] / 2 ** 20:.0f} MB are cheap to attend to ({r['block'][0]} positions per rank,
        {r['block'][1]} heads of {r['block'][2]}). {gain_words(r)}. The overlapped run waited
        {r['waiting'].median * 1e3:.2f} ms in all for a {r['comm'].median * 1e3:.2f} ms hop:
        {"the transfer is hidden" if r['waiting'].median < 0.25 * r['comm'].median else "most of the transfer still waited for"}.
        The model's best gain is small: 2 ranks have one hop to hide, behind 2 blocks whose real
        work (reading the megabytes of K and V) is about as long as the hop itself{
        ", and here hiding the hop did not even pay: gloo's copies ran on the core the next block's real work needed"
        if r['gain'] < 1 else ", and that real work on this CPU competes with gloo's copies"}.
        At the main page's sequence, heads and head dim (the forward only, on 2 ranks) with its real
        compute and no stand-in,
        {real_compute_words(r["real"], "the overlapped ring", "the one that waits at once")}.
        On GPUs, where a block's matmuls run on the SMs beside the transfer, the stand-in's case is
        the real one.
    """)


def wait_words(wait, wire):
    """What the total wait, against the wire time of the same hops alone, can and cannot say."""
    if wait > wire:
        return "That is more than the wire could take, so at least the excess is not the transfers themselves."
    return ("The number alone cannot say what they are: a wait shorter than the wire is also what a "
            "partly hidden transfer looks like.")


def balance_sizes():
    """Shapes for the balance measurement (sequence, heads, head dim): large enough that block
    compute, not communication, sets the step."""
    return (1024, 4, 64) if settings.quick else (2048, 4, 64)


def load_balance_section():
    from util.measure import machine, timing_ranks
    note("## Causal masking unbalances the ring: zig-zag and striped layouts")
    attention_blocks_figure(16, 4)
    note("""
        With causal attention a query sees only earlier keys, and a kernel skips the masked
        entries (the diagonal block costs about half a full one). Split the sequence into
        contiguous chunks and rank 0 computes half a block while the last rank computes n − 1 full
        blocks and a half: (2n − 1) : 1, and the step lasts as long as the busiest rank. Two
        layouts give every rank an equal share. **Zig-zag** (head-tail; Llama 3's context
        parallelism, zhuzilin's ring-flash-attention) cuts the sequence into 2n chunks and gives
        rank r chunks r and 2n−1−r, one early and one late. **Striped attention** (Brandon et al.
        2023) deals the tokens out like cards: rank r holds r, r+n, r+2n, …, so every block of
        the ring is a near-triangle of the same size. The ring here implements contiguous and
        zig-zag; striped is counted and drawn.
    """)
    see("https://arxiv.org/abs/2311.09431", "Brandon et al. 2023: Striped Attention: Faster Ring Attention for Causal Transformers")
    see(zigzag_shard)
    see(layout_segments)
    see(striped_positions)
    see(causal_work)
    ns = list(range(2, 9))
    S0 = 8192
    fig = work_imbalance_figure(ns, S0)
    figure(fig, caption=f"counted work imbalance of causal attention, s = {S0}: contiguous grows as 2n − 1, "
                        "zig-zag and striped stay at 1")
    S, h, d = balance_sizes()
    nb = 4
    shares = spawn(rank_compute, 1, seq_len=S, heads=h, head_dim=d, ranks=nb,
                   name=f"each rank's attention work alone, {nb} ring ranks").returns[0]
    rows, summary = [], {}
    problems = {}
    for layout in ("contiguous", "zigzag"):
        counted = ring_work(S, nb, layout)
        t = [shares[layout, r].q1 for r in range(nb)]
        timed, problems[layout] = share_spread(counted, [shares[layout, r] for r in range(nb)])
        summary[layout] = (max(counted) / min(counted), timed, max(t))
        for r in range(nb):
            rows.append([layout, r, counted[r], counted[r] / max(counted), shares[layout, r].ms(), t[r] / max(t)])
    table(rows, header=["layout", "rank", "score entries (counted)", "of the busiest", "its blocks, fwd+bwd (measured)",
                        "lower quartile, of the busiest"],
          caption=f"causal attention on {nb} ring ranks, s = {S}, {h} heads, head dim {d}, float32: each rank's "
                  "kernel calls (the same segment pairs the ring computes over its steps) timed alone on one "
                  "thread, one share at a time in one process, all eight taking turns")
    busiest = {layout: max((shares[layout, r] for r in range(nb)), key=lambda x: x.q1)
               for layout in ("contiguous", "zigzag")}
    counted_words = (f"Counted with the skipped entries, contiguous chunks give the busiest of {nb} ranks "
                     f"{summary['contiguous'][0]:.2f}× the idlest's work (2n − 1 = {2 * nb - 1}), zig-zag "
                     f"{summary['zigzag'][0]:.2f}×.")
    bad = [f"{layout}: {why}" for layout, why in problems.items() if why]
    if bad:
        note(f"""
            {counted_words} **This run's timings cannot be read as work** ({"; ".join(bad)}): the
            other processes on these cores took the shares' time, not the attention. The table
            keeps the numbers for what they are; rebuild on a quiet machine to see the shares.
        """)
    else:
        mc, mz = summary["contiguous"][1], summary["zigzag"][1]
        note(f"""
            {counted_words} Timed alone (lower quartiles, the least disturbed repetitions), the
            ranks' shares differ by {mc:.2f}× under contiguous chunks and {mz:.2f}× under zig-zag.
            {"The clock shows less imbalance than the count: a share also pays what does not "
             "scale with its unmasked entries (kernel calls, allocating and merging partial "
             "results)." if mc < summary["contiguous"][0] else ""} A ring step lasts as long as its
            busiest rank, so the busiest share is what counts (the unmasked work in all is the
            same). Busiest share against busiest share,
            {speedup_words(busiest["zigzag"], busiest["contiguous"], nb, balance_ceiling(S, nb))}.
        """)
    fig = share_bars_figure(shares, S, nb)
    figure(fig, caption="each rank's share of causal attention on a 4-rank ring, contiguous chunks vs zig-zag: "
                        "counted entries and measured time (lower quartile), each relative to its busiest rank")
    n = timing_ranks(4)
    step = spawn(layout_steps, n, seq_len=S, heads=h, head_dim=d, name=f"causal ring, both layouts, {n} ranks").returns[0]
    note(f"""
        The whole ring on {machine(n)}, communication included, the two layouts taking turns
        repetition by repetition, each step waiting for its slowest rank: zig-zag against
        contiguous, {speedup_words(step["zigzag"], step["contiguous"], n, balance_ceiling(S, n))}.
        Both ranks share these cores with the transfers and with other processes, so the step
        is a noisier instrument than the shares above.
    """)
    note(f"""
        **What balance can buy.** The busiest/idlest ratio of contiguous chunks grows as 2n − 1,
        but a step waits only for the busiest rank: {N_HALF} So zig-zag's gain by balance is at
        most (2n − 1)/n, which grows from {balance_ceiling(S0, 2):.2f}× at 2 ranks to
        {balance_ceiling(S0, 8):.2f}× at 8. It approaches 2× and never reaches it. Whatever a measurement shows above that is not
        balance: fixed costs per kernel call only narrow the ratio (zig-zag makes more, smaller
        calls), so an excess comes from a kernel that pays for the masked half of a diagonal
        block (which moves the ceiling to 4n/(2n + 1), {whole_diagonal_ceiling(nb):.2f}× at {nb} ranks)
        or from the machine's load changing between the two layouts' repetitions.
    """)
    gain = busiest["contiguous"].median / busiest["zigzag"].median
    if not bad and gain <= balance_ceiling(S, nb):   # noise, or a ratio above the ceiling: no cheat line from it
        cheat("zig-zag over contiguous, causal", "speed-up by balance $\\le (2n-1)/n$, below 2", round(gain, 2), "×",
              what=f"busiest share, {nb} ring ranks, measured (ceiling {balance_ceiling(S, nb):.2f})")
    note("""
        The zig-zag layout is a different order of the tokens, nothing more: the model embeds each
        token at its true position and the loss is a sum over tokens, so training is unchanged
        (the GPT check above ran with zig-zag).
    """)


N_HALF = ("per ring step the last contiguous rank computes a whole block (half of one at step 0), n − ½ "
          "blocks in all, while every zig-zag rank computes half a block per step, n/2 in all.")


def speedup_words(zigzag, contiguous, n, ceiling):
    """zig-zag against contiguous (`Timing`s) in words, beside the ceiling balance allows. A ratio
    of medians above it is never read as zig-zag's gain: it is put down to the repetitions'
    spread when the quartiles' least favourable reading (contiguous q1 over zig-zag q3) is within
    the ceiling, to the masked half of diagonal blocks when within 4n/(2n + 1), else to a cost
    the build does not separate."""
    from util.measure import compare
    words = compare(zigzag, contiguous, "zig-zag", "contiguous")
    ratio, low, whole = contiguous.median / zigzag.median, contiguous.q1 / zigzag.q3, whole_diagonal_ceiling(n)
    if ratio <= ceiling:
        return f"{words}; balance allows at most {ceiling:.2f}× at {n} ranks ((2n − 1)/n)"
    if low <= ceiling:
        return (f"{words}. That is above the {ceiling:.2f}× that balance allows at {n} ranks, but inside the "
                f"repetitions' spread (contiguous q1 over zig-zag q3: {low:.2f}×): the machine's load moved "
                "these timings by more than balance can, so this ratio is not read as zig-zag's gain")
    if ratio <= whole:
        return (f"{words}. That is above the {ceiling:.2f}× that balance allows with masked entries skipped, "
                f"within the {whole:.2f}× of a kernel that computes each diagonal block whole (4n/(2n + 1)), so "
                "part of each diagonal block's masked half was paid for")
    return (f"{words}. That is more than balance can give at {n} ranks (at most {ceiling:.2f}×, {whole:.2f}× "
            "even with diagonal blocks computed whole), even between the quartiles. The rest is a cost this build does not "
            "separate (the two layouts differ in more than balance: their blocks' shapes and kernel calls), "
            "so this ratio is not read as zig-zag's gain")


_VARIANT_RUN = {}   # the one timing of ring, all-gather and Ulysses at the page's sizes, shared by two sections


def variant_run():
    """Ring, all-gather and Ulysses, forward+backward at `attention_sizes()`: measured once per page;
    None where torchrun started fewer ranks (the page says the demo was skipped)."""
    from util.measure import timing_ranks
    key = (timing_ranks(4), attention_sizes())
    if key not in _VARIANT_RUN:
        n, (S, h, d) = key
        run = spawn(compare_variants, n, seq_len=S, heads=h, head_dim=d, variants=["ring", "all-gather", "ulysses"],
                    name=f"ring vs all-gather vs Ulysses, {n} ranks")
        _VARIANT_RUN[key] = None if run.skipped else run.returns
    return _VARIANT_RUN[key]


def allgather_section():
    from util.measure import machine, timing_ranks
    note("## The all-gather variant: simpler, more memory")
    if variant_run() is not None:
        held_bytes_picture(variant_run(), timing_ranks(4))
    note("""
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
    r = variant_run()
    if r is not None:
        table([[name, r[0][name]["time"].ms(), max(x[name]["held"] for x in r) / 2**20,
                r[0][name]["shard_bytes"] / 2**20] for name in ("ring", "all-gather")],
              header=["variant", "forward+backward", "held for backward per rank (MiB)", "one q shard (MiB)"],
              caption=f"causal attention, s = {S}, {h} heads, head dim {d}, float32, zig-zag; {machine(n)}. "
                      "Held bytes measured with a saved-tensors hook")
    note("""
        **Grouped-query attention makes K/V small.** With GQA, h query heads share $h_{kv}$ K/V
        heads, so the K/V a rank must send are $h_{kv}/h$ of its queries' size — *if* they travel
        with their own heads and are repeated only after the transfer, as here (lecture 01's
        attention repeats them before `attend`; the context-parallel wrapper takes one of each
        group back, a view, so the wire carries $h_{kv}$ heads). Llama 3 gives this as one reason
        for choosing all-gather: with GQA the gathered K and V are much smaller than Q, so the
        exposed all-gather is short (the other: it handles document masks easily).
    """)
    Sg, hg, kvg, dg = 256, 8, 2, 32
    b = spawn(gqa_bytes, n, seq_len=Sg, heads=hg, kv_heads=kvg, head_dim=dg,
              name=f"bytes with grouped-query attention, {n} ranks").returns[0]
    table([[name, b[name, hg] / 2**10, b[name, kvg] / 2**10, b[name, kvg] / b[name, hg]] for name in ATTENTION],
          header=["variant", f"KiB sent, K/V with {hg} heads", f"KiB sent, K/V with {kvg} heads (GQA)", "ratio"],
          caption=f"bytes rank 0 wrote in one causal forward+backward, s = {Sg}, {hg} query heads, head dim {dg}, "
                  f"float32; the ring and all-gather move only K/V and dK/dV (expected ratio {kvg}/{hg}), "
                  "Ulysses also moves q and the output")


def ulysses_section():
    from util.measure import machine, timing_ranks
    note("## Ulysses: trade the sequence split for a head split")
    layouts = spawn(ulysses_layouts, 4, name="Ulysses' all-to-all on labelled data, 4 ranks")
    if not layouts.skipped:    # torchrun with fewer ranks: the page says why, the section goes on without it
        figure(ulysses_picture(layouts.returns),
               caption="Ulysses' first all-to-all on 4 ranks, run on data labelled with the rank that held it: "
                       "each rank gives every other rank its positions of that rank's heads, so afterwards a "
                       "rank holds whole sequences of its own heads, every colour in its row (4 heads, 8 positions).")
    note("""
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
    for ranks in (2, 4):
        run = spawn(compare_variants, ranks, seq_len=S, heads=h, head_dim=d, variants=["ring", "ulysses", "all-gather"],
                    repeats=1, name=f"bytes: ring vs Ulysses vs all-gather, {ranks} ranks")
        if run.skipped:
            continue
        r = run.returns
        shard = shards[ranks] = r[0]["ring"]["shard_bytes"]
        for name in ("ring", "ulysses", "all-gather"):
            model = {"ring": (2 * (ranks - 1) + 2 * (ranks - 1) + 2 * ranks) * shard,
                     "ulysses": 2 * 4 * (ranks - 1) / ranks * shard,
                     "all-gather": (2 * (ranks - 1) + 2 * (ranks - 1)) * shard}[name]
            rows.append([ranks, name, r[0][name]["sent_forward"] / 2**20, r[0][name]["sent"] / 2**20, model / 2**20])
    table(rows, header=["ranks", "variant", "sent in forward (MiB, measured)", "forward+backward (MiB, measured)",
                        "forward+backward (model)"],
          caption=f"bytes rank 0 wrote to its sockets (/proc/self/io), s = {S}, {h} heads, head dim {d}, float32; "
                  f"model: ring 2(n−1) K/V forward + 2(n−1) K/V and 2n dK/dV backward shards; Ulysses 4 all-to-alls "
                  f"each way of (n−1)/n shard; all-gather and reduce-scatter as rings")
    got = {(row[0], row[1]): row[3] * 2**20 / shards[row[0]] for row in rows}   # fwd+bwd bytes in q shards
    if (4, "ring") in got:     # not when torchrun started fewer than 4 ranks
        cheat("ring attention bytes", "per rank, forward + backward: $(6n-4)$ K/V-sized shards (K, V around the ring twice, dK/dV once)",
              round(got[4, "ring"], 2), "shards", what="rank 0 at n = 4, measured from /proc/self/io (model: 20)")
        cheat("Ulysses bytes", "per rank, forward + backward: $8\\,\\frac{n-1}{n}$ shards (4 all-to-alls each way)",
              round(got[4, "ulysses"], 2), "shards", what="rank 0 at n = 4, measured from /proc/self/io (model: 6)")
    extra = [(row[0], (row[3] - row[2]) / (2 * (row[0] - 1) * shards[row[0]] / 2**20)) for row in rows if row[1] == "all-gather"]
    note(f"""
        The ring and Ulysses send what the model says, plus small headers. The all-gather
        variant's backward sent {", ".join(f"{x:.1f}× ({n} ranks)" for n, x in extra)} the bytes a
        ring reduce-scatter of dK/dV needs: gloo's reduce-scatter on CPU is a full all-reduce
        (NCCL's is a ring). Ulysses' volume per rank falls as n grows, the ring's grows: at large
        n that is Ulysses' advantage, and its head limit is the price.
    """)
    ulysses_against_the_ring(S, h, d, n, got)
    refusal = spawn(ulysses_refusal, 4, heads=2, name="Ulysses with 2 heads on 4 ranks")
    said = "." if refusal.skipped else f': *{refusal.returns[0].rstrip(".")}.*'
    note(f"""
        With 2 heads on 4 ranks Ulysses refuses{said} USP combines Ulysses with a ring to go
        past that limit:
    """)


def ulysses_against_the_ring(S, h, d, n, got):
    """The variants' times (variant_run) and what they say; nothing where that demo was skipped."""
    from util.measure import compare, machine
    if variant_run() is None:
        return
    t = {name: x["time"] for name, x in variant_run()[0].items()}
    table([[name, t[name].ms()] for name in ("ring", "all-gather", "ulysses")],
          header=["variant", "forward+backward"],
          caption=f"the three variants' times from the run of the all-gather section (one measurement per page); "
                  f"causal, s = {S}, {h} heads, head dim {d}, float32; {machine(n)}")
    bytes_ratio = got[n, "ulysses"] / got[n, "ring"] if (n, "ulysses") in got else None
    verdict = compare(t['ulysses'], t['ring'], 'Ulysses', 'the ring')
    note(f"""
        Ulysses against the ring: {verdict}.{f" Ulysses sent {bytes_ratio:.2f}× the ring's bytes at {n} ranks." if bytes_ratio else ""}
        On this machine the bytes do not decide the time; what differs is how the two wait. The ring posts each transfer
        without blocking and computes while it travels; each of Ulysses' eight all-to-alls per
        forward+backward blocks until every rank has arrived, so a rank held up by the other
        processes on these cores holds all of them up, and every all-to-all also copies whole
        tensors between sequence order and head order. On GPUs with NVLink the all-to-alls are
        short and Ulysses' smaller, n-independent volume is what counts.
    """)


def mixture_of_experts():
    note("## Mixture of experts: router, capacity, balance loss")
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
    steps = 40 if settings.quick else 200
    configs = [{"aux": 0.0}, {"aux": 0.01}, {"aux": AUX_WEIGHT}, {"bias": BIAS_STEP}]
    labels = ["no balancing", "balance loss α = 0.01", f"balance loss α = {AUX_WEIGHT}", f"bias, γ = {BIAS_STEP}"]
    r = spawn(train_moe_gpt, len(configs), configs=configs, steps=steps, batch_size=8,
              name="MoE GPT training: each rank one way of balancing").returns
    fig = moe_figure(counts, labels, r)
    figure(fig, caption=f"lecture 01's GPT with 4-expert top-1 MoE MLPs (capacity factor 1.25), {steps} steps "
                        "of AdamW; each way of balancing trained on its own rank, side by side (the last one is "
                        "DeepSeek-V3's bias, a deep dive below)")
    note(r"""
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
    note("""
        Two variations matter in practice. **Shared experts** (DeepSeek-MoE, Dai et al. 2024): a
        few experts see every token, ungated, beside the routed ones, so common knowledge need not
        be copied into every routed expert; in expert parallelism they are replicated like the
        router and reduce their gradients over all ranks. **Dropless** routing (capacity factor
        "no limit" below) drops nothing; what that costs is the subject of a subsection of expert
        parallelism.
    """)
    see("https://arxiv.org/abs/2401.06066", "Dai et al. 2024: DeepSeekMoE: Towards Ultimate Expert Specialization in Mixture-of-Experts Language Models")
    table(rows, header=["capacity factor", "capacity C (slots per expert)", "dropped choices", "fraction dropped"],
          caption="an untrained top-2 router over 8 experts, 512 tokens: dropped choices vs capacity factor")
    tail = max(1, steps // 10)
    mean = lambda xs: sum(xs[-tail:]) / tail
    spread = lambda tpe: value_range(min(min(l) for l in tpe), max(max(l) for l in tpe), decimals=0)
    table([[label, mean(log["loss"]), mean(log["aux"]), mean(log["max_load"]), mean(log["dropped"]),
            spread(log["tokens_per_expert"])] for label, log in zip(labels, r)],
          header=["balancing", "loss", "balance loss", "busiest / mean load", "dropped fraction",
                  "tokens per expert, last step (fewest–most, any layer)"],
          caption=f"means over the last {tail} steps")
    _TRAINING.update(logs=r, labels=labels, configs=configs, steps=steps)
    load = {label: mean(log["max_load"]) for label, log in zip(labels, r)}
    note(f"""
        Without balancing the busiest expert ended at {load[labels[0]]:.2f}× the mean load. With
        the balance loss (α = {AUX_WEIGHT}) it ended at {load[labels[2]]:.2f}×. How the weight α was chosen,
        what balancing does to the loss, and balancing without a loss are a deep dive:
    """)


def expert_parallelism():
    from util.measure import machine
    note("## Expert parallelism: all-to-all dispatch and combine")
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
            spaced = lambda counts: " · ".join(map(str, counts))   # rank 0's count first
            rows.append([n, rank, spaced(st["rows_sent"]), spaced(st["rows_received"]), sum(st["rows_received"]),
                         x["sent"] / 2**10,
                         2 * (remote + returned) * d_model * 4 / 2**10])
        recv = [sum(x["stats"]["rows_received"]) for x in r]
        last_rows = [x["stats"]["rows_sent"] for x in r]
        imbalance.append([n, (out - ref["out"]).abs().max().item(), same_drops, max(recv) / (sum(recv) / n),
                          f"{r[0]['time'].ms()} ({machine(n)})"])
    dispatch_figure(last_rows, n)
    note("""
        Put E/n experts on each of n ranks; each rank routes its own tokens. Two rounds of
        `all_to_all_single` move the tokens: *dispatch* sends each kept (token, choice) row to the
        rank owning that expert, the experts run, and *combine* sends the results back, to be
        weighted by the gates. The splits are uneven and change every step, so the ranks first
        exchange how many rows each will send (a small all-to-all of counts) to size the buffers.
        Here the choice counts are also all-gathered first, so every rank knows the global queue
        positions and drops exactly the tokens one process would; the layer then equals the
        one-process `MoE` on all ranks' tokens: outputs, gradients, dropped tokens. That extra
        all-gather is a device for checking against one process; real systems do without it (a
        subsection below).
    """)
    see(AllToAll)
    see(ExpertParallelMoE)
    r4 = [row for row in rows if row[0] == 4 and row[1] == 0][0]
    cheat("EP all-to-all bytes", "per rank, forward + backward: (rows dispatched to other ranks + rows returned to "
          "them) × $d_{\\text{model}}$ × 4 bytes × 2 passes",
          round(r4[5], 1), "KiB", what=f"rank 0 of 4, {tokens} tokens, top-{k}, measured (model: {r4[6]:.1f} KiB)")
    table(rows, header=["ranks", "rank", "rows sent to each rank", "rows received from each", "expert rows on this rank",
                        "KiB sent fwd+bwd (measured)",
                        "KiB model: (rows dispatched out + rows returned) × d_model × 4 B × 2 passes"],
          caption=f"{tokens} tokens per rank, d_model {d_model}, {E} experts, top-{k}, capacity factor 1.25, float32")
    table(imbalance, header=["ranks", "max |Δ output| vs one process (float64)", "same tokens dropped",
                             "busiest rank's rows / mean", "layer forward+backward"],
          caption="equality and imbalance; each row's timing names its ranks")
    note("""
        Measured bytes include the backward pass, which repeats both all-to-alls in reverse, and
        the small count exchanges. The busiest rank sets the pace: the balance loss that evens
        out experts also evens out the ranks.
    """)
    capacity_per_rank()


def capacity_per_rank():
    note("""
        ### Capacity per rank, and dropless
        GShard, Switch and Megatron do not exchange choice counts: each rank queues its own
        tokens and gives each expert C = ⌈factor · T_r · k / E⌉ of them, from its own token count
        T_r (`RankCapacityMoE` overrides only that step). One collective per layer less, and a
        different layer: it equals one process applied to each rank's tokens as a batch of its
        own (GShard's *groups*), so which tokens drop depends on how each rank's tokens route.
        **Dropless** routing (MegaBlocks, Gale et al. 2023; DeepSeek-V3 drops no token in
        training) sets no capacity at all: nothing drops, and an expert's batch, and so a rank's,
        is as large as the router makes it, different every step. Each is checked against its
        one-process reference:
    """)
    see("https://arxiv.org/abs/2211.15841", "Gale et al. 2023: MegaBlocks: Efficient Sparse Training with Mixture-of-Experts")
    see(RankCapacityMoE)
    n, tokens = 4, 64
    kw = dict(d_model=16, d_ff=32, n_experts=8, top_k=2, capacity_factor=1.0)
    r = spawn(capacity_scopes, n, layer_kw=kw, tokens=tokens, name=f"capacity over all ranks, per rank, none: {n} ranks").returns
    refs = {"all ranks": moe_reference(kw, [tokens] * n), "per rank": moe_reference(kw, [tokens] * n, capacity="rank"),
            "dropless": moe_reference(dict(kw, capacity_factor=None), [tokens] * n)}
    rows = {}
    for scope, ref in refs.items():
        got = torch.cat([x[scope]["out"] for x in r])
        recv = [sum(x[scope]["stats"]["rows_received"]) for x in r]
        rows[scope] = [scope, (got - ref["out"]).abs().max().item(), ref["dropped"] / (n * tokens * kw["top_k"]),
                       max(recv), max(recv) / (sum(recv) / n)]
    table(list(rows.values()), header=["capacity counted over", "max |Δ output| vs its one-process reference",
                                       "fraction of choices dropped", "busiest rank's expert rows",
                                       "busiest / mean"],
          caption=f"{n} ranks × {tokens} tokens, {kw['n_experts']} experts top-{kw['top_k']}, capacity factor "
                  f"{kw['capacity_factor']} (dropless: none), an untrained router, float64. References: one batch of "
                  "all tokens; each rank's tokens alone; one batch without capacity")
    a, b, c = rows["all ranks"], rows["per rank"], rows["dropless"]
    bound = kw["n_experts"] // n * capacity(kw["capacity_factor"], n * tokens, kw["top_k"], kw["n_experts"])
    note(f"""
        At the same factor, capacity per rank dropped {b[2]:.1%} of the choices against {a[2]:.1%} when
        counted over all ranks' tokens. Dropless kept every choice, and its busiest rank computed
        {c[3]} expert rows, {c[4]:.2f}× the mean. The capacity over all ranks bounds a rank's
        rows at E/n · C = {bound}, and its busiest computed {a[3]}. Without a capacity the
        buffers, and the time, follow the router.
    """)


def expert_gradient_groups():
    import matplotlib.pyplot as plt
    note("## Which gradients reduce over which group")
    kw = dict(d_model=16, d_ff=24, n_experts=4, top_k=2, capacity_factor=None)
    world, ep, tokens = 4, 2, 12
    ep_groups, edp_groups = ep_dp_groups(world, ep)
    counts, starts = expert_owners(kw["n_experts"], ep)
    colors = plt.get_cmap("tab10").colors
    fig = expert_groups_figure(ep_groups, edp_groups, ep, world, starts, colors, counts)
    figure(fig, caption="4 ranks as EP = 2 (rows, blue: the experts split, tokens dispatched by all-to-all) × "
                        "DP = 2 (columns, red: the same experts, gradients all-reduced). The router's gradient "
                        "is summed over all 4 ranks")

    note("""
        In a real job expert parallelism sits inside data parallelism: the experts are split over
        an EP group of ranks, and that group is replicated over data-parallel copies, each with
        its own tokens. The router (and every weight outside the MoE layers: attention,
        embeddings) is on every rank, so its gradient is summed over **all** DP × EP ranks. An
        expert lives on one rank per EP group, so its gradient is summed only over the ranks
        holding that same expert: the **expert-data-parallel** group, of size DP. Below, 4 ranks
        as EP = 2 × DP = 2, checked against one process on all their tokens, with the right groups
        and with two mistakes.
    """)
    see(ep_dp_groups)
    r = spawn(expert_data_parallel, world, ep=ep, layer_kw=kw, tokens=tokens,
              name="expert parallelism inside data parallelism, gradients by group").returns
    moe = moe_layer(**kw)
    xs, ws = moe_inputs(world, [tokens] * world, moe.d_model)
    (moe(torch.cat(xs)) * torch.cat(ws)).sum().backward()
    ref = {n: p.grad for n, p in moe.named_parameters()}
    rows = []
    for way in ("right", "router over EP only", "experts over all ranks"):
        got = {}
        for x in r:
            got.update(x[way])
        err = lambda pred: max((got[n] - g).abs().max().item() for n, g in ref.items() if pred(n))
        rows.append([way, err(lambda n: n == "router.weight"), err(lambda n: n != "router.weight")])
    table(rows, header=["how the gradients were summed", "router: max |Δ| vs one process",
                        "experts: max |Δ| vs one process"],
          caption=f"EP = {ep}, DP = {world // ep}, {kw['n_experts']} experts top-{kw['top_k']}, {tokens} tokens per "
                  "rank, no capacity limit (so one process drops nothing either), float64")
    b = r[0]["bytes"]
    note(f"""
        Only the right groups reproduce one process. The two reductions also differ in size:
        rank 0 sent {b["router"] / 2**10:.1f} KiB for the router's {r[0]["numel"]["router"]} numbers over
        all {world} ranks and {b["experts"] / 2**10:.1f} KiB for its experts' {r[0]["numel"]["experts"]} over
        its expert-data-parallel group of {world // ep}: in a large MoE most parameters are experts, so
        most gradient traffic runs in the smaller groups.
    """)


def what_to_remember():
    note("""
        ## What to remember
        - Context parallelism splits the sequence; only attention needs other ranks' K/V, and
          activation memory per rank falls as 1/n.
        - Ring attention passes K/V blocks around and merges partials by log-sum-exp; its
          transfers hide only when a block's compute outlasts its transfer (long blocks).
        - Causal masking gives contiguous chunks a (2n − 1) : 1 imbalance; zig-zag or striped
          layouts give every rank the same work, which speeds the step by at most (2n − 1)/n,
          never 2×.
        - All-gather CP is simpler and holds the whole K/V (small under GQA: send kv_heads, repeat
          after the transfer); Ulysses sends a volume that does not grow with n but needs
          heads ≥ ranks. PyTorch's `context_parallel` all-gathers K/V by default.
        - A MoE router picks top-k experts, capacity drops the overflow (dropless: none, and
          batches that follow the router), shared experts see every token, and a balance loss
          (or DeepSeek-V3's bias) keeps the experts evenly loaded; the router z-loss keeps the
          logits small.
        - Expert parallelism moves tokens with two all-to-alls; real systems size capacity per
          rank; router and shared weights reduce over all DP × EP ranks, experts over their
          expert-data-parallel group.

        The companion notebook, `lectures/notebooks/lecture_06_context_and_expert_parallel.ipynb`,
        runs every section of this page cell by cell, with its knobs at the top.
    """)


def main():
    try_it_yourself(notebook_exercises("lecture_06_context_and_expert_parallel"))   # its notebook's exercises, for the page
    intro()                      # what the two splits are
    what_needs_other_ranks()     # CP touches only attention; memory per rank ~ s/n
    with deep_dive("Context parallelism at published scale",
                   "torchtitan's Llama 3.1 8B from 32K to 256K tokens: attention's extra work, and what CP costs"):
        cp_at_published_scale()
    ring_attention_section()     # the ring, its merge, its backward, the overlap measured
    with deep_dive("Ring attention with the core released",
                   "each block followed by a stand-in that leaves the core to gloo: how much of a hop hides"):
        ring_released()
    load_balance_section()       # causal masking unbalances contiguous chunks; zig-zag
    allgather_section()          # the simpler variant and what it costs in memory
    ulysses_section()            # all-to-all to head shards: bytes compared, its limit
    with deep_dive("Ulysses × ring (USP)", "how a 2-D grid of ranks lifts Ulysses' limit of one rank per head"):
        usp_deep_dive()
    with deep_dive("PyTorch's own: context_parallel",
                   "what torch's context_parallel really runs (all-gather by default), beside ours on CPU"):
        pytorch_context_parallel()   # PyTorch's own, with a small CPU shim
    mixture_of_experts()         # router, capacity, balance loss, in training
    with deep_dive("Balancing the experts", "the balance loss's weight, DeepSeek-V3's bias instead of a loss, "
                                            "and the router z-loss, trained beside the runs above"):
        balancing_deep_dive()
    expert_parallelism()         # experts across ranks, tokens by all-to-all
    with deep_dive("Node-limited routing", "why DeepSeek-V3 sends each token to at most 4 nodes"):
        node_limited_deep_dive()
    expert_gradient_groups()     # EP inside DP: which gradients reduce over which group
    what_to_remember()           # the lecture in six lines, and its notebook


def bench():
    """Ring vs all-gather vs Ulysses (fwd+bwd) side by side; zig-zag's work balance vs contiguous."""
    from util.measure import timing_ranks
    n = timing_ranks(4)
    S, h, d = 1024, 8, 32
    r = spawn(compare_variants, n, seq_len=S, heads=h, head_dim=d, variants=["ring", "all-gather", "ulysses"],
              name="bench: ring vs all-gather vs Ulysses").returns[0]
    t = {k: v["time"].median for k, v in r.items()}
    Sb, hb, db = balance_sizes()
    shares = spawn(rank_compute, 1, seq_len=Sb, heads=hb, head_dim=db, ranks=4,
                   name="bench: each rank's attention work alone").returns[0]
    balance = {}
    for layout in ("contiguous", "zigzag"):
        c = [shares[layout, r].q1 for r in range(4)]
        work = ring_work(Sb, 4, layout)
        balance[layout] = (max(c) / min(c), max(c), max(work) / min(work))
    return [f"lecture_06: ring {t['ring'] * 1e3:.1f} ms vs all-gather {t['all-gather'] * 1e3:.1f} ms: ratio "
            f"{t['ring'] / t['all-gather']:.2f}; vs Ulysses {t['ulysses'] * 1e3:.1f} ms: ratio {t['ring'] / t['ulysses']:.2f} "
            f"(causal fwd+bwd, s={S}, {n} ranks)",
            f"lecture_06: causal attention on 4 ring ranks, max/min work per rank counted: contiguous "
            f"{balance['contiguous'][2]:.2f}, zig-zag {balance['zigzag'][2]:.2f}; each share timed alone: contiguous "
            f"{balance['contiguous'][0]:.2f}, zig-zag {balance['zigzag'][0]:.2f}; busiest share "
            f"{balance['contiguous'][1] * 1e3:.1f} ms vs {balance['zigzag'][1] * 1e3:.1f} ms "
            f"(zig-zag / contiguous {balance['zigzag'][1] / balance['contiguous'][1]:.2f})"]
