"""The critic's values reach the actor unchanged, rank to rank, and the driver only ever holds refs."""

from __future__ import annotations

import ray
import torch
from conftest import tiny_spec

from ppo_trainer.data import synthetic_prompts
from ppo_trainer.reporting import Recorder
from ppo_trainer.roles.build import build_roles, compute_layout
from ppo_trainer.roles.group import RoleGroup
from ppo_trainer.train import run_on


def test_handoff_values_bit_identical_per_rank(ray_session):
    spec = tiny_spec()
    roles = build_roles(spec, compute_layout(spec, use_gpus=False, cpu_ranks=2), timeout=120)
    try:
        batch, _ = roles.rollout.async_call("generate", synthetic_prompts(8, seed=3), seed=7, num_returns=2)
        old = roles.actor.async_call("log_probs", *batch)
        ref = roles.ref.async_call("log_probs", *batch)
        values, _ = roles.critic.async_train(*batch, old_log_probs=old, ref_log_probs=ref, updates=1, num_returns=2)
        assert len(values) == 2 and all(isinstance(v, ray.ObjectRef) for v in values)

        ray.get(roles.actor.async_train(*batch, old_log_probs=old, ref_log_probs=ref, external_data=values))

        produced = ray.get(list(values))
        received = roles.actor.call("received_external_data")
        for rank in range(2):
            assert received[rank].rank == produced[rank].rank == rank
            assert received[rank].values.dtype == torch.float32 and received[rank].values.device.type == "cpu"
            # bit for bit, not merely close
            assert torch.equal(received[rank].values.view(torch.int32), produced[rank].values.view(torch.int32))
            assert torch.equal(received[rank].returns.view(torch.int32), produced[rank].returns.view(torch.int32))
        assert produced[0].values.shape[0] + produced[1].values.shape[0] == 8
    finally:
        roles.shutdown()


def test_loop_passes_critic_refs_and_never_fetches_them(roles, monkeypatch):
    passed, fetched = [], []
    original_train, original_get = RoleGroup.async_train, ray.get

    def spy_train(self, *args, external_data=None, **kwargs):
        if external_data is not None:
            passed.extend(external_data)
        return original_train(self, *args, external_data=external_data, **kwargs)

    def spy_get(refs, *args, **kwargs):
        fetched.extend(refs if isinstance(refs, list) else [refs])
        return original_get(refs, *args, **kwargs)

    monkeypatch.setattr(RoleGroup, "async_train", spy_train)
    monkeypatch.setattr(ray, "get", spy_get)
    run_on(roles, tiny_spec(), reporter=Recorder(), checkpoint_dir=None)

    assert passed and all(isinstance(ref, ray.ObjectRef) for ref in passed)
    assert not {ref.hex() for ref in passed} & {r.hex() for r in fetched if isinstance(r, ray.ObjectRef)}
