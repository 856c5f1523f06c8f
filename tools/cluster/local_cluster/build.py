"""Build the cluster's binaries from Go modules into a cache directory keyed by the pins.

Three tiny wrapper modules are generated at build time (never committed): "k8s", which requires
k8s.io/kubernetes (with every staging module k8s.io/* replaced by its published v0.X.Y), etcd,
scheduler-plugins and KubeRay, so that they share one set of k8s.io library versions and so the
Go build cache; "tools" for helm and KWOK, whose releases need newer k8s.io libraries; and "node"
for the real node's cluster DNS (CoreDNS, with only the plugins it uses) and crictl, whose own
requirements would otherwise raise the versions the control plane is built with.
Binaries are built one after another (2 cores) with -trimpath and -ldflags "-s -w".
A component whose requirements these modules cannot take is built apart (`build_apart`), in a module
and a cache directory keyed by its own pin.
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

from .pins import Pins, build_dir, cache_root, load_pins


class BuildError(RuntimeError):
    """A Go command failed; the message names the command and its log file."""


@dataclass(frozen=True)
class Binary:
    name: str  # file name under bin/
    module: str  # "k8s" or "tools": which wrapper module builds it
    package: str  # Go package path of the main package
    stamp: str  # which version flags to add: "kube", "helm", "kwok" or ""


BINARIES: tuple[Binary, ...] = (
    Binary("kube-apiserver", "k8s", "k8s.io/kubernetes/cmd/kube-apiserver", "kube"),
    Binary("kube-controller-manager", "k8s", "k8s.io/kubernetes/cmd/kube-controller-manager", "kube"),
    Binary("kube-scheduler", "k8s", "k8s.io/kubernetes/cmd/kube-scheduler", "kube"),
    Binary("kubectl", "k8s", "k8s.io/kubernetes/cmd/kubectl", "kube"),
    Binary("kubelet", "k8s", "k8s.io/kubernetes/cmd/kubelet", "kube"),
    Binary("kube-proxy", "k8s", "k8s.io/kubernetes/cmd/kube-proxy", "kube"),
    Binary("etcd", "k8s", "./cmd/etcd", ""),
    Binary("gang-scheduler", "k8s", "sigs.k8s.io/scheduler-plugins/cmd/scheduler", "kube"),
    Binary("gang-controller", "k8s", "sigs.k8s.io/scheduler-plugins/cmd/controller", "kube"),
    Binary("kuberay-operator", "k8s", "github.com/ray-project/kuberay/ray-operator", "kube"),
    Binary("helm", "tools", "helm.sh/helm/v3/cmd/helm", "helm"),
    Binary("kwok", "tools", "sigs.k8s.io/kwok/cmd/kwok", "kwok"),
    Binary("coredns", "node", "./cmd/coredns", ""),
    Binary("crictl", "node", "sigs.k8s.io/cri-tools/cmd/crictl", ""),
)

KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"
SCHEDULER_PLUGINS_MODULE = "sigs.k8s.io/scheduler-plugins"
KWOK_MODULE = "sigs.k8s.io/kwok"

ETCD_MAIN = """// Command etcd runs the etcd server of go.etcd.io/etcd/server/v3 (generated wrapper).
package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""


# CoreDNS's own main compiles in every plugin it ships (cloud DNS providers among them); the
# cluster DNS needs only these.
COREDNS_MAIN = """// Command coredns serves the local cluster's DNS: CoreDNS with the plugins it uses (generated).
package main

import (
\t_ "github.com/coredns/coredns/plugin/bind"
\t_ "github.com/coredns/coredns/plugin/cache"
\t_ "github.com/coredns/coredns/plugin/errors"
\t_ "github.com/coredns/coredns/plugin/health"
\t_ "github.com/coredns/coredns/plugin/kubernetes"
\t_ "github.com/coredns/coredns/plugin/ready"

\t"github.com/coredns/coredns/coremain"
)

func main() { coremain.Run() }
"""


def go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GOTOOLCHAIN", "local")
    env["GOFLAGS"] = "-buildvcs=false"
    return env


def _run(cmd: list[str], cwd: Path, log: Path) -> None:
    with log.open("a") as out:
        out.write(f"\n$ (cd {cwd} && {' '.join(cmd)})\n")
        out.flush()
        result = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=go_env(), check=False)
    if result.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise BuildError(f"`{' '.join(cmd)}` failed in {cwd} (exit {result.returncode}); log: {log}\n{tail}")


def _go_output(args: list[str], cwd: Path) -> str:
    result = subprocess.run(["go", *args], cwd=cwd, capture_output=True, text=True, env=go_env(), check=False)
    if result.returncode != 0:
        raise BuildError(f"`go {' '.join(args)}` failed in {cwd}:\n{result.stderr.strip()}")
    return result.stdout


def _staging_modules(pins: Pins, cwd: Path) -> list[str]:
    """The k8s.io/* modules that k8s.io/kubernetes requires at v0.0.0 (its staging repos)."""
    info = json.loads(_go_output(["mod", "download", "-json", f"k8s.io/kubernetes@{pins.kubernetes}"], cwd))
    if info.get("Error"):
        raise BuildError(f"k8s.io/kubernetes@{pins.kubernetes}: {info['Error']}")
    modules = []
    for line in Path(info["GoMod"]).read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].startswith("k8s.io/") and parts[1] == "v0.0.0":
            modules.append(parts[0])
    return sorted(set(modules))


def write_k8s_module(pins: Pins, src: Path) -> None:
    src.mkdir(parents=True, exist_ok=True)
    overrides = pins.staging_overrides()
    replaces = [f"\tk8s.io/kubernetes => k8s.io/kubernetes {pins.kubernetes}"]
    for module in _staging_modules(pins, src):
        replaces.append(f"\t{module} => {module} {overrides.get(module, pins.staging)}")
    (src / "go.mod").write_text(
        "module ppojob.local/cluster-k8s\n\ngo 1.26\n\nrequire (\n"
        f"\tk8s.io/kubernetes {pins.kubernetes}\n"
        f"\tgo.etcd.io/etcd/server/v3 {pins['ETCD_VERSION']}\n"
        f"\tsigs.k8s.io/scheduler-plugins {pins['SCHEDULER_PLUGINS_VERSION']}\n"
        f"\tgithub.com/ray-project/kuberay/ray-operator {pins['KUBERAY_VERSION']}\n"
        ")\n\nreplace (\n" + "\n".join(replaces) + "\n)\n"
    )
    imports = "".join(f'\t_ "{b.package}"\n' for b in BINARIES if b.module == "k8s" and not b.package.startswith("."))
    (src / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{imports})\n")
    (src / "cmd" / "etcd").mkdir(parents=True, exist_ok=True)
    (src / "cmd" / "etcd" / "main.go").write_text(ETCD_MAIN)


def write_tools_module(pins: Pins, src: Path) -> None:
    src.mkdir(parents=True, exist_ok=True)
    (src / "go.mod").write_text(
        "module ppojob.local/cluster-tools\n\ngo 1.26\n\nrequire (\n"
        f"\thelm.sh/helm/v3 {pins['HELM_VERSION']}\n\tsigs.k8s.io/kwok {pins['KWOK_VERSION']}\n)\n"
    )
    imports = "".join(f'\t_ "{b.package}"\n' for b in BINARIES if b.module == "tools")
    (src / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{imports})\n")


def write_node_module(pins: Pins, src: Path) -> None:
    src.mkdir(parents=True, exist_ok=True)
    (src / "go.mod").write_text(
        "module ppojob.local/cluster-node\n\ngo 1.26\n\nrequire (\n"
        f"\tgithub.com/coredns/coredns {pins['COREDNS_VERSION']}\n"
        f"\tsigs.k8s.io/cri-tools {pins['CRI_TOOLS_VERSION']}\n)\n"
    )
    (src / "tools.go").write_text('//go:build tools\n\npackage tools\n\nimport _ "sigs.k8s.io/cri-tools/cmd/crictl"\n')
    (src / "cmd" / "coredns").mkdir(parents=True, exist_ok=True)
    (src / "cmd" / "coredns" / "main.go").write_text(COREDNS_MAIN)


def ldflags(binary: Binary, pins: Pins, src: Path) -> str:
    flags = ["-s", "-w"]
    if binary.stamp == "kube":
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            flags += [
                f"-X {pkg}.gitVersion={pins.kubernetes}",
                f"-X {pkg}.gitMajor=1",
                f"-X {pkg}.gitMinor={pins.kube_minor}",
                f"-X {pkg}.gitTreeState=clean",
            ]
    elif binary.stamp == "helm":
        client_go = _go_output(["list", "-m", "-f", "{{.Version}}", "k8s.io/client-go"], src).strip()
        minor = client_go.lstrip("v").split(".")[1]
        flags += [
            f"-X helm.sh/helm/v3/internal/version.version={pins['HELM_VERSION']}",
            "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
        ]
        for pkg in ("helm.sh/helm/v3/pkg/lint/rules", "helm.sh/helm/v3/pkg/chartutil"):
            flags += [f"-X {pkg}.k8sVersionMajor=1", f"-X {pkg}.k8sVersionMinor={minor}"]
    elif binary.stamp == "kwok":
        flags.append(f"-X sigs.k8s.io/kwok/pkg/consts.Version={pins['KWOK_VERSION'].lstrip('v')}")
    return " ".join(flags)


def manifest_path(pins: Pins) -> Path:
    return build_dir(pins) / "build.json"


def cached(pins: Pins) -> dict | None:
    """The build record if every binary for these pins is present, else None."""
    path = manifest_path(pins)
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    bin_dir = build_dir(pins) / "bin"
    if record.get("key") != pins.key() or any(not (bin_dir / b.name).is_file() for b in BINARIES):
        return None
    return record


def build(pins: Pins | None = None, force: bool = False, out=sys.stdout) -> dict:
    """Build every binary that is missing (or all with force). Returns the build record."""
    pins = pins or load_pins()
    if shutil.which("go") is None:
        raise BuildError("`go` is not on PATH: the local cluster is built with the machine's Go toolchain")
    root = build_dir(pins)
    record = None if force else cached(pins)
    if record is not None:
        print(f"local cluster binaries for pins {pins.key()} are cached in {root / 'bin'}", file=out)
        return record
    bin_dir, log = root / "bin", root / "build.log"
    bin_dir.mkdir(parents=True, exist_ok=True)
    print(f"building the local cluster into {root} (log: {log})", file=out, flush=True)
    started = time.monotonic()
    timings: dict[str, float] = {}
    srcs = {name: root / "src" / name for name in ("k8s", "tools", "node")}
    for name, writer in (("k8s", write_k8s_module), ("tools", write_tools_module), ("node", write_node_module)):
        t = time.monotonic()
        writer(pins, srcs[name])
        _run(["go", "mod", "tidy"], srcs[name], log)
        timings[f"modules:{name}"] = round(time.monotonic() - t, 1)
        print(f"  {'go mod tidy (' + name + ')':28s} {timings[f'modules:{name}']:7.1f}s", file=out, flush=True)
    for binary in BINARIES:
        target = bin_dir / binary.name
        if target.is_file() and not force:
            print(f"  {binary.name:28s} present", file=out, flush=True)
            continue
        t = time.monotonic()
        src = srcs[binary.module]
        tmp = bin_dir / f".{binary.name}.tmp"
        _run(
            [
                "go",
                "build",
                "-trimpath",
                "-ldflags",
                ldflags(binary, pins, src),
                "-o",
                str(tmp),
                binary.package,
            ],
            src,
            log,
        )
        tmp.replace(target)
        timings[binary.name] = round(time.monotonic() - t, 1)
        print(f"  {binary.name:28s} {timings[binary.name]:7.1f}s", file=out, flush=True)
    total = round(time.monotonic() - started, 1)
    print(f"  {'total':28s} {total:7.1f}s", file=out, flush=True)
    module_dirs = {
        m: _go_output(["list", "-m", "-f", "{{.Dir}}", m], srcs[src]).strip()
        for m, src in ((KUBERAY_MODULE, "k8s"), (SCHEDULER_PLUGINS_MODULE, "k8s"), (KWOK_MODULE, "tools"))
    }
    record = {
        "key": pins.key(),
        "pins": pins.values,
        "timings_s": timings,
        "total_s": total,
        "module_dirs": module_dirs,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    manifest_path(pins).write_text(json.dumps(record, indent=2) + "\n")
    return record


def module_dir(pins: Pins, module: str) -> Path:
    """Directory of a module in the Go module cache, recorded by the build (e.g. for CRD files)."""
    record = cached(pins)
    if record is None:
        raise BuildError("the local cluster is not built for these pins; run `python -m local_cluster build`")
    path = Path(record.get("module_dirs", {}).get(module, ""))
    if not path.is_dir():
        raise BuildError(
            f"module {module} is not in the Go module cache ({path}); run `python -m local_cluster build --force`"
        )
    return path


def apart_dir(name: str, version: str, recipe: str) -> Path:
    """<cache>/cluster/<name>-<key>/ for a component built apart, keyed by its own pin and recipe only."""
    key = hashlib.sha256(f"{version}\nrecipe={recipe}".encode()).hexdigest()[:12]
    return cache_root() / "cluster" / f"{name}-{key}"


def build_apart(name: str, *, module: str, version: str, package: str, root: Path, ldflags: str = "-s -w",
                force: bool = False, out=None) -> dict:
    """One binary built in a wrapper module and a cache directory of its own (`root`), for a component
    whose requirements the shared modules cannot take, keyed by its own pin so that changing it
    rebuilds neither the cluster nor makes a running one unattachable. Returns its record
    (`root/build.json`: timings, the module's directory); at once when `root/bin/name` is there."""
    record_file, target = root / "build.json", root / "bin" / name
    if not force and record_file.is_file() and target.is_file():
        if out is not None:
            print(f"{name} {version} is cached in {target}", file=out, flush=True)
        return json.loads(record_file.read_text())
    src, log = root / "src", root / "build.log"
    src.mkdir(parents=True, exist_ok=True)
    target.parent.mkdir(exist_ok=True)
    if out is not None:
        print(f"building {name} {version} into {root} (log: {log})", file=out, flush=True)
    started = time.monotonic()
    (src / "go.mod").write_text(f"module ppojob.local/cluster-{name}\n\ngo 1.26\n\nrequire {module} {version}\n")
    (src / "tools.go").write_text(f'//go:build tools\n\npackage tools\n\nimport _ "{package}"\n')
    _run(["go", "mod", "tidy"], src, log)
    tidy_s = round(time.monotonic() - started, 1)
    tmp = target.parent / f".{name}.tmp"
    _run(["go", "build", "-trimpath", "-ldflags", ldflags, "-o", str(tmp), package], src, log)
    tmp.replace(target)
    total = round(time.monotonic() - started, 1)
    record = {
        "version": version,
        "timings_s": {"go mod tidy": tidy_s, name: round(total - tidy_s, 1)},
        "total_s": total,
        "module_dir": _go_output(["list", "-m", "-f", "{{.Dir}}", module], src).strip(),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    if out is not None:
        print(f"  {'go mod tidy (' + name + ')':28s} {tidy_s:7.1f}s\n  {name:28s} {total - tidy_s:7.1f}s",
              file=out, flush=True)
    return record
