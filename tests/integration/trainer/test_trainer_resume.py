"""Kill the trainer process (SIGKILL, mid-run) and restart it with --resume: it continues exactly.

Runs the real CLI in a subprocess with its own local Ray; the whole process group is killed, so
the trainer gets no chance to clean up or finish a checkpoint it was writing.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import yaml
from cli_run import records, start

STEPS, WARMUP = 7, 3
CONFIG = {
    "apiVersion": "ppojob.io/v1alpha1",
    "kind": "PPOJob",
    "metadata": {"name": "resume"},
    "spec": {
        "seed": 5,
        "model": {"path": "builtin:tiny"},
        "actor": {"learningRate": 1e-2, "microBatchSize": 16},
        "rollout": {"batchSize": 16, "maxNewTokens": 8},
        "ppo": {"numRollouts": STEPS, "numCriticOnlySteps": WARMUP, "epochs": 2},
        "checkpoint": {"interval": 1, "keep": 2},
    },
}


@pytest.mark.timeout(300)
def test_resume_after_sigkill_same_step_and_warmup_counts(tmp_path):
    config, run_dir = tmp_path / "job.yaml", tmp_path / "run"
    config.write_text(yaml.safe_dump(CONFIG))

    first = start(config, run_dir)
    seen = []
    try:
        for record in records(first.stdout):
            seen.append(record)
            if record["kind"] == "step" and record["step"] == WARMUP:  # the first step after the warm-up
                break
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the trainer and its local Ray, mid-run
        first.wait()
    killed_rewards = {r["step"]: r["reward_mean"] for r in seen if r["kind"] == "step"}
    assert first.returncode == -signal.SIGKILL and WARMUP in killed_rewards

    second = start(config, run_dir, "--resume")
    out, _ = second.communicate(timeout=240)
    assert second.returncode == 0, out[-2000:]
    resumed = list(records(out.splitlines()))
    note = next(r for r in resumed if r["kind"] == "note")
    resumed_at = int(note["line"].split("at step ")[1])
    assert WARMUP <= resumed_at <= WARMUP + 1  # the last complete checkpoint
    # From its first report on, the resumed run names that checkpoint as its last one (a restart
    # decided before it writes its own is told as resuming from there, not from the start).
    first_report = next(r for r in resumed if r["kind"] == "progress")
    assert first_report["lastCheckpoint"]["step"] == resumed_at, first_report

    final = [r for r in resumed if r["kind"] == "progress"][-1]
    assert final["finished"] and final["steps"] == f"{STEPS}/{STEPS}"
    assert final["warmup"] == f"{WARMUP}/{WARMUP}" and final["weightSyncsSkipped"] == WARMUP
    resumed_steps = [r["step"] for r in resumed if r["kind"] == "step"]
    assert resumed_steps == list(range(resumed_at, STEPS))
    # Exactly where it stopped: a step run by both processes gave the same batch and reward.
    for step in set(resumed_steps) & set(killed_rewards):
        assert next(r for r in resumed if r["kind"] == "step" and r["step"] == step)["reward_mean"] == killed_rewards[step]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS  # the history survived the kill
    # checkpoint.keep = 2 step directories (beside them, the compile caches a restart reuses)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name != "compile-cache")
    assert checkpoints == [f"step-{STEPS - 1:08d}", f"step-{STEPS:08d}"]
