"""Helpers of the fault-injection tests: a record of every child ever created, small jobs that many
fit on the fake nodes at once, and the `[faults]` line each test prints."""

from __future__ import annotations

import collections
import threading
import time

import urllib3
import yaml
from kubernetes import client, config, watch
from operator_itest import kget, tiny_manifest

RAYCLUSTERS = ("ray.io", "v1", "rayclusters")
PODGROUPS = ("scheduling.x-k8s.io", "v1alpha1", "podgroups")
# The head is the operator's (--head-cpu/--head-memory); these keep 50 jobs within the 4 fake nodes.
SMALL_HEAD = ("--head-cpu", "100m", "--head-memory", "256Mi")


def small_manifest(name: str, **spec_overrides) -> dict:
    """A short CPU-only job (no GPUs, a tenth of a CPU per pod), so that dozens are placed at once."""
    resources = {"nodes": 1, "gpusPerNode": 0, "cpusPerNode": "100m", "memoryPerNode": "256Mi", "sharedMemory": "64Mi"}
    spec = {"ppo": {"numRollouts": 3, "numCriticOnlySteps": 1}, "resources": resources, **spec_overrides}
    return tiny_manifest(name, **spec)


def apply_all(cluster, namespace: str, manifests: list[dict]) -> None:
    """One `kubectl apply` for all of them: they arrive at the operator together."""
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(manifests), timeout=300)


def phases(cluster, namespace: str) -> dict[str, str | None]:
    return {j["metadata"]["name"]: (j.get("status") or {}).get("phase") for j in kget(cluster, "ppojobs", namespace) or []}


class CreationRecorder:
    """Every object of one kind ever seen in a namespace, as name -> set of uids, from a watch that
    resumes from its last resourceVersion after an error (an API server restart) and lists again
    when that version is too old. Deterministic names make a second copy a second uid under one name."""

    def __init__(self, cluster, namespace: str, group: str, version: str, plural: str):
        self.api = client.CustomObjectsApi(config.new_client_from_config(str(cluster.kubeconfig)))
        self.where = (group, version, namespace, plural)
        self.uids: dict[str, set[str]] = collections.defaultdict(set)
        self._stopped = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _list(self) -> str:
        listing = self.api.list_namespaced_custom_object(*self.where)
        for item in listing["items"]:
            self.uids[item["metadata"]["name"]].add(item["metadata"]["uid"])
        return listing["metadata"]["resourceVersion"]

    def _run(self) -> None:
        version = None
        while not self._stopped.is_set():
            try:
                version = version or self._list()
                self._watch = watch.Watch()
                for event in self._watch.stream(self.api.list_namespaced_custom_object, *self.where,
                                                resource_version=version, timeout_seconds=60):
                    meta = event["object"]["metadata"]
                    version = meta.get("resourceVersion", version)
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self.uids[meta["name"]].add(meta["uid"])
            except client.exceptions.ApiException as exc:
                if exc.status == 410:
                    version = None  # too old: list again (a list sees what the gap held, or its absence)
                else:
                    time.sleep(0.5)
            except (urllib3.exceptions.HTTPError, OSError, ValueError):
                time.sleep(0.5)  # the API server is away; resume from `version`

    def of_job(self, job: str) -> dict[str, set[str]]:
        """Names of this job's objects (`<job>-a<N>`) and their uids."""
        return {name: uids for name, uids in list(self.uids.items()) if name.rsplit("-a", 1)[0] == job}

    def stop(self) -> None:
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()


def trainer_launches(state_dir, namespace: str, job: str) -> int:
    """Trainer processes the local launcher started for a job (one `$ command` line per start)."""
    logs = state_dir.glob(f"{namespace}/{job}-*/a*/trainer.log")
    return sum(line.startswith("$ ") for log in logs for line in log.read_text(errors="replace").splitlines())


def report_faults(what: str, *, injected: int, recovered: int, duplicated: int, lost: int, **more) -> str:
    """The line the fault tests print (pytest -s, or in the captured output of a failure)."""
    extra = "".join(f", {k.replace('_', ' ')} {v}" for k, v in more.items())
    line = f"[faults] {what}: injected {injected}, recovered {recovered}, duplicated {duplicated}, lost {lost}{extra}"
    print(line, flush=True)
    return line
