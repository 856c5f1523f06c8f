"""A rollout server never outlives the worker that launched it: SIGKILL the worker, the server's
whole process group goes within seconds; a server that dies still reports its own exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ppo_trainer.rollout.sglang.launcher import ServerProcess

ROOT = Path(__file__).resolve().parents[3]


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False


def test_the_server_group_dies_with_its_killed_worker(tmp_path):
    worker_source = f"""
import sys, time
sys.path[:0] = [{str(ROOT / "trainer")!r}, {str(ROOT / "api")!r}]
from ppo_trainer.rollout.sglang.launcher import ServerProcess
server = ServerProcess(name="server", command=["sleep", "300"], url="http://127.0.0.1:9", log_path={str(tmp_path / "log")!r})
print(server.start().pid, flush=True)
time.sleep(300)
"""
    worker = subprocess.Popen([sys.executable, "-c", worker_source], stdout=subprocess.PIPE, text=True)
    group = int(worker.stdout.readline())
    try:
        time.sleep(1.0)
        assert group_alive(group)
        worker.kill()  # no stop(): the way a crashed Ray actor goes
        worker.wait()
        deadline = time.monotonic() + 10
        while group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_alive(group), "the server outlived its worker"
    finally:
        worker.kill()
        if group_alive(group):
            os.killpg(group, signal.SIGKILL)


def test_a_dead_server_reports_its_own_exit_code_and_signal(tmp_path):
    exits = ServerProcess(name="s", command=["sh", "-c", "exit 17"], url="http://127.0.0.1:9", log_path=tmp_path / "a")
    exits.start()._process.wait(timeout=10)
    assert "exited with code 17" in exits.death_notice()
    killed = ServerProcess(name="s", command=["sh", "-c", "kill -9 $$"], url="http://127.0.0.1:9", log_path=tmp_path / "b")
    killed.start()._process.wait(timeout=10)
    assert "exited with code -9" in killed.death_notice()
    stopped = ServerProcess(name="s", command=["sleep", "300"], url="http://127.0.0.1:9", log_path=tmp_path / "c").start()
    time.sleep(0.5)
    stopped.stop(grace_s=5)
    assert not stopped.alive() and not group_alive(stopped.pid)
