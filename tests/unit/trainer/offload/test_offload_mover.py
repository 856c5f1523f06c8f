"""The offload room's movers on a CPU (`offload/host_mirror.py`, `side_stream.py`, `kernel_copy.py`): a
HostMirror moves nothing there, and a SideStreamCopy runs its copy's parts as they are queued (not when
prepared), beside the last steps, each once. The GPU side: tests/gpu/test_host_mirror.py."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.offload.host_mirror import HostMirror
from ppo_trainer.offload.kernel_copy import WakeCopyPath, path_name
from ppo_trainer.offload.side_stream import SideStreamCopy


def test_a_side_stream_copy_goes_in_parts_beside_the_last_steps_each_once_on_a_cpu():
    runs: list[tuple[int, int]] = []

    def copy(part: int, parts: int) -> int:
        runs.append((part, parts))
        return 8

    side = SideStreamCopy(device="cpu")
    side.PART_BYTES = 10
    side.prepare(copy, 24)  # three parts of at most 10 bytes
    side.split(5)  # beside the last three of five steps
    assert runs == []
    side.advance()
    side.advance()
    assert runs == []
    side.advance()
    side.split(2)  # too late: a part is queued
    assert runs == [(0, 3)]
    side.wait()  # queues what is left
    side.advance()
    assert runs == [(0, 3), (1, 3), (2, 3)]
    assert side.settle() == {"direction": "onload", "bytes": 24, "seconds": 0.0, "sync_seconds": 0.0,
                             "path": "engines", "beside_compute": True}
    assert side.settle() is None
    side.prepare(copy, 24)
    side.split(2)  # never more parts than steps
    side.wait()
    assert runs[-2:] == [(0, 2), (1, 2)]
    side.prepare(copy, 24)
    side.wait()  # one part unless split
    assert runs[-1] == (0, 1)


def test_a_host_mirror_on_a_cpu_leaves_the_tensors_where_they_are():
    tensors = [torch.ones(3)]
    mirror = HostMirror(device="cpu")
    mirror.to_host(list(tensors), lambda index, moved: tensors.__setitem__(index, moved))
    assert mirror.last_transfer["bytes"] == 0
    assert mirror.stage_on_device(tensors, lambda index, moved: None) is None
    mirror.to_device(tensors, lambda index, moved: None)
    assert mirror.last_transfer["bytes"] == 0 and torch.equal(tensors[0], torch.ones(3))


def test_a_wake_goes_by_the_cores_then_the_engines_then_the_faster_and_rechecks_the_other():
    path, big = WakeCopyPath(), WakeCopyPath.MIN_BYTES
    chosen = []
    for kernel_seconds, engine_seconds in [(2.0, 1.0)] * 20:
        by_kernel = path.by_kernel()
        chosen.append(path_name(by_kernel))
        path.observe(by_kernel, big, kernel_seconds if by_kernel else engine_seconds)
    assert chosen[:3] == ["cores", "engines", "engines"]
    rechecks = [i for i, name in enumerate(chosen) if name == "cores"]
    assert rechecks == [0, WakeCopyPath.RECHECK]  # the engines stayed faster
    path.observe(True, big, 0.5)  # the cores got faster: the next wake follows them
    assert path.by_kernel()


def test_a_small_wake_teaches_the_path_nothing():
    path = WakeCopyPath()
    path.observe(True, WakeCopyPath.MIN_BYTES - 1, 1e-6)
    assert path.by_kernel()  # the cores are still untried
    path.observe(True, WakeCopyPath.MIN_BYTES, 1.0)
    assert not path.by_kernel()


def test_an_in_place_host_mirror_on_a_cpu_leaves_the_tensors_where_they_are():
    tensor = torch.ones(3)
    mirror = HostMirror(device="cpu", in_place=True)
    mirror.to_host([tensor], keep=[False])
    assert mirror.last_transfer["bytes"] == 0 and tensor.untyped_storage().nbytes() == 12
    assert mirror.stage_on_device() is None
    mirror.to_device()
    assert mirror.last_transfer["bytes"] == 0 and torch.equal(tensor, torch.ones(3))


def test_a_host_mirror_refuses_the_other_ways_arguments():
    """Swapped: tensors and `put`, no `keep`; in place: no `put`."""
    with pytest.raises(ValueError, match="in_place"):
        HostMirror(device="cpu").to_host([torch.ones(1)])
    with pytest.raises(ValueError, match="in_place"):
        HostMirror(device="cpu").to_host([torch.ones(1)], lambda index, moved: None, keep=[True])
    with pytest.raises(ValueError, match="in_place"):
        HostMirror(device="cpu", in_place=True).to_host([torch.ones(1)], lambda index, moved: None)
    with pytest.raises(ValueError, match="in_place"):
        HostMirror(device="cpu", in_place=True).to_device([torch.ones(1)], lambda index, moved: None)
