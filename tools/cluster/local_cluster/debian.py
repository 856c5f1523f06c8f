"""Debian packages the local cluster runs on (the real node's runtime, the image builder), installed
with apt-get when one is missing: a fresh machine needs nothing installed by hand."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path


class PackagesError(RuntimeError):
    """A package is missing and cannot be installed; the message names it and how to get it."""


def ensure_packages(tools: Mapping[str, Path], out=None) -> float:
    """Install the packages (name -> a file it ships) whose file is missing; the seconds it took."""
    missing = [name for name, path in tools.items() if not path.exists()]
    if not missing:
        return 0.0
    if os.geteuid() != 0:
        raise PackagesError(f"missing Debian packages {', '.join(missing)}: apt-get install them as root")
    started = time.monotonic()
    if out is not None:
        print(f"installing Debian packages: {' '.join(missing)}", file=out, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if result.returncode != 0:
            raise PackagesError(f"`{' '.join(cmd)}` failed: {result.stderr.strip()[-800:]}")
    still = [name for name, path in tools.items() if not path.exists()]
    if still:
        raise PackagesError(f"apt-get installed {' '.join(missing)} but {', '.join(still)} still lacks its files")
    return time.monotonic() - started
