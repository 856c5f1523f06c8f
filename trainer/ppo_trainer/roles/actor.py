"""The actor's rank: PPO policy updates on the critic's values, and handing its weights to the engines.

`train` receives the `CriticValues` of the critic ranks that hold this rank's samples (Ray resolved
the ObjectRefs before the task started; `roles/handoff.py` picks the rows by sample id, whatever
the two roles' data-parallel sizes), derives the same targets the critic used, checks the
returns agree, whitens the advantages over the whole batch (the ranks sum their moments) and
runs `ppo.epochs` clipped-policy-loss passes, each micro-batch's loss normalised by the whole
batch's counts (`ppo.lossAggregation`) and, with `ppo.rolloutCorrection`, reweighted by
truncated importance weights against the engine's log-probs (with `ppo.schedule` OneStepOverlap the
ratio itself is taken against the engine's log-probs: the batch may be one update old). `log_probs_and_mismatch` gives the
step's log-probs before the update and how far they are from the engine's. In the
Disaggregated layout rank 0 owns the weight-update group with the rollout workers
(`DistributedWeightSync`, built by `roles/link.py`): connected right after it wakes, broadcast in
buckets, disconnected right before it sleeps, each a reported transition of the same offload
state machine. Weight hand-offs are called on every rank (waking a multi-rank role is
collective); rank 0 sends. Must not depend on Ray except through `roles/link.py`.
"""

from __future__ import annotations

import collections

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
from ppo_trainer.offload import Residency
from ppo_trainer.roles.base import RoleWorker, take_rows
from ppo_trainer.roles.handoff import CriticValues, gather_values
from ppo_trainer.roles.targets import check_same_returns, compute_targets
from ppojob_api.vocabulary import RolloutCorrection, Schedule


class ActorWorker(RoleWorker):
    role = "actor"

    def __init__(
        self, spec, *, rank: int, world_size: int, device: str, offload: bool, rollout_workers: list | None = None,
        shared_process: bool = False,
    ) -> None:
        self.link: Residency | None = None  # set below; sleep() during setup must see it
        super().__init__(spec, rank=rank, world_size=world_size, device=device, offload=offload,
                         shared_process=shared_process)
        ref = spec.ppo.custom_advantage_function
        self.advantage_fn = load_advantage_function(ref) if ref else None
        self.received: CriticValues | None = None
        self._shared: list[torch.Tensor] = []  # weights shared with the colocated engine (CUDA IPC)
        if rollout_workers and rank == 0:
            from ppo_trainer.distributed import process_group_backend
            from ppo_trainer.roles.link import build_weight_sync

            self._sync = build_weight_sync(rollout_workers, backend=process_group_backend(device))
            self.link = Residency.for_link("actor.weight_sync", rank=rank, listener=self._transitions.append)
            if self.residency.awake:
                self.link.wake(self._sync.connect)

    def wake(self) -> bool:
        changed = super().wake()
        if self.link is not None:
            self.link.wake(self._sync.connect)
        return changed

    def sleep(self) -> bool:
        if self.link is not None:
            self.link.sleep(self._sync.disconnect)
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
        self.received = None
        values = torch.zeros_like(mask)
        if critic_outputs:
            ids = self.sample_ids(batch, parts)
            values, critic_returns = gather_values(critic_outputs, ids)
            self.received = CriticValues(sample_ids=ids, values=values, returns=critic_returns)
        ppo = self.spec.ppo
        targets = compute_targets(
            batch,
            values=values,
            old_log_probs=old_log_probs,
            ref_log_probs=ref_log_probs,
            ppo=ppo,
            advantage_fn=self.advantage_fn,
        )
        if self.received is not None:
            check_same_returns(targets.returns, self.received.returns, function=ppo.custom_advantage_function)
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

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Rank 0: the policy's weights as CPU tensors (Colocate: they travel to the engines through Ray).
        The other ranks take their turn (gathering tensor-parallel shards is collective) and return nothing."""
        with self.turn("export weights"):
            weights = self.backend.named_weights()
            if self.rank != 0:
                drain(weights)
                return {}
            return {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}

    def share_weights(self):
        """Colocate on GPUs: wake and share this rank's weights with the engine on its GPU (CUDA IPC
        handles, `rollout/cuda_ipc.py`); the rank stays awake, holding them, until `release_weights`."""
        from ppo_trainer.rollout.cuda_ipc import share_weights

        self.wake()
        self.residency.require_awake("share weights")
        shared, self._shared = share_weights(self.backend.named_weights(), self.device)
        return shared

    def release_weights(self) -> None:
        """The engine has copied the shared weights: drop them and sleep again (train-side offload)."""
        self._shared = []
        torch.cuda.ipc_collect()  # memory the engine held open goes back before the offload frees it
        if self.offload:
            self.sleep()

    def broadcast_weights(self) -> None:
        """Disaggregated: rank 0 sends the weights to the engines over the weight-update group."""
        if self.rank == 0 and self.link is None:
            raise RuntimeError("broadcast_weights needs the weight-sync link of actor rank 0 (Disaggregated layout)")
        with self.turn("broadcast weights"):
            if self.link is not None:
                self.link.require_awake("broadcast weights")
                self._sync.broadcast(self.backend.named_weights())
            else:
                drain(self.backend.named_weights())

    def link_state(self) -> str | None:
        return self.link.state if self.link is not None else None

    def received_external_data(self) -> CriticValues | None:
        """The critic's values and returns the last `train` took for its samples (for tests and debugging)."""
        return self.received


def drain(weights) -> None:
    """A rank that sends nothing still runs the export to its end: gathering tensor-parallel shards
    and pipeline stages is collective."""
    collections.deque(weights, maxlen=0)
