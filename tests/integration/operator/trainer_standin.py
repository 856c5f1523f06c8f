"""A trainer stand-in for the operator's integration tests: `ppo-train`'s command line and reports,
without the training.

    python trainer_standin.py CONFIG --run-dir DIR [--resume] [--address A]

Reads the PPOJob manifest CONFIG, then walks numRollouts steps (the first numCriticOnlySteps
critic-only), writing `status.progress` to its job's progress ConfigMap (PPOJOB_PROGRESS_CONFIGMAP)
with the identity the operator gave it (KUBECONFIG: the job's ServiceAccount token), exactly as the
real trainer's reporter does (the whole progress as one JSON value, each report the latest), and like it a failed report is logged and training goes on (so an API
server restart does not kill it). A checkpoint file in DIR lets --resume continue. Environment knobs:
STANDIN_STEP_SECONDS (default 0.3), STANDIN_HANG=1 (stop reporting and sleep), STANDIN_EXIT_CODE,
STANDIN_POD_LOSS_KUBECONFIG=PATH (a kubeconfig that may list pods: the stand-in exits 1 once a pod of
its attempt is deleted, as a Ray driver fails when a node it uses dies; the local launcher's trainer
runs on this machine, not in those pods, so without this it would not notice).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml
from kubernetes import client, config


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_loss_probe(namespace: str, name: str, attempt: int):
    """A function returning the name of a pod of this attempt that is gone since the start, or "" (never
    anything without STANDIN_POD_LOSS_KUBECONFIG)."""
    path = os.environ.get("STANDIN_POD_LOSS_KUBECONFIG")
    if not path:
        return lambda: ""
    pods = client.CoreV1Api(config.new_client_from_config(path))
    selector = f"ppojob.io/job-name={name},ppojob.io/attempt={attempt}"

    def alive() -> set[str] | None:
        try:
            items = pods.list_namespaced_pod(namespace, label_selector=selector).items
        except Exception:  # noqa: BLE001 (cannot tell now: assume nothing is lost)
            return None
        return {p.metadata.name for p in items if not p.metadata.deletion_timestamp}

    started = alive() or set()

    def lost() -> str:
        now_alive = alive()
        return "" if now_alive is None else ", ".join(sorted(started - now_alive))

    return lost


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--address")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    spec = yaml.safe_load(Path(args.config).read_text())["spec"]
    total = spec.get("ppo", {}).get("numRollouts", 10)
    warmup = spec.get("ppo", {}).get("numCriticOnlySteps", 0)
    interval = spec.get("checkpoint", {}).get("interval", 1) or total
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = run_dir / "checkpoint-step"
    start = int(checkpoint.read_text()) if args.resume and checkpoint.exists() else 0
    config.load_kube_config()
    api = client.CoreV1Api()
    name, namespace = os.environ["PPOJOB_NAME"], os.environ["PPOJOB_NAMESPACE"]
    configmap = os.environ["PPOJOB_PROGRESS_CONFIGMAP"]
    attempt = int(os.environ.get("PPOJOB_ATTEMPT", "0"))
    step_seconds = float(os.environ.get("STANDIN_STEP_SECONDS", "0.3"))

    latest = {"attempt": attempt, "totalSteps": total, "criticOnlySteps": warmup}

    def report(**progress) -> None:
        latest.update(progress, heartbeatTime=now())
        body = {"data": {"progress": json.dumps(latest)}}
        try:
            api.patch_namespaced_config_map(configmap, namespace, body, _content_type="application/merge-patch+json")
        except Exception as exc:  # noqa: BLE001 (as the real reporter: an API error never stops training)
            print(f"stand-in: report failed ({type(exc).__name__}); going on", flush=True)

    pods_lost = pod_loss_probe(namespace, name, attempt)

    print(f"stand-in: {namespace}/{name} attempt {attempt} from step {start}", flush=True)
    for step in range(start, total):
        critic_only = step < warmup
        report(step=step, steps=f"{step}/{total}", warmup=f"{min(step, warmup)}/{warmup}", stage="Generate",
               criticOnlyStepsDone=min(step, warmup), actor="Offloaded", critic="Offloaded", rollout="Awake",
               offload="actor:off critic:off rollout:awake")
        if os.environ.get("STANDIN_HANG") == "1":
            time.sleep(3600)
        time.sleep(step_seconds)
        lost = pods_lost()
        if lost:
            report(error=f"lost {lost}: the Ray cluster lost a node", stage="Failed")
            print(f"stand-in: lost {lost}; exiting 1", flush=True)
            return 1
        done = step + 1
        progress = {"step": done, "steps": f"{done}/{total}", "warmup": f"{min(done, warmup)}/{warmup}",
                    "criticOnlyStepsDone": min(done, warmup), "stage": "CriticTrain" if critic_only else "ActorTrain"}
        if done % interval == 0 or done == total:
            checkpoint.write_text(str(done))
            progress["lastCheckpoint"] = {"step": done, "path": str(run_dir / f"step-{done}"), "time": now()}
        report(**progress)
    code = int(os.environ.get("STANDIN_EXIT_CODE", "0"))
    if code == 0:
        report(step=total, steps=f"{total}/{total}", stage="Done", finished=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
