"""How long a PPOJob takes to start in real pods on the local cluster's real node: apply -> every pod
Running (its containers ready) and apply -> the trainer's first step, over N jobs one after another.

    .venv/bin/python bench/real_pods_startup.py --runs 5

The chart is installed as in the README's story (tests/e2e/story.py: the operator's two replicas in
containers, the production launcher), the tiny CPU PPOJob (examples/tiny-cpu-ppojob.yaml) applied
under a new name each run and deleted once it has stepped. Prints each run and the medians; needs
`make images` and a cluster with its real node (`make cluster-up`). Absolute times on this noisy
2-core machine are indicative only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

from story import Story, example_job

from local_cluster import LocalCluster, images
from ppo_operator.job import parse_time


def first_step_time(head_logs: str) -> float | None:
    """The wall time (epoch s) of the trainer's first report of a finished step, from its JSON lines
    in the head's log (their own clock: this machine's)."""
    for line in head_logs.splitlines():
        if line.startswith("{") and '"step"' in line:
            record = json.loads(line)
            if record.get("kind") == "progress" and record.get("step", 0) >= 1:
                return parse_time(record["time"]).timestamp()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    cluster = LocalCluster.running() or LocalCluster.start(out=sys.stdout)
    images.load_images(cluster.containerd_address)
    work = Path(tempfile.mkdtemp(prefix="ppojob-startup-"))
    chart = Story(cluster=cluster, work_dir=work / "chart", job_name="none")
    chart.work_dir.mkdir(parents=True)
    chart.create_job_namespace()
    chart.install_chart()
    chart.wait_for_operator()
    rows = []
    try:
        for run in range(args.runs):
            story = Story(cluster=cluster, work_dir=work / f"run-{run}", job_name=f"startup-{run}")
            story.work_dir.mkdir(parents=True)
            story.create_checkpoint_claim()
            try:
                applied = time.time()
                story.apply_job(example_job(story.job_name, claim=story.claim))
                story.wait_for_children()
                story.wait_for_pods()
                deadline = time.monotonic() + 300
                while (stepped := first_step_time(story.head_logs())) is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{story.job_name}: no step within 300 s")
                    time.sleep(1)
                first = round(stepped - applied, 1)
                rows.append((story.figures["apply_to_pods_running_s"], first))
                print(f"run {run}: apply -> pods Running {rows[-1][0]} s, apply -> first step {first} s", flush=True)
            finally:
                story.delete_job()
                story.delete_checkpoint_claim()
    finally:
        chart.uninstall()
    running, stepped = zip(*rows, strict=True)
    print(f"median of {len(rows)}: apply -> pods Running {statistics.median(running):.1f} s "
          f"(min {min(running)}, max {max(running)}); apply -> first step {statistics.median(stepped):.1f} s "
          f"(min {min(stepped)}, max {max(stepped)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
