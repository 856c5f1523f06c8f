"""Offload as an explicit state machine: the transitions of one step, idempotent sleep, and the
Disaggregated weight-sync link disconnected before the actor sleeps and connected after it wakes."""

from __future__ import annotations

import pytest
import ray
from role_state import link_states
from trainer_specs import tiny_spec

from ppo_trainer.reporting.reporters import Recorder
from ppo_trainer.roles.build import build_roles, compute_layout
from ppo_trainer.train import run_on
from ppo_trainer.weight_sync.broadcast import Bucket, RemoteReceiver

ON, OFF = "OnDevice", "Offloaded"
WAKE, SLEEP = (OFF, ON), (ON, OFF)


def transitions(recorder: Recorder) -> list[tuple[str, str, str]]:
    return [(f["role"], f["frm"], f["to"]) for kind, f in recorder.events if kind == "transition"]


def per_role(events, role):
    return [(frm, to) for r, frm, to in events if r == role]


def test_offload_transitions_of_one_ppo_step(roles):
    recorder = Recorder()
    run_on(roles, tiny_spec(ppo={"numRollouts": 1}), reporter=recorder, checkpoint_dir=None)
    events = transitions(recorder)

    assert per_role(events, "rollout") == [("Awake", "Asleep"), ("Asleep", "Awake")]  # after generate; for sync
    assert per_role(events, "actor") == [WAKE, SLEEP] * 2  # log-probs; train, awake through the weight export
    assert per_role(events, "ref") == [WAKE, SLEEP]
    assert per_role(events, "critic") == [WAKE, SLEEP]
    # Training roles take turns: never two of them on the device at once.
    on_device = set()
    for role, frm, to in events:
        if role in ("actor", "critic", "ref"):
            if to == ON:
                assert not on_device, f"{role} woke while {on_device} on the device"
                on_device.add(role)
            else:
                on_device.discard(role)
    assert [kind for kind, _ in recorder.events].count("transition") == len(events)


def test_offload_train_false_keeps_actor_critic_and_reference_resident(ray_session):
    spec = tiny_spec(ppo={"numRollouts": 1}, offload={"train": False})
    roles = build_roles(spec, compute_layout(spec, use_gpus=False), timeout=120)
    try:
        recorder = Recorder()
        run_on(roles, spec, reporter=recorder, checkpoint_dir=None)
        training = [(r, frm, to) for r, frm, to in transitions(recorder) if r in ("actor", "critic", "ref")]
        assert training == [], f"offload.train false, yet training roles moved: {training}"
        _, states = roles.poll()
        assert states["actor"] == states["critic"] == states["ref"] == ON
        assert per_role(transitions(recorder), "rollout") == [("Awake", "Asleep"), ("Asleep", "Awake")]
    finally:
        roles.shutdown()


def test_offload_double_sleep_is_a_noop(roles):
    assert roles.critic.call(roles.critic.worker_class.state) == [OFF]
    assert roles.critic.call(roles.critic.worker_class.sleep) == [False]
    assert roles.critic.call(roles.critic.worker_class.sleep) == [False]
    assert roles.rollout.call(roles.rollout.worker_class.sleep) == [True]
    assert roles.rollout.call(roles.rollout.worker_class.sleep) == [False]
    transitions_, states = roles.poll()
    assert [(t.role, t.from_state, t.to_state) for t in transitions_] == [("rollout", "Awake", "Asleep")]
    assert states["rollout"] == "Asleep" and states["critic"] == OFF


def test_offload_disaggregated_link_follows_residency(ray_session):
    spec = tiny_spec(placement="Disaggregated", rollout={"gpus": 1}, ppo={"numRollouts": 1})
    roles = build_roles(spec, compute_layout(spec, use_gpus=False), timeout=120)
    try:
        roles.poll()
        recorder = Recorder()
        run_on(roles, spec, reporter=recorder, checkpoint_dir=None)
        actor_side = [(r, frm, to) for r, frm, to in transitions(recorder) if r.startswith("actor")]
        one_turn = [
            ("actor", OFF, ON),
            ("actor.weight_sync", "Disconnected", "Connected"),
            ("actor.weight_sync", "Connected", "Disconnected"),
            ("actor", ON, OFF),
        ]
        assert actor_side == one_turn * 2  # log-probs; train, awake through the broadcast of the weights
        assert link_states(roles.actor) == ["Disconnected"]
        # The engine's end of the group is gone too: a bucket sent now is refused by name.
        with pytest.raises(ray.exceptions.RayTaskError, match="weight_update_group is not connected"):
            RemoteReceiver(roles.rollout.handles[0]).receive(
                Bucket(names=[], dtypes=[], shapes=[], group_name="weight_update_group"))
    finally:
        roles.shutdown()
