"""Prompt datasets: JSONL loading with located errors, synthetic prompts, resumable sampling."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from ppo_trainer.data import Prompt, PromptSampler, load_jsonl_prompts, synthetic_prompts


def write_lines(tmp_path, lines: list[str], name: str = "prompts.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


# --- JSONL -------------------------------------------------------------------------------------


def test_load_jsonl_prompts(tmp_path):
    path = write_lines(
        tmp_path,
        [
            json.dumps({"prompt": "2+2?", "label": "4"}),
            "",
            json.dumps({"prompt": "3*3?", "label": 9}),
            json.dumps({"prompt": "free text", "label": None}),
            json.dumps({"prompt": "no label"}),
        ],
    )
    assert load_jsonl_prompts(path) == [
        Prompt("2+2?", "4"),
        Prompt("3*3?", "9"),
        Prompt("free text", None),
        Prompt("no label", None),
    ]


def test_load_jsonl_prompts_custom_keys(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"question": "q", "answer": "#### 1"})])
    assert load_jsonl_prompts(path, prompt_key="question", label_key="answer") == [Prompt("q", "#### 1")]


def test_load_jsonl_bad_json_names_file_and_line(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"prompt": "ok"}), "{not json"])
    with pytest.raises(ValueError, match=rf"{path}:2: invalid JSON"):
        load_jsonl_prompts(path)


def test_load_jsonl_missing_key_names_file_line_and_keys(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"prompt": "ok"}), json.dumps({"question": "q"})])
    with pytest.raises(
        ValueError, match=rf"{path}:2: missing key 'prompt' \(keys: \['question'\]\); set prompt_key"
    ):
        load_jsonl_prompts(path)


@pytest.mark.parametrize(
    "line,message",
    [
        ("[1, 2]", r":1: expected a JSON object, got list"),
        (json.dumps({"prompt": 3}), r":1: 'prompt' must be a string, got int"),
        (json.dumps({"prompt": "p", "label": ["a"]}), r":1: 'label' must be a string or a number, got list"),
    ],
)
def test_load_jsonl_bad_records(tmp_path, line, message):
    with pytest.raises(ValueError, match=message):
        load_jsonl_prompts(write_lines(tmp_path, [line]))


def test_load_jsonl_empty_and_missing_files(tmp_path):
    with pytest.raises(ValueError, match="no prompts"):
        load_jsonl_prompts(write_lines(tmp_path, [""]))
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        load_jsonl_prompts(tmp_path / "absent.jsonl")


# --- synthetic prompts -------------------------------------------------------------------------


def test_synthetic_prompts_are_reproducible_and_varied():
    a, b = synthetic_prompts(50, seed=1), synthetic_prompts(50, seed=1)
    assert a == b
    assert a != synthetic_prompts(50, seed=2)
    assert len({p.text for p in a}) > 40
    assert all(p.label == "a" and "a" in p.text for p in a)
    assert all(p.label == "z" for p in synthetic_prompts(3, seed=0, target="z"))


def test_synthetic_prompts_rejects_zero():
    with pytest.raises(ValueError, match="n=0 must be >= 1"):
        synthetic_prompts(0, seed=0)


# --- sampler -----------------------------------------------------------------------------------


def numbered(n: int) -> list[Prompt]:
    return [Prompt(text=str(i)) for i in range(n)]


def take(sampler: PromptSampler, k: int) -> list[list[str]]:
    return [[p.text for p in sampler.next_batch()] for _ in range(k)]


def test_sampler_is_deterministic_from_seed():
    assert take(PromptSampler(numbered(10), 3, seed=7), 8) == take(PromptSampler(numbered(10), 3, seed=7), 8)
    assert take(PromptSampler(numbered(10), 3, seed=7), 8) != take(PromptSampler(numbered(10), 3, seed=8), 8)


def test_sampler_visits_every_prompt_once_per_epoch_and_batches_are_full():
    sampler = PromptSampler(numbered(10), 4, seed=0)
    batches = take(sampler, 5)  # 20 prompts = exactly 2 epochs
    assert all(len(b) == 4 for b in batches)
    flat = [x for b in batches for x in b]
    assert Counter(flat[:10]) == Counter(map(str, range(10)))
    assert Counter(flat[10:]) == Counter(map(str, range(10)))
    assert flat[:10] != flat[10:]  # each epoch has its own order
    assert sampler.state_dict()["epoch"] == 2 and sampler.state_dict()["position"] == 0


def test_sampler_without_shuffle_keeps_file_order_and_wraps():
    sampler = PromptSampler(numbered(3), 2, seed=0, shuffle=False)
    assert take(sampler, 3) == [["0", "1"], ["2", "0"], ["1", "2"]]


def test_sampler_batch_larger_than_dataset():
    batch = PromptSampler(numbered(3), 7, seed=0).next_batch()
    assert len(batch) == 7


def test_sampler_is_an_iterator():
    sampler = PromptSampler(numbered(5), 2, seed=3)
    first = next(iter(sampler))
    assert len(first) == 2


@pytest.mark.parametrize("steps_before", [0, 1, 3, 7])
def test_sampler_resume_from_state_gives_exactly_the_next_batches(steps_before):
    prompts = numbered(11)
    uninterrupted = PromptSampler(prompts, 4, seed=5)
    take(uninterrupted, steps_before)
    state = json.loads(json.dumps(uninterrupted.state_dict()))  # survives a JSON checkpoint

    resumed = PromptSampler(prompts, 4, seed=5)
    resumed.load_state_dict(state)
    assert take(resumed, 6) == take(uninterrupted, 6)


def test_sampler_rejects_state_of_another_dataset_or_seed():
    state = PromptSampler(numbered(10), 2, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"saved with num_prompts=10 but this sampler has num_prompts=9"):
        PromptSampler(numbered(9), 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved with seed=1 but this sampler has seed=2"):
        PromptSampler(numbered(10), 2, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"missing epoch, position"):
        PromptSampler(numbered(10), 2, seed=1).load_state_dict(
            {"seed": 1, "shuffle": True, "num_prompts": 10}
        )
    with pytest.raises(ValueError, match=r"position=10"):
        PromptSampler(numbered(10), 2, seed=1).load_state_dict({**state, "position": 10})


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptSampler([], 2, seed=0)
    with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
        PromptSampler(numbered(3), 0, seed=0)
