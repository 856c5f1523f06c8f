"""The Disaggregated weight sync over NCCL: the actor on GPU 0, a built-in server on GPU 1.

Marked `gpu` and skipped without two CUDA devices. The group is built with the recipe SGLang
uses, over NCCL as in production; connect, bucketed broadcast and disconnect are repeated around
the engine's sleep and wake, and each time the next greedy generation is that of the new weights.
"""

from __future__ import annotations

import pytest
import torch
from tests.doubles import sglang_server

from ppo_trainer.models.builtin import build_policy
from ppo_trainer.rollout.base import SamplingParams
from ppo_trainer.rollout.sglang.engine import SGLangRolloutEngine
from ppo_trainer.rollout.sglang.launcher import launch_engine_server
from ppo_trainer.rollout.torch_engine import TorchRolloutEngine
from ppo_trainer.weight_sync.broadcast import GroupSender, ServerReceiver
from ppojob_api.spec import PPOJobSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (actor and server)"),
]

SPEC = PPOJobSpec(image="test", seed=1)
PROMPTS = [[256, 104, 105], [256, 65], [256, 111, 107, 33], [256, 120]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


def test_nccl_weight_sync_to_a_server_on_another_gpu_across_sleep_and_wake(tmp_path):
    torch.cuda.set_device(0)
    server = launch_engine_server(
        SPEC,
        engine_index=0,
        host="127.0.0.1",
        log_dir=tmp_path,
        program=sglang_server.program("--device", "cuda", "--model-seed", "7"),
        base_gpu_id=1,
        timeout_s=300,
    )
    engine = SGLangRolloutEngine(servers=[server.client()], pad_token_id=258)
    sync = GroupSender(receivers=[ServerReceiver(engine.servers)], master_address="127.0.0.1", backend="nccl",
                       bucket_bytes=64 * 1024)
    try:
        for seed in (99, 5, 99):
            policy = build_policy(SPEC.model, seed=seed, device="cuda:0")
            sync.connect()  # after the actor wakes
            sync.broadcast(policy.named_parameters())
            sync.disconnect()  # before the actor sleeps
            engine.sleep()
            engine.wake_up()
            served = engine.generate(PROMPTS, GREEDY)
            local = TorchRolloutEngine(model_spec=SPEC.model, device="cuda:0", seed=seed).generate(PROMPTS, GREEDY)
            assert torch.equal(served.response_tokens, local.response_tokens), f"seed {seed}"
            torch.testing.assert_close(served.log_probs, local.log_probs, atol=1e-4, rtol=1e-4)
    finally:
        engine.close()
        server.stop()
