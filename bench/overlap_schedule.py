"""Seconds per step of ppo.schedule Synchronous and OneStepOverlap, and how much generation the overlap hides.

On the CPU, with builtin:tiny on the synthetic task, Disaggregated (one engine and the training roles
in processes of their own, one local Ray), both schedules run the same job in one process, one after
the other, through the product's loop (`train.run`). Per schedule it prints the mean seconds per
step (the first step left out: it pays for the start), the engines' own generation seconds per step,
the generation time the driver waited for (its `generate` stage), and the share of generation hidden
behind training: 1 - waited / generated. The ratio of the two step times closes the output. A busy
machine moves every figure; compare the two schedules of one run, not runs of different days.

    .venv/bin/python bench/overlap_schedule.py [--steps 8] [--batch-size 32] [--max-new-tokens 32] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "trainer"), str(ROOT / "api")]

from ppo_trainer.cli import configure_ray_auth

configure_ray_auth(joining=False)

import ray

from ppo_trainer.reporting.metrics import StepMetrics
from ppo_trainer.reporting.reporters import Recorder
from ppo_trainer.train import run
from ppojob_api.spec import parse_spec

SCHEDULES = ("Synchronous", "OneStepOverlap")


def job(schedule: str, *, steps: int, batch_size: int, max_new_tokens: int):
    return parse_spec({
        "image": "local", "seed": 1, "model": {"path": "builtin:tiny"},
        "actor": {"learningRate": 1e-2, "microBatchSize": batch_size},
        "rollout": {"batchSize": batch_size, "maxNewTokens": max_new_tokens, "gpus": 1},
        "placement": "Disaggregated", "offload": {"rollout": False},
        "ppo": {"numRollouts": steps, "numCriticOnlySteps": 0, "klCoef": 0.001, "epochs": 2, "schedule": schedule},
        "checkpoint": {"interval": 0},
    })


def measure(schedule: str, **sizes) -> dict:
    state = run(job(schedule, **sizes), reporter=Recorder(), checkpoint_dir=None, resume=False, use_gpus=False)
    timed = [StepMetrics.from_dict(d) for d in state.history][1:]
    generated = sum(m.generation_seconds for m in timed)
    waited = sum(m.stage_seconds.get("generate", 0.0) for m in timed)
    return {
        "schedule": schedule,
        "steps_timed": len(timed),
        "seconds_per_step": round(sum(m.seconds for m in timed) / len(timed), 3),
        "generation_seconds_per_step": round(generated / len(timed), 3),
        "waited_for_generation_per_step": round(waited / len(timed), 3),
        "generation_hidden": round(1 - waited / generated, 3),
        "staleness": sorted({m.staleness for m in timed}),
        "reward_last": round(timed[-1].reward_mean, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="run both schedules this many times, alternating")
    args = parser.parse_args()
    sizes = {"steps": args.steps, "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens}
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ppo-bench-"),
             object_store_memory=200 * 2**20, logging_level="WARNING", log_to_driver=False)
    try:
        results = [measure(schedule, **sizes) for _ in range(args.rounds) for schedule in SCHEDULES]
    finally:
        ray.shutdown()
    for result in results:
        print(json.dumps(result))
    per_schedule = {s: [r["seconds_per_step"] for r in results if r["schedule"] == s] for s in SCHEDULES}
    mean = {s: sum(v) / len(v) for s, v in per_schedule.items()}
    print(json.dumps({"synchronous_over_overlap": round(mean["Synchronous"] / mean["OneStepOverlap"], 3),
                      "sizes": sizes, "rounds": args.rounds}))


if __name__ == "__main__":
    main()
