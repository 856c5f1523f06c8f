"""RemoteReward against a real HTTP server in a thread of the test (tests/doubles/reward_server.py):
the protocol, batching, the concurrency bound, retries and their limit, and one-line errors that name
the endpoint and its answer."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.doubles.reward_server import Script, fraction, serve

from ppo_trainer.rewards import RemoteReward, RemoteRewardError, build_reward

RESPONSES = ["aaaa", "abab", "xyz", "", "a", "banana", "cab", "zzzz", "aaab", "qa"]
PROMPTS = [f"prompt {i}" for i in range(len(RESPONSES))]
LABELS = [str(i) if i % 2 else None for i in range(len(RESPONSES))]
FAST = {"backoff_seconds": 0.01, "timeout_seconds": 5}


def score_all(reward: RemoteReward) -> list[float]:
    return reward.score(PROMPTS, RESPONSES, LABELS)


def test_remote_reward_scores_come_from_the_endpoint_in_order():
    with serve(Script()) as server:
        scores = score_all(RemoteReward(url=server.url, **FAST))
        stats = server.stats()
    assert scores == [fraction(r, "a") for r in RESPONSES]
    assert (stats["requests"], stats["samples"]) == (1, len(RESPONSES))


def test_remote_reward_splits_into_batches_and_keeps_the_order():
    with serve(Script(delay_seconds=0.05)) as server:
        scores = score_all(RemoteReward(url=server.url, batch_size=4, max_concurrency=3, **FAST))
        stats = server.stats()
    assert scores == [fraction(r, "a") for r in RESPONSES]
    assert sorted(stats["batch_sizes"]) == [2, 4, 4]


@pytest.mark.parametrize("max_concurrency", [1, 3])
def test_remote_reward_keeps_at_most_max_concurrency_requests_in_flight(max_concurrency):
    with serve(Script(delay_seconds=0.5)) as server:  # long enough for every thread to send before one is answered
        RemoteReward(url=server.url, batch_size=1, max_concurrency=max_concurrency, **FAST).score(
            PROMPTS[:6], RESPONSES[:6], LABELS[:6])
        stats = server.stats()
    assert stats["requests"] == 6
    assert stats["max_in_flight"] == max_concurrency  # reached, never passed


@pytest.mark.parametrize("status", [503, 500, 429])
def test_remote_reward_retries_then_succeeds(status):
    with serve(Script(failures=2, failure_status=status)) as server:
        started = time.monotonic()
        scores = score_all(RemoteReward(url=server.url, max_retries=2, backoff_seconds=0.1))
        elapsed = time.monotonic() - started
        stats = server.stats()
    assert scores == [fraction(r, "a") for r in RESPONSES]
    assert stats["requests"] == 3
    assert elapsed >= 0.1 + 0.2  # the backoff doubles between tries


def test_remote_reward_retries_exhausted_name_the_endpoint_the_status_and_the_tries():
    with serve(Script(failures=100)) as server:
        with pytest.raises(RemoteRewardError) as info:
            score_all(RemoteReward(url=server.url, max_retries=2, **FAST))
        assert server.stats()["requests"] == 3
    assert str(info.value) == (
        f"reward endpoint {server.url} answered HTTP 503: 'warming up, try again' (the last of 3 tries;"
        " reward.remote.maxRetries 2)"
    )


def test_remote_reward_never_retries_a_client_error():
    with serve(Script(answer="refuse")) as server:
        with pytest.raises(RemoteRewardError) as info:
            score_all(RemoteReward(url=server.url, max_retries=3, **FAST))
        assert server.stats()["requests"] == 1
    message = str(info.value)
    assert message == (
        f"reward endpoint {server.url} answered HTTP 400: 'this scorer refuses the batch: labels must be numbers'"
    )
    assert "\n" not in message


def test_remote_reward_wrong_number_of_scores_is_named():
    with serve(Script(answer="short")) as server, pytest.raises(RemoteRewardError) as info:
        score_all(RemoteReward(url=server.url, batch_size=4, **FAST))
    assert str(info.value) == (
        f"reward endpoint {server.url} answered 3 scores for 4 samples; expected one per sample, in order"
    )


def test_remote_reward_nan_score_is_named_with_its_index():
    with serve(Script(answer="nan")) as server, pytest.raises(RemoteRewardError) as info:
        score_all(RemoteReward(url=server.url, batch_size=4, **FAST))
    assert str(info.value) == f"reward endpoint {server.url}: score 3 is nan, not a finite number"


def test_remote_reward_timeout_is_retried_then_named():
    with serve(Script(delay_seconds=1.0)) as server:
        with pytest.raises(RemoteRewardError) as info:
            score_all(RemoteReward(url=server.url, timeout_seconds=0.2, max_retries=1, backoff_seconds=0.01))
        assert server.stats()["requests"] == 2
    assert str(info.value) == (
        f"reward endpoint {server.url} did not answer within 0.2 s (reward.remote.timeoutSeconds) (the last of 2"
        " tries; reward.remote.maxRetries 1)"
    )


def test_remote_reward_unreachable_endpoint_is_retried_then_named():
    with socket.socket() as probe:  # a port that nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    with pytest.raises(RemoteRewardError) as info:
        score_all(RemoteReward(url=url, max_retries=1, **FAST))
    message = str(info.value)
    assert message.startswith(f"reward endpoint {url} could not be reached (") and "refused" in message
    assert message.endswith("(the last of 2 tries; reward.remote.maxRetries 1)")


@pytest.mark.parametrize("body", ['{"score": [1]}', "scores: 1", "[0.5]"])
def test_remote_reward_answer_that_is_not_the_protocol_is_quoted(body):
    reward = RemoteReward(url="http://scorer:8000/score")
    with pytest.raises(RemoteRewardError) as info:
        reward._scores_of(body.encode(), start=0, count=1)
    assert str(info.value) == (
        f'reward endpoint http://scorer:8000/score answered HTTP 200 without JSON {{"scores": [...]}}: {body!r}'
    )


def test_remote_reward_score_that_is_not_a_number_is_named():
    reward = RemoteReward(url="http://scorer:8000/score")
    with pytest.raises(RemoteRewardError, match=r"score 5 is 'good', not a number$"):
        reward._scores_of(b'{"scores": [1, "good"]}', start=4, count=2)
    with pytest.raises(RemoteRewardError, match=r"score 4 is True, not a number$"):
        reward._scores_of(b'{"scores": [true]}', start=4, count=1)


def test_remote_reward_sends_headers_from_the_environment(monkeypatch):
    monkeypatch.setenv("SCORER_AUTHORIZATION", "Bearer s3cret")
    with serve(Script()) as server:
        reward = RemoteReward(url=server.url, headers_from_env={"Authorization": "SCORER_AUTHORIZATION"}, **FAST)
        score_all(reward)
        assert server.stats()["authorization"] == "Bearer s3cret"
    assert "s3cret" not in repr(reward)


def test_remote_reward_header_from_an_unset_variable_is_refused_when_built(monkeypatch):
    monkeypatch.delenv("SCORER_AUTHORIZATION", raising=False)
    with pytest.raises(RemoteRewardError) as info:
        RemoteReward(url="http://scorer/score", headers_from_env={"Authorization": "SCORER_AUTHORIZATION"})
    assert str(info.value) == (
        "reward.remote.headers: header Authorization reads the environment variable SCORER_AUTHORIZATION,"
        " which is not set: add SCORER_AUTHORIZATION to the Secret named in envFromSecret (or export it for a"
        " local run)"
    )


@pytest.mark.parametrize(
    "url, fragment",
    [("http://scorer:99999/score", "has a bad port"), ("ftp://scorer/score", "is not an http:// or https:// URL"),
     ("http:///score", "is not an http:// or https:// URL")],
)
def test_remote_reward_bad_url_is_refused_when_built(url, fragment):
    with pytest.raises(RemoteRewardError, match=f"^reward.remote.url {url!r} {fragment}"):
        RemoteReward(url=url)


def test_remote_reward_of_no_samples_sends_nothing():
    assert RemoteReward(url="http://127.0.0.1:9/score").score([], [], []) == []


def test_build_reward_builds_a_remote_reward_from_its_options():
    reward = build_reward("remote", url="http://scorer/score", batch_size=8, max_concurrency=2)
    assert isinstance(reward, RemoteReward) and (reward.batch_size, reward.max_concurrency) == (8, 2)
    with pytest.raises(ValueError, match="valid options: url, timeout_seconds, max_retries"):
        build_reward("remote", url="http://scorer/score", _headers={})


def test_the_example_server_scores_through_remote_reward_once_it_is_up():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    example = Path(__file__).resolve().parents[3] / "examples" / "reward_server.py"
    server = subprocess.Popen([sys.executable, str(example), str(port)])
    try:
        # Not up yet when the first request goes: refused, retried until it answers.
        reward = RemoteReward(url=f"http://127.0.0.1:{port}/score", max_retries=10, backoff_seconds=0.1)
        assert score_all(reward) == [fraction(r, "a") for r in RESPONSES]
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_jobs_reward_remote_settings_reach_the_remote_reward(monkeypatch):
    from ppo_trainer.roles.rollout import build_spec_reward
    from ppojob_api.spec import parse_spec

    monkeypatch.setenv("SCORER_AUTHORIZATION", "Bearer s3cret")
    remote = {"url": "https://scorer:8443/v1/score", "timeoutSeconds": 2.5, "maxRetries": 7, "maxConcurrency": 5,
              "batchSize": 16, "headers": [{"name": "Authorization", "fromEnv": "SCORER_AUTHORIZATION"}]}
    reward = build_spec_reward(parse_spec({"image": "local", "reward": {"type": "Remote", "remote": remote}}))
    assert reward == RemoteReward(url="https://scorer:8443/v1/score", timeout_seconds=2.5, max_retries=7,
                                  max_concurrency=5, batch_size=16,
                                  headers_from_env={"Authorization": "SCORER_AUTHORIZATION"})
