"""reward.type Model: its settings parse with their defaults, and bad ones are refused naming the field,
with the messages the CRD's CEL rules give."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ppojob_api.spec import (
    COMBINED_CUSTOM_NEEDS_FUNCTION,
    COMBINED_REMOTE_NEEDS_URL,
    GATE_NEEDS_A_RULE,
    MODEL_REWARD_NEEDS_PATH,
    MODEL_REWARD_NOT_MODEL,
    REMOTE_REWARD_NOT_REMOTE,
    REWARD_FUNCTION_NOT_CUSTOM,
    SpecError,
    check_semantics,
    parse_spec,
)
from ppojob_api.vocabulary import RewardCombine, RuleReward

CRD = Path(__file__).resolve().parents[3] / "crds" / "ppojobs.ppojob.io.yaml"


def crd_rule_messages() -> list[str]:
    spec = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return [rule.get("message") for rule in spec["x-kubernetes-validations"]]


def problems_of(reward: dict) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_spec({"image": "local", "reward": reward})
    return info.value.problems


def test_model_reward_parses_with_its_defaults():
    reward = parse_spec({"image": "local", "reward": {"type": "Model", "model": {"path": "/models/rm"}}}).reward
    model = reward.model
    assert (model.path, model.micro_batch_size, model.max_length, model.weight) == ("/models/rm", 8, 2048, 1.0)
    assert model.combine_with is None and model.combine == RewardCombine.SUM
    assert reward.rule is None


def test_model_reward_combined_with_a_rule_names_that_rule():
    spec = parse_spec({"image": "local", "reward": {
        "type": "Model", "function": "my.rewards:score",
        "model": {"path": "/rm", "combineWith": "Custom", "combine": "Gate", "weight": "0.5"}}})
    assert spec.reward.rule == RuleReward.CUSTOM and spec.reward.model.weight == 0.5
    assert check_semantics(spec) == []
    remote = parse_spec({"image": "local", "reward": {
        "type": "Model", "remote": {"url": "http://scorer:8000/score"}, "model": {"path": "/rm", "combineWith": "Remote"}}})
    assert remote.reward.rule == RuleReward.REMOTE


@pytest.mark.parametrize(
    "reward, message",
    [
        ({"type": "Model"}, MODEL_REWARD_NEEDS_PATH),
        ({"type": "ExactAnswer", "model": {"path": "/rm"}}, MODEL_REWARD_NOT_MODEL),
        ({"type": "Synthetic", "model": {"combineWith": "ExactAnswer"}}, MODEL_REWARD_NOT_MODEL),
        ({"type": "Model", "model": {"path": "/rm", "combine": "Gate"}}, GATE_NEEDS_A_RULE),
        ({"type": "Model", "model": {"path": "/rm", "combineWith": "Custom"}}, COMBINED_CUSTOM_NEEDS_FUNCTION),
        ({"type": "Model", "model": {"path": "/rm", "combineWith": "Remote"}}, COMBINED_REMOTE_NEEDS_URL),
        ({"type": "Model", "function": "m:f", "model": {"path": "/rm", "combineWith": "ExactAnswer"}},
         REWARD_FUNCTION_NOT_CUSTOM),
        ({"type": "Model", "remote": {"url": "http://s"}, "model": {"path": "/rm"}}, REMOTE_REWARD_NOT_REMOTE),
    ],
)
def test_model_reward_settings_that_cannot_run_are_refused_with_the_crd_rules_message(reward, message):
    assert problems_of(reward) == [message]
    assert message in crd_rule_messages()


@pytest.mark.parametrize(
    "model, field",
    [
        ({"path": ""}, "spec.reward.model.path"),
        ({"path": "/rm", "microBatchSize": 0}, "spec.reward.model.microBatchSize"),
        ({"path": "/rm", "maxLength": 0}, "spec.reward.model.maxLength"),
        ({"path": "/rm", "weight": 0}, "spec.reward.model.weight"),
        ({"path": "/rm", "combineWith": "Model"}, "spec.reward.model.combineWith"),
        ({"path": "/rm", "combine": "Product"}, "spec.reward.model.combine"),
        ({"path": "/rm", "tokenizer": "/t"}, "spec.reward.model.tokenizer"),
    ],
)
def test_model_reward_bad_values_name_their_field(model, field):
    problems = problems_of({"type": "Model", "model": model})
    assert any(p.startswith(field + ":") for p in problems), problems
