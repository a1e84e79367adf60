"""Tensor and sequence parallelism: split every matrix of a layer across ranks

Each rank holds a slice of every weight matrix and computes its slice of every product; a few
collectives, written as autograd functions with their forward *and* backward, put the
slices back together. The GPT of lecture 01 is split this way, checked against one process, and
then split again with PyTorch's DTensor sharding annotations.
"""
import math

import torch

from exercises import listing as notebook_exercises
from lectures.model.gpt import GPT, GPTConfig
from lectures.model.memory import saved_bytes
from lectures.tensor_parallel.layers import (ColumnParallelLinear, ColumnParallelLinearFunction, RowParallelLinear,
                                             SequenceParallelLayerNorm)
from lectures.tensor_parallel.attention import ShareKVHeads, TensorParallelAttention
from lectures.tensor_parallel.gpt import check_splittable, dtensor_plan, gpt_plan, parallelize_gpt
from lectures.tensor_parallel.ops import (AllGatherSequence, CopyToRegion, GatherFromRegion, ReduceFromRegion,
                                          ReduceScatterSequence, ScatterToRegion)
from lectures.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy
from lectures.tensor_parallel.figures import (cut_figure, fg_figure, gqa_figure, sp_split_figure, placements_picture,
                                              memory_per_rank_figure, vocab_parallel_figure, training_loss_figure,
                                              sp_activation_figure, gemm_efficiency_figure)
from lectures.tensor_parallel.deep_dives import async_tensor_parallelism, dropout_and_random_numbers
from lectures.tensor_parallel.demos import (RING_UNITS, activation_formula, activation_memory,
                                            attention_cases, compare_with_dtensor, gemm_rates, linear_demo,
                                            max_diff, mlp_comms, redistribute_table, refuse_split,
                                            rank0, replicated_grad_reduction, sequence_units, sp_traffic, time_steps,
                                            traced_block, train_reference, train_tp, training_state_bytes,
                                            vocab_demo, released_async_tp, hidden_share)
from lectures.data_parallel.figures import overlap_bars
from lectures.data_parallel.overlap import gain_words
from lectures.model.figures import published_figure
from lectures.model.gpu_evidence import TORCHTITAN_ASYNC_TP
from util import cheat, deep_dive, figure, note, plural, see, settings, spawn, table, timeline
from util import try_it_yourself
from util.measure import with_spread


# =========================================================================================
# The lecture: main()'s sections, in its order (the deep dives are in tensor_parallel/deep_dives.py)
# =========================================================================================

def demo_cfg():
    """Lecture 01's GPT as it trains there (quick: a shorter sequence)."""
    return GPTConfig(seq_len=16) if settings.quick else GPTConfig()


def tp_sizes():
    """The tensor-parallel sizes the demos show: 2 and 4 (quick: 2; the tests cover 4)."""
    return (2,) if settings.quick else (2, 4)


def fmt_counts(counts):
    return ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items())) or "none"


def intro():
    note("""
        # Tensor and sequence parallelism
        Data parallelism (lecture 03) copies the model and splits the batch; it stops helping when
        one layer no longer fits or is too slow on one device. Tensor parallelism splits the
        layer itself: every weight matrix is cut into slices, one per rank, and each rank
        computes its slice of every product. Megatron-LM (Shoeybi et al. 2019) showed that for a
        transformer the cuts can be placed so that a whole MLP or attention block needs a single
        all-reduce forward and a single one backward. Sequence parallelism (Korthikanti et al.
        2022) then splits what is left over (LayerNorms, residual stream) along the sequence.

        Every building block below is a few lines of PyTorch with its backward written out; each
        is checked against one process on real ranks (gloo on CPU, NCCL on GPUs), and the same
        split is then expressed with PyTorch's DTensor sharding annotations.

        **What you will learn.** How a weight matrix is cut by columns or by rows and which
        collective joins the pieces; Megatron's conjugate operators f and g; a tensor-parallel
        MLP, attention (with grouped-query K/V heads) and vocabulary; what each rank then holds;
        sequence parallelism and the activation memory it saves; dropout masks under TP and SP;
        why tensor parallelism's communication sits on the critical path, and how cutting the
        matmul into pieces (async TP) hides part of it.

        **What you need.** Lecture 01's GPT (blocks, heads, LayerNorm) and lecture 02's collectives (all-reduce = reduce-scatter + all-gather); in PyTorch,
        `torch.autograd.Function` (a forward and a hand-written backward) and `nn.Linear`.
    """)
    see("https://arxiv.org/abs/1909.08053", "Shoeybi et al. 2019, Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism")
    see("https://arxiv.org/abs/2205.05198", "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models")


def column_and_row():
    note("## Column- and row-parallel linear")
    n = tp_sizes()[-1]
    r = rank0(spawn(linear_demo, n, name=f"column then row-parallel linear, {n} ranks"))
    if r is not None:       # None: skipped under torchrun with fewer ranks (the page says so), here and below
        figure(cut_figure(n, r["shapes"]), caption=f"the two cuts of a weight matrix over {n} ranks, with the shapes "
               "rank 0 held in this run (math orientation: Y = XA)")
    note("""
        Write a linear layer as $Y = XA$. Cut $A$ by **columns**, $A = [A_1, \\dots, A_t]$: rank $r$
        computes $Y_r = XA_r$, its slice of the output features, and nothing needs adding. Cut the
        next layer's $B$ by **rows**: rank $r$ multiplies its slice $Y_r$ by $B_r$, a full-size
        *partial* result, and the sum over ranks takes an all-reduce. So a column-parallel layer
        followed by a row-parallel one needs no communication in between: the split output of the
        first is exactly the split input of the second.
    """)
    if r is not None:
        table([[k, v] for k, v in r["diffs"].items()],
              header=["max |ours − nn.Linear in one process|", f"{n} ranks (rank 0)"],
              caption="the column → row pair above against the unsplit pair: float32 rounding (the same "
                      "sums, added in another order)")
    see(ColumnParallelLinear)
    see(RowParallelLinear)


def megatron_mlp():
    note("## f and g: the Megatron MLP, one all-reduce each way")
    n = 2 if settings.quick or settings.world_size not in (2, 4) else settings.world_size
    r = rank0(spawn(mlp_comms, n, name=f"Megatron MLP collectives, {n} ranks"))
    if r is not None:
        figure(fg_figure(n, r["ours"]), caption=f"the Megatron MLP on {n} ranks: f where the whole input "
               "enters, g where the partial sums leave; the counts are the ones this run measured (table below)")
    note("""
        $\\mathrm{MLP}(X) = \\mathrm{GELU}(XA)B$ with $A$ cut by columns and $B$ by rows: GELU is
        elementwise, so it runs on each rank's slice, and the only collectives sit at the borders.
        Megatron-LM names them. **f**, where the replicated input enters, is the identity forward
        and an all-reduce backward (each rank's slice of $A$ gives part of the input's gradient);
        **g**, where the partial sums leave, is an all-reduce forward and the identity backward.
        Each is the other's transpose. Counted with PyTorch's `CommDebugMode`, for ours and for the
        same MLP split by DTensor's `ColwiseParallel`/`RowwiseParallel`:
    """)
    if r is not None:
        mlp_counts(n, r)
    note("""
        One all-reduce forward, one backward, for both. The two operators are a few lines each:
    """)
    see(CopyToRegion, lesson=True)
    see(ReduceFromRegion, lesson=True)
    note("""
        Our column-parallel backward also starts the input gradient's all-reduce before it computes
        the weight gradient, so the two overlap (`ColumnParallelLinearFunction`). Gathering and
        splitting the last dimension are a conjugate pair too, and so are sequence parallelism's
        all-gather and reduce-scatter (below).
    """)
    see(ColumnParallelLinearFunction)
    see(GatherFromRegion)
    see(ScatterToRegion)


def mlp_counts(n, r):
    """The collectives of one MLP forward and backward, ours and DTensor's (`mlp_comms`' rank 0)."""
    rows = [[who, fmt_counts(r[who]["forward"]), fmt_counts(r[who]["backward"]), r[who]["bytes"]]
            for who in ("ours", "DTensor")]
    table(rows, header=["", "forward", "backward", "bytes this rank wrote (fwd + bwd)"],
          caption=f"collectives in one MLP forward and backward, {n} ranks, b = 4, s = 8, h = 16, float32 "
                  f"(CommDebugMode; bytes from /proc/self/io); the outputs differ by "
                  f"{r['max |ours - DTensor|']:.1e}")
    act = 4 * 8 * 16 * 4
    if r["ours"]["bytes"] is not None:
        cheat("TP traffic of one MLP (f and g)",
              "one all-reduce of the $(b, s, h)$ activation forward (g) and one backward (f): "
              "$2 \\cdot \\frac{2(t-1)}{t}\\,bsh$ values sent per rank",
              r["ours"]["bytes"], "bytes",
              what=f"measured on the sockets, t = {n}, b·s·h = 512 float32 values ({act:,} bytes; the "
                   f"ring formula gives {int(2 * 2 * (n - 1) / n * act):,}, plus gloo's headers)")


def attention_heads():
    note("## Attention: whole heads per rank")
    base = GPTConfig(n_layers=1, seq_len=8, d_model=32)
    overrides = [dict(n_heads=4), dict(n_heads=8, n_kv_heads=2), dict(n_heads=4, n_kv_heads=1)]
    rows, layouts = [], {}
    for n in tp_sizes():
        cfgs = [dataclasses_replace(base, **o) for o in overrides]
        run = spawn(attention_cases, n, cases=cfgs, name=f"attention heads split, {n} ranks")
        if run.skipped:
            continue
        for i, cfg in enumerate(cfgs):
            ref = train_reference(cfg, steps=1, batch_size=3)
            g = run.returns[0][i]
            layouts[(n, cfg.n_heads, cfg.kv_heads)] = [r[i] for r in run.returns]
            d, h, k = cfg.head_dim, cfg.d_model, cfg.kv_heads
            held = 2 * len(g["kv heads"]) * d * h
            traffic = 0 if g["kv kind"] == "split" else 2 * k * d * (h + 1) * 4
            rows.append([n, cfg.n_heads, k, len(g["q heads"]), len(g["kv heads"]), g["kv kind"],
                         str(g["qkv weight"]), f"{held} of {2 * k * d * h}", traffic,
                         (g["logits"] - ref["logits"]).abs().max().item(), max_diff(g["grads"], ref["grads"])])
    if layouts:
        figure(gqa_figure(layouts), caption="what each rank holds in this run: its query heads (blue) and the K/V "
               "heads they read (orange); an orange head on several ranks is replicated")
    note("""
        Heads are independent until the output projection, so Q, K and V are column-parallel (each
        rank keeps $a/t$ whole heads, which needs $t \\mid a$), attention runs locally, and the output
        projection is row-parallel: again one all-reduce each way. As in Megatron-LM, Q, K and V are
        **one** column-parallel matmul, so one f and one input-gradient all-reduce that overlaps
        their weight gradients.

        Grouped-query attention has fewer K/V heads, $k < a$. When $t \\mid k$ they are split like
        the queries. When $k \\mid t$, each rank's query heads all read one K/V head, so that head is
        replicated on the $t/k$ ranks that read it (vLLM's layout) and its gradient is summed over
        them: $2dh$ K/V elements per rank instead of $2kdh/t$, and one more all-reduce per layer in
        backward. Other combinations are refused. One step of a one-layer GPT against one process:
    """)
    if rows:
        table(rows, header=["tp", "heads", "K/V heads", "Q heads per rank", "K/V heads per rank", "K/V layout",
                            "fused Q/K/V weight per rank", "K/V weight elements per rank (of the whole)",
                            "extra all-reduce in backward (buffer bytes)", "max |Δ logits|", "max |Δ gradient|"],
              caption="float32; the extra all-reduce sums a replicated K/V head's gradient over its readers")
    n = tp_sizes()[-1]
    bad = dataclasses_replace(base, n_heads=n - 1, d_model=8 * (n - 1))
    msg = rank0(spawn(refuse_split, n, cfg=bad, name=f"attention heads: tp={n} does not divide {plural(n - 1, 'head')}"))
    note(f"With {plural(n - 1, 'head')} and {n} ranks there is no way to give each rank whole heads, and "
         f"`parallelize_gpt` says so" + ("." if msg is None else f": *{msg}*"))
    see(TensorParallelAttention)
    see(ShareKVHeads)


def dataclasses_replace(cfg, **changes):
    import dataclasses
    return dataclasses.replace(cfg, **changes)


def vocab_parallel():
    note("## Vocabulary-parallel embedding and cross-entropy")
    vocab = 1024 if settings.quick else 8192
    got = {n: rank0(spawn(vocab_demo, n, vocab=vocab, name=f"vocab-parallel embedding and loss, {n} ranks"))
           for n in tp_sizes()}
    got = {n: r for n, r in got.items() if r is not None}
    if got:
        full = next(iter(got.values()))["full logits"]
        labels = ["one process: the full logits"] + [f"tp={n}: largest tensor a rank holds" for n in got]
        values = [full] + [r["largest"] for r in got.values()]
        fig = vocab_parallel_figure(labels, values, full, got)
        figure(fig, caption=f"vocabulary {vocab}, batch 4 × 32 tokens: with the vocabulary split, the largest "
               "tensor a rank holds is its slice of the logits")
    note("""
        The embedding table and the LM head are $v \\times h$, the largest matrices of a small
        model. Split the vocabulary: rank $r$ owns token ids $[rv/t, (r+1)v/t)$; its embedding writes
        zeros for the tokens it does not own, and g sums the ranks' rows. The LM head is
        column-parallel and keeps its slice of the logits; the loss needs only three per-token
        all-reduces (the max, the sum of exponentials, the target's logit), so the $(b, s, v)$
        logits never exist anywhere. For backward it keeps one fp32 copy of its slice, the
        softmax, computed in place, and writes the gradient softmax − one-hot by hand, as
        Megatron-LM's `_VocabParallelCrossEntropy` does: composed from autograd operations the
        loss would keep two (the shifted logits and their exponentials).
    """)
    if got:
        table([[n, r["loss"], r["ref"], abs(r["loss"] - r["ref"]), r["grad diff"], str(r["local logits"])]
               for n, r in got.items()],
              header=["tp", "loss", "one process", "|Δ loss|", "max |Δ embedding grad|", "local logits"],
              caption=f"vocabulary {vocab}, batch 4 × 32 tokens, h = 32")
    see(VocabParallelEmbedding)
    see(vocab_parallel_cross_entropy)


def training():
    cfg, steps = demo_cfg(), (10 if settings.quick else 60)
    note("## A tensor-parallel GPT trains on lecture 01's task")
    runs = {n: spawn(train_tp, n, cfg=cfg, steps=steps, batch_size=16, name=f"TP GPT trains, tp={n}")
            for n in tp_sizes()}
    runs = {n: run.returns for n, run in runs.items() if not run.skipped}
    if runs:        # the one-process reference is shown beside them (seeded: the order does not matter)
        ref = train_reference(cfg, steps=steps, batch_size=16)
        figure(training_loss_figure(steps, ref, runs, list(runs)),
               caption="training loss, tensor-parallel on top of one process")
    note(f"""
        `parallelize_gpt` applies a plan, in the spirit of torchtitan: the model file stays plain
        PyTorch, and a dict from module names to how each is split is applied afterwards (every
        module that owns parameters must be in the plan, or it refuses). Lecture 01's GPT
        ({cfg.n_layers} layers, h = {cfg.d_model}, {plural(cfg.n_heads, 'head')}, sequence {cfg.seq_len})
        trained for {steps} AdamW steps (batch 16) split over {" and ".join(map(str, tp_sizes()))} ranks,
        beside one process. Two things every rank of a tensor-parallel group must share. *The
        same initial model:* the launcher seeds every rank alike, so a layer built fresh
        (`ColumnParallelLinear(d_in, d_out, group)`) draws the whole weight an `nn.Linear` would
        draw and keeps its own slice — one full layer split, not t copies of one shard — and
        here the plan slices lecture 01's model itself. *The same batch:* each rank computes its
        part of the same tokens (Megatron broadcasts the batch inside the group); ranks fed
        different data return one loss that belongs to no batch, and nothing detects it:
    """)
    rows = []
    for n, r in runs.items():
        spread = max(max_diff(x["params"], r[0]["params"]) for x in r)
        rows.append([n, r[0]["losses"][-1], ref["losses"][-1], max_diff(r[0]["params"], ref["params"]), spread])
    if rows:
        table(rows, header=["tp", "final loss", "one process", "max |Δ parameter| vs one process",
                            "max |Δ| between ranks' gathered parameters"],
              caption=f"after {steps} steps (float32: the differences are rounding, amplified a little by Adam)")
    see(gpt_plan)
    see(parallelize_gpt)


def memory_per_rank():
    """Per-rank weights, gradients and optimizer state under TP: the sharded part falls as 1/t,
    the replicated part (norms, row-parallel biases, positions) does not."""
    cfg = demo_cfg()
    note("## What each rank holds: weights, gradients and Adam's moments")
    full = dict(GPT(cfg).named_parameters())
    n_full = sum(p.numel() for p in full.values())
    # what the plan keeps whole: the norms, the positions, the row-parallel layers' biases
    whole = ("ln1.", "ln2.", "ln_f.", "pos_emb.", "o_proj.bias", "fc_out.bias")
    n_whole = sum(p.numel() for k, p in full.items() if any(w in k for w in whole))
    rows, parts = [], {}
    for t in (1, 2, 3, 4):
        try:
            check_splittable(cfg, t)
        except ValueError:
            continue
        run = spawn(training_state_bytes, t, cfg=cfg, name=f"weights, gradients, Adam per rank, tp={t}")
        if run.skipped:
            continue
        m = run.returns
        if any(r != m[0] for r in m):
            raise RuntimeError(f"tp={t}: ranks hold different amounts: {m}")
        m = parts[t] = m[0]
        total = m["sharded parameters"] + m["replicated parameters"] + m["gradients"] + m["Adam moments"]
        predicted = 16 * ((n_full - n_whole) / t + n_whole)
        rows.append([t, m["sharded parameters"], m["replicated parameters"], m["gradients"], m["Adam moments"],
                     total, predicted, total / (16 * n_full)])
    if parts:
        figure(memory_per_rank_figure(list(parts), parts, n_full),
               caption="what a rank holds between steps, measured: everything shrinks with tp except the "
                       "replicated parameters and their gradients and moments (the bars stand above the dashed "
                       "ideal by 16R(1 − 1/t))")
    note("""
        With AdamW in float32 a rank holds 16 bytes per parameter it owns: the weight, its gradient
        and two moments (lecture 01). A parameter the plan splits is owned by one rank in $t$; one
        it keeps whole (the LayerNorms, the row-parallel biases, the learned positions) by all of
        them. So a rank holds $16\\,(S/t + R)$ bytes for $S$ split and $R$ replicated parameters
        (K/V heads replicated under grouped-query attention add their share back). Measured from
        the tensors each rank holds after one AdamW step:
    """)
    if rows:
        memory_measured(rows, parts, n_full)
    see(training_state_bytes)


def memory_measured(rows, parts, n_full):
    """`memory_per_rank`'s measurements (one row per tp that ran) against 16(S/t + R)."""
    table(rows, header=["tp", "split parameters", "replicated parameters", "gradients", "Adam moments",
                        "total per rank (bytes, measured)", "16·(S/t + R)", "share of one process"],
          caption=f"lecture 01's GPT ({n_full:,} parameters), float32, AdamW; per rank, every rank alike")
    last = rows[-1]
    cheat("TP training state per rank", "$16\\,(S/t + R)$ bytes: $S$ split, $R$ replicated parameters, "
          "float32 AdamW", last[5], "bytes",
          what=f"measured per rank at tp = {last[0]}, {n_full:,} parameters ({last[7]:.1%} of one process)")
    names = ", ".join(f"`{n}`" for n in parts[last[0]]["replicated names"])
    note(f"""
        At tp = {last[0]} a rank holds {last[7]:.1%} of
        {with_spread("one process's bytes", f"{16 * n_full / 1e3:.0f} kB")}, not {1 / last[0]:.1%}: the replicated parameters ({names}) stay whole, and so do their
        gradients and moments. In this small model they are
        {parts[last[0]]['replicated parameters'] / 4 / n_full:.1%} of the parameters. A block's
        replicated ones are two LayerNorms and two biases, $6h$ values, against about $12h^2$
        split ones: at GPT-3's $h$ = 12288 that is {6 / (12 * 12288):.3%}, so in a large model tensor
        parallelism divides the state by almost exactly $t$. What it leaves is replicated across
        the data-parallel ranks; ZeRO (lecture 03) splits it there.
    """)


def sequence_parallelism():
    cfg = demo_cfg()
    sp_collectives(cfg)             # the same bytes as TP, in other collectives
    sp_activation_memory(cfg)       # what it saves: the activations TP left whole
    sp_layernorm_gradients(cfg)     # what it costs: the replicated weights' gradients are partial


def sp_collectives(cfg):
    note("## Sequence parallelism")
    sp_split_figure(cfg, t=2, b=4)
    note("""
        Tensor parallelism leaves the LayerNorms, the residual adds (and dropout) replicated: every
        rank computes them on the whole $(b, s, h)$ activation and keeps it for backward.
        Korthikanti et al. split those along the sequence instead. Entering a tensor-parallel
        region then takes an **all-gather** along the sequence where f stood (backward:
        reduce-scatter), and leaving it a **reduce-scatter** where g stood (backward: all-gather).
        A ring all-reduce *is* a reduce-scatter followed by an all-gather, so in a ring each pair
        moves the bytes of the all-reduce it replaces. One thing adds bytes: the column-parallel
        layers keep only their slice of the sequence for backward, and all-gather it again there
        (Megatron-LM does the same), instead of keeping the gathered input for the whole step.
    """)
    n = 2
    r = rank0(spawn(sp_traffic, n, cfg=cfg, name=f"sequence parallelism: one block's collectives, {n} ranks"))
    if r is not None:
        sp_bytes(n, cfg, r)
    see(AllGatherSequence)
    see(ReduceScatterSequence)


def sp_bytes(n, cfg, r):
    """One block's collectives and bytes with SP off and on (`sp_traffic`'s rank 0), and what they say."""
    table([["off" if not sp else "on", fmt_counts(r[sp]["forward"]), fmt_counts(r[sp]["backward"]), r[sp]["bytes"]]
           for sp in (False, True)],
          header=["SP", "forward", "backward", "bytes this rank wrote, fwd + bwd (median of 5)"],
          caption=f"one transformer block, {n} ranks, b = 4, s = {cfg.seq_len}, h = {cfg.d_model} (CommDebugMode; /proc/self/io)")
    ring = lambda k: (n - 1) / n * r["activation bytes"] * k
    table([["all-reduce", r["all-reduce"], ring(2)],
           ["reduce-scatter", r["reduce-scatter"], ring(1)],
           ["all-gather", r["all-gather"], ring(1)],
           ["reduce-scatter + all-gather", r["reduce-scatter"] + r["all-gather"], ring(2)]],
          header=["collective on one (b, s, h) activation", "bytes this rank wrote (measured)", "ring algorithm (formula)"],
          caption=f"{n} ranks, gloo on this machine, activation {r['activation bytes']} bytes")
    units = sequence_units(r)
    note(f"""
        Counted from the table, in units of $(t-1)/t$ of one $(b, s, h)$ activation (what a ring
        all-gather or reduce-scatter moves per rank; an all-reduce is 2): the block without SP
        moves {units[False]}, with SP {units[True]}, {units[True] / units[False]:.2f}× — the
        backward's re-gathers of the two column-parallel inputs, the price of the activations SP
        does not keep. Only the weight gradient needs a re-gathered input, so each re-gather is
        posted first and travels while the input gradient $dY\\,W$ is computed (Megatron-LM's
        order too). In the ring algorithm (NCCL's), reduce-scatter + all-gather moves exactly
        the bytes of one all-reduce. gloo on CPU does not: its reduce-scatter wrote {r['reduce-scatter'] / r['all-reduce']:.2f}×
        the bytes of its all-reduce (it reduces everything, then keeps a slice), so here the block
        with SP wrote {r[True]['bytes'] / r[False]['bytes']:.2f}× the bytes of the block without,
        which includes the re-gathers and {plural(r[True]['backward'].get('all-reduce', 0), 'small all-reduce')}
        of the LayerNorm and row-parallel bias gradients, which under SP each rank computes from
        its positions only.
    """)


def sp_activation_memory(cfg):
    b = 4
    rows = []
    block, x = GPT(cfg).blocks[0], torch.randn(b, cfg.seq_len, cfg.d_model, requires_grad=True)
    one = saved_bytes(lambda: block(x), exclude=block.parameters())[1]
    formula = activation_formula(cfg, b, 1, False)
    rows.append([1, "—", one, formula, one / formula])
    for t in tp_sizes():
        m = rank0(spawn(activation_memory, t, cfg=cfg, b=b, name=f"sequence parallelism: activation bytes, {t} ranks"))
        if m is None:
            continue
        for sp in (False, True):
            formula = activation_formula(cfg, b, t, sp)
            rows.append([t, "on" if sp else "off", m[sp], formula, m[sp] / formula])
    note("**Activation memory.**")
    fig = sp_activation_figure(rows)
    figure(fig, caption="one block's activation memory per rank: tensor parallelism alone leaves 4 units whole; "
           "with sequence parallelism all 16 shrink with tp (the table's numbers)")
    note("""
        For one block, autograd saves (in units of $bsh$ values, counted from what this code saves)
        the block input and the attention residual (2), the two LayerNorm outputs (2), Q, K, V (3),
        the attention output (1) and the MLP's hidden layer before and after GELU (4 + 4). Tensor
        parallelism splits the last 12 but not the first 4: $4 + 12/t$. With sequence parallelism
        the LayerNorm inputs are slices, and the column-parallel layers save only their input's
        sequence slice and all-gather it again in backward: $16/t$, as in Korthikanti et al.'s
        $sbh \\cdot 34/t$ (their count is in bytes of 16-bit values and includes dropout masks, which
        this GPT has none of; per-token LayerNorm statistics come on top, and CPU SDPA's flash
        kernel keeps no $s \\times s$ matrix, so the paper's $5as/h$ term is absent).
    """)
    table(rows, header=["tp", "SP", "saved for backward, bytes per rank (measured)", "formula", "measured / formula"],
          caption=f"one block's activations, b = {b}, s = {cfg.seq_len}, h = {cfg.d_model}, float32")
    sp_row = next((r for r in rows if r[1] == "on"), None)
    if sp_row is not None:      # None: every tp demo was skipped, and the table has one process's row only
        exact = all(r[2] == r[3] for r in rows)
        note("The measured bytes equal the formula exactly in every row: this code reaches the paper's $16/t$."
             if exact else "Where measured and formula differ, the table's last column says by how much.")
        cheat("Activation memory of a block under TP and SP",
              "$bsh\\,(4 + 12/t)$ values without SP, $16\\,bsh/t$ with SP (float32 here, no dropout)",
              sp_row[2], "bytes",
              what=f"measured per rank at tp = {sp_row[0]} with SP, b = {b}, s = {cfg.seq_len}, h = {cfg.d_model}")
    see(saved_bytes)


def sp_layernorm_gradients(cfg):
    note("""
        **The LayerNorm gradients.** Under SP each rank's LayerNorm sees only its positions, so the
        gradient of its (replicated) weight and bias is a partial sum. They must be all-reduced —
        here, by passing the weights through f — or the replicas drift apart and none equals the
        one-process model:
    """)
    steps = 5
    ref = train_reference(cfg, steps=steps, batch_size=8)
    rows = []
    for sync in (True, False):
        run = spawn(train_tp, 2, cfg=cfg, steps=steps, batch_size=8, sequence_parallel=True, sync_layernorm_grads=sync,
                    name=f"SP LayerNorm gradients {'all-reduced' if sync else 'not all-reduced'}")
        if run.skipped:
            continue
        rr = run.returns
        ln = [k for k in ref["params"] if ".ln" in k or k.startswith("ln_f")]
        rows.append(["all-reduced (f)" if sync else "left out", max_diff(rr[0]["params"], ref["params"]),
                     max((rr[0]["params"][k] - rr[1]["params"][k]).abs().max().item() for k in ln)])
    if rows:
        table(rows, header=["LayerNorm gradients", f"max |Δ parameter| vs one process after {steps} steps",
                            "max |rank 0 − rank 1| of the LayerNorm weights"],
              caption="sequence parallelism, 2 ranks")
    see(SequenceParallelLayerNorm)
    sp_replicated_grad_cost(cfg)
    note("""
        Dropout, which this GPT does not use, meets the same two kinds of activation: a mask on a
        replicated tensor must be the same on every rank, one on a split tensor different on each,
        so tensor parallelism needs two random streams.
    """)


def sp_replicated_grad_cost(cfg):
    from util.measure import compare, machine, timing_ranks
    ranks = timing_ranks(2)
    r = rank0(spawn(replicated_grad_reduction, ranks, cfg=cfg, repeats=7 if settings.quick else 21,
                    name=f"SP: the replicated parameters' gradients, one by one or once, {ranks} ranks"))
    if r is None:
        return
    others = r["backward all-reduces"] - r["tensors"]
    note(f"""
        Passing each replicated parameter through f costs one small all-reduce per tensor in
        every backward: one backward of this SP GPT made {plural(r['backward all-reduces'], 'all-reduce')},
        {f"{r['tensors']} of them" if others else "all of them"} for the LayerNorm weights and biases, the row-parallel biases
        and the position table ({r['bytes']:,} bytes in all){f", {others} for other tensors" if others else ""}.
        Megatron-LM marks these parameters `sequence_parallel` and reduces their gradients once
        per optimizer step, after the last micro-batch's backward, flattened into one buffer
        (`finalize_model_grads` → `_allreduce_layernorm_grads`): off the backward's critical
        path, and once instead of once per micro-batch. The same {r['tensors']} gradients here
        ({machine(ranks)}), all-reduced once flattened against one by one:
        {compare(r['times']['once, flattened'], r['times']['one by one'], 'the flattened all-reduce', "all-reducing them one by one")}.
        With $m$ micro-batches per step ours pays the one-by-one cost $m$ times, Megatron the
        flattened one once. DTensor (below) is the
        other extreme: it leaves these gradients `Partial` and reduces them on every read by
        the optimizer.
    """)


def critical_path():
    tp_timeline_and_step_times(demo_cfg())   # measured here: what waits for what
    tp_at_scale()                           # computed: why tp stays inside a node


def tp_timeline_and_step_times(cfg):
    note("## Communication on the critical path")
    run = spawn(traced_block, 2, cfg=cfg, b=8, name="TP block timeline, 2 ranks")
    if not run.skipped:     # skipped under torchrun with fewer ranks: the page says so, here and below
        figure(timeline(run.spans, title="one TP block: forward, backward and their collectives (2 steps)"),
               caption="per-rank spans measured on the ranks; each async all-reduce runs beside a weight-gradient "
                       "matmul, (the text below says how much of it the matmul covers)")
    note("""
        Data parallelism's all-reduce can hide behind the backward of earlier layers (lecture 03).
        Tensor parallelism's mostly cannot: the next matmul needs the all-reduced activation. Only
        the input-gradient all-reduce of a column-parallel layer has work to hide behind (the weight
        gradient), and a block has two column-parallel matmuls, the MLP's `fc_in` and the
        attention's fused Q/K/V.
    """)
    if not run.skipped:
        tp_block_overlap(run.spans)
    released_core_overlap()
    pub = TORCHTITAN_ASYNC_TP
    gains = [a / v for (_, v), (_, a) in zip(pub.series["vanilla TP"], pub.series["async TP"])]
    figure(published_figure(pub, ratio=("async TP", "vanilla TP")), caption=pub.caption(
        "Async TP's speed-up over TP with blocking collectives, end to end, tp = 8 inside each node."))
    note(f"""
        On H100s, as published by torchtitan, PyTorch's async TP (the same decomposition, with
        symmetric memory moving the chunks) trains {min(gains):.2f}–{max(gains):.2f}× faster
        than TP with blocking collectives, at tp = 8 on NVLink: the collectives it hides are a
        slice of the step, and only that slice shrinks.
    """)
    tp_step_times(cfg)


def tp_block_overlap(spans):
    """What the traced TP block's spans say: which all-reduces ran beside a weight gradient, and how much it hid."""
    mine = [sp for sp in spans if sp["rank"] == 0]
    back = [sp for sp in mine if sp["label"] == "backward"]
    in_back = [sp["label"] for sp in mine if any(b["start"] <= sp["start"] <= b["end"] for b in back)]
    asyncs, blocking = in_back.count("all-reduce (async)"), in_back.count("all-reduce")
    hidden = hidden_share(mine, "all-reduce (async)", "weight gradient (overlapped)")
    note(f"""
        In {plural(len(back), 'backward pass', 'backward passes')} rank 0 ran
        {plural(asyncs, 'asynchronous all-reduce')} (each beside a weight-gradient matmul)
        {f"and {plural(blocking, 'blocking one')}" if blocking else "and no blocking one"}. The forward's two all-reduces (g after `o_proj` and after `fc_out`)
        block: the residual add needs them. How much the weight gradients hide here: they
        overlap {with_spread(f"{100 * hidden['share']:.0f}%", f"{hidden['hidden'] * 1e3:.2f} of {hidden['comm'] * 1e3:.2f} ms")}
        of the asynchronous all-reduces' time, so their marks in the
        figure are that short beside the all-reduces' bars. This block is tiny, so its
        matmuls are short beside gloo's per-message cost; and gloo's copies need the cores the
        matmuls run on. Give the cores back and the overlap shows:
    """)


def released_core_overlap():
    """The async TP ring whose compute stand-in releases the core: the overlap gloo's copies hid above."""
    r = rank0(spawn(released_async_tp, 2, name="async TP ring with a compute stand-in that releases the core, 2 ranks"))
    if r is None:
        return
    figure(overlap_bars({"async TP ring, compute stand-in (core released)": r}),
           caption="async TP's all-gather + matmul ring (lecture 04's appendix) on 2 ranks, each partial matmul "
                   "followed by a stand-in that waits as long as one transfer: medians (bars: interquartile "
                   "range); red: the model")
    note(f"""
        Here each partial matmul of the async-TP ring (the appendix builds it) also waits in a
        stand-in that releases the core (`release_core`, a timed wait, lecture 05's sleep mode),
        as long as one {r['chunk_bytes'] / 2 ** 20:.0f} MB chunk takes to travel. {gain_words(r)}. The model: the rank's own
        chunk needs no transfer, and each later chunk travels while the one before is multiplied,
        so the step is one piece plus $\\max(\\text{{piece}}, \\text{{transfer}})$ per later chunk.
        On a GPU the matmuls run on the SMs and NCCL (or symmetric memory) moves the chunks
        beside them, which is the case this stand-in imitates.
    """)


def tp_step_times(cfg):
    """A training step at tp = 1, 2, 4 on this machine; nothing where the tp=1 and largest-tp run was skipped."""
    from util.measure import machine, timing_ranks
    ranks = timing_ranks(4)
    tps = [t for t in (1, 2, 4, 8) if t <= ranks]
    # tp=1 and the largest tp in one run, taking turns: at tp=1 every rank runs the whole model on its own core
    both = rank0(spawn(time_steps, tps[-1], cfg=cfg, batch_size=16, kinds=("one process", "ours"),
                       repeats=3 if settings.quick else 9, name=f"TP step time, tp=1 and tp={tps[-1]} taking turns"))
    if both is None:
        return
    times = {1: both["one process"], tps[-1]: both["ours"]}
    for t in tps[1:-1]:
        r = rank0(spawn(time_steps, t, cfg=cfg, batch_size=16, kinds=("ours",), repeats=3 if settings.quick else 9,
                        name=f"TP step time, tp={t}"))
        if r is not None:
            times[t] = r["ours"]
    rows = [[t, times[t].ms()] for t in tps if t in times]
    table(rows, header=["tp", "training step, median (IQR)"],
          caption=f"lecture 01's GPT, batch 16, {machine(ranks)}; tp=1 and tp={tps[-1]} timed in one run, taking "
                  f"turns (at tp=1 each of the {tps[-1]} ranks trains its own copy on one core)")
    ratio = times[tps[-1]].median / times[1].median
    why = ("slower: the model is tiny, so the collectives' fixed cost over TCP outweighs what "
           "splitting the matmuls saves" if ratio > 1 else
           f"faster, but short of the ideal 1/{tps[-1]}: every block waits for its collectives")
    note(f"""
        On {machine(ranks)}, each running one thread, a step at tp={tps[-1]} takes
        {ratio:.2f}× the one-process time, {why}.
    """)


def tp_at_scale():
    note(f"""
        On real hardware the question is bandwidth. Per layer, forward and backward, tensor
        parallelism all-reduces the $(b, s, h)$ activation 4 times; a ring all-reduce moves
        $2(t-1)/t$ of it per rank. With SP, 4 all-gather + reduce-scatter pairs move the same
        bytes, and the backward's re-gathers of the column-parallel inputs add 2 more
        all-gathers: {RING_UNITS[True] / RING_UNITS[False]:.2f}× (the sequence-parallelism
        section counts it).
        For a GPT-3-sized layer in bf16 against the link speeds of lecture 02:
    """)
    rows = []
    for name, h, s_, t in (("GPT-3 175B layer", 12288, 2048, 8), ("Llama-2 70B-like layer", 8192, 4096, 8)):
        act = 1 * s_ * h * 2
        per_rank = 4 * 2 * (t - 1) / t * act
        flops = 72 * s_ * h * h / t                # fwd + bwd ≈ 3 × 24·b·s·h² per layer, split t ways
        compute = flops / 989e12                   # H100 SXM dense bf16 peak
        rows.append([name, f"h={h}, s={s_}, b=1, t={t}", per_rank / 1e6, compute * 1e3,
                     per_rank / 450e9 * 1e3, per_rank / 50e9 * 1e3])
    table(rows, header=["", "shape", "MB per rank per layer (fwd + bwd)", "compute ms at peak",
                        "NVLink 450 GB/s: ms", "InfiniBand NDR 50 GB/s: ms"],
          caption="computed, not measured: H100 peak 989 TFLOP/s bf16; link speeds per direction as in lecture 02")
    (a, *_, nv_a, ib_a), (b, *_, nv_b, ib_b) = [[r[0], r[4] / r[3], r[5] / r[3]] for r in rows]
    note(f"""
        Over NVLink, communication takes {nv_a:.2f}× the compute of a {a} and {nv_b:.2f}× of a
        {b}. Over InfiniBand it takes {ib_a:.1f}× and {ib_b:.1f}×. Both columns are
        ideal: the compute assumes the GPU at its peak (a real layer runs below it, which shrinks
        these ratios by the same factor), the links their full speed (a real all-reduce falls
        short of it, which grows them). Over InfiniBand the all-reduces
        would take longer than the matmuls they sit between, and most of them cannot be hidden
        (the next matmul needs their result). Hence tensor parallelism stays inside the NVLink
        domain — a node of 8 GPUs on most machines, 72 GPUs on a GB200 NVL72 rack — and data/pipeline parallelism span nodes. Inside the node, asynchronous tensor
        parallelism cuts each matmul into ring steps so that sequence parallelism's collectives
        travel beside it: the deep dive "Asynchronous tensor parallelism" below traces and times
        it here, beside what PyTorch reports on H100s.
    """)


def gemm_efficiency():
    """A rank's matmul gets thinner as tp grows: measured rate of the MLP's two local matmuls."""
    from util.measure import machine
    on_gpu = torch.cuda.is_available()
    tokens = 256 if not on_gpu else 8192
    widths = ((128, 512) if settings.quick else (128, 512, 1024)) if not on_gpu else (1024, 4096, 8192)
    tps = (1, 2, 4, 8, 16, 32) if not on_gpu else (1, 2, 4, 8, 16, 32, 64)
    note(f"""
        ## Thin matrices run slower
        Splitting a matmul $t$ ways gives each rank $1/t$ of the work, but not $1/t$ of the time:
        a rank's share of the MLP is a $({tokens} \\times h)\\cdot(h \\times 4h/t)$ matmul
        (column-parallel) and a $({tokens} \\times 4h/t)\\cdot(4h/t \\times h)$ one (row-parallel),
        and as $4h/t$ shrinks the matrix gets too thin to keep the arithmetic units busy: there is
        less reuse of each loaded value, and fixed per-call costs weigh more. Measured here
        ({"bf16 on the GPU" if on_gpu else "float32, one CPU thread"}), the rate each share reaches,
        against the unsplit ($t$ = 1) matmul of the same width:
    """)
    see(gemm_rates)
    rates = rank0(spawn(gemm_rates, 1, tokens=tokens, widths=widths, tps=tps, repeats=3 if settings.quick else 7,
                        name="matmul rate of a rank's share"))
    if rates is None:
        return
    fig = gemm_efficiency_figure(widths, tps, rates)
    figure(fig, caption=f"measured: time of the whole matmul on one rank over the time of a 1/t share "
           f"({tokens} tokens, {'bf16 on the GPU' if on_gpu else 'float32, one CPU thread'}); below the dashed line, splitting wastes compute")
    rows = [[h, t, 4 * h // t, rates[(h, t)][0] / 1e9, rates[(h, t)][1] / 1e9,
             rates[(h, t)][0] / rates[(h, 1)][0], rates[(h, t)][1] / rates[(h, 1)][1]] for h in widths for t in tps]
    table(rows, header=["h", "t", "4h/t", "column-parallel GFLOP/s", "row-parallel GFLOP/s",
                        "column efficiency vs t=1", "row efficiency vs t=1"],
          caption=f"measured, median of repeats; {machine(1)}")
    too_thin = lambda h, t: any(rates[(h, t)][k] < 0.8 * rates[(h, 1)][k] for k in (0, 1))
    # the first t from which every share stays too thin (a single dip below 80% followed by
    # shares at full rate is this machine's noise, not the matrix getting too thin)
    slow = {h: next((t for i, t in enumerate(tps) if all(too_thin(h, u) for u in tps[i:])), None)
            for h in widths}
    faster = [h for h in widths if any(rates[(h, t)][k] > 1.1 * rates[(h, 1)][k] for t in tps for k in (0, 1))]
    said = "; ".join(f"h = {h}: from t = {t} on (local width {4 * h // t})" if t else f"h = {h}: not up to t = {tps[-1]}"
                     for h, t in slow.items())
    firsts = [t or math.inf for t in slow.values()]
    if not any(slow.values()):
        verdict = "No share fell below 80% in this range."
    elif firsts == sorted(firsts):
        verdict = ("The narrower the model, the smaller the t at which its shares get too thin: a wide "
                   "model can be split further before each rank wastes compute.")
    else:
        verdict = ("This run does not order the widths as expected (the narrower model first); the "
                   "table's rows say what it measured.")
    note(f"""
        From where a rank's share stays below 80% of the unsplit matmul's rate: {said}. {verdict}
    """ + (f"""
        Some shares run *faster* than the unsplit matmul (h = {", ".join(map(str, faster))}): a
        smaller weight can fit a faster level of the {"GPU's" if on_gpu else "CPU's"} memory hierarchy.
    """ if faster else ""))


def dtensor_section():
    dtensor_redistribute()          # placements, and the collective each change of placement runs
    dtensor_parallelize_module()    # the GPT split by a plan of placements, against ours


def dtensor_redistribute():
    note("## Sharding annotations: DTensor")
    n = 2
    rows = rank0(spawn(redistribute_table, n, name=f"DTensor redistribute table, {n} ranks"))
    if rows is not None:
        placements_picture(rows, n)
    note("""
        Mesh-TensorFlow (Shazeer et al. 2018) first wrote model parallelism as layouts: name the
        tensor dimensions, say which ones are split over which axis of a mesh of devices, and let
        the library insert the collectives. GShard and GSPMD (Lepikhin et al. 2020; Xu et al. 2021)
        made the same idea an annotation on an ordinary program: say how a few tensors are laid out over a mesh of devices, and the compiler
        propagates layouts and inserts the collectives. PyTorch's DTensor is the eager version: a
        tensor carries a `DeviceMesh` and a placement per mesh dimension — `Shard(d)`,
        `Replicate()`, or `Partial()` (each rank holds a summand) — and changing placement runs the
        collective that does it:
    """)
    see("https://arxiv.org/abs/1811.02084", "Shazeer et al. 2018, Mesh-TensorFlow: Deep Learning for Supercomputers")
    see("https://arxiv.org/abs/2006.16668", "Lepikhin et al. 2020, GShard: Scaling Giant Models with Conditional Computation and Automatic Sharding")
    see("https://arxiv.org/abs/2105.04663", "Xu et al. 2021, GSPMD: General and Scalable Parallelization for ML Computation Graphs")
    see("https://pytorch.org/docs/stable/distributed.tensor.html", "PyTorch DTensor documentation")
    if rows is not None:
        table(rows, header=["from", "to", "collective (CommDebugMode)", "local shape before", "after",
                            "values equal the full tensor"],
              caption=f"a {4 * n}×{2 * n} tensor on a mesh of {n} ranks")
    note("""
        Shard → Replicate is an all-gather, Partial → Replicate an all-reduce, Partial → Shard a
        reduce-scatter, Replicate → Shard a local slice with no communication. Shard(0) → Shard(1)
        is an all-to-all on NCCL. gloo has an all-to-all too (`all_to_all_single` runs on CPU, uneven
        splits included), but DTensor's redistribution on CPU does not use it: it all-gathers the
        whole tensor and keeps its slice (and logs a warning whose comment claims gloo lacks
        all-to-all), which is what the table shows. Same result, $t\\times$ the memory and more bytes.
    """)


def dtensor_parallelize_module():
    note("""
        `parallelize_module` applies a plan of such layouts to modules: `ColwiseParallel` shards a
        Linear's weight on dim 0, `RowwiseParallel` on dim 1, `SequenceParallel` runs a LayerNorm
        on sequence shards, `PrepareModuleInput` redistributes a module's input, and
        `loss_parallel()` computes cross-entropy on logits sharded on the vocabulary. The plan for
        the same GPT:
    """)
    see(dtensor_plan)
    cfg = GPTConfig(seq_len=8, d_model=32, n_heads=4, dtype="float64")
    rows = []
    for n, sp in ((2, False), (2 if settings.quick else 4, True)):
        r = rank0(spawn(compare_with_dtensor, n, cfg=cfg, sequence_parallel=sp,
                        name=f"ours vs DTensor parallelize_module, {n} ranks, {'SP' if sp else 'no SP'}"))
        if r is None:
            continue
        rows.append([n, "on" if sp else "off", (r["ours"]["logits"] - r["DTensor"]["logits"]).abs().max().item(),
                     max_diff(r["ours"]["grads"], r["DTensor"]["grads"]),
                     max_diff(r["ours"]["params"], r["DTensor"]["params"]),
                     fmt_counts(r["ours counts"]), fmt_counts(r["ours optimizer counts"]),
                     fmt_counts(r["DTensor counts"]), fmt_counts(r["DTensor optimizer counts"])])
        last = r
    if rows:
        table(rows, header=["tp", "SP", "max |Δ logits|", "max |Δ gradient|", "max |Δ parameter| after 3 AdamW steps",
                            "ours: forward + backward", "ours: AdamW step", "DTensor: forward + backward",
                            "DTensor: AdamW step"],
              caption="float64, the same GPT split both ways; collectives of one whole training step (CommDebugMode)")
    if len(rows) == 2:      # both ran (neither skipped under torchrun with fewer ranks)
        dtensor_against_ours(rows, last)


def dtensor_against_ours(rows, last):
    """What the table of ours against DTensor says: rows[0] without SP, rows[1] and `last` (its
    rank 0's returns) with SP."""
    same = rows[0][5] == rows[0][7] and rows[0][6] == rows[0][8]
    partial = ", ".join(f"`{k}`" for k in last["DTensor partial grads"]) or "none"
    bias = last["DTensor grad placements"].get("blocks.0.attn.o_proj.bias", "?")
    note(f"""
        The two agree to rounding. Without SP a whole step's collectives are {"the same" if same
        else "different"}: {rows[0][5]} and {rows[0][6]} in the optimizer step (ours),
        {rows[0][7]} and {rows[0][8]} (DTensor). With SP ({rows[1][0]} ranks) they differ in where the work is done:
        we all-gather both column-parallel inputs (Q/K/V's and the MLP's) again in backward (keeping only a slice) and all-reduce the
        partial gradients of the replicated LayerNorm weights, row-parallel biases and positions
        during backward, through f, so our optimizer step communicates nothing ({rows[1][6]}). DTensor leaves
        the LayerNorm gradients as `Partial` placements ({partial}); the row-parallel bias gradient
        is `{bias}` (not `Partial`): only the norms are left for the optimizer to reduce.
        A `Partial` gradient is reduced every time the optimizer *reads* it, and AdamW's foreach
        step reads each several times: its step ran {rows[1][8]}. Counting only forward and
        backward, as one easily does, hides that cost. Ours is a few hundred lines you can read;
        DTensor's is a general layout algebra that derives the collectives from the annotations.
    """)


def summary():
    note(f"""
        ## What to remember
        - A column cut ($A = [A_1, \\dots, A_t]$) gives each rank a slice of the output and needs no
          collective; a row cut gives partial sums that an all-reduce adds.
        - f (identity forward, all-reduce backward) and g (all-reduce forward, identity backward)
          bracket a column → row pair: one all-reduce each way per MLP and per attention.
        - Attention splits by whole heads ($t \\mid a$); Q, K, V fused into one column-parallel
          matmul let backward overlap the input-gradient all-reduce with the weight gradient.
          K/V heads are split when $t \\mid k$, else replicated on the ranks that read them.
        - Vocabulary parallelism splits the embedding and LM head; the loss needs three
          per-token all-reduces and the full logits never exist.
        - Sequence parallelism turns each all-reduce into a reduce-scatter + all-gather (the same
          bytes in a ring) and splits the activations TP left whole, at the price of
          re-gathering the column-parallel inputs in backward ({RING_UNITS[True] / RING_UNITS[False]:.2f}× TP's bytes) and
          all-reducing the replicated LayerNorm gradients.
        - A rank holds $16(S/t + R)$ bytes of weights, gradients and Adam state: TP divides the
          split parameters by $t$ (K/V heads too, when $t$ divides them) and leaves the norms,
          positions and row-parallel biases whole.
        - A dropout mask on a replicated activation must be the same on every TP rank, one on a
          split activation different on each: two streams (Megatron's RNG tracker). Masks that
          are a function of a key survive recomputation with no generator state to save.
        - Most of TP's communication blocks the next matmul: keep tp inside the NVLink domain (a node, or an NVL72 rack). Cutting the
          matmul into per-rank pieces on a ring (async TP) lets the sequence-parallel collectives
          travel beside it; each rank's matmul also gets thinner as $t$ grows (a deep dive).

        The companion notebook, `lectures/notebooks/lecture_04_tensor_parallel.ipynb`, runs every
        section above and lets you split the GPT your way (`make jupyter` opens it).
    """)


def main():
    try_it_yourself(notebook_exercises("lecture_04_tensor_parallel"))   # its notebook's exercises, for the page
    intro()
    column_and_row()            # the two ways to split one matrix
    megatron_mlp()              # composing them between f and g: one all-reduce per direction
    attention_heads()           # the same for attention, including GQA
    vocab_parallel()            # the biggest matrices: embedding, head and the loss
    training()                  # the whole GPT, split and trained, equal to one process
    memory_per_rank()           # weights, gradients and Adam per rank: 1/t, except what stays whole
    sequence_parallelism()      # what TP leaves replicated, split along the sequence
    with deep_dive("Dropout and random numbers under TP",
                   "why masks must agree on replicated copies and differ on shards, measured four ways"):
        dropout_and_random_numbers()
    critical_path()             # why TP stays inside a node
    with deep_dive("Thin matrices run slower",
                   "each rank's share of a split matmul, measured: from which t it stays below 80% of "
                   "the unsplit matmul's rate"):
        gemm_efficiency()       # measured: thin matrices run below the machine's rate
    with deep_dive("Asynchronous tensor parallelism",
                   "cutting each matmul into ring steps so the SP collectives travel beside it, traced "
                   "and timed, with PyTorch's GPU figures"):
        async_tensor_parallelism()
    dtensor_section()           # the same thing as sharding annotations
    summary()                   # what to remember, and where to try it


def bench():
    """Our TP GPT step vs DTensor's parallelize_module step, same model and ranks, interleaved."""
    from util.measure import timing_ranks
    n = timing_ranks(2)
    t = spawn(time_steps, n, cfg=GPTConfig(), batch_size=16, kinds=("ours", "DTensor"), repeats=15,
              name="bench: ours vs DTensor TP").returns[0]
    return [f"lecture_04: TP GPT step (tp={n}) {t['ours'].median * 1e3:.1f} ms vs DTensor parallelize_module "
            f"{t['DTensor'].median * 1e3:.1f} ms: ratio {t['ours'].median / t['DTensor'].median:.2f} (target <= 1.1)"]
