"""gpu_ppo_loop: which of the roles' reported transitions count towards the measured steps."""

from gpu_ppo_loop import transition_seconds


def transition(role, frm, to, seconds, time):
    return "transition", {"role": role, "rank": 0, "frm": frm, "to": to, "seconds": seconds, "time": time}


def test_transitions_count_by_when_they_finished_not_by_where_they_were_reported():
    events = [
        transition("actor", "OnDevice", "Offloaded", 9.0, time=99.0),  # the first step's last sleep
        ("step", {"line": "step 1"}),  # its event, at 100.0, before that sleep is drained
        transition("actor", "OnDevice", "Offloaded", 8.0, time=99.5),  # drained after it
        transition("actor", "Offloaded", "OnDevice", 0.2, time=101.0),
        transition("actor", "OnDevice", "Offloaded", 0.4, time=104.0),
        ("step", {"line": "step 2"}),
        transition("actor", "Offloaded", "OnDevice", 0.4, time=106.0),
        transition("actor", "OnDevice", "Offloaded", 0.6, time=109.0),
        ("step", {"line": "step 3"}),
    ]
    per_step = transition_seconds(events, after=100.0, steps=2)
    assert per_step == {"actor Offloaded->OnDevice": (0.2 + 0.4) / 2, "actor OnDevice->Offloaded": (0.4 + 0.6) / 2}
