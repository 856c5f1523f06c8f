"""The operator's Prometheus endpoint serves its API request counts."""

from __future__ import annotations

import collections
import urllib.request

from ppo_operator import metrics


def test_metrics_endpoint_serves_request_counts():
    counts = collections.Counter({"POST rayclusters": 2, "PATCH ppojobs/status": 5})
    server = metrics.serve(0, counts, host="127.0.0.1")
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    assert 'ppojob_operator_api_requests_total{verb="POST",resource="rayclusters"} 2' in body
    assert 'ppojob_operator_api_requests_total{verb="PATCH",resource="ppojobs/status"} 5' in body
