"""rollout.engine SGLang through the trainer's roles, on CPU: the rollout worker launches the built-in
server (it speaks SGLang's protocol) with the SGLang launcher, through Ray, Disaggregated.

One PPO step runs for real; the weights the server then serves are the actor's (checked over
HTTP against a local engine loaded with the actor's exported weights), and the weight-update
group is connected right after each actor wake and disconnected right before each sleep.
"""

from __future__ import annotations

import pytest
import torch
from role_state import role_weights
from tests.doubles import sglang_server
from trainer_specs import tiny_spec

from ppo_trainer.reporting.reporters import Recorder
from ppo_trainer.roles.build import PlacementError, build_roles, compute_layout
from ppo_trainer.rollout.base import SamplingParams
from ppo_trainer.rollout.sglang.client import RolloutServerError, SGLangClient
from ppo_trainer.rollout.sglang.engine import SGLangRolloutEngine
from ppo_trainer.rollout.torch_engine import TorchRolloutEngine
from ppo_trainer.train import run_on

PROMPTS = [[256, 104, 105], [256, 65], [256, 111, 107, 33]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
ON, OFF = "OnDevice", "Offloaded"


def sglang_spec(**overrides):
    return tiny_spec(placement="Disaggregated", rollout={"gpus": 1, "engine": "SGLang"}, **overrides)


def served_greedy(url: str):
    engine = SGLangRolloutEngine(servers=[SGLangClient(url)], pad_token_id=258)
    try:
        return engine.generate(PROMPTS, GREEDY)
    finally:
        engine.close()


def test_sglang_roles_sync_the_actor_weights_to_the_served_model(ray_session):
    spec = sglang_spec(ppo={"numRollouts": 1})
    # builtin:tiny is random: the stand-in serves the weights the actor starts from (the spec's seed).
    cpu_server = sglang_server.program("--model-seed", str(spec.seed), "--device", "cpu")
    roles = build_roles(spec, compute_layout(spec, use_gpus=False), timeout=120, sglang_server=cpu_server)
    try:
        [[url]] = roles.rollout.call(roles.rollout.worker_class.server_urls)
        before = served_greedy(url)
        roles.poll()
        recorder = Recorder()
        run_on(roles, spec, reporter=recorder, checkpoint_dir=None)

        # What the server serves now is exactly the trained actor's policy.
        weights = role_weights(roles.actor)
        local = TorchRolloutEngine(model_spec=spec.model, device="cpu", seed=spec.seed)
        local.update_weights(weights.items())
        after, expected = served_greedy(url), local.generate(PROMPTS, GREEDY)
        assert torch.equal(after.response_tokens, expected.response_tokens)
        torch.testing.assert_close(after.log_probs, expected.log_probs, atol=1e-5, rtol=1e-5)
        assert not torch.equal(before.log_probs, after.log_probs)

        events = [(f["role"], f["frm"], f["to"]) for kind, f in recorder.events if kind == "transition"]
        one_turn = [
            ("actor", OFF, ON),
            ("actor.weight_sync", "Disconnected", "Connected"),
            ("actor.weight_sync", "Connected", "Disconnected"),
            ("actor", ON, OFF),
        ]
        assert [e for e in events if e[0].startswith("actor")] == one_turn * 2  # log-probs; train, awake through the broadcast
        assert [e[1:] for e in events if e[0] == "rollout"] == [("Awake", "Asleep"), ("Asleep", "Awake")]

        # The server's end of the group went with the actor's: a bucket now is refused by SGLang's words.
        with pytest.raises(RolloutServerError, match=r"Group weight_update_group not in \[\]"):
            SGLangClient(url).update_weights_from_distributed(names=["x"], dtypes=["float32"], shapes=[[1]])
        # The worker's sleep released the server's memory; its wake resumed it with the weights intact.
        roles.rollout.call(roles.rollout.worker_class.sleep)
        with pytest.raises(RolloutServerError, match="memory released"):
            SGLangClient(url).generate(PROMPTS[:1], [{"max_new_tokens": 2}])
        roles.rollout.call(roles.rollout.worker_class.wake)
        assert torch.equal(served_greedy(url).response_tokens, after.response_tokens)
    finally:
        roles.shutdown()
    assert not SGLangClient(url).health(timeout_s=2)  # shutdown stopped the server the worker launched


def test_sglang_roles_without_gpus_refuse_to_place(ray_session):
    spec = sglang_spec()
    with pytest.raises(PlacementError, match="rollout.engine SGLang needs GPUs"):
        build_roles(spec, compute_layout(spec, use_gpus=False), timeout=10)
