"""Atomic, resumable checkpoints: a directory per step that appears whole or not at all.

A checkpoint is written into `<root>/.tmp-step-NNNNNNNN-<id>/`: every role's rank writes its own
`<role>-rank<r>.pt` (model, optimizer, RNG), fsynced; then the driver writes `trainer.json`
(step, warm-up count, skipped weight syncs, sampler state, driver RNG, metrics history) and, with
ppo.schedule OneStepOverlap, `pending-batch.pt` (the next step's batch, already generated),
fsyncs the directory and renames it to `<root>/step-NNNNNNNN`, and fsyncs the root. A crash at
any point leaves either the new checkpoint or none, and the previous one is untouched;
leftover temp directories are ignored and cleared. Only the last `keep` checkpoints stay.
Depends on torch (for the role files) and the standard library.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

STEP_DIR = re.compile(r"^step-(\d{8})$")
TRAINER_FILE = "trainer.json"
PENDING_BATCH_FILE = "pending-batch.pt"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit this run."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, write) -> None:
    """Write through `write(file)` into a temp sibling, fsync it, and rename it into place."""
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(temp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def role_file(directory: str | Path, *, role: str, rank: int) -> Path:
    return Path(directory) / f"{role}-rank{rank}.pt"


def write_role_state(directory: str | Path, *, role: str, rank: int, state: dict) -> str:
    """One rank's state (model, optimizer, RNG) into a checkpoint being written; returns the path."""
    path = role_file(directory, role=role, rank=rank)
    _write_file(path, lambda f: torch.save(state, f))
    return str(path)


def read_role_state(directory: str | Path, *, role: str, rank: int) -> dict:
    path = role_file(directory, role=role, rank=rank)
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: the checkpoint was written with a different layout of {role} ranks")
    return torch.load(path, map_location="cpu", weights_only=False)


def write_pending_batch(directory: str | Path, *, parts: list, stats: list[dict]) -> None:
    """ppo.schedule OneStepOverlap: the next step's batch (every engine's part and statistics), generated
    before the checkpoint with weights it does not hold, into the checkpoint being written."""
    _write_file(Path(directory) / PENDING_BATCH_FILE, lambda f: torch.save({"parts": parts, "stats": stats}, f))


def read_pending_batch(directory: str | Path) -> dict | None:
    """{"parts", "stats"} of the batch `write_pending_batch` saved, or None when there was none in flight."""
    path = Path(directory) / PENDING_BATCH_FILE
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None


def capture_rng() -> dict[str, Any]:
    """The driver process's RNG states, as JSON."""
    version, state, gauss = random.getstate()
    return {"python": [version, list(state), gauss], "torch": torch.get_rng_state().tolist()}


def restore_rng(rng: dict[str, Any]) -> None:
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))


@dataclass
class TrainerState:
    """What the driver needs to continue exactly where it stopped."""

    step: int = 0
    """Steps finished: the next step to run."""
    critic_only_steps_done: int = 0
    weight_syncs_skipped: int = 0
    sampler: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    """Per-step metrics so far (StepMetrics.to_dict())."""
    last_export: dict[str, Any] | None = None
    """The latest Hugging Face export (checkpoint.export) as status.progress.lastExport says it, so
    that a resumed run reports it again."""


class CheckpointManager:
    def __init__(self, root: str | Path, *, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1")
        self.root = Path(root)
        self.keep = keep

    def begin(self, step: int) -> Path:
        """A fresh temp directory for the checkpoint after `step` steps; roles write into it."""
        self.root.mkdir(parents=True, exist_ok=True)
        temp = self.root / f".tmp-step-{step:08d}-{uuid.uuid4().hex[:8]}"
        temp.mkdir()
        return temp

    def commit(self, temp: Path, state: TrainerState) -> Path:
        """Write the trainer state, make the directory durable and rename it into place; prune old ones."""
        _write_file(temp / TRAINER_FILE, lambda f: f.write(json.dumps(asdict(state)).encode()))
        fsync_dir(temp)
        final = self.root / f"step-{state.step:08d}"
        os.rename(temp, final)
        fsync_dir(self.root)
        self._prune()
        return final

    def abort(self, temp: Path) -> None:
        shutil.rmtree(temp, ignore_errors=True)

    def all(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if STEP_DIR.match(p.name) and (p / TRAINER_FILE).is_file()]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        complete = self.all()
        return complete[-1] if complete else None

    def written_at(self, path: Path) -> float:
        """When the checkpoint was completed, as POSIX seconds (its trainer state is written last)."""
        return (path / TRAINER_FILE).stat().st_mtime

    def load_state(self, path: Path) -> TrainerState:
        try:
            data = json.loads((path / TRAINER_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {path / TRAINER_FILE}: {exc}") from exc
        return TrainerState(**data)

    def _prune(self) -> None:
        for old in self.all()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for temp in self.root.glob(".tmp-step-*"):
            shutil.rmtree(temp, ignore_errors=True)
