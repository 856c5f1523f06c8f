"""The PPOJob status reporter: the trainer merge-patches `status.progress` of its own PPOJob.

Throttled: at most one patch per `min_interval` seconds, except the changes that matter (a step
starts, a checkpoint is written, the run finishes or fails), which are sent at once; a throttled
snapshot is sent by the next report after the interval, by the heartbeat thread, or on close.
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
from ppojob_api.vocabulary import GROUP, PLURAL, VERSION, Stage

log = logging.getLogger(__name__)

Patch = Callable[[dict[str, Any]], None]


def status_patch(progress: Progress, *, now: str) -> dict[str, Any]:
    """The merge-patch body for the status subresource; `error: None` clears an older attempt's error."""
    body = {**progress.to_status(), "heartbeatTime": now}
    body.setdefault("error", None)
    return {"status": {"progress": body}}


def _matters(previous: Progress | None, current: Progress) -> str | None:
    """Why this snapshot must go out now (its reason), or None when it may wait."""
    if previous is None:
        return "first report"
    if current.error is not None and current.error != previous.error:
        return "error"
    if current.finished and not previous.finished:
        return "finished"
    if current.last_checkpoint != previous.last_checkpoint:
        return "checkpoint"
    if current.stage == Stage.GENERATE and (previous.stage != Stage.GENERATE or previous.step != current.step):
        return "step start"
    return None


class KubernetesReporter:
    def __init__(
        self,
        patch: Patch,
        *,
        min_interval: float = 10.0,
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
            urgent = _matters(self._last_sent, progress)
            due = self._last_sent_at is None or self.clock() - self._last_sent_at >= self.min_interval
            if urgent or due:
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
