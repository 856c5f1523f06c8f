"""The critic's rank: values before its update, K clipped-value-loss passes, values and returns handed on.

Each micro-batch's value loss is normalised by the whole batch's counts (`ppo.lossAggregation`),
as the actor's policy loss is, so the update does not depend on the micro-batch size or the
number of ranks.

`train` returns two objects (the group asks Ray for two return refs): the `CriticOutput` that
goes, as an ObjectRef, to the same rank of the actor, and a small metrics dict the driver reads.
So the driver never fetches the values. Targets come from `roles/targets.py` with the same
KL-shaped rewards the actor uses. Must not depend on Ray.
"""

from __future__ import annotations

import torch

from ppo_trainer.algorithms import load_advantage_function, value_loss
from ppo_trainer.batch import CriticOutput, RolloutBatch
from ppo_trainer.roles.base import RoleWorker, take_rows
from ppo_trainer.roles.targets import compute_targets


class CriticWorker(RoleWorker):
    role = "critic"

    def __init__(self, spec, *, rank: int, world_size: int, device: str, offload: bool, shared_process: bool = False) -> None:
        super().__init__(spec, rank=rank, world_size=world_size, device=device, offload=offload,
                         shared_process=shared_process)
        ref = spec.ppo.custom_advantage_function
        self.advantage_fn = load_advantage_function(ref) if ref else None

    def train(
        self, *parts: RolloutBatch, old_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, updates: int
    ) -> tuple[CriticOutput, dict[str, float]]:
        batch, counts = self.training_batch(parts)
        mask = batch.response_mask
        clip_range = self.spec.ppo.value_clip or None
        aggregation = self.spec.ppo.loss_aggregation.value
        with self.turn("train"):
            values = self.backend.forward(batch)["values"].detach().to("cpu", torch.float32)
            targets = compute_targets(
                batch,
                values=values,
                old_log_probs=old_log_probs,
                ref_log_probs=ref_log_probs,
                ppo=self.spec.ppo,
                advantage_fn=self.advantage_fn,
            )

            def loss_fn(output: dict[str, torch.Tensor], rows: torch.Tensor):
                v = output["values"]
                v_loss, stats = value_loss(
                    v, take_rows(values, rows, v), take_rows(targets.returns, rows, v), take_rows(mask, rows, v),
                    clip_range=clip_range, aggregation=aggregation, counts=counts,
                )
                return v_loss, {"value_loss": float(v_loss.detach()), "value_clipfrac": float(stats["clipfrac"])}

            passes = [
                self.backend.train(batch, loss_fn, micro_batch_size=self.spec.actor.micro_batch_size)
                for _ in range(updates)
            ]
        metrics = {
            "value_loss": passes[0]["value_loss"],
            "value_loss_last": passes[-1]["value_loss"],
            "value_clipfrac": passes[-1]["value_clipfrac"],
            "value_mean": float((values * mask).sum() / mask.sum().clamp(min=1)),
            "kl": targets.kl,
        }
        output = CriticOutput(rank=self.rank, values=values, returns=targets.returns, metrics=metrics)
        return output, metrics
