"""`ppo-operator`: the command line that wires the pieces together and runs kopf.

    ppo-operator [--namespace NS ...] [--launcher ray-jobs|local] [--state-dir DIR] ...

`--launcher local` is the development mode (the trainer as a local process, for the local
cluster); the default starts trainers through Ray's job-submission API on each job's head.
Depends on kopf and every other module of the package.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import getpass
import hashlib
import json
import logging
import os
import secrets
import shlex
import signal
import socket
import sys
import threading
from pathlib import Path

import kopf

from ppo_operator import handlers, metrics
from ppo_operator.builders.common import BuildOptions
from ppo_operator.decisions import Policy
from ppo_operator.events import REPORTING_COMPONENT, Event
from ppo_operator.gang import backend_for
from ppo_operator.job import Job
from ppo_operator.kube import Kube
from ppo_operator.launchers.local import LocalLauncher
from ppo_operator.launchers.ray_jobs import RayJobsLauncher
from ppo_operator.leadership import Leadership, peering_paths
from ppo_operator.reconcile import Reconciler
from ppojob_api.vocabulary import GangScheduler


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ppo-operator", description="Reconciles PPOJobs into gang-scheduled KubeRay clusters.")
    p.add_argument("--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable; default: all)")
    p.add_argument("--launcher", choices=["ray-jobs", "local"], default="ray-jobs",
                   help="how trainers start: Ray job submission on the head (default), or local processes (development)")
    p.add_argument("--state-dir", type=Path, default=Path(os.environ.get("PPO_OPERATOR_STATE", "~/.cache/ppojob/operator")),
                   help="local launcher: where trainer processes keep pid files, logs and checkpoints")
    p.add_argument("--trainer-command", default="ppo-train", help="the trainer's command before CONFIG (shell words)")
    p.add_argument("--heartbeat-timeout", type=float, default=180.0, help="seconds without a trainer report before it is lost")
    p.add_argument("--gang-schedulers", default="Coscheduling,Kueue,None",
                   help="gang schedulers this cluster has (comma-separated); jobs asking for another fail InvalidSpec")
    p.add_argument("--scheduler-name", action="append", default=[], metavar="SCHEDULER=NAME",
                   help="schedulerName pods of a gang scheduler ask for, e.g. Coscheduling=scheduler-plugins-scheduler")
    p.add_argument("--ray-version", default=BuildOptions.ray_version)
    p.add_argument("--head-cpu", default=BuildOptions.head_cpu)
    p.add_argument("--head-memory", default=BuildOptions.head_memory)
    p.add_argument("--operator-namespace", default=os.environ.get("POD_NAMESPACE"),
                   help="the namespace of this operator's pods (default $POD_NAMESPACE, which the chart sets): each job's "
                        "NetworkPolicy admits them to the head's dashboard; unset: it admits the job's own pods only")
    p.add_argument("--operator-pod-label", action="append", default=[], metavar="KEY=VALUE",
                   help="a label that selects this operator's pods in that namespace (repeatable; the chart passes its selector labels)")
    p.add_argument("--liveness", metavar="URL", help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--peering", metavar="NAME", help="kopf peering name (several replicas, one active); default standalone")
    p.add_argument("--priority", type=int, default=None,
                   help="kopf peering priority of this replica (default: derived from $POD_NAME, so replicas differ)")
    p.add_argument("--api-connections", type=int, default=64,
                   help="connections for API requests other than status writes (a loaded API server answers in seconds)")
    p.add_argument("--status-connections", type=int, default=64,
                   help="connections of their own for status writes, so they never queue behind creates and deletes")
    p.add_argument("--gc-full-every", type=float, default=300.0, metavar="SECONDS",
                   help="run CPython's full garbage collection on this timer instead of its own trigger (0: CPython's default)")
    p.add_argument("--metrics-port", type=int, help="serve the operator's Prometheus metrics on this port (/metrics)")
    p.add_argument("--stats-file", type=Path, help="write the operator's API request counts (JSON) here on exit and on SIGUSR1")
    p.add_argument("--debug-pause-after-pod-group", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--verbose", "-v", action="store_true")
    return p.parse_args(argv)


def build_policy(args: argparse.Namespace) -> tuple[Policy, list[GangScheduler]]:
    enabled = [GangScheduler(s.strip()) for s in args.gang_schedulers.split(",") if s.strip()]
    names = {}
    for item in args.scheduler_name:
        scheduler, _, name = item.partition("=")
        names[GangScheduler(scheduler)] = name
    return Policy(heartbeat_timeout_s=args.heartbeat_timeout, scheduler_names=names, enabled=frozenset(enabled)), enabled


def build_options(args: argparse.Namespace) -> BuildOptions:
    return BuildOptions(ray_version=args.ray_version, head_cpu=args.head_cpu, head_memory=args.head_memory,
                        trainer_command=tuple(shlex.split(args.trainer_command)),
                        operator_namespace=args.operator_namespace or None,
                        operator_pod_labels=tuple(label_pair(item) for item in args.operator_pod_label))


def label_pair(item: str) -> tuple[str, str]:
    """'KEY=VALUE' of --operator-pod-label."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--operator-pod-label {item!r}: expected KEY=VALUE")
    return key, value


def peering_priority(explicit: int | None, pod_name: str | None) -> int:
    """kopf freezes every replica when two share a priority: give each pod its own, stable one."""
    if explicit is not None:
        return explicit
    if not pod_name:
        return 0
    return 1 + int(hashlib.sha256(pod_name.encode()).hexdigest()[:8], 16) % 1_000_000


def peer_identity(pod_name: str | None) -> str:
    """This process's name in the peering object (kopf's own default has the same shape): unique per
    start, so a restarted replica never takes its predecessor's entry for its own."""
    who = pod_name or f"{getpass.getuser()}@{socket.gethostname()}"
    started = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d%H%M%S")
    return f"{who}/{started}/{secrets.token_hex(3)}"


def build_settings(pod_name: str | None) -> kopf.OperatorSettings:
    """kopf's settings that must hold from the start: the Events name this operator, and this
    replica (its pod), as the component and instance that report them."""
    settings = kopf.OperatorSettings()
    settings.posting.reporting_component = REPORTING_COMPONENT
    settings.posting.reporting_instance = pod_name or socket.gethostname()
    settings.posting.event_name_prefix = f"{REPORTING_COMPONENT}-"
    return settings


def post_event(job: Job, event: Event) -> None:
    metrics.count_event(event)
    handlers.post_event(job, event)


def tune_gc(full_every_s: float) -> threading.Event | None:
    """Full garbage collections on a timer, not on CPython's own trigger; returns the timer's stop.

    A full collection stops the whole process (event loop and API threads) while it scans every
    live object. CPython starts one whenever the objects that survived into the old generation
    since the last one reach a quarter of it; the operator replaces each watched object's body on
    every event, so at 500 jobs that was every 5 to 6 s, each stopping it 0.3 to 0.5 s (a report
    arriving then waited). The cyclic garbage those collections found was small (100 to 2,500
    objects each), so running them every few minutes costs little memory. The imports' objects
    are frozen out of the scans first (they live as long as the process).
    """
    if full_every_s <= 0:
        return None
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 1_000_000)  # the old generation: in effect only on the timer
    stop = threading.Event()

    def collect() -> None:
        while not stop.wait(full_every_s):
            gc.collect()

    threading.Thread(target=collect, name="gc-full", daemon=True).start()
    return stop


def write_stats(path: Path | None, kube: Kube) -> None:
    if path is not None:
        path.write_text(json.dumps(dict(sorted(kube.counts.items())), indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    policy, enabled = build_policy(args)
    options = build_options(args)
    kube = Kube.from_environment(connections=args.api_connections, status_connections=args.status_connections)
    if args.launcher == "local":
        launcher = LocalLauncher(kube, state_dir=args.state_dir.expanduser().resolve(), options=options)
    else:
        launcher = RayJobsLauncher(kube=kube, options=options)
    reconciler = Reconciler(kube=kube, launcher=launcher, policy=policy, options=options,
                            post_event=post_event, pause_after_pod_group_s=args.debug_pause_after_pod_group)
    resources = tuple(r for s in enabled if (r := backend_for(s).pod_group_resource) is not None)
    registry = kopf.OperatorRegistry()
    handlers.register(registry, pod_group_resources=resources, namespaced=bool(args.namespace),
                      kueue=GangScheduler.KUEUE in enabled)
    identity, priority = peer_identity(os.environ.get("POD_NAME")), peering_priority(args.priority, os.environ.get("POD_NAME"))
    leadership = (Leadership(kube, paths=peering_paths(args.peering, args.namespace), identity=identity, priority=priority)
                  if args.peering else Leadership())
    runtime = handlers.Runtime(reconciler=reconciler, launcher=launcher, pod_group_resources=resources,
                               leadership=leadership)
    if args.metrics_port:
        phases = metrics.JobPhases()
        metrics.register(registry, phases)
        metrics.count_watch_restarts(shown_level=logging.getLogger().getEffectiveLevel())
        metrics.serve(args.metrics_port, metrics.build_registry(api_counts=kube.counts, phases=phases,
                                                              serving=leadership.is_serving))
    gc_timer = tune_gc(args.gc_full_every)
    if args.stats_file and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, lambda *_: write_stats(args.stats_file, kube))
    try:
        kopf.run(
            registry=registry, settings=build_settings(os.environ.get("POD_NAME")), memo=kopf.Memo(runtime=runtime),
            standalone=args.peering is None,
            peering_name=args.peering, priority=priority, identity=identity, liveness_endpoint=args.liveness,
            namespaces=args.namespace, clusterwide=not args.namespace,
        )
    except asyncio.CancelledError:
        pass
    finally:
        if gc_timer is not None:
            gc_timer.set()
        write_stats(args.stats_file, kube)
    return 0


if __name__ == "__main__":
    sys.exit(main())
