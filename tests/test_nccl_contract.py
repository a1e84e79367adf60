"""The pipeline executor under NCCL's rules, without a GPU.

NCCL returns one Work per batch_isend_irecv, fills a receive only for the Work that is waited on,
runs a rank's batches in order on one stream, matches a pair's messages in posting order and
completes a send only when its receive runs. `simulate.p2p_deadlock` applies those rules to
the executor's plans for every schedule and size lecture 05 allows; `tests/support/nccl_standin.py`
applies them to real tensors, with ranks as threads, and the executor must then train exactly
like one process."""
import types

import pytest
import torch

from lectures.pipeline import executor as pipeline
from lectures.model import GPTConfig
from lectures.pipeline import PipelineExecutor, make_schedule, message_order, p2p_deadlock
from lectures.pipeline.simulate import one_stream_makespan
from lectures.pipeline.demos import reference_train
from lectures.pipeline import demos, schedules
from tests.support.nccl_standin import NcclLikeP2P, run_ranks

V = {"interleaved-1f1b": (2, 3, 4), "zb-v": (2,), "dualpipev": (2,), "gpipe": (1, 2), "1f1b": (1, 2)}


def allowed(p_max=8, m_max=16):
    """Every (schedule, p, m, v) that make_schedule builds (the others it refuses clearly)."""
    for name in schedules.SCHEDULES:
        for p in range(1, p_max + 1):
            for v in V.get(name, (1,)):
                for m in range(1, m_max + 1):
                    try:
                        yield name, p, m, v, make_schedule(name, p, m, v)
                    except ValueError:
                        continue


# --- the rules, on programs small enough to check by hand -----------------------------------------

def test_the_rules_find_the_cycles_nccl_has():
    send = lambda peer, key: ("post", [("send", peer, key)])
    recv = lambda peer, key: ("post", [("recv", peer, key)])
    # each rank sends first, in a batch of its own: each send waits for a receive queued behind it
    assert p2p_deadlock([[send(1, "a"), recv(1, "b"), ("wait", "b")],
                         [send(0, "b"), recv(0, "a"), ("wait", "a")]])
    # the same messages in one batch per rank meet
    assert p2p_deadlock([[("post", [("send", 1, "a"), ("recv", 1, "b")]), ("wait", "b")],
                         [("post", [("send", 0, "b"), ("recv", 0, "a")]), ("wait", "a")]]) is None
    # a send before a receive it does not depend on, on the other side: fine
    assert p2p_deadlock([[send(1, "a"), recv(1, "b"), ("wait", "b")],
                         [recv(0, "a"), ("wait", "a"), send(0, "b")]]) is None
    # a send at the head of a stream blocks the receives queued behind it: rank 1's stream starts
    # with a send rank 0 never receives, so rank 0's sends never meet their receives
    stuck = p2p_deadlock([[send(1, "a"), send(1, "c")], [send(0, "b"), recv(0, "a"), recv(0, "c")]])
    assert [r for r, _, _ in stuck] == [0, 1]
    # tags are ignored: a pair's first receive takes the first send, whatever the keys say (no
    # deadlock: the wrong tensor arrives; the plans' per-pair order is checked below for that)
    assert p2p_deadlock([[send(1, "x")], [recv(0, "y"), ("wait", "y")]]) is None


def test_no_schedule_lecture_05_allows_deadlocks_under_nccls_rules():
    """Every schedule, p <= 8, m <= 16 and the chunk counts the lecture uses: the plans of all ranks
    finish under NCCL's rules, and each pair posts its messages in the same order at both ends."""
    checked = 0
    for name, p, m, v, sched in allowed():
        plans = pipeline.communication_plans(sched)
        stuck = p2p_deadlock(plans)
        assert stuck is None, f"{name} p={p} m={m} v={v}: {stuck[:2]}"
        for (src, dst), keys in message_order(sched).items():
            sends = [k for what, batch in plans[src] if what == "post" for op, peer, k in batch
                     if op == "send" and peer == dst]
            recvs = [k for what, batch in plans[dst] if what == "post" for op, peer, k in batch
                     if op == "recv" and peer == src]
            assert sends == recvs == keys, f"{name} p={p} m={m} v={v}: pair {src}->{dst}"
        checked += 1
    assert checked > 600


# The costs a plan can be timed with: unit, Qi et al.'s measured mixes (1.5B with its T_comm),
# W free, a dear B, and the page's sleep mode (seconds, per chunk)
PLAN_COSTS = [None, {"F": 1, "B": 1, "W": 0.5}, {"F": 1, "B": 0.976, "W": 0.504, "send": 0.032},
              {"F": 1, "B": 1, "W": 0}, {"F": 1, "B": 2, "W": 1}, {"F": 0.04, "B": 0.04, "W": 0.04}]


def test_plans_timed_at_the_runs_costs_stay_deadlock_free():
    """The slots may come from any costs the run will have: every schedule, p <= 8, m <= 16, each
    size under one of PLAN_COSTS in turn (p = 4, m = 8 under all), finishes under NCCL's rules,
    each pair in the same order at both ends."""
    checked = 0
    for n, (name, p, m, v, sched) in enumerate(allowed()):
        for cost in (PLAN_COSTS if (p, m) == (4, 8) else [PLAN_COSTS[n % len(PLAN_COSTS)]]):
            plans = pipeline.communication_plans(sched, cost=cost)
            stuck = p2p_deadlock(plans)
            assert stuck is None, f"{name} p={p} m={m} v={v} cost={cost}: {stuck[:2]}"
            for (src, dst), keys in message_order(sched).items():
                sends = [k for what, batch in plans[src] if what == "post" for op, peer, k in batch
                         if op == "send" and peer == dst]
                assert sends == keys, f"{name} p={p} m={m} v={v} cost={cost}: pair {src}->{dst}"
            checked += 1
    assert checked > 600


def test_all_ranks_plans_at_once_are_each_ranks_own():
    """`communication_plans` (one simulation, the deadlock checks above) gives what each rank's
    executor computes alone with `communication_plan`."""
    for name, v in (("zb-h1", 1), ("dualpipev", 2), ("interleaved-1f1b", 2)):
        sched = make_schedule(name, 4, 8, v)
        for cost in (None, PLAN_COSTS[2]):
            assert pipeline.communication_plans(sched, cost=cost) == \
                [pipeline.communication_plan(sched, r, cost=cost) for r in range(4)], (name, cost)


@pytest.mark.parametrize("name,v", [("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2)])
def test_a_plan_timed_at_the_runs_costs_keeps_the_simulated_step(name, v):
    """Review B1: slots from unit costs, one batch per slot, made a message ready early wait
    behind a batch whose partner still computes (one stream per rank): at F = B = 1, W = 0.5
    ZB-H1 took 26.5 units instead of 24.5 at p = 4. Timed at the run's costs (and one batch per
    neighbour and slot), the plan keeps the simulator's makespan."""
    sched = make_schedule(name, 4, 8, v)
    cost = demos.chunk_cost(v, 1, 1, 0.5)
    ideal = pipeline.simulate(sched, cost).makespan
    timed = one_stream_makespan(sched, cost, pipeline.communication_plans(sched, cost=cost))
    unit = one_stream_makespan(sched, cost, pipeline.communication_plans(sched))
    stuck = pipeline.communication_plans(sched, cost=cost)[:3] + [[]]
    assert one_stream_makespan(sched, cost, stuck) is None      # a rank that posts nothing: stuck, said so
    assert timed == pytest.approx(ideal) and unit >= ideal - 1e-9


# --- the executor on real tensors under the stand-in -------------------------------------------

def run_under_nccl(name, p, m, v, monkeypatch, offset=0, cost=None):
    """Train one step with ranks as threads under NCCL's rules on global ranks offset..offset+p-1
    (a sub-group when offset > 0), the plan timed at `cost` if given; returns the executors and
    the stand-in."""
    p2p = NcclLikeP2P()
    monkeypatch.setattr(pipeline, "dist", p2p)
    sched = make_schedule(name, p, m, v)
    cfg = GPTConfig(n_layers=2 * p * v, d_model=16, n_heads=2, seq_len=8, dtype="float64")
    _, stages = pipeline.split_gpt(cfg, sched.layout)
    inputs, targets = demos.microbatches(cfg, m, 2, 0)
    group = types.SimpleNamespace(ranks=list(range(offset, offset + p))) if offset else None

    def rank_main(g):
        p2p.local.rank = g
        r = g - offset
        mine = {c: stages[sched.layout.stage(r, c)] for c in range(v)}
        ex = PipelineExecutor(sched, mine, r, (2, cfg.seq_len, cfg.d_model), group=group, dtype=torch.float64,
                              cost=cost)
        ex.step(inputs, targets)
        return ex
    executors = run_ranks(rank_main, range(offset, offset + p))
    ref = reference_train(cfg, m, 2, steps=1)
    grads = pipeline.gradients_by_name(stages)
    assert set(grads) == set(ref["grads"])
    for k, g in ref["grads"].items():
        torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-12, msg=f"{name} p={p} m={m} v={v}: {k}")
    return executors, p2p


CASES = [(name, p, m, v) for p in (2, 3, 4) for name in schedules.SCHEDULES for v in V.get(name, (1,))[:1]
         for m in sorted({p + 1, 2 * p + 1} if name == "dualpipev" else {p - 1 or 1, p + 1, 2 * p})
         if (name, p, m, v) != ("dualpipev", 3, 4, 2)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_schedule_equals_one_process_under_nccls_rules(name, p, m, v, monkeypatch):
    try:
        make_schedule(name, p, m, v)
    except ValueError:
        pytest.skip("the schedule refuses this size")
    executors, p2p = run_under_nccl(name, p, m, v, monkeypatch)
    assert p2p.works_returned == p2p.batches          # one Work per batch, as NCCL returns


@pytest.mark.parametrize("p,m", [(4, 8), (8, 16)])
@pytest.mark.parametrize("name,v", [("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-h2", 1), ("zb-v", 2), ("dualpipev", 2)])
def test_plans_timed_at_the_runs_costs_train_right_under_nccls_rules(name, v, p, m, monkeypatch):
    """Issue 39: the plan's slots come from the costs the run will have (W half of B, as Qi et
    al. measured): on real tensors under the stand-in it finishes, up to p = 8, and equals one
    process; one Work per batch."""
    executors, p2p = run_under_nccl(name, p, m, v, monkeypatch, cost=demos.chunk_cost(v, 1, 1, 0.5))
    assert p2p.works_returned == p2p.batches


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("dualpipev", 2)])
def test_on_a_sub_group_under_nccls_rules(name, v, monkeypatch):
    """Ranks 1..3 of a larger world: peers are named by their global rank."""
    executors, _ = run_under_nccl(name, 3, 7, v, monkeypatch, offset=1)
    assert {peer for ex in executors.values() for peer, _, _ in ex.posted} <= {0, 1, 2}


def test_the_stand_in_hands_over_data_only_to_the_waited_work(monkeypatch):
    """What the old executor got wrong on NCCL: it paired ops with Works one to one, so every op
    after the first had no Work to wait for and was read before it arrived (NaN here)."""
    p2p = NcclLikeP2P()

    def rank_main(r):
        p2p.local.rank = r
        peer = 1 - r
        out, back = torch.full((3,), float(r)), torch.empty(3)
        works = p2p.batch_isend_irecv([p2p.P2POp(p2p.isend, out, peer), p2p.P2POp(p2p.irecv, back, peer)])
        assert len(works) == 1
        early = back.clone()
        works[0].wait()
        return early, back
    got = run_ranks(rank_main, [0, 1])
    for r, (early, back) in got.items():
        assert torch.isnan(early).all() or torch.equal(early, back)
        assert torch.equal(back, torch.full((3,), float(1 - r)))


def test_a_step_with_another_number_of_microbatches_refuses():
    cfg = GPTConfig(n_layers=2, d_model=16, n_heads=2, seq_len=8, dtype="float64")
    sched = make_schedule("1f1b", 1, 3)
    _, stages = pipeline.split_gpt(cfg, sched.layout)
    ex = PipelineExecutor(sched, {0: stages[0]}, 0, (2, 8, 16), dtype=torch.float64)
    inputs, targets = demos.microbatches(cfg, 4, 2, 0)
    with pytest.raises(ValueError, match="runs 3 micro-batches; got 4"):
        ex.step(inputs, targets)
