"""How the local images are built (tools/cluster/local_cluster/images.py, images/project_requirements.py):
the commands, the cache keys, the archive names and the errors, without building anything."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

from local_cluster import images

REPO = Path(__file__).resolve().parents[3]
BUILDAH = images.Buildah(Path("/cache/images/buildah"))


def load_project_requirements():
    spec = importlib.util.spec_from_file_location("project_requirements", REPO / "images/project_requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_buildah_keeps_storage_run_state_and_cache_mounts_in_its_own_folder():
    assert BUILDAH.command("images") == [
        "buildah",
        "--root",
        "/cache/images/buildah/storage",
        "--runroot",
        "/cache/images/buildah/run",
        "--storage-driver",
        "overlay",
        "images",
    ]
    assert BUILDAH.env()["TMPDIR"] == "/cache/images/buildah/tmp"


def test_trainer_cpu_build_is_the_trainer_dockerfile_on_the_debian_base_without_gpu_extras():
    operator, trainer = images.dockerfile_images(images.BOOKWORM)
    assert operator == images.DockerfileImage(
        images.OPERATOR_IMAGE, "images/operator/Dockerfile", (("BASE_IMAGE", images.BOOKWORM.image),), ("build",)
    )
    assert trainer.tagged_stages == ()
    assert trainer.dockerfile == "images/trainer/Dockerfile"
    assert dict(trainer.build_args) == {
        "BASE_IMAGE": images.BOOKWORM.image,
        "PYTHON": "python3.11",
        "EXTRAS": "trainer",
        "DROP_PACKAGES": "triton",
    }
    volumes = ("/host/ca.crt:/etc/ssl/certs/ca-certificates.crt:ro",)
    assert images.bud_command(trainer, buildah=BUILDAH, volumes=volumes, context=Path("/repo")) == BUILDAH.command(
        "bud",
        "--layers",
        "--pull=never",
        "--network",
        "host",
        "--runtime",
        "runc",  # crun refuses these machines' hybrid cgroups
        "-f",
        "/repo/images/trainer/Dockerfile",
        "-t",
        "localhost/ppojob-trainer:cpu-dev",
        "--build-arg",
        f"BASE_IMAGE={images.BOOKWORM.image}",
        "--build-arg",
        "PYTHON=python3.11",
        "--build-arg",
        "EXTRAS=trainer",
        "--build-arg",
        "DROP_PACKAGES=triton",
        "--volume",
        volumes[0],
        "/repo",
    )


def test_a_tagged_stage_is_built_alone_under_its_own_tag_and_is_a_stage_of_its_dockerfile():
    operator, _ = images.dockerfile_images(images.BOOKWORM)
    command = images.bud_command(operator, buildah=BUILDAH, volumes=(), context=Path("/repo"), stage="build")
    assert command[command.index("--target") : command.index("--target") + 4] == [
        "--target", "build", "-t", "localhost/ppojob-operator-build:dev"
    ]
    assert images.OPERATOR_IMAGE not in command
    for image in images.dockerfile_images():
        text = (REPO / image.dockerfile).read_text()
        for stage in image.tagged_stages:
            assert f" AS {stage}\n" in text, f"{image.dockerfile} has no stage {stage}"


def test_build_args_name_only_what_the_dockerfiles_declare():
    for image in images.dockerfile_images():
        text = (REPO / image.dockerfile).read_text()
        for key, _ in image.build_args:
            assert f"ARG {key}=" in text, f"{image.dockerfile} declares no ARG {key}"


def test_base_key_changes_with_what_the_base_holds_and_only_then():
    base = images.BOOKWORM
    same = images.DebianBase(base.suite, tuple(reversed(base.packages)), base.mirrors, base.python)
    assert same.key() == base.key()  # the order packages are listed in is not content
    more = images.DebianBase(base.suite, (*base.packages, "bash-completion"), base.mirrors, base.python)
    other_suite = images.DebianBase("trixie", base.packages, base.mirrors, "python3.13")
    assert len({base.key(), more.key(), other_suite.key()}) == 3
    assert base.image == f"localhost/ppojob-base:bookworm-{base.key()}"


def test_mmdebstrap_makes_a_minimal_bookworm_with_python_and_security_updates():
    command = images.BOOKWORM.mmdebstrap_command(Path("/tmp/base.tar"))
    assert command[:3] == ["mmdebstrap", "--variant=minbase", "--include=ca-certificates,passwd,python3,python3-venv"]
    assert command[3:5] == ["bookworm", "/tmp/base.tar"]
    assert "deb http://deb.debian.org/debian-security bookworm-security main" in command[5:]


def test_push_writes_an_oci_archive_with_zstd_layers_named_as_the_image():
    archive = Path("/cache/images/archives/ppojob-operator-dev.tar")
    assert images.push_command(images.OPERATOR_IMAGE, archive, buildah=BUILDAH) == BUILDAH.command(
        "push",
        "--quiet",
        "--compression-format",
        "zstd",
        "--compression-level",
        "1",
        images.OPERATOR_IMAGE,
        f"oci-archive:{archive}:{images.OPERATOR_IMAGE}",
    )


def test_a_step_that_fills_the_disk_says_so_with_the_free_space_and_what_holds_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PPOJOB_CACHE", str(tmp_path))
    (tmp_path / "images" / "archives").mkdir(parents=True)
    (tmp_path / "images" / "archives" / "old.tar").write_bytes(b"x" * 1000)
    steps = images._Steps(tmp_path / "build.log", images.Buildah(tmp_path / "images" / "buildah"), out=None)
    with pytest.raises(images.ImagesError) as error:
        steps.run(["sh", "-c", "echo 'writing blob: write /x.tar.partial: no space left on device'; exit 125"])
    message = str(error.value)
    assert "exit 125" in message and "the disk is full" in message
    assert f"GB free under {tmp_path / 'images'}" in message and "archives 0.0 GB" in message
    with pytest.raises(images.ImagesError) as other:
        steps.run(["sh", "-c", "echo 'pip: no matching distribution'; exit 1"])
    assert "the disk is full" not in str(other.value)


def test_archive_paths_are_in_the_cache_and_distinct(monkeypatch, tmp_path):
    monkeypatch.setenv("PPOJOB_CACHE", str(tmp_path))
    paths = {images.archive_path(name) for name in images.LOCAL_IMAGES}
    assert paths == {
        tmp_path / "images/archives/ppojob-pause-dev.tar",
        tmp_path / "images/archives/ppojob-operator-dev.tar",
        tmp_path / "images/archives/ppojob-trainer-cpu-dev.tar",
    }


def test_archive_path_of_a_name_without_registry_and_tag_says_what_is_expected():
    with pytest.raises(images.ImagesError, match="is not REGISTRY/REPOSITORY:TAG"):
        images.archive_path("ppojob-operator")


def test_pause_key_follows_its_source_and_compiler(tmp_path):
    source = tmp_path / "pause.c"
    source.write_text("int main(void) { return 0; }\n")
    first = images.pause_key(source, "gcc 12.2.0")
    assert images.pause_key(source, "gcc 12.2.0") == first
    assert images.pause_key(source, "gcc 13.1.0") != first
    source.write_text("int main(void) { return 1; }\n")
    assert images.pause_key(source, "gcc 12.2.0") != first


def test_trust_volumes_mount_the_host_bundle_and_a_pip_conf_read_only(tmp_path):
    bundle = tmp_path / "ca.crt"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    volumes = images.trust_volumes(tmp_path / "images", bundle)
    assert volumes == (
        f"{bundle}:/etc/ssl/certs/ca-certificates.crt:ro",
        f"{tmp_path / 'images/pip.conf'}:/etc/pip.conf:ro",
    )
    pip_conf = (tmp_path / "images/pip.conf").read_text()
    assert "cert = /etc/ssl/certs/ca-certificates.crt" in pip_conf
    assert images.trust_volumes(tmp_path / "other", tmp_path / "missing.crt") == ()


def test_import_of_a_missing_archive_or_socket_names_it_and_the_fix(tmp_path):
    with pytest.raises(images.ImagesError, match=r"no image archive at .*missing\.tar: build it with `make images`"):
        images.import_image(tmp_path / "missing.tar", address=tmp_path / "containerd.sock")
    archive = tmp_path / "image.tar"
    archive.write_bytes(b"")
    with pytest.raises(images.ImagesError, match=r"no containerd socket at .*containerd\.sock"):
        images.import_image(archive, address=tmp_path / "containerd.sock")


def test_project_requirements_are_the_dependencies_then_each_extras_once():
    module = load_project_requirements()
    pyproject = {
        "project": {
            "dependencies": ["pyyaml>=6"],
            "optional-dependencies": {"a": ["kubernetes>=31", "torch>=2.6"], "b": ["kubernetes>=31", "ray==2.60.0"]},
        }
    }
    assert module.project_requirements(pyproject, ["a", "b"]) == [
        "pyyaml>=6",
        "kubernetes>=31",
        "torch>=2.6",
        "ray==2.60.0",
    ]
    with pytest.raises(ValueError, match="pyproject.toml has no extra gpu; it has: a, b"):
        module.project_requirements(pyproject, ["gpu"])


def test_project_requirements_of_the_images_extras_hold_no_gpu_packages_on_cpu():
    module = load_project_requirements()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    cpu = module.project_requirements(pyproject, ["trainer"])
    assert any(r.startswith("torch") for r in cpu) and any(r.startswith("ray[default]") for r in cpu)
    assert not [r for r in cpu if r.startswith(("megatron", "sglang"))]
    operator = module.project_requirements(pyproject, ["operator"])
    assert not [r for r in operator if r.startswith(("torch", "ray", "transformers"))]
