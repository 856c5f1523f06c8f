"""The real-cluster trainer start against a real Ray head on this machine, with Ray's token auth
on: the job-submission API refuses a request without the job's token and takes the operator's
submission, which carries it, once per attempt (a resubmission is refused), runs its entrypoint
(the PPOJob manifest decoded, then the trainer command), and reports its end state."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from ppo_operator.builders.common import BuildOptions
from ppo_operator.job import Job
from ppo_operator.launchers.ray_jobs import RayJobsLauncher
from ppo_operator.observed import TrainerState

pytestmark = [pytest.mark.slow]

RAY = Path(sys.executable).with_name("ray")
TOKEN = secrets.token_hex(32)


class SecretKube:
    """The API server's side of the launcher: the job's Ray token Secret, as the operator created it."""

    async def get(self, resource, namespace, name):
        assert (resource.plural, name) == ("secrets", "tiny-ray-token")
        return {"data": {"token": base64.b64encode(TOKEN.encode()).decode()}}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    if not RAY.exists():
        pytest.skip("ray is not installed (the trainer extra)")
    gcs, dashboard = _port(), _port()
    temp = Path("/tmp") / f"rayop-{os.getpid()}"  # Ray's socket paths must stay short
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}  # as the pods get them
    start = [str(RAY), "start", "--head", f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
             "--num-cpus=1", "--include-dashboard=true", f"--temp-dir={temp}", "--disable-usage-stats"]
    subprocess.run(start, env=env, check=True, capture_output=True, timeout=180)
    try:
        yield f"http://127.0.0.1:{dashboard}"
    finally:
        subprocess.run([str(RAY), "stop", "--force"], env=env, capture_output=True, timeout=120, check=False)
        shutil.rmtree(temp, ignore_errors=True)


def test_submission_runs_once_per_attempt_and_reports_its_end(ray_head, tmp_path):
    out = tmp_path / "argv.json"
    trainer = (sys.executable, "-c", f"import json, sys; json.dump(sys.argv[1:], open({str(out)!r}, 'w'))")
    launcher = RayJobsLauncher(kube=SecretKube(), options=BuildOptions(trainer_command=trainer),
                               run_dir=str(tmp_path / "run"), url_of=lambda job, attempt: ray_head)
    job = Job.from_body({"metadata": {"name": "tiny", "namespace": "ns", "uid": "u-1"},
                         "spec": {"image": "ppojob/trainer:test"}})

    async def scenario():
        async with aiohttp.ClientSession() as session:
            for headers, refused in (({}, 401), ({"Authorization": "Bearer not-the-token"}, 403)):
                async with session.get(f"{ray_head}/api/jobs/", headers=headers) as response:
                    assert response.status == refused, (headers, response.status)
        assert (await launcher.observe(job, 1)).state == TrainerState.NOT_STARTED
        await launcher.launch(job, 1)
        await launcher.launch(job, 1)  # as after an operator restart: refused by Ray, not a second run
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            record = await launcher.observe(job, 1)
            if record.state not in (TrainerState.RUNNING, TrainerState.UNKNOWN):
                return record
            await asyncio.sleep(0.5)
        return record

    record = asyncio.run(scenario())
    assert record.state == TrainerState.SUCCEEDED, record
    assert record.handle == "ppojob-u-1-a1"
    args = json.loads(out.read_text())
    assert args[0] == "/tmp/ppojob-u-1-a1.yaml" and args[1:] == ["--address", "auto", "--run-dir", str(tmp_path / "run"), "--resume"]
