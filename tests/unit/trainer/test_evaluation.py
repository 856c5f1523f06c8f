"""Held-out evaluation's pure parts: when it is due, its scores' summary, its prompts, its metrics and status."""

from __future__ import annotations

import json

import pytest

from ppo_trainer.data import SYNTHETIC_SET_SIZE, synthetic_prompts
from ppo_trainer.evaluation import evaluation_seed, is_evaluation_due, load_validation_prompts, score_summary
from ppo_trainer.reporting.metrics import StepMetrics, summarize_run
from ppo_trainer.reporting.progress import last_evaluation
from ppo_trainer.reporting.reporters import EvaluationInfo
from ppojob_api.spec import parse_spec


def spec_with(validation: dict, **sections):
    return parse_spec({"image": "local", "data": {"validation": validation, **sections.pop("data", {})}, **sections})


def test_evaluation_is_due_every_interval_steps_and_after_the_last():
    assert [n for n in range(1, 11) if is_evaluation_due(n, interval=3, total_steps=10)] == [3, 6, 9, 10]
    assert [n for n in range(1, 11) if is_evaluation_due(n, interval=0, total_steps=10)] == [10]
    assert [n for n in range(1, 5) if is_evaluation_due(n, interval=1, total_steps=4)] == [1, 2, 3, 4]


def test_score_summary_has_a_pass_rate_only_for_pass_fail_scores():
    assert score_summary([1.0, 0.0, 1.0, 1.0]) == (0.75, 0.75)
    assert score_summary([0.0, 0.0]) == (0.0, 0.0)
    mean, pass_rate = score_summary([0.5, 1.0])
    assert mean == 0.75 and pass_rate is None
    with pytest.raises(ValueError, match="at least one held-out prompt"):
        score_summary([])


def test_validation_prompts_are_the_first_count_of_the_file(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": i}) + "\n" for i in range(5)))
    data = {"promptKey": "question", "labelKey": "answer"}
    prompts = load_validation_prompts(spec_with({"prompts": str(path), "count": 2}, data=data))
    assert [(p.text, p.label) for p in prompts] == [("q0", "0"), ("q1", "1")]
    assert len(load_validation_prompts(spec_with({"prompts": str(path)}, data=data))) == 5  # unset: all
    assert len(load_validation_prompts(spec_with({"prompts": str(path), "count": 0}, data=data))) == 5


def test_synthetic_validation_prompts_are_held_out_from_the_synthetic_training_set():
    prompts = load_validation_prompts(spec_with({"prompts": "synthetic"}, seed=7))
    training = {p.text for p in synthetic_prompts(SYNTHETIC_SET_SIZE, seed=7)}
    assert len(prompts) > SYNTHETIC_SET_SIZE * 0.9 and not training & {p.text for p in prompts}


def test_validation_prompts_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such.jsonl"):
        load_validation_prompts(spec_with({"prompts": str(tmp_path / "no_such.jsonl")}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_validation_prompts(spec_with({"prompts": str(bad)}))


def test_evaluation_seed_is_none_of_the_training_steps_seeds():
    for seed in (0, 1, 42):
        steps = {seed * 1_000_003 + step for step in range(100_000)}
        assert evaluation_seed(seed) not in steps


def step_metrics(step: int, **evaluation) -> StepMetrics:
    return StepMetrics(step=step, critic_only=False, reward_mean=0.1 * step, response_tokens=10, samples=4,
                       seconds=2.0, **evaluation)


def test_step_metrics_carry_the_evaluation_to_tensorboard_and_the_status():
    evaluated = step_metrics(4, eval_reward_mean=0.5, eval_pass_rate=0.5, eval_samples=8, eval_seconds=1.25)
    assert {k: v for k, v in evaluated.scalars().items() if k.startswith("eval/")} == {
        "eval/reward_mean": 0.5, "eval/pass_rate": 0.5, "eval/samples": 8.0, "eval/seconds": 1.25}
    assert evaluated.evaluation() == EvaluationInfo(step=5, reward_mean=0.5, pass_rate=0.5, samples=8)
    assert "eval(reward=0.5000 pass_rate=0.5000 n=8 1.25s)" in evaluated.summary_line(10)
    assert StepMetrics.from_dict(evaluated.to_dict()) == evaluated
    plain = step_metrics(3)
    assert not any(k.startswith("eval/") for k in plain.scalars()) and plain.evaluation() is None
    assert "eval(" not in plain.summary_line(10)


def test_evaluation_status_has_a_pass_rate_only_when_there_is_one():
    assert EvaluationInfo(step=5, reward_mean=0.4, pass_rate=None, samples=8).to_status() == {
        "step": 5, "rewardMean": 0.4, "samples": 8}
    assert EvaluationInfo(step=5, reward_mean=0.25, pass_rate=0.25, samples=4).to_status()["passRate"] == 0.25


def test_run_summary_and_resumed_status_take_the_evaluations_from_the_history():
    history = [step_metrics(0), step_metrics(1, eval_reward_mean=0.25, eval_pass_rate=0.25, eval_samples=4,
                                             eval_seconds=1.0),
               step_metrics(2), step_metrics(3, eval_reward_mean=0.75, eval_pass_rate=0.75, eval_samples=4,
                                             eval_seconds=2.0)]
    summary = summarize_run(history)
    assert {k: v for k, v in summary.items() if k.startswith("eval")} == {
        "evaluations": 2, "evalRewardStart": 0.25, "evalRewardEnd": 0.75, "evalRewardEndStep": 4,
        "evalPassRateStart": 0.25, "evalPassRateEnd": 0.75, "evalSecondsPerEvaluation": 1.5}
    assert not any(k.startswith("eval") for k in summarize_run(history[:1]))
    assert last_evaluation([m.to_dict() for m in history]) == EvaluationInfo(step=4, reward_mean=0.75,
                                                                               pass_rate=0.75, samples=4)
    assert last_evaluation([m.to_dict() for m in history[:1]]) is None


def test_the_status_keeps_the_last_evaluation_through_the_steps_without_one():
    from ppo_trainer.checkpoint import TrainerState
    from ppo_trainer.reporting.progress import ProgressTracker
    from ppo_trainer.reporting.reporters import Recorder

    recorder, state = Recorder(), TrainerState()
    tracker = ProgressTracker(reporter=recorder, poll=lambda: ([], {"actor": "OnDevice", "rollout": "Awake"}),
                              total_steps=4, critic_only_steps=0, with_critic=False, state=state, attempt=0)
    reported = []
    for metrics in (step_metrics(0), step_metrics(1, eval_reward_mean=0.25, eval_samples=4, eval_seconds=1.0),
                    step_metrics(2)):
        state.step = metrics.step + 1
        tracker.step_done(metrics, state=state)
        reported.append(recorder.progress[-1].to_status().get("evaluation"))
    assert reported == [None, {"step": 2, "rewardMean": 0.25, "samples": 4}, {"step": 2, "rewardMean": 0.25, "samples": 4}]
