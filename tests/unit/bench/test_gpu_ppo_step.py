"""gpu_ppo_step: the one-process PPO step drives the product's roles through their current seam."""

import math

import gpu_ppo_step
from gpu_workloads import MODELS

from ppojob_api.spec import PPOJobSpec


def test_one_step_on_the_cpu_runs_every_stage_through_the_roles(tmp_path):
    model = tmp_path / "qwen2-test"
    gpu_ppo_step.make_checkpoint(model, seed=0, config=MODELS["qwen2-test"])
    spec = PPOJobSpec.model_validate({
        "image": "bench", "seed": 1, "model": {"path": str(model), "dtype": "float32"},
        "actor": {"backend": "Torch", "microBatchSize": 2, "learningRate": 1e-6, "compile": False},
        "rollout": {"batchSize": 4, "maxNewTokens": 6, "temperature": 1.0},
    })
    prompts = gpu_ppo_step.make_prompts(4, 12, seed=0)

    run = gpu_ppo_step.run_backend("Torch", spec, prompts, steps=1, device="cpu")

    step = run["steps"][0]
    assert step["generated_tokens"] > 0
    for stage in ("generate", "actor log-probs", "ref log-probs", "critic values", "critic train", "actor train",
                  "weight sync (wake + actor turn + copy)"):
        assert step["stages"][stage]["calls"] >= 1, stage
    # The actor trained on the critic's values: its loss and gradient are real numbers, its KL is the step's.
    assert math.isfinite(step["actor"]["loss"]) and step["actor"]["grad_norm"] > 0
    assert math.isfinite(step["actor"]["kl"])
    # Train-side offload as in the product: every training role went to the host and back.
    for role in ("actor", "critic", "ref"):
        assert step["stages"][f"{role} offload"]["calls"] >= 1 and step["stages"][f"{role} onload"]["calls"] >= 1
