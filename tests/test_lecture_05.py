"""Lecture 05: every pipeline schedule is complete and dependency-correct, the simulator gives the
textbook bubbles, and the executor's loss, gradients and parameters after AdamW steps equal one
process's for every schedule at 2 and 4 ranks."""
import re
import statistics

import pytest
import torch

from lectures import lecture_05_pipeline_parallel as L
from lectures.model import GPTConfig, saved_bytes
from lectures.pipeline import (V_SHAPED, Layout, PipelineExecutor, Schedule, check_schedule, consecutive_steps,
                               dependencies, held, make_schedule, message_order, qi_bubble, simulate, steady_step,
                               theory_bubble)
from lectures.pipeline.demos import (ALL, PYTORCH_SCHEDULES, chunk_cost, measure_schedules, measured_bubbles,
                                     rank_spans, reference_train, train_pipeline)
from lectures.pipeline.figures import deadlock_figure, pytorch_figure
from lectures.pipeline import deep_dives, demos, executor, schedules
from util import spawn
from tests.conftest import built
from tests.support.nccl_standin import NcclLikeP2P, ThreadGather, run_ranks


def cases():
    for name in schedules.SCHEDULES:
        for p in (2, 3, 4):
            for m in sorted({1, p - 1, p, 2 * p + 1}):
                for v in (1, 2):
                    yield name, p, m, v


@pytest.mark.parametrize("name,p,m,v", list(cases()))
def test_schedule_complete_and_dependency_correct(name, p, m, v):
    refuses = ((name in V_SHAPED and v != 2) or (name in ("zb-h1", "zb-h2") and v != 1)
               or (name == "dualpipev" and m < 2 * p))
    if refuses:                      # a schedule that cannot serve these sizes says so
        with pytest.raises(ValueError):
            make_schedule(name, p, m, v)
        return
    sched = make_schedule(name, p, m, v)
    check_schedule(sched)            # every (stage, micro-batch) once per kind
    assert len(sched) == p and all(isinstance(a, schedules.Action) for acts in sched for a in acts)
    for cost in ({"F": 1, "B": 1, "W": 0}, {"F": 1, "B": 1, "W": 1, "send": 0.2},
                 {"F": 1.0, "B": 2.0, "W": 0.5, "send": 3.0}):
        sim = simulate(sched, cost)     # raises on a deadlock
        # and the simulated order respects every dependency
        finish = {}
        for r, row in enumerate(sim.timeline):
            for a, start, end in row:
                finish[a.kind, sched.layout.stage(r, a.chunk), a.microbatch] = (start, end)
        for (kind, s, i), (start, _) in finish.items():
            for dep in dependencies(schedules.Action(kind, i), s, sched.layout):
                assert finish[dep][1] <= start + 1e-12, (kind, s, i, dep)


def test_checker_and_simulator_catch_broken_schedules():
    sched = make_schedule("1f1b", 3, 4)
    missing = Schedule([acts[:-1] for acts in sched], "broken", sched.layout, 4)
    with pytest.raises(ValueError, match="missing"):
        check_schedule(missing)
    # the last stage runs B0 before F0: it waits for itself forever
    swapped = [list(acts) for acts in sched]
    swapped[2][0], swapped[2][1] = swapped[2][1], swapped[2][0]
    with pytest.raises(ValueError, match="deadlock"):
        simulate(Schedule(swapped, "swapped", sched.layout, 4), {"F": 1, "B": 1})


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_bubble_equals_formula_under_unit_costs(name, p):
    for m in (1, p - 1, p, 2 * p + 1, 16):
        sim = simulate(make_schedule(name, p, m), {"F": 1, "B": 1, "W": 0, "send": 0})
        assert sim.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


def test_interleaved_bubble_formula_holds_for_every_m_from_p():
    """(p − 1)/(v·m + p − 1) is the simulated bubble (F = B, W = 0) for every m >= p,
    not only multiples of p (441 sizes), so theory_bubble gives it there; below p it gives none."""
    for p in range(2, 9):
        for v in (2, 3, 4):
            for m in range(1, 5 * p + 1):
                sim = simulate(make_schedule("interleaved-1f1b", p, m, v), chunk_cost(v, W=0))
                want = theory_bubble("interleaved-1f1b", p, m, v)
                assert (want is None) == (m < p)
                if want is not None:
                    assert sim.bubble == pytest.approx(want, abs=1e-12), (p, v, m)


def test_interleaving_and_zero_bubble_shrink_the_bubble():
    p, m, unit = 4, 8, {"F": 1, "B": 1, "W": 1}
    bubble = {name: simulate(make_schedule(name, p, m, v), unit).bubble
              for name, v in [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1),
                              ("zb-v", 2), ("dualpipev", 2)]}
    assert bubble["interleaved-1f1b"] == pytest.approx(theory_bubble("interleaved-1f1b", p, m, 2))
    assert bubble["zb-h1"] < bubble["1f1b"] and bubble["zb-v"] < bubble["zb-h1"]
    assert bubble["dualpipev"] < bubble["1f1b"]


def _gaps(row):
    return sum(b[1] - a[2] for a, b in zip(row, row[1:]))


@pytest.mark.parametrize("p", range(1, 9))
def test_zero_bubble_schedules_have_their_papers_numbers(p):
    """Qi et al. 2023: ZB-H1 keeps 1F1B's memory (at most p micro-batches between F and W on any
    rank) and, with F = B = W, takes 3m + (p − 1)(F + B − W) = 3m + p − 1 (1F1B: 3m + 3(p − 1));
    ZB-H2 holds at most 2p − 1 and (m >= 2p) runs without a gap from its first action to its last
    on every rank (the head and tail are what the next step fills once the optimizer step does not
    synchronise). ZB-V (Qi et al. 2024): two half-size chunks in a V, 1F1B's memory (2p chunks),
    and at m >= 2p the V's head of (p − 1) half-stage forwards is all a rank waits. (The greedy
    list that stood for ZB-V before only came within one unit of it, and lost to ZB-H1 under
    unequal costs.)"""
    for m in sorted({1, p, 2 * p, 3 * p + 1}):
        unit = {"F": 1, "B": 1, "W": 1}
        h1 = make_schedule("zb-h1", p, m)
        assert max(held(h1)) <= p
        if m >= p:
            assert simulate(h1, unit).makespan == 3 * m + (p - 1) * (1 + 1 - 1)
            assert simulate(make_schedule("1f1b", p, m), unit).makespan == 3 * m + 3 * (p - 1)
        h2 = make_schedule("zb-h2", p, m)
        assert max(held(h2)) <= 2 * p - 1
        if m >= 2 * p:          # fewer micro-batches cannot fill the warm-up
            sim = simulate(h2, unit)
            assert all(_gaps(row) == 0 and row[0][1] == r for r, row in enumerate(sim.timeline))
        zbv = make_schedule("zb-v", p, m, 2)
        assert max(held(zbv)) <= 2 * p
        if m >= 2 * p:
            half = {k: 0.5 for k in "FBW"}
            assert simulate(zbv, half).makespan == 3 * m + (p - 1) * 0.5


def pytorch_zbv_order(p, m, rank):
    """PyTorch's ScheduleZBVZeroBubble.pipeline_order for one rank, as our Actions. Its order is
    computed from p, the stage count and m alone, so no process group is needed."""
    import types
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    stub = types.SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m)
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    return [schedules.Action(kinds[a.computation_type.name], a.microbatch_index, 0 if a.stage_index == rank else 1)
            for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(stub, rank) if a is not None]


@pytest.mark.parametrize("p", range(1, 9))
def test_zb_v_is_pytorchs_order(p):
    """Our ZB-V runs, rank by rank, exactly the actions PyTorch's ScheduleZBVZeroBubble runs, for
    every m up to 4p + 1 (below 2p − 1 both drop the missing micro-batches' actions). It failed
    before: the list was a greedy fit (p = 6, m = 12 took 39.5 units against the V's 38.5)."""
    for m in range(1, 4 * p + 2):
        ours = make_schedule("zb-v", p, m, 2)
        check_schedule(ours)
        assert [pytorch_zbv_order(p, m, r) for r in range(p)] == list(ours), (p, m)


def test_measured_costs_are_qi_et_als_table_9_normalised():
    """The appendix's cost mixes are Qi et al.'s profiled times (ICLR 2024, Table 9) divided by T_F,
    labelled by model; F = B = W comes first."""
    mixes = deep_dives.cost_mixes()
    assert list(mixes) == ["F = B = W", "1.5B model's costs", "6.2B model's costs", "14.6B model's costs", "28.3B model's costs"]
    assert mixes["1.5B model's costs"] == pytest.approx((1.0, 18.086 / 18.522, 9.337 / 18.522, 0.601 / 18.522))
    assert mixes["28.3B model's costs"] == pytest.approx((1.0, 10.207 / 10.419, 7.715 / 10.419, 0.408 / 10.419))


@pytest.mark.parametrize("p,m", [(4, 8), (8, 24), (3, 7)])
def test_measured_costs_give_qi_et_als_makespans_and_the_page_says_so(p, m):
    """Under every mix Qi et al. profiled, the simulated 1F1B and ZB-H1 take m(F + B + W) plus their
    Table 2 bubble, and ZB-H2 back to back its own; ZB-V is shorter than ZB-H1 at each (the greedy list
    that stood for ZB-V was longer at an invented (1, 1.2, 0.8): 29.6 against 28.2), with or without
    T_comm, and the page's sentence is generated from those makespans."""
    span = {}
    for label, (F, B, W, comm) in deep_dives.cost_mixes().items():
        got = span[label] = deep_dives.mix_makespans(p, m, F, B, W)
        work = m * (F + B + W)
        for name in ("1f1b", "zb-h1"):
            assert got[name] == pytest.approx(work + qi_bubble(name, p, F, B, W)), (label, name)
        assert steady_step(make_schedule("zb-h2", p, m), chunk_cost(1, F, B, W)) == pytest.approx(
            work + qi_bubble("zb-h2", p, F, B, W))
        assert got["zb-v"] < got["zb-h1"], label
        with_comm = deep_dives.mix_makespans(p, m, F, B, W, comm)
        assert with_comm["zb-v"] < with_comm["zb-h1"], label
        assert comm == 0 or with_comm["1f1b"] > got["1f1b"], "the send time reaches the simulator"
    words = deep_dives.zbv_against_zbh1(span)
    assert words.startswith("ZB-V is shorter than ZB-H1 at every one of these costs")
    small = span["1.5B model's costs"]
    assert f"1.5B model's costs: {small['zb-v']:.2f} against {small['zb-h1']:.2f}" in words
    span["28.3B model's costs"]["zb-v"] = span["28.3B model's costs"]["zb-h1"] + 1
    assert deep_dives.zbv_against_zbh1(span).startswith("ZB-V is shorter than ZB-H1 at 4 of these 5 costs")


def test_page_states_the_zb_v_verdict_at_measured_costs(course_site):
    """The appendix's table and sentence come from the run: the built page cites Table 9 and its verdict
    is the one the simulator gives at the page's p = 4, m = 8."""
    html = (built(course_site, "lecture_05_pipeline_parallel") / "lecture_05_pipeline_parallel_appendix.html").read_text()
    span = {label: deep_dives.mix_makespans(4, 8, *mix[:3]) for label, mix in deep_dives.cost_mixes().items()}
    verdict = deep_dives.zbv_against_zbh1(span)
    assert verdict.split(" (")[0] in html and "Table 9" in html
    large = span["28.3B model's costs"]
    assert f"{large['zb-v']:.2f} against {large['zb-h1']:.2f}" in html


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_h2_across_steps_has_qi_et_als_bubble(p):
    """Qi et al. 2023, Table 2: once steps run back to back (post-validation), ZB-H2 idles
    (p − 1)(F + B − 2W) per step: zero at F = B = W, 3·0.6 units at (1, 1.2, 0.8), p = 4. One
    step alone keeps the parallelogram's head and tail. 1F1B and ZB-H1 have their formulas too."""
    for m in (2 * p, 3 * p, 4 * p):
        for F, B, W in [(1, 1, 1), (1, 1.2, 0.8), (1, 1, 0.5), (1, 2, 1), (2, 1, 1), (1, 1.5, 0.2)]:
            cost, work = {"F": F, "B": B, "W": W}, m * (F + B + W)
            h2 = make_schedule("zb-h2", p, m)
            assert steady_step(h2, cost) == pytest.approx(work + qi_bubble("zb-h2", p, F, B, W))
            assert simulate(make_schedule("zb-h1", p, m), cost).makespan == pytest.approx(
                work + qi_bubble("zb-h1", p, F, B, W))
            assert simulate(make_schedule("1f1b", p, m), cost).makespan == pytest.approx(
                work + qi_bubble("1f1b", p, F, B, W))
        unit = {"F": 1, "B": 1, "W": 1}
        assert steady_step(h2, unit) == 3 * m < simulate(h2, unit).makespan
    two = consecutive_steps(make_schedule("zb-h2", p, 2 * p), 2)
    check_schedule(two)
    with pytest.raises(ValueError, match="2W <= F"):
        qi_bubble("zb-h2", p, 1, 1, 1.5)


def test_interleaved_memory_sentence_counts_the_lists():
    """With p < m < 2p interleaved 1F1B makes one group, and rank 0 holds all m
    micro-batches (GPipe's memory); at m = 2p it holds p + (p − 1)/v. The page's sentence comes
    from held()."""
    for p in range(2, 9):
        for m in range(p + 1, 2 * p):
            assert held(make_schedule("interleaved-1f1b", p, m, 2))[0] == 2 * m
        assert held(make_schedule("interleaved-1f1b", p, 2 * p, 2))[0] / 2 == p + (p - 1) / 2
    words = L.interleaved_memory_words(4, 2)
    assert "at m = 8 rank 0 holds 5.5 micro-batches (4 with 1F1B" in words
    assert "rank 0 holds all $m$ micro-batches at once, GPipe's memory: 7 at m = 7" in words


def test_zb_h1_is_the_papers_order():
    """Fig. 3 of Qi et al. 2023 at p = 4: the first rank runs 4 forwards, then B W F; the last
    rank runs F B pairs and starts its Ws 3 micro-batches late."""
    sched = make_schedule("zb-h1", 4, 8)
    assert " ".join(map(str, sched[0][:10])) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5"
    assert " ".join(map(str, sched[3][:10])) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4"


def _all_sizes():
    for p in range(1, 9):
        for m in range(1, 3 * p + 2):
            for name in schedules.SCHEDULES:
                for v in ((1, 2, 3, 4) if name in ("naive", "gpipe", "1f1b", "interleaved-1f1b") else (1, 2)):
                    yield name, p, m, v


def test_every_schedule_runs_or_refuses_clearly_for_every_size():
    """Interleaved 1F1B deadlocked at (p, m, v) = (6, 8, 2), (5, 7, 2), (4, 5, 3), ... (55 sizes
    up to p = 8, all with m not a multiple of p). Every size now either builds a list the
    simulator finishes or is refused at `make_schedule` with a ValueError that says why."""
    for name, p, m, v in _all_sizes():
        try:
            sched = make_schedule(name, p, m, v)
        except ValueError as e:
            assert str(e)
            continue
        check_schedule(sched)
        simulate(sched, {"F": 1, "B": 1, "W": 1})
        simulate(sched, {"F": 1, "B": 2, "W": 0.5, "send": 3})


CFG = GPTConfig(n_layers=4, d_model=16, n_heads=2, seq_len=8, dtype="float64")
CFG8 = GPTConfig(n_layers=8, d_model=16, n_heads=2, seq_len=8, dtype="float64")


def executor_cases():
    for p in (2, 4):
        for name in schedules.SCHEDULES:
            v = 2 if name in ("interleaved-1f1b", "zb-v", "dualpipev") else 1
            m = 2 * p + 1 if name == "dualpipev" else p + 1
            yield p, name, v, m


def train_every_schedule(rank, world_size, cases, mb_size, steps):
    out = {}
    for p, name, v, m in cases:
        cfg = CFG8 if p * v > CFG.n_layers else CFG
        out[name, v, m] = train_pipeline(rank, world_size, cfg, name, m, mb_size, chunks=v, steps=steps)
    return out


@pytest.fixture(scope="module")
def executed():
    runs = {}
    for p in (2, 4):
        cases = [c for c in executor_cases() if c[0] == p]
        runs[p] = (cases, spawn(train_every_schedule, p, cases=cases, mb_size=3, steps=2).returns)
    return runs


@pytest.mark.parametrize("p,name,v,m", list(executor_cases()))
def test_executor_equals_one_process(executed, p, name, v, m):
    cfg = CFG8 if p * v > CFG.n_layers else CFG
    ref = reference_train(cfg, m, 3, steps=2)
    cases, per_rank = executed[p]
    got = [r[name, v, m] for r in per_rank]
    losses = [x for r in got for x in [r["losses"]] if r["losses"][0] is not None]
    assert len(losses) == 1, "exactly one rank (the last stage's) reports the loss"
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref["losses"]), rtol=1e-6, atol=1e-6)  # the loss is float32
    grads = {k: g for r in got for k, g in r["grads"].items()}
    params = {k: q for r in got for k, q in r["params"].items()}
    assert set(grads) == set(ref["grads"]) == set(params), "every parameter lives on exactly one stage"
    for k in ref["grads"]:
        torch.testing.assert_close(grads[k], ref["grads"][k], rtol=1e-9, atol=1e-12, msg=k)
        torch.testing.assert_close(params[k], ref["params"][k], rtol=1e-9, atol=1e-12, msg=k)
    # the spans the page's executor figure draws: every action of the rank's list, in its order
    sched = make_schedule(name, p, m, v)
    for r, acts in zip(got, sched):
        assert [schedules.Action(*a) for a, _, _ in r["events"]] == list(acts)
        assert all(t0 <= t1 for _, t0, t1 in r["events"])


def test_building_blocks_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("pipedream-2bw", 2, 4)
    sched = make_schedule("zb-h1", 2, 3)
    _, stages = executor.split_gpt(CFG, sched.layout)
    with pytest.raises(ValueError, match="checkpointing"):
        PipelineExecutor(sched, {0: stages[0]}, 0, (3, 8, 16), checkpoint=True)


def test_layouts_place_every_stage_once():
    for layout in (Layout(4, 2, "looped"), Layout(4, 2, "v"), Layout(3, 1)):
        placed = {layout.stage(r, c) for r in range(layout.ranks) for c in range(layout.chunks)}
        assert placed == set(range(layout.stages))
        for s in range(layout.stages):
            assert layout.stage(*layout.place(s)) == s
    v = Layout(4, 2, "v")
    assert v.place(0) == (0, 0) and v.place(7) == (0, 1) and v.place(3) == (3, 0) and v.place(4) == (3, 1)


def test_sleep_mode_measures_the_schedule():
    """In sleep mode the measured bubble of 1F1B is near (p-1)/(m+p-1), and GPipe holds more."""
    cfg = GPTConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8)
    runs = [{"label": "1f1b", "name": "1f1b", "m": 4}, {"label": "gpipe", "name": "gpipe", "m": 4}]
    R = spawn(measure_schedules, 2, cfg=cfg, runs=runs, mb_size=2, delay={"F": 0.01, "B": 0.01, "W": 0.01},
              repeats=3).returns
    got = statistics.median(measured_bubbles(R, "1f1b")[0])
    assert got == pytest.approx(1 / 5, abs=0.1)
    assert max(r["gpipe"]["peak_saved_bytes"] for r in R) > max(r["1f1b"]["peak_saved_bytes"] for r in R) > 0



def test_split_backward_refuses_modules_returning_tuples():
    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.w, x

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = Pair()

        def forward(self, x):
            return self.pair(x)[0]

    sched = make_schedule("zb-h1", 1, 1)
    ex = PipelineExecutor(sched, {0: Stage()}, 0, (2, 3), loss_fn=lambda y, t: (y - t).pow(2).mean())
    with pytest.raises(TypeError, match="one tensor"):
        ex.step([torch.ones(2, 3)], [torch.zeros(2, 3)])


def test_one_stage_step_under_no_grad_equals_autograd():
    """p = 1: the executor is plain gradient accumulation; it trains even under no_grad."""
    lin = torch.nn.Linear(3, 2).double()
    x, t = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    loss = lambda y, t: (y - t).pow(2).mean()
    loss(lin(x), t).backward()
    want = [p.grad.clone() for p in lin.parameters()]
    for name in ("1f1b", "zb-h1"):
        lin.zero_grad()
        ex = PipelineExecutor(make_schedule(name, 1, 2), {0: lin}, 0, (2, 2), loss_fn=loss,
                              dtype=torch.float64)
        with torch.no_grad():
            ex.step(list(x.chunk(2)), list(t.chunk(2)))
        for p, w in zip(lin.parameters(), want):
            torch.testing.assert_close(p.grad, w)


# The split schedule's W runs only the parameter-owning modules' backward nodes, so autograd
# frees the other nodes' saved tensors only when the graph itself goes. A pack hook that kept a
# saved *output* (tanh's here, LayerNorm's mean and rstd in the GPT) with its grad_fn made a
# reference cycle through C++ that was never freed: ZB-H1 leaked, and this test caught it.
@pytest.mark.parametrize("name,held,grads", [("gpipe", 3, 0), ("1f1b", 1, 0), ("zb-h1", 1, 1), ("zb-h2", 1, 1)])
def test_executor_meters_what_autograd_holds(name, held, grads):
    """Peak bytes saved for backward, one stage: GPipe holds every micro-batch's activations at
    once, 1F1B and ZB-H1 one micro-batch's, which is what saved_bytes measures for one forward.
    A split backward also keeps each Linear's output gradient from B until W: by hand,
    5 × 16 + 5 × 4 float64 = 800 bytes per micro-batch (the meter once missed them). By the end
    of the step everything is released."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    xs = [torch.randn(5, 8, dtype=torch.float64) for _ in range(3)]
    ts = [torch.randn(5, 4, dtype=torch.float64) for _ in range(3)]
    _, one = saved_bytes(lambda: net(xs[0]), exclude=list(net.parameters()))
    assert one > 0
    ex = PipelineExecutor(make_schedule(name, 1, 3), {0: net}, 0, (5, 4),
                          loss_fn=lambda y, t: (y - t).pow(2).mean(), dtype=torch.float64)
    assert ex.step(xs, ts)["peak_saved_bytes"] == held * one + grads * (5 * 16 + 5 * 4) * 8
    assert ex.meter.live == 0


# --- NCCL's matching, emulated: ranks as threads, each pair's k-th receive gets the k-th send ---

class PostingOrderP2P(ThreadGather):
    """A stand-in for torch.distributed's point-to-point calls that matches like NCCL: between a
    pair of ranks the k-th receive posted gets the k-th send posted, whatever the tags. Each
    thread is one rank (`local.rank`)."""
    isend, irecv = "isend", "irecv"

    def __init__(self):
        import collections
        import threading
        self.sent, self.received = collections.defaultdict(list), collections.Counter()
        self.cond, self.local = threading.Condition(), threading.local()

    def P2POp(self, op, tensor, peer, group=None, tag=0):
        import types
        return types.SimpleNamespace(op=op, tensor=tensor, peer=peer, tag=tag)

    def get_global_rank(self, group, r):
        return r

    def batch_isend_irecv(self, ops):
        import types
        me, works = self.local.rank, []
        for op in ops:
            with self.cond:
                if op.op == self.isend:
                    self.sent[me, op.peer].append(op.tensor.detach().clone())
                    self.cond.notify_all()
                    works.append(types.SimpleNamespace(wait=lambda: None))
                else:
                    k = self.received[op.peer, me]
                    self.received[op.peer, me] += 1
                    works.append(types.SimpleNamespace(wait=lambda key=(op.peer, me), k=k, buf=op.tensor:
                                                       self._deliver(key, k, buf)))
        return works

    def _deliver(self, key, k, buf):
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.sent[key]) > k, timeout=30):
                raise TimeoutError(f"receive {k} from rank {key[0]} never sent")
            buf.copy_(self.sent[key][k])


def run_threads_under_nccl_matching(name, p, m, v, monkeypatch):
    import threading
    from lectures.pipeline import executor as pipeline
    fake = PostingOrderP2P()
    monkeypatch.setattr(pipeline, "dist", fake)
    sched = make_schedule(name, p, m, v)
    cfg = GPTConfig(n_layers=2 * p, d_model=16, n_heads=2, seq_len=8, dtype="float64")
    _, stages = executor.split_gpt(cfg, sched.layout)
    inputs, targets = demos.microbatches(cfg, m, 2, 0)
    errors, executors = [], []

    def rank_main(r):
        fake.local.rank = r
        try:
            mine = {c: stages[sched.layout.stage(r, c)] for c in range(v)}
            ex = PipelineExecutor(sched, mine, r, (2, cfg.seq_len, cfg.d_model), dtype=torch.float64)
            executors.append(ex)
            ex.step(inputs, targets)
        except BaseException as e:            # noqa: BLE001  (reported below)
            errors.append((r, e))
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    ref = reference_train(cfg, m, 2, steps=1)
    grads = executor.gradients_by_name(stages)
    for k, g in ref["grads"].items():
        torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-12, msg=f"{name} p={p} m={m}: {k}")
    return executors


NCCL_CASES = [(name, p, m, 2 if name in ("interleaved-1f1b", "zb-v", "dualpipev") else 1)
              for p in (3, 4) for name in schedules.SCHEDULES
              for m in ((2 * p + 1,) if name == "dualpipev" else (p + 1, 2 * p))]
NCCL_CASES.append(("interleaved-1f1b", 2, 5, 2))   # its sends to a peer and that peer's needs differ in order


@pytest.mark.parametrize("name,p,m,v", NCCL_CASES)
def test_executor_correct_when_messages_match_in_posting_order(name, p, m, v, monkeypatch):
    """NCCL ignores tags: every schedule must post a pair's receives in the order of its sends.
    Before, interleaved 1F1B with m mod p != 0 and DualPipeV at p >= 3 swapped tensors here."""
    executors = run_threads_under_nccl_matching(name, p, m, v, monkeypatch)
    by_rank = {ex.rank: ex.posted for ex in executors}
    for (src, dst), keys in message_order(make_schedule(name, p, m, v)).items():
        assert [k for peer, kind, k in by_rank[src] if kind == "send" and peer == dst] == keys
        assert [k for peer, kind, k in by_rank[dst] if kind == "recv" and peer == src] == keys


def _disagreeing_step(r, case, cfg):
    """Rank r's part of a 2-rank 1F1B step in which rank 1 disagrees with rank 0 (`case`);
    returns the error text the rank got, or None."""
    name = "zb-h1" if case == "schedule" and r == 1 else "1f1b"
    dtype = torch.float32 if case == "boundary dtype" and r == 1 else torch.float64
    mb = 3 if case == "micro-batch shape" and r == 1 else 2
    cost = {"F": 1, "B": 2, "W": 1} if case == "plan costs" and r == 1 else None
    sched = make_schedule(name, 2, 3)
    _, stages = executor.split_gpt(cfg, sched.layout)
    inputs, targets = demos.microbatches(cfg, 3, mb, 0)
    ex = PipelineExecutor(sched, {0: stages[r]}, r, (2, cfg.seq_len, cfg.d_model), dtype=dtype, cost=cost)
    try:
        ex.step(inputs, targets)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("case", ["boundary dtype", "micro-batch shape", "schedule", "plan costs"])
def test_ranks_that_disagree_get_a_clear_error(case, monkeypatch):
    """A rank with another dtype, micro-batch shape or
    schedule (or a plan timed at other costs: its batches would not meet) made gloo abort ('op.preamble.length <= op.nbytes'), wait for ever, or (NCCL) copy
    bytes into a buffer of another type. An all_gather of each rank's signature at entry now
    gives every rank the same ValueError naming what each has. Ranks as threads here; the gloo
    test below runs real processes."""
    from lectures.pipeline import executor as pipeline
    p2p = NcclLikeP2P()
    monkeypatch.setattr(pipeline, "dist", p2p)
    cfg = GPTConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8, dtype="float64")

    def rank_main(r):
        p2p.local.rank = r
        return _disagreeing_step(r, case, cfg)
    got = run_ranks(rank_main, [0, 1])
    assert got[0] == got[1] and got[0] is not None, got
    assert got[0].startswith("the pipeline's ranks disagree on the step they run") and "rank 0: " in got[0]
    assert p2p.batches == 0, "the check comes before any message"


def disagree_over_gloo(rank, world_size):
    cfg = GPTConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8, dtype="float64")
    return _disagreeing_step(rank, "boundary dtype", cfg)


def test_ranks_that_disagree_get_a_clear_error_over_gloo():
    got = spawn(disagree_over_gloo, 2, timeout=20).returns
    assert got[0] == got[1] and "torch.float32" in got[0] and "torch.float64" in got[0], got


def test_checkpointing_counts_the_recomputation():
    """GPipe with checkpointing keeps every micro-batch's input, and during each backward the
    re-run forward saves one micro-batch's activations again: the peak is both. The old meter
    counted only what F saved (the inputs), 3 × 320 bytes here, and printed a 66.5× saving."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)).double()
    xs = [torch.randn(5, 8, dtype=torch.float64) for _ in range(3)]
    ts = [torch.randn(5, 4, dtype=torch.float64) for _ in range(3)]
    loss = lambda y, t: (y - t).pow(2).mean()
    _, one = saved_bytes(lambda: net(xs[0]), exclude=list(net.parameters()))   # includes the input
    sum(loss(net(x), t) for x, t in zip(xs, ts)).div(3).backward()
    want = [q.grad.clone() for q in net.parameters()]
    net.zero_grad()
    ex = PipelineExecutor(make_schedule("gpipe", 1, 3), {0: net}, 0, (5, 4), loss_fn=loss,
                          dtype=torch.float64, checkpoint=True)
    out = ex.step(xs, ts)
    assert out["peak_saved_bytes"] == 2 * xs[0].nbytes + one     # 3 inputs + one re-run minus its input
    for q, w in zip(net.parameters(), want):
        torch.testing.assert_close(q.grad, w)


# --- what the page claims, checked against the code and the sources it cites -----------------

def test_dualpipev_readme_formula_beside_the_simulated_idle():
    """(S/2 − 1)(F&B + B − 3W) with a chunk's F = 1/2, full B = 1, W = 1/2 and
    F&B = F + B is 3 units per rank at p = 4; the simulated list idles 1.5 on every rank."""
    from lectures.pipeline import dualpipev_readme_bubble
    assert dualpipev_readme_bubble(4, 0.5, 1.0, 0.5) == 3.0
    assert dualpipev_readme_bubble(4, 0.5, 1.0, 0.5, FB=1.0) == 1.5       # a perfect overlap: F&B = B
    sim = simulate(make_schedule("dualpipev", 4, 8, 2), chunk_cost(2))
    assert [sim.makespan - sum(e - b for _, b, e in row) for row in sim.timeline] == [1.5] * 4
    with pytest.raises(ValueError):
        dualpipev_readme_bubble(4, 0.5, 0.5, 1.0)                         # W cannot exceed the full B


def pytorch_dualpipev_order(p, m, rank):
    """PyTorch's ScheduleDualPipeV.pipeline_order for one rank as our Actions (a FULL_BACKWARD is
    our B then W), and where its OVERLAP_F_B pairs sit: {index of the pair's F: its actions}."""
    import types
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV
    kinds = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "BW"}
    acts, pairs = [], {}

    def add(a):
        acts.extend(schedules.Action(k, a.microbatch_index, 0 if a.stage_index == rank else 1)
                    for k in kinds[a.computation_type.name])
    stub = types.SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    for a in ScheduleDualPipeV._calculate_single_rank_operations(stub, rank):
        if a.computation_type.name == "OVERLAP_F_B":
            start = len(acts)
            for sub in a.sub_actions:
                add(sub)
            pairs[start] = len(acts) - start
        else:
            add(a)
    return acts, pairs


@pytest.mark.parametrize("p", range(1, 9))
def test_dualpipev_and_its_pairs_are_pytorchs(p):
    """Our DualPipeV list is PyTorch's ScheduleDualPipeV order, and its overlapped pairs are
    PyTorch's OVERLAP_F_B actions, for m = 2p .. 4p + 1."""
    for m in range(2 * p, 4 * p + 2):
        sched = make_schedule("dualpipev", p, m, 2)
        for r in range(p):
            assert pytorch_dualpipev_order(p, m, r) == (sched[r], sched.pairs[r]), (p, m, r)


def test_dualpipev_readme_formula_equals_the_reference_run():
    """(S/2 − 1)(F&B + B − 3W) is the most idle rank of DualPipeV run as the reference
    runs it (each F&B pair one unit, its outputs leaving at its end), for p = 2..8, m = 2p, 2p + 3,
    4p and F&B from F + B to max(F, B), exactly when F = B_in = W; our pair-by-pair list idles
    (p − 1)F, (p − 1)B_in less. With F = 0.5, B_in = 0.6, W = 0.4 the formula is off."""
    for c in (0.5, 1.0):
        holds, worst = deep_dives.dualpipev_readme_holds(c, c, c)
        assert holds, worst
    holds, worst = deep_dives.dualpipev_readme_holds(0.5, 0.6, 0.4)
    assert not holds and worst > 0.1
    cost = chunk_cost(2)
    for p in range(2, 9):
        sched = make_schedule("dualpipev", p, 2 * p + 1, 2)
        ours = deep_dives.most_idle(simulate(sched, cost))
        paired = deep_dives.most_idle(simulate(sched, cost, pair=cost["F"] + cost["B"] + cost["W"]))
        assert ours == pytest.approx((p - 1) * cost["F"]) and paired == pytest.approx(ours + (p - 1) * cost["B"])
    # a pair runs as one unit: the simulated rank is busy exactly F&B for it
    sim = simulate(make_schedule("dualpipev", 2, 4, 2), cost, pair=1.2)
    pairs = sum(len(u) for u in make_schedule("dualpipev", 2, 4, 2).pairs)
    assert sum(sim.busy) == pytest.approx(2 * 4 * 2 * 1.5 - pairs * (1.5 - 1.2))


def test_free_w_caption_comes_from_the_numbers():
    """With W = 0 the caption says which split lists gain and which do not, from the
    simulated bubbles. (With the greedy ZB-V it said that list lost 8.7 points; the paper's ZB-V
    gains from its V.)"""
    free = {n: simulate(make_schedule(n, 4, 8, v), chunk_cost(v, W=0)).bubble for n, v in ALL}
    words = deep_dives.free_w_words(free)
    assert "zb-h1, zb-h2 have 1F1B's 27.3%" in words
    assert "zb-v is shorter (15.8% against 1F1B's 27.3%), from its 2 chunks per rank" in words
    free["zb-v"] = free["1f1b"] + 0.087
    assert "zb-v's list, built for F = B = W, loses 8.7 points" in deep_dives.free_w_words(free)


def test_one_sample_gives_no_verdict_and_checkpointing_sentence_reads():
    """A single sample yields times and no verdict; the checkpointing
    sentence names plain GPipe first and says 'slower'."""
    from util.measure import Timing
    one = L.verdict(Timing([0.0609]), Timing([0.0550]), "ours", "PyTorch's")
    assert "one sample, no verdict" in one and "faster" not in one
    from util.render import markdown_inline, visible_text
    words = L.slower_or_faster(Timing([0.103, 0.104, 0.102]), Timing([0.0836, 0.0840, 0.0830]),
                               "with checkpointing", "plain GPipe")
    assert visible_text(words) == "with checkpointing is 1.23× slower than plain GPipe"   # 0.103 / 0.0836
    assert "with checkpointing 103 ms (IQR 102–104), plain GPipe 83.6 ms (IQR 83.3–83.8)" in markdown_inline(words)
    overlap = L.slower_or_faster(Timing([1.0, 2.0, 3.0]), Timing([1.5, 2.5, 3.5]), "a", "b")
    assert "no measurable difference" in visible_text(overlap)


def test_zb_h1_verdict_is_the_step_not_the_bubble():
    """A smaller measured bubble with a slower step reads as a slower step, said so."""
    from util.measure import Timing
    slow, fast = Timing([0.0976, 0.0926, 0.101]), Timing([0.0731, 0.070, 0.0788])
    from util.render import visible_text
    words = visible_text(L.zb_h1_verdict(0.212, 0.285, slow, fast))
    assert words.startswith("its measured bubble is smaller (21.2% against 28.5%). Yet its step is 1.34× slower than 1F1B's: the step")
    assert "outweighs" not in words                                  # no cause claimed without the busy times
    words = L.zb_h1_verdict(0.212, 0.285, slow, fast, 0.30, 0.21)
    assert "300 ms of compute per step over the ranks against 1F1B's 210 ms" in words and "outweighs" in words
    assert "). Its step is 1.34× faster than 1F1B's too." in visible_text(L.zb_h1_verdict(0.212, 0.285, fast, slow))
    assert "not smaller" in L.zb_h1_verdict(0.3, 0.285, fast, fast)
    assert "(30.0% against 28.5%). Yet its step is 1.34× faster than 1F1B's." in visible_text(L.zb_h1_verdict(0.3, 0.285, fast, slow))
    assert "(30.0% against 28.5%). Its step is 1.34× slower than 1F1B's." in visible_text(L.zb_h1_verdict(0.3, 0.285, slow, fast))
    assert ". Its step and 1F1B's show no measurable" in visible_text(L.zb_h1_verdict(0.3, 0.285, fast, fast))
    # whichever branch a build takes, each sentence keeps to two measured numbers (issue 43)
    from tests.support.density import MAX_PER_SENTENCE, measured_numbers, sentences
    for bubbles in ((0.212, 0.285), (0.3, 0.285)):
        for pair in ((slow, fast), (fast, slow), (fast, fast), (Timing([0.09]), fast)):
            for said in sentences(visible_text(L.zb_h1_verdict(*bubbles, *pair, 0.30, 0.21))):
                assert len(measured_numbers(said)) <= MAX_PER_SENTENCE, said


def test_timed_comparisons_take_enough_samples():
    """PyTorch's comparison warms up and takes 3 repeats in quick mode;
    sleep mode takes at least 5."""
    import inspect
    src = inspect.getsource(L.pytorch_schedules)
    assert "repeats=3 if settings.quick" in src and "warmup=1 if settings.quick" in src
    assert "repeats=5 if settings.quick" in inspect.getsource(L.run_sleep_mode)


def test_sleep_caveat_said_once_and_megatron_claim_dated():
    """Sleep mode's caveat is said once, and the Megatron claim names the option it rests on
    (microbatch_group_size_per_vp_stage), so a reader can check it against their version."""
    import inspect
    assert inspect.getsource(L.measured_schedules).count("sleep_mode(p)") == 1
    assert "microbatch_group_size_per_vp_stage" in inspect.getsource(L.interleaved_measured)


@pytest.mark.parametrize("cost,pair,says", [
    ({"F": -1.0, "B": 1.0}, None, "cost F must be a finite number of at least 0, not -1.0"),
    ({"F": 1.0, "B": float("nan")}, None, "cost B must be a finite number of at least 0, not nan"),
    ({"F": 1.0, "B": 1.0, "W": float("inf")}, None, "cost W must be"),
    ({"F": 1.0, "B": 1.0, "send": -0.1}, None, "cost send must be"),
    ({"F": 1.0}, None, "cost needs F and B"),
    ({"F": 1.0, "B": 1.0, "W": 1.0}, float("nan"), "cost pair must be")])
def test_simulate_refuses_costs_that_are_not_times(cost, pair, says):
    """A negative or non-finite cost (or a missing B) is a clear
    ValueError, not a NaN makespan or a bubble outside 0-100%; zero costs stay allowed."""
    with pytest.raises(ValueError, match=re.escape(says)):
        simulate(make_schedule("dualpipev", 2, 4, 2), cost, pair=pair)
    free = simulate(make_schedule("1f1b", 2, 4), {"F": 1, "B": 1, "W": 0, "send": 0})
    assert free.makespan == 10 and 0 <= free.bubble < 1


def test_explorer_formula_is_the_papers_and_exact_where_it_is_shown():
    """Beside the explorer's timeline stands the paper's formula, evaluated at the
    explorer's costs, and only where it equals the simulated bubble of that very list; ZB-H2,
    ZB-V and DualPipeV say there is no closed form here, and why."""
    import random
    from lectures.pipeline import explorer_entries, formula_bubble
    rng, shown = random.Random(3), set()
    for e in explorer_entries():
        sched = make_schedule(e["name"], e["p"], e["m"], e["chunks"])
        if e["name"] in ("zb-h2", "zb-v", "dualpipev"):
            assert e["formula"] is None and e["why"], e
            continue
        if e["formula"] is None:
            assert "assumes m ≥ p" in e["why"] or "one chunk per rank" in e["why"], e
            continue
        for _ in range(3):
            F, B = rng.uniform(0.2, 3), rng.uniform(0.2, 3)
            stage = {"F": F, "B": B, "W": rng.uniform(0, min(F, B)), "send": 0}
            v = e["chunks"]
            sim = simulate(sched, {k: stage[k] / v for k in "FBW"})
            assert formula_bubble(e["formula"], e["p"], e["m"], stage) == pytest.approx(sim.bubble, abs=1e-9), e["name"]
        shown.add(e["name"])
        assert formula_bubble(e["formula"], e["p"], e["m"], dict(stage, send=0.1)) is None   # sends are not free
    assert shown == {"naive", "gpipe", "1f1b", "interleaved-1f1b", "zb-h1"}
    zb = next(e for e in explorer_entries(names=("zb-h1",)) if (e["p"], e["m"]) == (4, 8))
    assert zb["formula"]["text"].startswith("(p−1)(F+B−W)") and "Qi et al." in zb["formula"]["source"]
    assert formula_bubble(zb["formula"], 4, 8, {"F": 1, "B": 1, "W": 1}) == pytest.approx(3 / 27)
    assert formula_bubble(zb["formula"], 4, 8, {"F": 1, "B": 1, "W": 1.5}) is None      # W > F: not this list's


def test_figure_helpers_draw_what_the_runs_measured():
    """The pictures that open four sections take their numbers from the run: a rank that
    recorded no span spans the whole demo; the deadlock, real-compute and PyTorch figures draw
    one bar per rank, run or schedule, each as long as what was measured."""
    import types
    from util.measure import Timing
    run = types.SimpleNamespace(world_size=2, elapsed=3.2, spans=[
        {"label": "send", "rank": 1, "start": 0.1, "end": 3.1}, {"label": "other", "rank": 0, "start": 0, "end": 1}])
    assert rank_spans(run, "send") == {0: (0.0, 3.2), 1: (0.1, 3.1)}
    fig = deadlock_figure({0: (0.0, 3.0), 1: (0.1, 3.1)}, {0: (0.0, 0.04), 1: (0.01, 0.05)}, 16, [1.0, 0.0])
    left, right = fig.axes
    assert [round(b.get_width(), 6) for b in left.patches[:2]] == [3.0, 3.0]          # seconds
    assert [round(b.get_width(), 6) for b in right.patches[:2]] == [40.0, 40.0]       # ms
    assert "got 1" in [t.get_text().strip() for t in right.texts]
    assert fig.get_size_inches()[0] <= 7.5
    times = {label: Timing([0.1, 0.2, 0.3]) for cls in PYTORCH_SCHEDULES
             for label in ("PyTorch " + cls, "ours: " + PYTORCH_SCHEDULES[cls][1])}
    times["PyTorch ScheduleGPipe"] = Timing([0.5, 0.6, 0.7])
    fig = pytorch_figure(times, list(PYTORCH_SCHEDULES))
    widths = sorted(round(b.get_width(), 6) for b in fig.axes[0].patches)
    assert widths == [200.0] * 11 + [600.0] and fig.get_size_inches()[0] <= 7.5


def test_four_sections_open_with_a_picture(course_site):
    """The executor, real compute, deadlock and PyTorch sections open with a figure
    drawn from their runs (only a demo's own bar may come first); the page stays within 25
    screens (checked by the page tests) because two tables live in the appendix."""
    import json
    from tests.conftest import walk
    rec = json.loads((built(course_site, "lecture_05_pipeline_parallel") / "lecture_05_pipeline_parallel.json").read_text())
    records = [r for r in rec["records"] if r["kind"] != "demo"]
    opens = {}
    for i, r in enumerate(records):
        if r["kind"] == "note" and r["text"].lstrip().startswith("## "):
            opens[r["text"].lstrip()[3:].splitlines()[0].strip()] = records[i + 1]["kind"] if i + 1 < len(records) else None
    for title in ("One executor for every schedule", "Real compute, and GPipe with activation checkpointing",
                  "Deadlock, and how batched send/receive avoids it", "PyTorch's own: torch.distributed.pipelining"):
        assert opens[title] == "figure", (title, opens[title])
    spans = [s for r in rec["records"] if r["kind"] == "demo" and "deadlock" in r["name"]
             for s in walk(r["records"]) if s["kind"] == "span"]
    assert sorted(s["rank"] for s in spans) == [0, 1] and all(s["end"] - s["start"] > 1 for s in spans)


def test_time_between_actions_is_a_reason_only_when_zb_h1_loses_more_there():
    """The review's case: ZB-H1 lost 1.0 ms per action, 1F1B 2.0 ms, and the page gave ZB-H1's
    excess as why its step was slower; close excesses are 'about as much', and a step faster
    than its list lost nothing between actions."""
    from util.measure import Timing
    slow, fast = Timing([0.30, 0.31, 0.32]), Timing([0.20, 0.21, 0.22])
    less = L.between_actions(0.001, 0.002, 0.010, slow, fast)
    assert "less there than 1F1B" in less and "not what makes its step slower" in less
    assert "clean idle" not in less
    more = L.between_actions(0.003, 0.002, 0.010, slow, fast)
    assert "loses more there than 1F1B" in more and "0.3× its average action" in more
    close = L.between_actions(0.00140, 0.00139, 0.010, slow, fast)
    assert "about as much there as 1F1B" in close and "clean idle" not in close
    # a slower median inside the spreads is no verdict: nothing said about what makes it slower
    tied = L.between_actions(0.001, 0.002, 0.010, Timing([1.5, 2.5, 3.5]), Timing([1.0, 2.0, 3.0]))
    assert "slower" not in tied
    faster = L.between_actions(-0.0005, 0.002, 0.010, slow, fast)
    assert "0.5 ms per action less" in faster and "longer" not in faster and "did not slow it" in faster
    trifle = L.between_actions(0.0002, -0.001, 0.010, slow, fast)     # more than 1F1B, but 2% of an action
    assert "clean idle" not in trifle and "little there, but more than 1F1B" in trifle
    assert "1.0 ms per action shorter" in L.between_actions(0.003, -0.001, 0.010, slow, fast)
