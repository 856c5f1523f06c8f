"""reward.type Model with a real tiny LlamaForSequenceClassification and a tokenizer of its own: scores
are the model's own forward on the text its chat template renders, whatever the micro-batch; a long
sequence keeps its end; the weighted score is summed with or gated by a rule; sleeping and waking
changes no score; the rollout worker scores with it and sleeps it with its engine; a directory that is
not a one-label classifier is refused before Ray starts."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from tests.fixtures.tiny_reward_model import save_tiny_reward_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from ppo_trainer.checkpoint import TrainerState
from ppo_trainer.cli import EXIT_CONFIG, main
from ppo_trainer.data import Prompt
from ppo_trainer.reporting.progress import ProgressTracker
from ppo_trainer.reporting.reporters import Recorder
from ppo_trainer.reward_model import (
    ModelReward,
    RewardModel,
    RewardModelError,
    check_reward_model,
    combine_scores,
    keep_end,
)
from ppo_trainer.rewards import ExactFinalAnswerReward
from ppo_trainer.roles.rollout import RolloutWorker, build_spec_reward, load_reward_model
from ppo_trainer.weight_sync import OBJECT_STORE
from ppojob_api.spec import parse_spec
from ppojob_api.vocabulary import RewardCombine

PROMPTS = ["What is 2+2?", "Name a colour.", "Say hi", "A long question " * 6, "x"]
RESPONSES = ["The answer is 4", "blue", "hi!", "I do not know, but " * 5, ""]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm"))


def reward_model(path, *, micro_batch_size=8, max_length=512) -> RewardModel:
    return RewardModel(str(path), device="cpu", dtype="float32", micro_batch_size=micro_batch_size,
                       max_length=max_length)


def own_forward(path, ids: list[int]) -> float:
    """transformers' own score of one unpadded sequence."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def chat_ids(path, prompt: str, response: str) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_scores_are_the_models_own_forward_on_its_chat_templates_rendering(model_dir):
    scores = reward_model(model_dir, micro_batch_size=1).score(PROMPTS, RESPONSES)
    expected = [own_forward(model_dir, chat_ids(model_dir, p, r)) for p, r in zip(PROMPTS, RESPONSES)]
    assert scores == expected
    assert len(set(scores)) == len(scores)  # the texts are told apart


def test_without_a_chat_template_the_prompt_and_response_are_read_as_one_text(tmp_path):
    path = save_tiny_reward_model(tmp_path, chat_template=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    scores = reward_model(path, micro_batch_size=1).score(PROMPTS[:2], RESPONSES[:2])
    ids = [tokenizer.encode(p + r, add_special_tokens=True) for p, r in zip(PROMPTS[:2], RESPONSES[:2])]
    assert ids[0][0] == tokenizer.bos_token_id
    assert scores == [own_forward(path, i) for i in ids]


@pytest.mark.parametrize("micro_batch_size", [2, 3, 8])
def test_micro_batches_do_not_change_the_scores(model_dir, micro_batch_size):
    one_by_one = reward_model(model_dir, micro_batch_size=1).score(PROMPTS, RESPONSES)
    batched = reward_model(model_dir, micro_batch_size=micro_batch_size).score(PROMPTS, RESPONSES)
    assert batched == pytest.approx(one_by_one, abs=1e-5, rel=1e-5)


def test_a_sequence_longer_than_max_length_keeps_its_end(model_dir):
    ids = chat_ids(model_dir, PROMPTS[3], RESPONSES[3])
    assert len(ids) > 40
    (score,) = reward_model(model_dir, max_length=40).score(PROMPTS[3:4], RESPONSES[3:4])
    assert score == own_forward(model_dir, ids[-40:])
    assert score != own_forward(model_dir, ids[:40])
    assert keep_end([1, 2, 3, 4], 2) == [3, 4] and keep_end([1, 2], 5) == [1, 2]


def test_combined_scores_sum_or_gate_the_weighted_model_score():
    model, rule = [2.0, -1.0, 0.5], [1.0, 0.0, 1.0]
    assert combine_scores(model, None, weight=0.5, combine=RewardCombine.SUM) == [1.0, -0.5, 0.25]
    assert combine_scores(model, rule, weight=0.5, combine=RewardCombine.SUM) == [2.0, -0.5, 1.25]
    assert combine_scores(model, rule, weight=0.5, combine=RewardCombine.GATE) == [1.0, 0.0, 0.25]
    assert combine_scores([3.0], [-2.0], weight=1.0, combine=RewardCombine.GATE) == [-2.0]  # a failed rule stands
    with pytest.raises(ValueError, match="2 rule scores for 3 model scores"):
        combine_scores(model, rule[:2], weight=1.0, combine=RewardCombine.SUM)


def test_a_jobs_reward_model_gated_by_exact_answer(model_dir):
    spec = parse_spec({"image": "local", "reward": {"type": "Model", "model": {
        "path": str(model_dir), "microBatchSize": 2, "weight": 0.25, "combineWith": "ExactAnswer", "combine": "Gate"}}})
    loaded = load_reward_model(spec, device="cpu")
    reward = build_spec_reward(spec, reward_model=loaded)
    assert reward == ModelReward(model=loaded, rule=ExactFinalAnswerReward(), weight=0.25, combine=RewardCombine.GATE)
    prompts, responses, labels = ["2+2?", "3+3?"], ["it is 4", "it is 7"], ["4", "6"]
    model_scores = loaded.score(prompts, responses)
    assert reward.score(prompts, responses, labels) == [0.25 * model_scores[0], 0.0]
    assert load_reward_model(parse_spec({"image": "local"}), device="cpu") is None


def test_sleeping_and_waking_keeps_the_scores_bit_identical(model_dir):
    model = reward_model(model_dir, micro_batch_size=2)
    before = model.score(PROMPTS, RESPONSES)
    model.sleep()
    model.wake_up()
    assert model.score(PROMPTS, RESPONSES) == before


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda tmp: tmp / "missing", "is not a Hugging Face model directory (no config.json)"),
        (lambda tmp: save_tiny_reward_model(tmp, num_labels=2), "scores 2 labels; a reward model gives one score"),
        (lambda tmp: causal_lm(tmp), "holds a LlamaForCausalLM model, not a sequence classifier"),
        (lambda tmp: without_tokenizer(save_tiny_reward_model(tmp)), "holds no tokenizer that loads"),
    ],
)
def test_a_directory_that_is_not_a_one_label_classifier_is_refused_naming_the_field(tmp_path, make, fragment):
    path = make(tmp_path)
    with pytest.raises(RewardModelError) as info:
        check_reward_model(str(path))
    message = str(info.value)
    assert message.startswith(f"reward.model.path {str(path)!r}") and fragment in message, message
    assert "\n" not in message


def causal_lm(directory):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(directory)
    return directory


def without_tokenizer(directory):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).unlink(missing_ok=True)
    return directory


def test_ppo_train_refuses_a_bad_reward_model_before_ray_starts(tmp_path, capsys):
    path = save_tiny_reward_model(tmp_path / "rm", num_labels=3)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"reward": {"type": "Model", "model": {"path": str(path)}}}))
    capsys.readouterr()  # what saving it printed
    assert main([str(job), "--run-dir", str(tmp_path / "run")]) == EXIT_CONFIG
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ppo-train: reward.model.path {str(path)!r} scores 3 labels"), line


def test_the_reward_models_residency_is_reported_in_the_offload_column():
    def poll():
        return [], {"actor": "Offloaded", "critic": "Offloaded", "rollout": "Asleep", "reward": "Asleep"}

    recorder = Recorder()
    tracker = ProgressTracker(reporter=recorder, poll=poll, total_steps=2, critic_only_steps=0, with_critic=True,
                              state=TrainerState(), attempt=0)
    tracker.stage(tracker.progress.stage, state=TrainerState())
    status = json.loads(json.dumps(recorder.progress[-1].to_status()))
    assert status["reward"] == "Asleep"
    assert status["offload"] == "actor=Offloaded critic=Offloaded rollout=Asleep reward=Asleep"


def test_the_rollout_worker_scores_with_the_reward_model_which_sleeps_with_the_engine(model_dir):
    spec = parse_spec({"image": "local", "seed": 1, "model": {"path": "builtin:tiny"}, "resources": {"gpusPerNode": 0},
                       "rollout": {"batchSize": 4, "maxNewTokens": 6},
                       "reward": {"type": "Model", "model": {"path": str(model_dir), "microBatchSize": 3}}})
    worker = RolloutWorker(spec, rank=0, device="cpu", weight_sync=OBJECT_STORE)
    prompts = [Prompt(text=f"question {i}: ") for i in range(4)]
    batch, stats = worker.generate(prompts, seed=5)
    assert batch.scores.tolist() == pytest.approx(worker.reward_model.score(batch.prompts, batch.responses), abs=1e-6)
    assert stats["reward_sum"] == pytest.approx(float(batch.scores.sum()))
    worker.sleep()
    assert (worker.state(), worker.reward_state()) == ("Asleep", "Asleep")
    worker.wake()  # the engine alone, as for a weight sync
    assert (worker.state(), worker.reward_state()) == ("Awake", "Asleep")
    again, _ = worker.generate(prompts, seed=5)
    assert again.scores.tolist() == batch.scores.tolist() and worker.reward_state() == "Awake"
    moves = [(t.role, t.from_state, t.to_state) for t in worker.drain_transitions()]
    assert moves == [("reward", "Awake", "Asleep"), ("rollout", "Awake", "Asleep"), ("rollout", "Asleep", "Awake"),
                     ("reward", "Asleep", "Awake")]
    assert RolloutWorker(parse_spec({"image": "local", "resources": {"gpusPerNode": 0}}), rank=0, device="cpu",
                         weight_sync=OBJECT_STORE).reward_state() is None
