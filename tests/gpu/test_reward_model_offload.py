"""The reward model on a CUDA device: sleeping parks its weights in host memory and gives their device
memory back; waking brings them back and every score is bit-identical."""

from __future__ import annotations

import pytest
import torch
from tests.fixtures.tiny_reward_model import save_tiny_reward_model

from ppo_trainer.reward_model import RewardModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sleep_parks_the_weights_on_the_host_and_wake_keeps_the_scores(tmp_path, dtype):
    model = RewardModel(str(save_tiny_reward_model(tmp_path)), device="cuda", dtype=dtype, micro_batch_size=2,
                        max_length=64)
    prompts, responses = ["What is 2+2?", "Name a colour.", "x"], ["4", "blue, I think", ""]
    before = model.score(prompts, responses)
    held = torch.cuda.memory_allocated()
    model.sleep()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.model.parameters())
    assert torch.cuda.memory_allocated() < held
    model.wake_up()
    assert all(p.device.type == "cuda" for p in model.model.parameters())
    assert model.score(prompts, responses) == before
