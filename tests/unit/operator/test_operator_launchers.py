"""The development-mode launcher with real local processes: one trainer per attempt, ever; its exit
code observed; stopped and forgotten. And the Ray job-submission launcher against a fake dashboard."""

from __future__ import annotations

import asyncio
import base64
import fcntl
import os
import sys
import time
from pathlib import Path

from aiohttp import web
from operator_factory import make_job

from ppo_operator.builders.common import BuildOptions
from ppo_operator.kube import KubeError
from ppo_operator.launchers.local import LocalLauncher
from ppo_operator.launchers.ray_jobs import RayJobsLauncher
from ppo_operator.observed import TrainerState


async def serve_on_loopback(app: web.Application) -> tuple[web.AppRunner, int]:
    """A dashboard stand-in served on a free loopback port: its runner (to clean up) and the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]



class TokenKube:
    server = "https://127.0.0.1:6443"
    verifies_tls = True

    def __init__(self):
        self.token_requests = 0
        self.live: dict[str, set[str]] = {}  # namespace -> uids of the PPOJobs that exist
        self.forbidden: set[str] = set()

    async def list_uids(self, resource, namespace, label_selector):
        if namespace in self.forbidden:
            raise KubeError(403, "Forbidden", "ppojobs is forbidden")
        return self.live.get(namespace, set())

    async def request_token(self, namespace, service_account, body):
        self.token_requests += 1
        return "t0k3n"

    def ca_data(self):
        return "Q0E="


def launcher(tmp_path, script: str) -> tuple[LocalLauncher, TokenKube]:
    kube = TokenKube()
    command = (sys.executable, "-c", script)
    return LocalLauncher(kube, state_dir=tmp_path, options=BuildOptions(trainer_command=command)), kube


def wait_state(local, job, attempt, state, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = asyncio.run(local.observe(job, attempt))
        if record.state == state:
            return record
        time.sleep(0.05)
    raise AssertionError(f"not {state}: {record}")


def test_one_trainer_per_attempt_even_when_launched_twice(tmp_path):
    local, kube = launcher(tmp_path, "import time; time.sleep(30)")
    job = make_job()
    assert asyncio.run(local.observe(job, 0)).state == TrainerState.NOT_STARTED
    first = asyncio.run(local.launch(job, 0))
    second = asyncio.run(local.launch(job, 0))  # e.g. after an operator restart
    assert first.state == second.state == TrainerState.RUNNING and first.handle == second.handle
    assert kube.token_requests == 1
    folder = local.attempt_dir(job, 0)
    assert "token: t0k3n" in (folder / "kubeconfig").read_text()
    assert oct((folder / "kubeconfig").stat().st_mode)[-3:] == "600"
    assert asyncio.run(local.stop_others(job, keep_attempt=0)) == []
    assert asyncio.run(local.stop_others(job, keep_attempt=1)) == [0]
    record = wait_state(local, job, 0, TrainerState.FAILED)
    assert "gone without an exit code" in record.message


def test_the_wrapper_records_its_own_pid_and_start_time_before_the_trainer_runs(tmp_path):
    local, _ = launcher(tmp_path, "import time; time.sleep(30)")
    job = make_job()
    record = asyncio.run(local.launch(job, 0))
    pid, start = (local.attempt_dir(job, 0) / "pid").read_text().split()
    assert record.handle == f"local:{pid}"
    assert start == Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    asyncio.run(local.forget(job))


def test_a_launch_killed_before_its_spawn_is_launched_again_not_failed(tmp_path):
    local, kube = launcher(tmp_path, "pass")
    job = make_job()
    folder = local.attempt_dir(job, 0)
    folder.mkdir(parents=True)
    (folder / "launch.lock").touch()  # what a launch leaves when the operator dies before the spawn
    assert asyncio.run(local.observe(job, 0)).state == TrainerState.NOT_STARTED
    asyncio.run(local.launch(job, 0))
    wait_state(local, job, 0, TrainerState.SUCCEEDED)
    assert kube.token_requests == 1


def test_a_held_launch_lock_without_a_pid_is_being_launched_and_never_launched_twice(tmp_path):
    local, kube = launcher(tmp_path, "pass")
    job = make_job()
    folder = local.attempt_dir(job, 0)
    folder.mkdir(parents=True)
    holder = os.open(folder / "launch.lock", os.O_CREAT | os.O_RDWR)  # a wrapper that has not written its pid yet
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert asyncio.run(local.observe(job, 0)).state == TrainerState.UNKNOWN
        assert asyncio.run(local.launch(job, 0)).state == TrainerState.UNKNOWN
        assert kube.token_requests == 0 and not (folder / "trainer.log").exists()
    finally:
        os.close(holder)


def test_exit_codes_are_observed_and_arguments_passed(tmp_path):
    script = "import sys, os; print(sys.argv[1:], os.environ['PPOJOB_ATTEMPT'], os.environ['KUBECONFIG']); sys.exit(3)"
    local, _ = launcher(tmp_path, script)
    job = make_job()
    asyncio.run(local.launch(job, 2))
    record = wait_state(local, job, 2, TrainerState.FAILED)
    assert "exited with code 3" in record.message
    log = (local.attempt_dir(job, 2) / "trainer.log").read_text()
    assert "--resume" in log and "'--run-dir'" in log and f"{local.job_dir(job)}/run" in log and " 2 " in log


def test_a_clean_exit_is_success_and_forget_drops_everything(tmp_path):
    local, _ = launcher(tmp_path, "pass")
    job = make_job()
    asyncio.run(local.launch(job, 0))
    wait_state(local, job, 0, TrainerState.SUCCEEDED)
    asyncio.run(local.forget(job))
    assert not local.job_dir(job).exists()


def test_the_sweep_stops_the_trainers_of_jobs_deleted_while_no_operator_ran_and_keeps_the_rest(tmp_path):
    local, kube = launcher(tmp_path, "import time; time.sleep(30)")
    kept = make_job(name="kept", uid="00000000-0000-0000-0000-000000000001")
    deleted = make_job(name="deleted", uid="00000000-0000-0000-0000-000000000002")
    unlisted = make_job(name="other", namespace="team-b", uid="00000000-0000-0000-0000-000000000003")
    for job in (kept, deleted, unlisted):
        asyncio.run(local.launch(job, 0))
    kube.live = {"team-a": {kept.uid}}
    kube.forbidden = {"team-b"}  # a namespace this operator may not list: left alone
    pid = int((local.attempt_dir(deleted, 0) / "pid").read_text().split()[0])
    assert asyncio.run(local.sweep()) == [f"team-a/deleted-{deleted.uid}"]
    assert not local.job_dir(deleted).exists()
    deadline = time.monotonic() + 5  # SIGKILL is delivered, not waited for
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid)
    assert wait_state(local, kept, 0, TrainerState.RUNNING) and local.job_dir(unlisted).exists()
    assert asyncio.run(RayJobsLauncher(kube=SecretKube(), options=BuildOptions()).sweep()) == []
    for job in (kept, unlisted):
        asyncio.run(local.forget(job))


def alive(pid: int) -> bool:
    """Running, not merely a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


RAY_TOKEN = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


class SecretKube:
    """The API server holding each job's Ray token Secret (as created: stringData stored as base64 data)."""

    def __init__(self, objects=None):
        self.gets: list[tuple[str, str, str]] = []
        self.objects = objects or {}
        """plural -> the objects a list returns."""
        self.deleted: list[tuple[str, str, int | None]] = []

    async def get(self, resource, namespace, name):
        self.gets.append((resource.plural, namespace, name))
        return {"kind": "Secret", "data": {"token": base64.b64encode(RAY_TOKEN.encode()).decode()}}

    async def list(self, resource, namespace, label_selector):
        assert label_selector == "ppojob.io/job-name=tiny"
        return self.objects.get(resource.plural, [])

    async def ensure_deleted(self, resource, namespace, name, *, grace_period_seconds=None):
        self.deleted.append((resource.plural, name, grace_period_seconds))
        return True


def ray_auth(handler):
    """What Ray's dashboard does with token auth on: 401 without a token, 403 with another one."""

    async def checked(request):
        header = request.headers.get("Authorization")
        if header is None:
            return web.Response(status=401, text="Unauthorized: Missing authentication token")
        if header != f"Bearer {RAY_TOKEN}":
            return web.Response(status=403, text="Forbidden: Invalid authentication token")
        return await handler(request)

    return checked


def test_ray_jobs_launcher_submits_once_and_reads_the_state():
    async def scenario():
        jobs: dict[str, dict] = {}

        async def submit(request):
            body = await request.json()
            if body["submission_id"] in jobs:
                return web.Response(status=400, text=f"Job with submission_id {body['submission_id']} already exists.")
            jobs[body["submission_id"]] = {"status": "RUNNING", "message": ""}
            return web.json_response({"submission_id": body["submission_id"]})

        async def info(request):
            found = jobs.get(request.match_info["id"])
            return web.json_response(found) if found else web.Response(status=404)

        app = web.Application()
        app.router.add_post("/api/jobs/", ray_auth(submit))
        app.router.add_get("/api/jobs/{id}", ray_auth(info))
        runner, port = await serve_on_loopback(app)
        kube = SecretKube()
        ray = RayJobsLauncher(kube=kube, options=BuildOptions(), url_of=lambda job, attempt: f"http://127.0.0.1:{port}")
        job = make_job()
        try:
            assert (await ray.observe(job, 0)).state == TrainerState.NOT_STARTED
            await ray.launch(job, 0)
            await ray.launch(job, 0)  # refused by Ray as a duplicate: not an error, not a second trainer
            assert list(jobs) == ["ppojob-1234-abcd-a0"]
            assert (await ray.observe(job, 0)).state == TrainerState.RUNNING
            jobs["ppojob-1234-abcd-a0"] = {"status": "FAILED", "message": "driver exited with 1"}
            record = await ray.observe(job, 0)
            assert record.state == TrainerState.FAILED and "driver exited with 1" in record.message
            # Every request carried the token (the fake refuses others), read from the Secret once.
            assert kube.gets == [("secrets", "team-a", "tiny-ray-token")]
            await ray.forget(job)  # deleted: its token goes from memory
            await ray.observe(job, 0)
            assert len(kube.gets) == 2
        finally:
            await runner.cleanup()
        unreachable = RayJobsLauncher(kube=SecretKube(), options=BuildOptions(),
                                      url_of=lambda job, attempt: "http://127.0.0.1:9")
        assert (await unreachable.observe(job, 0)).state == TrainerState.UNKNOWN

    asyncio.run(scenario())



def test_a_deleted_jobs_ray_pods_are_deleted_with_a_1s_grace_but_not_those_of_a_new_job_of_its_name():
    def owned(name, uid, owner):
        return {"metadata": {"name": name, "uid": uid, "ownerReferences": [{"uid": owner}]}}

    kube = SecretKube({
        "rayclusters": [owned("tiny-a1", "rc-new", "job-new")],  # the deleted job's own cluster is gone already
        "pods": [owned("tiny-a0-head-x", "p1", "rc-old"), owned("tiny-a0-worker-y", "p2", "rc-old"),
                 owned("tiny-a1-head-z", "p3", "rc-new")],
    })
    launcher = RayJobsLauncher(kube=kube, options=BuildOptions())
    asyncio.run(launcher.forget(make_job()))
    assert kube.deleted == [("pods", "tiny-a0-head-x", 1), ("pods", "tiny-a0-worker-y", 1)]


def test_ray_jobs_launcher_waits_for_a_just_started_heads_job_agent_and_no_longer():
    """Ray's dashboard answers before its job agent has registered: 500 "No available agent", which
    is a moment too early, not a refusal; any other 500, or the agent never coming, is an error."""
    async def scenario(agent_after: int, wait_s: float, other_error: bool = False):
        posts = []

        async def submit(request):
            posts.append(await request.json())
            if other_error:
                return web.Response(status=500, text="Internal error: disk full")
            if len(posts) <= agent_after:
                return web.Response(status=500, text="No available agent to submit job, please try again later.")
            return web.json_response({"submission_id": posts[-1]["submission_id"]})

        app = web.Application()
        app.router.add_post("/api/jobs/", ray_auth(submit))
        runner, port = await serve_on_loopback(app)
        ray = RayJobsLauncher(kube=SecretKube(), options=BuildOptions(), agent_wait_s=wait_s,
                              url_of=lambda job, attempt: f"http://127.0.0.1:{port}")
        try:
            return await ray.launch(make_job(), 0), len(posts)
        except RuntimeError as exc:
            return exc, len(posts)
        finally:
            await runner.cleanup()

    record, posts = asyncio.run(scenario(agent_after=2, wait_s=30))
    assert record.state == TrainerState.RUNNING and posts == 3
    error, posts = asyncio.run(scenario(agent_after=100, wait_s=1.5))
    assert isinstance(error, RuntimeError) and "No available agent" in str(error) and 2 <= posts <= 3
    error, posts = asyncio.run(scenario(agent_after=0, wait_s=30, other_error=True))
    assert isinstance(error, RuntimeError) and "disk full" in str(error) and posts == 1


def test_ray_jobs_launcher_without_the_token_says_so_and_asks_no_dashboard():
    class Forbidden:
        async def get(self, resource, namespace, name):
            raise KubeError(403, "Forbidden", 'secrets "tiny-ray-token" is forbidden')

    def no_dashboard(job, attempt):
        raise AssertionError("no request may go out without the token")

    launcher = RayJobsLauncher(kube=Forbidden(), options=BuildOptions(), url_of=no_dashboard)
    record = asyncio.run(launcher.observe(make_job(), 0))
    assert record.state == TrainerState.UNKNOWN and "Ray token is unreadable" in record.message
    assert "403" in record.message


def test_exited_children_are_reaped_at_most_once_a_second(tmp_path, monkeypatch):
    local, _ = launcher(tmp_path, "pass")
    polls = []

    class Child:
        def poll(self):
            polls.append(1)
            return 0

    local._children = {1: Child(), 2: Child()}
    local._reap()
    local._children[3] = Child()
    local._reap()  # within the second: no poll
    assert len(polls) == 2 and 3 in local._children
    monkeypatch.setattr("ppo_operator.launchers.local.REAP_EVERY_S", 0.0)
    local._reap()
    assert len(polls) == 3 and not local._children
