"""The PPO loop, on one screen: generate, critic trains and returns refs, actor trains on them, sync.

`train` is the whole schedule of a run: each step generates and scores a batch (the rollout
engines sleep afterwards when rollout offload is on), computes the actor's and the reference's
log-probs once (and how far the actor's are from the engine's), trains the critic K times and
gets its output back as ObjectRefs, and, unless the step is a critic-only warm-up step, trains
the actor on those refs (each actor rank gets the critic ranks' refs that hold its samples,
`Roles.values_for_actor`; the driver never fetches them) and sends the new weights to the
engines. In warm-up steps the actor did not change, so the sync is skipped and counted. When
data.validation is set, a step whose count is due ends with an evaluation on the held-out prompts
(`evaluation.py`), on the weights the engines then hold. With
`ppo.schedule` OneStepOverlap the next step's batch is started as soon as this step's is out (on
the weights the engines hold, one update behind the actor's at most) and trains next step; the
weight sync first waits for it, since the engines take no weights mid-batch. `run`
wires a run together (prompts, roles, resume); `critic.save` gets the critic's checkpoints too,
and `checkpoint.export` Hugging Face directories of the trained models (every interval steps, and
at the end).
A stop asked for (SIGTERM, `graceful_stop`) is taken between two steps: the steps since the last
checkpoint are saved, then the run ends with TrainerStopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import ray

from ppo_trainer.algorithms import summarize_mismatch
from ppo_trainer.checkpoint import (
    CheckpointManager,
    TrainerState,
    capture_rng,
    read_pending_batch,
    restore_rng,
    write_pending_batch,
)
from ppo_trainer.data import SYNTHETIC_SET_SIZE, PromptSampler, synthetic_prompts
from ppo_trainer.evaluation import Evaluation, Evaluator
from ppo_trainer.export import CRITIC_FOLDER, export_name
from ppo_trainer.failures import describe_failure
from ppo_trainer.graceful_stop import StopRequest, TrainerStopped
from ppo_trainer.prompt_files import load_prompt_file
from ppo_trainer.reporting.metrics import StageTimer, StepMetrics
from ppo_trainer.reporting.progress import ProgressTracker
from ppo_trainer.reporting.reporters import CheckpointInfo, ExportInfo, Reporter, utc_now, utc_time
from ppo_trainer.roles.actor import ActorWorker
from ppo_trainer.roles.build import Roles, build_roles, compute_layout
from ppo_trainer.roles.critic import CriticWorker
from ppo_trainer.roles.group import PerRank
from ppo_trainer.roles.ref import RefWorker
from ppo_trainer.roles.rollout import RolloutWorker
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import Schedule, Stage


def train(spec: PPOJobSpec, *, roles: Roles, sampler: PromptSampler, state: TrainerState, status: ProgressTracker,
          checkpoints: CheckpointManager | None, evaluator: Evaluator, pending: Generation | None = None,
          stop: StopRequest | None = None, exports: Path | None = None) -> TrainerState:
    ppo, critic_updates = spec.ppo, spec.critic.updates_per_actor_update
    overlap = ppo.schedule == Schedule.ONE_STEP_OVERLAP
    saved_step = state.step  # a resumed run starts at its checkpoint's step
    for step in range(state.step, ppo.num_rollouts):
        if stop is not None and stop.requested:  # between steps: the last one is whole, so it can be saved
            stop_between_steps(stop, roles, checkpoints, state, sampler, status, pending, saved_step=saved_step)
        critic_only = ppo.is_critic_only_step(step)  # the warm-up: the critic learns, the actor waits
        timer = StageTimer()
        status.stage(Stage.GENERATE, state=state)
        with timer("generate"):
            generation = pending or generate(roles, spec, sampler, step)  # pending: started during the last step
            batch, rollout_stats = generation.batch, ray.get(generation.stats)
            if spec.offload.rollout:
                roles.rollout.call(RolloutWorker.sleep)
        # OneStepOverlap: the next batch starts now, on the weights the engines hold, while this one trains.
        pending = generate(roles, spec, sampler, step + 1) if overlap and step + 1 < ppo.num_rollouts else None
        if roles.critic is not None:  # from the log-probs on: they are the first input of the critic's targets
            status.stage(Stage.GENERATE_CRITIC_TRAIN if pending else Stage.CRITIC_TRAIN, state=state)
        with timer("log_probs"):  # once per step, for both critic and actor: one reward definition
            old_log_probs, mismatch = roles.actor.async_call(ActorWorker.log_probs_and_mismatch, *batch, num_returns=2)
            ray.wait(old_log_probs, num_returns=len(old_log_probs))  # one role on the device at a time
            ref_log_probs = roles.ref.async_call(RefWorker.log_probs, *batch)
            ray.wait(ref_log_probs, num_returns=len(ref_log_probs))
        values = critic_stats = actor_stats = None
        if roles.critic is not None:
            with timer("critic_train"):
                values, critic_stats = roles.critic.async_call(  # each critic rank its samples' log-probs
                    CriticWorker.train, *batch, spread=roles.log_probs_for_critic(old_log_probs, ref_log_probs),
                    actor_data_size=roles.layout.actor.data, updates=critic_updates, num_returns=2)
                critic_stats = ray.get(critic_stats)  # metrics only: the values stay refs
        if not critic_only:
            status.stage(Stage.GENERATE_ACTOR_TRAIN if pending else Stage.ACTOR_TRAIN, state=state)
            with timer("actor_train"):
                actor_stats = ray.get(roles.actor.async_call(  # awake until the sync is done with it
                    ActorWorker.train, *batch, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
                    spread=roles.values_for_actor(values) if values is not None else None, stay_awake=True))
            if pending:  # the engines take no weights mid-batch: the next batch is finished first
                status.stage(Stage.GENERATE, state=state)
                with timer("generate"):
                    pending.wait()
            status.stage(Stage.WEIGHT_SYNC, state=state)
            with timer("weight_sync"):
                roles.sync_weights(version=ppo.actor_updates_before(step + 1))
        else:
            state.critic_only_steps_done += 1
            state.weight_syncs_skipped += 1  # the actor did not change: nothing to send
        state.step = step + 1
        evaluation = None
        if evaluator.is_due(state.step):  # held-out prompts, on the weights just synced; seeds of its own
            status.stage(Stage.EVALUATE, state=state)
            evaluation = evaluator.evaluate(roles.rollout, step=state.step)
        metrics = summarize(step, critic_only, rollout_stats, critic_stats, actor_stats, ray.get(mismatch), timer,
                            actor_version=ppo.actor_updates_before(step), compile_seconds=roles.take_compile_seconds(),
                            evaluation=evaluation)
        state.history.append(metrics.to_dict())
        status.step_done(metrics, state=state)
        if save_what_is_due(spec, roles, state, sampler, status, pending, checkpoints=checkpoints, exports=exports):
            saved_step = state.step
    if exports is not None:
        status.stage(Stage.CHECKPOINT, state=state)
        export_models(roles, spec, exports, state, status, final=True)
    status.finish()
    return state


@dataclass(frozen=True)
class Generation:
    """A step's batch being generated: the engines' parts and their statistics, as refs."""

    batch: PerRank
    stats: PerRank

    def wait(self) -> None:
        ray.wait(list(self.stats), num_returns=len(self.stats))


def generate(roles: Roles, spec: PPOJobSpec, sampler: PromptSampler, step: int) -> Generation:
    """Start step `step`'s generation (each engine its share of the prompts, a seed of its own); returns at once."""
    batch, stats = roles.rollout.async_call(
        RolloutWorker.generate, roles.rollout.split(sampler.next_batch()),
        seed=roles.rollout.seeds(spec.seed * 1_000_003 + step), num_returns=2)
    return Generation(batch, stats)


def summarize(step, critic_only, rollout_stats, critic_stats, actor_stats, mismatch, timer, *,
              actor_version: int, compile_seconds: float, evaluation: Evaluation | None = None) -> StepMetrics:
    """One step's metrics from the per-rank statistics (sums for counts, means for the rest; the
    trainer's and the engine's log-probs compared over every rank's tokens); the staleness from
    the weights version the engines stamped on the batch and the actor's (`actor_version`);
    `compile_seconds`: the roles' seconds in torch.compile during the step; `evaluation`: the
    held-out evaluation the step ended with, if any."""
    samples = sum(s["samples"] for s in rollout_stats)
    generated_by = int(min(s["weights_version"] for s in rollout_stats))

    def mean(stats, key):
        return sum(s[key] for s in stats) / len(stats) if stats else None

    return StepMetrics(
        step=step, critic_only=critic_only,
        reward_mean=sum(s["reward_sum"] for s in rollout_stats) / samples,
        response_tokens=int(sum(s["response_tokens"] for s in rollout_stats)), samples=int(samples),
        seconds=timer.total, stage_seconds=dict(timer.seconds), compile_seconds=compile_seconds,
        value_loss=mean(critic_stats, "value_loss"), value_clipfrac=mean(critic_stats, "value_clipfrac"),
        policy_loss=mean(actor_stats, "policy_loss"), clipfrac=mean(actor_stats, "clipfrac"),
        kl=mean(actor_stats or critic_stats, "kl"), entropy=mean(actor_stats, "entropy"),
        **summarize_mismatch(mismatch),
        staleness=actor_version - generated_by, rollout_weights_version=generated_by,
        generation_seconds=max(s["seconds"] for s in rollout_stats),
        generated_at=(min(s["started_at"] for s in rollout_stats), max(s["finished_at"] for s in rollout_stats)),
        **({} if evaluation is None else {
            "eval_reward_mean": evaluation.reward_mean, "eval_pass_rate": evaluation.pass_rate,
            "eval_samples": evaluation.samples, "eval_seconds": evaluation.seconds}),
    )


def should_checkpoint(spec: PPOJobSpec, steps_done: int) -> bool:
    interval = spec.checkpoint.interval
    return interval > 0 and (steps_done % interval == 0 or steps_done == spec.ppo.num_rollouts)


def save_what_is_due(spec: PPOJobSpec, roles: Roles, state: TrainerState, sampler: PromptSampler,
                     status: ProgressTracker, pending: Generation | None, *, checkpoints: CheckpointManager | None,
                     exports: Path | None) -> bool:
    """After a step: the export, checkpoint and critic save its count makes due (the export first, so
    that the checkpoint names it); whether a checkpoint was written."""
    if exports is not None and should_export(spec, state.step):
        status.stage(Stage.CHECKPOINT, state=state)
        export_models(roles, spec, exports, state, status, final=False)
    checkpointed = checkpoints is not None and should_checkpoint(spec, state.step)
    if checkpointed:
        status.stage(Stage.CHECKPOINT, state=state)
        save_checkpoint(roles, checkpoints, state, sampler, status, pending)
    if should_save_critic(spec, state.step):
        status.stage(Stage.CHECKPOINT, state=state)
        save_critic(roles, CheckpointManager(spec.critic.save, keep=spec.checkpoint.keep), state)
    return checkpointed


def should_save_critic(spec: PPOJobSpec, steps_done: int) -> bool:
    """critic.save: at every checkpoint, and after the last step even when checkpoints are off."""
    return bool(spec.critic.enabled and spec.critic.save) and (
        should_checkpoint(spec, steps_done) or steps_done == spec.ppo.num_rollouts)


def should_export(spec: PPOJobSpec, steps_done: int) -> bool:
    """checkpoint.export.interval: every interval steps, but the last (the end's export is that one)."""
    interval = spec.checkpoint.export.interval
    return interval > 0 and steps_done % interval == 0 and steps_done < spec.ppo.num_rollouts


def export_root(spec: PPOJobSpec, checkpoint_dir: str | None) -> Path | None:
    """Where checkpoint.export writes: its path, or <checkpoint directory>/export; None when export is off."""
    export = spec.checkpoint.export
    if export is None:
        return None
    if export.path is None and checkpoint_dir is None:
        raise ValueError("checkpoint.export has no folder to write to (this run has no checkpoint directory):"
                         " set checkpoint.export.path")
    return Path(export.path) if export.path is not None else Path(checkpoint_dir) / "export"


def export_models(roles: Roles, spec: PPOJobSpec, root: Path, state: TrainerState, status: ProgressTracker, *,
                  final: bool) -> None:
    """The actor (and with checkpoint.export.critic the critic) as Hugging Face directories under `root`:
    `final` after the last step, else step-NNNNNNNN; one role after the other, as they share the devices."""
    export, started = spec.checkpoint.export, time.perf_counter()
    name, dtype = export_name(None if final else state.step), export.dtype or spec.model.dtype
    path = roles.actor.call(ActorWorker.export, str(root / name), dtype=dtype)[0]
    critic_path = (roles.critic.call(CriticWorker.export, str(root / CRITIC_FOLDER / name), dtype=dtype)[0]
                   if export.critic else None)
    written = ExportInfo(step=state.step, path=path, time=utc_now(), critic_path=critic_path)
    state.last_export = written.to_status()
    status.exported(written, seconds=time.perf_counter() - started)


def save_critic(roles: Roles, checkpoints: CheckpointManager, state: TrainerState) -> None:
    """The critic's ranks into a step directory of critic.save (atomic, as the run's checkpoints)."""
    temp = checkpoints.begin(state.step)
    try:
        roles.critic.call(CriticWorker.save, str(temp))
        checkpoints.commit(temp, state)
    except BaseException:
        checkpoints.abort(temp)
        raise


def save_checkpoint(roles: Roles, checkpoints: CheckpointManager, state: TrainerState,
                    sampler: PromptSampler, status: ProgressTracker, pending: Generation | None) -> None:
    """`pending` (OneStepOverlap): the next step's batch, already drawn and generated with weights the
    checkpoint does not hold; it is saved whole, so a resume trains on the very same samples."""
    started = time.perf_counter()
    temp = checkpoints.begin(state.step)
    try:
        save_roles(roles, temp)
        if pending is not None:
            write_pending_batch(temp, parts=ray.get(list(pending.batch)), stats=ray.get(list(pending.stats)))
        state.sampler, state.rng = sampler.state_dict(), capture_rng()
        path = checkpoints.commit(temp, state)
    except BaseException:
        checkpoints.abort(temp)
        raise
    status.checkpoint(step=state.step, path=str(path), seconds=time.perf_counter() - started)


def stop_between_steps(stop: StopRequest, roles: Roles, checkpoints: CheckpointManager | None, state: TrainerState,
                       sampler: PromptSampler, status: ProgressTracker, pending: Generation | None, *,
                       saved_step: int) -> None:
    """The trainer was asked to stop: the steps done since the last checkpoint are saved, then TrainerStopped."""
    if checkpoints is not None and state.step > saved_step:
        status.stage(Stage.CHECKPOINT, state=state)
        save_checkpoint(roles, checkpoints, state, sampler, status, pending)
        saved_step = state.step
    saved = f"; checkpoint at step {saved_step}" if checkpoints is not None else "; checkpoints are off"
    raise TrainerStopped(f"stopped by {stop.signal_name} after step {state.step}{saved}")


def save_roles(roles: Roles, directory) -> None:
    trained = [g for g in (roles.actor, roles.critic) if g is not None]
    ray.get([ref for g in trained for ref in g.async_call(g.worker_class.save, str(directory))])


def load_prompts(spec: PPOJobSpec):
    if spec.data.prompts == "synthetic":
        return synthetic_prompts(SYNTHETIC_SET_SIZE, seed=spec.seed)
    return load_prompt_file(spec.data.prompts, prompt_key=spec.data.prompt_key, label_key=spec.data.label_key)


def run(spec: PPOJobSpec, *, reporter: Reporter, checkpoint_dir: str | None, resume: bool,
        use_gpus: bool, cpu_ranks: int = 1, attempt: int = 0, stop: StopRequest | None = None) -> TrainerState:
    """Place and build the roles, run the job on them, and release them."""
    layout = compute_layout(spec, use_gpus=use_gpus, cpu_ranks=cpu_ranks)
    roles = build_roles(spec, layout, timeout=spec.scheduling.schedule_timeout_seconds, checkpoint_dir=checkpoint_dir)
    try:
        return run_on(roles, spec, reporter=reporter, checkpoint_dir=checkpoint_dir, resume=resume, attempt=attempt,
                      stop=stop)
    finally:
        roles.shutdown()


def run_on(roles: Roles, spec: PPOJobSpec, *, reporter: Reporter, checkpoint_dir: str | None,
           resume: bool = False, attempt: int = 0, stop: StopRequest | None = None) -> TrainerState:
    """Run the job on built roles: restore the latest checkpoint when resuming, then train to the end."""
    checkpoints = CheckpointManager(checkpoint_dir, keep=spec.checkpoint.keep) if checkpoint_dir else None
    exports = export_root(spec, checkpoint_dir)
    sampler = PromptSampler(load_prompts(spec), spec.rollout.batch_size, seed=spec.seed)
    evaluator = Evaluator.from_spec(spec)
    state = TrainerState()
    latest = checkpoints.latest() if (checkpoints and resume) else None
    pending = None
    if latest is not None:
        state = checkpoints.load_state(latest)
        sampler.load_state_dict(state.sampler)
        restore_rng(state.rng)
        restore_roles(roles, latest)
        saved = read_pending_batch(latest)
        if saved is not None:
            pending = Generation(PerRank(map(ray.put, saved["parts"])), PerRank(map(ray.put, saved["stats"])))
        reporter.event("note", line=f"resumed from {latest} at step {state.step}", path=str(latest))
    # A resumed run reports the checkpoint it resumed from as the last one: it is, until the next.
    resumed = (CheckpointInfo(step=state.step, path=str(latest), time=utc_time(checkpoints.written_at(latest)))
               if latest is not None else None)
    status = ProgressTracker(reporter=reporter, poll=roles.poll, total_steps=spec.ppo.num_rollouts,
                             critic_only_steps=spec.ppo.num_critic_only_steps,
                             with_critic=roles.critic is not None, state=state, attempt=attempt,
                             last_checkpoint=resumed)
    if latest is not None:  # fresh engines hold the initial weights; restored ones must be sent
        status.stage(Stage.WEIGHT_SYNC, state=state)
        roles.sync_weights(version=spec.ppo.actor_updates_before(state.step))
    try:
        return train(spec, roles=roles, sampler=sampler, state=state, status=status, checkpoints=checkpoints,
                     evaluator=evaluator, pending=pending, stop=stop, exports=exports)
    except TrainerStopped as stopped:  # not a failure: the job goes on from the checkpoint when it resumes
        reporter.event("note", line=str(stopped))
        raise
    except Exception as exc:
        status.finish(error=describe_failure(exc))
        raise


def restore_roles(roles: Roles, directory) -> None:
    """Load the actor's and critic's state (model, optimizer, RNG) from a checkpoint directory."""
    trained = [g for g in (roles.actor, roles.critic) if g is not None]
    ray.get([ref for g in trained for ref in g.async_call(g.worker_class.load, str(directory))])
