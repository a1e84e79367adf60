"""Lecture 08: checkpoints that load under any layout, clipping counted once over every axis,
a job that survives a rank's death, and bad checkpoints refused without harm.

The model is float64 (lecture 01's loss computes in float32, so "equal" means ~1e-7), with 3
layers and 4 heads: awkward pipeline cuts (3 stages of 1 layer, 2 stages of 1 and 2)."""
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess

import pytest
import torch

from lectures.checkpoint import CheckpointError, export, load, save, saved_steps, train_resumable
from lectures.checkpoint.pytorch import pytorch_resume, pytorch_save
from lectures.checkpoint.restart import expected_waste, read_events, torchrun_command, young_daly
from lectures.layout import Layout, LayoutTrainer, Run, build_model, make_mesh, max_param_diff, reference_run
from lectures.layout.shards import Piece, flat_boxes, global_grad_norm
from lectures.model import GPT, GPTConfig
from util import spawn

CFG = GPTConfig(vocab_size=32, seq_len=12, d_model=24, n_layers=3, n_heads=4, dtype="float64")
RUN = Run(cfg=CFG, global_batch=8, steps=4)
L = {
    "1 rank": Layout(micro_batch=4, micro_batches=2),
    "dp×tp": Layout(dp=2, tp=2, micro_batch=4),
    "pp×tp": Layout(pp=2, tp=2, micro_batch=1, micro_batches=8),
    "dp×cp ZeRO-2": Layout(dp=2, cp=2, zero=2, micro_batch=2, micro_batches=2),
    "dp ZeRO-1": Layout(dp=2, zero=1, micro_batch=2, micro_batches=2),
    "pp3": Layout(pp=3, micro_batch=2, micro_batches=4),
    "tp2 SP": Layout(tp=2, sp=True, micro_batch=4, micro_batches=2),
}
PAIRS = [("dp×tp", "pp×tp"), ("dp×cp ZeRO-2", "dp×tp"), ("pp×tp", "dp ZeRO-1"), ("pp3", "1 rank"),
         ("1 rank", "pp3"), ("dp ZeRO-1", "tp2 SP")]


@pytest.fixture(scope="module")
def reference():
    return reference_run(RUN)


def moved(ref):
    """The check can fail: training moved the parameters."""
    init = {k: p.detach() for k, p in GPT(CFG).named_parameters()}
    return max((ref["params"][k] - v).abs().max().item() for k, v in init.items())


@pytest.mark.parametrize("before,after", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_save_under_one_layout_load_under_another_equals_one_process(tmp_path, reference, before, after):
    a, b = L[before], L[after]
    first = spawn(train_resumable, a.world, run=RUN, layout=a, directory=str(tmp_path), until=2, save_every=2).returns
    assert first[0]["start"] == 0 and saved_steps(str(tmp_path)) == [2]
    second = spawn(train_resumable, b.world, run=RUN, layout=b, directory=str(tmp_path), until=4).returns
    assert all(r["start"] == 2 for r in second)
    assert max_param_diff(second, reference["params"]) < 1e-6
    torch.testing.assert_close(torch.tensor(second[0]["losses"]), torch.tensor(reference["losses"][2:]),
                               rtol=1e-6, atol=1e-6)
    assert moved(reference) > 1e-3


def test_without_the_optimizer_state_the_resumed_run_differs(tmp_path, reference):
    """What the comparison above would miss if load restored only the weights: AdamW restarted
    from zero moments and step 0 ends elsewhere."""
    lay = L["dp×tp"]
    spawn(train_resumable, 4, run=RUN, layout=lay, directory=str(tmp_path), until=2, save_every=2)
    got = spawn(_resume_weights_only, 4, run=RUN, layout=lay, directory=str(tmp_path)).returns
    assert max_param_diff(got, reference["params"]) > 1e-4


def _resume_weights_only(rank, world_size, run, layout, directory):
    trainer = LayoutTrainer(run, layout, make_mesh(layout.dp, layout.pp, layout.cp, layout.tp), track_memory=False)
    start = load(trainer, directory)
    trainer.opt.state.clear()
    for step in range(start, 4):
        trainer.train_step(step)
    return {"params": trainer.full_parameters()}


def test_export_is_the_one_process_model(tmp_path, reference):
    spawn(train_resumable, 4, run=RUN, layout=L["pp×tp"], directory=str(tmp_path), until=4, save_every=4)
    out = export(str(tmp_path), str(tmp_path / "model.pt"))
    weights = torch.load(out)
    assert set(weights) == set(reference["params"])
    assert max((weights[k] - v).abs().max().item() for k, v in reference["params"].items()) < 1e-6
    model = GPT(CFG)
    model.load_state_dict(weights)          # loads into the plain model: names and shapes are its own


def test_async_save_writes_what_a_synchronous_save_writes(tmp_path):
    got = spawn(_sync_and_async, 4, run=RUN, layout=L["dp×cp ZeRO-2"], directory=str(tmp_path)).returns
    assert got[0]["steps"] == [1, 2]
    a, b = (torch.load(export(str(tmp_path), str(tmp_path / f"{s}.pt"), step=s)) for s in (1, 2))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _sync_and_async(rank, world_size, run, layout, directory):
    from lectures.checkpoint import finish
    trainer = LayoutTrainer(run, layout, make_mesh(layout.dp, layout.pp, layout.cp, layout.tp), track_memory=False)
    trainer.train_step(0)
    save(trainer, directory, 1)
    pending = save(trainer, os.path.join(directory), 2, async_save=True)
    # what the background write holds is a copy: changing the weights now changes nothing there
    with torch.no_grad():
        for p in trainer.params:
            p.add_(1.0)
    finish(pending)
    return {"steps": saved_steps(directory)}


def test_dcps_greedy_planner_makes_zero1s_rank_1_write_most_and_the_page_says_why_only_then(tmp_path):
    """DCP gives each replicated box to the rank with the least to write so far, going through
    rank 0's boxes first: under ZeRO-1 rank 0's own Adam shard comes in between, so rank 1 takes
    most of the replicated weights, then writes its own shard too. The page explains the split
    only when the run's bytes show it."""
    from lectures.checkpoint.demos import checkpoint_costs
    from lectures.lecture_08_checkpoints_and_restarts import uneven_writes
    got = spawn(checkpoint_costs, 2, run=RUN, layout=Layout(dp=2, zero=1, micro_batch=4), directory=str(tmp_path),
                repeats=1).returns
    mine, held = [r["mine"] for r in got], [r["held"] for r in got]
    assert held[0] == held[1] and mine[1] > 1.5 * mine[0], (mine, held)
    said = uneven_writes({"dp + ZeRO-1": [(m / 2 ** 20, h / 2 ** 20) for m, h in zip(mine, held)]})
    assert "Under ZeRO-1 rank 0 writes" in said and "tp" not in said
    assert uneven_writes({"dp + ZeRO-1": [(20.0, 26.2), (20.1, 26.2)], "tp": [(20.1, 19.8), (20.1, 19.8)]}) == ""
    assert uneven_writes({"tp": [(19.74, 19.80), (20.12, 19.80)]}).startswith("Under tp the replicas are")


def test_a_resume_restores_each_ranks_rng_and_seeds_new_ranks_deterministically(tmp_path):
    """Saved on 2 ranks, loaded on 4, twice, after drawing different amounts: ranks 0 and 1 draw
    what they would have drawn after the save; ranks 2 and 3, absent from the checkpoint, draw
    the same in both loads, each its own stream."""
    before = spawn(_rng_after_save, 2, run=RUN, layout=Layout(dp=2, micro_batch=4), directory=str(tmp_path)).returns
    assert not torch.equal(before[0], before[1])
    loads = [spawn(_rng_after_load, 4, run=RUN, layout=Layout(dp=4, micro_batch=2), directory=str(tmp_path),
                   draws=draws).returns for draws in (0, 5)]
    for after in loads:
        assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert torch.equal(loads[0][2], loads[1][2]) and torch.equal(loads[0][3], loads[1][3])
    streams = [before[0], before[1], loads[0][2], loads[0][3]]
    assert all(not torch.equal(a, b) for i, a in enumerate(streams) for b in streams[i + 1:])


def _rng_after_save(rank, world_size, run, layout, directory):
    trainer = LayoutTrainer(run, layout, make_mesh(layout.dp), track_memory=False)
    trainer.train_step(0)
    torch.rand(rank + 1)            # each rank somewhere of its own in its stream
    save(trainer, directory, 1)
    return torch.rand(4)


def _rng_after_load(rank, world_size, run, layout, directory, draws):
    trainer = LayoutTrainer(run, layout, make_mesh(layout.dp), track_memory=False)
    torch.rand(draws + rank)        # what a process drew before loading must not matter
    assert load(trainer, directory) == 1
    return torch.rand(4)


# --- experts under expert parallelism (ep inside dp) --------------------------------------------

MOE_RUN = Run(cfg=CFG, global_batch=8, steps=4, experts=4, top_k=2)
EP = {"dp4 ep4": Layout(dp=4, ep=4, micro_batch=1, micro_batches=2),     # one expert per rank
      "dp4 ep2": Layout(dp=4, ep=2, micro_batch=2),                       # two per rank, two replicas
      "dp2 ep2": Layout(dp=2, ep=2, micro_batch=4),
      "dp4 replicated": Layout(dp=4, micro_batch=2),                      # every expert on every rank
      "1 rank": Layout(micro_batch=4, micro_batches=2)}
EP_PAIRS = [("dp4 ep4", "dp2 ep2"), ("dp4 ep2", "1 rank"), ("1 rank", "dp4 ep4"), ("dp2 ep2", "dp4 replicated")]


@pytest.fixture(scope="module")
def moe_reference():
    return reference_run(MOE_RUN)


@pytest.mark.parametrize("before,after", EP_PAIRS, ids=[f"{a}->{b}" for a, b in EP_PAIRS])
def test_experts_saved_under_one_ep_layout_load_under_another_equals_one_process(tmp_path, moe_reference,
                                                                                before, after):
    a, b = EP[before], EP[after]
    spawn(train_resumable, a.world, run=MOE_RUN, layout=a, directory=str(tmp_path), until=2, save_every=2)
    second = spawn(train_resumable, b.world, run=MOE_RUN, layout=b, directory=str(tmp_path), until=4).returns
    assert all(r["start"] == 2 for r in second)
    assert max_param_diff(second, moe_reference["params"]) < 1e-6
    torch.testing.assert_close(torch.tensor(second[0]["losses"]), torch.tensor(moe_reference["losses"][2:]),
                               rtol=1e-6, atol=1e-6)
    init = dict(build_model(MOE_RUN).named_parameters())
    assert max((moe_reference["params"][k] - v.detach()).abs().max().item() for k, v in init.items()) > 1e-3


def test_each_expert_is_written_once_under_the_models_name(tmp_path, moe_reference):
    """dp4 ep2: experts 0-1 on ranks 0 and 2, experts 2-3 on ranks 1 and 3; DCP keeps one copy of
    each, as one whole tensor named as in the one-process model, and the export is that model."""
    from torch.distributed.checkpoint import FileSystemReader
    spawn(train_resumable, 4, run=MOE_RUN, layout=EP["dp4 ep2"], directory=str(tmp_path), until=4, save_every=4)
    meta = FileSystemReader(str(tmp_path / "step-000004")).read_metadata()
    written = [i.fqn for i in meta.storage_data if i.fqn.startswith("model/")]
    assert sorted(written) == sorted(f"model/{k}" for k in moe_reference["params"])     # each once
    weights = torch.load(export(str(tmp_path), str(tmp_path / "moe.pt")))
    assert max((weights[k] - v).abs().max().item() for k, v in moe_reference["params"].items()) < 1e-6
    model = build_model(MOE_RUN)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) == {k for k, _ in model.named_buffers()}   # the parameters, all of them


def test_a_dense_checkpoint_is_refused_by_a_run_with_experts(tmp_path):
    spawn(train_resumable, 2, run=RUN, layout=L["dp ZeRO-1"], directory=str(tmp_path), until=1, save_every=1)
    got = spawn(_load_error, 2, run=dataclasses.replace(MOE_RUN, steps=1), layout=EP["dp2 ep2"],
                directory=str(tmp_path)).returns
    assert all("another run: experts=None there" in e for e in got), got


def _load_error(rank, world_size, run, layout, directory):
    trainer = LayoutTrainer(run, layout, make_mesh(layout.dp, ep=layout.ep), track_memory=False)
    try:
        load(trainer, directory)
    except CheckpointError as e:
        return str(e)
    return "loaded"


# --- clipping over every axis -------------------------------------------------------------------

CLIPPED = dataclasses.replace(RUN, steps=2, max_grad_norm=0.05)
TIED = Run(cfg=dataclasses.replace(CFG, tie_embeddings=True), global_batch=8, steps=2, max_grad_norm=0.05)
CLIP_LAYOUTS = {"dp×tp": L["dp×tp"], "pp×tp": L["pp×tp"], "dp×cp ZeRO-2": L["dp×cp ZeRO-2"],
                "dp×tp ZeRO-1": Layout(dp=2, tp=2, zero=1, micro_batch=2, micro_batches=2)}


def _clip_all(rank, world_size, run, layouts):
    out = {}
    for name, lay in layouts.items():
        trainer = LayoutTrainer(run, lay, make_mesh(lay.dp, lay.pp, lay.cp, lay.tp, ep=lay.ep), track_memory=False)
        norms = []
        for step in range(run.steps):
            trainer.train_step(step)
            norms.append(trainer.grad_norm)
        out[name] = {"params": trainer.full_parameters(), "norms": norms}
    return out


def reference_norms(run):
    """clip_grad_norm_'s total norms, step by step, in one process."""
    from lectures.model import batch, loss_fn
    model = build_model(run)
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr, weight_decay=run.weight_decay)
    norms = []
    for step in range(run.steps):
        tokens, targets = batch(run.cfg, run.global_batch, step)
        loss_fn(model(tokens), targets).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm).item())
        opt.step()
        opt.zero_grad()
    return norms


@pytest.fixture(scope="module")
def clipped():
    got = spawn(_clip_all, 4, run=CLIPPED, layouts=CLIP_LAYOUTS).returns
    tied = spawn(_clip_all, 4, run=TIED, layouts={"pp×tp tied": L["pp×tp"]}).returns
    return got, tied


@pytest.mark.parametrize("name", list(CLIP_LAYOUTS))
def test_clipping_by_the_global_norm_equals_clip_grad_norm_in_one_process(clipped, name):
    got, _ = clipped
    ref = reference_run(CLIPPED)
    unclipped = reference_run(dataclasses.replace(CLIPPED, max_grad_norm=None))
    norms = reference_norms(CLIPPED)
    assert min(norms) > 4 * CLIPPED.max_grad_norm           # the bound bites at every step
    per_rank = [g[name] for g in got]
    assert max_param_diff(per_rank, ref["params"]) < 1e-6
    assert max_param_diff(per_rank, unclipped["params"]) > 1e-4
    for r in per_rank:
        assert r["norms"] == pytest.approx(norms, rel=1e-6)


def test_clipping_counts_a_tied_embedding_once_across_the_pipeline_ends(clipped):
    _, tied = clipped
    ref = reference_run(TIED)
    per_rank = [g["pp×tp tied"] for g in tied]
    heads = [r["params"].pop("lm_head.weight") for r in per_rank if "lm_head.weight" in r["params"]]
    assert heads and all((h - ref["params"]["tok_emb.weight"]).abs().max() < 1e-6 for h in heads)  # the last stage's copy
    assert max_param_diff(per_rank, ref["params"]) < 1e-6
    assert per_rank[0]["norms"] == pytest.approx(reference_norms(TIED), rel=1e-6)


def test_the_classic_bug_counts_replicas_and_copies_many_times():
    got = spawn(_both_norms, 4, run=CLIPPED, layout=L["dp×tp"]).returns
    once, every = got[0]
    assert once == pytest.approx(reference_norms(CLIPPED)[0], rel=1e-6)
    assert every > 1.5 * once       # dp=2 copies of everything, tp=2 copies of the norms and biases


def _both_norms(rank, world_size, run, layout):
    trainer = LayoutTrainer(dataclasses.replace(run, max_grad_norm=None), layout,
                            make_mesh(layout.dp, layout.pp, layout.cp, layout.tp), track_memory=False)
    trainer.forward_backward(0)
    for p in trainer.params:
        trainer.comm.all_reduce(p.grad)
        p.grad.div_(trainer.comm.n)
    return global_grad_norm(trainer), global_grad_norm(trainer, count_once=False)


MOE_CLIPPED = dataclasses.replace(MOE_RUN, steps=2, max_grad_norm=0.05)
EP_CLIP_LAYOUTS = {k: EP[k] for k in ("dp4 ep4", "dp4 ep2")}


@pytest.mark.parametrize("name", list(EP_CLIP_LAYOUTS))
def test_clipping_counts_each_expert_once_under_ep(moe_clipped, name):
    """The router and attention are on every rank, each expert on dp/ep of them: the global norm
    counts each once, and the run equals clip_grad_norm_ in one process."""
    ref = reference_run(MOE_CLIPPED)
    norms = reference_norms(MOE_CLIPPED)
    assert min(norms) > 4 * MOE_CLIPPED.max_grad_norm          # the bound bites at every step
    per_rank = [g[name] for g in moe_clipped]
    assert max_param_diff(per_rank, ref["params"]) < 1e-6
    assert max_param_diff(per_rank, reference_run(dataclasses.replace(MOE_CLIPPED, max_grad_norm=None))["params"]) > 1e-4
    for r in per_rank:
        assert r["norms"] == pytest.approx(norms, rel=1e-6)


@pytest.fixture(scope="module")
def moe_clipped():
    return spawn(_clip_all, 4, run=MOE_CLIPPED, layouts=EP_CLIP_LAYOUTS).returns


def test_flat_boxes_cover_a_flat_range_exactly():
    piece = Piece("w", (0, 5), (10, 7), (5, 6))
    for start, stop in [(0, 30), (3, 4), (5, 19), (6, 18), (0, 1), (29, 30), (7, 7)]:
        covered = []
        for offset, shape, a, b in flat_boxes(piece, start, stop):
            assert shape[0] * shape[1] == b - a
            covered += [(offset[0] + i - 10) * 6 + offset[1] + j - 7 for i in range(shape[0]) for j in range(shape[1])]
        assert covered == list(range(start, stop))
    assert len(list(flat_boxes(piece, 5, 19))) == 3


# --- failures -----------------------------------------------------------------------------------

TORCHRUN = os.path.join(os.path.dirname(__import__("sys").executable), "torchrun")


@pytest.mark.torchrun
@pytest.mark.skipif(not os.path.exists(TORCHRUN), reason="torchrun not installed")
@pytest.mark.timeout(240)
def test_a_rank_that_dies_at_step_3_resumes_from_step_2_and_ends_equal_to_one_process(tmp_path, reference):
    proc = subprocess.run(torchrun_command(str(tmp_path), ranks=2, max_restarts=1, steps=4, save_every=2, die_at=3),
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = read_events(str(tmp_path))
    died = [e for e in events if e["event"] == "died"]
    resumed = [(e["attempt"], e["step"]) for e in events if e["event"] == "resumed"]
    assert [(d["attempt"], d["rank"], d["step"]) for d in died] == [(0, 1, 3)]
    assert resumed == [(0, 0), (1, 2)]
    weights = torch.load(export(str(tmp_path), str(tmp_path / "model.pt")))
    assert max((weights[k] - v).abs().max().item() for k, v in reference["params"].items()) < 1e-6


def test_bad_checkpoints_are_refused_and_lose_nothing(tmp_path):
    spawn(train_resumable, 2, run=RUN, layout=L["dp ZeRO-1"], directory=str(tmp_path / "good"), until=2, save_every=1)
    other = Run(cfg=dataclasses.replace(CFG, d_model=16), global_batch=8, steps=2)
    spawn(train_resumable, 2, run=other, layout=L["dp ZeRO-1"], directory=str(tmp_path / "other"), until=1, save_every=1)
    shutil.copytree(tmp_path / "good", tmp_path / "corrupt")
    victim = tmp_path / "corrupt" / "step-000002" / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[:100])
    (tmp_path / "half" / "step-000003.partial").mkdir(parents=True)     # a save that died
    before = {p: p.read_bytes() for p in (tmp_path / "good").rglob("*") if p.is_file()}
    got = spawn(_try_loads, 2, run=RUN, layout=Layout(tp=2, micro_batch=8),
                root=str(tmp_path)).returns
    for r in got:
        assert r["empty"] == 0 and r["half"] == 0
        assert "no complete checkpoint of step 7" in r["missing"]
        assert "cannot be read" in r["corrupt"]
        assert "another run: d_model=16 there, 24 here" in r["other"]
        assert r["unchanged"]
        assert r["good"] == 2
    assert before == {p: p.read_bytes() for p in (tmp_path / "good").rglob("*") if p.is_file()}


def _try_loads(rank, world_size, run, layout, root):
    trainer = LayoutTrainer(run, layout, make_mesh(layout.dp, layout.pp, layout.cp, layout.tp), track_memory=False)
    initial = [p.detach().clone() for p in trainer.params]
    out = {"empty": load(trainer, os.path.join(root, "nothing here")), "half": load(trainer, os.path.join(root, "half"))}
    for name, directory, step in (("missing", "good", 7), ("corrupt", "corrupt", None), ("other", "other", None)):
        try:
            load(trainer, os.path.join(root, directory), step)
            out[name] = "loaded"
        except CheckpointError as e:
            out[name] = str(e)
    out["unchanged"] = all(torch.equal(p, q) for p, q in zip(trainer.params, initial))
    out["good"] = load(trainer, os.path.join(root, "good"))
    return out


def test_young_daly_interval_minimises_the_expected_waste():
    delta, mtbf = 30.0, 3 * 3600.0
    best = young_daly(delta, mtbf)
    assert best == pytest.approx(math.sqrt(2 * 30 * 10800))
    around = [expected_waste(best * f, delta, mtbf) for f in (0.5, 0.9, 1.0, 1.1, 2.0)]
    assert around[2] == min(around)
    with pytest.raises(ValueError):
        young_daly(1.0, 0.0)


@pytest.mark.timeout(200)
def test_fsdp2_checkpoint_at_dp4_loads_at_dp2_tp2_and_trains_on_equal(tmp_path, reference):
    """PyTorch's own: FSDP2 at dp=4 saved with get_state_dict + DCP, loaded into FSDP2 × DTensor
    tensor parallelism at dp=2 × tp=2 with set_state_dict: equal after loading and after 2 more steps."""
    saved = spawn(pytorch_save, 4, run=RUN, layout=Layout(dp=4, micro_batch=2), directory=str(tmp_path),
                  steps=2).returns
    assert saved[0]["kinds"] == ["DTensor"]
    two = reference_run(dataclasses.replace(RUN, steps=2))
    assert max_param_diff(saved, two["params"]) < 1e-6
    resumed = spawn(pytorch_resume, 4, run=RUN, layout=Layout(dp=2, tp=2, micro_batch=4), directory=str(tmp_path),
                    until=4).returns
    assert resumed[0]["start"] == 2
    assert max((resumed[0]["loaded"][k] - saved[0]["params"][k]).abs().max().item() for k in two["params"]) == 0
    assert max_param_diff(resumed, reference["params"]) < 1e-6


def _hangs(rank, world_size, run, layout, directory):
    import time
    trainer = LayoutTrainer(run, layout, make_mesh(layout.dp, layout.pp, layout.cp, layout.tp), track_memory=False)
    for step in range(2):
        trainer.train_step(step)
    save(trainer, directory, 2)
    if rank == 1:
        time.sleep(8)           # hung: never joins step 3's gradient all-reduce
        return None
    trainer.train_step(2)       # waits in the all-reduce until the group's timeout
    return "finished"


def test_a_hung_rank_ends_in_the_groups_timeout_and_the_checkpoint_survives(tmp_path, reference):
    timeout = 3
    got = spawn(_hangs, 2, run=RUN, layout=Layout(dp=2, micro_batch=4), directory=str(tmp_path), timeout=timeout,
                expect_error=True)
    # the waiting rank's own process group ends the wait (gloo's error, with the group's timeout),
    # not the launcher's bound on a rank that never finishes ("did not finish within ...")
    assert "rank 0 raised" in got.error, got.error
    assert re.search(rf"Timed out waiting {timeout * 1000}ms for \w+ operation", got.error), got.error
    assert saved_steps(str(tmp_path)) == [2]
    resumed = spawn(train_resumable, 2, run=RUN, layout=Layout(tp=2, micro_batch=8), directory=str(tmp_path),
                    until=4).returns
    assert resumed[0]["start"] == 2 and max_param_diff(resumed, reference["params"]) < 1e-6


def test_a_tied_embedding_saved_by_a_pipeline_loads_into_one_tensor(tmp_path):
    """The first and the last stage both hold the tied table (tok_emb / lm_head): the checkpoint
    keeps one tok_emb.weight, and a layout without a pipeline resumes equal to one process."""
    tied = Run(cfg=dataclasses.replace(CFG, tie_embeddings=True), global_batch=8, steps=4)
    spawn(train_resumable, 4, run=tied, layout=L["pp×tp"], directory=str(tmp_path), until=2, save_every=2)
    got = spawn(train_resumable, 4, run=tied, layout=L["dp×tp"], directory=str(tmp_path), until=4).returns
    ref = reference_run(tied)
    for r in got:
        r["params"].pop("lm_head.weight", None)
    assert max_param_diff(got, ref["params"]) < 1e-6
    assert "lm_head.weight" not in torch.load(export(str(tmp_path), str(tmp_path / "m.pt")))


def test_the_metadata_sentence_says_zero_lists_more_only_where_its_bytes_show_it():
    from lectures.lecture_08_checkpoints_and_restarts import metadata_words
    assert "ZeRO" not in metadata_words({"dp": 52_000})             # the quick build: one layout
    said = metadata_words({"dp": 52_000, "dp + ZeRO-1": 73_000})
    assert "71 KiB against plain data parallelism's 51 KiB" in said
    assert "52,100 bytes against plain data parallelism's 52,000 bytes" in metadata_words({"dp": 52_000, "dp + ZeRO-1": 52_100})
    assert "ZeRO" not in metadata_words({"dp": 73_000, "dp + ZeRO-1": 52_000})


def test_llama3s_interruption_causes_add_up_to_its_unexpected_interruptions():
    """Table 5 of the Llama 3 paper, as the page draws it: the bars add up to the 419 unexpected
    interruptions the lecture's model of M uses, and the four GPU bars to 256."""
    from lectures.checkpoint.restart import LLAMA3_UNEXPECTED
    from lectures.model.gpu_evidence import LLAMA3_INTERRUPTION_CAUSES
    counts = dict(LLAMA3_INTERRUPTION_CAUSES.series["unexpected interruptions"])
    assert sum(counts.values()) == LLAMA3_UNEXPECTED == 419
    assert sum(n for cause, n in counts.items() if "GPU" in cause) == 256 and counts["faulty GPU"] == 148
