"""Fault injection on the real local cluster: the operator SIGKILLed at random points while it creates
50 jobs' children. Every job must end with one pod group, one RayCluster and one trainer (a second
uid under a deterministic name, or a second attempt, is a duplicate) and reach the phase it would
have reached without the faults (Succeeded, no restart). Prints a `[faults]` line with the counts.
The trainer is the stand-in (`trainer_standin.py`): a test double, since no container runs under KWOK."""

from __future__ import annotations

import collections
import json
import os
import random
import time

import pytest
from fault_itest import (
    PODGROUPS,
    RAYCLUSTERS,
    SMALL_HEAD,
    CreationRecorder,
    apply_all,
    phases,
    report_faults,
    small_manifest,
    trainer_launches,
)
from operator_itest import kget, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SEED = int(os.environ.get("PPOJOB_FAULT_SEED", "7"))
FINISHED = ("Succeeded", "Failed")


def test_operator_sigkilled_at_random_points_during_50_creations_duplicates_and_loses_nothing(
    local_cluster, k8s_namespace, start_operator
):
    ns, rng = k8s_namespace, random.Random(SEED)
    jobs = [f"j{i:02d}" for i in range(50)]
    clusters, groups = CreationRecorder(local_cluster, ns, *RAYCLUSTERS), CreationRecorder(local_cluster, ns, *PODGROUPS)
    # A trainer must not be called lost because 50 stand-ins start at once on a loaded machine.
    operator = start_operator(*SMALL_HEAD, "--heartbeat-timeout", "120", STANDIN_STEP_SECONDS="0.2")
    apply_all(local_cluster, ns, [small_manifest(job) for job in jobs])
    kills, in_flight = 0, set()
    for _ in range(6):
        time.sleep(rng.uniform(0.2, 4.0))  # where the kill lands: anywhere in the operator's work
        operator.kill()
        kills += 1
        in_flight |= {job for job, phase in phases(local_cluster, ns).items() if phase not in FINISHED}
        operator.start()
    wait_for("every job finished", lambda: all(p in FINISHED for p in phases(local_cluster, ns).values())
             and len(phases(local_cluster, ns)) == len(jobs), timeout=400, interval=2)
    wait_for("every RayCluster torn down", lambda: kget(local_cluster, "rayclusters", ns) == [], timeout=120)
    clusters.stop(), groups.stop()

    final = {job["metadata"]["name"]: job["status"] for job in kget(local_cluster, "ppojobs", ns)}
    warnings = local_cluster.kubectl("get", "events", "-n", ns, "--field-selector", "type=Warning",
                                     "-o", "custom-columns=OBJ:.involvedObject.name,REASON:.reason,MSG:.message").stdout
    duplicated = lost = 0
    for job in jobs:
        made = {"RayCluster": clusters.of_job(job), "PodGroup": groups.of_job(job)}
        for kind, uids in made.items():
            duplicated += max(0, sum(len(u) for u in uids.values()) - 1)
            lost += not uids
            assert list(uids) == [f"{job}-a0"] and len(uids[f"{job}-a0"]) == 1, (job, kind, uids, warnings)
        launches = trainer_launches(operator.state_dir, ns, job)
        duplicated += max(0, launches - 1)
        lost += final[job]["phase"] != "Succeeded" or launches == 0
    recovered = sum(final[job]["phase"] == "Succeeded" for job in in_flight)
    report_faults("operator SIGKILL during 50 creations", injected=kills, recovered=recovered,
                  duplicated=duplicated, lost=lost, jobs_in_flight_at_a_kill=len(in_flight), seed=SEED)
    assert (duplicated, lost) == (0, 0)
    for job in jobs:
        assert final[job]["phase"] == "Succeeded", (job, final[job])
        assert (final[job]["restarts"], final[job]["attempt"]) == (0, 0), (job, final[job])
    assert operator.trainer_pids() == []


def _worker_pod(cluster, namespace: str, job: str, attempt: int) -> str:
    selector = f"ppojob.io/job-name={job},ppojob.io/attempt={attempt},ppojob.io/role=train"
    return kget(cluster, "pods", namespace, selector=selector)[0]["metadata"]["name"]


def test_api_server_and_etcd_restarts_mid_run_miss_no_event_for_good(local_cluster, k8s_namespace, start_operator):
    """Two crashes of the control plane: the API server alone while jobs are being created, then etcd
    and the API server while the operator is frozen (SIGSTOP) and a worker pod is deleted meanwhile.
    The operator's watches resume from versions the new API server no longer has (410: they list
    again), so that deletion reaches the operator only through the relist: it must still notice it."""
    ns = k8s_namespace
    clusters, groups = CreationRecorder(local_cluster, ns, *RAYCLUSTERS), CreationRecorder(local_cluster, ns, *PODGROUPS)
    operator = start_operator(*SMALL_HEAD, "--heartbeat-timeout", "120", STANDIN_STEP_SECONDS="0.5")
    steady = [f"s{i}" for i in range(8)]
    apply_all(local_cluster, ns, [small_manifest("lost", ppo={"numRollouts": 40}, checkpoint={"interval": 2})]
              + [small_manifest(job, ppo={"numRollouts": 12}) for job in steady[:4]])
    wait_for("the first jobs' trainers started", lambda: all(
        p in ("CriticWarmup", "Training", *FINISHED) for j, p in phases(local_cluster, ns).items() if j in steady[:4]),
        timeout=120)
    apply_all(local_cluster, ns, [small_manifest(job, ppo={"numRollouts": 12}) for job in steady[4:]])
    down_s = [local_cluster.restart_apiserver()]  # while the last four are being created

    wait_for("a checkpoint of the long job", lambda: ((kget(local_cluster, "ppojob", ns, "lost") or {})
                                                      .get("status") or {}).get("progress", {}).get("lastCheckpoint"),
             timeout=120)
    operator.pause()
    try:
        down_s.append(local_cluster.restart_etcd())
        local_cluster.kubectl("delete", "pod", _worker_pod(local_cluster, ns, "lost", 0), "-n", ns, "--wait=false")
        local_cluster.compact_etcd()  # the frozen watches' versions are history now: they must list again
    finally:
        operator.resume()

    wait_for("every job finished", lambda: all(p in FINISHED for p in phases(local_cluster, ns).values()),
             timeout=240, interval=1, context=lambda: _unfinished(local_cluster, ns))
    wait_for("every RayCluster torn down", lambda: kget(local_cluster, "rayclusters", ns) == [], timeout=120)
    clusters.stop(), groups.stop()
    final = {job["metadata"]["name"]: job["status"] for job in kget(local_cluster, "ppojobs", ns)}
    expected_attempts = {**{job: ["a0"] for job in steady}, "lost": ["a0", "a1"]}
    made = {job: (clusters.of_job(job), groups.of_job(job)) for job in expected_attempts}
    duplicated = sum(max(0, len(uids) - 1) for job in made for kind in made[job] for uids in kind.values())
    lost = sum(final[job]["phase"] != "Succeeded" for job in expected_attempts)
    report_faults("API server and etcd restarts", injected=3, recovered=len(expected_attempts) - lost,
                  duplicated=duplicated, lost=lost, control_plane_down_s="/".join(f"{s:.1f}" for s in down_s))
    for job, attempts in expected_attempts.items():
        assert final[job]["phase"] == "Succeeded", (job, final[job])
        assert final[job]["restarts"] == len(attempts) - 1, (job, final[job])
        for kind in made[job]:
            assert sorted(kind) == [f"{job}-{a}" for a in attempts] and all(len(u) == 1 for u in kind.values()), kind
    assert (duplicated, lost) == (0, 0)
    assert final["lost"]["progress"]["steps"] == "40/40"
    log = (next(operator.state_dir.glob(f"{ns}/lost-*/a1")) / "trainer.log").read_text()
    assert "--resume" in log and "from step 0" not in log


def test_a_second_head_pod_of_a_raycluster_is_deleted_and_the_job_goes_on(local_cluster, k8s_namespace, start_operator):
    """KubeRay makes a second head pod when the reply to its create is lost (an API server restart)
    and then reconciles that RayCluster no more ("Please delete extra head pods"). Made here by
    copying the head pod: the operator deletes the newer one, says so, and the job neither restarts
    nor counts the copy as a member of its gang."""
    ns = k8s_namespace
    start_operator(*SMALL_HEAD, STANDIN_STEP_SECONDS="0.5")
    apply_all(local_cluster, ns, [small_manifest("twin", ppo={"numRollouts": 16})])
    wait_for("the trainer started", lambda: phases(local_cluster, ns).get("twin") in ("CriticWarmup", "Training"),
             timeout=120)
    (head,) = kget(local_cluster, "pods", ns, selector="ppojob.io/job-name=twin,ppojob.io/role=head")
    twin = {"apiVersion": "v1", "kind": "Pod", "spec": head["spec"],  # nodeName kept: bound at once
            "metadata": {"name": head["metadata"]["name"] + "-twin", "labels": head["metadata"]["labels"],
                         "ownerReferences": head["metadata"]["ownerReferences"]}}
    local_cluster.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(twin))
    wait_for("the second head deleted", lambda: "DuplicateHeadPodDeleted" in " ".join(_story(local_cluster, ns, "twin")),
             timeout=30, interval=0.5)
    final = wait_for("the job finished", lambda: _finished(_statuses(local_cluster, ns)["twin"]), timeout=120, interval=1)
    assert (final["phase"], final["restarts"]) == ("Succeeded", 0), final
    (told,) = [line for line in _story(local_cluster, ns, "twin") if line.startswith("DuplicateHeadPodDeleted")]
    assert f"Pod {twin['metadata']['name']} deleted: a second head pod of RayCluster twin-a0" in told, told


def _finished(status: dict) -> dict | None:
    """The status once its phase is final, for `wait_for` to return."""
    return status if status.get("phase") in FINISHED else None


def _statuses(cluster, namespace: str) -> dict[str, dict]:
    return {job["metadata"]["name"]: job.get("status") or {} for job in kget(cluster, "ppojobs", namespace) or []}


def _unfinished(cluster, namespace: str) -> dict:
    """The unfinished jobs' status, and the pods and RayClusters of the namespace."""
    pods = {p["metadata"]["name"]: (p["status"].get("phase"), bool(p["metadata"].get("deletionTimestamp")))
            for p in kget(cluster, "pods", namespace) or []}
    return {"jobs": {job: status for job, status in _statuses(cluster, namespace).items()
                     if status.get("phase") not in FINISHED},
            "pods": pods, "rayclusters": [c["metadata"]["name"] for c in kget(cluster, "rayclusters", namespace) or []]}


def _story(cluster, namespace: str, job: str) -> list[str]:
    """The job's Warning events as `reason: message`."""
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                          f"involvedObject.name={job},type=Warning", "-o", "json").stdout
    return [f"{e['reason']}: {e['message']}" for e in json.loads(out)["items"]]


def _reported_a_checkpoint(status: dict) -> bool:
    """The current attempt's trainer runs and has reported since it started (progress is kept across
    attempts), and there is a checkpoint to resume from."""
    progress = status.get("progress") or {}
    return (status.get("phase") in ("CriticWarmup", "Training") and progress.get("attempt") == status.get("attempt")
            and bool(progress.get("lastCheckpoint")))


def test_deleted_worker_pods_restart_each_job_from_its_checkpoint_until_its_backoff_limit(
    local_cluster, k8s_namespace, start_operator
):
    """KubeRay recreates a deleted worker pod; the operator sees the pod lost (deleted, or replaced by a
    pod created after the gang was placed) and restarts the attempt from the last checkpoint, or fails
    the job once runPolicy.backoffLimit is reached. The stand-in trainer dies on the pod loss as a Ray
    driver would (STANDIN_POD_LOSS_KUBECONFIG), so both failure signals race: one lost pod must cost
    exactly one restart."""
    ns, rng = k8s_namespace, random.Random(SEED)
    limits = {"w0": 0, "w1": 1, **{f"w{i}": rng.choice([1, 2, 3]) for i in range(2, 6)}}
    planned = {"w0": 1, "w1": 2, **{job: rng.randint(0, limits[job] + 1) for job in list(limits)[2:]}}
    operator = start_operator(*SMALL_HEAD, "--heartbeat-timeout", "120", STANDIN_STEP_SECONDS="0.4",
                              STANDIN_POD_LOSS_KUBECONFIG=str(local_cluster.kubeconfig))
    apply_all(local_cluster, ns, [small_manifest(job, ppo={"numRollouts": 40}, checkpoint={"interval": 2},
                                                 runPolicy={"backoffLimit": limit}) for job, limit in limits.items()])
    deleted: collections.Counter[str] = collections.Counter()
    hit: set[tuple[str, int]] = set()
    deadline = time.monotonic() + 300
    while sum(deleted.values()) < sum(planned.values()) and time.monotonic() < deadline:
        now = _statuses(local_cluster, ns)
        ready = sorted(job for job, s in now.items() if deleted[job] < planned[job] and (job, s.get("attempt")) not in hit
                       and _reported_a_checkpoint(s))
        if not ready:
            if all(s.get("phase") in FINISHED for job, s in now.items() if deleted[job] < planned[job]):
                break  # a job finished before its turn: it is counted with the deletions it got
            time.sleep(0.5)
            continue
        job = rng.choice(ready)
        attempt = now[job]["attempt"]
        local_cluster.kubectl("delete", "pod", _worker_pod(local_cluster, ns, job, attempt), "-n", ns, "--wait=false")
        deleted[job] += 1
        hit.add((job, attempt))

    wait_for("every job finished", lambda: all(s.get("phase") in FINISHED for s in _statuses(local_cluster, ns).values()),
             timeout=300, interval=1)
    final = _statuses(local_cluster, ns)
    recovered = sum(0 < deleted[job] <= limits[job] and final[job]["phase"] == "Succeeded" for job in limits)
    past_limit = [job for job in limits if deleted[job] > limits[job]]
    wrong = [job for job in limits if final[job]["phase"] != ("Failed" if job in past_limit else "Succeeded")]
    report_faults("worker pods deleted", injected=sum(deleted.values()), recovered=recovered, duplicated=0,
                  lost=len(wrong), jobs=len(limits), failed_past_backoff_limit=len(past_limit), seed=SEED)
    assert past_limit and not wrong, (deleted, {job: final[job]["message"] for job in wrong})
    for job, limit in limits.items():
        status, story = final[job], _story(local_cluster, ns, job)
        restarts = min(deleted[job], limit)
        assert (status["restarts"], status["attempt"]) == (restarts, restarts), (job, status)
        for k in range(1, restarts + 1):  # each restart told, with the checkpoint it resumes from
            told = [line for line in story if f"Restarting: restart {k}/{limit} from step " in line]
            assert told and told[0].split(":")[0] in ("PodLost", "TrainerFailed"), (job, k, story)
            resumed_from = int(told[0].split("from step ")[1].split(":")[0])
            log = (next(operator.state_dir.glob(f"{ns}/{job}-*/a{k}")) / "trainer.log").read_text()
            assert "--resume" in log and int(log.split(" from step ")[1].split()[0]) >= resumed_from > 0, log
        if job in past_limit:
            assert status["reason"] == "BackoffLimitExceeded", (job, status)
            assert status["message"].split(":")[0] in ("PodLost", "TrainerFailed"), status["message"]
            assert f"runPolicy.backoffLimit ({limit}) reached" in status["message"]
            assert any(line.startswith("BackoffLimitExceeded: Failed: ") for line in story), story
