"""The launcher: ranks run, report back in order, fail loudly and promptly, and start clean."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from util import DemoFailed, launch, note, span, spawn, table, timeline


# --- rank functions (module level: workers import them by name) ---------------------------

def say_rank(rank, world_size, greeting="hello"):
    print(f"{greeting} from {rank}")
    note(f"note from {rank}")
    table([[rank]], header=["rank"])
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return {"rank": rank, "sum": x.item(), "world": dist.get_world_size()}


def raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    dist.all_reduce(torch.ones(1))  # blocks: rank 1 never joins


def skip_collective_on_last_rank(rank, world_size):
    if rank != world_size - 1:
        dist.all_reduce(torch.ones(1))


def die_on_rank_zero(rank, world_size):
    if rank == 0:
        os._exit(3)
    dist.barrier()


def dirty_the_process(rank, world_size):
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.manual_seed(1234 + rank)
    return torch.randn(2).tolist()


def read_state(rank, world_size):
    return {"dtype": str(torch.get_default_dtype()), "grad": torch.is_grad_enabled(),
            "noise": torch.randn(3).tolist(), "threads": torch.get_num_threads()}


def timed(rank, world_size):
    with span("work"):
        time.sleep(0.05 * (rank + 1))
    with span("sync"):
        dist.barrier()


def succeed(rank, world_size):
    return rank


def whoami(rank, world_size):
    x = torch.ones(1)
    dist.all_reduce(x)  # the group really has world_size members
    return os.getpid(), dist.get_world_size(), x.item()


# --- tests --------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_returns_records_and_output_come_back_in_rank_order(world_size):
    run = spawn(say_rank, world_size, greeting="hi")
    assert run.status == "ok"
    expected_sum = world_size * (world_size - 1) / 2
    assert run.returns == [{"rank": r, "sum": expected_sum, "world": world_size}
                           for r in range(world_size)]
    ranks = [rec["rank"] for rec in run.records]
    assert ranks == sorted(ranks) and set(ranks) == set(range(world_size))
    outputs = [rec for rec in run.records if rec["kind"] == "output"]
    assert [o["text"] for o in outputs] == [f"hi from {r}\n" for r in range(world_size)]
    notes = [rec for rec in run.records if rec["kind"] == "note"]
    assert notes[0]["source"]["function"] == "say_rank"
    assert notes[0]["source"]["file"] == "tests/test_launch.py"


def test_exception_on_one_rank_fails_promptly_with_its_traceback():
    spawn(succeed, 4)  # the pool is warm: what follows times the failure, not a start-up
    start = time.monotonic()
    with pytest.raises(DemoFailed) as info:
        spawn(raise_on_rank_one, 4)
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"took {elapsed:.1f} s; the collective timeout is 30 s"
    run = info.value.run
    assert run.status == "failed"
    assert "rank 1 raised" in run.error and "deliberate failure on rank one" in run.error
    errors = [rec for rec in run.records if rec["kind"] == "error"]
    assert errors and errors[0]["rank"] == 1 and "Traceback" in errors[0]["text"]
    assert spawn(succeed, 4).returns == [0, 1, 2, 3]  # a fresh pool replaces the broken one


def test_rank_that_skips_a_collective_ends_in_a_clear_error_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(DemoFailed) as info:
        spawn(skip_collective_on_last_rank, 2, timeout=3)
    elapsed = time.monotonic() - start
    assert elapsed < 3 + 15, elapsed  # the timeout, plus starting a pool on 2 busy cores
    message = info.value.run.error
    assert "skip_collective_on_last_rank" in message and "rank 0 raised" in message
    assert "skipped a collective" in message


def test_expected_failure_is_not_an_error_and_unexpected_success_is():
    run = spawn(skip_collective_on_last_rank, 2, timeout=3, expect_error=True)
    assert run.status == "expected_failure" and "imed out" in run.error
    with pytest.raises(DemoFailed, match="expected to fail"):
        spawn(succeed, 2, expect_error=True)


def test_a_rank_that_dies_is_noticed_at_once():
    spawn(succeed, 2)
    start = time.monotonic()
    with pytest.raises(DemoFailed, match=r"died \(exit codes \[3\]\)"):
        spawn(die_on_rank_zero, 2)
    assert time.monotonic() - start < 10


def test_reused_workers_start_each_demo_clean_and_match_fresh_processes():
    spawn(dirty_the_process, 2)
    pooled = spawn(read_state, 2).returns
    assert pooled[0]["dtype"] == "torch.float32" and pooled[0]["grad"] is True
    torch.manual_seed(0)
    assert pooled[0]["noise"] == pooled[1]["noise"] == torch.randn(3).tolist()
    launch.settings.launcher = "spawn"
    try:
        fresh = spawn(read_state, 2).returns
    finally:
        launch.settings.launcher = "pool"
    assert pooled == fresh


def test_spans_are_relative_to_the_demo_and_comparable_across_ranks():
    run = spawn(timed, 2)
    assert {(s["rank"], s["label"]) for s in run.spans} == {
        (r, l) for r in (0, 1) for l in ("work", "sync")}
    work = {s["rank"]: s for s in run.spans if s["label"] == "work"}
    assert all(0 <= s["start"] < 0.05 for s in work.values())
    assert work[1]["end"] - work[1]["start"] > work[0]["end"] - work[0]["start"]
    sync_end = [s["end"] for s in run.spans if s["label"] == "sync"]
    assert abs(sync_end[0] - sync_end[1]) < 0.05  # the barrier ends together on both ranks
    ax = timeline(run.spans).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 1", "rank 0"]
    assert len(ax.patches) == 4


def test_timeline_gives_overlapping_spans_their_own_lane():
    spans = [{"rank": 0, "label": "compute", "start": 0.0, "end": 1.0},
             {"rank": 0, "label": "all-reduce", "start": 0.5, "end": 1.5},
             {"rank": 0, "label": "compute", "start": 1.2, "end": 2.0}]
    bars = timeline(spans).axes[0].patches
    lanes = [bar.get_y() for bar in bars]
    assert lanes[0] == lanes[2] != lanes[1]  # the all-reduce does not hide the compute
    assert timeline([]).axes  # nothing recorded: a figure that says so, not a crash


def test_demos_are_recorded_in_the_current_recorder():
    from util import record
    recorder = record.Recorder()
    previous = record.use(recorder)
    try:
        spawn(succeed, 2, name="named demo")
    finally:
        record.use(previous)
    demo = recorder.records[-1]
    assert demo["kind"] == "demo" and demo["name"] == "named demo" and demo["world_size"] == 2
    assert demo["status"] == "ok" and demo["function"] in recorder.functions
    assert "def succeed" in recorder.functions[demo["function"]]["code"]


def test_one_pool_serves_every_world_size_and_timeout():
    four = spawn(whoami, 4).returns
    two = spawn(whoami, 2, timeout=7).returns
    one = spawn(whoami, 1).returns
    again = spawn(whoami, 4).returns
    assert [(w, s) for _, w, s in four] == [(4, 4.0)] * 4 and [(w, s) for _, w, s in two] == [(2, 2.0)] * 2
    assert one[0][1:] == (1, 1.0)
    pids = [p for p, _, _ in four]
    assert [p for p, _, _ in two] == pids[:2] and one[0][0] == pids[0]  # no new processes
    assert [p for p, _, _ in again] == pids


def test_workers_notice_a_module_changed_on_disk_and_run_the_new_code():
    """A notebook user edits a lecture and re-runs a cell: the ranks must run the new code,
    not what the reused workers imported before."""
    import importlib
    import sys
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_changing_module.py")
    try:
        with open(path, "w") as f:
            f.write("def answer(rank, world_size):\n    return 1\n")
        importlib.invalidate_caches()
        module = importlib.import_module("tests._changing_module")
        assert spawn(module.answer, 2).returns == [1, 1]
        with open(path, "w") as f:
            f.write("def answer(rank, world_size):\n    return 2  # edited\n")
        module = importlib.reload(module)
        assert module.answer(0, 1) == 2                      # the lecture process has it...
        assert spawn(module.answer, 2).returns == [2, 2]     # ...and so do the ranks
    finally:
        os.unlink(path)
        sys.modules.pop("tests._changing_module", None)


def dtensor_row_parallel_sum(rank, world_size, groups_before=0):
    """A DTensor op on one dimension of a 2D mesh, whose sharding decision DTensor caches by
    mesh: Shard(1) @ Shard(0) is Partial, and redistributing it all-reduces on that dimension's
    group (whose name counts the groups made before it in this process group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    for _ in range(groups_before):
        dist.new_group(list(range(world_size)))
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("a", "b"))["b"]
    n = mesh.size()
    a = distribute_tensor(torch.ones(2, 4 * n), mesh, [Shard(1)])
    b = distribute_tensor(torch.ones(4 * n, 3), mesh, [Shard(0)])
    return (a @ b).redistribute(placements=[Replicate()]).to_local().sum().item()


def test_dtensor_works_after_the_workers_changed_process_group():
    """Two meshes of one shape compare equal in DTensor's caches even when their process groups
    differ; after a demo on another world size the workers rejoin a new process group, and a
    stale cached mesh would name destroyed groups. The pool drops those caches."""
    want = 2 * 3 * 4 * 2
    assert spawn(dtensor_row_parallel_sum, 4, groups_before=5, name="dtensor before").returns == [want] * 4
    spawn(succeed, 2, name="another world size")
    assert spawn(dtensor_row_parallel_sum, 4, name="dtensor after").returns == [want] * 4


# --- runs that cannot break the launcher ----------------------------------------------------

def spin_forever(rank, world_size):
    step = 0
    while step < 3:        # a student's loop whose counter never changes
        pass


def returns_numpy(rank, world_size):
    import numpy as np
    return {"array": np.arange(3) * rank, "scalar": np.float32(rank), "count": np.int64(7)}["scalar" if rank else "array"]


def tear_down_the_group(rank, world_size):
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()       # a tutorial's last line


def die_while_others_work(rank, world_size):
    if rank == 1:
        os._exit(5)
    time.sleep(30)            # busy with something else: nothing tells them rank 1 is gone


def test_ranks_that_all_loop_end_at_the_deadline_saying_where_they_were():
    spawn(say_rank, 2)                    # workers started: the deadline is the demo's, not start-up's
    start = time.monotonic()
    with pytest.raises(DemoFailed) as e:
        spawn(spin_forever, 2, deadline=4)
    assert time.monotonic() - start < 15
    error = e.value.run.error
    assert "did not finish within the demo's deadline of 4 s" in error, error
    assert "rank 0 was at tests/test_launch.py:" in error and "in spin_forever" in error, error
    assert spawn(say_rank, 2).returns[0]["sum"] == 1.0           # the next demo runs on fresh ranks


def spin_unless_last(rank, world_size):
    if rank < world_size - 1:
        spin_forever(rank, world_size)
    return rank


def test_a_deadline_that_ends_the_demo_is_named_even_after_a_rank_finished():
    """The last rank returns at once, the others spin: the deadline (3 s) comes before the
    timeout after the first rank finished (10 s), and the error names the deadline, not the
    timeout that never ran out (a check's last world size gets what is left of its deadline)."""
    spawn(say_rank, 3)
    start = time.monotonic()
    with pytest.raises(DemoFailed) as e:
        spawn(spin_unless_last, 3, deadline=3, timeout=10)
    assert time.monotonic() - start < 12
    error = e.value.run.error
    assert "ranks 0 and 1 did not finish within the demo's deadline of 3 s" in error, error
    assert "within 10 s of rank 2 finishing" not in error, error


def test_numpy_values_come_back_from_ranks():
    run = spawn(returns_numpy, 2)
    assert list(run.returns[0]) == [0, 0, 0] and float(run.returns[1]) == 1.0


def test_a_demo_that_destroys_the_group_does_not_poison_the_next():
    spawn(tear_down_the_group, 2)
    assert spawn(say_rank, 2).returns[1]["world"] == 2


def test_the_failure_sentence_says_who_died_and_who_was_stopped():
    start = time.monotonic()
    with pytest.raises(DemoFailed) as e:
        spawn(die_while_others_work, 3)
    assert time.monotonic() - start < 10
    error = e.value.run.error
    assert "rank 1 died (exit codes [5])" in error and "ranks 0 and 2 were stopped after rank 1 died, " in error, error
    ran = float(error.split("died, ")[1].split(" s into the demo")[0])   # how long they really ran
    assert 0 < ran < time.monotonic() - start, error


def exit_cleanly(rank, world_size):
    os._exit(0)


def test_a_rank_that_exits_with_code_0_is_said_to_exit_not_to_die():
    with pytest.raises(DemoFailed) as e:
        spawn(exit_cleanly, 2)
    # both ranks exit; under load the launcher may stop rank 0 after rank 1's exit, before its own
    error = e.value.run.error
    assert ("ranks 0 and 1 exited (exit code 0) before finishing" in error or
            "rank 1 exited (exit code 0) before finishing; rank 0 was stopped after rank 1 exited" in error
            or "rank 0 exited (exit code 0) before finishing; rank 1 was stopped after rank 0 exited" in error), error
    assert "died" not in error, error


def test_a_signal_while_workers_start_ends_with_its_own_exit_and_no_worker_left(monkeypatch):
    """SIGTERM (a SystemExit) during the pool's start-up: the exit goes through, not an error
    from throwing away a pool whose last worker never started, and the started ones are gone."""
    from util import pool as pools
    pools.close_all()
    process = type(pools._context().Process())
    real_start, started = process.start, []

    def start(self):
        if started:
            raise SystemExit(143)          # what the build's SIGTERM handler raises
        real_start(self)
        started.append(self.pid)
    monkeypatch.setattr(process, "start", start)
    with pytest.raises(SystemExit) as e:
        pools.pooled("gloo", 3)
    assert e.value.code == 143 and started
    assert not os.path.exists(f"/proc/{started[0]}") or open(f"/proc/{started[0]}/stat").read().split()[2] == "Z"


def subgroup_timeouts(rank, world_size):
    """The timeouts (seconds) of the subgroups the course makes: util's new_group, lecture 04's
    tensor-parallel groups, lecture 07's mesh groups, lecture 08's background writer's group, and
    a DeviceMesh's (lecture 07's torch_mesh; lecture 03's HSDP mesh is made the same way)."""
    from lectures.checkpoint.store import _background_group
    from lectures.layout.mesh import _new_group, torch_mesh
    from lectures.tensor_parallel.gpt import tp_group
    from util import device, new_group
    seconds = lambda g: g._get_backend(device()).options._timeout.total_seconds()
    pairs = [new_group([0, 1]), new_group([2, 3])], [_new_group([0, 2]), _new_group([1, 3])]   # made by every rank
    mesh = torch_mesh(dp=2, tp=2)      # PyTorch's DeviceMesh makes its own groups
    return [seconds(g) for g in (pairs[0][rank // 2], tp_group(world_size, 2), pairs[1][rank % 2], _background_group(),
                                 mesh.get_group("dp"), mesh.get_group("tp"))]


def skip_a_subgroup_collective(rank, world_size):
    from util import new_group
    group = new_group([0, 1])
    if rank == 0:
        dist.all_reduce(torch.ones(1), group=group)


def test_subgroups_wait_the_runs_timeout_not_pytorchs_30_minutes():
    """dist.new_group does not inherit the default group's timeout (30 minutes on gloo): every
    group the course makes takes the run's, so a collective a member skips is an error in time."""
    assert spawn(subgroup_timeouts, 4, timeout=7).returns == [[7.0] * 6] * 4
    start = time.monotonic()
    with pytest.raises(DemoFailed, match="rank 0 raised"):
        spawn(skip_a_subgroup_collective, 2, timeout=3)
    assert time.monotonic() - start < 3 + 15
