"""Chart tests render the chart with the real helm built for the local cluster."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from chart_paths import CHART

from local_cluster.pins import build_dir, load_pins


@pytest.fixture(scope="session")
def helm() -> Path:
    path = build_dir(load_pins()) / "bin" / "helm"
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make cluster-binaries` (make test does it first)")
    return path


@pytest.fixture(scope="session")
def render(helm):
    """render(*set_args, namespace=...) -> list of rendered objects; raises CalledProcessError on failure."""

    def _render(*set_args: str, namespace: str = "ppojob-system") -> list[dict]:
        args = [str(helm), "template", "ppojob", str(CHART), "--namespace", namespace]
        for item in set_args:
            args += ["--set", item]
        out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]

    return _render
