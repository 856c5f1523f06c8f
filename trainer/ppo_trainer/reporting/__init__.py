"""Reporting: what a run tells the world about itself, and where.

- `reporters.py`: the `Progress` snapshot (the fields of the CRD's `status.progress`) and the one
  interface every destination implements, `Reporter`, with the terminal, JSON-lines, fan-out and
  recording reporters.
- `kubernetes.py`: the reporter that writes `status.progress` to the job's progress ConfigMap, throttled.
- `tensorboard.py`: each step's scalars as TensorBoard event files in the run directory.
- `metrics.py`: one step's `StepMetrics`, the stage timer, the run's plot and summary.
- `progress.py`: the loop's `ProgressTracker`, which keeps the snapshot and reports it at each stage.
"""
