"""SIGTERM mid-interval: the trainer finishes its step, checkpoints it and exits 143; --resume goes on
from the step after it, where a SIGKILL would have gone back to the last interval checkpoint.

The real CLI in a subprocess with its own local Ray; the signal goes to the trainer's pid from its
--pid-file, as the Ray head's preStop hook sends it.
"""

from __future__ import annotations

import os
import signal

import pytest
import yaml
from cli_run import records, start

from ppo_trainer.graceful_stop import EXIT_STOPPED

STEPS, INTERVAL = 4, 3
CONFIG = {
    "apiVersion": "ppojob.io/v1alpha1",
    "kind": "PPOJob",
    "metadata": {"name": "graceful"},
    "spec": {
        "seed": 3,
        "model": {"path": "builtin:tiny"},
        "actor": {"learningRate": 1e-2, "microBatchSize": 16},
        "rollout": {"batchSize": 16, "maxNewTokens": 8},
        "ppo": {"numRollouts": STEPS, "numCriticOnlySteps": 0, "epochs": 1},
        "checkpoint": {"interval": INTERVAL, "keep": 2},
    },
}


@pytest.mark.timeout(600)
def test_sigterm_mid_interval_checkpoints_the_step_it_was_at_and_resume_goes_on_from_there(tmp_path):
    config, run_dir, pid_file = tmp_path / "job.yaml", tmp_path / "run", tmp_path / "trainer.pid"
    config.write_text(yaml.safe_dump(CONFIG))

    first = start(config, run_dir, "--pid-file", str(pid_file))
    seen = []
    try:
        for record in records(first.stdout):
            seen.append(record)
            if record["kind"] == "step" and record["step"] == 0:  # one step done, the second under way
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
        first.wait(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == EXIT_STOPPED, seen[-3:]
    steps_done = max(r["step"] for r in seen if r["kind"] == "step") + 1
    assert 1 <= steps_done < INTERVAL, seen  # stopped mid-interval, after the step it was in
    checkpoint = next(r for r in seen if r["kind"] == "checkpoint")
    assert checkpoint["step"] == steps_done, checkpoint
    note = next(r for r in seen if r["kind"] == "note")
    assert note["line"] == f"stopped by SIGTERM after step {steps_done}; checkpoint at step {steps_done}", note
    assert not any(r["kind"] == "error" for r in seen)  # a stop is not a failure
    assert not any(r.get("finished") for r in seen if r["kind"] == "progress")

    second = start(config, run_dir, "--resume")
    out, _ = second.communicate(timeout=400)
    assert second.returncode == 0, out[-2000:]
    resumed = list(records(out.splitlines()))
    assert [r["step"] for r in resumed if r["kind"] == "step"] == list(range(steps_done, STEPS))
    killed_rewards = {r["step"]: r["reward_mean"] for r in seen if r["kind"] == "step"}
    resumed_rewards = {r["step"]: r["reward_mean"] for r in resumed if r["kind"] == "step"}
    assert all(step not in resumed_rewards for step in killed_rewards)  # no step run twice, none lost
