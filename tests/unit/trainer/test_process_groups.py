"""The role's process group and re-pointing held groups after a rebuild, on gloo (CPU).

A sleeping role destroys its default group (and with it every subgroup); objects built while
the groups lived (megatron's layers, DDP buckets, optimizer) still hold the old ones, and
`repoint_process_groups` must find and replace each of them, or say loudly that it cannot.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import types

import pytest
import torch
import torch.distributed as dist

from ppo_trainer.distributed import (
    RoleProcessGroup,
    find_process_groups,
    group_key,
    merge_groups_of_the_same_ranks,
    repoint_process_groups,
)

Pair = collections.namedtuple("Pair", "group other")


@dataclasses.dataclass
class Bucket:
    group: object
    groups_by_name: dict


class Layer(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.tp_group = group


def build_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.new_group([0], group_desc="TENSOR"), dist.new_group([0], group_desc="DATA")


@pytest.fixture
def no_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_every_held_group_is_replaced_by_its_rebuilt_twin(no_world):
    tensor, data = build_world()
    model = torch.nn.Sequential(Layer(tensor), Layer(tensor))
    bucket = Bucket(group=data, groups_by_name={"tp": tensor})
    holders = [model, bucket, [Pair(tensor, data)], {data: "keyed by its group"}]
    packages = (__name__,)
    old = {id(g): group_key(g) for g in find_process_groups(holders, packages=packages)}
    assert sorted(key[0] for key in old.values()) == ["DATA", "TENSOR"]

    dist.destroy_process_group()
    new_tensor, new_data = build_world()
    rebuilt = {group_key(g): g for g in (new_tensor, new_data)}
    changed = repoint_process_groups(holders, old, rebuilt, packages=packages)

    assert changed == 7
    assert model[0].tp_group is new_tensor and model[1].tp_group is new_tensor
    assert bucket.group is new_data and bucket.groups_by_name["tp"] is new_tensor
    assert holders[2][0] == Pair(new_tensor, new_data) and isinstance(holders[2][0], Pair)
    assert list(holders[3]) == [new_data]
    assert not {id(g) for g in find_process_groups(holders, packages=packages)} & set(old)


def test_a_group_without_a_twin_is_an_error_naming_it(no_world):
    tensor, _ = build_world()
    holders = [Bucket(group=tensor, groups_by_name={})]
    old = {id(g): group_key(g) for g in find_process_groups(holders, packages=(__name__,))}
    dist.destroy_process_group()
    build_world()
    with pytest.raises(RuntimeError, match="'TENSOR' .* was not rebuilt"):
        repoint_process_groups(holders, old, {}, packages=(__name__,))


def test_one_rank_group_builds_and_destroys_around_hooks_as_reported_transitions(no_world):
    seen, transitions = [], []
    group = RoleProcessGroup(role="ref", rank=0, world_size=1, device="cpu", listener=transitions.append)
    group.on_connect = lambda: seen.append(("connected", dist.is_initialized()))
    group.on_disconnect = lambda: seen.append(("disconnecting", dist.is_initialized()))
    with pytest.raises(RuntimeError, match="no rendezvous yet"):
        group.connect()
    group.host("127.0.0.1")
    assert group.connect() and group.connected and dist.get_world_size() == 1
    assert not group.connect()  # already connected: a no-op
    assert group.disconnect()
    group.finish_teardown()
    assert not dist.is_initialized()
    assert group.connect() and group.disconnect()  # a fresh build under a new key prefix
    group.finish_teardown()
    assert seen == [("connected", True), ("disconnecting", True)] * 2
    assert [(t.role, t.to_state) for t in transitions] == [("ref.process_group", "Connected"),
                                                           ("ref.process_group", "Disconnected")] * 2


def test_the_destroy_runs_on_a_thread_that_the_next_connect_waits_for(no_world, monkeypatch):
    group = RoleProcessGroup(role="critic", rank=0, world_size=1, device="cpu")
    group.host("127.0.0.1")
    group.connect()
    release, destroyed_on = threading.Event(), []
    real_destroy = dist.destroy_process_group

    def slow_destroy():
        destroyed_on.append(threading.current_thread())
        release.wait(timeout=30)
        real_destroy()

    monkeypatch.setattr(dist, "destroy_process_group", slow_destroy)
    assert group.disconnect() and not group.connected  # returned while the destroy still waits
    assert dist.is_initialized()
    threading.Timer(0.2, release.set).start()
    assert group.connect() and dist.get_world_size() == 1  # waited for the destroy, then built anew
    assert destroyed_on and destroyed_on[0] is not threading.current_thread()


def test_a_failed_destroy_is_raised_by_the_next_connect(no_world, monkeypatch):
    group = RoleProcessGroup(role="critic", rank=0, world_size=1, device="cpu")
    group.host("127.0.0.1")
    group.connect()
    real_destroy = dist.destroy_process_group

    def failing_destroy():
        real_destroy()
        raise OSError("communicator abort timed out")

    monkeypatch.setattr(dist, "destroy_process_group", failing_destroy)
    group.disconnect()
    with pytest.raises(RuntimeError, match=r"destroying the process group failed on critic\[0\]") as failed:
        group.connect()
    assert isinstance(failed.value.__cause__, OSError)
    assert group.connect()  # the failure was reported once; the next wake builds the group


def test_groups_of_the_same_ranks_are_merged_into_the_default_group(no_world):
    tensor, data = build_world()
    state = types.SimpleNamespace(TENSOR=tensor, DATA=data, LISTED=[data, tensor], NOT_A_GROUP=3, EMPTY=[])
    assert merge_groups_of_the_same_ranks(state) == 4
    world = dist.group.WORLD
    assert state.TENSOR is world and state.DATA is world and state.LISTED == [world, world]
    assert state.NOT_A_GROUP == 3 and state.EMPTY == []
    assert merge_groups_of_the_same_ranks(state) == 0
