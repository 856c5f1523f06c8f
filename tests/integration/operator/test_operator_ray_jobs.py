"""The real-cluster trainer start against a real Ray head on this machine, with Ray's token auth
on: the job-submission API refuses a request without the job's token and takes the operator's
submission, which carries it, once per attempt (a resubmission is refused), runs its entrypoint
(the PPOJob manifest decoded, then the trainer command), and reports its end state. A submission
whose answer never comes (held back here by a proxy, as a loaded head's agent holds it) is sent
again under its id, and the trainer still runs once."""

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
from aiohttp import web

from ppo_operator import names
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


@pytest.fixture(scope="module")
def ray_head():
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
    assert args[0] == "/tmp/ppojob-u-1-a1.yaml" and args[1:] == [
        "--address", "auto", "--run-dir", str(tmp_path / "run"), "--pid-file", names.TRAINER_PID_FILE, "--resume"]


LAUNCHER_TIMEOUT_S = 2.0


def test_an_unanswered_submission_is_sent_again_under_its_id_and_the_trainer_runs_once(ray_head, tmp_path):
    runs = tmp_path / "runs.txt"
    trainer = (sys.executable, "-c", f"open({str(runs)!r}, 'a').write('ran\\n')")
    job = Job.from_body({"metadata": {"name": "tiny", "namespace": "ns", "uid": "u-2"},
                         "spec": {"image": "ppojob/trainer:test"}})
    answers = []

    async def hold_the_first_answer(request):
        """Forwards the POST to Ray; Ray's answer to the first one is held past the launcher's timeout."""
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{ray_head}/api/jobs/", data=await request.read(),
                         headers={"Authorization": request.headers["Authorization"],
                                  "Content-Type": "application/json"}) as response,
        ):
            answer = (response.status, await response.text())
        answers.append(answer)
        if len(answers) == 1:
            await asyncio.sleep(LAUNCHER_TIMEOUT_S + 2)
        return web.Response(status=answer[0], text=answer[1])

    async def scenario():
        app = web.Application()
        app.router.add_post("/api/jobs/", hold_the_first_answer)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        launcher = RayJobsLauncher(kube=SecretKube(), options=BuildOptions(trainer_command=trainer),
                                   run_dir=str(tmp_path / "run"), timeout_s=LAUNCHER_TIMEOUT_S,
                                   url_of=lambda job, attempt: f"http://127.0.0.1:{port}")
        try:
            launched = await launcher.launch(job, 0)
            observer = RayJobsLauncher(kube=SecretKube(), options=BuildOptions(), url_of=lambda job, attempt: ray_head)
            deadline = time.monotonic() + 120
            while (record := await observer.observe(job, 0)).state in (TrainerState.RUNNING, TrainerState.UNKNOWN):
                assert time.monotonic() < deadline, record
                await asyncio.sleep(0.5)
            return launched, record
        finally:
            await runner.cleanup()

    launched, record = asyncio.run(scenario())
    assert launched.state == TrainerState.RUNNING and launched.handle == "ppojob-u-2-a0", launched
    assert record.state == TrainerState.SUCCEEDED, record
    # Ray took one of the submissions; every other was refused as the same id, not run again.
    assert len(answers) >= 2, answers
    assert [status for status, _ in answers].count(200) == 1, answers
    assert all("already exists" in text for status, text in answers if status != 200), answers
    assert runs.read_text() == "ran\n"
