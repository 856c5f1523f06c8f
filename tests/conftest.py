"""Shared pytest fixtures: the local Kubernetes cluster (tools/cluster/local_cluster).

`local_cluster` (session): attaches to a cluster already running from the default state dir
(`make cluster-up`) and leaves it running; otherwise starts one and stops exactly the processes it
started at the end of the session. Tests that use it are marked `@pytest.mark.cluster`.

`real_node_images` (session): the operator and CPU trainer images built (cached) and loaded into the
real node's containerd, for tests whose pods run containers there.

`k8s_namespace` (function): a fresh namespace on that cluster, deleted after the test.

`ragged_batch` (function): a small RolloutBatch of ragged responses for the trainer's tests.

At the end of a run the terminal summary gives the seconds each tier (unit, integration, e2e, gpu)
and the slowest test files took, setup and teardown included: where a CI run's time goes.

The repository's root goes on PYTHONPATH: the test doubles (`tests/doubles/`) run as
`python -m tests.doubles...` in processes the tests start, Ray's workers' children included.
"""

from __future__ import annotations

import collections
import os
import re
import uuid
from pathlib import Path

import pytest

from local_cluster import LocalCluster, images

ROOT = str(Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


def _ppojob_crd_stuck(cluster: LocalCluster) -> bool:
    """The PPOJob CRD is being deleted (a chart uninstall) and cannot finish: PPOJobs still carry the
    operator's finalizer, left by operators killed in an earlier session, some of them in namespaces
    already gone, where no API call can reach them. No PPOJob can be created until it finishes."""
    found = cluster.kubectl("get", "crd", "ppojobs.ppojob.io", "-o", "jsonpath={.metadata.deletionTimestamp}",
                            check=False)
    return found.returncode == 0 and bool(found.stdout.strip())


@pytest.fixture(scope="session")
def local_cluster():
    """A ready LocalCluster: .kubeconfig, .bin_dir, .kubectl(*args), .helm(*args), .env(), ..."""
    running = LocalCluster.running()
    if running is not None and _ppojob_crd_stuck(running):
        running.stop()  # a fresh start wipes etcd's data: the stuck objects go with it
        running = None
    if running is not None:
        yield running
        return
    cluster = LocalCluster.start()  # attaches instead if another session started one meanwhile
    try:
        yield cluster
    finally:
        if cluster.owns_processes:
            cluster.stop()


@pytest.fixture(scope="session")
def real_node_images(local_cluster):
    """The names of the images now in the real node's runtime (built first where missing: minutes on
    a fresh machine, seconds afterwards)."""
    images.build_images()
    return images.load_images(local_cluster.containerd_address)


@pytest.fixture
def k8s_namespace(local_cluster, request):
    """Name of a new namespace for this test; deleted (without waiting) afterwards."""
    stem = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = f"{stem}-{uuid.uuid4().hex[:6]}"
    local_cluster.kubectl("create", "namespace", name)
    local_cluster.kubectl("wait", "--for=create", "serviceaccount/default", "-n", name, "--timeout=60s")
    yield name
    local_cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


_SECONDS_BY_FILE: collections.Counter[str] = collections.Counter()


@pytest.fixture
def ragged_batch():
    """A RolloutBatch of 8 rows for the trainer's split-invariance tests (unit and integration): prompts
    of 2-6 tokens, left-padded; responses of 1-8 of 8 tokens; random scores and rollout log-probs, in
    builtin:tiny's vocabulary (258 pads)."""
    import torch

    from ppo_trainer.batch import RolloutBatch

    rows, response, pad = 8, 8, 258
    g = torch.Generator().manual_seed(0)
    lengths = [1, 8, 3, 7, 2, 8, 5, 1]
    prompt_lengths = torch.randint(2, 7, (rows,), generator=g).tolist()
    width = max(prompt_lengths)
    tokens = torch.full((rows, width + response), pad)
    attention = torch.zeros(rows, width + response, dtype=torch.long)
    mask = torch.zeros(rows, response)
    for row, (p, n) in enumerate(zip(prompt_lengths, lengths, strict=True)):
        tokens[row, width - p : width + n] = torch.randint(0, 256, (p + n,), generator=g)
        attention[row, width - p : width + n] = 1
        mask[row, :n] = 1.0
    rollout = -torch.rand(rows, response, generator=g) * 6 * mask
    return RolloutBatch(tokens=tokens, attention_mask=attention, response_mask=mask, prompt_length=width,
                        rollout_log_probs=rollout, scores=torch.rand(rows, generator=g))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS_BY_FILE[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _SECONDS_BY_FILE:
        return
    tiers: collections.Counter[str] = collections.Counter()
    for path, seconds in _SECONDS_BY_FILE.items():
        parts = path.split("/")
        tiers[parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]] += seconds
    terminalreporter.write_sep("=", "seconds by tier and by test file (setup and teardown included)")
    terminalreporter.write_line("  ".join(f"{tier} {seconds:.0f}s" for tier, seconds in tiers.most_common()))
    for path, seconds in _SECONDS_BY_FILE.most_common(15):
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
