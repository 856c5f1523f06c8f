"""Prompts: chat prompts' readable text, synthetic prompts, resumable sampling (files: test_prompt_files.py)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from ppo_trainer.data import ChatMessage, Prompt, PromptSampler, synthetic_prompts


def test_a_chat_prompt_reads_as_its_messages_role_by_role():
    messages = [ChatMessage("system", "Answer with a number."), ChatMessage("user", "2+2?")]
    prompt = Prompt.chat(messages, label="4")
    assert prompt == Prompt(text="system: Answer with a number.\nuser: 2+2?", label="4", messages=tuple(messages))


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
