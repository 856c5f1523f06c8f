"""The actor's rank: PPO policy updates on the critic's values, and handing its weights to the engines.

`train` receives the `CriticValues` of the critic ranks that hold this rank's samples (Ray resolved
the ObjectRefs before the task started; `roles/handoff.py` picks the rows by sample id, whatever
the two roles' data-parallel sizes), derives the same targets the critic used, checks the
returns agree, whitens the advantages over the whole batch (the ranks sum their moments) and
runs `ppo.epochs` clipped-policy-loss passes, each micro-batch's loss normalised by the whole
batch's counts (`ppo.lossAggregation`) and, with `ppo.rolloutCorrection`, reweighted by
truncated importance weights against the engine's log-probs (with `ppo.schedule` OneStepOverlap the
ratio itself is taken against the engine's log-probs: the batch may be one update old). `log_probs_and_mismatch` gives the
step's log-probs before the update and how far they are from the engine's. `send_weights` is
the one way its weights leave for the engines: the rank's `Sender`, built from the run's
weight-sync path (`weight_sync/`), sends them during the rank's turn, and its `wake` and `sleep`
hooks run right after the rank wakes and right before it sleeps (the broadcast path connects and
disconnects its group there). It is called on every rank (waking a multi-rank role is
collective). Must not depend on Ray except through the weight-sync path.
"""

from __future__ import annotations

import torch

from ppo_trainer.algorithms import (
    TOKEN_MEAN,
    aggregate_loss,
    load_advantage_function,
    log_prob_mismatch,
    masked_moments,
    masked_whiten,
    policy_loss,
    truncated_importance_weights,
)
from ppo_trainer.batch import RolloutBatch
from ppo_trainer.distributed import all_reduce_sum
from ppo_trainer.roles.base import RoleWorker, take_rows
from ppo_trainer.roles.handoff import CriticValues, gather_values
from ppo_trainer.roles.targets import check_same_returns, compute_targets
from ppo_trainer.weight_sync import Sender, weight_sync_path
from ppojob_api.vocabulary import RolloutCorrection, Schedule


class ActorWorker(RoleWorker):
    role = "actor"

    def __init__(
        self, spec, *, rank: int, world_size: int, device: str, offload: bool, weight_sync: str | None = None,
        rollout_workers: list | None = None, shared_process: bool = False,
    ) -> None:
        """`weight_sync`: the run's weight-sync path (`weight_sync.PATHS`; None: this rank sends
        nothing), `rollout_workers` the engines' Ray handles, in rank order."""
        self.sender = Sender()  # replaced below; sleep() during setup must see one
        super().__init__(spec, rank=rank, world_size=world_size, device=device, offload=offload,
                         shared_process=shared_process)
        ref = spec.ppo.custom_advantage_function
        self.advantage_fn = load_advantage_function(ref) if ref else None
        if weight_sync is not None:
            self.sender = weight_sync_path(weight_sync).sender(
                rank=rank, device=device, engines=list(rollout_workers or []), listener=self._transitions.append
            )
            if self.residency.awake:
                self.sender.wake()

    def wake(self) -> bool:
        changed = super().wake()
        self.sender.wake()
        return changed

    def sleep(self) -> bool:
        self.sender.sleep()
        return super().sleep()

    def log_probs_and_mismatch(self, *parts: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's log-probs of the sampled tokens before the update ([B_rank, T], as `log_probs`),
        and their mismatch with the engine's (`log_prob_mismatch` sums; the group asks Ray for two
        return refs, so the log-probs stay refs while the driver reads the sums)."""
        batch = self.shard(parts)
        with self.turn("compute log-probs"):
            log_probs = self.backend.forward(batch)["log_probs"]
        return log_probs, log_prob_mismatch(log_probs, batch.rollout_log_probs, batch.response_mask)

    def train(
        self,
        *inputs: RolloutBatch | CriticValues,
        old_log_probs: torch.Tensor,
        ref_log_probs: torch.Tensor,
        stay_awake: bool = False,
    ) -> dict[str, float]:
        """`inputs`: the engines' batch parts, then the `CriticValues` of the critic ranks that hold this
        rank's samples (none without a critic; Ray resolved the refs). `stay_awake`: the weight sync
        comes next and puts the rank to sleep when it is done (one offload and onload fewer per step)."""
        parts = tuple(x for x in inputs if isinstance(x, RolloutBatch))
        critic_outputs = [x for x in inputs if isinstance(x, CriticValues)]
        batch, counts = self.training_batch(parts)
        mask = batch.response_mask
        values, critic_returns = torch.zeros_like(mask), None
        if critic_outputs:
            values, critic_returns = gather_values(critic_outputs, self.sample_ids(batch, parts))
        ppo = self.spec.ppo
        targets = compute_targets(
            batch,
            values=values,
            old_log_probs=old_log_probs,
            ref_log_probs=ref_log_probs,
            ppo=ppo,
            advantage_fn=self.advantage_fn,
        )
        if critic_returns is not None:
            check_same_returns(targets.returns, critic_returns, function=ppo.custom_advantage_function)
        correction = ppo.rollout_correction
        weights = None
        if correction.type == RolloutCorrection.TRUNCATED_IMPORTANCE_SAMPLING:
            weights = truncated_importance_weights(old_log_probs, batch.rollout_log_probs, mask, cap=correction.cap)
        aggregation = ppo.loss_aggregation.value
        # OneStepOverlap: the engines sampled this batch with weights up to one update older than the
        # actor's; the PPO ratio is taken against that behaviour policy, their log-probs of their own tokens.
        behaviour_log_probs = batch.rollout_log_probs if ppo.schedule == Schedule.ONE_STEP_OVERLAP else old_log_probs

        def loss_fn(output: dict[str, torch.Tensor], rows: torch.Tensor):
            logp = output["log_probs"]
            rows_mask = take_rows(mask, rows, logp)
            pg_loss, stats = policy_loss(
                logp,
                take_rows(behaviour_log_probs, rows, logp),
                take_rows(advantages, rows, logp),
                rows_mask,
                clip_eps=ppo.clip_eps,
                clip_eps_high=ppo.clip_eps_high,
                dual_clip=ppo.dual_clip,
                aggregation=aggregation,
                counts=counts,
                token_weights=take_rows(weights, rows, logp) if weights is not None else None,
            )
            entropy = output["entropy"]
            entropy_term = aggregate_loss(entropy, rows_mask, mode=aggregation, counts=counts)
            loss = pg_loss - ppo.entropy_coef * entropy_term
            return loss, {
                "policy_loss": pg_loss,
                "clipfrac": stats["clipfrac"],
                "approx_kl": stats["approx_kl"],
                "entropy": aggregate_loss(entropy.detach(), rows_mask, mode=TOKEN_MEAN, counts=counts),
            }

        with self.turn("train", stay_awake=stay_awake):
            advantages = targets.advantages
            if ppo.normalize_advantages:
                # The whole batch's mean and variance: the moments of every rank's rows, summed (the
                # model-parallel ranks of one data rank repeat its rows, which leaves both unchanged).
                advantages = masked_whiten(advantages, mask, moments=all_reduce_sum(masked_moments(advantages, mask)))
            passes = [
                self.backend.train(batch, loss_fn, micro_batch_size=self.training.micro_batch_size)
                for _ in range(ppo.epochs)
            ]
            if stay_awake and self.offload:
                # The weight sync reads the weights alone: the optimizer state leaves before an engine
                # wakes beside them (Megatron's at 3B: 37 GB that would not leave room for it on 80 GB).
                self.backend.offload_optimizer_state()
        return {**passes[-1], "policy_loss": passes[0]["policy_loss"], "kl": targets.kl}

    def send_weights(self):
        """The policy's weights to the engines, by the run's weight-sync path; called on every rank at
        once. Returns what the path's driver side hands the engines, if anything."""
        with self.turn("send weights"):
            return self.sender.send(self.backend.named_weights())
