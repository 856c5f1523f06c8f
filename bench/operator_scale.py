"""PPOJobs at scale on the local cluster, side by side with KubeRay's RayJob (issue #7).

    .venv/bin/python bench/operator_scale.py --jobs 10,100,500 [--every 5 --steps 6 --out DIR]

For each size N, two phases one after the other on the same pool of fake GPU nodes, each in a
fresh namespace, with a fresh KubeRay operator (and, for PPOJobs, a fresh ppo-operator and trainer
stand-in): apply N objects at once, let every one run to its end, delete them all, wait until
every child is gone. Measured per phase: apply -> pod group and RayCluster created and -> all pods
Running (p50, p99, first sightings by our own watches); trainer report -> the PPOJob's phase
showing it (p50, p99); API requests per job by verb and resource from the API server's own
`apiserver_request_total` (diffed around the phase); the controllers' CPU seconds and peak RSS
from /proc. Writes `scale.json` and `scale.txt` (the table: PPOJob | RayJob | ratio) into --out.

The cluster lock (/tmp/ppojob-cluster.lock, shared with the other tests of this machine) is held
for one size at a time (both of its phases), never across sizes. What is a stand-in, and why:
docs/scale.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import fcntl
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import operator_scale_manifests as manifests
import operator_scale_procs as procs
import operator_scale_stats as stats
from operator_scale_kube import Api, ApiError, Sightings, collection_path, watch
from operator_scale_standin import STANDIN_COMMAND

from local_cluster import LocalCluster
from local_cluster import manifests as cluster_manifests
from ppojob_api.progress import MIN_INTERVAL_S, SLOWDOWN

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "ppojobs.ppojob.io.yaml"
LOCK = Path("/tmp/ppojob-cluster.lock")
CONTROL_PLANE_NICE = -10
"""The API server and etcd run ahead of everything else on this machine's two cores, as on the
control-plane machines of a real cluster, where neither the kubelets, the operators nor 500
trainers take CPU from them (docs/scale.md, session 7)."""


class Kind:
    """What differs between the two sides: the job resource, the label on its children, its pod count."""

    def __init__(self, name: str, group: str, version: str, plural: str, label: str, pods: int, running: set[str],
                 finished: set[str]):
        self.name, self.group, self.version, self.plural = name, group, version, plural
        self.label, self.pods, self.running, self.finished = label, pods, running, finished

    def phase_of(self, body: dict) -> str | None:
        status = body.get("status") or {}
        return status.get("phase") if self.name == "ppojob" else status.get("jobDeploymentStatus")


PPOJOB = Kind("ppojob", "ppojob.io", "v1alpha1", "ppojobs", "ppojob.io/job-name", pods=2,
              running={"CriticWarmup", "Training", "Succeeded"}, finished={"Succeeded", "Failed"})
RAYJOB = Kind("rayjob", "ray.io", "v1", "rayjobs", manifests.JOB_LABEL, pods=3,
              running={"Running", "Complete", "Failed"}, finished={"Complete", "Failed", "ValidationFailed"})
CHILDREN = {  # what we watch in a phase's namespace: (group, version, plural)
    "podgroup": ("scheduling.x-k8s.io", "v1alpha1", "podgroups"),
    "raycluster": ("ray.io", "v1", "rayclusters"),
    "pod": ("", "v1", "pods"),
}


def record(kind: Kind, sightings: Sightings, what: str):
    """The watch handler of one resource: first sightings per job, and which objects exist now."""

    def handle(event: str, body: dict, seen: float) -> None:
        meta = body["metadata"]
        job = meta["name"] if what == "job" else (meta.get("labels") or {}).get(kind.label)
        if job is None:
            return
        live = sightings.live.setdefault(what, set())
        if event == "DELETED":
            live.discard(meta["name"])
            return
        live.add(meta["name"])
        sightings.saw(job, what, seen)
        status = body.get("status") or {}
        if what == "job" and kind.phase_of(body):
            sightings.saw(job, f"phase:{kind.phase_of(body)}", seen)
            progress = status.get("progress") or {}
            sightings.saw(job, f"report:{progress.get('step')}:{bool(progress.get('finished'))}", seen)
        elif what == "raycluster" and status.get("state") == "ready":
            sightings.saw(job, "cluster_ready", seen)
        elif what == "pod" and status.get("phase") in ("Running", "Succeeded"):
            running = sightings.running_pods.setdefault(job, set())
            running.add(meta["name"])
            if len(running) >= kind.pods:
                sightings.saw(job, "pods_running", seen)

    return handle


async def wait_until(what: str, done, describe, timeout: float, say) -> bool:
    """Poll `done()` (a cheap in-memory check) every 0.5 s, saying `describe()` every 15 s; False on timeout."""
    start = last = time.monotonic()
    while time.monotonic() - start < timeout:
        if done():
            return True
        if time.monotonic() - last >= 15:
            say(f"  ... {what}: {describe()} ({time.monotonic() - start:.0f} s)")
            last = time.monotonic()
        await asyncio.sleep(0.5)
    say(f"  !! timed out after {timeout:.0f} s waiting for {what}")
    return False


async def ensure_namespace(api: Api, namespace: str) -> None:
    try:
        await api.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
    except ApiError as exc:
        if exc.status != 409:
            raise
    for _ in range(120):  # pods need the namespace's default ServiceAccount
        try:
            await api.request("GET", f"/api/v1/namespaces/{namespace}/serviceaccounts/default")
            return
        except ApiError:
            await asyncio.sleep(0.25)


async def terminating_namespaces(api: Api) -> list[str]:
    """Other namespaces being deleted: their namespace controller's retries are noise in the counts."""
    return [n["metadata"]["name"] for n in await api.items("/api/v1/namespaces")
            if (n.get("status") or {}).get("phase") == "Terminating"]


async def delete_namespace(api: Api, namespace: str, timeout: float = 180) -> None:
    await api.delete(f"/api/v1/namespaces/{namespace}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            await api.request("GET", f"/api/v1/namespaces/{namespace}")
        except ApiError as exc:
            if exc.status == 404:
                return
        await asyncio.sleep(1)


async def apply_jobs(api: Api, kind: Kind, namespace: str, names: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Create every job at once (64 requests in flight); the monotonic time each create returned."""
    applied: dict[str, float] = {}
    gate = asyncio.Semaphore(64)
    path = collection_path(kind.group, kind.version, kind.plural, namespace)

    async def one(name: str) -> None:
        async with gate:
            if kind is PPOJOB:
                await api.create(path, manifests.ppojob(name, steps=args.steps, warmup=args.warmup))
                applied[name] = time.monotonic()
                return
            created = await api.create(path, manifests.rayjob(name))
            applied[name] = time.monotonic()
            await api.create(collection_path(*CHILDREN["podgroup"], namespace), manifests.rayjob_pod_group(name, created))

    await asyncio.gather(*(one(name) for name in names))
    return applied


async def run_to_end(api: Api, kind: Kind, namespace: str, names: list[str], sightings: Sightings, *, life_s: float,
                     timeout: float, say) -> bool:
    """Delete each job once it has finished, or (a RayJob, which cannot finish here) once it has run `life_s`.

    A PPOJob ends by itself: its stand-in reports `finished` after its steps. A RayJob's Ray job
    status comes from the Ray dashboard, which does not exist under KWOK: KubeRay retries it with
    exponential backoff and ends the RayJob only minutes later. So a RayJob is deleted as a user
    deletes a running one, after the same time its PPOJob counterpart reports for. True when all went.
    """
    path = collection_path(kind.group, kind.version, kind.plural, namespace)
    pending, deletions = set(names), []
    start = last = time.monotonic()
    while pending and time.monotonic() - start < timeout:
        now = time.monotonic()
        for name in sorted(pending):
            running = sightings.at(name, "phase:Running") if kind is RAYJOB else None
            if any(sightings.at(name, f"phase:{p}") for p in kind.finished) or (running and now - running >= life_s):
                pending.discard(name)
                deletions.append(asyncio.create_task(api.delete(f"{path}/{name}")))
        if now - last >= 15:
            ready = sum(bool(sightings.at(n, "pods_running")) for n in names)
            say(f"  ... {len(names) - len(pending)} ended and deleted, {ready} had all pods Running ({now - start:.0f} s)")
            last = now
        await asyncio.sleep(0.5)
    for name in pending:  # timed out: delete them anyway, so the phase cleans up
        deletions.append(asyncio.create_task(api.delete(f"{path}/{name}")))
    await asyncio.gather(*deletions)
    if pending:
        say(f"  !! {len(pending)} jobs had not ended after {timeout:.0f} s")
    return not pending


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def read_reports(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


async def run_phase(cluster, api: Api, kind: Kind, jobs: int, args: argparse.Namespace, say) -> dict[str, Any]:
    """One side at one size: start its controllers, apply, run to the end, delete; what was measured."""
    namespace = f"scale-{kind.name}-{jobs}"
    workdir = args.out / f"{kind.name}-{jobs}"
    if workdir.exists():  # an earlier run's: its spool entries and reports would be read as this run's
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    names = [manifests.job_name(i) for i in range(jobs)]
    await ensure_namespace(api, namespace)
    kuberay, kuberay_metrics = procs.start_kuberay(cluster, namespace, workdir / "kuberay.log")
    operator = standin = None
    reports_path = workdir / "reports.jsonl"
    if kind is PPOJOB:
        standin, spool, reports_path = procs.start_standin(workdir, every=args.every, steps=args.steps, warmup=args.warmup,
                                                           min_interval=args.min_interval, slowdown=args.slowdown)
        operator, operator_metrics = procs.start_operator(cluster, namespace, workdir,
                                                          STANDIN_COMMAND.format(spool=spool), args.operator_args.split())
        if args.profile:
            procs.profile(operator, workdir / "operator-profile.txt")
    sightings, stop, connections = Sightings(), asyncio.Event(), collections.Counter()
    loop_lags: list[tuple[float, float]] = []
    watches = [asyncio.create_task(watch(api, collection_path(kind.group, kind.version, kind.plural, namespace),
                                         record(kind, sightings, "job"), stop, connections))]
    watches.append(asyncio.create_task(probe_loop(loop_lags, stop)))
    watches += [asyncio.create_task(watch(api, collection_path(*gvr, namespace), record(kind, sightings, what), stop,
                                          connections)) for what, gvr in CHILDREN.items()]
    try:
        await asyncio.sleep(args.settle)  # watches listed, controllers idle
        others = await terminating_namespaces(api)
        idle_from, idle_start = stats.apiserver_requests(await api.metrics()), time.monotonic()
        await asyncio.sleep(args.idle)  # what the cluster does without us, to take off the phase's counts
        metrics = await api.metrics()
        idle_to, idle_end = stats.apiserver_requests(metrics), time.monotonic()
        before = {"apiserver": idle_to, "at": idle_end, "terminated_watchers": stats.terminated_watchers(metrics),
                  "idle_rate": {k: v / (idle_end - idle_start) for k, v in stats.diff(idle_to, idle_from).items()},
                  "kuberay": scrape(f"http://127.0.0.1:{kuberay_metrics}/metrics"),
                  "operator": scrape(f"http://127.0.0.1:{operator_metrics}/metrics") if operator else "",
                  "kuberay_cpu": kuberay.usage()["cpu_s"], "operator_cpu": operator.usage()["cpu_s"] if operator else 0,
                  "control_plane_cpu": procs.control_plane_cpu(cluster)}
        started = time.monotonic()
        say(f"[{kind.name} x{jobs}] applying")
        applied = await apply_jobs(api, kind, namespace, names, args)
        say(f"[{kind.name} x{jobs}] applied in {time.monotonic() - started:.1f} s")

        deleted = await run_to_end(api, kind, namespace, names, sightings, life_s=args.steps * args.every,
                                   timeout=args.phase_timeout, say=say)
        ended = time.monotonic()

        def left() -> dict[str, int]:
            return {what: len(objects) for what, objects in sightings.live.items() if objects}

        cleaned = await wait_until("every object to go", lambda: not left(), lambda: f"left: {left()}",
                                   args.phase_timeout, say)
        await asyncio.sleep(2)  # the last deletions' requests land in the metrics
        metrics = await api.metrics()
        after = {"apiserver": stats.apiserver_requests(metrics), "at": time.monotonic(),
                 "terminated_watchers": stats.terminated_watchers(metrics),
                 "kuberay": scrape(f"http://127.0.0.1:{kuberay_metrics}/metrics"),
                 "operator": scrape(f"http://127.0.0.1:{operator_metrics}/metrics") if operator else "",
                 "kuberay_usage": kuberay.usage(), "operator_usage": operator.usage() if operator else None,
                 "control_plane_cpu": procs.control_plane_cpu(cluster),
                 "standin_usage": standin.usage() if standin else None}
        say(f"[{kind.name} x{jobs}] done: {time.monotonic() - started:.0f} s in all")
    finally:
        stop.set()
        for task in watches:
            task.cancel()
        await delete_namespace(api, namespace)  # while the operator lives to take its finalizers off
        for child in (operator, standin, kuberay):
            if child is not None:
                child.stop()
        if operator is not None:
            procs.stop_trainer_sessions(workdir / "operator-state")
    reports = read_reports(reports_path)
    if kind is PPOJOB:
        write_lag_samples(workdir / "lags.jsonl", reports, sightings, started)
    result = measure(kind, jobs, applied, sightings, reports, before, after,
                     complete=deleted and cleaned, run_s=ended - started)
    result["benchmark_loop_lag_s"] = loop_lag(workdir / "loop-lag.jsonl", loop_lags, started)
    watch_requests = {path.rsplit("/", 1)[-1]: n for path, n in connections.items()}
    return {**result, "benchmark_watch_requests": watch_requests, "other_namespaces_terminating": others}


async def probe_loop(samples: list[tuple[float, float]], stop: asyncio.Event, every: float = 0.1) -> None:
    """How late this process's event loop wakes a sleep of `every` s: if the benchmark itself falls
    behind, its sightings (and its watches' draining, which the API server waits for) come late."""
    while not stop.is_set():
        asked = time.monotonic()
        await asyncio.sleep(every)
        woke = time.monotonic()
        samples.append((woke, woke - asked - every))


def loop_lag(path: Path, samples: list[tuple[float, float]], started: float) -> dict[str, Any]:
    """The probe's samples since the apply: p50, p99 and max, and one line each into `path`."""
    lags = [(at - started, lag) for at, lag in samples if at >= started]
    with open(path, "w") as out:
        out.writelines(json.dumps({"t": round(t, 2), "lag": round(lag, 4)}) + "\n" for t, lag in lags)
    return {**stats.p50_p99(lag for _, lag in lags), "max": max((lag for _, lag in lags), default=None)}


def seconds_from(applied: dict[str, float], sightings: Sightings, *whats: str) -> list[float]:
    """Per job: the last of `whats` first seen, minus its apply (jobs where each was seen)."""
    samples = []
    for job, at in applied.items():
        seen = [sightings.at(job, what) for what in whats]
        if all(s is not None for s in seen):
            samples.append(max(seen) - at)
    return samples


def report_visible(reports: list[dict], sightings: Sightings) -> list[float]:
    """Per phase-moving report: our watch's first sighting of it minus its stored time (the API server's share)."""
    lags = []
    for report in reports:
        seen = sightings.at(report["job"], f"report:{report['step']}:{report['finished']}")
        if report["phase"] and report["code"] == 200 and seen is not None:
            lags.append(seen - report["stored"])
    return lags


def status_lags(reports: list[dict], sightings: Sightings) -> list[float]:
    """Per report that should move the phase: first sighting of that phase minus the report's stored time."""
    lags = []
    for report in reports:
        if report["phase"] and report["code"] == 200:
            seen = sightings.at(report["job"], f"phase:{report['phase']}")
            if seen is not None:
                lags.append(seen - report["stored"])
    return lags


def write_lag_samples(path: Path, reports: list[dict], sightings: Sightings, started: float) -> None:
    """One line per phase-moving report (times in seconds since apply), to see when in the phase the lag grows."""
    with open(path, "w") as out:
        for report in reports:
            if report["phase"] and report["code"] == 200:
                seen = sightings.at(report["job"], f"phase:{report['phase']}")
                visible = sightings.at(report["job"], f"report:{report['step']}:{report['finished']}")
                out.write(json.dumps({
                    "job": report["job"], "phase": report["phase"], "sent": round(report["sent"] - started, 3),
                    "stored": round(report["stored"] - started, 3),
                    "visible": None if visible is None else round(visible - started, 3),
                    "phase_seen": None if seen is None else round(seen - started, 3)}) + "\n")


def measure(kind: Kind, jobs: int, applied: dict[str, float], sightings: Sightings, reports: list[dict],
            before: dict, after: dict, *, complete: bool, run_s: float) -> dict[str, Any]:
    raw = stats.diff(after["apiserver"], before["apiserver"])
    requests = stats.minus_idle(raw, before["idle_rate"], after["at"] - before["at"])
    job_requests = {k: v for k, v in requests.items() if not stats.is_background(k)}
    kuberay_requests = stats.diff(
        stats.sum_by(stats.parse_samples(after["kuberay"], "rest_client_requests_total"), "method"),
        stats.sum_by(stats.parse_samples(before["kuberay"], "rest_client_requests_total"), "method"))
    operator_requests = stats.diff(
        stats.sum_by(stats.parse_samples(after["operator"], "ppojob_operator_api_requests_total"), "verb", "resource"),
        stats.sum_by(stats.parse_samples(before["operator"], "ppojob_operator_api_requests_total"), "verb", "resource"))
    first_phase = sorted(kind.running)
    running = [min(t for p in first_phase if (t := sightings.at(job, f"phase:{p}")) is not None) - at
               for job, at in applied.items() if any(sightings.at(job, f"phase:{p}") for p in first_phase)]
    kuberay_usage, operator_usage = after["kuberay_usage"], after["operator_usage"]
    kuberay_cpu = kuberay_usage["cpu_s"] - before["kuberay_cpu"]
    operator_cpu = operator_usage["cpu_s"] - before["operator_cpu"] if operator_usage else None
    return {
        "kind": kind.name, "jobs": jobs, "complete": complete, "run_s": round(run_s, 1),
        "apply_to_created_s": stats.p50_p99(seconds_from(applied, sightings, "podgroup", "raycluster")),
        "apply_to_raycluster_ready_s": stats.p50_p99(seconds_from(applied, sightings, "cluster_ready")),
        "apply_to_pods_running_s": stats.p50_p99(seconds_from(applied, sightings, "pods_running")),
        "apply_to_job_running_s": stats.p50_p99(running),
        "status_lag_s": stats.p50_p99(status_lags(reports, sightings)) if kind is PPOJOB else None,
        "report_visible_s": stats.p50_p99(report_visible(reports, sightings)) if kind is PPOJOB else None,
        "report_patch_s": stats.p50_p99(r["stored"] - r["sent"] for r in reports) if kind is PPOJOB else None,
        "trainer_reports": len(reports),
        "apiserver_watchers_terminated": stats.diff(after["terminated_watchers"], before["terminated_watchers"]),
        "trainer_reports_failed": sum(r["code"] != 200 for r in reports),
        "api_requests_per_job": stats.per_job(job_requests, jobs),
        "api_requests_per_job_by_verb": stats.per_job(stats.by_verb(job_requests), jobs),
        "api_requests_per_job_total": round(sum(job_requests.values()) / jobs, 2),
        "api_requests_background": {k: v for k, v in raw.items() if stats.is_background(k)},
        "api_requests_raw_per_job_total": round(sum(v for k, v in raw.items() if not stats.is_background(k)) / jobs, 2),
        "api_idle_rate_per_s": {k: round(v, 3) for k, v in before["idle_rate"].items()},
        "kuberay_requests_per_job_by_method": stats.per_job(kuberay_requests, jobs),
        "operator_writes_per_job": stats.per_job(operator_requests, jobs),
        "kuberay": {"cpu_s": round(kuberay_cpu, 2), "peak_rss_mib": kuberay_usage["peak_rss_mib"]},
        "operator": {"cpu_s": round(operator_cpu, 2), "peak_rss_mib": operator_usage["peak_rss_mib"]}
        if operator_usage else None,
        "standin": after["standin_usage"],
        "control_plane_cpu_s": stats.cpu_spent(before["control_plane_cpu"], after["control_plane_cpu"]),
    }


def summarize_side(phase: dict[str, Any]) -> dict[str, float | None]:
    """The table's figures of one phase (see stats.ROWS)."""
    lag = phase["status_lag_s"] or {}
    total = phase["api_requests_per_job_total"]
    reports = phase["trainer_reports"] / phase["jobs"]
    kuberay, operator = phase["kuberay"], phase["operator"]
    controller = operator or kuberay
    return {
        "created_p50": phase["apply_to_created_s"]["p50"], "created_p99": phase["apply_to_created_s"]["p99"],
        "pods_running_p50": phase["apply_to_pods_running_s"]["p50"],
        "pods_running_p99": phase["apply_to_pods_running_s"]["p99"],
        "status_lag_p50": lag.get("p50"), "status_lag_p99": lag.get("p99"),
        "requests_per_job": total, "requests_per_job_without_reports": total - reports,
        "controller_cpu_s": controller["cpu_s"],
        "stack_cpu_s": controller["cpu_s"] + (kuberay["cpu_s"] if operator else 0),
        "control_plane_cpu_s": (phase.get("control_plane_cpu_s") or {}).get("total"),
        "controller_peak_rss_mib": controller["peak_rss_mib"],
        "stack_peak_rss_mib": controller["peak_rss_mib"] + (kuberay["peak_rss_mib"] if operator else 0),
    }


@contextmanager
def cluster_lock(say):
    """The machine's one local cluster is shared: hold its lock (blocking) for the block."""
    LOCK.touch(exist_ok=True)
    with open(LOCK) as handle:
        say(f"waiting for {LOCK}")
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_cluster(cluster, max_jobs: int, say) -> None:
    """The PPOJob CRD and a pool of fake GPU nodes for every job of both kinds."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/ppojobs.ppojob.io", "--timeout=60s")
    # The garbage collector finds a new resource up to 30 s after its CRD; until then its lookups of
    # the PPOJobs' owner references fail and are retried with backoff, unlike on a cluster that
    # has run a while.
    started = time.monotonic()
    cluster.apply(json.dumps(manifests.gc_probe(str(uuid.uuid4()))))
    cluster.kubectl("wait", "--for=delete", "configmap/ppojob-gc-probe", "-n", "default", "--timeout=120s",
                    check=False, timeout=150)
    if cluster.kubectl("get", "configmap/ppojob-gc-probe", "-n", "default", "--ignore-not-found", "-o", "name").stdout.strip():
        raise RuntimeError("the garbage collector did not delete configmap default/ppojob-gc-probe in 120 s: "
                           "it cannot look PPOJobs up (see the kube-controller-manager log)")
    say(f"the garbage collector follows PPOJob owners ({time.monotonic() - started:.0f} s)")
    count, gpus = manifests.pool_shape(max_jobs)
    nodes = [f"scale-pool-{i}" for i in range(count)]
    cluster.apply("\n---\n".join(cluster_manifests.fake_node(n, gpus, "1000", "4000Gi", {manifests.POOL_LABEL: manifests.POOL})
                                 for n in nodes))
    cluster.kubectl("wait", "--for=condition=Ready", "node", "-l", f"{manifests.POOL_LABEL}={manifests.POOL}",
                    "--timeout=120s", timeout=150)
    say(f"pool: {count} fake nodes x {gpus} GPUs ({manifests.POOL_LABEL}={manifests.POOL})")


async def run_size(jobs: int, args: argparse.Namespace, say) -> dict[str, Any]:
    """Both phases of one size, under the cluster lock."""
    with cluster_lock(say):
        cluster = LocalCluster.running()
        owned = cluster is None
        cluster = cluster or LocalCluster.start(out=sys.stdout, real_node=False)  # KWOK nodes only
        procs.resume_cluster_kuberay(cluster)  # in case an earlier run died with it paused
        prepare_cluster(cluster, jobs, say)
        try:
            async with Api(cluster.server, cluster.state_dir / "pki") as api:
                with procs.cluster_kuberay_paused(cluster), \
                        procs.control_plane_priority(cluster, args.control_plane_nice) as nice:
                    if nice != args.control_plane_nice:
                        say(f"control plane left at its nice: setting {args.control_plane_nice} was not permitted")
                    return {kind.name: {**await run_phase(cluster, api, kind, jobs, args, say), "control_plane_nice": nice}
                            for kind in (PPOJOB, RAYJOB) if kind.name in args.kinds}
        finally:
            cluster.kubectl("delete", "node", "-l", f"{manifests.POOL_LABEL}={manifests.POOL}", "--wait=true",
                            check=False, timeout=120)
            if owned:
                cluster.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="10,100", help="sizes, comma-separated, e.g. 10,100,500")
    p.add_argument("--every", type=float, default=5.0, help="seconds a step of a trainer stand-in takes")
    p.add_argument("--steps", type=int, default=6, help="steps each PPOJob runs (one every --every seconds)")
    p.add_argument("--min-interval", type=float, default=MIN_INTERVAL_S,
                   help="the trainers' report throttle (the trainer's own default; 0 with --slowdown 0: a report at every step)")
    p.add_argument("--slowdown", type=float, default=SLOWDOWN,
                   help="the trainers' routine reports wait this many times their last PATCH's time (the trainer's own; 0: off)")
    p.add_argument("--warmup", type=int, default=1, help="critic-only steps of each PPOJob")
    p.add_argument("--settle", type=float, default=5.0, help="seconds between starting the controllers and applying")
    p.add_argument("--idle", type=float, default=10.0,
                   help="seconds of the cluster's own traffic measured before each phase and taken off its counts")
    p.add_argument("--phase-timeout", type=float, default=1200.0, help="seconds a phase may take to finish, and to clean up")
    p.add_argument("--control-plane-nice", type=int, default=CONTROL_PLANE_NICE,
                   help="the API server's and etcd's nice during the phases (their own machines, in a real cluster; 0: as started)")
    p.add_argument("--kinds", default="ppojob,rayjob", help="the sides to run (a profiling run may want ppojob alone)")
    p.add_argument("--operator-args", default="", help="more ppo-operator flags, e.g. '--api-connections 16' (A/B runs)")
    p.add_argument("--profile", action="store_true",
                   help="sample ppo-operator with py-spy over the phase (collapsed stacks in operator-profile.txt)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "operator_scale")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()  # the per-job trainer commands run in their own folders
    args.out.mkdir(parents=True, exist_ok=True)
    # Stopping the run (Ctrl-C, kill) must still clean up and resume the cluster's KubeRay.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = [int(s) for s in args.jobs.split(",") if s.strip()]

    def say(line: str) -> None:
        print(line, flush=True)

    results: dict[int, dict[str, Any]] = {}
    for jobs in sizes:
        results[jobs] = asyncio.run(run_size(jobs, args, say))
    summary = {jobs: {k: summarize_side(v) for k, v in sides.items()} for jobs, sides in results.items()}
    table = stats.render_table(summary)
    checks = stats.targets(summary)
    verdicts = "\n".join(f"{'met' if ok else 'MISSED' if ok is not None else 'n/a'}: {what} ({figure})"
                         for what, ok, figure in checks)
    machine = subprocess.run(["uptime"], check=False, capture_output=True, text=True).stdout.strip()
    document = {"command": " ".join(["bench/operator_scale.py", *(argv if argv is not None else sys.argv[1:])]),
                "settings": {k: str(v) for k, v in vars(args).items()}, "load_after": machine,
                "summary": summary, "targets": [{"target": t, "met": ok, "figure": f} for t, ok, f in checks],
                "phases": results}
    (args.out / "scale.json").write_text(json.dumps(document, indent=1, default=str))
    (args.out / "scale.txt").write_text(table + "\n" + verdicts + "\n")
    say("\n" + table + verdicts)
    say(f"\nwritten: {args.out / 'scale.json'}, {args.out / 'scale.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
