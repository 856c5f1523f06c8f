"""One PPO step is the same on 1 and on 2 data-parallel ranks, whatever the micro-batch size.

Two CPU ranks per role through Ray (gloo), micro-batches of 1 row, against one rank in this
process with the whole batch as one micro-batch; builtin:tiny on a batch of ragged responses,
advantages whitened, the entropy bonus on and truncated importance sampling against the batch's
rollout log-probs. The gradient of every optimizer step of the actor (2 epochs) and of the
critic is recorded on each rank (the product's optimizer step is wrapped through
`__ray_call__`), as is the rollout/training mismatch the ranks report.
"""

from __future__ import annotations

import ray
import torch
from trainer_specs import tiny_spec

from ppo_trainer.algorithms import summarize_mismatch
from ppo_trainer.roles.actor import ActorWorker
from ppo_trainer.roles.build import build_roles, compute_layout
from ppo_trainer.roles.critic import CriticWorker
from ppo_trainer.roles.ref import RefWorker

ROWS, RESPONSE = 8, 8  # the ragged_batch fixture's


def split_spec(micro_batch_size: int):
    return tiny_spec(
        actor={"microBatchSize": micro_batch_size, "maxGradNorm": 0.0},
        rollout={"batchSize": ROWS, "maxNewTokens": RESPONSE},
        ppo={"epochs": 2, "klCoef": 0.05, "entropyCoef": 0.01,
             "rolloutCorrection": {"type": "TruncatedImportanceSampling", "cap": 2.0}},
    )


def gradient_recorders():
    """(record, recorded): `record(worker)` wraps the worker's optimizer step so that each step's
    reduced gradient is kept; `recorded(worker)` returns them. Defined in a function so that Ray
    pickles them by value (the ranks cannot import this test module)."""

    def record(worker) -> None:
        worker.recorded_gradients = []
        step = worker.backend.optimizer.step

        def record_then_step():
            params = worker.backend.model.parameters()
            worker.recorded_gradients.append(torch.cat([p.grad.reshape(-1).clone() for p in params]))
            step()

        worker.backend.optimizer.step = record_then_step

    def recorded(worker) -> list[torch.Tensor]:
        return worker.recorded_gradients

    return record, recorded


def single_rank_step(spec, batch):
    workers = {cls.role: cls(spec, rank=0, world_size=1, device="cpu", offload=False)
               for cls in (ActorWorker, CriticWorker, RefWorker)}
    actor, critic, ref = workers["actor"], workers["critic"], workers["ref"]
    record, _ = gradient_recorders()
    record(actor)
    record(critic)
    old, mismatch = actor.log_probs_and_mismatch(batch)
    ref_lp = ref.log_probs(batch)
    values, _ = critic.train(batch, old, ref_lp, actor_data_size=1, updates=1)
    actor.train(batch, values, old_log_probs=old, ref_log_probs=ref_lp)
    return {"actor": actor.recorded_gradients, "critic": critic.recorded_gradients}, summarize_mismatch([mismatch])


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_one_step_on_two_ranks_of_micro_batch_one_equals_one_rank_on_the_whole_batch(ray_session, ragged_batch):
    batch = ragged_batch
    spec = split_spec(micro_batch_size=1)
    record, recorded = gradient_recorders()
    roles = build_roles(spec, compute_layout(spec, use_gpus=False, cpu_ranks=2), timeout=120)
    try:
        for group in (roles.actor, roles.critic):
            ray.get([h.__ray_call__.remote(record) for h in group.handles])
        old, mismatch = roles.actor.async_call(roles.actor.worker_class.log_probs_and_mismatch, batch, num_returns=2)
        ray.wait(old, num_returns=len(old))
        ref_lp = roles.ref.async_call(roles.ref.worker_class.log_probs, batch)
        ray.wait(ref_lp, num_returns=len(ref_lp))
        values, _ = roles.critic.async_call(roles.critic.worker_class.train, batch, spread=roles.log_probs_for_critic(old, ref_lp), actor_data_size=roles.layout.actor.data, updates=1, num_returns=2)
        ray.get(roles.actor.async_call(roles.actor.worker_class.train, batch, old_log_probs=old, ref_log_probs=ref_lp, spread=roles.values_for_actor(values)))
        parallel = {role: ray.get([h.__ray_call__.remote(recorded) for h in getattr(roles, role).handles])
                    for role in ("actor", "critic")}
        parallel_mismatch = summarize_mismatch(ray.get(list(mismatch)))
    finally:
        roles.shutdown()

    single, single_mismatch = single_rank_step(split_spec(micro_batch_size=ROWS), batch)
    for role, steps in (("actor", 2), ("critic", 1)):
        assert len(single[role]) == steps
        for rank in (0, 1):
            assert len(parallel[role][rank]) == steps
            for step in range(steps):
                # Measured 3e-7 (first steps) and 3e-6 (the actor's second, after an Adam step in float32).
                difference = relative_difference(parallel[role][rank][step], single[role][step])
                assert difference < 1e-5, f"{role}[{rank}] step {step}: {difference:.2e}"
    for key, value in single_mismatch.items():
        assert abs(parallel_mismatch[key] - value) <= 1e-6 * max(1.0, abs(value)), key
    assert single_mismatch["rollout_k3"] > 0.1  # the batch's rollout log-probs are far from the model's
