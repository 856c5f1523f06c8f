"""The product's own PPO loop on the GPU issue's workload: `train.run` through Ray, stage by stage.

`gpu_ppo_step.py` drives the role classes in one process to time every transition; this script
runs what a PPOJob runs: Ray actors for the rollout engine, actor, critic and reference,
colocated on the GPUs (fractional bundles), offload on, the critic's values handed to the actor
through the object store. Same model as the step bench (Qwen2.5-0.5B shape, random weights,
bf16), 256 prompts of about 100 tokens (byte tokenizer: one token a character), up to 512 new
tokens, reward `Synthetic`. Prints each step's seconds and stages (train.py's timer) per backend
and writes loop.json into --out.

    python3 bench/gpu_ppo_loop.py --out $OUT/loop --steps 4 --backends Torch,Megatron
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent / "trainer"), str(ROOT.parent / "api")]

from gpu_ppo_step import make_checkpoint

from ppojob_api.spec import parse_spec


def write_prompts(path: Path, count: int, length: int, seed: int) -> None:
    """JSONL prompts of length +- 10 lowercase words' characters."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            text = ""
            target = rng.randint(length - 10, length + 10)
            while len(text) < target:
                text += "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) + " "
            out.write(json.dumps({"prompt": text[:target]}) + "\n")


def run_loop(backend: str, args: argparse.Namespace, model: Path, prompts: Path) -> dict:
    import ray

    from ppo_trainer.reporting import Recorder
    from ppo_trainer.train import run

    parallelism = {"tensor": args.tensor, "pipeline": args.pipeline}
    spec = parse_spec({
        "image": "bench", "seed": 1,
        "model": {"path": str(model), "tokenizer": "builtin:tiny", "dtype": "bfloat16"},
        "actor": {"backend": backend, "microBatchSize": args.micro_batch_size, "learningRate": 1e-6,
                  "parallelism": parallelism},
        "critic": {"parallelism": parallelism},
        "rollout": {"batchSize": args.prompts, "maxNewTokens": args.max_new_tokens, "temperature": 1.0},
        "ppo": {"numRollouts": args.steps, "numCriticOnlySteps": 0, "epochs": 1},
        "data": {"prompts": str(prompts)},
        "offload": {"train": True, "rollout": True, "processGroups": args.process_groups},
        "checkpoint": {"interval": 0},
        "resources": {"nodes": 1, "gpusPerNode": args.gpus},
    })
    ray.init(num_gpus=args.gpus, include_dashboard=False, logging_level="WARNING",
             _temp_dir=tempfile.mkdtemp(prefix="ppo-loop-ray-"))
    started = time.perf_counter()
    try:
        state = run(spec, reporter=Recorder(), checkpoint_dir=None, resume=False, use_gpus=True)
    finally:
        ray.shutdown()
    steps = [{"seconds": h["seconds"], "stages": h["stage_seconds"], "tokens": h["response_tokens"]}
             for h in state.history]
    for index, step in enumerate(steps):
        stages = ", ".join(f"{k} {v:.2f}" for k, v in step["stages"].items())
        print(f"[{backend}] step {index}: {step['seconds']:.2f} s, {step['tokens']} tokens; {stages}", flush=True)
    measured = steps[1:] or steps  # step 0 compiles and warms up
    return {
        "backend": backend, "wall_seconds": time.perf_counter() - started, "steps": steps,
        "step_seconds": statistics.mean(s["seconds"] for s in measured),
        "stage_seconds": {k: statistics.mean(s["stages"][k] for s in measured) for k in measured[0]["stages"]},
        "tokens_per_step": statistics.mean(s["tokens"] for s in measured),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4, help="PPO steps per backend; the first is warm-up")
    parser.add_argument("--backends", default="Torch,Megatron")
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-length", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--tensor", type=int, default=1, help="Megatron's tensor-parallel size")
    parser.add_argument("--pipeline", type=int, default=1, help="Megatron's pipeline-parallel size")
    parser.add_argument("--process-groups", action=argparse.BooleanOptionalAction, default=True,
                        help="offload.processGroups: destroy and rebuild the roles' process groups around sleep")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ppo-loop-"))
    make_checkpoint(work / "model", seed=0)
    write_prompts(work / "prompts.jsonl", args.prompts, args.prompt_length, seed=0)
    results = []
    for backend in args.backends.split(","):
        results.append(run_loop(backend, args, work / "model", work / "prompts.jsonl"))
        (args.out / "loop.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                        "results": results}, indent=1))
    print(f"{'stage (s per step, steps 1..)':40}" + "".join(f"{r['backend']:>12}" for r in results))
    for stage in results[0]["stage_seconds"]:
        print(f"{stage:40}" + "".join(f"{r['stage_seconds'].get(stage, float('nan')):12.3f}" for r in results))
    print(f"{'step seconds (target < 8)':40}" + "".join(f"{r['step_seconds']:12.2f}" for r in results))
    print(f"{'generated tokens per step':40}" + "".join(f"{r['tokens_per_step']:12.0f}" for r in results))


if __name__ == "__main__":
    main()
