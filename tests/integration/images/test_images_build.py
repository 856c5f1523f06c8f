"""The local images built for real (buildah, cached) and run through a containerd of the test's own:
its own root, state, socket and runc root under a temporary folder, so that it touches no other
containerd (the local cluster's lives under the cluster's state dir). The CPU trainer image (7 GB)
is run by the real node instead, where it is imported anyway (tests/integration/cluster/test_real_node.py
and the README's story)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from local_cluster import images

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("buildah") is None or shutil.which("containerd") is None,
        reason="needs buildah and containerd (apt-get install buildah containerd)",
    ),
]

CONFIG = """version = 2
root = "{folder}/root"
state = "{folder}/state"
# ctr talks to containerd directly: no CRI plugin, and so no CNI or sandbox image, is needed.
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{folder}/containerd.sock"
[ttrpc]
  address = "{folder}/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{folder}/opt"
"""


@pytest.fixture(scope="module")
def built():
    return images.build_images()


@pytest.fixture(scope="module")
def containerd():
    """The socket of a containerd started for this module alone, stopped and removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="ppojob-ctrd-", dir="/tmp"))  # a socket path must stay short
    (folder / "config.toml").write_text(CONFIG.format(folder=folder))
    socket = folder / "containerd.sock"
    with (folder / "containerd.log").open("w") as log:
        process = subprocess.Popen(
            ["containerd", "--config", str(folder / "config.toml")], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 30
        while ctr(socket, "version", check=False).returncode != 0:
            assert process.poll() is None, (folder / "containerd.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "containerd did not answer within 30 s"
            time.sleep(0.2)
        yield socket
    finally:
        process.terminate()
        process.wait(timeout=30)
        subprocess.run(["umount", "--recursive", "--quiet", str(folder / "root")], check=False)
        shutil.rmtree(folder, ignore_errors=True)


SMALL_IMAGES = (images.PAUSE_IMAGE, images.OPERATOR_IMAGE)


@pytest.fixture(scope="module")
def imported(built, containerd):
    """The socket of that containerd, with the pause and operator images imported once."""
    for name in SMALL_IMAGES:
        seconds = images.import_image(Path(built[name]["archive"]), address=containerd)
        print(f"[timing] import {name}: {seconds:.1f}s ({built[name]['archive_bytes'] / 1e6:.0f} MB)")
    return containerd


def ctr(socket: Path, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ctr", "--address", str(socket), "--namespace", images.CONTAINERD_NAMESPACE, *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
    )


def run_in(socket: Path, image: str, *command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`command` as the image's process (in place of its entrypoint), as KubeRay's pods run theirs."""
    return ctr(
        socket,
        "run",
        "--rm",
        *run_flags(socket),
        image,
        f"images-test-{uuid.uuid4().hex[:8]}",
        *command,
        check=False,
        timeout=timeout,
    )


def run_flags(socket: Path) -> tuple[str, ...]:
    # runc's state in the test's folder; cgroup "" is /<container id>, which runc removes with the container.
    return ("--runc-root", str(socket.parent / "runc"), "--cgroup", "")


def test_the_build_leaves_no_image_chain_that_no_tag_needs(built):
    buildah = images.Buildah(images.images_dir() / "buildah")
    result = subprocess.run(buildah.command("rmi", "--prune"), capture_output=True, text=True, env=buildah.env(),
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [], "build_images left untagged images that nothing builds on"
    assert built["timings_s"]["prune"] >= 0


def test_the_archives_import_under_the_cri_namespace(imported):
    listed = ctr(imported, "images", "ls", "--quiet").stdout.split()
    assert set(SMALL_IMAGES) <= set(listed)


def test_operator_image_runs_its_entrypoint_as_its_numeric_non_root_user(imported):
    result = run_in(imported, images.OPERATOR_IMAGE, "ppo-operator", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()
    who = run_in(imported, images.OPERATOR_IMAGE, "python", "-c", "import os, kopf; print(os.getuid(), os.getgid())")
    assert who.stdout.split() == ["10001", "10001"], who.stderr


def task_status(socket: Path, container: str) -> str:
    for line in ctr(socket, "tasks", "ls").stdout.splitlines()[1:]:
        name, _pid, status = line.split()
        if name == container:
            return status
    return "absent"


def test_pause_image_waits_until_terminated_and_then_exits_cleanly(imported):
    container = f"pause-test-{uuid.uuid4().hex[:8]}"
    ctr(imported, "run", "--detach", *run_flags(imported), images.PAUSE_IMAGE, container)
    try:
        time.sleep(1)
        assert task_status(imported, container) == "RUNNING"
        ctr(imported, "tasks", "kill", "--signal", "SIGTERM", container)
        deadline = time.monotonic() + 10
        while task_status(imported, container) == "RUNNING":
            assert time.monotonic() < deadline, "the pause process ignored SIGTERM"
            time.sleep(0.2)
        assert task_status(imported, container) == "STOPPED"
    finally:
        ctr(imported, "tasks", "delete", "--force", container, check=False)
        ctr(imported, "containers", "delete", container, check=False)
