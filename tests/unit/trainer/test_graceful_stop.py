"""The preStop hook's two halves on this machine: the head's SIGTERM to the trainer named by its pid
file, waited for until it exits; the worker's wait for its actor processes, told from Ray's own."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from ray._private import ray_constants

from ppo_trainer import graceful_stop


def test_rays_own_process_titles_are_the_ones_ray_sets():
    own = (ray_constants.WORKER_PROCESS_TYPE_IDLE_WORKER, ray_constants.WORKER_PROCESS_TYPE_SPILL_WORKER,
           ray_constants.WORKER_PROCESS_TYPE_RESTORE_WORKER, ray_constants.WORKER_PROCESS_TYPE_SPILL_WORKER_DELETE,
           ray_constants.AGENT_PROCESS_TYPE_DASHBOARD_AGENT, ray_constants.AGENT_PROCESS_TYPE_RUNTIME_ENV_AGENT)
    assert all(title.startswith(graceful_stop.RAY_PROCESS_TITLES) for title in own)
    assert not "ray::ActorWorker.train".startswith(graceful_stop.RAY_PROCESS_TITLES)


def test_the_head_hook_sends_sigterm_and_waits_for_the_trainer_to_save_and_exit(tmp_path):
    pid_file, saved = tmp_path / "trainer.pid", tmp_path / "saved"
    trainer = subprocess.Popen([sys.executable, "-c", (
        "import signal, time, sys\n"
        "from ppo_trainer.graceful_stop import StopRequest, write_pid_file\n"
        f"stop = StopRequest().install(); write_pid_file({str(pid_file)!r})\n"
        "while not stop.requested: time.sleep(0.05)\n"
        f"time.sleep(1); open({str(saved)!r}, 'w').write(stop.signal_name); sys.exit(143)\n")])
    try:
        while not pid_file.exists():
            time.sleep(0.05)
        threading.Thread(target=trainer.wait, daemon=True).start()  # its parent reaps it, as Ray's job supervisor does
        started = time.monotonic()
        what = graceful_stop.stop_head(pid_file)
        assert time.monotonic() - started >= 1 and saved.read_text() == "SIGTERM", what
        assert what.startswith(f"the trainer {trainer.pid} exited") and trainer.wait(timeout=5) == 143
    finally:
        trainer.kill()
    assert graceful_stop.stop_head(pid_file) == f"the trainer {trainer.pid} had exited"
    assert graceful_stop.stop_head(tmp_path / "none.pid").startswith("no trainer")


def test_the_worker_hook_waits_while_a_process_titled_as_an_actor_runs():
    # This machine's /proc also shows other tests' Ray actors (and the real node's pods): the hook
    # is asked about this test's actor only, as a container's /proc holds only its own processes.
    actor = subprocess.Popen(["bash", "-c", "exec -a 'ray::CriticWorker.train' sleep 1.5"])
    try:
        time.sleep(0.2)
        assert actor.pid in graceful_stop.job_actors()
        started = time.monotonic()
        threading.Thread(target=actor.wait, daemon=True).start()
        graceful_stop.stop_worker(lambda: [pid for pid in graceful_stop.job_actors() if pid == actor.pid])
        assert time.monotonic() - started >= 1
    finally:
        actor.kill()
