"""The critic's values reach every actor rank unchanged, by sample id, whatever the two roles'
data-parallel sizes, and the driver only ever holds refs."""

from __future__ import annotations

import pytest
import ray
import torch
from role_state import received_values, record_received_values
from trainer_specs import tiny_spec

from ppo_trainer.data import synthetic_prompts
from ppo_trainer.reporting.reporters import Recorder
from ppo_trainer.roles.actor import ActorWorker
from ppo_trainer.roles.build import build_roles, compute_layout
from ppo_trainer.roles.critic import CriticWorker
from ppo_trainer.roles.group import RoleGroup
from ppo_trainer.roles.ref import RefWorker
from ppo_trainer.roles.rollout import RolloutWorker
from ppo_trainer.train import run_on


@pytest.mark.parametrize(("actor_data", "critic_data"), [(2, 2), (2, 1), (1, 2)])
def test_handoff_values_bit_identical_per_sample(ray_session, actor_data, critic_data):
    spec = tiny_spec(actor={"parallelism": {"data": actor_data}}, critic={"parallelism": {"data": critic_data}})
    layout = compute_layout(spec, use_gpus=False, cpu_ranks=2)
    assert (layout.actor.ranks, layout.critic.ranks) == (actor_data, critic_data)
    roles = build_roles(spec, layout, timeout=120)
    try:
        record_received_values(roles.actor)
        batch, _ = roles.rollout.async_call(RolloutWorker.generate, synthetic_prompts(9, seed=3), seed=7, num_returns=2)
        old = roles.actor.async_call(ActorWorker.log_probs, *batch)
        ref = roles.ref.async_call(RefWorker.log_probs, *batch)
        values, _ = roles.critic.async_call(
            CriticWorker.train, *batch, spread=roles.log_probs_for_critic(old, ref), actor_data_size=roles.layout.actor.data, updates=1, num_returns=2)
        routed = roles.values_for_actor(values)
        assert len(values) == critic_data and all(isinstance(v, ray.ObjectRef) for v in values)
        assert all(isinstance(v, ray.ObjectRef) for refs in routed for v in refs)

        ray.get(roles.actor.async_call(ActorWorker.train, *batch, old_log_probs=old, ref_log_probs=ref, spread=routed))

        produced = ray.get(list(values))
        by_sample = {}
        for output in produced:
            for row, sample in enumerate(output.sample_ids.tolist()):
                by_sample[sample] = (output.values[row], output.returns[row])
        assert sorted(by_sample) == list(range(9))  # every sample valued once
        received = received_values(roles.actor)
        assert sorted(s for r in received for s in r.sample_ids.tolist()) == list(range(9))
        for rank, got in enumerate(received):
            assert got.sample_ids.tolist() == list(range(rank, 9, actor_data))
            assert got.values.dtype == torch.float32 and got.values.device.type == "cpu"
            for row, sample in enumerate(got.sample_ids.tolist()):
                values_row, returns_row = by_sample[sample]
                # bit for bit, not merely close
                assert torch.equal(got.values[row].view(torch.int32), values_row.view(torch.int32))
                assert torch.equal(got.returns[row].view(torch.int32), returns_row.view(torch.int32))
    finally:
        roles.shutdown()


def test_loop_passes_critic_refs_and_never_fetches_them(roles, monkeypatch):
    passed, fetched = [], []
    original_call, original_get = RoleGroup.async_call, ray.get

    def spy_call(self, method, *args, spread=None, **kwargs):
        if spread is not None:
            passed.extend(ref for refs in spread for ref in refs)
        return original_call(self, method, *args, spread=spread, **kwargs)

    def spy_get(refs, *args, **kwargs):
        fetched.extend(refs if isinstance(refs, list) else [refs])
        return original_get(refs, *args, **kwargs)

    monkeypatch.setattr(RoleGroup, "async_call", spy_call)
    monkeypatch.setattr(ray, "get", spy_get)
    run_on(roles, tiny_spec(), reporter=Recorder(), checkpoint_dir=None)

    assert passed and all(isinstance(ref, ray.ObjectRef) for ref in passed)
    assert not {ref.hex() for ref in passed} & {r.hex() for r in fetched if isinstance(r, ray.ObjectRef)}
