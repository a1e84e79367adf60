"""The appendix page of lecture 05: its deep dives, each a section function that main() (or a
section main() calls) runs inside `with deep_dive(...)`, in the order the page reaches them,
with the helpers and rank functions only they use."""
from lectures.model.gpt import GPTConfig
from lectures.pipeline.demos import ALL, chunk_cost, differences, pct, reference_train, train_schedules, units_against
from lectures.pipeline.executor import PipelineExecutor, communication_plans
from lectures.pipeline.figures import posting_order_figure
from lectures.pipeline.schedules import make_schedule
from lectures.pipeline.simulate import (check_schedule, dualpipev_readme_bubble, held, message_order, qi_bubble,
                                        one_stream_makespan, simulate, steady_step, theory_bubble)
from util import figure, note, see, spawn, table
from util.measure import value_range


def tied_embeddings(n):
    """Deep dive: a GPT with tied embeddings on the pipeline, against one process with them, and
    what the tie costs a step."""
    cfg = GPTConfig(n_layers=2 * n, d_model=32, n_heads=2, seq_len=16, dtype="float64", tie_embeddings=True)
    mb_size, steps = 2, 2
    runs = [("1f1b", n + 1, 1), ("zb-v", n + 1, 2)]
    run = spawn(train_schedules, n, cfg=cfg, runs=runs, mb_size=mb_size, steps=steps,
                name=f"tied embeddings vs one process, {n} ranks")
    ref = reference_train(cfg, n + 1, mb_size, steps)
    rows = [[name, v, *(f"{d:.1e}" for d in differences([r[name, m, v] for r in run.returns], ref))]
            for name, m, v in runs]
    size = cfg.torch_dtype.itemsize
    note(f"""
        ## Deep dive: tied embeddings across the pipeline
        With tied embeddings the first stage's token embedding and the last stage's LM head are
        one weight, but in a pipeline they sit on different ranks. As Megatron-LM does, each of
        the two ranks keeps a copy, made equal at the start (the executor's first step gives the
        last stage's copy the first stage's values), and after each step's backward the two
        copies' gradients are summed across those two ranks, so both take the same optimizer
        step: one all-reduce per step of a vocab × hidden
        gradient, here {cfg.vocab_size} × {cfg.d_model} × {size} bytes =
        {cfg.vocab_size * cfg.d_model * size / 2**10:g} KiB between rank 0 and rank {n - 1}. The V
        layouts (ZB-V, DualPipeV) put the first and the last stage on rank 0, so there the sum is
        autograd's own, inside one parameter, and nothing crosses the network — and an
        optimizer must be given that parameter once (`stage_parameters`), or it steps it twice.
    """)
    table(rows, header=["schedule", "chunks v", "max |Δ loss|", "max |Δ gradient|",
                        f"max |Δ parameter| after {steps} steps"],
          caption=f"Lecture 01's GPT with tied embeddings ({cfg.n_layers} layers, float64) on {n} ranks against "
                  "one process with tied embeddings; the LM head's copy is compared with the embedding.")
    see(PipelineExecutor._sum_tied, "PipelineExecutor._sum_tied: the tied embedding's gradient, summed")


def schedules_table(p=4, m=8):
    """Every schedule simulated with F = B and W free, then W = B: the theory beside both."""
    note(f"""
        ## Deep dive: every schedule with W free and with W = B
        The textbook bubbles assume a free weight gradient. Here every list of the page ({p} ranks,
        {m} micro-batches) on the simulator with W = 0 and with W = B, beside that theory.
    """)
    rows, free_w = [], {}
    for name, v in ALL:
        sch = make_schedule(name, p, m, v)
        check_schedule(sch)
        a, b = simulate(sch, chunk_cost(v, W=0)), simulate(sch, chunk_cost(v))
        free_w[name] = a.bubble
        rows.append([name, v, pct(theory_bubble(name, p, m, v)), pct(a.bubble), pct(b.bubble),
                     f"{b.makespan:g}", f"{max(held(sch)) / v:g}"])
    table(rows, header=["schedule", "chunks v", "theory (F=B, W=0)", "simulated, F=B, W=0",
                        "simulated, F=B=W", "makespan, F=B=W", "most micro-batches held"],
          caption=f"{p} ranks, {m} micro-batches; a chunk's action costs 1/v. {free_w_words(free_w)} "
                  "Once W costs as much as B, postponed Ws fill the "
                  "idle slots. Held: micro-batches between F and the release of their activations "
                  "(W when split, else B), the most on any rank, a chunk counting 1/v.")


def free_w_words(free_w):
    """What the split-backward lists do when W is free (W = 0), against 1F1B, from the simulated
    bubbles {name: bubble}: the same, or better or worse by how many points."""
    chunks = dict(ALL)
    base = free_w["1f1b"]
    split = [n for n in ("zb-h1", "zb-h2", "zb-v", "dualpipev") if n in free_w]
    worse = [n for n in split if free_w[n] > base + 1e-9]
    better = [n for n in split if free_w[n] < base - 1e-9]
    same = [n for n in split if n not in worse and n not in better]
    parts = []
    if same:
        parts.append(f"With W = 0 splitting the backward gains nothing: {', '.join(same)} "
                     f"{'has' if len(same) == 1 else 'have'} 1F1B's {pct(base)}")
    if better:
        parts.append("; ".join(f"{n} is shorter ({pct(free_w[n])} against 1F1B's {pct(base)})"
                               + (f", from its {chunks[n]} chunks per rank" if chunks[n] > 1 else "")
                               for n in better))
    if worse:
        parts.append("; ".join(f"{n}'s list, built for F = B = W, loses "
                               f"{100 * (free_w[n] - base):.1f} points when W is free "
                               f"({pct(free_w[n])} against 1F1B's {pct(base)})" for n in worse))
    return "; ".join(parts) + "."


# Qi et al. 2024 (ICLR 2024; arXiv 2401.10241), "Zero Bubble Pipeline Parallelism", Appendix D,
# Table 9: a stage's T_F, T_B, T_W and T_comm in ms, as profiled for its experiments (Section 5):
# (model, p, m, T_F, T_B, T_W, T_comm).
QI_TABLE_9 = [("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601),
              ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527),
              ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377),
              ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408)]
QI_2024 = ("https://arxiv.org/abs/2401.10241",
           "Qi, Wan, Huang, Lin 2024, Zero Bubble Pipeline Parallelism (ICLR 2024; the arXiv version with ZB-V), Appendix D, Table 9: profiled T_F, T_B, T_W, T_comm")


def cost_mixes():
    """{label: (F, B, W, comm)} per stage: F = B = W, then each model of Qi et al.'s Table 9
    with its times divided by its T_F (so F = 1, and the mixes compare on one clock)."""
    mixes = {"F = B = W": (1.0, 1.0, 1.0, 0.0)}
    for model, p, m, tf, tb, tw, tc in QI_TABLE_9:
        mixes[f"{model} model's costs"] = (1.0, tb / tf, tw / tf, tc / tf)
    return mixes


def mix_makespans(p, m, F, B, W, send=0.0):
    """{schedule: simulated makespan} of the zero-bubble comparison at one cost mix."""
    names = [("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("dualpipev", 2)]
    return {n: simulate(make_schedule(n, p, m, v), chunk_cost(v, F, B, W, send)).makespan for n, v in names}


def unequal_costs(p, m):
    """The zero-bubble lists simulated at the costs Qi et al. measured, beside their formulas;
    and ZB-V against ZB-H1 in words, from the makespans, without and with T_comm."""
    mixes = cost_mixes()
    measured = list(mixes.values())[1:]

    def spread(i):          # the measured models' range of one cost, in forwards
        return value_range(min(c[i] for c in measured), max(c[i] for c in measured), decimals=2)
    note(f"""
        ## Deep dive: zero bubble at the costs Qi et al. measured
        The page's zero-bubble lists assume a forward, an input gradient and a weight gradient
        of equal cost. Qi et al. profiled their own runs (Appendix D, Table 9): on GPT models of
        {QI_TABLE_9[0][0]} to {QI_TABLE_9[-1][0]} parameters, B took {spread(1)} of a forward's
        time, W {spread(2)} of it, and a message between stages ($T_{{comm}}$) {spread(3)}. Below,
        each list on the simulator ({p} ranks, {m} micro-batches) at equal costs and at each
        model's measured $T_F$, $T_B$, $T_W$ (divided by its $T_F$), beside Qi et al.'s formulas
        where they give one. Those runs had {QI_TABLE_9[0][1]} to {QI_TABLE_9[-1][1]} stages; only
        their per-stage ratios carry over, so every row here runs at {p} ranks. The formulas have no term for communication, so the table leaves
        $T_{{comm}}$ out; the sentence after it adds it.
    """)
    rows, span, with_comm = [], {}, {}
    for label, (F, B, W, comm) in mixes.items():
        got = span[label] = mix_makespans(p, m, F, B, W)
        with_comm[label] = mix_makespans(p, m, F, B, W, comm)
        across = steady_step(make_schedule("zb-h2", p, m), chunk_cost(1, F, B, W))
        work = m * (F + B + W)
        rows.append([label, f"{F:.2f}, {B:.2f}, {W:.2f}"] +
                    [f"{got[n]:.2f} ({work + qi_bubble(n, p, F, B, W):.2f})" for n in ("1f1b", "zb-h1")] +
                    [f"{got['zb-h2']:.2f}", f"{across:.2f} ({work + qi_bubble('zb-h2', p, F, B, W):.2f})",
                     f"{got['zb-v']:.2f}", f"{got['dualpipev']:.2f}"])
    table(rows, header=["costs", "F, B, W per stage", "1F1B", "ZB-H1", "ZB-H2, one step",
                        "ZB-H2, per step back to back", "ZB-V", "DualPipeV"],
          caption=f"Makespans on the simulator, {p} ranks, {m} micro-batches (a chunk's action 1/2 of a stage's), "
                  "in brackets $m(F+B+W)$ plus Qi et al.'s bubble for 1F1B, ZB-H1 and ZB-H2. Rows 2-5: Qi et al.'s "
                  "profiled times for each model, divided by its $T_F$; communication left out.")
    see(*QI_2024)
    note(f"""
        {zbv_against_zbh1(span)} With every message between two ranks taking the model's
        $T_{{comm}}$ as well (the simulator's send time; at equal costs none),
        {zbv_against_zbh1(with_comm)}
    """)


def zbv_against_zbh1(span):
    """ZB-V against ZB-H1 from the simulated makespans {mix label: {name: makespan}}, in words."""
    shorter = [c for c, got in span.items() if got["zb-v"] < got["zb-h1"] - 1e-9]
    pairs = "; ".join(f"{c}: {got['zb-v']:.2f} against {got['zb-h1']:.2f}" for c, got in span.items())
    if len(shorter) == len(span):
        verdict = "ZB-V is shorter than ZB-H1 at every one of these costs"
    elif not shorter:
        verdict = "ZB-V is not shorter than ZB-H1 at any of these costs"
    else:
        verdict = f"ZB-V is shorter than ZB-H1 at {len(shorter)} of these {len(span)} costs"
    return f"{verdict} ({pairs}), holding the same number of micro-batches ($p$, in half-size chunks)."


def most_idle(sim):
    """The idle time of the rank that idles most in a simulated step."""
    return max(sim.makespan - busy for busy in sim.busy)


def dualpipev_readme_holds(F, B_in, W, ps=range(2, 9), overlaps=(1.0, 0.5, 0.0)):
    """Whether DeepSeek's (S/2 − 1)(F&B + B − 3W) equals the most idle rank of DualPipeV run as
    the reference runs it (each F&B pair one unit, simulate(pair=...)), for every p in `ps`,
    m = 2p, 2p + 3, 4p, and F&B from F + B (no overlap, 1.0) down to the longer of the two
    (a perfect overlap, 0.0). Returns (holds, the largest |formula − simulation|)."""
    full_b, worst = B_in + W, 0.0
    for p in ps:
        for m in (2 * p, 2 * p + 3, 4 * p):
            sched = make_schedule("dualpipev", p, m, 2)
            for share in overlaps:
                fb = max(F, full_b) + share * min(F, full_b)
                sim = simulate(sched, {"F": F, "B": B_in, "W": W}, pair=fb)
                worst = max(worst, abs(dualpipev_readme_bubble(p, F, full_b, W, fb) - most_idle(sim)))
    return worst < 1e-9, worst


def dualpipev_formula(p, m=8):
    """Deep dive: the DualPipe README's bubble formula against DualPipeV run pair by pair (our
    executor) and as the reference runs it (each F&B pair one unit)."""
    lists = {name: make_schedule(name, p, m, 2) for name in ("zb-v", "dualpipev")}
    most = {name: max(held(sch)) / 2 for name, sch in lists.items()}
    unit = {name: simulate(sch, chunk_cost(2)).makespan for name, sch in lists.items()}
    S = 2 * p                                           # DualPipeV's stages: the README's PP
    cost = chunk_cost(2)                                # a chunk's F, B (input) and W: 1/2 each
    F, B_in, W = cost["F"], cost["B"], cost["W"]
    full_b = B_in + W                                   # the README's B is the full backward
    fbs = {"no overlap": F + full_b, "a perfect overlap": max(F, full_b)}
    readme = {k: dualpipev_readme_bubble(p, F, full_b, W, fb) for k, fb in fbs.items()}
    paired = {k: most_idle(simulate(lists["dualpipev"], cost, pair=fb)) for k, fb in fbs.items()}
    ours = most_idle(simulate(lists["dualpipev"], cost))
    holds, _ = dualpipev_readme_holds(F, B_in, W)
    mixes = cost_mixes()
    measured = min(list(mixes)[1:], key=lambda k: mixes[k][2])   # the profiled mix with the cheapest W
    other = chunk_cost(2, *mixes[measured][:3])
    other_holds, other_gap = dualpipev_readme_holds(other["F"], other["B"], other["W"])
    exact = ("equals it exactly" if holds else "does not equal it")
    gap = paired["no overlap"] - ours
    hop_words = (f"which saves each of the $p-1$ hops down the V a backward: $(p-1)B_{{in}}$ = {gap:g} "
                 f"units, a factor only because $F = B_{{in}}$ here" if abs(gap - (p - 1) * B_in) < 1e-9 else
                 f"{gap:g} units apart")
    note(f"""
        ## Deep dive: DualPipeV's bubble formula
        **DualPipeV** is the V-shaped, "cut-in-half" DualPipe. DualPipe (DeepSeek-AI 2024,
        DeepSeek-V3 report) runs micro-batches in both directions through $S$ stages on $S$
        devices, each holding two stages; DualPipeV, which DeepSeek's README credits to Sea AI
        Lab's "cut-in-half" procedure, keeps one direction on $S/2 = p$ devices, rank $r$
        holding stages $r$ and $2p-1-r$. The README gives both $(S/2-1)(F\\&B+B-3W)$ bubble
        and $S + 1$ activations per device ($F$, $B$, $W$ a chunk's forward, full backward
        and weight backward), {S} stages here. $F\\&B$ is a forward of one chunk and a backward
        of the other, from two different micro-batches, run *together*: the overlap is within
        each pair — one's computation runs while the other's messages travel — and it exists
        to hide the expert-parallel all-to-all (dispatch and combine) of DeepSeek's
        mixture-of-experts layers (lecture 06). A CPU rank cannot overlap them, so our
        executor runs each pair's forward, then its backward; the list is transcribed from the
        eight phases of the reference schedule. On the simulator it takes
        {units_against(unit['dualpipev'], unit['zb-v'], "ZB-V")}, holding {most['dualpipev'] * 2:g} chunks against
        ZB-V's {most['zb-v'] * 2:g}.

        Whose idle time does the formula count? Not our executor's: with a chunk's $F$ =
        $B_{{in}}$ = $W$ = {F:g} (so the README's full $B$ = {full_b:g}) and no overlap
        ($F\\&B = F + B$ = {fbs['no overlap']:g}), the formula gives **{readme['no overlap']:g}**
        units per rank, while our pair-by-pair list idles **{ours:g}** on its most idle rank.
        The reference schedule runs a pair as one interleaved unit: it starts when both inputs
        are there and the forward's output leaves only when the whole pair ends. Simulated that
        way (`simulate(..., pair=F&B)`), the most idle rank idles **{paired['no overlap']:g}**
        with no overlap and **{paired['a perfect overlap']:g}** with a perfect one ($F\\&B$ =
        {fbs['a perfect overlap']:g}), where the formula says {readme['no overlap']:g} and
        {readme['a perfect overlap']:g}. For every $p$ from 2 to 8, $m = 2p, 2p+3, 4p$ and
        $F\\&B$ from $F + B$ down to the longer of the two, the simulation {exact} at these
        costs. So the factor of {readme['no overlap'] / ours:g} between the README and our list
        is where the forward's output leaves: after the whole pair in the reference, after the
        forward alone in ours, {hop_words}. The formula also
        assumes $F = B_{{in}} = W$: at the {measured} as Qi et al. profiled them (a
        chunk's $F$ = {other['F']:.3g}, $B_{{in}}$ = {other['B']:.3g}, $W$ = {other['W']:.3g}; the
        appendix's zero-bubble table) it {"still holds" if other_holds else f"is off by up to {other_gap:.2g} units"}
        over the same sizes.
    """)


def notes():
    note("""
        ## Notes
        Pipeline parallelism sends only activations between neighbours — far less than data or
        tensor parallelism — which is why it spans nodes. Its costs are the bubble (fewer with
        more micro-batches, interleaving or zero-bubble schedules), memory (1F1B bounds it;
        checkpointing trades it for compute), and load balance: the first and last stages also
        hold the embeddings and the LM head, so real systems give them fewer layers.
    """)
    for url, title in [
        ("https://arxiv.org/abs/1811.06965", "Huang et al. 2019, GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism"),
        ("https://arxiv.org/abs/1806.03377", "Harlap et al. 2018, PipeDream: Fast and Efficient Pipeline Parallel DNN Training"),
        ("https://arxiv.org/abs/2006.09503", "Narayanan et al. 2021, Memory-Efficient Pipeline-Parallel DNN Training (PipeDream-2BW and PipeDream-Flush, i.e. 1F1B)"),
        ("https://arxiv.org/abs/2104.04473", "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"),
        ("https://arxiv.org/abs/2211.05953", "Lamy-Poirier 2023, Breadth-First Pipeline Parallelism"),
        ("https://arxiv.org/abs/2401.10241", "Qi et al. 2024, Zero Bubble Pipeline Parallelism (ZB-H1, ZB-H2, post-validation)"),
        ("https://arxiv.org/abs/2405.15362", "Qi et al. 2024, Pipeline Parallelism with Controllable Memory (V-shaped schedules, ZB-V)"),
        ("https://hackmd.io/@ufotalent/r1lVXsa9Jg", "Sea AI Lab, the 'cut-in-half' DualPipe that became DualPipeV"),
        ("https://arxiv.org/abs/2412.19437", "DeepSeek-AI 2024, DeepSeek-V3 Technical Report (DualPipe)"),
        ("https://github.com/deepseek-ai/DualPipe", "DeepSeek-AI, DualPipe and DualPipeV reference schedules"),
        ("https://arxiv.org/abs/2407.21783", "Llama Team 2024, The Llama 3 Herd of Models"),
        ("https://docs.pytorch.org/docs/stable/distributed.pipelining.html", "PyTorch: torch.distributed.pipelining"),
    ]:
        see(url, title=title)


def deep_dive_posting_order():
    p, m = 4, 8
    sched = make_schedule("dualpipev", p, m, 2)
    order = message_order(sched)
    src, dst = max(order, key=lambda k: _crossings(sched, k, order[k]))
    sent = order[src, dst]
    needed = _needed_order(sched, dst, src)
    moved = sum(a != b for a, b in zip(sent, needed))
    zb, cost = make_schedule("zb-h1", p, m), {"F": 1, "B": 1, "W": 0.5}
    ideal = simulate(zb, cost).makespan
    unit, timed = (one_stream_makespan(zb, cost, communication_plans(zb, cost=c))
                   for c in (None, cost))
    note(f"""
        ## Deep dive: NCCL matches messages in posting order
        This matters once the executor runs on GPUs. gloo matches a receive to a send by its tag; NCCL ignores tags and pairs the $k$-th
        receive a rank posts for a peer with the $k$-th send that peer posted to it. If a rank
        posts its receives in the order its own actions need them, and the peer sends in
        another order, NCCL delivers same-shaped tensors to the wrong receive: no error, wrong
        gradients. In DualPipeV at p = {p}, m = {m}, rank {src} sends rank {dst} {len(sent)}
        messages, and {moved} of them sit at another position in the order rank {dst} needs
        them (below). Interleaved 1F1B does it too at some sizes where $m$ is not a multiple
        of $p$ (p = 2, m = 5, for one). So the executor posts each message at both ends in the same slot of one
        shared clock (`communication_plan`, from `simulate.message_slots`), which makes every
        pair's posting orders equal; a test runs every schedule with ranks as threads and a
        stand-in that matches as NCCL does.

        Two more of NCCL's rules shape the executor. *One Work per batch:* with CUDA tensors,
        `batch_isend_irecv` coalesces its operations and returns a single Work for the whole
        batch (torch's `_coalescing_manager`), and a receive's buffer holds the data only after
        that Work is waited — so pairing each operation with "its" Work (as gloo's list of Works
        invites) reads buffers that have not arrived. The executor waits every Work of a batch
        before it reads any buffer of it. *One stream, in order:* a rank's batches run one after
        another on one stream, and a large send completes only when its peer's matching receive
        runs; two ranks whose batches wait on each other in opposite orders hang. Posting both
        ends of each message in the same slot of the shared clock rules that cycle out:
        `simulate.p2p_deadlock` replays every rank's posting program under these rules, and a
        test finds no deadlock for any schedule the lecture accepts up to $p = 8$, with the
        clock timed at unit costs or at any of the cost mixes the lecture uses. The same rule
        has a price in time: a batch waits for its partner, so a message ready early can wait
        behind a batch whose partner is still computing. So the clock is timed with the costs
        the run will have (`communication_plan(..., cost=...)`: the sleep lengths, or measured
        F, B, W), and each slot's messages go out as one batch per neighbour (pairs in one
        order on every rank, so still no cycle). Timed on one stream per rank
        (`one_stream_makespan`) at F = B = 1, W = 0.5, p = {p}, m = {m}, ZB-H1's plan takes
        {timed:g} units against the simulator's {ideal:g}{"" if unit == timed else f" (slots from unit costs: {unit:g})"}.
    """)
    figure(posting_order_figure(sent, needed, src, dst), caption=f"DualPipeV, p = {p}, m = {m}: the messages from rank {src} to rank {dst} in the "
                        f"order rank {src} sends them (top) and the order rank {dst}'s actions need them "
                        "(bottom); a: an activation, g: a gradient, with its micro-batch. Red lines: "
                        "messages that would be paired with another one's buffer if receives were posted "
                        "in the order needed.")


def _needed_order(sched, dst, src):
    """The messages from `src` in the order rank `dst`'s actions need them."""
    lay, out = sched.layout, []
    for a in sched[dst]:
        s = lay.stage(dst, a.chunk)
        if a.kind == "F" and s > 0 and lay.place(s - 1)[0] == src:
            out.append(("act", s, a.microbatch))
        elif a.kind == "B" and s < lay.stages - 1 and lay.place(s + 1)[0] == src:
            out.append(("grad", s, a.microbatch))
    return out


def _crossings(sched, pair, sent):
    return sum(a != b for a, b in zip(sent, _needed_order(sched, pair[1], pair[0])))
