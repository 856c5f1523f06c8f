"""What the GPU tests share: small random Qwen2 checkpoints."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def random_qwen2(tmp_path_factory):
    """`random_qwen2(name, **shape)`: a Hugging Face directory of a Qwen2 with tied embeddings, `shape`'s
    sizes and weights drawn from seed 0."""

    def save(name: str, **shape):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        directory = tmp_path_factory.mktemp(name)
        Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True)).save_pretrained(str(directory))
        return directory

    return save
