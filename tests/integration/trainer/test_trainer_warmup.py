"""Critic-only warm-up: the actor stays put for N steps and moves after; the critic trains every step."""

from __future__ import annotations

from role_state import weights_digests
from trainer_specs import tiny_spec

from ppo_trainer.reporting.reporters import Recorder
from ppo_trainer.train import run_on


class DigestRecorder(Recorder):
    """Records the actor's and critic's state hashes after every step."""

    def __init__(self, roles) -> None:
        super().__init__()
        self.roles = roles
        self.digests = []

    def event(self, kind, **fields):
        super().event(kind, **fields)
        if kind == "step":
            self.digests.append((weights_digests(self.roles.actor)[0], weights_digests(self.roles.critic)[0]))


def test_warmup_actor_frozen_for_n_steps_then_trains(roles):
    spec = tiny_spec(ppo={"numRollouts": 4, "numCriticOnlySteps": 2})
    initial = (weights_digests(roles.actor)[0], weights_digests(roles.critic)[0])
    recorder = DigestRecorder(roles)

    state = run_on(roles, spec, reporter=recorder, checkpoint_dir=None)

    actor = [initial[0]] + [a for a, _ in recorder.digests]
    critic = [initial[1]] + [c for _, c in recorder.digests]
    assert actor[0] == actor[1] == actor[2], "the actor changed during a critic-only step"
    assert actor[2] != actor[3] != actor[4], "the actor did not train after the warm-up"
    assert all(critic[i] != critic[i + 1] for i in range(4)), "the critic must train every step"

    steps = [fields for kind, fields in recorder.events if kind == "step"]
    assert [s["critic_only"] for s in steps] == [True, True, False, False]
    assert all(s["value_loss"] is not None for s in steps)
    assert [s["policy_loss"] is None for s in steps] == [True, True, False, False]

    warmups = [p.warmup for p in recorder.progress]
    assert warmups[0] == "0/2" and "1/2" in warmups and warmups[-1] == "2/2"
    final = recorder.progress[-1]
    assert final.finished and final.steps == "4/4" and final.weight_syncs_skipped == 2
    assert final.to_status()["warmup"] == "2/2" and final.to_status()["weightSyncsSkipped"] == 2
    assert state.critic_only_steps_done == 2 and state.weight_syncs_skipped == 2
