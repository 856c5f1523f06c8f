"""Running the real `ppo-train` CLI in a subprocess (its own local Ray, its own session) and reading its JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def start(config: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "ppo_trainer.cli", str(config), "--run-dir", str(run_dir), "--json",
               "--object-store-mb", "200", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)


def records(lines):
    for line in lines:
        if line.startswith("{"):
            yield json.loads(line)
