"""The operator's Prometheus metrics (`--metrics-port`), through prometheus_client.

What each one counts, and where it is observed:

* `ppojob_operator_api_requests_total{verb,resource}`: the requests `Kube` sent (its `counts`,
  read at each scrape); kopf's own watch and event requests are not among them.
* `ppojob_operator_reconcile_duration_seconds`: one observation per pass of a job's loop
  (`handlers.run_job`), failed passes included.
* `ppojob_operator_ppojobs{phase}`: the PPOJobs the operator's watch shows, by `status.phase`
  (every phase of the vocabulary, zeros included; a job not yet given a phase is in none). All
  zeros while the replica stands by, so that a sum over replicas counts each job once.
* `ppojob_operator_serving`: 1 while this replica serves its jobs, 0 while it stands by (peering:
  another replica leads).
* `ppojob_operator_watch_restarts_total{resource,reason}`: kopf's watch streams that started again:
  `Gone` (410, the resource version expired: kopf lists again) or `Inactive` (no event within
  kopf's inactivity timeout: it reconnects). Read from kopf's own debug records of them.
* `ppojob_operator_trainer_reports_total{outcome}`: trainers' reports `folded` into a PPOJob's
  status (a watched change of `status.progress`, which only the operator writes) and `refused`
  by the API server (each one is a ReportRefused Event).

Depends on prometheus_client, kopf (the PPOJob watch handler) and the API vocabulary.
"""

from __future__ import annotations

import collections
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIServer

import kopf
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ppo_operator.events import Event
from ppojob_api.vocabulary import GROUP, PLURAL, VERSION, Phase, Reason

FOLDED, REFUSED = "folded", "refused"

RECONCILE_SECONDS = Histogram(
    "ppojob_operator_reconcile_duration_seconds", "Seconds one pass of a job's reconcile loop took.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0), registry=None,
)
WATCH_RESTARTS = Counter(
    "ppojob_operator_watch_restarts", "kopf watch streams started again, by resource and reason (Gone: a relist; "
    "Inactive: a reconnect).", ["resource", "reason"], registry=None,
)
TRAINER_REPORTS = Counter(
    "ppojob_operator_trainer_reports", "Trainer reports folded into a PPOJob's status, or refused by the API server.",
    ["outcome"], registry=None,
)

# kopf's records of a watch stream ending to start again (kopf/_cogs/clients/watching.py, kopf 1.45).
WATCH_LOGGER = "kopf._cogs.clients.watching"
WATCH_RESTART_RECORDS = (
    (re.compile(r"^Restarting the watch-stream for (\S+) "), "Gone"),
    (re.compile(r"^Watch-stream for (\S+) .* is inactive, reconnecting\."), "Inactive"),
)


class JobPhases:
    """Each PPOJob's phase and trainer report as the watch last showed them (fed by `register`)."""

    def __init__(self) -> None:
        self._jobs: dict[tuple[str, str], tuple[str | None, Mapping[str, Any] | None]] = {}

    def watched(self, event_type: str | None, key: tuple[str, str], status: Mapping[str, Any]) -> None:
        """A watch event of the job (type None: kopf's listing). A MODIFIED event whose report differs
        from the one seen before is a report folded; a listing after a pause or a relist is not
        counted, since the change may be another replica's."""
        if event_type == "DELETED":
            self._jobs.pop(key, None)
            return
        phase, progress = status.get("phase"), status.get("progress")
        before = self._jobs.get(key)
        if event_type == "MODIFIED" and before is not None and progress is not None and progress != before[1]:
            TRAINER_REPORTS.labels(outcome=FOLDED).inc()
        self._jobs[key] = (phase, progress)

    def counts(self) -> dict[str, int]:
        """PPOJobs by phase, every phase of the vocabulary present."""
        counts = dict.fromkeys((p.value for p in Phase), 0)
        for phase, _ in list(self._jobs.values()):
            if phase in counts:
                counts[phase] += 1
        return counts


class OperatorCollector(Collector):
    """The metrics read at scrape time: API requests from `Kube.counts`, PPOJobs by phase, serving."""

    def __init__(self, api_counts: collections.Counter[str], phases: JobPhases,
                 serving: Callable[[], bool]) -> None:
        self.api_counts, self.phases, self.serving = api_counts, phases, serving

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("ppojob_operator_api_requests", "API requests the reconcile made, by verb and "
                                       "resource.", labels=["verb", "resource"])
        for key, value in sorted(self.api_counts.copy().items()):
            verb, _, resource = key.partition(" ")
            requests.add_metric([verb, resource], value)
        yield requests
        serving = self.serving()
        yield GaugeMetricFamily("ppojob_operator_serving", "1 while this replica serves its jobs, 0 while it "
                                "stands by.", value=int(serving))
        jobs = GaugeMetricFamily("ppojob_operator_ppojobs", "PPOJobs the operator's watch shows, by status.phase "
                                 "(zeros while standing by).", labels=["phase"])
        for phase, count in self.phases.counts().items():
            jobs.add_metric([phase], count if serving else 0)
        yield jobs


def build_registry(*, api_counts: collections.Counter[str], phases: JobPhases,
                   serving: Callable[[], bool] = lambda: True) -> CollectorRegistry:
    """A registry of everything above, and the process's CPU, memory and open files. `serving`:
    whether this replica serves its jobs now (`Leadership.is_serving`)."""
    registry = CollectorRegistry()
    for collector in (RECONCILE_SECONDS, WATCH_RESTARTS, TRAINER_REPORTS,
                      OperatorCollector(api_counts, phases, serving)):
        registry.register(collector)
    ProcessCollector(registry=registry)
    return registry


def serve(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> WSGIServer:
    """/metrics on `port` from a daemon thread (`shutdown()` stops it)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server


def count_event(event: Event) -> None:
    """Every Event the reconcile posts goes past here: a ReportRefused one is a refused report."""
    if event.reason == Reason.REPORT_REFUSED.value:
        TRAINER_REPORTS.labels(outcome=REFUSED).inc()


class WatchRestartFilter(logging.Filter):
    """Counts kopf's records of a watch stream starting again; lets through only what the operator's
    log level would show (the filter needs kopf's watch logger at DEBUG, where these records are)."""

    def __init__(self, *, shown_level: int) -> None:
        super().__init__()
        self.shown_level = shown_level

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        for pattern, reason in WATCH_RESTART_RECORDS:
            if (match := pattern.match(message)) is not None:
                WATCH_RESTARTS.labels(resource=match.group(1), reason=reason).inc()
        return record.levelno >= self.shown_level


def count_watch_restarts(*, shown_level: int) -> WatchRestartFilter:
    """Install the counting filter on kopf's watch logger (its records are DEBUG: the logger must make them)."""
    watch_filter = WatchRestartFilter(shown_level=shown_level)
    logger = logging.getLogger(WATCH_LOGGER)
    logger.setLevel(logging.DEBUG)
    logger.addFilter(watch_filter)
    return watch_filter


def register(registry: kopf.OperatorRegistry, phases: JobPhases) -> None:
    """A PPOJob watch handler that keeps `phases` as the watch shows the jobs."""

    @kopf.on.event(GROUP, VERSION, PLURAL, registry=registry, id="metrics_phases")
    def ppojob_phases(event: kopf.RawEvent, namespace: str, name: str, status: kopf.Status, **_: Any) -> None:
        phases.watched(event.get("type"), (namespace, name), status)
