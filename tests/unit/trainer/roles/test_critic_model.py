"""The critic as a model of its own: its settings default to the actor's, its values go to the actor
by sample id (pure functions), its tokenizer must be the actor's, and critic.load starts it from a
saved critic bit for bit. In-process, on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from ppo_trainer.checkpoint import CheckpointManager, TrainerState
from ppo_trainer.roles.critic import CriticWorker
from ppo_trainer.roles.handoff import CriticValues, gather_rows, gather_values, ranks_sharing_samples, shard_sample_ids
from ppojob_api.spec import parse_spec
from ppojob_api.vocabulary import TrainBackend


def make_spec(**critic):
    return parse_spec({
        "image": "local", "seed": 1, "model": {"path": "builtin:tiny"},
        "actor": {"learningRate": 1e-2, "microBatchSize": 4, "maxGradNorm": 0.5,
                  "parallelism": {"tensor": 1, "pipeline": 1}},
        "critic": critic,
    })


def test_critic_settings_default_to_the_actors():
    critic = make_spec().training_role("critic")
    actor = make_spec().training_role("actor")
    assert critic.model == actor.model and critic.backend == actor.backend == TrainBackend.TORCH
    assert (critic.micro_batch_size, critic.max_grad_norm, critic.tensor, critic.pipeline, critic.data) == (4, 0.5, 1, 1, None)
    assert critic.learning_rate == actor.learning_rate and critic.field == "critic" and actor.field == "actor"


def test_critic_settings_set_are_its_own():
    critic = make_spec(model="builtin:tiny-narrow", backend="Megatron", microBatchSize=2, maxGradNorm=0.0,
                       learningRate=3e-3, parallelism={"tensor": 2, "data": 1}).training_role("critic")
    assert (critic.model.path, critic.backend, critic.micro_batch_size, critic.max_grad_norm, critic.learning_rate) == (
        "builtin:tiny-narrow", TrainBackend.MEGATRON, 2, 0.0, 3e-3)
    assert (critic.tensor, critic.pipeline, critic.data, critic.model_parallel_size) == (2, 1, 1, 2)


@pytest.mark.parametrize(
    ("actor_size", "critic_size", "expected"),
    [(2, 2, [[0], [1]]), (2, 1, [[0], [0]]), (1, 2, [[0, 1]]), (2, 4, [[0, 2], [1, 3]]), (2, 3, [[0, 1, 2], [0, 1, 2]])],
)
def test_ranks_sharing_samples_are_the_critic_ranks_holding_an_actor_ranks_samples(actor_size, critic_size, expected):
    got = [ranks_sharing_samples(data_rank=a, data_size=actor_size, other_data_size=critic_size)
           for a in range(actor_size)]
    assert got == expected
    for a, sources in enumerate(got):  # exactly the critic ranks that hold one of its samples, for a large batch
        held = {s % critic_size for s in shard_sample_ids(60, data_rank=a, data_size=actor_size).tolist()}
        assert held == set(sources)


def critic_outputs(batch_size: int, critic_size: int, width: int = 5) -> list[CriticValues]:
    g = torch.Generator().manual_seed(batch_size * 7 + critic_size)
    outputs = []
    for c in range(critic_size):
        ids = shard_sample_ids(batch_size, data_rank=c, data_size=critic_size)
        outputs.append(CriticValues(sample_ids=ids, values=torch.randn(len(ids), width, generator=g),
                                    returns=torch.randn(len(ids), width, generator=g)))
    return outputs


@pytest.mark.parametrize(("actor_size", "critic_size"), [(2, 1), (1, 2), (2, 3), (3, 2), (2, 2)])
def test_gather_values_takes_each_samples_bits_from_the_critic_rank_holding_it(actor_size, critic_size):
    outputs = critic_outputs(11, critic_size)
    for a in range(actor_size):
        ids = shard_sample_ids(11, data_rank=a, data_size=actor_size)
        sources = ranks_sharing_samples(data_rank=a, data_size=actor_size, other_data_size=critic_size)
        values, returns = gather_values([outputs[c] for c in sources], ids)
        for row, sample in enumerate(ids.tolist()):
            owner = outputs[sample % critic_size]
            at = owner.sample_ids.tolist().index(sample)
            assert torch.equal(values[row].view(torch.int32), owner.values[at].view(torch.int32))
            assert torch.equal(returns[row].view(torch.int32), owner.returns[at].view(torch.int32))


def test_a_critic_rank_takes_the_actor_log_probs_of_its_samples():
    """Actor 2 ranks, critic 1: the critic's rows from both actor ranks' tensors, by sample id."""
    log_probs = torch.randn(7, 3)
    sources = [(shard_sample_ids(7, data_rank=a, data_size=2), log_probs[a::2]) for a in range(2)]
    assert torch.equal(gather_rows(sources, torch.arange(7)), log_probs)


def test_gather_values_names_the_samples_it_lacks():
    outputs = critic_outputs(6, 2)
    with pytest.raises(ValueError, match=r"but not \[1, 3, 5\]: the actor and the critic sharded different batches"):
        gather_values([outputs[0]], torch.arange(6))


def ragged_batch(rows: int = 6):
    from ppo_trainer.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    width, response = 4, 5
    tokens = torch.randint(0, 256, (rows, width + response), generator=g)
    mask = torch.ones(rows, response)
    mask[::2, 3:] = 0
    attention = torch.cat([torch.ones(rows, width, dtype=torch.long), mask.long()], dim=1)
    return RolloutBatch(tokens=tokens, attention_mask=attention, response_mask=mask, prompt_length=width,
                        rollout_log_probs=-torch.rand(rows, response, generator=g) * mask,
                        scores=torch.rand(rows, generator=g))


def train_once(worker: CriticWorker) -> None:
    batch = ragged_batch()
    zeros = torch.zeros_like(batch.response_mask)
    worker.train(batch, zeros, zeros, actor_data_size=1, updates=1)


def test_a_critic_of_another_size_than_the_actor():
    worker = CriticWorker(make_spec(model="builtin:tiny-narrow"), rank=0, world_size=1, device="cpu", offload=False)
    trunk = worker.backend.model.trunk
    assert (trunk.config.hidden_size, trunk.config.num_hidden_layers) == (32, 1)  # builtin:tiny is 64 x 2
    output, metrics = worker.train(ragged_batch(), torch.zeros(6, 5), torch.zeros(6, 5), actor_data_size=1, updates=1)
    assert output.values.shape == (6, 5) and metrics["value_loss"] > 0


@pytest.mark.parametrize("from_root", [False, True])
def test_critic_load_starts_from_the_saved_critic_bit_for_bit(tmp_path, from_root):
    trained = CriticWorker(make_spec(model="builtin:tiny-narrow"), rank=0, world_size=1, device="cpu", offload=False)
    train_once(trained)
    manager = CheckpointManager(tmp_path, keep=2)
    temp = manager.begin(3)
    trained.save(str(temp))
    step_dir = manager.commit(temp, TrainerState(step=3))
    source = tmp_path if from_root else step_dir

    loaded = CriticWorker(make_spec(model="builtin:tiny-narrow", load=str(source)), rank=0, world_size=1,
                          device="cpu", offload=False)
    fresh = CriticWorker(make_spec(model="builtin:tiny-narrow"), rank=0, world_size=1, device="cpu", offload=False)
    want, got = trained.backend.state_dict(), loaded.backend.state_dict()
    head = "value_head.weight"
    assert not torch.equal(want["model"][head], fresh.backend.state_dict()["model"][head])  # training moved it
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    assert json.loads((step_dir / "trainer.json").read_text())["step"] == 3


def test_critic_load_of_another_model_is_refused_naming_both(tmp_path):
    trained = CriticWorker(make_spec(), rank=0, world_size=1, device="cpu", offload=False)
    trained.save(str(tmp_path))
    with pytest.raises(ValueError, match=r"critic.load .* does not fit the critic model 'builtin:tiny-narrow'"):
        CriticWorker(make_spec(model="builtin:tiny-narrow", load=str(tmp_path)), rank=0, world_size=1,
                     device="cpu", offload=False)


def test_critic_load_without_a_critic_checkpoint_says_what_it_needs(tmp_path):
    with pytest.raises(ValueError, match="holds no critic checkpoint"):
        CriticWorker(make_spec(load=str(tmp_path)), rank=0, world_size=1, device="cpu", offload=False)


def hf_model_dir(tmp_path):
    """A local Hugging Face directory: a tiny Llama config and a word-level tokenizer of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{w: i + 3 for i, w in enumerate(["the", "cat", "sat", "on", "a", "mat"])}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", pad_token="<pad>", bos_token="<s>")
    tokenizer.save_pretrained(tmp_path)
    LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    return tmp_path


def test_a_critic_with_another_tokenizer_is_refused_naming_both(tmp_path):
    directory = hf_model_dir(tmp_path)
    with pytest.raises(ValueError, match=r"critic.model .* has another tokenizer than the actor's .*builtin:tiny"):
        CriticWorker(make_spec(model=str(directory)), rank=0, world_size=1, device="cpu", offload=False)


def test_a_critic_directory_without_a_tokenizer_reads_model_tokenizer_or_is_refused(tmp_path):
    from transformers import LlamaConfig

    from ppo_trainer.models.tokenizer import check_same_tokenizer
    from ppojob_api.spec import ModelSpec

    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    critic = ModelSpec(path=str(tmp_path))
    check_same_tokenizer(ModelSpec(path="builtin:tiny", tokenizer="builtin:tiny"), critic)
    with pytest.raises(ValueError, match=r"critic.model .* holds no tokenizer .* set model.tokenizer"):
        check_same_tokenizer(ModelSpec(path="builtin:tiny"), critic)
