"""The local cluster's container images, built from the repository's Dockerfiles with buildah (no daemon).

No registry is reachable, so each Dockerfile takes its base as a build argument: here a Debian
bookworm made by mmdebstrap from Debian's packages, tagged by what it contains. The operator and the
CPU trainer are built on it with buildah's layer cache (pip's downloads in a cache mount), and each
image is pushed to an OCI archive (zstd layers) that `import_image` loads into a containerd. The pause image, the
kubelet's pod sandbox (containerd's sandbox_image), is images/pause/pause.c compiled static.

Everything lives under <cache>/images/ (cache: ${PPOJOB_CACHE:-~/.cache/ppojob}): buildah's storage,
its cache mounts, the archives and images.json (what each archive holds, sizes, timings). Each build
ends by pruning the image chains no tag leads to any more, so a dependency change does not leave its
old 6 GB layer behind. Depends on nothing of the cluster's but pins.cache_root.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import debian
from .pins import cache_root

REPO = Path(__file__).resolve().parents[3]

OPERATOR_IMAGE = "localhost/ppojob-operator:dev"
TRAINER_CPU_IMAGE = "localhost/ppojob-trainer:cpu-dev"
PAUSE_IMAGE = "localhost/ppojob-pause:dev"
LOCAL_IMAGES = (PAUSE_IMAGE, OPERATOR_IMAGE, TRAINER_CPU_IMAGE)
CONTAINERD_NAMESPACE = "k8s.io"  # the CRI plugin's: the kubelet sees images of this namespace only

STORAGE_DRIVER = "overlay"
PAUSE_SOURCE = REPO / "images" / "pause" / "pause.c"
PAUSE_USER = "65535:65535"  # nobody needs to own the sandbox's process
# Bump when the way a base or the pause image is made changes: forces them to be made again.
RECIPE = "1"


# Debian packages the builds need (installed when missing), and a file each ships.
BUILD_PACKAGES = {"buildah": Path("/usr/bin/buildah"), "mmdebstrap": Path("/usr/bin/mmdebstrap"),
                  "containerd": Path("/usr/bin/ctr"), "runc": Path("/usr/sbin/runc")}
# The OCI runtime of RUN steps. Debian's buildah takes crun when it is installed first, and crun
# refuses these machines' hybrid cgroups (v1, plus a v2 hierarchy holding hugetlb): runc, which
# the real node's containerd uses too, runs them.
BUILD_RUNTIME = "runc"


class ImagesError(RuntimeError):
    """A tool is missing, a build step failed (the message names the command and its log), or an
    archive or containerd socket is not where it was said to be."""


@dataclass(frozen=True)
class DebianBase:
    """A base image made from Debian packages by mmdebstrap; its tag carries a key of what it holds."""

    suite: str
    packages: tuple[str, ...]
    mirrors: tuple[str, ...]
    python: str  # the interpreter's package on this suite (what `python3` is): the trainer's PYTHON
    variant: str = "minbase"

    def key(self) -> str:
        text = "\n".join([self.suite, self.variant, *sorted(self.packages), *self.mirrors, f"recipe={RECIPE}"])
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def image(self) -> str:
        return f"localhost/ppojob-base:{self.suite}-{self.key()}"

    def mmdebstrap_command(self, tarball: Path) -> list[str]:
        return [
            "mmdebstrap",
            f"--variant={self.variant}",
            f"--include={','.join(self.packages)}",
            self.suite,
            str(tarball),
            *self.mirrors,
        ]


BOOKWORM = DebianBase(
    suite="bookworm",
    # The operator's Dockerfile needs python3 with venv, groupadd and useradd (passwd); the trainer's
    # installs its own packages with apt from these same mirrors.
    packages=("ca-certificates", "passwd", "python3", "python3-venv"),
    mirrors=(
        "deb http://deb.debian.org/debian bookworm main",
        "deb http://deb.debian.org/debian bookworm-updates main",
        "deb http://deb.debian.org/debian-security bookworm-security main",
    ),
    python="python3.11",
)

# Scratch images have no environment; the Dockerfiles extend PATH, so the base must set it.
BASE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8")


@dataclass(frozen=True)
class DockerfileImage:
    """An image built from one of images/*/Dockerfile with these build arguments."""

    name: str
    dockerfile: str  # relative to the repository root, the build context
    build_args: tuple[tuple[str, str], ...]
    # Earlier stages (FROM ... AS <stage>) built and tagged on their own first: the prune after a
    # build keeps only what a tag leads to, and an untagged stage would lose its layer cache.
    tagged_stages: tuple[str, ...] = ()


def stage_image(name: str, stage: str) -> str:
    """The tag of `name`'s stage: localhost/ppojob-operator:dev, build -> localhost/ppojob-operator-build:dev."""
    repository, _, tag = name.rpartition(":")
    return f"{repository}-{stage}:{tag}"


def dockerfile_images(base: DebianBase = BOOKWORM) -> tuple[DockerfileImage, ...]:
    """The operator and the CPU trainer (no megatron, no SGLang) on the Debian base."""
    return (
        DockerfileImage(OPERATOR_IMAGE, "images/operator/Dockerfile", (("BASE_IMAGE", base.image),), ("build",)),
        DockerfileImage(
            TRAINER_CPU_IMAGE,
            "images/trainer/Dockerfile",
            (("BASE_IMAGE", base.image), ("PYTHON", base.python), ("EXTRAS", "trainer"), ("DROP_PACKAGES", "triton")),
        ),
    )


def images_dir() -> Path:
    return cache_root() / "images"


def archive_path(name: str) -> Path:
    """Where `name`'s docker archive lives: localhost/ppojob-operator:dev -> <cache>/images/archives/ppojob-operator-dev.tar."""
    repository, _, tag = name.rpartition(":")
    if not repository or "/" not in repository:
        raise ImagesError(f"image name {name!r} is not REGISTRY/REPOSITORY:TAG (e.g. {OPERATOR_IMAGE})")
    return images_dir() / "archives" / f"{repository.rsplit('/', 1)[1]}-{tag}.tar"


@dataclass(frozen=True)
class Buildah:
    """buildah with its storage, run state and cache mounts under one folder of ours."""

    root: Path

    def command(self, *args: str) -> list[str]:
        return [
            "buildah",
            "--root",
            str(self.root / "storage"),
            "--runroot",
            str(self.root / "run"),
            "--storage-driver",
            STORAGE_DRIVER,
            *args,
        ]

    def env(self) -> dict[str, str]:
        # buildah keeps RUN --mount=type=cache folders (pip's downloads) under $TMPDIR/buildah-cache.
        return {**os.environ, "TMPDIR": str(self.root / "tmp")}


def bud_command(
    image: DockerfileImage, *, buildah: Buildah, volumes: tuple[str, ...], context: Path = REPO,
    stage: str | None = None,
) -> list[str]:
    """buildah bud with the layer cache, no pulls (the base is local) and the host's network (pip, apt);
    with `stage`, that stage alone, tagged as `stage_image` says."""
    args = ["bud", "--layers", "--pull=never", "--network", "host", "--runtime", BUILD_RUNTIME,
            "-f", str(context / image.dockerfile)]
    args += ["--target", stage, "-t", stage_image(image.name, stage)] if stage else ["-t", image.name]
    for key, value in image.build_args:
        args += ["--build-arg", f"{key}={value}"]
    for volume in volumes:
        args += ["--volume", volume]
    return buildah.command(*args, str(context))


# zstd at its fastest level: the CPU trainer's archive is 3.1 GB instead of 6.2 GB (so is the copy in
# containerd's content store) for about 10% more push time; gzip of several GB costs minutes on 2 cores.
ARCHIVE_FORMAT = "oci-archive+zstd:1"


def push_command(name: str, archive: Path, *, buildah: Buildah) -> list[str]:
    return buildah.command("push", "--quiet", "--compression-format", "zstd", "--compression-level", "1",
                           name, f"oci-archive:{archive}:{name}")


def prune_command(buildah: Buildah) -> list[str]:
    """Removes the untagged images no other image builds on: one round peels one step off each
    chain that no tag leads to, so `prune_images` repeats it until it removes nothing."""
    return buildah.command("rmi", "--prune")


def trust_volumes(directory: Path, ca_bundle: Path) -> tuple[str, ...]:
    """Build-time mounts that make pip in a RUN step trust what pip on this machine trusts (here a
    TLS-inspecting proxy's CA): the host's CA bundle and a pip.conf naming it. Nothing of it is
    committed into an image. None if there is no bundle."""
    if not ca_bundle.is_file():
        return ()
    directory.mkdir(parents=True, exist_ok=True)
    pip_conf = directory / "pip.conf"
    pip_conf.write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    return (f"{ca_bundle.resolve()}:/etc/ssl/certs/ca-certificates.crt:ro", f"{pip_conf}:/etc/pip.conf:ro")


def pause_key(source: Path, compiler_version: str) -> str:
    text = source.read_text() + "\n" + compiler_version + f"\nrecipe={RECIPE}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def import_image(
    archive: Path,
    *,
    address: str | Path,
    namespace: str = CONTAINERD_NAMESPACE,
    snapshotter: str = "overlayfs",
) -> float:
    """Load an image archive into the containerd whose socket is `address`, under `namespace`, unpacked
    for `snapshotter` (the CRI plugin runs only unpacked images). Returns the seconds it took."""
    archive = Path(archive)
    if not archive.is_file():
        raise ImagesError(f"no image archive at {archive}: build it with `make images`")
    if not Path(address).exists():
        raise ImagesError(f"no containerd socket at {address}: start that containerd first, or pass its [grpc] address")
    if shutil.which("ctr") is None:
        raise ImagesError("`ctr` is not on PATH: apt-get install containerd")
    cmd = ["ctr", "--address", str(address), "--namespace", namespace, "images", "import"]
    cmd += ["--snapshotter", snapshotter, str(archive)]
    started = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ImagesError(f"`{' '.join(cmd)}` failed (exit {result.returncode}):\n{result.stderr.strip()}")
    return time.monotonic() - started


def disk_report(folder: Path) -> str:
    """Free space where `folder` lives and what the images' parts take there: for a full disk's error."""
    free = shutil.disk_usage(folder if folder.exists() else cache_root().parent).free
    parts = [f"{free / 1e9:.1f} GB free under {folder}"]
    for part in (folder / "buildah" / "storage", folder / "archives"):
        if part.is_dir():
            used = sum(f.stat().st_size for f in part.rglob("*") if f.is_file() and not f.is_symlink())
            parts.append(f"{part.name} {used / 1e9:.1f} GB")
    return "; ".join(parts)


class _Steps:
    """Runs the build's commands with their output in one log, and prints a [timing] line per step."""

    def __init__(self, log: Path, buildah: Buildah, out) -> None:
        self.log, self.buildah, self.out = log, buildah, out
        self.timings: dict[str, float] = {}

    def run(self, cmd: list[str], cwd: Path = REPO) -> None:
        with self.log.open("a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            start = log.tell()
            result = subprocess.run(
                cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=self.buildah.env(), check=False
            )
        if result.returncode != 0:
            with self.log.open("rb") as log:
                log.seek(start)
                tail = "".join(log.read().decode(errors="replace").splitlines(keepends=True)[-25:])
            hint = ""
            if "no space left on device" in tail:
                hint = (f"\nthe disk is full ({disk_report(images_dir())}): a first build needs about 20 GB "
                        "(buildah's storage 6.5 GB, archives 3.6 GB, the real node's containerd 9 GB); free some")
            raise ImagesError(f"`{' '.join(cmd)}` failed (exit {result.returncode}); log: {self.log}\n{tail}{hint}")

    def output(self, cmd: list[str]) -> str:
        result = subprocess.run(cmd, capture_output=True, text=True, env=self.buildah.env(), check=False)
        if result.returncode != 0:
            raise ImagesError(f"`{' '.join(cmd)}` failed (exit {result.returncode}):\n{result.stderr.strip()}")
        return result.stdout.strip()

    def image_id(self, name: str) -> str | None:
        cmd = self.buildah.command("inspect", "--type", "image", "--format", "{{.FromImageID}}", name)
        result = subprocess.run(cmd, capture_output=True, text=True, env=self.buildah.env(), check=False)
        return result.stdout.strip() if result.returncode == 0 else None

    def timing(self, step: str, seconds: float, note: str = "") -> None:
        self.timings[step] = round(seconds, 1)
        print(f"[timing] {step}: {seconds:.1f}s{'  ' + note if note else ''}", file=self.out, flush=True)


def _require_tools(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise ImagesError(f"not on PATH: {', '.join(missing)}; apt-get install {' '.join(missing)}")
    if os.geteuid() != 0:
        raise ImagesError("building the images needs root here (buildah's overlay storage, mmdebstrap's chroot)")


def _ensure_base(base: DebianBase, steps: _Steps, previous: dict) -> dict:
    if steps.image_id(base.image) is not None:
        steps.timing(f"base {base.image}", 0.0, "cached")
        return {**(previous if previous.get("image") == base.image else {}), "image": base.image, "cached": True}
    tarball = steps.buildah.root / "tmp" / f"base-{base.key()}.tar"
    started = time.monotonic()
    try:
        steps.run(base.mmdebstrap_command(tarball))
        made = time.monotonic() - started
        container = steps.output(steps.buildah.command("from", "scratch"))
        steps.run(steps.buildah.command("add", container, str(tarball), "/"))
        config = ["config", "--cmd", "/bin/bash"]
        for variable in BASE_ENV:
            config += ["--env", variable]
        steps.run(steps.buildah.command(*config, container))
        steps.run(steps.buildah.command("commit", "--quiet", "--rm", container, base.image))
    finally:
        tarball.unlink(missing_ok=True)
    total = time.monotonic() - started
    steps.timing(f"base {base.image}", total, f"(mmdebstrap {made:.1f}s, into buildah {total - made:.1f}s)")
    return {"image": base.image, "cached": False, "mmdebstrap_s": round(made, 1)}


def _ensure_pause(steps: _Steps, record: dict) -> dict:
    compiler = steps.output(["gcc", "--version"]).splitlines()[0]
    key = pause_key(PAUSE_SOURCE, compiler)
    previous = record.get(PAUSE_IMAGE, {})
    if previous.get("key") == key and steps.image_id(PAUSE_IMAGE) == previous.get("image_id"):
        steps.timing(f"build {PAUSE_IMAGE}", 0.0, "cached")
        return previous
    started = time.monotonic()
    binary = steps.buildah.root / "tmp" / "pause"
    steps.run(["gcc", "-static", "-Os", "-s", "-Wall", "-Wextra", "-Werror", "-o", str(binary), str(PAUSE_SOURCE)])
    container = steps.output(steps.buildah.command("from", "scratch"))
    steps.run(steps.buildah.command("copy", "--chmod", "0755", container, str(binary), "/pause"))
    steps.run(steps.buildah.command("config", "--entrypoint", '["/pause"]', "--user", PAUSE_USER, container))
    # A fixed timestamp: the same source and compiler give the same image, so nothing downstream churns.
    steps.run(steps.buildah.command("commit", "--quiet", "--rm", "--timestamp", "0", container, PAUSE_IMAGE))
    steps.timing(f"build {PAUSE_IMAGE}", time.monotonic() - started, f"({binary.stat().st_size} byte static binary)")
    return {"key": key, "compiler": compiler}


def _push(name: str, entry: dict, steps: _Steps, previous: dict) -> dict:
    """Push `name` to its archive unless the archive already holds this very image."""
    image_id = steps.image_id(name)
    archive = archive_path(name)
    size = steps.output(steps.buildah.command("images", "--format", "{{.Size}}", name))
    entry = {**entry, "image_id": image_id, "size": size, "archive": str(archive), "archive_format": ARCHIVE_FORMAT}
    if previous.get("image_id") == image_id and previous.get("archive_format") == ARCHIVE_FORMAT and archive.is_file():
        steps.timing(f"push {name}", 0.0, "archive holds this image")
        return {**previous, **entry}
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_suffix(".tar.partial")
    partial.unlink(missing_ok=True)  # a push refuses to write into an existing archive
    started = time.monotonic()
    try:
        steps.run(push_command(name, partial, buildah=steps.buildah))
    except ImagesError:
        partial.unlink(missing_ok=True)  # gigabytes a failed push would otherwise leave behind
        raise
    partial.replace(archive)
    archive_bytes = archive.stat().st_size
    steps.timing(f"push {name}", time.monotonic() - started, f"(archive {archive_bytes / 1e6:.0f} MB)")
    return {**entry, "archive_bytes": archive_bytes, "push_s": steps.timings[f"push {name}"]}


def prune_images(steps: _Steps) -> None:
    """Remove what no tagged image needs (the chains of earlier builds), keeping every current
    image's intermediate steps: they are the layer cache of the next build."""
    started, removed = time.monotonic(), 0
    for _ in range(100):  # a chain is about 20 steps long; the bound only stops a runaway
        ids = steps.output(prune_command(steps.buildah)).split()
        if not ids:
            break
        removed += len(ids)
    steps.timing("prune", time.monotonic() - started, f"({removed} untagged images removed)")


def build_images(*, base: DebianBase = BOOKWORM, out=sys.stdout) -> dict:
    """Make the base if missing, build the pause image, the operator and the CPU trainer, and push each
    to its archive. Returns images.json's record: per image its id, archive, sizes and timings."""
    debian.ensure_packages(BUILD_PACKAGES, out)
    _require_tools("buildah", "mmdebstrap", "gcc")
    root = images_dir()
    buildah = Buildah(root / "buildah")
    for folder in (buildah.root / "tmp", root / "archives"):
        folder.mkdir(parents=True, exist_ok=True)
    record_path = root / "images.json"
    previous = json.loads(record_path.read_text()) if record_path.is_file() else {}
    steps = _Steps(root / "build.log", buildah, out)
    free = shutil.disk_usage(root).free / 1e9
    print(f"building the local images into {root} ({free:.1f} GB free; log: {steps.log})", file=out, flush=True)
    started = time.monotonic()
    record: dict = {"base": _ensure_base(base, steps, previous.get("base", {}))}
    record[PAUSE_IMAGE] = _push(PAUSE_IMAGE, _ensure_pause(steps, previous), steps, previous.get(PAUSE_IMAGE, {}))
    volumes = trust_volumes(root, Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"))
    for image in dockerfile_images(base):
        t = time.monotonic()
        for stage in image.tagged_stages:
            steps.run(bud_command(image, buildah=buildah, volumes=volumes, stage=stage))
        steps.run(bud_command(image, buildah=buildah, volumes=volumes))
        steps.timing(f"build {image.name}", time.monotonic() - t)
        built = {"build_args": dict(image.build_args), "build_s": steps.timings[f"build {image.name}"]}
        record[image.name] = _push(image.name, built, steps, previous.get(image.name, {}))
    prune_images(steps)
    steps.timing("images total", time.monotonic() - started)
    record["timings_s"] = steps.timings
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return record


def loaded_images(address: str | Path, namespace: str = CONTAINERD_NAMESPACE) -> set[str]:
    """Names of the images the containerd at `address` holds in `namespace`."""
    result = subprocess.run(["ctr", "--address", str(address), "--namespace", namespace, "images", "list", "-q"],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ImagesError(f"`ctr images list` at {address} failed: {result.stderr.strip()}")
    return set(result.stdout.split())


def load_images(address: str | Path, names: tuple[str, ...] = LOCAL_IMAGES) -> list[str]:
    """Import the archives of `names` into the containerd at `address` unless it holds that very build
    already (the image ids imported are kept beside its socket, as `loaded-images.json`); the names
    now loaded. The archives must exist (`make images`)."""
    record_path = images_dir() / "images.json"
    built = json.loads(record_path.read_text()) if record_path.is_file() else {}
    loaded_path = Path(address).parent / "loaded-images.json"
    loaded = json.loads(loaded_path.read_text()) if loaded_path.is_file() else {}
    present = loaded_images(address)
    for name in names:
        image_id = built.get(name, {}).get("image_id")
        if name in present and image_id and loaded.get(name) == image_id:
            continue
        import_image(archive_path(name), address=address)
        loaded[name] = image_id
        loaded_path.write_text(json.dumps(loaded, indent=2) + "\n")
    return list(names)


def build_pause_image(out=sys.stdout) -> None:
    """The pause image alone (the real node's sandbox, which it needs before any other image), built
    and pushed to its archive; `build_images` keeps it."""
    debian.ensure_packages({"buildah": BUILD_PACKAGES["buildah"]}, out)
    _require_tools("buildah", "gcc")
    root = images_dir()
    buildah = Buildah(root / "buildah")
    for folder in (buildah.root / "tmp", root / "archives"):
        folder.mkdir(parents=True, exist_ok=True)
    steps = _Steps(root / "build.log", buildah, out)
    _push(PAUSE_IMAGE, _ensure_pause(steps, {}), steps, {})


def ensure_pause_image(address: str | Path, out=sys.stdout) -> None:
    """The kubelet's sandbox image in the containerd at `address`, built first if its archive is missing."""
    if PAUSE_IMAGE in loaded_images(address):
        return
    if not archive_path(PAUSE_IMAGE).is_file():
        build_pause_image(out)
    import_image(archive_path(PAUSE_IMAGE), address=address)
