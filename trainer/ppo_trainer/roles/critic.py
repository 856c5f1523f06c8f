"""The critic's rank: values before its update, K clipped-value-loss passes, values and returns handed on.

The critic is a model of its own (`critic.model`, `critic.backend`, `critic.microBatchSize`,
`critic.maxGradNorm`, `critic.parallelism`, the actor's where unset; its tokenizer must be the
actor's). It may start from a critic checkpoint (`critic.load`: each rank reads the file of its
model-parallel position, so data-parallel sizes may differ). Each micro-batch's value loss is
normalised by the whole batch's counts (`ppo.lossAggregation`), as the actor's policy loss is, so
the update does not depend on the micro-batch size or the number of ranks.

`train` returns two objects (the group asks Ray for two return refs): the `CriticValues` of this
rank's samples, which go as ObjectRefs to the actor ranks that hold the same samples
(`roles/handoff.py`), and a small metrics dict the driver reads. So the driver never fetches the
values. Targets come from `roles/targets.py` with the same KL-shaped rewards the actor uses: it
takes the actor's and the reference's log-probs of its samples from the actor ranks that hold
them, by sample id. Must
not depend on Ray.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ppo_trainer.algorithms import load_advantage_function, value_loss
from ppo_trainer.batch import RolloutBatch
from ppo_trainer.checkpoint import CheckpointManager, read_role_state, role_file
from ppo_trainer.models.tokenizer import check_same_tokenizer
from ppo_trainer.roles.base import RoleWorker, batch_size, take_rows
from ppo_trainer.roles.handoff import CriticValues, gather_rows, ranks_sharing_samples, shard_sample_ids
from ppo_trainer.roles.targets import compute_targets


def critic_checkpoint_dir(path: str) -> Path:
    """The directory of critic files `critic.load` names: itself, or its latest step directory."""
    directory = Path(path).expanduser()
    if role_file(directory, role="critic", rank=0).is_file():
        return directory
    latest = CheckpointManager(directory, keep=1).latest()
    if latest is not None and role_file(latest, role="critic", rank=0).is_file():
        return latest
    raise ValueError(
        f"critic.load {path!r} holds no critic checkpoint (no critic-rank0.pt in it or in a step-NNNNNNNN"
        " directory under it): give a checkpoint directory written with a critic, or the critic.save folder"
    )


class CriticWorker(RoleWorker):
    role = "critic"

    def __init__(self, spec, *, rank: int, world_size: int, device: str, offload: bool, shared_process: bool = False) -> None:
        if spec.critic.model is not None:
            check_same_tokenizer(spec.model, spec.training_role("critic").model)
        super().__init__(spec, rank=rank, world_size=world_size, device=device, offload=offload,
                         shared_process=shared_process)
        ref = spec.ppo.custom_advantage_function
        self.advantage_fn = load_advantage_function(ref) if ref else None

    def backend_built(self) -> None:
        if self.spec.critic.load is None:
            return
        directory = critic_checkpoint_dir(self.spec.critic.load)
        position = self.rank % self.training.model_parallel_size  # data ranks hold the same model
        state = read_role_state(directory, role="critic", rank=position)
        try:
            self.backend.load_state_dict(state["backend"])
        except (RuntimeError, ValueError, KeyError) as exc:
            model = self.spec.critic.model or self.spec.model.path
            raise ValueError(
                f"critic.load {str(directory)!r} does not fit the critic model {model!r} (critic.model,"
                f" default model.path): {type(exc).__name__}: {str(exc)[:300]}; load a checkpoint of the same model"
            ) from None

    def train(
        self, *inputs: RolloutBatch | torch.Tensor, actor_data_size: int, updates: int
    ) -> tuple[CriticValues, dict[str, float]]:
        """`inputs`: the engines' batch parts, then the actor's log-probs and then the reference's, of
        the actor data ranks that share this rank's samples (`ranks_sharing_samples` order, the
        actor having `actor_data_size` data ranks; Ray resolved the refs)."""
        parts = tuple(x for x in inputs if isinstance(x, RolloutBatch))
        log_probs = [x for x in inputs if isinstance(x, torch.Tensor)]
        batch, counts = self.training_batch(parts)
        ids = self.sample_ids(batch, parts)
        sources = ranks_sharing_samples(data_rank=self.data_rank, data_size=self.data_size,
                                        other_data_size=actor_data_size)
        if len(log_probs) != 2 * len(sources):
            raise ValueError(f"critic[{self.rank}]: {len(log_probs)} log-prob tensors for {len(sources)} actor ranks"
                             " (the actor's and the reference's of each)")
        total = batch_size(parts)
        source_ids = [shard_sample_ids(total, data_rank=a, data_size=actor_data_size) for a in sources]
        old_log_probs = gather_rows(list(zip(source_ids, log_probs[:len(sources)])), ids)
        ref_log_probs = gather_rows(list(zip(source_ids, log_probs[len(sources):])), ids)
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
                return v_loss, {"value_loss": v_loss, "value_clipfrac": stats["clipfrac"]}

            passes = [
                self.backend.train(batch, loss_fn, micro_batch_size=self.training.micro_batch_size)
                for _ in range(updates)
            ]
        metrics = {
            "value_loss": passes[0]["value_loss"],
            "value_loss_last": passes[-1]["value_loss"],
            "value_clipfrac": passes[-1]["value_clipfrac"],
            "value_mean": float((values * mask).sum() / mask.sum().clamp(min=1)),
            "kl": targets.kl,
        }
        output = CriticValues(sample_ids=ids, values=values, returns=targets.returns,
                              metrics=metrics)
        return output, metrics
