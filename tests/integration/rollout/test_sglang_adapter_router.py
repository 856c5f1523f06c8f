"""The adapter through the real sglang_router (0.3.2) in front of two built-in servers.

Marked `sglang`: it runs only where sglang_router is importable (never in CI's venv; see
docs/sglang.md for the throwaway venv it was run in). Greedy answers through the router equal
those of the servers called directly, so routing changes nothing but where a prompt runs.
"""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tests.doubles import sglang_server

from ppo_trainer.rollout.base import SamplingParams
from ppo_trainer.rollout.sglang.engine import SGLangRolloutEngine
from ppo_trainer.rollout.sglang.launcher import launch_engine_server, launch_router
from ppojob_api.spec import PPOJobSpec

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang_router") is None,
        reason="sglang-router is not installed (CI never installs it); see docs/sglang.md to run it",
    ),
]

SPEC = PPOJobSpec(image="test", seed=1)
PROMPTS = [[256, 104, 105], [256, 65], [256, 111, 107, 33], [256, 120]]
GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0)


def test_generate_through_the_router_equals_generate_on_the_servers(tmp_path):
    def launch(index: int):
        return launch_engine_server(
            SPEC, engine_index=index, host="127.0.0.1", log_dir=tmp_path, program=sglang_server.program("--model-seed", "7")
        )

    with ThreadPoolExecutor(2) as pool:
        servers = list(pool.map(launch, range(2)))
    router = None
    try:
        router = launch_router(worker_urls=[s.url for s in servers], host="127.0.0.1", log_dir=tmp_path)
        clients = [s.client() for s in servers]
        routed = SGLangRolloutEngine(servers=clients, router=router.client(), pad_token_id=258).generate(PROMPTS, GREEDY)
        direct = SGLangRolloutEngine(servers=clients, pad_token_id=258).generate(PROMPTS, GREEDY)
        assert torch.equal(routed.response_tokens, direct.response_tokens)
        torch.testing.assert_close(routed.log_probs, direct.log_probs)
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()
