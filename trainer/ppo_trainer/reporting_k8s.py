"""The PPOJob status reporter: the trainer merge-patches `status.progress` of its own PPOJob.

Throttled: at most one patch per `min_interval` seconds, except the changes that matter (a
critic-only warm-up step is done, a checkpoint is written, the run finishes or fails), which are
sent at once; a throttled snapshot is sent by the next report after the interval, by the heartbeat
thread, or on close. A new step after the warm-up is not urgent: with steps shorter than the
interval, its status would otherwise be written once a step, and at hundreds of jobs those writes
are the API server's largest load (docs/scale.md); `kubectl get` shows the step up to
`min_interval` late instead.
The heartbeat re-sends the latest snapshot with a fresh `heartbeatTime` when nothing was sent for
`heartbeat_seconds`, so the operator can tell a live trainer in a long stage from a dead one.
It never crashes training: API errors are logged and counted, and the run goes on. The
transport is a plain function (`patch(body)`), so tests can record it; `from_environment` builds
the real one from PPOJOB_NAME, PPOJOB_NAMESPACE and in-cluster config or KUBECONFIG.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ppo_trainer.reporting import Progress, utc_now
from ppojob_api.vocabulary import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)

Patch = Callable[[dict[str, Any]], None]
MIN_INTERVAL_S = 10.0
"""The least time between two snapshots that are not urgent."""


def status_patch(progress: Progress, *, now: str) -> dict[str, Any]:
    """The merge-patch body for the status subresource; `error: None` clears an older attempt's error."""
    body = {**progress.to_status(), "heartbeatTime": now}
    body.setdefault("error", None)
    return {"status": {"progress": body}}


def urgency(previous: Progress | None, current: Progress) -> str | None:
    """Why this snapshot must go out now (its reason), or None when it may wait for the interval.
    Each urgent change is one the operator acts on or tells as an Event: the warm-up count moves
    the job to Training at N of N."""
    if previous is None:
        return "first report"
    if current.error is not None and current.error != previous.error:
        return "error"
    if current.finished and not previous.finished:
        return "finished"
    if current.last_checkpoint != previous.last_checkpoint:
        return "checkpoint"
    if current.critic_only_steps_done != previous.critic_only_steps_done:
        return "warm-up step"
    return None


def due(previous: Progress | None, sent_at: float | None, current: Progress, now: float, min_interval: float) -> bool:
    """Whether `current` is sent now, given the last snapshot sent and when (the one throttling rule)."""
    return urgency(previous, current) is not None or sent_at is None or now - sent_at >= min_interval


class KubernetesReporter:
    def __init__(
        self,
        patch: Patch,
        *,
        min_interval: float = MIN_INTERVAL_S,
        heartbeat_seconds: float | None = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._patch = patch
        self.min_interval = min_interval
        self.clock = clock
        self.failures = 0
        self.sent = 0
        self._lock = threading.Lock()
        self._last_sent_at: float | None = None
        self._last_sent: Progress | None = None
        self._latest: Progress | None = None
        self._stop = threading.Event()
        self._heartbeat = None
        if heartbeat_seconds:
            self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_seconds,), daemon=True)
            self._heartbeat.start()

    @classmethod
    def from_environment(cls, **kwargs: Any) -> KubernetesReporter | None:
        """The reporter of the PPOJob named by PPOJOB_NAME / PPOJOB_NAMESPACE, or None outside a job."""
        name, namespace = os.environ.get("PPOJOB_NAME"), os.environ.get("PPOJOB_NAMESPACE")
        if not name or not namespace:
            return None
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.CustomObjectsApi()

        def patch(body: dict[str, Any]) -> None:
            api.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, body, _content_type="application/merge-patch+json"
            )

        return cls(patch, **kwargs)

    def report(self, progress: Progress) -> None:
        with self._lock:
            self._latest = progress
            if due(self._last_sent, self._last_sent_at, progress, self.clock(), self.min_interval):
                self._send(progress)

    def event(self, kind: str, **fields: Any) -> None:
        """Events are not written to the PPOJob (the operator turns status changes into events)."""

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            if self._latest is not None and self._latest is not self._last_sent:
                self._send(self._latest)

    def _beat(self, every: float) -> None:
        while not self._stop.wait(min(every, 1.0)):
            with self._lock:
                stale = self._last_sent_at is not None and self.clock() - self._last_sent_at >= every
                if stale and self._latest is not None:
                    self._send(self._latest)

    def _send(self, progress: Progress) -> None:
        try:
            self._patch(status_patch(progress, now=utc_now()))
            self.sent += 1
        except Exception as exc:  # noqa: BLE001 (an API error must never stop training)
            self.failures += 1
            log.warning("could not patch the PPOJob status (%s: %s); training goes on", type(exc).__name__, exc)
        self._last_sent_at = self.clock()
        self._last_sent = progress
