"""The scale benchmark's arithmetic: percentiles, Prometheus parsing, idle subtraction, targets."""

import operator_scale_stats as stats
import pytest
from operator_scale_standin import expected_phase, parse_registration, progress_at, snapshots

from ppo_trainer.reporting.kubernetes import Throttle

APISERVER = """\
# HELP apiserver_request_total [STABLE] Counter of apiserver requests
# TYPE apiserver_request_total counter
apiserver_request_total{code="201",component="apiserver",dry_run="",group="ray.io",resource="rayclusters",scope="resource",subresource="",verb="POST",version="v1"} 10
apiserver_request_total{code="409",component="apiserver",dry_run="",group="ray.io",resource="rayclusters",scope="resource",subresource="",verb="POST",version="v1"} 2
apiserver_request_total{code="200",component="apiserver",dry_run="",group="ppojob.io",resource="ppojobs",scope="resource",subresource="status",verb="PATCH",version="v1alpha1"} 7
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="resource",subresource="",verb="PUT",version="v1"} 99
apiserver_request_total{code="200",component="",dry_run="",group="",resource="",scope="",subresource="/healthz",verb="GET",version=""} 1
apiserver_request_duration_seconds_count{verb="POST"} 5
"""


def test_percentile_interpolates_between_ranks():
    assert stats.percentile([], 50) is None
    assert stats.percentile([3.0], 99) == 3.0
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5
    assert stats.percentile(range(101), 99) == pytest.approx(99.0)
    assert stats.p50_p99([2, 1]) == {"p50": 1.5, "p99": pytest.approx(1.99), "n": 2}


def test_apiserver_requests_sum_codes_and_join_subresources():
    counts = stats.apiserver_requests(APISERVER)
    assert counts == {"POST rayclusters": 12, "PATCH ppojobs/status": 7, "PUT leases": 99, "GET ": 1}
    assert stats.is_background("PUT leases") and stats.is_background("GET ")
    assert not stats.is_background("PATCH ppojobs/status")


def test_controller_runtime_requests_by_method():
    text = 'rest_client_requests_total{code="200",host="127.0.0.1:16443",method="GET"} 3\n' \
           'rest_client_requests_total{code="201",host="127.0.0.1:16443",method="POST"} 2\n' \
           'rest_client_requests_total{code="200",host="127.0.0.1:16443",method="GET"} 1\n'
    assert stats.sum_by(stats.parse_samples(text, "rest_client_requests_total"), "method") == {"GET": 4, "POST": 2}


def test_terminated_watchers_per_resource():
    text = 'apiserver_terminated_watchers_total{group="ppojob.io",resource="ppojobs"} 6\n' \
           'apiserver_terminated_watchers_total{group="",resource="pods"} 1\n'
    assert stats.terminated_watchers(text) == {"ppojobs": 6, "pods": 1}


def test_diff_keeps_what_grew_and_idle_rate_is_taken_off():
    grown = stats.diff({"POST pods": 30, "GET pods": 5, "PUT leases": 40}, {"POST pods": 10, "GET pods": 5})
    assert grown == {"POST pods": 20, "PUT leases": 40}
    assert stats.minus_idle(grown, {"PUT leases": 2.0, "POST pods": 0.5}, 20) == {"POST pods": 10}
    assert stats.by_verb({"POST pods": 2, "POST events": 3, "PATCH events": 1}) == {"PATCH": 1, "POST": 5}


def test_cpu_spent_per_process_and_in_all_unless_one_was_restarted():
    assert stats.cpu_spent({"kube-apiserver": 10.0, "etcd": 2.5}, {"kube-apiserver": 70.25, "etcd": 9.0}) == {
        "kube-apiserver": 60.25, "etcd": 6.5, "total": 66.75}
    restarted = stats.cpu_spent({"kube-apiserver": 10.0, "etcd": 2.5}, {"kube-apiserver": 3.0, "etcd": None})
    assert restarted == {"kube-apiserver": None, "etcd": None, "total": None}


def test_table_has_ratios_and_targets_judge_the_largest_size():
    ours = {"created_p99": 0.3, "requests_per_job": 50, "status_lag_p99": 1.0}
    theirs = {"created_p99": 0.3, "requests_per_job": 100, "status_lag_p99": None}
    table = stats.render_table({10: {"ppojob": ours, "rayjob": theirs}})
    assert "0.50x" in table and "n/a" in table
    slow = {"created_p99": 0.9, "requests_per_job": 150, "status_lag_p99": 3.0}
    verdicts = stats.targets({10: {"ppojob": ours, "rayjob": theirs}, 500: {"ppojob": slow, "rayjob": theirs}})
    assert [ok for _, ok, _ in verdicts] == [False, False, False]
    assert [ok for _, ok, _ in stats.targets({10: {"ppojob": ours, "rayjob": theirs}})] == [True, True, True]


def test_standin_reports_like_the_trainer_and_names_the_phase_it_expects():
    registration = parse_registration("ns j0001 0 j0001-progress /tmp/state/ns/j0001 uid/a0\n")
    assert (registration.namespace, registration.name, registration.attempt) == ("ns", "j0001", 0)
    assert registration.progress_configmap == "j0001-progress" and str(registration.folder).endswith("j0001 uid/a0")
    status = progress_at(1, steps=6, warmup=1, attempt=0).to_status()
    assert status["steps"] == "1/6" and status["warmup"] == "1/1" and status["criticOnlyStepsDone"] == 1
    assert progress_at(6, steps=6, warmup=1, attempt=0, finished=True).to_status()["finished"] is True
    assert [expected_phase(s, warmup=1, finished=False) for s in (0, 1, 2)] == [None, "Training", None]
    assert expected_phase(6, warmup=1, finished=True) == "Succeeded"


def test_standin_throttles_its_reports_as_the_trainer_does():
    """Steps of 5 s under the trainer's throttle: the start, the end of the warm-up and the end at
    once; the other steps at most one per 10 s with a quick API server, none when it is slow;
    with no throttle, one report a step."""
    def sent(min_interval, patch_s, slowdown=50.0):
        throttle, out = Throttle(min_interval, slowdown), []
        for at, p in snapshots(steps=6, warmup=1, attempt=0, every=5.0):
            if throttle.due(p, at):
                throttle.sent(p, at, patch_s)
                out.append((at, p.step, p.finished))
        return out

    assert sent(10.0, 0.05) == [(0, 0, False), (5, 1, False), (15, 3, False), (25, 5, False), (30, 6, True)]
    assert sent(10.0, 1.0) == [(0, 0, False), (5, 1, False), (30, 6, True)]  # 30 s between routine reports
    assert sent(0.0, 1.0, slowdown=0.0) == [(5.0 * s, s, False) for s in range(7)] + [(30, 6, True)]
