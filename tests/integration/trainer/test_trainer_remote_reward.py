"""reward.type Remote through the real CLI and Ray: a short run scored by a server process the test
started, and a misbehaving server ending the run with one line that names the endpoint; bad settings
refused before Ray starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import yaml
from cli_run import records

STEPS, SAMPLES = 2, 8
SPEC = {"model": {"path": "builtin:tiny"}, "ppo": {"numRollouts": STEPS},
        "rollout": {"batchSize": SAMPLES, "maxNewTokens": 4}, "actor": {"microBatchSize": SAMPLES},
        "checkpoint": {"interval": 0}}


@contextmanager
def reward_server(*args: str) -> Iterator[str]:
    """`tests/doubles/reward_server.py` in a process of its own; yields its URL."""
    process = subprocess.Popen([sys.executable, "-m", "tests.doubles.reward_server", *args],
                               stdout=subprocess.PIPE, text=True)
    try:
        yield process.stdout.readline().strip()
    finally:
        process.terminate()
        process.wait(timeout=30)


def stats(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def ppo_train(tmp_path, reward: dict, *, timeout: int = 120) -> subprocess.CompletedProcess:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({**SPEC, "reward": reward}))
    args = [sys.executable, "-m", "ppo_trainer.cli", str(config), "--run-dir", str(tmp_path / "run"), "--json",
            "--object-store-mb", "200"]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)


def test_remote_reward_scores_a_run_from_the_server_the_test_started(tmp_path):
    with reward_server() as url:
        remote = {"url": url, "batchSize": 3, "maxConcurrency": 2}
        result = ppo_train(tmp_path, {"type": "Remote", "remote": remote}, timeout=600)
        seen = stats(url)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in records(result.stdout.splitlines()) if r["kind"] == "step"]
    assert len(steps) == STEPS
    # Every sample of every step was scored there, in requests of at most 3, and the run's rewards are its scores.
    assert seen["samples"] == STEPS * SAMPLES and max(seen["batch_sizes"]) == 3
    assert seen["requests"] == STEPS * 3  # 8 samples a step: 3 + 3 + 2
    assert sum(s["reward_mean"] * s["samples"] for s in steps) == pytest.approx(seen["score_sum"], abs=1e-4)


def test_remote_reward_misbehaving_server_ends_the_run_with_one_line_naming_the_endpoint(tmp_path):
    with reward_server("--answer", "nan") as url:
        result = ppo_train(tmp_path, {"type": "Remote", "remote": {"url": url, "batchSize": 3}}, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    first = result.stderr.splitlines()[0]
    # The first request's samples are 0-2; the server makes the last score of each request NaN.
    assert first == f"ppo-train: the run failed: RemoteRewardError: reward endpoint {url}: score 2 is nan, not a finite number"
    assert "\x1b" not in result.stderr and "RayTaskError" not in result.stderr and "ray::" not in result.stderr


@pytest.mark.parametrize(
    "remote, expected",
    [
        ({"url": "http://scorer:99999/score"}, "reward.remote.url 'http://scorer:99999/score' has a bad port"),
        ({"url": "http://scorer/score", "headers": [{"name": "Authorization", "fromEnv": "NO_SUCH_SCORER_TOKEN"}]},
         ("reward.remote.headers: header Authorization reads the environment variable NO_SUCH_SCORER_TOKEN,"
          " which is not set")),
    ],
)
def test_remote_reward_bad_settings_exit_2_before_ray_starts(tmp_path, remote, expected):
    started = time.monotonic()
    result = ppo_train(tmp_path, {"type": "Remote", "remote": remote})
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[0].startswith(f"ppo-train: {expected}")
    assert not (tmp_path / "run").exists()  # made just before Ray starts
    assert time.monotonic() - started < 60, "checked before Ray starts: seconds, not Ray's minute"
