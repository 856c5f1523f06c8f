"""Helpers of the operator's integration tests: read PPOJobs and children, wait, record phases,
scrape an operator's /metrics."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import urllib3
import yaml
from kubernetes import client, config, watch
from prometheus_client.parser import text_string_to_metric_families

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def kget(cluster, kind: str, namespace: str, name: str | None = None, selector: str | None = None) -> Any:
    args = ["get", kind, "-n", namespace, "-o", "json"]
    if name:
        args.insert(2, name)
    if selector:
        args += ["-l", selector]
    result = cluster.kubectl(*args, check=False)
    if result.returncode != 0:
        return None
    data = json.loads(result.stdout)
    return data if name else data["items"]


def apply(cluster, namespace: str, manifest: dict) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 60, interval: float = 0.2,
             context: Callable[[], Any] | None = None) -> Any:
    """Polls probe until it returns something truthy; on timeout the error shows its last answer and, when
    given, what context() says about the state (what a failure needs to be understood afterwards)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    state = f"; state: {context()!r}" if context else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}{state}")


def phase_of(cluster, namespace: str, name: str) -> str | None:
    job = kget(cluster, "ppojob", namespace, name)
    return ((job or {}).get("status") or {}).get("phase")


def wait_phase(cluster, namespace: str, name: str, *phases: str, timeout: float = 90) -> dict:
    def probe():
        job = kget(cluster, "ppojob", namespace, name)
        return job if job and (job.get("status") or {}).get("phase") in phases else None

    return wait_for(f"{name} in {phases}", probe, timeout)


def condition(job: dict, type_: str) -> dict:
    return next(c for c in job["status"]["conditions"] if c["type"] == type_)


class PhaseRecorder:
    """Watches one PPOJob (a real watch, admin identity) and keeps (monotonic time, phase) changes."""

    def __init__(self, cluster, namespace: str, name: str):
        self.namespace, self.name = namespace, name
        self.api = client.CustomObjectsApi(config.new_client_from_config(str(cluster.kubeconfig)))
        self.changes: list[tuple[float, str]] = []
        self.bodies: list[dict] = []
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self._watch.stream(
                self.api.list_namespaced_custom_object, "ppojob.io", "v1alpha1", self.namespace, "ppojobs",
                field_selector=f"metadata.name={self.name}", timeout_seconds=600,
            ):
                body = event["object"]
                self.bodies.append(body)
                phase = (body.get("status") or {}).get("phase")
                if phase and (not self.changes or self.changes[-1][1] != phase):
                    self.changes.append((time.monotonic(), phase))
        except (client.exceptions.ApiException, urllib3.exceptions.HTTPError, OSError, ValueError):
            return  # the watch ends with the test

    @property
    def phases(self) -> list[str]:
        return [p for _, p in self.changes]

    def stop(self) -> None:
        self._watch.stop()


def tiny_manifest(name: str = "tiny", **spec_overrides) -> dict:
    """examples/tiny-ppojob.yaml with spec sections overridden (the trainer engineer's example).
    Its Ray pods get a 1 s grace: KWOK ends a deleted pod only when its grace period is over, and no
    trainer runs in a KWOK pod to checkpoint (a real kubelet ends it once its preStop hook returns)."""
    manifest = yaml.safe_load((EXAMPLES / "tiny-ppojob.yaml").read_text())
    manifest["metadata"] = {"name": name}
    manifest["spec"]["checkpoint"]["terminationGracePeriodSeconds"] = 1
    for key, value in spec_overrides.items():
        if isinstance(value, dict) and isinstance(manifest["spec"].get(key), dict):
            manifest["spec"][key] = {**manifest["spec"][key], **value}
        else:
            manifest["spec"][key] = value
    return manifest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
