"""A run that survives: checkpoints that reshard, clipping across shards, restarts after a failure

Lecture 07's trainer, made to finish a long run: every rank writes its own boxes of the global
tensors with torch.distributed.checkpoint, and any other layout reads them back; the gradient is
clipped by a norm that counts every element once over all axes; a torchrun job loses a rank in
the middle of a step and comes back from its last checkpoint; and the checkpoint interval that
loses the least work is worked out from what a write costs and how often a job fails.
"""
import dataclasses

import torch

from util import cheat, deep_dive, figure, note, published, see, settings, spawn, table, try_it_yourself
from util.measure import compare, machine, timing_ranks

from exercises import listing as notebook_exercises
from lectures.checkpoint.deep_dives import dcp_metadata
from lectures.checkpoint.demos import (COST, ODD, SMALL, boxes_of, checkpoint_costs, clip_norms, lost_work,
                                       reference_norm, restart_job, timings, workdir)
from lectures.checkpoint.figures import draw_boxes, draw_costs, draw_norms, draw_restart, draw_waste
from lectures.checkpoint.pytorch import pytorch_resume, pytorch_save
from lectures.checkpoint.restart import (LLAMA3_405B_PARAMS, LLAMA3_DAYS, LLAMA3_GPUS, LLAMA3_INTERRUPTIONS,
                                         LLAMA3_UNEXPECTED, TECTONIC_SUSTAINED, expected_waste, init_group, young_daly)
from lectures.checkpoint.store import export, load, save, train_resumable
from lectures.layout.estimator import Layout
from lectures.layout.shards import flat_boxes, global_grad_norm, local_pieces
from lectures.layout.trainer import max_param_diff, reference_run
from lectures.model.figures import published_figure
from lectures.model.gpt import param_count
from lectures.model.gpu_evidence import LLAMA3_INTERRUPTION_CAUSES

RESULTS = {}
SAVED_UNDER = ("dp×tp", Layout(dp=2, tp=2, micro_batch=4))
LOADED_UNDER = [
    ("pp×tp", Layout(pp=2, tp=2, micro_batch=1, micro_batches=8)),
    ("dp×cp + ZeRO-2", Layout(dp=2, cp=2, zero=2, micro_batch=2, micro_batches=2)),
    ("dp + ZeRO-1, 2 ranks", Layout(dp=2, zero=1, micro_batch=2, micro_batches=2)),
    ("one rank", Layout(micro_batch=4, micro_batches=2)),
    ("pp, 3 stages", Layout(pp=3, micro_batch=2, micro_batches=4)),
]
QUICK_LOADS = ("pp×tp", "dp×cp + ZeRO-2", "one rank")


def intro():
    note("""
        # A run that survives: checkpoints, clipping across shards, restarts

        Lecture 07 trained one model under any layout for a few steps. A real run takes weeks,
        and in weeks something fails: Llama 3 405B's pre-training on 16,384 H100s saw 466 job
        interruptions in 54 days, 419 of them unexpected — about one every three hours. Each time
        the job restarts from its last checkpoint, often on a different number of GPUs and so in
        a different layout. This lecture makes lecture 07's trainer survive that: **checkpoints
        that load under any other layout**, **clipping by the gradient norm of the whole model**
        while every rank holds only a piece of it, and **a job that loses a rank mid-step** and
        resumes where it saved.

        **You will learn** what each rank of each layout writes, and how a different layout reads
        it back; what a checkpoint costs (bytes per rank, seconds, an asynchronous save's
        blocking time); why a naive norm over shards is wrong, and by how much; how torchrun
        restarts a job, and how often to save. **You need** lecture 07's trainer and layouts,
        ZeRO (lecture 03), tensor parallelism's replicated norms (lecture 04) and a pipeline's
        tied ends (lecture 05).
    """)


def what_a_checkpoint_holds():
    note("## Every rank writes its boxes of the global tensors")
    fc_in, fc_out = "model/blocks.0.mlp.fc_in.weight", "model/blocks.0.mlp.fc_out.weight"
    moment = "optim/exp_avg/blocks.0.mlp.fc_in.weight"
    dp_tp = spawn(boxes_of, 4, run=SMALL, layout=SAVED_UNDER[1], keys=[fc_in, fc_out],
                  name="the boxes each rank of dp×tp writes")
    zero = spawn(boxes_of, 3, run=ODD, layout=Layout(cp=3, zero=2, micro_batch=8), keys=[moment],
                 name="the boxes each rank of cp=3 + ZeRO-2 writes of Adam's first moment")
    d, e = SMALL.cfg.d_model, ODD.cfg.d_model
    panels = []
    for title, demo, key, shape in (("dp×tp: MLP in", dp_tp, fc_in, (4 * d, d)),
                                    ("dp×tp: MLP out", dp_tp, fc_out, (d, 4 * d)),
                                    ("ZeRO-2 ×3: Adam's m", zero, moment, (4 * e, e))):
        if not demo.skipped:
            panels.append((title, shape, [(r, o, s) for r, got in enumerate(demo.returns) for o, s in got["boxes"][key]]))
    if panels:
        figure(draw_boxes(panels),
               caption="Matrices of the GPT's first MLP, and the box of each that every rank writes, in the rank's "
                       "colour. Under dp×tp (4 ranks) the tensor-parallel ranks hold the input weight's rows "
                       "(column-parallel) and the output weight's columns (row-parallel); ranks 2 and 3 hold the "
                       "same boxes as 0 and 1 (drawn once). Under ZeRO-2 over three replicas (a model with "
                       f"h = {e}), each rank holds a third of Adam's moments as a flat range, which lands in the "
                       "matrix as a partial row, whole rows and a partial row.")
    note("""
        A checkpoint of a sharded run must not gather the model on one rank: at scale it does
        not fit there, and one rank's disk link would carry everything. Instead every rank
        writes what it holds, and says where it sits in the unsplit model. For lecture 07's
        trainer that is a list of **boxes**: a column-parallel weight's rows, a row-parallel
        weight's columns, the vocabulary range of the embedding, the fused Q, K and V rows of
        this rank's heads (three boxes in three global tensors), whole copies of the norms;
        under expert parallelism, each expert it holds, whole, under its index in the whole model, whatever ep;
        under ZeRO, Adam's moments are a flat range of each tensor, cut into at most three
        boxes. `local_pieces` finds them from the modules of lectures 04–05 (a module it does
        not know fails loudly, if its shape does not fit); `flat_boxes` cuts a flat range.
    """)
    see(local_pieces)
    see(flat_boxes)
    note("""
        `torch.distributed.checkpoint` (DCP) does the rest. `save` hands its planner every
        rank's boxes; the planner keeps one copy of a box that several ranks hold (the replicas),
        checks that the boxes of each tensor cover it exactly once, and each rank writes one
        file with its boxes, plus one `.metadata` file that maps every box to its file and
        offset. `load` asks, on each rank, for the boxes of the *new* layout; DCP reads from
        each saved box the part that overlaps. The step, the data position (the data of step
        k is a function of k here) and each rank's RNG state are saved beside them (a rank
        the saving layout lacked is seeded from the step and its rank). A
        checkpoint is written to `step-N.partial/` and renamed when every rank is done, so a
        crash mid-save leaves the previous one as the latest.
    """)
    see(save)
    see(load)
    resharding()


def resharding():
    run = SMALL
    ref = reference_run(run)
    cases = [c for c in LOADED_UNDER if not settings.quick or c[0] in QUICK_LOADS]
    rows, worst = [], 0.0
    first = workdir("saved-under-dp-tp")
    saved = spawn(train_resumable, SAVED_UNDER[1].world, run=run, layout=SAVED_UNDER[1], directory=first, until=2,
                  save_every=2, name=f"train 2 steps under {SAVED_UNDER[0]} and save")
    if saved.skipped:
        return
    for name, lay in cases:
        demo = spawn(train_resumable, lay.world, run=run, layout=lay, directory=first, until=4,
                     name=f"load into {name}, train 2 more steps")
        if demo.skipped:
            continue
        got = demo.returns
        diff = max_param_diff(got, ref["params"])
        worst = max(worst, diff)
        rows.append([SAVED_UNDER[0], name, lay.world, got[0]["start"], f"{diff:.1e}",
                     f"{max(abs(a - b) for a, b in zip(got[0]['losses'], ref['losses'][2:])):.1e}"])
    table(rows, header=["saved under (4 ranks)", "loaded into", "ranks", "resumed at step",
                        "max |Δ parameter| vs one process after 4 steps", "max |Δ loss| steps 3–4"],
          caption="One checkpoint, written by dp×tp after 2 steps, loaded by other layouts on 1 to 4 ranks, "
                  "each trained 2 more steps and compared with one process trained 4 (float64 weights, the "
                  "loss in float32: differences of 1e-8 are summation order). tests/test_lecture_08.py runs "
                  "six such pairs in both directions.")
    assert worst < 1e-6, worst
    RESULTS["reshard_worst"] = worst


def what_it_costs():
    note("## What a checkpoint costs")
    ranks = timing_ranks(2)
    layouts = [("dp", Layout(dp=ranks, micro_batch=COST.global_batch // ranks)),
               ("tp", Layout(tp=ranks, micro_batch=COST.global_batch)),
               ("dp + ZeRO-1", Layout(dp=ranks, zero=1, micro_batch=COST.global_batch // ranks))]
    if settings.quick:
        layouts = layouts[:1]
    rows, RESULTS["costs"], wrote, metadata = [], [], {}, {}
    for name, lay in layouts:
        demo = spawn(checkpoint_costs, ranks, run=COST, layout=lay, directory=workdir(f"cost-{name}"),
                     repeats=3 if settings.quick else 5, name=f"checkpoint costs, {name} on {ranks} ranks")
        if demo.skipped:
            continue
        got = demo.returns
        step, sync, blocked, total = (timings(got, k) for k in ("step", "sync", "blocked", "total"))
        rows.append([name, " / ".join(f"{r['mine'] / 2 ** 20:.1f}" for r in got),
                     " / ".join(f"{r['held'] / 2 ** 20:.1f}" for r in got), f"{got[0]['metadata'] / 1024:.0f}",
                     step.ms(), sync.ms(), blocked.ms(), total.ms()])
        RESULTS["costs"].append((name, sync, blocked, total, step))
        wrote[name] = [(r["mine"] / 2 ** 20, r["held"] / 2 ** 20) for r in got]
        metadata[name] = got[0]["metadata"]
    params = param_count(COST.cfg)
    if RESULTS.get("costs"):
        figure(draw_costs([(c[0], (c[4], c[1], c[2], c[3])) for c in RESULTS["costs"]]),
               caption=f"What saving a {params / 1e6:.1f}M-parameter model's weights and Adam moments cost here, "
                       f"{machine(ranks)}: a synchronous save stops training for the whole write; an asynchronous "
                       "one only for the copy (green), then writes in the background while the next step runs "
                       "(blue: until the files are on disk).")
    table(rows, header=["layout", "MiB each rank wrote", "MiB each rank holds (weights + Adam)", "metadata KiB",
                        "training step", "synchronous save", "async: step blocked", "async: until on disk"],
          caption=f"A GPT of {params / 1e6:.1f}M float32 parameters (h = {COST.cfg.d_model}, "
                  f"{COST.cfg.n_layers} layers) after one AdamW step: 12 bytes per parameter to save "
                  f"(weights and two moments), {machine(ranks)}, to this machine's temporary directory; "
                  "median of the slowest rank over the repeats, with the interquartile range.")
    if RESULTS.get("costs"):
        name, sync, blocked, total, step = RESULTS["costs"][0]
        note(f"""
            Replicas hold the same boxes, and DCP's planner gives each replicated box to the rank
            that has the least to write so far: {name} ranks hold the whole model each, but each
            writes about half of it. {metadata_words(metadata)} {uneven_writes(wrote)}

            An asynchronous save (`dcp.async_save`) blocks the step only while it copies this
            rank's tensors; a background thread plans and writes the files on a process group
            of its own (on the training's group its collectives could interleave with the
            step's) while the next step runs. In the time it blocks the step,
            {compare(blocked, sync, "the asynchronous save", "a synchronous one")}. Until the files are on
            disk the asynchronous save takes {total.brief()}, with a training step
            ({step.brief()} alone) running beside it on {machine(ranks)}: the writer and the step
            share the cores. On a GPU the copy is device-to-host into pinned memory, which is
            why torchtitan keeps those buffers between saves.
        """)
        cheat("Checkpoint blocking", "async: barrier + copy; sync: + plan + write", round(blocked.median * 1e3, 1), "ms",
              what=f"{params / 1e6:.1f}M parameters, {name}, {machine(ranks)}")


def metadata_words(metadata):
    """The .metadata sentence, from its measured bytes per layout ({name: bytes})."""
    said = "The `.metadata` file lists every box with its offsets and sizes (the table's metadata column)"
    zero, plain = metadata.get("dp + ZeRO-1"), metadata.get("dp")
    if zero and plain and zero > plain:
        size = (lambda b: f"{b / 1024:.0f} KiB") if round(zero / 1024) != round(plain / 1024) else (lambda b: f"{b:,} bytes")
        said += (f"; ZeRO's flat ranges cut a matrix into up to three boxes, so ZeRO-1's lists more: "
                 f"{size(zero)} against plain data parallelism's {size(plain)}")
    return said + "."


def uneven_writes(wrote):
    """What the rows of the layouts other than dp show (the full build times them), from
    {layout: [(MiB written, MiB held) per rank]}; nothing where the numbers do not show it."""
    said = []
    zero = wrote.get("dp + ZeRO-1")
    if zero and zero[1][0] > 1.3 * zero[0][0]:
        said.append(f"""Under ZeRO-1 rank 0 writes {zero[0][0]:.1f} MiB and rank 1 {zero[1][0]:.1f}.
            "Least so far" is greedy and goes through rank 0's boxes first: rank 0 lists its own
            Adam shard as it goes, so rank 1, with nothing yet, takes the replicated weights, and
            its own shard comes after. The planner balances the boxes it has seen, not those to
            come.""")
    tp = wrote.get("tp")
    if tp and tp[0][0] < tp[0][1] < tp[1][0]:
        said.append("""Under tp the replicas are what tp does not split (the position table, the
            LayerNorms and the row-parallel layers' biases), and rank 1 takes them for the same
            reason: it writes a little more than it holds (with a header per tensor and its RNG
            state), rank 0 a little less.""")
    return " ".join(said)


def clipping_across_shards():
    note("## Clipping by the norm of the whole model")
    run = dataclasses.replace(SMALL, steps=2, max_grad_norm=0.05)
    ref, plain = reference_run(run), reference_run(dataclasses.replace(run, max_grad_norm=None))
    norm = reference_norm(run)
    rows, RESULTS["clip"] = [], []
    for name, lay in (("dp×tp", Layout(dp=2, tp=2, micro_batch=4)),
                      ("pp×tp", Layout(pp=2, tp=2, micro_batch=1, micro_batches=8)),
                      ("dp×cp + ZeRO-2", Layout(dp=2, cp=2, zero=2, micro_batch=2, micro_batches=2))):
        demo = spawn(clip_norms, lay.world, run=run, layout=lay, name=f"clipping under {name}")
        if demo.skipped:
            continue
        got = demo.returns
        rows.append([name, f"{got[0]['once']:.6f}", f"{got[0]['naive']:.6f}", f"{got[0]['naive'] / norm:.2f}×",
                     f"{max_param_diff(got, ref['params']):.1e}", f"{max_param_diff(got, plain['params']):.1e}"])
        RESULTS["clip"].append((name, got[0]["once"], got[0]["naive"]))
    if RESULTS.get("clip"):
        figure(draw_norms(RESULTS["clip"], norm),
               caption="The first step's gradient norm on 4 ranks, counted once (green) and the naive way, each "
                       "rank adding the squares of everything it holds (red), against clip_grad_norm_ in one "
                       "process (dashed).")
    note(f"""
        `torch.nn.utils.clip_grad_norm_(params, c)` scales every gradient by
        $\\min(1, c / (\\lVert g \\rVert + 10^{{-6}}))$, where $\\lVert g \\rVert$ is the 2-norm of
        *all* the gradients together. On a mesh no rank holds all of them: tensor parallelism
        splits the matrices but keeps a whole copy of every LayerNorm and of the row-parallel
        biases on each tp rank; data and context parallelism keep whole replicas; ZeRO-2 gives
        each replica a flat range; a pipeline's tied embedding has a copy on its first and last
        stage. The sum of squares must count every element **once**: each rank adds the squares
        of the boxes it *owns* — of the ranks that hold a box, the lowest — and one all-reduce
        adds the ranks' sums. `Run(max_grad_norm=...)` makes lecture 07's trainer clip this
        way, after the gradient average and before AdamW (under ZeRO, on the gradient shards),
        and `reference_run` clips with `clip_grad_norm_`. Here the first step's norm is
        {norm:.3f}, so a bound of {run.max_grad_norm} bites at every step.
    """)
    see(global_grad_norm)
    table(rows, header=["layout", "norm counted once", "norm, each rank counting all it holds", "naive / true",
                        "max |Δ| vs clip_grad_norm_ in one process", "max |Δ| vs no clipping"],
          caption=f"The first step's global gradient norm on 4 ranks (one process: {norm:.6f}), and every parameter "
                  f"after {run.steps} clipped steps against one process that clips with clip_grad_norm_ "
                  "(and, to show the bound bites, against one that does not clip).")
    if RESULTS.get("clip"):
        name, once, naive = max(RESULTS["clip"], key=lambda x: x[2] / x[1])
        exact = [n for n, o, v in RESULTS["clip"] if abs(v / o - 1) < 1e-6]
        exact_words = (f"Under {' and '.join(exact)} every element has exactly one holder, so there the naive "
                       "sum happens to be right: the bug shows in some layouts and hides in others." if exact else "")
        note(f"""
            The classic bug is the middle column: each rank computes the norm of what it holds
            and the ranks add their squares up, so a replica counts its whole model again and a
            LayerNorm kept whole on every tp rank counts tp times. Under {name} it reports
            {naive:.4f} instead of {once:.4f} at the first step. A step is clipped
            {naive / once:.2f}× too hard. Under SGD that is a smaller learning rate; AdamW cancels a factor
            that stays the same from step to step, but the factor changes with the layout and the
            step, and steps whose true norm is under the bound get clipped too, so the run no
            longer trains as the one-process run it was tuned on. The opposite mistake, each rank
            clipping by the norm of its own shard, gives every rank a different factor.
            {exact_words}
        """)
        cheat("Global gradient norm", "$\\lVert g \\rVert = \\sqrt{\\sum_r \\sum_{b \\in \\text{owned}(r)} \\lVert g_b \\rVert^2}$",
              round(naive / once, 2), "×", what=f"the naive sum's overcount under {name}")


def failures_and_restarts():
    note("## A rank dies; the job comes back")
    note("""
        With `torchrun --max-restarts 1`, the agent on each node watches its workers. Here rank 1
        of a two-rank job dies in the middle of step 3 — after its backward, while rank 0 is
        already waiting in the gradient all-reduce. The agent sees rank 1 exit and stops rank 0
        (which may already have failed in its all-reduce, "connection reset by peer"), then starts every worker
        again; the new attempt builds its trainer, loads the latest complete checkpoint (step 2)
        and trains to the end. Had rank 1 hung instead of dying, rank 0 would wait in the
        collective until the process group's timeout (lecture 02) and then fail the same way.
        On torch 2.13 with gloo the new attempt must not reuse the old attempt's rendezvous
        keys, which the agent's store still holds (gloo's "connectFullMesh failed"):
        `init_group` prefixes them with the attempt number.
    """)
    see(init_group)
    job = restart_job(workdir("restart-job"))
    if job["rc"] != 0:
        raise RuntimeError(f"the torchrun job failed ({job['rc']}): {job['log']}")
    lost = lost_work(job["events"])
    figure(draw_restart(job["events"], lost),
           caption=f"The job's two attempts (torchrun, 2 ranks, a checkpoint every 2 steps): rank 1 dies in step "
                   f"{lost['died_in']}; the grey band is the restart (the agent stops and starts the workers, Python and torch import, the process "
                   f"group forms, the checkpoint loads in {lost['load']:.2f} s). Attempt 1 resumes at step "
                   f"{lost['resumed_from']}.")
    ref = reference_run(SMALL)
    weights = torch.load(export(workdir("restart-job", fresh=False), workdir("restart-model.pt")))
    diff = max((weights[k] - v).abs().max().item() for k, v in ref["params"].items())
    assert diff < 1e-6, diff
    note(f"""
        The job ends with the parameters of one process trained 4 steps (max |Δ| = {diff:.1e},
        read back from its last checkpoint with `export`, which writes one file of full tensors
        for inference). The failure cost {lost['restart']:.1f} s of restarting and the steps
        after the last checkpoint, done again: step {lost['died_in']}, in progress when the rank
        died, which attempt 1 redid in {lost['recompute']:.2f} s ({machine(2)}). At scale the
        restart is minutes — every node's agent restarts, tens of thousands of processes
        import and form their groups, and the checkpoint is read from a distributed file
        system — and the lost work is on average half a checkpoint interval.
    """)
    RESULTS["lost"] = lost


def how_often():
    note("## How often to save")
    mtbf = LLAMA3_DAYS * 86400 / LLAMA3_UNEXPECTED
    state_bytes = 14 * LLAMA3_405B_PARAMS          # bf16 weights (2), fp32 master weights and two Adam moments (4 each)
    delta = state_bytes / TECTONIC_SUSTAINED
    best = young_daly(delta, mtbf)
    note(f"""
        Saving often loses little work per failure but pays the write every time; saving rarely
        does the opposite. With a blocking write of δ seconds every τ seconds and failures
        every M seconds on average, the fraction of time lost is about
        $\\delta/\\tau + \\tau/(2M)$ (plus the restart, R/M), smallest at Young's interval
        $\\tau^* = \\sqrt{{2\\delta M}}$ (Young 1974; Daly 2006 adds higher-order terms that
        matter only when δ approaches M). For Llama 3 405B: {LLAMA3_UNEXPECTED} unexpected
        interruptions in {LLAMA3_DAYS} days is M = {mtbf / 3600:.1f} h for the whole job.
        Its training state is {state_bytes / 1e12:.1f} TB, at 14 bytes per parameter (bf16
        weights, fp32 master weights and two fp32 Adam moments; the gradients are not saved). The
        storage's published sustained bandwidth is 2 TB/s. If all of it went to the checkpoint, a
        save would block δ = {delta:.1f} s and the best interval would be τ* = {best / 60:.1f} min.
        That loses {100 * expected_waste(best, delta, mtbf):.2f}% of the time.
    """)
    causes = LLAMA3_INTERRUPTION_CAUSES
    counts = dict(causes.series["unexpected interruptions"])
    gpu = sum(n for cause, n in counts.items() if "GPU" in cause)
    figure(published_figure(causes, height=3.0), caption=causes.caption(
        f"What stopped the run: {sum(counts.values())} unexpected interruptions, {gpu} in the four GPU bars "
        "alone. Any one of them stops every rank of a synchronous job, so M is the whole "
        "job's, not one GPU's."))
    published(f"{LLAMA3_INTERRUPTIONS} job interruptions in {LLAMA3_DAYS} days of Llama 3 405B pre-training on "
              f"{LLAMA3_GPUS:,} H100s: 47 planned, {LLAMA3_UNEXPECTED} unexpected (about 78% confirmed or suspected "
              "hardware); more than 90% effective training time. Checkpoints of 1 MB to 4 GB per GPU; the Tectonic "
              "file system sustains 2 TB/s (7 TB/s peak), and bursty checkpoint writes saturated it.",
              "https://arxiv.org/abs/2407.21783", "Llama Team 2024, The Llama 3 Herd of Models, §3.3.1 and §3.3.4, Table 5")
    cases = [(f"δ = {delta:.1f} s (2 TB/s, all of it)", delta), (f"δ = {10 * delta:.0f} s (a tenth of it)", 10 * delta),
             ("δ = 5 min (a slow store)", 300.0)]
    figure(draw_waste(cases, mtbf),
           caption=f"Expected % of time lost against the checkpoint interval, for Llama 3's M = {mtbf / 3600:.1f} h and "
                   "three write times; the dot is Young's √(2δM). Restart time adds R/M at every interval.")
    costs = RESULTS.get("costs")
    here = ""
    if costs:
        name, sync, blocked, total, step = costs[0]
        if blocked.q3 < sync.q1:
            here = (f"Here an asynchronous save blocked the step {blocked.brief()} where a synchronous "
                    f"one took {sync.brief()}. With δ the blocking time, √(2δM) shrinks by "
                    f"√({sync.median / blocked.median:.1f}) and every interval loses less.")
        else:
            here = (f"Here, {machine(timing_ranks(2))}, this small model's asynchronous save blocked about as "
                    f"long as a synchronous one ({compare(blocked, sync, 'async', 'sync')}): a write of "
                    f"{sync.median * 1e3:.0f} ms is mostly fixed costs (planning, a barrier, a thread); the "
                    "gain comes with gigabytes per rank, where the write dwarfs the copy.")
    note(f"""
        The curve is flat near its minimum: twice or half τ* costs little. What moves it is δ —
        the seconds the *training* stops, which is why large runs save asynchronously (the
        step waits only for the copy out of GPU memory) and write each rank's shard in
        parallel. {here}
    """)
    if costs:
        here_best = young_daly(blocked.median, mtbf)
        cheat("Young/Daly interval", "$\\tau^* = \\sqrt{2\\,\\delta\\,M}$", round(here_best, 1), "s",
              what=f"computed: δ = the time this page's asynchronous save blocked the step ({blocked.median * 1e3:.0f} ms, "
                   f"measured), M = Llama 3 405B's {mtbf / 3600:.1f} h (published)")
    for url, title in [("https://doi.org/10.1145/361147.361115", "Young 1974, A first order approximation to the optimum checkpoint interval"),
                       ("https://doi.org/10.1016/j.future.2004.11.016", "Daly 2006, A higher order estimate of the optimum checkpoint interval for restart dumps")]:
        see(url, title=title)


def pytorch_side():
    note("## The same with PyTorch's own: FSDP2 and DTensor")
    run = SMALL
    folder = workdir("fsdp2")
    saved = spawn(pytorch_save, 4, run=run, layout=Layout(dp=4, micro_batch=2), directory=folder, steps=2,
                  name="FSDP2 at dp=4: train 2 steps, get_state_dict, dcp.save")
    if saved.skipped:
        return
    resumed = spawn(pytorch_resume, 4, run=run, layout=Layout(dp=2, tp=2, micro_batch=4), directory=folder, until=4,
                    name="FSDP2 × TP at dp=2 × tp=2: dcp.load, set_state_dict, 2 more steps")
    if resumed.skipped:
        return
    ref = reference_run(run)
    loaded = max((resumed.returns[0]["loaded"][k] - saved.returns[0]["params"][k]).abs().max().item()
                 for k in ref["params"])
    diff = max_param_diff(resumed.returns, ref["params"])
    note(f"""
        PyTorch's FSDP2 (`fully_shard`) and tensor parallelism (`parallelize_module`) hold
        every parameter as a DTensor, which knows its placement on the mesh.
        `get_state_dict(model, optimizer)` returns model and optimizer state under the unsplit
        model's names, as DTensors; `dcp.save` writes each rank's local shard at the offset its
        placement implies. Saved by FSDP2 on 4 ranks (dp=4) after 2 steps and loaded with
        `dcp.load` + `set_state_dict` into FSDP2 × TP on a 2 × 2 mesh: the loaded parameters
        differ from the saved ones by {loaded:.1e}, and after 2 more steps from one process by
        {diff:.1e}. Our checkpoint does with listed boxes what DTensor derives from placements;
        the one thing placements cannot express is ZeRO's flat ranges, which is why FSDP2
        shards by rows (Shard(0)) rather than flattening.
    """)
    RESULTS["pytorch"] = diff


def remember():
    note("""
        ## What to remember
        * A sharded checkpoint is every rank's boxes of the global tensors, with offsets; no
          rank gathers the model, and any layout reads back the parts of the boxes it needs.
        * Save everything the next step depends on: weights, optimizer moments and its step
          count, the data position, RNG states. Write to a temporary name and rename when all
          ranks are done; refuse a checkpoint that is missing, corrupt or of another model
          before changing anything.
        * Clip by the norm of the whole model: every element counted once — replicas, copies of
          the norms under tp, tied ends of a pipeline, ZeRO's shards, a routed expert's replicas.
        * torchrun restarts every worker of a failed job; the job must find its last complete
          checkpoint by itself. The work lost per failure is the time since that checkpoint plus
          the restart.
        * Save every $\\sqrt{2\\delta M}$ seconds; make δ the time the training is blocked, not
          the time the write takes (asynchronous saves).

        The notebook `lectures/notebooks/lecture_08_checkpoints_and_restarts.ipynb` runs every
        section above and lets you resume your own layout from any other's checkpoint.
    """)


def main():
    try_it_yourself(notebook_exercises("lecture_08_checkpoints_and_restarts"))
    intro()
    what_a_checkpoint_holds()   # the boxes, save/load, and a checkpoint loaded under 5 other layouts
    with deep_dive("What DCP's metadata records", "the boxes of three tensors, and the file that holds each"):
        dcp_metadata()
    what_it_costs()             # bytes per rank, a synchronous save, an asynchronous one
    clipping_across_shards()    # the global norm counted once, and the classic bug
    failures_and_restarts()     # a torchrun job that loses a rank and resumes
    how_often()                 # Young/Daly at Llama 3's scale
    pytorch_side()              # FSDP2 / DTensor saved at one mesh, loaded at another
    remember()
