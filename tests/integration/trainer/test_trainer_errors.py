"""Bad configs and a bad custom advantage function: exit code 2 and a message that names the problem."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from ppo_trainer.cli import load_config

BASE = {"model": {"path": "builtin:tiny"}, "ppo": {"numRollouts": 2}}


def ppo_train(tmp_path, spec: dict, *extra: str, critic: dict | None = None) -> subprocess.CompletedProcess:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(spec))
    args = [sys.executable, "-m", "ppo_trainer.cli", str(config), "--run-dir", str(tmp_path / "run"), *extra]
    if critic is not None:
        (tmp_path / "critic.yaml").write_text(yaml.safe_dump(critic))
        args += ["--critic-config", str(tmp_path / "critic.yaml")]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


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
