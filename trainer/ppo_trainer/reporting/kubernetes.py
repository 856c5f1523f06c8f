"""The PPOJob progress reporter: the trainer writes `status.progress` to its job's progress ConfigMap.

The operator creates that ConfigMap (named in PPOJOB_PROGRESS_CONFIGMAP), lets the job's
ServiceAccount patch it and nothing else, watches it, and folds each report into the PPOJob's
status in the write it makes anyway: a report that moves the phase costs one PPOJob write, not
two, and a ConfigMap write costs the API server a fraction of a PPOJob write (docs/scale.md).

Throttled (`Throttle`, by the rule of `ppojob_api.progress` that the operator's folding follows
too): the changes that matter (a critic-only warm-up step is done, a checkpoint is written, the run
finishes or fails) are sent at once; any other snapshot waits until `min_interval` seconds have
passed since the last one sent, and longer while the API server is slow (at most MAX_INTERVAL_S,
the heartbeat's period). A slow API server is a loaded one, and at hundreds of jobs the trainers'
routine writes are a large part of its load (docs/scale.md). A held snapshot is sent by the next
report that is due, by the heartbeat thread, or on close.
The heartbeat re-sends the latest snapshot with a fresh `heartbeatTime` when nothing was sent for
`heartbeat_seconds`, so the operator can tell a live trainer in a long stage from a dead one.
It never crashes training: API errors are logged and counted, and the run goes on. The
transport is a plain function (`patch(body)`), so tests can record it; `from_environment` builds
the real one from PPOJOB_PROGRESS_CONFIGMAP, PPOJOB_NAMESPACE and in-cluster config or KUBECONFIG.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ppo_trainer.reporting.reporters import Progress, utc_now
from ppojob_api.progress import MAX_INTERVAL_S, MIN_INTERVAL_S, SLOWDOWN, routine_interval, urgency
from ppojob_api.vocabulary import ENV_PROGRESS_CONFIGMAP, PROGRESS_KEY

log = logging.getLogger(__name__)

Patch = Callable[[dict[str, Any]], None]


def progress_patch(progress: Progress, *, now: str) -> dict[str, Any]:
    """The merge-patch body for the progress ConfigMap: the whole `status.progress` as one JSON value
    (so a key left out, such as an older attempt's error, is gone)."""
    return {"data": {PROGRESS_KEY: json.dumps({**progress.to_status(), "heartbeatTime": now}, sort_keys=True)}}


class Throttle:
    """The one rule for when a snapshot is sent (the trainer's reporter and the scale stand-in both use it)."""

    def __init__(self, min_interval: float = MIN_INTERVAL_S, slowdown: float = SLOWDOWN):
        self.min_interval, self.slowdown = min_interval, slowdown
        self.last_sent: Progress | None = None
        self.sent_at: float | None = None
        self.last_patch_s = 0.0

    def interval(self) -> float:
        return routine_interval(self.min_interval, self.last_patch_s, self.slowdown)

    def due(self, current: Progress, now: float) -> bool:
        previous = None if self.last_sent is None else self.last_sent.to_status()
        if self.sent_at is None or urgency(previous, current.to_status()) is not None:
            return True
        return now - self.sent_at >= self.interval()

    def sent(self, progress: Progress, at: float, took_s: float) -> None:
        """`progress` was sent at `at` (when its patch started) and its patch took `took_s`."""
        self.last_sent, self.sent_at, self.last_patch_s = progress, at, took_s


class KubernetesReporter:
    def __init__(
        self,
        patch: Patch,
        *,
        min_interval: float = MIN_INTERVAL_S,
        heartbeat_seconds: float | None = MAX_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._patch = patch
        self.throttle = Throttle(min_interval)
        self.clock = clock
        self.failures = 0
        self.sent = 0
        self._lock = threading.Lock()
        self._latest: Progress | None = None
        self._stop = threading.Event()
        self._heartbeat = None
        if heartbeat_seconds:
            self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_seconds,), daemon=True)
            self._heartbeat.start()

    @classmethod
    def from_environment(cls, **kwargs: Any) -> KubernetesReporter | None:
        """The reporter to the ConfigMap named by PPOJOB_PROGRESS_CONFIGMAP in PPOJOB_NAMESPACE, or None
        outside a job."""
        name, namespace = os.environ.get(ENV_PROGRESS_CONFIGMAP), os.environ.get("PPOJOB_NAMESPACE")
        if not name or not namespace:
            return None
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.CoreV1Api()

        def patch(body: dict[str, Any]) -> None:
            api.patch_namespaced_config_map(name, namespace, body, _content_type="application/merge-patch+json")

        return cls(patch, **kwargs)

    def report(self, progress: Progress) -> None:
        with self._lock:
            self._latest = progress
            if self.throttle.due(progress, self.clock()):
                self._send(progress)

    def event(self, kind: str, **fields: Any) -> None:
        """Events are not written to the PPOJob (the operator turns status changes into events)."""

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._latest is not None and self._latest is not self.throttle.last_sent:
                self._send(self._latest)

    def _beat(self, every: float) -> None:
        while not self._stop.wait(min(every, 1.0)):
            with self._lock:
                sent_at = self.throttle.sent_at
                stale = sent_at is not None and self.clock() - sent_at >= every
                if stale and self._latest is not None:
                    self._send(self._latest)

    def _send(self, progress: Progress) -> None:
        started = self.clock()
        try:
            self._patch(progress_patch(progress, now=utc_now()))
            self.sent += 1
        except Exception as exc:  # noqa: BLE001 (an API error must never stop training)
            self.failures += 1
            log.warning("could not report the progress (%s: %s); training goes on", type(exc).__name__, exc)
        self.throttle.sent(progress, started, self.clock() - started)
