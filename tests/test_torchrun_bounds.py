"""What bounds a torchrun job when something goes wrong outside a collective: a serving rank
leaves when rank 0 stops beating, and a rank in an endless loop interrupts itself at the
demo's deadline."""
import datetime
import time

import pytest

from util import torchrun_job


class Store:
    """The two calls wait_for_task makes, on a dict; `beating` says whether rank 0 is alive."""

    def __init__(self, beating):
        self.keys, self.beating, self.beats = {}, beating, 0

    def wait(self, keys, timeout):
        time.sleep(timeout.total_seconds())
        if not all(k in self.keys for k in keys):
            raise RuntimeError("Socket Timeout")

    def add(self, key, amount):
        if self.beating:
            self.beats += 1
        return self.beats


def test_a_serving_rank_leaves_when_rank_0_stops_beating():
    start = time.monotonic()
    with pytest.raises(torchrun_job.Rank0Gone, match="has not beaten for 0.3 s"):
        torchrun_job.wait_for_task(Store(beating=False), "course/task1", silence=0.3, poll=0.05)
    assert time.monotonic() - start < 2


def test_a_serving_rank_waits_on_while_rank_0_beats():
    store = Store(beating=True)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        with torchrun_job.deadline_alarm(0.6):        # rank 0 alive: the wait has no end of its own
            try:
                torchrun_job.wait_for_task(store, "course/task1", silence=0.2, poll=0.05)
            except torchrun_job.DeadlinePassed as e:
                raise TimeoutError from e
    assert store.beats > 3 and time.monotonic() - start < 2


def test_a_serving_rank_takes_the_task_once_it_is_there():
    store = Store(beating=False)
    store.keys["course/task1"] = b"x"
    torchrun_job.wait_for_task(store, "course/task1", silence=0.2, poll=0.05)


def test_a_store_that_went_away_is_named_at_once():
    class Gone(Store):
        def wait(self, keys, timeout):
            raise RuntimeError("Connection reset by peer")
    with pytest.raises(torchrun_job.Rank0Gone, match="store went away"):
        torchrun_job.wait_for_task(Gone(beating=True), "course/task1", silence=10, poll=1)


def test_an_endless_loop_interrupts_itself_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(torchrun_job.DeadlinePassed, match="deadline of 0.3 s"):
        with torchrun_job.deadline_alarm(0.3):
            while True:
                pass
    assert time.monotonic() - start < 2
    time.sleep(0.4)                                   # the alarm is off afterwards


RANK_0_THAT_ENDS = """
from util import torchrun_job
torchrun_job.BEAT = 0.0005          # a beat almost always in flight in the store's C++ call
job = torchrun_job.job()
torchrun_job.end()
print("alive" if job.heartbeat.is_alive() else "joined")
"""


def test_rank_0_stops_its_heartbeat_before_python_exits():
    """A daemon thread inside the store's C++ call when Python shuts down aborts the process
    ('terminate called without an active exception'): the build's end joins the heartbeat."""
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", RANK_0_THAT_ENDS], cwd=root, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stdout.strip() == "joined", proc.stderr[-3000:]
