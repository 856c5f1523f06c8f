"""Command line: python -m local_cluster build | images | up | down | env | status."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from . import build as builder
from . import images, kueue, network_policies
from .cluster import ClusterError, LocalCluster
from .pins import default_state_dir, load_pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m local_cluster", description=__doc__)
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"where pids, kubeconfig, certificates and logs live (default: %(default)s → {default_state_dir()})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build (or validate) the cached binaries; prints timings")
    b.add_argument("--force", action="store_true", help="rebuild every binary")
    i = sub.add_parser("images", help="build the pause, operator and CPU trainer images into archives; prints timings")
    i.add_argument(
        "--containerd",
        metavar="SOCKET",
        help=f"also import the archives into the containerd at this socket (namespace {images.CONTAINERD_NAMESPACE})",
    )
    u = sub.add_parser("up", help="build if needed, start the cluster, wait until ready, leave it running")
    u.add_argument("--timeout", type=float, default=240, help="seconds to wait for readiness")
    sub.add_parser("down", help="stop exactly the processes `up` started")
    sub.add_parser("env", help="print shell exports for KUBECONFIG and PATH")
    sub.add_parser("status", help="say whether a cluster is running")
    args = parser.parse_args(argv)

    try:
        if args.command == "build":
            t = time.monotonic()
            record = builder.build(load_pins(), force=args.force)
            kueue.build(load_pins(), force=args.force, out=sys.stdout)
            network_policies.build(load_pins(), force=args.force, out=sys.stdout)
            print(f"binaries: {builder.build_dir(load_pins()) / 'bin'}")
            if "timings_s" in record:
                print(
                    f"timings recorded when these binaries were built (s): {record['timings_s']}, "
                    f"total {record['total_s']}s"
                )
            print(f"this invocation took {time.monotonic() - t:.1f}s")
            return 0
        if args.command == "images":
            record = images.build_images()
            for name in images.LOCAL_IMAGES:
                entry = record[name]
                print(f"{name}: {entry['size']}, archive {entry['archive']} ({entry['archive_bytes'] / 1e6:.0f} MB)")
                if args.containerd:
                    seconds = images.import_image(Path(entry["archive"]), address=args.containerd)
                    print(f"[timing] import {name}: {seconds:.1f}s")
            return 0
        if args.command == "up":
            running = LocalCluster.running(args.state_dir)
            if running is not None:
                print(f"local cluster already running; kubeconfig: {running.kubeconfig}")
                return 0
            t = time.monotonic()
            cluster = LocalCluster.start(args.state_dir, timeout=args.timeout, out=sys.stdout)
            print(f"up took {time.monotonic() - t:.1f}s; logs: {cluster.log_dir}")
            print(cluster.kubeconfig)
            return 0
        if args.command == "down":
            cluster = LocalCluster(state_dir=args.state_dir or default_state_dir())
            stopped = cluster.stop()
            print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'}")
            return 0
        if args.command == "env":
            cluster = LocalCluster(state_dir=args.state_dir or default_state_dir())
            print(
                f"export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}; "
                f'export PATH={shlex.quote(str(cluster.bin_dir))}:"$PATH"'
            )
            return 0
        if args.command == "status":
            cluster = LocalCluster(state_dir=args.state_dir or default_state_dir())
            running = cluster.is_running()
            print(f"local cluster {'running' if running else 'not running'} (state: {cluster.state_dir})")
            return 0 if running else 1
    except (ClusterError, builder.BuildError, images.ImagesError) as err:
        print(f"local_cluster {args.command}: {err}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
