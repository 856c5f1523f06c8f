"""Bad configs and bad custom advantage or reward functions: exit code 2 and a message that names the
problem, before Ray starts; an error raised inside Ray: its cause on the first line, without Ray's wrapping."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from ppo_trainer.cli import load_config
from ppo_trainer.failures import describe_failure, failure_cause

BASE = {"model": {"path": "builtin:tiny"}, "ppo": {"numRollouts": 2}}


def ppo_train(tmp_path, spec: dict, *extra: str, critic: dict | None = None,
              timeout: int = 120) -> subprocess.CompletedProcess:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(spec))
    args = [sys.executable, "-m", "ppo_trainer.cli", str(config), "--run-dir", str(tmp_path / "run"), *extra]
    if critic is not None:
        (tmp_path / "critic.yaml").write_text(yaml.safe_dump(critic))
        args += ["--critic-config", str(tmp_path / "critic.yaml")]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.parametrize(
    ("spec", "critic", "expected"),
    [
        ({**BASE, "ppo": {"numRollouts": 2, "numCriticOnlySteps": 5}}, None, "ppo.numCriticOnlySteps (5) must not exceed"),
        ({**BASE, "criticLr": 1e-5}, None, "spec.criticLr: was removed; use critic.learningRate"),
        ({**BASE, "rollout": {"batchSize": 0}}, None, "spec.rollout.batchSize"),
        (BASE, {"lr": "1e-5"}, "spec.critic.lr: was removed; use critic.learningRate"),
        (BASE, {"learningRat": 1e-5}, "valid fields here: enabled, model, learningRate, backend"),
        (BASE, {"parallelism": {"data": 9}}, "lower critic.parallelism.data"),
        (BASE, {"backend": "Jax"}, "spec.critic.backend"),
    ],
)
def test_errors_bad_config_exit_2_with_message(tmp_path, spec, critic, expected):
    result = ppo_train(tmp_path, spec, critic=critic)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_errors_critic_config_numbers_as_strings_are_numbers(tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(BASE))
    (tmp_path / "critic.yaml").write_text("learningRate: 1e-5\nupdatesPerActorUpdate: '3'\n")
    spec, name = load_config(str(tmp_path / "job.yaml"), critic_config=str(tmp_path / "critic.yaml"))
    assert spec.critic.learning_rate == 1e-5 and spec.critic.updates_per_actor_update == 3
    assert spec.image == "local" and name == "job"


def test_errors_critic_config_covers_the_critics_own_model_and_layout(tmp_path):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**BASE, "actor": {"microBatchSize": 4, "maxGradNorm": 0.5}}))
    (tmp_path / "critic.yaml").write_text(yaml.safe_dump({
        "model": "builtin:tiny-narrow", "backend": "Torch", "microBatchSize": 2, "load": "/ckpt/critic",
        "save": "/ckpt/critic-out", "parallelism": {"data": 1}}))
    spec, _ = load_config(str(tmp_path / "job.yaml"), critic_config=str(tmp_path / "critic.yaml"))
    critic = spec.training_role("critic")
    assert (critic.model.path, critic.micro_batch_size, critic.max_grad_norm, critic.data) == (
        "builtin:tiny-narrow", 2, 0.5, 1)  # maxGradNorm unset: the actor's
    assert (spec.critic.load, spec.critic.save) == ("/ckpt/critic", "/ckpt/critic-out")


BAD_FUNCTIONS = {
    "forgets_returns": ("return {'advantages': batch.rewards}", "returned a dict without 'returns'"),
    "wrong_shape": ("return {'advantages': batch.rewards[:, :1], 'returns': batch.rewards}", "of shape (2, 1)"),
    "not_finite": ("return {'advantages': batch.rewards / 0 * 0, 'returns': batch.rewards}", "non-finite"),
}


@pytest.mark.parametrize("name", sorted(BAD_FUNCTIONS))
def test_errors_bad_custom_advantage_function_named(tmp_path, name):
    body, expected = BAD_FUNCTIONS[name]
    module = tmp_path / "my_advantages.py"
    module.write_text(f"def {name}(batch):\n    {body}\n")
    spec = {**BASE, "ppo": {"numRollouts": 2, "customAdvantageFunction": f"{module}:{name}"}}
    result = ppo_train(tmp_path, spec)
    assert result.returncode == 2, result.stderr
    assert f"{module}:{name}" in result.stderr and expected in result.stderr
    assert "Traceback" not in result.stderr


def test_errors_missing_custom_advantage_function(tmp_path):
    spec = {**BASE, "ppo": {"numRollouts": 2, "customAdvantageFunction": "no_such_module_xyz:fn"}}
    result = ppo_train(tmp_path, spec)
    assert result.returncode == 2 and "no_such_module_xyz" in result.stderr


def test_errors_the_example_critic_config_merges_over_the_example_job():
    from pathlib import Path

    examples = Path(__file__).resolve().parents[3] / "examples"
    spec, _ = load_config(str(examples / "tiny-cpu-ppojob.yaml"), critic_config=str(examples / "critic-tiny-narrow.yaml"))
    critic = spec.training_role("critic")
    assert (critic.model.path, critic.micro_batch_size, critic.data) == ("builtin:tiny-narrow", 16, 1)
    assert spec.model.path == "builtin:tiny"


def test_errors_missing_reward_file_fails_before_ray_starts(tmp_path):
    missing = tmp_path / "no_such_rewards.py"
    spec = {**BASE, "reward": {"type": "Custom", "function": f"{missing}:score"}}
    started = time.monotonic()
    result = ppo_train(tmp_path, spec)
    assert result.returncode == 2, result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith("ppo-train: custom reward function") and str(missing) in first
    assert not (tmp_path / "run").exists()  # made just before Ray starts
    assert time.monotonic() - started < 60, "the check runs before Ray starts: seconds, not Ray's minute"


def test_errors_reward_function_with_the_wrong_parameters_named(tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text("def score(responses):\n    return [0.0 for _ in responses]\n")
    result = ppo_train(tmp_path, {**BASE, "reward": {"type": "Custom", "function": f"{module}:score"}})
    assert result.returncode == 2, result.stderr
    assert "fn(prompts, responses, labels)" in result.stderr.splitlines()[0]
    assert not (tmp_path / "run").exists()


def test_errors_reward_failing_inside_ray_shows_its_cause_on_the_first_line(tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text("def score(prompts, responses, labels):\n    return [float('nan') for _ in responses]\n")
    spec = {**BASE, "rollout": {"batchSize": 8, "maxNewTokens": 4}, "actor": {"microBatchSize": 8},
            "reward": {"type": "Custom", "function": f"{module}:score"}}
    result = ppo_train(tmp_path, spec, "--json", timeout=400)  # Ray's start and a first rollout: a loaded 2-core machine takes minutes
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == f"ppo-train: the run failed: CustomRewardError: {module}:score returned a non-finite score at index 0 (nan)"
    assert "\x1b" not in result.stderr and "RayTaskError" not in result.stderr and "ray::" not in result.stderr


def test_errors_inside_ray_unwrap_to_their_cause(ray_session):
    import ray

    from ppo_trainer.rewards import CustomRewardError

    @ray.remote
    class Failing:  # defined here, so pickled by value: the workers cannot import this test module
        def __init__(self, fail: bool):
            if fail:
                raise CustomRewardError("the constructor failed")

        def call(self):
            raise CustomRewardError("the \x1b[31mmethod\x1b[0m failed")

    for actor, message in ((Failing.remote(True), "the constructor failed"), (Failing.remote(False), "the method failed")):
        with pytest.raises(ray.exceptions.RayError) as raised:
            ray.get(actor.call.remote())
        assert isinstance(failure_cause(raised.value), CustomRewardError)
        assert describe_failure(raised.value) == f"CustomRewardError: {message}"
