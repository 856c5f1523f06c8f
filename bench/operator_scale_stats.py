"""Pure arithmetic of the scale benchmark: percentiles, Prometheus text, counter diffs, the table.

Nothing here talks to a cluster or reads a clock, so each piece is unit-tested
(`tests/unit/bench/test_operator_scale_stats.py`). Depends on the standard library only.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Iterable, Mapping

# `name{label="value",...} 123` (no timestamps on the API server's or controller-runtime's samples).
SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)$')
LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')

# API server traffic that is no job's: node heartbeats and leases, discovery, health checks.
BACKGROUND_RESOURCES = frozenset({"leases", "nodes", ""})


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between closest ranks; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def p50_p99(values: Iterable[float]) -> dict[str, float | int | None]:
    values = list(values)
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}


def parse_samples(text: str, metric: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of one metric in Prometheus text format, as (labels, value)."""
    samples = []
    for line in text.splitlines():
        match = SAMPLE.match(line.strip())
        if match and match["name"] == metric:
            labels = {m["key"]: m["value"] for m in LABEL.finditer(match["labels"] or "")}
            samples.append((labels, float(match["value"])))
    return samples


def sum_by(samples: Iterable[tuple[Mapping[str, str], float]], *keys: str) -> collections.Counter:
    """Values summed over every label but `keys` (one string key joined by spaces)."""
    total: collections.Counter = collections.Counter()
    for labels, value in samples:
        total[" ".join(labels.get(k, "") for k in keys).strip()] += value
    return total


def apiserver_requests(text: str) -> collections.Counter:
    """`apiserver_request_total` as 'VERB resource[/subresource]' -> requests (all codes, all clients)."""
    total: collections.Counter = collections.Counter()
    for labels, value in parse_samples(text, "apiserver_request_total"):
        resource = labels.get("resource", "")
        if labels.get("subresource") and resource:
            resource = f"{resource}/{labels['subresource']}"
        total[f"{labels.get('verb', '')} {resource}"] += value
    return total


def terminated_watchers(text: str) -> collections.Counter:
    """`apiserver_terminated_watchers_total` per resource: watches the API server ended because
    their client did not keep up (each must resume, and sees its events late)."""
    return sum_by(parse_samples(text, "apiserver_terminated_watchers_total"), "resource")


def diff(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """after - before per key, keeping only keys that grew."""
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v - before.get(k, 0) > 0}


def minus_idle(counts: Mapping[str, float], idle_rate: Mapping[str, float], seconds: float) -> dict[str, float]:
    """counts less what the same keys' idle rate (requests/s, measured just before) predicts for `seconds`."""
    rest = {k: v - idle_rate.get(k, 0) * seconds for k, v in counts.items()}
    return {k: v for k, v in rest.items() if v > 0}


def is_background(key: str) -> bool:
    """'VERB resource' of traffic that belongs to no job (see BACKGROUND_RESOURCES)."""
    resource = key.partition(" ")[2].split("/")[0]
    return resource in BACKGROUND_RESOURCES


def per_job(counts: Mapping[str, float], jobs: int) -> dict[str, float]:
    return {k: round(v / jobs, 2) for k, v in counts.items()}


def by_verb(counts: Mapping[str, float]) -> dict[str, float]:
    """'VERB resource' -> n summed per verb."""
    total: collections.Counter = collections.Counter()
    for key, value in counts.items():
        total[key.partition(" ")[0]] += value
    return dict(sorted(total.items()))


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        return f"{value:.0f}{unit}"
    if abs(value) >= 10:
        return f"{value:.1f}{unit}"
    return f"{value:.2f}{unit}"


def cpu_spent(before: Mapping[str, float | None], after: Mapping[str, float | None]) -> dict[str, float | None]:
    """Per process, the CPU seconds between two readings, and their total; None where a reading is
    missing or went down (the process was restarted in between), and then no total."""
    spent = {name: None if before.get(name) is None or after.get(name) is None or after[name] < before[name]
             else round(after[name] - before[name], 2) for name in before}
    parts = list(spent.values())
    return {**spent, "total": None if None in parts else round(sum(parts), 2)}


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


# (row label, key in a side's summary, unit); a side's summary is `summarize_side`'s result.
ROWS = (
    ("apply -> pod group + RayCluster created, p50", "created_p50", " s"),
    ("apply -> pod group + RayCluster created, p99", "created_p99", " s"),
    ("apply -> all pods Running, p50", "pods_running_p50", " s"),
    ("apply -> all pods Running, p99", "pods_running_p99", " s"),
    ("trainer report -> status shows it, p50", "status_lag_p50", " s"),
    ("trainer report -> status shows it, p99", "status_lag_p99", " s"),
    ("API requests per job (all clients)", "requests_per_job", ""),
    ("  without the trainer's own reports", "requests_per_job_without_reports", ""),
    ("job controller CPU s (ppo-operator | KubeRay)", "controller_cpu_s", " s"),
    ("  with KubeRay's RayCluster work", "stack_cpu_s", " s"),
    ("API server + etcd CPU s (all clients)", "control_plane_cpu_s", " s"),
    ("job controller peak RSS MiB", "controller_peak_rss_mib", ""),
    ("  with KubeRay's", "stack_peak_rss_mib", ""),
)


def render_table(results: Mapping[int, Mapping[str, Mapping[str, float | None]]]) -> str:
    """One block per size: PPOJob | RayJob | ratio, from {jobs: {"ppojob": summary, "rayjob": summary}}."""
    width = max(len(label) for label, _, _ in ROWS)
    lines = []
    for jobs, sides in sorted(results.items()):
        ours, theirs = sides.get("ppojob") or {}, sides.get("rayjob") or {}
        lines.append(f"{f'{jobs} jobs':<{width}}  {'PPOJob':>10}  {'RayJob':>10}  {'ratio':>7}")
        for label, key, unit in ROWS:
            a, b = ours.get(key), theirs.get(key)
            lines.append(f"{label:<{width}}  {fmt(a, unit):>10}  {fmt(b, unit):>10}  {fmt_ratio(ratio(a, b)):>7}")
        lines.append("")
    return "\n".join(lines)


def targets(results: Mapping[int, Mapping[str, Mapping[str, float | None]]]) -> list[tuple[str, bool | None, str]]:
    """The issue's three targets at the largest size: (target, met or None when unmeasured, figures)."""
    jobs = max(results)
    ours, theirs = results[jobs].get("ppojob") or {}, results[jobs].get("rayjob") or {}
    lag = ours.get("status_lag_p99")
    requests = ratio(ours.get("requests_per_job"), theirs.get("requests_per_job"))
    created = ratio(ours.get("created_p99"), theirs.get("created_p99"))
    return [
        (f"status lag p99 < 2 s at {jobs} jobs", None if lag is None else lag < 2, f"{fmt(lag, ' s')}"),
        (f"API requests per job <= RayJob's at {jobs} jobs", None if requests is None else requests <= 1,
         f"{fmt_ratio(requests)}"),
        (f"apply -> created p99 <= 1.5x RayJob's at {jobs} jobs", None if created is None else created <= 1.5,
         f"{fmt_ratio(created)}"),
    ]
