"""`models/residency.py` on a CPU: a HostMirror moves nothing there, and a SideStreamCopy runs its
copy when started (not when prepared), once. The GPU side: tests/gpu/test_host_mirror.py."""

from __future__ import annotations

import torch

from ppo_trainer.models.residency import HostMirror, SideStreamCopy


def test_a_side_stream_copy_runs_when_started_once_and_settles_to_nothing_on_a_cpu():
    runs: list[int] = []
    side = SideStreamCopy(device="cpu")
    side.prepare(lambda: runs.append(1) or 8)
    assert runs == []
    side.start()
    side.start()
    assert runs == [1]
    assert side.settle() is None
    side.prepare(lambda: runs.append(2) or 8)
    side.wait()  # starts what was prepared
    assert runs == [1, 2]


def test_a_host_mirror_on_a_cpu_leaves_the_tensors_where_they_are():
    tensors = [torch.ones(3)]
    mirror = HostMirror(device="cpu")
    mirror.to_host(list(tensors), lambda index, moved: tensors.__setitem__(index, moved))
    assert mirror.last_transfer["bytes"] == 0
    assert mirror.stage_on_device(tensors, lambda index, moved: None) is None
    mirror.to_device(tensors, lambda index, moved: None)
    assert mirror.last_transfer["bytes"] == 0 and torch.equal(tensors[0], torch.ones(3))
