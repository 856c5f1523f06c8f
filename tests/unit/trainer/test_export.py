"""The Hugging Face export: what transformers loads from it equals what was exported, in the asked
dtype, tied embeddings included; a directory appears whole or not at all."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from ppo_trainer.backends.build import build_backend
from ppo_trainer.export import (
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    ExportError,
    export_name,
    export_source,
    write_export,
)
from ppo_trainer.models import build_policy
from ppojob_api.spec import ModelSpec, parse_spec

TOKENS = torch.tensor([[256, 72, 105, 33, 10, 200, 3, 257]])


def tiny_source():
    return export_source(ModelSpec(path="builtin:tiny"))


def tiny_policy(seed: int = 0):
    return build_policy(ModelSpec(path="builtin:tiny"), seed=seed, device="cpu").eval()


def logits_of(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def test_names_say_the_step_or_the_end():
    assert export_name(7) == "step-00000007" and export_name(None) == "final"


def test_the_export_of_the_tiny_policy_loads_as_a_causal_lm_with_the_same_logits(tmp_path):
    policy = tiny_policy()
    path = write_export(tmp_path / "final", policy.named_parameters(), source=tiny_source(), dtype=torch.float32)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "generation_config.json", WEIGHTS_FILE]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    generation = json.loads((path / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (256, 257)  # the byte tokenizer's
    loaded = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    torch.testing.assert_close(logits_of(loaded), logits_of(policy), atol=1e-6, rtol=0)


def test_bfloat16_export_holds_bfloat16_weights_and_says_so(tmp_path):
    policy = tiny_policy()
    path = write_export(tmp_path / "x", policy.named_parameters(), source=tiny_source(), dtype=torch.bfloat16)
    with safe_open(str(path / WEIGHTS_FILE), "pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.bfloat16}  # noqa: SIM118 (not a dict)
        assert torch.equal(f.get_tensor("lm_head.weight"), policy.lm_head.weight.detach().bfloat16())
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.fixture
def tied_source_dir(tmp_path):
    """A Hugging Face directory of a Llama with tied embeddings, a word-level tokenizer and a generation config."""
    directory = tmp_path / "source"
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 16)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(str(directory))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.7}))
    return directory


def test_tied_embeddings_round_trip_with_the_source_s_tokenizer_and_generation_config(tmp_path, tied_source_dir):
    model_spec = ModelSpec(path=str(tied_source_dir))
    policy = build_policy(model_spec, seed=0, device="cpu").eval()
    with torch.no_grad():
        policy.model.embed_tokens.weight.add_(0.5)  # trained: no longer what the source holds
    names = [name for name, _ in policy.named_parameters()]
    assert "lm_head.weight" not in names  # tied: the embedding is the output layer's one weight
    path = write_export(tmp_path / "out" / "final", policy.named_parameters(), source=export_source(model_spec),
                        dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    tokens = torch.tensor([[1, 5, 9, 3, 2]])
    torch.testing.assert_close(logits_of(loaded, tokens), logits_of(policy, tokens), atol=1e-6, rtol=0)
    copied = {p.name for p in path.iterdir()} & set(TOKENIZER_FILES)
    assert copied and all((path / n).read_bytes() == (tied_source_dir / n).read_bytes() for n in copied)
    assert AutoTokenizer.from_pretrained(str(path)).encode("w5 w9") == [5, 9]
    assert json.loads((path / "generation_config.json").read_text())["temperature"] == 0.7


def test_the_critic_exports_as_a_token_classifier_whose_logits_are_its_values(tmp_path):
    spec = parse_spec({"image": "local", "seed": 3, "actor": {"compile": False}})
    critic = build_backend(spec, role="critic", device="cpu")
    source = export_source(spec.model, value_model=True)
    path = write_export(tmp_path / "critic" / "final", critic.named_weights(), source=source, dtype=torch.float32)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", WEIGHTS_FILE]
    loaded = AutoModelForTokenClassification.from_pretrained(str(path)).eval()
    assert loaded.config.num_labels == 1 and loaded.config.architectures == ["LlamaForTokenClassification"]
    with torch.no_grad():
        values = critic.model(input_ids=TOKENS)
        torch.testing.assert_close(loaded(input_ids=TOKENS).logits[..., 0], values, atol=1e-6, rtol=0)


def test_weights_that_do_not_make_the_model_are_refused_and_nothing_is_written(tmp_path):
    weights = dict(tiny_policy().named_parameters())
    del weights["model.norm.weight"]
    with pytest.raises(ExportError, match=r"missing \['model.norm.weight'\]"):
        write_export(tmp_path / "final", weights.items(), source=tiny_source(), dtype=torch.float32)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_the_previous_export_whole_and_no_temp(tmp_path, monkeypatch):
    first = tiny_policy(seed=1)
    path = write_export(tmp_path / "final", first.named_parameters(), source=tiny_source(), dtype=torch.float32)
    before = (path / WEIGHTS_FILE).read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("ppo_trainer.export.save_file", fail)
    with pytest.raises(OSError, match="disk full"):
        write_export(path, tiny_policy(seed=2).named_parameters(), source=tiny_source(), dtype=torch.float32)
    assert [p.name for p in tmp_path.iterdir()] == ["final"] and (path / WEIGHTS_FILE).read_bytes() == before


def test_a_new_export_replaces_an_older_one_of_the_same_name_whole(tmp_path):
    write_export(tmp_path / "final", tiny_policy(seed=1).named_parameters(), source=tiny_source(), dtype=torch.float32)
    (tmp_path / "final" / "stale.txt").write_text("from the older export")
    newer = tiny_policy(seed=2)
    path = write_export(tmp_path / "final", newer.named_parameters(), source=tiny_source(), dtype=torch.float32)
    assert [p.name for p in tmp_path.iterdir()] == ["final"] and not (path / "stale.txt").exists()
    torch.testing.assert_close(logits_of(AutoModelForCausalLM.from_pretrained(str(path))), logits_of(newer))
