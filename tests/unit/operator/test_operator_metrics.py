"""The operator's Prometheus metrics: what /metrics serves, and what moves each one."""

from __future__ import annotations

import collections
import inspect
import logging
import urllib.request

import kopf._cogs.clients.watching as kopf_watching
import pytest
from kopf._cogs.structs.references import Resource
from prometheus_client.parser import text_string_to_metric_families

from ppo_operator import metrics
from ppo_operator.events import Event, compute_refused_report_event
from ppojob_api.vocabulary import Phase


def samples(registry) -> dict[tuple[str, tuple], float]:
    """Every sample of the registry's exposition, read back with prometheus_client's own parser."""
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(registry, name: str, **labels: str) -> float:
    return samples(registry).get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def phases() -> metrics.JobPhases:
    return metrics.JobPhases()


def test_metrics_endpoint_serves_request_counts_histogram_and_phases(phases):
    counts = collections.Counter({"POST rayclusters": 2, "PATCH ppojobs/status": 5})
    phases.watched(None, ("ns", "a"), {"phase": Phase.TRAINING.value})
    server = metrics.serve(0, metrics.build_registry(api_counts=counts, phases=phases), host="127.0.0.1")
    try:
        counts["POST rayclusters"] += 1  # read at scrape time, not at registration
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read().decode()
    finally:
        server.shutdown()
    assert 'ppojob_operator_api_requests_total{resource="rayclusters",verb="POST"} 3.0' in body
    assert 'ppojob_operator_api_requests_total{resource="ppojobs/status",verb="PATCH"} 5.0' in body
    assert 'ppojob_operator_ppojobs{phase="Training"} 1.0' in body
    assert 'ppojob_operator_ppojobs{phase="Pending"} 0.0' in body
    assert "# TYPE ppojob_operator_reconcile_duration_seconds histogram" in body
    assert "process_cpu_seconds_total" in body


def test_reconcile_histogram_counts_each_pass(phases):
    registry = metrics.build_registry(api_counts=collections.Counter(), phases=phases)
    name = "ppojob_operator_reconcile_duration_seconds"
    before = {le: value(registry, f"{name}_bucket", le=le) for le in ("0.25", "0.5")}
    count = value(registry, f"{name}_count")
    with metrics.RECONCILE_SECONDS.time():  # a pass of microseconds
        pass
    metrics.RECONCILE_SECONDS.observe(0.3)
    assert value(registry, f"{name}_count") == count + 2
    assert value(registry, f"{name}_bucket", le="0.25") == before["0.25"] + 1
    assert value(registry, f"{name}_bucket", le="0.5") == before["0.5"] + 2


def test_phase_gauge_follows_the_watch(phases):
    registry = metrics.build_registry(api_counts=collections.Counter(), phases=phases)
    phases.watched(None, ("ns", "a"), {})  # listed before its first status write: in no phase
    phases.watched("ADDED", ("ns", "b"), {"phase": Phase.PENDING.value})
    assert value(registry, "ppojob_operator_ppojobs", phase="Pending") == 1
    phases.watched("MODIFIED", ("ns", "a"), {"phase": Phase.PENDING.value})
    phases.watched("MODIFIED", ("ns", "b"), {"phase": Phase.TRAINING.value})
    assert value(registry, "ppojob_operator_ppojobs", phase="Pending") == 1
    assert value(registry, "ppojob_operator_ppojobs", phase="Training") == 1
    phases.watched("DELETED", ("ns", "b"), {"phase": Phase.TRAINING.value})
    assert value(registry, "ppojob_operator_ppojobs", phase="Training") == 0
    assert sum(phases.counts().values()) == 1
    assert set(phases.counts()) == {p.value for p in Phase}


def test_a_standby_replica_says_so_and_counts_no_jobs(phases):
    serving = [False]
    registry = metrics.build_registry(api_counts=collections.Counter(), phases=phases, serving=lambda: serving[0])
    phases.watched("ADDED", ("ns", "a"), {"phase": Phase.TRAINING.value})
    assert value(registry, "ppojob_operator_serving") == 0
    assert value(registry, "ppojob_operator_ppojobs", phase="Training") == 0
    serving[0] = True  # took over: the watch's view counts again
    assert value(registry, "ppojob_operator_serving") == 1
    assert value(registry, "ppojob_operator_ppojobs", phase="Training") == 1


def test_folded_reports_are_changes_of_the_watched_progress(phases):
    registry = metrics.build_registry(api_counts=collections.Counter(), phases=phases)

    def folded() -> float:
        return value(registry, "ppojob_operator_trainer_reports_total", outcome="folded")

    start = folded()
    phases.watched(None, ("ns", "a"), {"phase": "Training", "progress": {"step": 1}})  # listed: not a fold
    phases.watched("MODIFIED", ("ns", "a"), {"phase": "Training", "progress": {"step": 1}, "message": "m"})
    assert folded() == start
    phases.watched("MODIFIED", ("ns", "a"), {"phase": "Training", "progress": {"step": 2}})
    assert folded() == start + 1
    phases.watched(None, ("ns", "a"), {"phase": "Training", "progress": {"step": 5}})  # a relist: maybe another replica's
    assert folded() == start + 1
    phases.watched("MODIFIED", ("ns", "b"), {"phase": "Training", "progress": {"step": 3}})  # first sighting
    assert folded() == start + 1


def test_refused_reports_are_counted_from_their_events(phases):
    registry = metrics.build_registry(api_counts=collections.Counter(), phases=phases)
    start = value(registry, "ppojob_operator_trainer_reports_total", outcome="refused")
    metrics.count_event(compute_refused_report_event('{"message": "progress.step: Invalid value"}'))
    metrics.count_event(Event("Normal", "Created", "created RayCluster x"))
    assert value(registry, "ppojob_operator_trainer_reports_total", outcome="refused") == start + 1


def test_watch_restarts_counted_from_kopfs_records_and_hidden_at_info(phases, caplog):
    registry = metrics.build_registry(api_counts=collections.Counter(), phases=phases)
    logger = logging.getLogger(metrics.WATCH_LOGGER)
    level = logger.level
    watch_filter = metrics.count_watch_restarts(shown_level=logging.INFO)
    try:
        resource = str(Resource("ppojob.io", "v1", "ppojobs"))
        gone = value(registry, "ppojob_operator_watch_restarts_total", resource=resource, reason="Gone")
        inactive = value(registry, "ppojob_operator_watch_restarts_total", resource=resource, reason="Inactive")
        with caplog.at_level(logging.DEBUG):
            logger.debug(f"Restarting the watch-stream for {resource} cluster-wide.")
            logger.debug(f"Watch-stream for {resource} in 'team-a' is inactive, reconnecting.")
            logger.debug(f"Starting the watch-stream for {resource} cluster-wide.")
            logger.warning("Ignoring an unsupported event type: {}")
        assert value(registry, "ppojob_operator_watch_restarts_total", resource=resource, reason="Gone") == gone + 1
        assert value(registry, "ppojob_operator_watch_restarts_total", resource=resource, reason="Inactive") == inactive + 1
        assert [r.levelname for r in caplog.records if r.name == metrics.WATCH_LOGGER] == ["WARNING"]
    finally:
        logger.removeFilter(watch_filter)
        logger.setLevel(level)


def test_kopf_still_writes_the_watch_records_counted():
    """The counter reads kopf's own words (kopf is pinned): a kopf that words them otherwise fails here."""
    source = inspect.getsource(kopf_watching)
    assert kopf_watching.logger.name == metrics.WATCH_LOGGER
    assert 'logger.debug(f"Restarting the watch-stream for {resource} {where}.")' in source
    assert 'logger.debug(f"Watch-stream for {resource} {where} is inactive, reconnecting.")' in source
    assert " " not in str(Resource("", "v1", "pods"))  # the resource is one word of the record
