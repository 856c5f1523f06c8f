"""The run's scalars as TensorBoard event files in the run directory: one point per metric per step.

`TensorBoardReporter` is a `Reporter`: each 'step' event (a `StepMetrics` as a dict) becomes that
step's `StepMetrics.scalars()`, at the step's index, flushed at once so that `tensorboard --logdir`
on the run directory (on a cluster, the checkpoint volume) shows a run as it goes; progress
snapshots and other events are not written (the status and events.jsonl have them). A resumed run
starts its file by purging the steps from the one it resumes at, so that steps run again after a
restart show once. The writer is torch.utils.tensorboard's (it needs the `tensorboard` package of
the trainer extra), imported when the first step is written. Depends on metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ppo_trainer.reporting.metrics import StepMetrics
from ppo_trainer.reporting.reporters import Progress


class TensorBoardReporter:
    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.writer = None

    def report(self, progress: Progress) -> None:
        """Stage changes carry no scalar: the step events hold every metric."""

    def event(self, kind: str, **fields: Any) -> None:
        if kind != "step":
            return
        metrics = StepMetrics.from_dict({k: v for k, v in fields.items() if k != "line"})
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides what earlier files of this directory hold from this step on
            self.writer = SummaryWriter(log_dir=str(self.run_dir), purge_step=metrics.step)
        for tag, value in metrics.scalars().items():
            self.writer.add_scalar(tag, value, global_step=metrics.step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
