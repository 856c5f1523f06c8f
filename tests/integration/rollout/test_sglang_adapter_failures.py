"""The SGLang adapter when servers fail: bounded retries, then an error naming the server, the call and why.

One built-in server with its fault hooks: it answers the first /generate with 503 (as SGLang
does while unhealthy) and exits while serving the third, like a server killed mid-step.
"""

from __future__ import annotations

import pytest
from tests.doubles import sglang_server

from ppo_trainer.rollout.base import SamplingParams
from ppo_trainer.rollout.sglang.client import RetryPolicy, RolloutServerError
from ppo_trainer.rollout.sglang.engine import SGLangRolloutEngine
from ppo_trainer.rollout.sglang.launcher import ServerStartError, launch_engine_server
from ppojob_api.spec import PPOJobSpec, RolloutSpec

SPEC = PPOJobSpec(image="test", seed=1)
PROMPTS = [[256, 104, 105], [256, 65]]
PARAMS = SamplingParams(max_new_tokens=3, temperature=1.0, seed=2)
FAST_RETRY = RetryPolicy(attempts=3, backoff_s=0.05)


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    server = launch_engine_server(
        SPEC,
        engine_index=0,
        host="127.0.0.1",
        log_dir=tmp_path_factory.mktemp("rollout-logs"),
        program=sglang_server.program("--fault-unavailable-generates", "1", "--fault-exit-on-generate", "3"),
        timeout_s=120,
    )
    yield server
    server.stop()


def test_unavailable_server_is_retried_within_the_policy(faulty_server):
    engine = SGLangRolloutEngine(servers=[faulty_server.client(retry=FAST_RETRY)], pad_token_id=258)
    out = engine.generate(PROMPTS, PARAMS)  # the first try gets 503, the second answers
    assert out.response_tokens.shape[0] == len(PROMPTS)


def test_server_dying_mid_generate_fails_with_the_server_the_call_and_the_reason(faulty_server):
    engine = SGLangRolloutEngine(servers=[faulty_server.client(retry=FAST_RETRY)], pad_token_id=258)
    with pytest.raises(RolloutServerError) as caught:
        for _ in range(3):  # the server exits while serving its third /generate
            engine.generate(PROMPTS, PARAMS)
    error = caught.value
    message = str(error)
    assert error.server == faulty_server.url and error.call == "/generate" and error.attempts == 3
    assert f"rollout server {faulty_server.url}: /generate failed after 3 attempts: connection failed" in message
    assert "exited with code 17" in message and "fault hook: exiting while serving /generate" in message
    assert not faulty_server.alive()


def test_server_that_exits_at_start_is_reported_with_its_log(tmp_path):
    # The built-in server serves one device: tensorParallel 2 makes it exit (as a bad SGLang flag would).
    spec = SPEC.model_copy(update={"rollout": RolloutSpec(tensor_parallel=2)})
    with pytest.raises(ServerStartError, match=r"(?s)did not start: process \d+ exited with code 2.*--tp-size 2"):
        launch_engine_server(spec, engine_index=0, host="127.0.0.1", log_dir=tmp_path, program=sglang_server.program(), timeout_s=60)
