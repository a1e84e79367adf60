"""Tied embeddings in the pipeline: the first stage's embedding and the last stage's LM
head are two copies of one weight; after the pipeline's backward their gradients are summed across
the two ranks (or, on the V layouts' rank 0, which holds both ends, autograd has summed them in the
one Parameter). Loss, every gradient and the parameters after two AdamW steps equal one process
with tied embeddings, on real gloo ranks and under the NCCL stand-in."""
import re
import types

import pytest
import torch

from lectures.model import GPTConfig
from lectures.pipeline import V_SHAPED, Layout, PipelineExecutor, make_schedule
from lectures.pipeline.demos import reference_train, train_pipeline
from lectures.pipeline import executor as pipeline
from lectures.pipeline import demos
from util import spawn
from tests.support.nccl_standin import NcclLikeP2P, run_ranks

CFG = GPTConfig(n_layers=4, d_model=16, n_heads=2, seq_len=8, dtype="float64", tie_embeddings=True)
MB, STEPS = 3, 2
CASES = [(2, "1f1b", 1, 3), (2, "zb-v", 2, 4), (2, "dualpipev", 2, 5), (3, "1f1b", 1, 4), (4, "1f1b", 1, 5)]
TIED = "tok_emb.weight"          # the name one process gives the tied weight (named_parameters lists it once)


def train_tied(rank, world_size, cases):
    return {(name, v, m): train_pipeline(rank, world_size, CFG, name, m, MB, chunks=v, steps=STEPS)
            for p, name, v, m in cases if p == world_size}


@pytest.fixture(scope="module")
def executed():
    return {p: spawn(train_tied, p, cases=CASES).returns for p in sorted({c[0] for c in CASES})}


@pytest.mark.parametrize("p,name,v,m", CASES)
def test_tied_pipeline_equals_one_tied_process(executed, p, name, v, m):
    ref = reference_train(CFG, m, MB, steps=STEPS)
    assert "lm_head.weight" not in ref["grads"], "one process holds the tied weight once"
    got = [r[name, v, m] for r in executed[p]]
    losses = [r["losses"] for r in got if r["losses"][0] is not None]
    assert len(losses) == 1
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref["losses"]), rtol=1e-6, atol=1e-6)
    # the embedding on the first stage's rank, the LM head on the last's: both are the tied weight
    ends = {"tok_emb.weight": Layout(p, v, "v" if name in V_SHAPED else "looped").place(0)[0],
            "lm_head.weight": Layout(p, v, "v" if name in V_SHAPED else "looped").place(p * v - 1)[0]}
    assert [r for r, res in enumerate(got) if "lm_head.weight" in res["grads"]] == [ends["lm_head.weight"]]
    for copy, r in ends.items():
        torch.testing.assert_close(got[r]["grads"][copy], ref["grads"][TIED], rtol=1e-9, atol=1e-12, msg=copy)
        torch.testing.assert_close(got[r]["params"][copy], ref["params"][TIED], rtol=1e-9, atol=1e-12, msg=copy)
    first, last = (got[r]["params"][copy] for copy, r in ends.items())
    assert torch.equal(first, last), "the two copies take bit-identical steps"
    grads = {k: g for res in got for k, g in res["grads"].items()}
    params = {k: q for res in got for k, q in res["params"].items()}
    assert set(grads) == set(params) == set(ref["grads"]) | {"lm_head.weight"}
    for k in ref["grads"]:
        torch.testing.assert_close(grads[k], ref["grads"][k], rtol=1e-9, atol=1e-12, msg=k)
        torch.testing.assert_close(params[k], ref["params"][k], rtol=1e-9, atol=1e-12, msg=k)


def test_tie_peer_is_the_other_end_or_none():
    assert [pipeline.tie_peer(Layout(4), r) for r in range(4)] == [3, None, None, 0]
    assert [pipeline.tie_peer(Layout(2, 2, "v"), r) for r in range(2)] == [None, None]     # rank 0 holds both
    assert [pipeline.tie_peer(Layout(2, 2, "looped"), r) for r in range(2)] == [1, 0]     # stage 3 on rank 1
    assert pipeline.tie_peer(Layout(1), 0) is None


def run_tied_under_nccl(name, p, m, v, monkeypatch, offset=1, hook=False, steps=1, skew=False):
    """One tied step with ranks as threads under NCCL's rules (one Work per batch, posting-order
    matching, unbuffered sends), on global ranks offset..offset+p-1; each rank its own model."""
    p2p = NcclLikeP2P()
    monkeypatch.setattr(pipeline, "dist", p2p)
    sched = make_schedule(name, p, m, v)
    stages = [pipeline.split_gpt(CFG, sched.layout)[1] for _ in range(p)]   # built here: the seeding is not thread-safe
    if hook:
        stages[0][0].tok_emb.weight.register_post_accumulate_grad_hook(lambda t: None)
    if skew:    # the last stage's copy starts elsewhere (ranks seeded differently): the first step syncs it
        with torch.no_grad():
            stages[-1][sched.layout.stages - 1].lm_head.weight.add_(1.0)
    inputs, targets = demos.microbatches(CFG, m, MB, 0)
    group = types.SimpleNamespace(ranks=list(range(offset, offset + p)))

    def rank_main(g):
        p2p.local.rank = g
        r = g - offset
        mine = {c: stages[r][sched.layout.stage(r, c)] for c in range(v)}
        ex = PipelineExecutor(sched, mine, r, (MB, CFG.seq_len, CFG.d_model), group=group, dtype=torch.float64)
        for _ in range(steps):         # no zero_grad between them: the gradients accumulate
            ex.step(inputs, targets)
        return {sched.layout.stage(r, c): mod for c, mod in mine.items()}
    return run_ranks(rank_main, range(offset, offset + p))


def assert_tied_grads(held, ref, times=1):
    grads = {k: g for r in held.values() for k, g in pipeline.gradients_by_name(r).items()}
    assert set(grads) == set(ref) | {"lm_head.weight"}
    for k, g in grads.items():
        torch.testing.assert_close(g, times * ref[TIED if k == "lm_head.weight" else k], rtol=1e-9, atol=1e-12, msg=k)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 3, 4, 1), ("zb-h1", 2, 3, 1), ("zb-v", 2, 4, 2),
                                        ("interleaved-1f1b", 2, 4, 2), ("gpipe", 3, 3, 1), ("zb-h2", 3, 4, 1)])
def test_tied_gradient_sum_under_nccls_rules(name, p, m, v, monkeypatch):
    assert_tied_grads(run_tied_under_nccl(name, p, m, v, monkeypatch), reference_train(CFG, m, MB, steps=1)["grads"])


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 2, 3, 1), ("1f1b", 3, 4, 1), ("zb-v", 2, 4, 2)])
def test_tied_gradients_accumulate_over_two_steps(name, p, m, v, monkeypatch):
    """Two steps without zero_grad give twice one step's gradient on every copy: only each step's
    own part crosses between the ends (exchanging the accumulated total would count the first
    step's three times)."""
    held = run_tied_under_nccl(name, p, m, v, monkeypatch, steps=2)
    assert_tied_grads(held, reference_train(CFG, m, MB, steps=1)["grads"], times=2)


def test_the_first_step_makes_the_two_copies_equal(monkeypatch):
    """The last stage's copy starts elsewhere (as with ranks seeded differently): the first step
    gives it the first stage's values, so the step equals one tied process."""
    held = run_tied_under_nccl("1f1b", 3, 4, 1, monkeypatch, skew=True)
    assert torch.equal(held[1][0].tok_emb.weight, held[3][2].lm_head.weight)      # global ranks 1..3
    assert_tied_grads(held, reference_train(CFG, 4, MB, steps=1)["grads"])


@pytest.mark.parametrize("p", [2, 3])
def test_a_hook_on_the_tied_gradient_is_refused_on_every_rank(monkeypatch, p):
    """A hook on the tied weight (the course's overlapped all-reduce, Zero2) would reduce or shard
    it before the sum: refused, not trained wrongly — and every rank, the middle ones too, raises
    at once instead of waiting for a message the hooked end will not send."""
    import time
    start = time.monotonic()
    with pytest.raises(AssertionError, match="a gradient hook on the tied weight: refused"):
        run_tied_under_nccl("1f1b", p, 3, 1, monkeypatch, hook=True)
    assert time.monotonic() - start < 10, "a rank waited for its peer's timeout"


def test_page_states_what_the_tie_costs(course_site):
    """The appendix's paragraph gives the all-reduce's size from the run's config (vocab × hidden ×
    bytes per element) and its table shows the tied pipeline equal to one process."""
    from tests.conftest import built
    page = (built(course_site, "lecture_05_pipeline_parallel") / "lecture_05_pipeline_parallel_appendix.html").read_text()
    page = re.sub(r"\s+", " ", page)                    # the note's lines break anywhere
    cfg = GPTConfig(d_model=32, dtype="float64")        # tied_embeddings' model: the page's vocabulary and width
    assert f"{cfg.vocab_size} × {cfg.d_model} × 8 bytes = {cfg.vocab_size * cfg.d_model * 8 / 2**10:g} KiB" in page
    assert "Deep dive: tied embeddings across the pipeline" in page and "nothing crosses the network" in page
