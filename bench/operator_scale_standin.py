"""One process that stands in for every trainer of the scale benchmark.

    python bench/operator_scale_standin.py --spool DIR --log OUT.jsonl --every S --steps N --warmup W

The operator (`--launcher local`) starts, per job, the command `operator_scale.py` gives it
(`STANDIN_COMMAND`): a shell that drops a line "namespace name attempt folder" into the spool
directory and then sleeps, so the operator sees a live trainer process at the cost of a `sleep`.
This process picks each line up and reports for that job exactly as the real trainer does
(`ppo_trainer.reporting.kubernetes.progress_patch` of a `Progress`: a JSON merge patch of the job's
progress ConfigMap, authenticated with the job's own ServiceAccount token from the kubeconfig
the operator wrote into the folder; the operator folds it into the PPOJob's status). Its steps
take S seconds each (the first W critic-only), then it finishes; it reports at the start, at
each step and at the end as far as the trainer's own throttle lets it
(`ppo_trainer.reporting.kubernetes.Throttle`: warm-up steps and the end at once, other steps at most one
per `MIN_INTERVAL_S`, fewer while the API server is slow). Each report is logged with the
monotonic time its PATCH returned and the phase the operator should show after it (Training after
the last critic-only step, Succeeded after `finished`), from which the benchmark computes the
status lag.
Depends on aiohttp, PyYAML and the trainer's reporting modules (no torch, no Ray).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from ppo_trainer.reporting.kubernetes import Throttle, progress_patch
from ppo_trainer.reporting.reporters import Progress, utc_now
from ppojob_api.progress import MIN_INTERVAL_S, SLOWDOWN
from ppojob_api.vocabulary import Stage, TrainResidency

MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class Registration:
    namespace: str
    name: str
    attempt: int
    progress_configmap: str
    folder: Path


def parse_registration(line: str) -> Registration:
    namespace, name, attempt, configmap, folder = line.split(maxsplit=4)
    return Registration(namespace, name, int(attempt), configmap, Path(folder.strip()))


def progress_at(step: int, *, steps: int, warmup: int, attempt: int, finished: bool = False) -> Progress:
    """The snapshot the trainer reports after `step` steps (step 0: the first report)."""
    return Progress(
        total_steps=steps, critic_only_steps=warmup, attempt=attempt, step=step,
        critic_only_steps_done=min(step, warmup),
        stage=Stage.DONE if finished else Stage.GENERATE,
        actor=TrainResidency.OFFLOADED, critic=TrainResidency.OFFLOADED, finished=finished,
    )


def expected_phase(step: int, *, warmup: int, finished: bool) -> str | None:
    """The phase this report should move the job to, or None when the phase stays."""
    if finished:
        return "Succeeded"
    return "Training" if warmup and step == warmup else None


def snapshots(*, steps: int, warmup: int, attempt: int, every: float) -> list[tuple[float, Progress]]:
    """(seconds after the start, snapshot) of each report a trainer would send unthrottled: the start,
    a step every `every` seconds, the end right after the last step."""
    return [(min(step, steps) * every, progress_at(min(step, steps), steps=steps, warmup=warmup, attempt=attempt,
                                                    finished=step > steps))
            for step in range(steps + 2)]


def credentials(folder: Path) -> tuple[str, str, ssl.SSLContext]:
    """(server, token, TLS context) from the kubeconfig the operator wrote for the job."""
    kubeconfig = yaml.safe_load((folder / "kubeconfig").read_text())
    cluster = kubeconfig["clusters"][0]["cluster"]
    token = kubeconfig["users"][0]["user"]["token"]
    context = ssl.create_default_context(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
    return cluster["server"], token, context


class Standin:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.log = open(args.log, "a", buffering=1)  # noqa: SIM115 (one line per report, for the whole run)
        self.seen: set[str] = set()
        self.tasks: set[asyncio.Task] = set()
        self.session: aiohttp.ClientSession | None = None

    async def report(self, job: Registration, server: str, token: str, progress: Progress, phase: str | None) -> float:
        """One PATCH, logged; the seconds it took."""
        path = f"/api/v1/namespaces/{job.namespace}/configmaps/{job.progress_configmap}"
        sent = time.monotonic()
        try:
            async with self.session.patch(f"{server}{path}", data=json.dumps(progress_patch(progress, now=utc_now())),
                                          headers={"Authorization": f"Bearer {token}", "Content-Type": MERGE_PATCH},
                                          timeout=aiohttp.ClientTimeout(total=60)) as response:
                await response.read()
                code = response.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            code = f"{type(exc).__name__}"
        stored = time.monotonic()
        self.log.write(json.dumps({"namespace": job.namespace, "job": job.name, "step": progress.step,
                                   "finished": progress.finished, "phase": phase, "sent": sent,
                                   "stored": stored, "code": code}) + "\n")
        return stored - sent

    async def run_job(self, job: Registration) -> None:
        """A trainer's reports on its step clock; it then waits (its `sleep` is stopped by the operator)."""
        server, token, context = credentials(job.folder)
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context, limit=64))
        a, start = self.args, time.monotonic()
        throttle = Throttle(a.min_interval, a.slowdown)
        for at, progress in snapshots(steps=a.steps, warmup=a.warmup, attempt=job.attempt, every=a.every):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            if throttle.due(progress, start + at):
                phase = expected_phase(progress.step, warmup=a.warmup, finished=progress.finished)
                throttle.sent(progress, start + at, await self.report(job, server, token, progress, phase))

    def pick_up(self) -> None:
        for entry in os.scandir(self.args.spool):
            if entry.name.startswith(".") or entry.name in self.seen:
                continue
            self.seen.add(entry.name)
            task = asyncio.create_task(self.run_job(parse_registration(Path(entry.path).read_text())))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def run(self) -> None:
        while True:
            self.pick_up()
            await asyncio.sleep(0.05)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spool", type=Path, required=True, help="where the per-job commands drop their registration")
    p.add_argument("--log", type=Path, required=True, help="JSON lines, one per report")
    p.add_argument("--every", type=float, default=5.0, help="seconds a step of one job takes")
    p.add_argument("--min-interval", type=float, default=MIN_INTERVAL_S,
                   help="the trainer's throttle: seconds between two reports that are not urgent")
    p.add_argument("--slowdown", type=float, default=SLOWDOWN,
                   help="the trainer's throttle: a routine report waits this many times its last PATCH's time (0: off)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1, help="critic-only steps")
    return p.parse_args(argv)


# The per-job trainer command (before CONFIG): register in SPOOL (a dot file renamed, so never read half
# written), then sleep.
STANDIN_COMMAND = (
    "sh -c 'f=\"$PPOJOB_NAMESPACE.$PPOJOB_NAME.$PPOJOB_ATTEMPT\"; "
    "echo \"$PPOJOB_NAMESPACE $PPOJOB_NAME $PPOJOB_ATTEMPT $PPOJOB_PROGRESS_CONFIGMAP $PWD\" > \"$0/.$f\" && "
    "mv \"$0/.$f\" \"$0/$f\"; "
    "exec sleep 86400' {spool}"
)
"""`{spool}` becomes `$0` of the shell; the operator appends CONFIG --run-dir DIR, which it ignores."""


def main(argv: list[str] | None = None) -> None:
    asyncio.run(Standin(parse_args(argv)).run())


if __name__ == "__main__":
    main()
