"""One PPO step does not depend on the micro-batch size: the actor's and the critic's update through
the role classes and the Torch backend, on builtin:tiny with ragged responses, in-process."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.batch import RolloutBatch
from ppo_trainer.roles.actor import ActorWorker
from ppo_trainer.roles.critic import CriticWorker
from ppo_trainer.roles.handoff import CriticValues
from ppojob_api.spec import parse_spec

AGGREGATIONS = ["TokenMean", "SequenceMeanTokenMean", "SequenceMeanTokenSum"]


def make_spec(micro_batch_size: int, aggregation: str, **ppo):
    return parse_spec({
        "image": "local", "seed": 1, "model": {"path": "builtin:tiny"},
        "actor": {"learningRate": 1e-2, "microBatchSize": micro_batch_size, "maxGradNorm": 0.0},
        "ppo": {"numRollouts": 1, "epochs": 2, "klCoef": 0.05, "entropyCoef": 0.01,
                "lossAggregation": aggregation, **ppo},
    })


def one_step(spec, batch: RolloutBatch) -> dict[str, list[torch.Tensor]]:
    """Every optimizer step's gradient (critic: 1 update; actor: 2 epochs) and the parameters after."""
    actor = ActorWorker(spec, rank=0, world_size=1, device="cpu", offload=False)
    critic = CriticWorker(spec, rank=0, world_size=1, device="cpu", offload=False)
    grads: dict[str, list[torch.Tensor]] = {"actor": [], "critic": []}
    for role, worker in (("actor", actor), ("critic", critic)):
        step = worker.backend.optimizer.step

        def record_then_step(worker=worker, role=role, step=step):
            grads[role].append(torch.cat([p.grad.reshape(-1).clone() for p in worker.backend.model.parameters()]))
            step()

        worker.backend.optimizer.step = record_then_step
    old = actor.log_probs(batch)
    ref = old + 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * batch.response_mask
    output, _ = critic.train(batch, old, ref, actor_data_size=1, updates=1)
    assert isinstance(output, CriticValues) and output.sample_ids.tolist() == list(range(batch.size))
    actor.train(batch, output, old_log_probs=old, ref_log_probs=ref)
    for role, worker in (("actor", actor), ("critic", critic)):
        grads[role].append(torch.cat([p.detach().reshape(-1) for p in worker.backend.model.parameters()]))
    return grads


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_one_step_is_the_same_for_micro_batches_of_1_4_and_the_whole_batch(aggregation, ragged_batch):
    batch = ragged_batch
    whole = one_step(make_spec(batch.size, aggregation), batch)
    for micro_batch_size in (1, 4):
        split = one_step(make_spec(micro_batch_size, aggregation), batch)
        for role in ("actor", "critic"):
            *gradients, parameters = split[role]
            *expected_gradients, expected_parameters = whole[role]
            # Each optimizer step's gradient: measured 2e-7 to 4e-7 (first step) and 2e-6 to 4e-6 (the
            # second, after an Adam step in float32); the code that weighted micro-batch means by
            # their rows was 1.1 away at micro-batch 1.
            for index, (got, expected) in enumerate(zip(gradients, expected_gradients, strict=True)):
                assert relative_difference(got, expected) < 1e-5, f"{role} step {index} at micro-batch {micro_batch_size}"
            # Adam turns round-off in a near-zero gradient entry into a step of up to lr: measured
            # 1e-6 to 1.5e-5 relative (one entry of 1e5 off by 2.6e-4).
            assert relative_difference(parameters, expected_parameters) < 1e-4, f"{role} at micro-batch {micro_batch_size}"


def test_the_aggregation_modes_give_different_updates(ragged_batch):
    """The three modes are different losses (a test that could not tell them apart would prove nothing)."""
    batch = ragged_batch
    actor_gradients = [one_step(make_spec(batch.size, mode), batch)["actor"][0] for mode in AGGREGATIONS]
    for i in range(len(AGGREGATIONS)):
        for j in range(i):
            assert relative_difference(actor_gradients[i], actor_gradients[j]) > 1e-2


def test_truncated_importance_sampling_changes_the_update_and_stays_split_invariant(ragged_batch):
    batch = ragged_batch
    tis = {"rolloutCorrection": {"type": "TruncatedImportanceSampling", "cap": 2.0}}
    plain = one_step(make_spec(batch.size, "TokenMean"), batch)["actor"][0]
    whole = one_step(make_spec(batch.size, "TokenMean", **tis), batch)["actor"]
    split = one_step(make_spec(1, "TokenMean", **tis), batch)["actor"]
    assert relative_difference(whole[0], plain) > 1e-2
    for index, (got, expected) in enumerate(zip(split[:-1], whole[:-1], strict=True)):
        assert relative_difference(got, expected) < 1e-5, f"step {index}"
