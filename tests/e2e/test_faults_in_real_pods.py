"""Faults and stops in real pods: the chart's operator (two replicas) runs the tiny CPU PPOJob on the
real node while the leading operator, a container, a pod and the kubelet are taken away in turn; the
job recovers from its checkpoint on the claim, within its backoffLimit, and its status tells the
truth meanwhile. One job lives through all four: a job's start in real pods costs a minute and more.
A second job is stopped mid-interval three ways (suspended, its head evicted, its head deleted with
a 1 s grace) and deleted: the Ray pods' preStop hook lets its trainer checkpoint the step it was at
within the grace period, so only the stop without time for it loses steps."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from story import JOB_NAMESPACE, OPERATOR_NAMESPACE, RELEASE, Story, example_job

from local_cluster import node
from ppo_operator import names

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def operator_in_pods(local_cluster, real_node_images, tmp_path_factory):
    """The chart installed as in the README (its operator in containers on the real node)."""
    story = Story(cluster=local_cluster, work_dir=tmp_path_factory.mktemp("operator"), job_name="none")
    story.work_dir.mkdir(parents=True, exist_ok=True)
    story.create_job_namespace()
    story.install_chart()
    story.wait_for_operator()
    yield story
    story.uninstall()


def start_job(operator_in_pods: Story, name: str, tmp_path, *, steps: int | None = None,
              checkpoint_interval: int | None = None) -> Story:
    story = Story(cluster=operator_in_pods.cluster, work_dir=tmp_path, job_name=name)
    story.create_checkpoint_claim()
    manifest = example_job(name, claim=story.claim, steps=steps)
    if checkpoint_interval is not None:
        manifest["spec"]["checkpoint"]["interval"] = checkpoint_interval
    story.apply_job(manifest)
    story.wait_for_children()
    story.wait_for_pods()
    return story


def wait_for(story: Story, predicate, what: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = story.job()
        if predicate(job.get("status", {})):
            return job["status"]
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout}s; status: {json.dumps(story.job().get('status'))[:3000]}")


def step(status: dict) -> int:
    return status.get("progress", {}).get("step", 0)


def stepping(attempt: int, past: int = 0):
    """The attempt's own trainer runs and has reported a step beyond `past`."""
    return lambda s: (s.get("phase") == "Training" and s.get("attempt") == attempt
                      and s.get("progress", {}).get("attempt") == attempt and step(s) > past)


def pods_ready(ready: bool):
    want = "True" if ready else "False"
    return lambda s: any(c["type"] == "PodsReady" and c["status"] == want for c in s.get("conditions", []))


def container_pid(story: Story, pod: str) -> int:
    found = story.cluster.crictl("ps", "--pod", pod_sandbox(story, pod), "-o", "json")
    (container,) = json.loads(found.stdout)["containers"]
    inspected = json.loads(story.cluster.crictl("inspect", container["id"]).stdout)
    return inspected["info"]["pid"]


def trainer_pid(story: Story, attempt: int) -> int:
    """The attempt's trainer process (in its head container): the one whose arguments name the
    attempt's config file."""
    config = names.trainer_config_path(story.job()["metadata"]["uid"], attempt)
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):  # a process gone meanwhile
            if proc.name.isdigit() and config.encode() in (proc / "cmdline").read_bytes().split(b"\0"):
                found.append(int(proc.name))
    (pid,) = found
    return pid


def pod_sandbox(story: Story, pod: str) -> str:
    return story.cluster.crictl("pods", "--name", pod, "--namespace", JOB_NAMESPACE, "--state", "ready", "-q"
                                ).stdout.split()[0]


def role_pod(story: Story, role: str, attempt: int) -> str:
    (pod,) = story.pods(JOB_NAMESPACE, f"ppojob.io/job-name={story.job_name},ppojob.io/role={role},"
                                       f"ppojob.io/attempt={attempt}")
    return pod["metadata"]["name"]


def leading_operator(story: Story) -> str:
    """The pod of the replica kopf's peering lets serve: the one of highest priority."""
    peering = json.loads(story.kubectl("get", "kopfpeerings.kopf.dev", "-n", JOB_NAMESPACE, "-o", "json"))
    peers = {name: info for item in peering["items"] for name, info in (item.get("status") or {}).items()}
    leader = max(peers, key=lambda name: peers[name]["priority"])
    pods = [p["metadata"]["name"] for p in story.pods(OPERATOR_NAMESPACE, f"app.kubernetes.io/instance={RELEASE}")]
    (pod,) = [p for p in pods if p in leader]
    return pod


STOP_STEPS, STOP_INTERVAL = 200, 50
"""Every stop falls mid-interval: the job is deleted long before its 50th step."""
GRACE_S = 300
"""spec.checkpoint.terminationGracePeriodSeconds's default, which the job keeps."""


def trainer_lines(story: Story) -> list[dict]:
    """Every attempt's JSON lines on the claim (the run dir is checkpoint.path), in order; a line a
    killed trainer left half-written is skipped."""
    lines = []
    for text in (story.volume_path / "events.jsonl").read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(text))
    return lines


def stops_seen(lines: list[dict]) -> list[dict]:
    """Each stop as the trainers told it: the steps the stopped one had done, whether it said it saved
    them, and the step its successor resumed from (the note `resumed from ... at step N`)."""
    stops, done, saved = [], 0, False
    for line in lines:
        if line["kind"] == "step":
            done = line["step"] + 1
        elif line["kind"] == "note" and line["line"].startswith("stopped by SIGTERM"):
            saved = True
        elif line["kind"] == "note" and line["line"].startswith("resumed from"):
            resumed = int(line["line"].rsplit("at step ", 1)[1])
            stops.append({"done": done, "saved": saved, "resumed_at": resumed, "lost": done - resumed})
            saved = False
    return stops


def pods_gone(story: Story, selector: str, since: float, limit_s: float) -> float:
    """Seconds from `since` until no pod matches; fails past limit_s."""
    while story.pods(JOB_NAMESPACE, selector):
        assert time.monotonic() - since < limit_s, f"pods {selector} still there {limit_s}s on"
        time.sleep(0.5)
    return round(time.monotonic() - since, 1)


STEPS = 100
"""Enough that each attempt steps before the next fault. The trainer is paused while the kubelet is
away, so that the job outlasts the node controller's grace however fast this machine steps."""


def test_one_job_lives_through_its_leading_operator_worker_container_head_pod_and_kubelet_taken_away(
    operator_in_pods, tmp_path
):
    story = start_job(operator_in_pods, "faults", tmp_path, steps=STEPS)
    status = None
    try:
        # 1. The leading operator's pod killed: the standby replica takes over (kopf peering) and folds
        #    the trainer's reports into the status from then on; no restart.
        wait_for(story, lambda s: step(s) >= 2, "no second step")
        leader = leading_operator(story)
        story.kubectl("delete", "pod", leader, "-n", OPERATOR_NAMESPACE, "--grace-period=0", "--force")
        story.say(f"killed the leading operator {leader}")
        status = wait_for(story, lambda s: step(s) >= 5, "no step past the first checkpoint under the standby")
        assert status.get("restarts", 0) == 0, status

        # 2. The worker's container killed: the driver fails with its worker's actors, and the job
        #    restarts from the checkpoint on the claim.
        worker = role_pod(story, "train", 0)
        os.kill(container_pid(story, worker), signal.SIGKILL)
        story.say(f"killed the container of {worker}")
        status = wait_for(story, stepping(1), "attempt 1 never stepped", timeout=400)
        story.say(f"attempt 1 steps from {step(status)}")

        # 3. The head pod deleted: seen at once (the operator watches the pods), never Running over a
        #    dead driver; restart 2 from the checkpoint.
        head = role_pod(story, "head", 1)
        deleted = time.monotonic()
        story.kubectl("delete", "pod", head, "-n", JOB_NAMESPACE, "--wait=false")
        seen = wait_for(story, lambda s: s.get("restarts", 0) >= 2 or s.get("phase") != "Training",
                        "the status never left Training after the head pod was deleted", timeout=60)
        story.figures["head_deleted_to_status_s"] = round(time.monotonic() - deleted, 1)
        story.say(f"status after the head's deletion: phase {seen['phase']}, restarts {seen.get('restarts')} "
                  f"({story.figures['head_deleted_to_status_s']}s)")
        assert story.figures["head_deleted_to_status_s"] < 15
        # Its preStop hook has the trainer finish its step and checkpoint, then ends the container:
        # the pod goes then, well within its grace period.
        story.figures["head_deleted_to_gone_s"] = pods_gone(
            story, f"ppojob.io/job-name={story.job_name},ppojob.io/role=head,ppojob.io/attempt=1", deleted, GRACE_S)
        story.say(f"head pod gone {story.figures['head_deleted_to_gone_s']}s after its deletion")
        status = wait_for(story, stepping(2), "attempt 2 never stepped", timeout=400)

        # 4. The kubelet stopped: after the node controller's grace the node is Unknown and PodsReady=False
        #    names each pod and its node; the containers run on, and the same attempt steps on after.
        #    Its trainer is paused (SIGSTOP) until the kubelet is back, or a fast machine ends the job
        #    before the node controller's grace is over.
        trainer = trainer_pid(story, attempt=2)
        os.kill(trainer, signal.SIGSTOP)
        try:
            with story.cluster.stopped("kubelet"):
                stopped = time.monotonic()
                story.say(f"paused the trainer (pid {trainer}) and stopped the kubelet")
                status = wait_for(story, pods_ready(False), "no PodsReady=False while the node is NotReady",
                                  timeout=120)
                story.figures["kubelet_stopped_to_condition_s"] = round(time.monotonic() - stopped, 1)
                ready = story.kubectl("get", "node", node.NODE_NAME, "-o",
                                      "jsonpath={.status.conditions[?(@.type=='Ready')].status}")
                (condition,) = [c for c in status["conditions"] if c["type"] == "PodsReady"]
                story.say(f"node Ready={ready}; job condition PodsReady=False after "
                          f"{story.figures['kubelet_stopped_to_condition_s']}s: {condition['message']}")
                assert ready == "Unknown" and node.NODE_NAME in condition["message"], condition
                step_while_down = step(status)
            story.say("started the kubelet again")
            wait_for(story, pods_ready(True), "no PodsReady=True once the kubelet is back", timeout=120)
        finally:
            os.kill(trainer, signal.SIGCONT)
        status = wait_for(story, stepping(2, past=step_while_down), "no step after the kubelet came back")
        assert status.get("restarts") == 2, status

        status = story.follow()
        story.capture()
    finally:
        story.record(status, None, None)
        story.delete_job()
        story.delete_checkpoint_claim()
    assert status["phase"] == "Succeeded", status
    assert (status["restarts"], status["attempt"], step(status)) == (2, 2, STEPS), status
    events = story.snapshots["events"]
    restart = re.search(r"TrainerFailed .*Restarting: restart 1/3 from step (\d+): Ray job FAILED", events)
    assert restart and int(restart.group(1)) >= 4, events
    # Told from the checkpoint attempt 1 resumed from, though attempt 1 had written none of its own.
    restart = re.search(r"PodLost .*Restarting: restart 2/3 from step (\d+): pod faults-a1-head-\S+ deleted", events)
    assert restart and int(restart.group(1)) >= 4, events
    # The Deployment's replacement of the killed replica joins the peering.
    operator_in_pods.wait_for_operator()


def test_a_job_stopped_mid_interval_resumes_from_the_step_it_was_at_and_its_deletion_waits_for_no_checkpoint(
    operator_in_pods, tmp_path
):
    story = start_job(operator_in_pods, "stops", tmp_path, steps=STOP_STEPS, checkpoint_interval=STOP_INTERVAL)
    job_pods = f"ppojob.io/job-name={story.job_name}"
    try:
        # 1. runPolicy.suspend: the RayCluster goes; its trainer saves the step it was at first.
        wait_for(story, stepping(0, past=3), "attempt 0 never passed step 3", timeout=400)
        story.kubectl("patch", "ppojob", story.job_name, "-n", JOB_NAMESPACE, "--type", "merge",
                      "-p", json.dumps({"spec": {"runPolicy": {"suspend": True}}}))
        suspended = time.monotonic()
        wait_for(story, lambda s: s.get("phase") == "Suspended", "never Suspended", timeout=60)
        story.figures["suspend_to_pods_gone_s"] = pods_gone(story, job_pods, suspended, GRACE_S)
        story.say(f"suspended: the pods were gone {story.figures['suspend_to_pods_gone_s']}s after the suspend")
        story.kubectl("patch", "ppojob", story.job_name, "-n", JOB_NAMESPACE, "--type", "merge",
                      "-p", json.dumps({"spec": {"runPolicy": {"suspend": False}}}))
        resumed = step(wait_for(story, stepping(1), "attempt 1 never stepped after the resume", timeout=400))
        wait_for(story, stepping(1, past=resumed + 1), "attempt 1 never did two steps of its own")

        # 2. The head evicted (as a node drain does): PodLost at once, the trainer saves meanwhile.
        head = role_pod(story, "head", 1)
        eviction = {"apiVersion": "policy/v1", "kind": "Eviction",
                    "metadata": {"name": head, "namespace": JOB_NAMESPACE}}
        (tmp_path / "eviction.json").write_text(json.dumps(eviction))
        evicted = time.monotonic()
        story.kubectl("create", "--raw", f"/api/v1/namespaces/{JOB_NAMESPACE}/pods/{head}/eviction",
                      "-f", str(tmp_path / "eviction.json"))
        wait_for(story, lambda s: s.get("restarts", 0) >= 1, "the eviction was not seen", timeout=15)
        story.figures["head_evicted_to_status_s"] = round(time.monotonic() - evicted, 1)
        story.figures["head_evicted_to_gone_s"] = pods_gone(story, f"{job_pods},ppojob.io/attempt=1", evicted, GRACE_S)
        story.say(f"head evicted: restart seen after {story.figures['head_evicted_to_status_s']}s, "
                  f"attempt 1's pods gone after {story.figures['head_evicted_to_gone_s']}s")
        resumed = step(wait_for(story, stepping(2), "attempt 2 never stepped after the eviction", timeout=400))

        # 3. The head deleted with a 1 s grace: no time to save, so the steps since the last checkpoint go.
        step_at_delete = step(wait_for(story, stepping(2, past=resumed + 1), "attempt 2 never did two steps of its own"))
        story.kubectl("delete", "pod", role_pod(story, "head", 2), "-n", JOB_NAMESPACE, "--grace-period=1",
                      "--wait=false")
        story.say(f"deleted the head of attempt 2 with --grace-period=1 at step {step_at_delete}")
        wait_for(story, stepping(3), "attempt 3 never stepped after the head's deletion", timeout=400)

        # 4. The job deleted mid-run: its pods go at once, not after a checkpoint.
        deleted = time.monotonic()
        story.kubectl("delete", "ppojob", story.job_name, "-n", JOB_NAMESPACE, "--wait=false")
        story.figures["job_deleted_to_pods_gone_s"] = pods_gone(story, job_pods, deleted, 60)
        story.say(f"job deleted: its pods were gone after {story.figures['job_deleted_to_pods_gone_s']}s")
    finally:
        story.record(None, None, None)
        story.delete_job()
        stops = []
        with contextlib.suppress(FileNotFoundError):  # a run that failed before any trainer wrote
            stops = stops_seen(trainer_lines(story))
        story.delete_checkpoint_claim()
    story.say(f"stops as the trainers told them: {stops}")
    suspend, eviction, short_grace = stops
    for stop in (suspend, eviction):  # the step in progress finished and was saved: nothing lost
        assert stop["saved"] and stop["lost"] == 0 and stop["done"] % STOP_INTERVAL != 0, stops
    # Without the time to save (a SIGKILL 1 s on): back to the checkpoint of the eviction, unless a
    # step and its checkpoint happened to fit in that second.
    assert short_grace["resumed_at"] == (short_grace["done"] if short_grace["saved"] else eviction["done"]), stops
    story.figures["steps_lost"] = {"suspend": suspend["lost"], "eviction": eviction["lost"],
                                   "head deleted, 1 s grace": short_grace["lost"]}
    story.say(f"steps lost per stop: {story.figures['steps_lost']}")
    assert story.figures["head_evicted_to_status_s"] < 15
    assert story.figures["job_deleted_to_pods_gone_s"] < 30
