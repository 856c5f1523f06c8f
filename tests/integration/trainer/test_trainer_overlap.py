"""ppo.schedule OneStepOverlap through Ray on CPU, Disaggregated (the engine and the training roles in
processes of their own): what one run's timeline, weights versions, rewards and transitions show.

The timeline is measured, not inferred: the engine stamps the wall-clock start and end of each
batch's generation, and the recorder below stamps the moment the driver reports each stage.
"""

from __future__ import annotations

import itertools
import time

import pytest
from trainer_specs import tiny_spec

from ppo_trainer.reporting.metrics import StepMetrics, summarize_run
from ppo_trainer.reporting.reporters import Recorder
from ppo_trainer.roles.build import build_roles, compute_layout
from ppo_trainer.train import run_on
from ppojob_api.vocabulary import Stage

STEPS, WARMUP = 24, 2
TRAINING_STAGES = {Stage.CRITIC_TRAIN, Stage.ACTOR_TRAIN, Stage.GENERATE_CRITIC_TRAIN, Stage.GENERATE_ACTOR_TRAIN}


class TimedRecorder(Recorder):
    """Each progress report with the wall-clock time the driver sent it."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def report(self, progress) -> None:
        self.times.append(time.time())
        super().report(progress)

    def stage_changes(self) -> list[tuple[int, Stage]]:
        """(step, stage) of each report that enters a stage (a step's end restates the stage it was in)."""
        stages = [p.stage for p in self.progress]
        return [(p.step, p.stage) for i, p in enumerate(self.progress) if i == 0 or p.stage != stages[i - 1]]

    def training_spans(self) -> dict[int, list[tuple[float, float]]]:
        """Per step, the spans during which the driver reported a training stage (CriticTrain covers the
        log-probs too), each from the report that entered it to the next report."""
        spans: dict[int, list[tuple[float, float]]] = {}
        reports = list(zip(self.times, self.progress))
        for i, ((start, progress), (end, _)) in enumerate(itertools.pairwise(reports)):
            entered = i == 0 or progress.stage != reports[i - 1][1].stage
            if entered and progress.stage in TRAINING_STAGES:
                spans.setdefault(progress.step, []).append((start, end))
        return spans


def overlap_seconds(window: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(window[1], end) - max(window[0], start)) for start, end in spans)


def disaggregated(schedule: str, steps: int, warmup: int):
    return tiny_spec(placement="Disaggregated", rollout={"gpus": 1}, offload={"rollout": False},
                     ppo={"numRollouts": steps, "numCriticOnlySteps": warmup, "schedule": schedule})


def run(spec) -> tuple[TimedRecorder, list[StepMetrics]]:
    roles = build_roles(spec, compute_layout(spec, use_gpus=False), timeout=120)
    try:
        roles.poll()  # forget the transitions of the build
        recorder = TimedRecorder()
        state = run_on(roles, spec, reporter=recorder, checkpoint_dir=None)
        return recorder, [StepMetrics.from_dict(d) for d in state.history]
    finally:
        roles.shutdown()


@pytest.fixture(scope="module")
def overlap_run(ray_session):
    return run(disaggregated("OneStepOverlap", STEPS, WARMUP))


def test_overlap_generation_of_the_next_step_runs_while_this_step_trains(overlap_run):
    recorder, history = overlap_run
    spans = recorder.training_spans()
    overlapped = [overlap_seconds(history[n].generated_at, spans[n - 1]) for n in range(1, STEPS)]
    generation = [history[n].generated_at[1] - history[n].generated_at[0] for n in range(1, STEPS)]
    print("generation seconds overlapped with the previous step's training:", sum(overlapped), "of", sum(generation))
    assert all(seconds > 0 for seconds in overlapped), overlapped
    assert sum(overlapped) > 0.5 * sum(generation), (overlapped, generation)
    # The status shows both at once; the last step has no next batch to generate, and says so.
    shown = [(step, stage) for step, stage in recorder.stage_changes() if stage in TRAINING_STAGES]
    both = [(n, Stage.GENERATE_CRITIC_TRAIN) for n in range(STEPS - 1)] + [
        (n, Stage.GENERATE_ACTOR_TRAIN) for n in range(WARMUP, STEPS - 1)]
    assert sorted(shown) == sorted(both + [(STEPS - 1, Stage.CRITIC_TRAIN), (STEPS - 1, Stage.ACTOR_TRAIN)])


def test_synchronous_generation_never_overlaps_training(ray_session):
    """The same measurement on the Synchronous schedule finds no overlap: it can tell them apart."""
    recorder, history = run(disaggregated("Synchronous", 3, 0))
    spans = recorder.training_spans()
    assert [overlap_seconds(history[n].generated_at, spans[n - 1]) for n in range(1, 3)] == [0.0, 0.0]
    assert [m.staleness for m in history] == [0, 0, 0] and [m.rollout_weights_version for m in history] == [0, 1, 2]


def test_overlap_trains_step_n_on_samples_of_the_weights_of_step_n_minus_1(overlap_run):
    _, history = overlap_run
    # The weights the actor held at step n-1 have max(0, n-1-WARMUP) updates; the engines stamp theirs.
    assert [m.rollout_weights_version for m in history] == [max(0, n - 1 - WARMUP) for n in range(STEPS)]
    assert [m.staleness for m in history] == [0] * (WARMUP + 1) + [1] * (STEPS - WARMUP - 1)
    # Measured on the tokens: the engine's and the actor's log-probs agree (same fp32 model) exactly when
    # the weights are the same, and differ once the batch is one update old.
    fresh = [m.rollout_log_ratio_abs_max for m in history if m.staleness == 0]
    stale = [m.rollout_log_ratio_abs_max for m in history if m.staleness == 1]
    assert max(fresh) < 1e-4 < min(stale), (fresh, stale)


def test_overlap_still_learns_the_tiny_task(overlap_run):
    _, history = overlap_run
    summary = summarize_run(history)
    print("overlap learning run:", summary)
    assert summary["rewardFirst3Mean"] < 0.05
    assert summary["rewardLast3Mean"] > summary["rewardFirst3Mean"] + 0.3, summary


def test_overlap_warmup_skips_the_sync_and_shows_staleness_zero(overlap_run):
    recorder, history = overlap_run
    warmup = [m for m in history if m.critic_only]
    assert len(warmup) == WARMUP and all(m.staleness == 0 and m.policy_loss is None for m in warmup)
    syncs = [step for step, stage in recorder.stage_changes() if stage == Stage.WEIGHT_SYNC]
    assert syncs == list(range(WARMUP, STEPS))  # one after each actor update, none in the warm-up
    final = recorder.progress[-1]
    assert final.finished and final.weight_syncs_skipped == WARMUP and final.critic_only_steps_done == WARMUP


def test_overlap_keeps_the_offload_rules(overlap_run):
    recorder, _ = overlap_run
    events = [(f["role"], f["frm"], f["to"]) for kind, f in recorder.events if kind == "transition"]
    assert not [e for e in events if e[0] == "rollout"]  # the engines never sleep in this schedule
    on_device: set[str] = set()
    link = "Disconnected"
    for role, frm, to in events:
        if role in ("actor", "critic", "ref"):
            if to == "OnDevice":
                assert not on_device, f"{role} woke while {on_device} on the device"
                on_device.add(role)
            else:
                on_device.discard(role)
                assert role != "actor" or link == "Disconnected", "the actor slept with its weight-sync group connected"
        elif role == "actor.weight_sync":
            assert "actor" in on_device, "the weight-sync group changed while the actor was offloaded"
            link = to
