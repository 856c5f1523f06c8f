"""parse_spec: defaults, lax numbers, and errors that name the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ppojob_api.spec import (
    OVERLAP_KEEPS_ENGINES_AWAKE,
    OVERLAP_NEEDS_DISAGGREGATED,
    OVERLAP_RATIO_IS_CORRECTED,
    REMOTE_REWARD_NEEDS_URL,
    REMOTE_REWARD_NOT_REMOTE,
    REWARD_FUNCTION_NOT_CUSTOM,
    SpecError,
    check_semantics,
    parse_spec,
    to_manifest_dict,
)
from ppojob_api.vocabulary import LossAggregation, Placement, RolloutCorrection, Schedule

CRD = Path(__file__).resolve().parents[3] / "crds" / "ppojobs.ppojob.io.yaml"


def make_spec(**sections):
    raw = {"image": "ppojob/trainer:test"}
    raw.update(sections)
    return raw


def crd_rule_messages() -> list[str]:
    """The messages of the CRD's CEL rules on spec, which the API server returns."""
    spec = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return [rule.get("message") for rule in spec["x-kubernetes-validations"]]


def problems_of(raw) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_spec(raw)
    return info.value.problems


def test_parse_spec_fills_defaults_like_the_api_server():
    spec = parse_spec(make_spec())
    assert spec.ppo.num_rollouts == 10 and spec.ppo.lam == 0.95 and spec.placement == Placement.COLOCATE
    assert spec.critic.enabled and spec.offload.train
    assert spec.critic_learning_rate == spec.actor.learning_rate


def test_parse_spec_reads_numbers_written_as_strings():
    spec = parse_spec(make_spec(critic={"learningRate": "1e-5"}, ppo={"lambda": "0.9"}))
    assert spec.critic.learning_rate == pytest.approx(1e-5)
    assert spec.critic_learning_rate == pytest.approx(1e-5)
    assert spec.ppo.lam == pytest.approx(0.9)


def test_parse_spec_rejects_unknown_keys_with_the_valid_ones():
    (problem,) = problems_of(make_spec(critic={"learningrate": 1e-5}))
    assert problem.startswith("spec.critic.learningrate: unknown field")
    assert "learningRate" in problem and "updatesPerActorUpdate" in problem


@pytest.mark.parametrize(
    "raw, old, replacement",
    [
        ({"criticLoad": "/ckpt"}, "spec.criticLoad", "critic.load"),
        ({"critic": {"lr": 1e-5}}, "spec.critic.lr", "critic.learningRate"),
        ({"critic": {"numGpusPerNode": 8}}, "spec.critic.numGpusPerNode", "shares the actor's GPUs"),
        ({"customAdvantageFunctionPath": "m:f"}, "spec.customAdvantageFunctionPath", "ppo.customAdvantageFunction"),
    ],
)
def test_parse_spec_names_the_replacement_of_removed_keys(raw, old, replacement):
    (problem,) = problems_of(make_spec(**raw))
    assert problem.startswith(f"{old}: was removed; use") and replacement in problem


def test_parse_spec_lists_every_problem_at_once():
    problems = problems_of({"ppo": {"gamma": "abc", "clipEps": -1}})
    assert any(p.startswith("spec.image: required") for p in problems)
    assert any(p.startswith("spec.ppo.gamma:") for p in problems)
    assert any(p.startswith("spec.ppo.clipEps:") for p in problems)


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ({"ppo": {"numRollouts": 2, "numCriticOnlySteps": 3}}, "must not exceed ppo.numRollouts (2)"),
        ({"ppo": {"numCriticOnlySteps": 1}, "critic": {"enabled": False}}, "needs a critic"),
        ({"placement": "Disaggregated"}, "set rollout.gpus > 0"),
        ({"rollout": {"gpus": 2}}, "set rollout.gpus to 0"),
        ({"critic": {"parallelism": {"tensor": 3}}, "resources": {"gpusPerNode": 8}}, "multiple of critic.parallelism"),
        ({"critic": {"parallelism": {"data": 3, "tensor": 2}}, "resources": {"gpusPerNode": 4}},
         "lower critic.parallelism.data"),
        ({"actor": {"parallelism": {"data": 2}}, "resources": {"gpusPerNode": 1}}, "lower actor.parallelism.data"),
        ({"reward": {"type": "Custom"}}, "needs reward.function"),
        ({"actor": {"parallelism": {"tensor": 3}}, "critic": {"parallelism": {"tensor": 3}}}, "multiple of"),
        ({"ppo": {"clipEps": 0.2, "clipEpsHigh": 0.1}}, "clipEpsHigh must be at least"),
    ],
)
def test_semantic_rules_reject_with_their_message(raw, fragment):
    problems = problems_of(make_spec(**raw))
    assert any(fragment in p for p in problems), problems


@pytest.mark.parametrize(
    "raw, role",
    [
        ({"rollout": {"batchSize": 4}, "resources": {"gpusPerNode": 8}}, "actor"),  # 8 data ranks by default
        ({"rollout": {"batchSize": 2}, "actor": {"parallelism": {"data": 1}}, "critic": {"parallelism": {"data": 4}},
          "resources": {"gpusPerNode": 4}}, "critic"),
        ({"rollout": {"batchSize": 1}, "actor": {"parallelism": {"data": 2}}, "resources": {"gpusPerNode": 0}}, "actor"),
        ({"rollout": {"batchSize": 2, "gpus": 1}, "placement": "Disaggregated", "resources": {"gpusPerNode": 4}},
         "actor"),  # 3 training GPUs
    ],
)
def test_a_step_with_fewer_samples_than_data_parallel_ranks_is_refused_as_the_crd_refuses_it(raw, role):
    problems = problems_of(make_spec(**raw))
    message = (
        f"a step's samples (rollout.batchSize * rollout.samplesPerPrompt) are fewer than the {role}'s data-parallel"
        f" ranks ({role}.parallelism.data; unset, the training GPUs / (tensor * pipeline)), each of which trains on"
        f" its own share: raise rollout.batchSize, or lower {role}.parallelism.data"
    )
    assert message in problems, problems
    assert message in crd_rule_messages()


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ({"rollout": {"batchSize": 4}, "resources": {"gpusPerNode": 8}}, "are fewer than the actor's"),
        ({"actor": {"parallelism": {"data": 2}}, "resources": {"gpusPerNode": 1}}, "lower actor.parallelism.data"),
        ({"actor": {"parallelism": {"tensor": 3}}, "resources": {"gpusPerNode": 8}}, "multiple of actor.parallelism"),
    ],
)
def test_a_critic_without_sizes_of_its_own_is_covered_by_the_actors_message_alone(raw, fragment):
    (problem,) = problems_of(make_spec(**raw))
    assert fragment in problem


@pytest.mark.parametrize(
    "raw",
    [
        {"rollout": {"batchSize": 4, "samplesPerPrompt": 2}, "resources": {"gpusPerNode": 8}},
        {"rollout": {"batchSize": 4}, "resources": {"gpusPerNode": 8}, "actor": {"backend": "Megatron",
                                                                             "parallelism": {"tensor": 2}}},
        {"rollout": {"batchSize": 1}, "resources": {"gpusPerNode": 0}},  # the CPU ranks are the trainer's to check
    ],
)
def test_a_step_with_a_sample_for_every_data_parallel_rank_passes(raw):
    assert check_semantics(parse_spec(make_spec(**raw))) == []


def test_a_valid_disaggregated_spec_passes():
    spec = parse_spec(make_spec(placement="Disaggregated", rollout={"gpus": 2}))
    assert check_semantics(spec) == []


def test_manifest_round_trip_is_stable():
    spec = parse_spec(make_spec(ppo={"numCriticOnlySteps": 2}))
    assert parse_spec(to_manifest_dict(spec)) == spec


def test_loss_aggregation_and_rollout_correction_default_to_token_mean_and_none():
    ppo = parse_spec(make_spec()).ppo
    assert ppo.loss_aggregation == LossAggregation.TOKEN_MEAN
    assert ppo.rollout_correction.type == RolloutCorrection.NONE and ppo.rollout_correction.cap == 2.0
    chosen = parse_spec(make_spec(ppo={"lossAggregation": "SequenceMeanTokenSum",
                                       "rolloutCorrection": {"type": "TruncatedImportanceSampling", "cap": "3"}})).ppo
    assert chosen.loss_aggregation == LossAggregation.SEQUENCE_MEAN_TOKEN_SUM
    assert chosen.rollout_correction.type == RolloutCorrection.TRUNCATED_IMPORTANCE_SAMPLING
    assert chosen.rollout_correction.cap == 3.0


def test_bad_loss_aggregation_and_rollout_correction_name_the_field_and_the_choices():
    problems = problems_of(make_spec(ppo={"lossAggregation": "Mean", "rolloutCorrection": {"type": "TIS", "cap": 0.5}}))
    assert len(problems) == 3
    assert problems[0].startswith("spec.ppo.lossAggregation:") and "'SequenceMeanTokenMean'" in problems[0]
    assert problems[1].startswith("spec.ppo.rolloutCorrection.type:") and "'TruncatedImportanceSampling'" in problems[1]
    assert problems[2].startswith("spec.ppo.rolloutCorrection.cap:") and "greater than or equal to 1" in problems[2]


OVERLAP = {"schedule": "OneStepOverlap"}
DISAGGREGATED = {"placement": "Disaggregated", "rollout": {"gpus": 1}, "offload": {"rollout": False}}


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"ppo": OVERLAP, "offload": {"rollout": False}}, OVERLAP_NEEDS_DISAGGREGATED),
        ({**DISAGGREGATED, "ppo": OVERLAP, "offload": {"rollout": True}}, OVERLAP_KEEPS_ENGINES_AWAKE),
        ({**DISAGGREGATED, "ppo": {**OVERLAP, "rolloutCorrection": {"type": "TruncatedImportanceSampling"}}},
         OVERLAP_RATIO_IS_CORRECTED),
    ],
)
def test_one_step_overlap_refuses_what_it_cannot_honour_with_the_crd_rules_message(raw, message):
    assert problems_of(make_spec(**raw)) == [message]
    # The CRD states the same rule in CEL, with the same message for the API server to return.
    assert message in crd_rule_messages()


def test_one_step_overlap_on_colocate_names_the_placement_and_the_way_back():
    (problem,) = problems_of(make_spec(ppo=OVERLAP, offload={"rollout": False}))
    assert "set placement Disaggregated" in problem and "use ppo.schedule Synchronous" in problem


def test_schedule_defaults_to_synchronous_and_overlap_parses_on_disaggregated():
    assert parse_spec(make_spec()).ppo.schedule == Schedule.SYNCHRONOUS
    spec = parse_spec(make_spec(**DISAGGREGATED, ppo=OVERLAP))
    assert spec.ppo.schedule == Schedule.ONE_STEP_OVERLAP and check_semantics(spec) == []


def test_actor_updates_before_a_step_count_the_steps_after_the_warm_up():
    ppo = parse_spec(make_spec(ppo={"numRollouts": 6, "numCriticOnlySteps": 2})).ppo
    assert [ppo.actor_updates_before(step) for step in range(7)] == [0, 0, 0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "reward, message",
    [
        ({"type": "ExactAnswer", "function": "my.rewards:score"}, REWARD_FUNCTION_NOT_CUSTOM),
        ({"type": "Remote"}, REMOTE_REWARD_NEEDS_URL),
        ({"type": "Remote", "remote": {"batchSize": 8}}, REMOTE_REWARD_NEEDS_URL),
        ({"type": "Synthetic", "remote": {"url": "http://scorer:8000/score"}}, REMOTE_REWARD_NOT_REMOTE),
        ({"type": "Custom", "function": "m:f", "remote": {"headers": [{"name": "Authorization", "fromEnv": "TOKEN"}]}},
         REMOTE_REWARD_NOT_REMOTE),
    ],
)
def test_reward_settings_of_another_type_are_refused_with_the_crd_rules_message(reward, message):
    assert problems_of(make_spec(reward=reward)) == [message]
    assert message in crd_rule_messages()


def test_remote_reward_parses_with_its_defaults():
    remote = parse_spec(make_spec(reward={"type": "Remote", "remote": {"url": "https://scorer.example/v1/score?x=1"}})).reward.remote
    assert remote.url == "https://scorer.example/v1/score?x=1"
    assert (remote.timeout_seconds, remote.max_retries, remote.max_concurrency, remote.batch_size) == (60, 3, 4, 64)
    assert remote.headers is None


@pytest.mark.parametrize(
    "remote, field",
    [
        ({"url": "ftp://scorer/score"}, "spec.reward.remote.url"),
        ({"url": "scorer:8000/score"}, "spec.reward.remote.url"),
        ({"url": "http:///score"}, "spec.reward.remote.url"),
        ({"url": "http://scorer/a b"}, "spec.reward.remote.url"),
        ({"url": "http://s", "maxRetries": 11}, "spec.reward.remote.maxRetries"),
        ({"url": "http://s", "timeoutSeconds": 0}, "spec.reward.remote.timeoutSeconds"),
        ({"url": "http://s", "maxConcurrency": 0}, "spec.reward.remote.maxConcurrency"),
        ({"url": "http://s", "batchSize": 0}, "spec.reward.remote.batchSize"),
    ],
)
def test_remote_reward_bad_settings_name_their_field(remote, field):
    problems = problems_of(make_spec(reward={"type": "Remote", "remote": remote}))
    assert any(p.startswith(field + ":") for p in problems), problems


def test_remote_reward_headers_name_their_environment_variables():
    headers = [{"name": "Authorization", "fromEnv": "SCORER_AUTHORIZATION"}, {"name": "X-Team", "fromEnv": "TEAM"}]
    remote = parse_spec(make_spec(reward={"type": "Remote", "remote": {"url": "http://s", "headers": headers}})).reward.remote
    assert [(h.name, h.from_env) for h in remote.headers] == [("Authorization", "SCORER_AUTHORIZATION"), ("X-Team", "TEAM")]


@pytest.mark.parametrize(
    "headers, fragment",
    [
        ([{"name": "Bad Header", "fromEnv": "T"}], "spec.reward.remote.headers.0.name:"),
        ([{"name": "Authorization", "fromEnv": "1TOKEN"}], "spec.reward.remote.headers.0.fromEnv:"),
        ([{"name": "Authorization"}], "spec.reward.remote.headers.0.fromEnv: required"),
        ([{"name": "A", "fromEnv": "T"}, {"name": "A", "fromEnv": "U"}],
         "reward.remote.headers: a header is named twice: keep one entry per name"),
    ],
)
def test_remote_reward_bad_headers_are_refused_naming_the_field(headers, fragment):
    problems = problems_of(make_spec(reward={"type": "Remote", "remote": {"url": "http://s", "headers": headers}}))
    assert any(p.startswith(fragment) for p in problems), problems
