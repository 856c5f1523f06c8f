"""The pinned versions (tools/cluster/versions.env) and the cache paths keyed by them."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

VERSIONS_FILE = Path(__file__).resolve().parent.parent / "versions.env"

# Bump when the way binaries are built changes (flags, wrapper modules): forces a rebuild.
BUILD_RECIPE = "3"

# Pins of components built apart, each in a cache directory keyed by its own pin (kueue.py, network_policies.py):
# left out of `Pins.key`, so that changing one neither rebuilds the control plane nor makes a running
# cluster unattachable.
SEPARATE_PINS = frozenset({"KUEUE_VERSION", "KUBE_ROUTER_VERSION"})

_LINE = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$")


class PinError(RuntimeError):
    """versions.env is missing a key or has a line that is not KEY=VALUE."""


def read_env_file(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """Parse a shell-sourceable KEY=VALUE file (comments and blank lines allowed)."""
    values: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if not match:
            raise PinError(f"{path}:{number}: expected KEY=VALUE, got {raw!r}")
        value = match.group(2).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[match.group(1)] = value
    return values


@dataclass(frozen=True)
class Pins:
    """Every version the local cluster is built from."""

    values: dict[str, str]

    def __getitem__(self, key: str) -> str:
        if key not in self.values:
            raise PinError(f"{VERSIONS_FILE} has no {key}=...")
        return self.values[key]

    @property
    def kubernetes(self) -> str:
        return self["KUBERNETES_VERSION"]

    @property
    def kube_minor(self) -> str:
        return self.kubernetes.lstrip("v").split(".")[1]

    @property
    def staging(self) -> str:
        """Version of the published staging modules k8s.io/* that match KUBERNETES_VERSION."""
        return "v0." + self.kubernetes.lstrip("v").split(".", 1)[1]

    def staging_overrides(self) -> dict[str, str]:
        """Staging modules the proxy does not serve at `staging`, with the version used instead."""
        out: dict[str, str] = {}
        for item in self.values.get("KUBERNETES_STAGING_OVERRIDES", "").split():
            module, _, version = item.partition("=")
            if not version:
                raise PinError(f"{VERSIONS_FILE}: KUBERNETES_STAGING_OVERRIDES item {item!r} is not module=version")
            out[module] = version
        return out

    def key(self) -> str:
        """Short hash of the build-relevant pins: the cache directory's name."""
        build_keys = sorted(k for k in self.values if k.endswith(("_VERSION", "_OVERRIDES")) and k not in SEPARATE_PINS)
        text = "\n".join(f"{k}={self.values[k]}" for k in build_keys) + f"\nrecipe={BUILD_RECIPE}"
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def load_pins(path: Path = VERSIONS_FILE) -> Pins:
    return Pins(read_env_file(path))


def cache_root() -> Path:
    """${PPOJOB_CACHE:-$HOME/.cache/ppojob}."""
    base = os.environ.get("PPOJOB_CACHE") or str(Path.home() / ".cache" / "ppojob")
    return Path(base)


def build_dir(pins: Pins) -> Path:
    """Where the binaries for these pins live: <cache>/cluster/<key>/."""
    return cache_root() / "cluster" / pins.key()


def default_state_dir() -> Path:
    """Where a running cluster keeps its pid file, kubeconfig, certificates, data and logs."""
    return cache_root() / "run"
