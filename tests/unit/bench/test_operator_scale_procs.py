"""The scale benchmark's hold on the cluster's processes: which pid is a component, and its CPU priority."""

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import operator_scale_procs as procs
import pytest


def thread_nices(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.fixture
def cluster(tmp_path: Path):
    """A cluster record (as local_cluster writes it) naming two live processes as the control plane."""
    children = {name: subprocess.Popen(["sleep", "60"]) for name in procs.CONTROL_PLANE}
    record = {"processes": {name: {"pid": child.pid, "start_time": procs._stat_fields(child.pid)[19]}
                            for name, child in children.items()}}
    (tmp_path / "record.json").write_text(json.dumps(record))
    yield SimpleNamespace(record_file=tmp_path / "record.json"), children
    for child in children.values():
        child.kill()
        child.wait()


def test_control_plane_runs_at_the_given_nice_for_the_block_only(cluster):
    record, children = cluster
    pids = [child.pid for child in children.values()]
    with procs.control_plane_priority(record, 7) as applied:  # a higher nice needs no privilege
        assert applied == 7
        assert all(thread_nices(pid) == {7} for pid in pids)
    assert all(thread_nices(pid) == {0} for pid in pids)


def test_a_pid_whose_process_is_gone_is_not_the_component(cluster):
    record, children = cluster
    name, child = next(iter(children.items()))
    assert procs.cluster_pid(record, name) == child.pid
    child.kill()
    child.wait()
    assert procs.cluster_pid(record, name) is None
    with procs.control_plane_priority(record, 0) as applied:
        assert applied == 0
