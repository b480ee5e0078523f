"""Local signed apt repositories that publish the vendors' real package names, holding the simulated drivers.

Signed with one throwaway gpg key (InRelease clearsigned + detached Release.gpg), the armored public key served
beside each repository under the vendor's file name:

    <root>/cuda-debian/   flat, NVIDIA's Debian naming: nvidia-driver-pinning-<branch>, nvidia-open /
                          cuda-drivers -> nvidia-driver-cuda + nvidia-kernel-open-dkms / nvidia-kernel-dkms
                          key: cuda-debian/8793F200.pub (the name of NVIDIA's debian13 key)
    <root>/cuda-ubuntu/   flat, NVIDIA's Ubuntu naming: nvidia-driver-pinning-<branch>, 580:
                          nvidia-driver-580-open -> nvidia-dkms-580-open (...), 590: nvidia-open -> nvidia-dkms-open
    <root>/libnvidia-container/   nvidia-container-toolkit + -base, libnvidia-container-tools, libnvidia-container1,
                          each at 1.19.0-1 and 1.19.1-1 (without the lock's pin apt would take 1.19.1-1)
    <root>/docker/        Docker's layout (dists/trixie/stable): docker-ce, docker-ce-cli, containerd.io,
                          docker-buildx-plugin, docker-compose-plugin; key: docker/gpg. Each is Debian's own
                          package (docker.io, docker-cli, containerd + runc, docker-buildx, docker-compose, from
                          the rootfs tarball's apt cache) repackaged under Docker's name, version and relations
                          (docker/docker-ce-packaging deb/common/control, docker/containerd-packaging
                          debian/control): a Docker that runs, installed the way Docker's instructions install it

Every driver branch exists in two versions (580 and 590), so installing the pinning package first is what
keeps a rig on its branch, as on NVIDIA's repositories. The package owning the kernel module (nvidia-kernel-
open-dkms, nvidia-dkms-580-open, ...) simulates a freshly loaded module; the package shipping nvidia-smi gets
the simulated GPUs: the stub drivers behave the same under either naming.
Built once per testbed dir; the cache key is the hash of the stub sources and this file.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from ._util import ensure_safe_dir, hash_tree, log, sh
from .rootfs import _recipe_key as rootfs_key
from .rootfs import tarball_path

STUBS = Path(__file__).parent / "stubs"
DRIVER_VERSION = "580.159.04"
DRIVER_DEB_VERSION = f"{DRIVER_VERSION}-1"
NEXT_DRIVER_VERSION = "590.48.01"  # a later branch in the same repository: the pinning package must hold it off
TOOLKIT_VERSION = "1.19.0"  # the lock's toolkit pin
TOOLKIT_DEB_VERSION = f"{TOOLKIT_VERSION}-1"
NEXT_TOOLKIT_VERSION = "1.19.1"  # newer in the same repository (it broke cuInit upstream): only the pin holds it off
DRIVER_REPO, DRIVER_KEY = "cuda-debian", "cuda-debian/8793F200.pub"
UBUNTU_DRIVER_REPO, UBUNTU_DRIVER_KEY = "cuda-ubuntu", "cuda-ubuntu/3bf863cc.pub"
TOOLKIT_REPO, TOOLKIT_KEY = "libnvidia-container", "libnvidia-container/gpgkey"
DOCKER_REPO, DOCKER_KEY, DOCKER_SUITE = "docker", "docker/gpg", "trixie"
FINGERPRINT_FILE = "fingerprint"  # the signing key's fingerprint, for host data
TOOLKIT_PACKAGES = ["nvidia-container-toolkit-base", "libnvidia-container-tools", "libnvidia-container1"]
DOCKER_PACKAGES = ["docker-ce", "docker-ce-cli", "containerd.io", "docker-buildx-plugin", "docker-compose-plugin"]
DOCKER_CE_VERSION = "5:28.5.1-1~debian.13~trixie"
# Docker's name: (Debian's packages whose files and maintainer scripts it carries, its version, its relations as in
# Docker's control files; Depends adds what Debian's build needs beside its libraries: adduser, tini as docker-init)
DOCKER_REPACKAGES = {
    "docker-ce": (
        ["docker.io"],
        DOCKER_CE_VERSION,
        {
            "Depends": "containerd.io (>= 1.7.27), docker-ce-cli, iptables, nftables, libc6 (>= 2.34), libsystemd0, "
            "adduser, sysvinit-utils (>= 3.05-4~), tini",
            "Recommends": "apparmor, ca-certificates, docker-ce-rootless-extras, git, pigz, procps, xz-utils",
            "Conflicts": "docker (<< 1.5~), docker-engine, docker.io",
            "Replaces": "docker-engine, docker-ce-cli (<< 5:28.0.0)",
        },
    ),
    "docker-ce-cli": (
        ["docker-cli"],
        DOCKER_CE_VERSION,
        {
            "Depends": "libc6 (>= 2.34)",
            "Recommends": "docker-buildx-plugin, docker-compose-plugin",
            "Conflicts": "docker (<< 1.5~), docker-engine, docker.io",
            "Replaces": "docker-ce (<< 5:0)",
            "Breaks": "docker-ce (<< 5:0)",
        },
    ),
    "containerd.io": (
        ["containerd", "runc"],
        "1.7.28-1~debian.13~trixie",
        {
            "Depends": "libc6 (>= 2.38), libseccomp2 (>= 2.5.0)",
            "Provides": "containerd, runc",
            "Conflicts": "containerd, runc",
            "Replaces": "containerd, runc",
        },
    ),
    "docker-buildx-plugin": (
        ["docker-buildx"],
        "0.29.1-1~debian.13~trixie",
        {
            "Depends": "libc6 (>= 2.34)",
            "Replaces": "docker-ce-cli",
            "Enhances": "docker-ce-cli",
        },
    ),
    "docker-compose-plugin": (
        ["docker-compose"],
        "2.40.3-1~debian.13~trixie",
        {
            "Depends": "libc6 (>= 2.34)",
            "Recommends": "docker-buildx-plugin (>= 0.17.0)",
            "Enhances": "docker-ce-cli",
            "Conflicts": "docker-compose",
            "Replaces": "docker-compose",
            "Breaks": "docker-compose",
        },
    ),
}
# Debian's fields a repackage drops: the relations are Docker's, the source is not Debian's
DEBIAN_ONLY_FIELDS = {
    "Source",
    "Built-Using",
    "Depends",
    "Pre-Depends",
    "Recommends",
    "Suggests",
    "Conflicts",
    "Replaces",
    "Breaks",
    "Provides",
    "Enhances",
    "Static-Built-Using",
}

DRIVER_POSTINST = """#!/bin/sh
# rigforge testbed: simulate the freshly loaded kernel module (in a chroot /sys and /proc are plain dirs; a
# booted rig has a writable /sys/module and a real procfs, where /proc/driver cannot be made)
set -e
if [ "$1" = configure ]; then
    mkdir -p /sys/module/nvidia
    echo "{version}" > /sys/module/nvidia/version
    mkdir -p /proc/driver/nvidia 2>/dev/null || exit 0
    printf 'NVRM version: NVIDIA UNIX {kind} Kernel Module for x86_64  %s  Release Build  (rigforge@testbed)\\n' \\
        "{version}" > /proc/driver/nvidia/version
fi
exit 0
"""


def repo_key() -> str:
    return hash_tree(STUBS, Path(__file__)) + "-" + rootfs_key()


def _control(name: str, version: str, description: str, **extra: str) -> str:
    fields = {
        "Package": name,
        "Version": version,
        "Architecture": "all",
        "Maintainer": "rigforge testbed <testbed@rigforge.invalid>",
        "Depends": "python3",
        **extra,
        "Description": f"{description}\n rigforge testbed stub: simulated hardware, no GPU behind it.",
    }
    return "".join(f"{k}: {v}\n" for k, v in fields.items())


def stub_script(name: str, **subst: str) -> str:
    text = (STUBS / name).read_text()
    for key, value in subst.items():
        text = text.replace(f"@{key}@", value)
    return text


def _build_deb(work: Path, out_dir: Path, control: str, files: dict[str, str], postinst: str | None = None) -> None:
    """A .deb in `out_dir` from `control`, `files` ({path: text}, 0644 under /etc/, else 0755) and `postinst`."""
    name = control.split("\n", 1)[0].split(": ", 1)[1]
    version = control.split("\nVersion: ", 1)[1].split("\n", 1)[0]
    pkg = work / f"{name}_{version}"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN/control").write_text(control)
    if postinst:
        (pkg / "DEBIAN/postinst").write_text(postinst)
        (pkg / "DEBIAN/postinst").chmod(0o755)
    for path, text in files.items():
        target = pkg / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        target.chmod(0o644 if path.startswith("/etc/") else 0o755)
    sh(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(pkg), str(out_dir)], capture=True)


def _docker_repackages(work: Path, pool: Path, tarball: Path) -> None:
    """Docker's five packages, each made of Debian's own from the rootfs tarball's apt cache (DOCKER_REPACKAGES)."""
    archives = work / "var/cache/apt/archives"
    work.mkdir(parents=True)
    wanted = sorted(
        {f"./var/cache/apt/archives/{deb}_*.deb" for debs, _, _ in DOCKER_REPACKAGES.values() for deb in debs}
    )
    sh(["tar", "-C", str(work), "-xf", str(tarball), "--wildcards", *wanted])
    for name, (debs, version, relations) in DOCKER_REPACKAGES.items():
        pkg = work / name
        md5sums = []
        for deb in debs:
            (found,) = archives.glob(f"{deb}_*.deb")
            part = work / f"part-{deb}"
            sh(["dpkg-deb", "--raw-extract", str(found), str(part)])
            md5sums.append((part / "DEBIAN/md5sums").read_text() if (part / "DEBIAN/md5sums").exists() else "")
            if not pkg.exists():
                part.rename(pkg)  # the first carries the control and maintainer scripts
            else:
                sh(["cp", "-a", "--no-clobber", f"{part}/.", str(pkg)])
        fields, key = {}, ""
        for line in (pkg / "DEBIAN/control").read_text().splitlines():
            if line[:1] in (" ", "\t"):  # a continuation line (Description's body)
                fields[key] += "\n" + line
            else:
                key, value = line.split(":", 1)
                fields[key] = value.strip()
        fields = {k: v for k, v in fields.items() if k not in DEBIAN_ONLY_FIELDS}
        fields.update(
            Package=name, Version=version, Maintainer="Docker <support@docker.com> (rigforge testbed repackage)"
        )
        fields.update(relations)
        (pkg / "DEBIAN/control").write_text("".join(f"{k}: {v}\n" for k, v in fields.items()))
        (pkg / "DEBIAN/md5sums").write_text("".join(md5sums))
        sh(["dpkg-deb", "-Zgzip", "-z1", "--build", str(pkg), str(pool)], capture=True)


def _index_and_sign(repo: Path, gnupghome: Path, suite: str | None = None) -> None:
    """Index and sign a flat repository (`Suites: /`), or with `suite` a dists/<suite>/stable one (Docker's)."""
    dist = repo / "dists" / suite if suite else repo
    index = dist / "stable/binary-amd64" if suite else repo
    index.mkdir(parents=True, exist_ok=True)
    pool = "pool" if suite else "."
    packages = sh(["apt-ftparchive", "packages", pool], cwd=repo, capture=True).stdout
    (index / "Packages").write_text(packages)
    sh(["gzip", "-9kf", "Packages"], cwd=index)
    options = ["-o", "APT::FTPArchive::Release::Origin=rigforge-testbed"]
    if suite:
        for key, value in (("Suite", suite), ("Codename", suite), ("Components", "stable"), ("Architectures", "amd64")):
            options += ["-o", f"APT::FTPArchive::Release::{key}={value}"]
    release = sh(["apt-ftparchive", *options, "release", "."], cwd=dist, capture=True).stdout
    (dist / "Release").write_text(release)
    gpg = ["gpg", "--homedir", str(gnupghome), "--batch", "--yes", "--digest-algo", "SHA512"]
    sh([*gpg, "--clearsign", "-o", str(dist / "InRelease"), str(dist / "Release")], capture=True)
    sh([*gpg, "--armor", "--detach-sign", "-o", str(dist / "Release.gpg"), str(dist / "Release")], capture=True)


def _pinning(branch: str) -> tuple[str, dict[str, str]]:
    """nvidia-driver-pinning-<branch>: an apt preferences file keeping NVIDIA's driver packages on the branch."""
    text = (
        f"# rigforge testbed stand-in for NVIDIA's nvidia-driver-pinning-{branch}\n"
        "Package: nvidia-* libnvidia-* cuda-drivers\n"
        f"Pin: version {branch}.*\nPin-Priority: 1000\n"
    )
    return f"nvidia-driver-pinning-{branch}", {f"/etc/apt/preferences.d/nvidia-driver-pinning-{branch}": text}


def _driver_scheme(tmp: Path, repo: Path, scheme: str, version: str) -> None:
    """One branch of the driver packages under `scheme` ("debian" or "ubuntu") naming, in `repo`."""
    branch = version.split(".")[0]
    deb = f"{version}-1"
    smi_files = {
        flavor: {
            "/usr/bin/nvidia-smi": stub_script("nvidia-smi", DRIVER_VERSION=version, FLAVOR=flavor),
            "/usr/bin/nvidia-persistenced": stub_script("nvidia-persistenced", DRIVER_VERSION=version, FLAVOR=flavor),
        }
        for flavor in ("open", "proprietary")
    }
    name, files = _pinning(branch)
    _build_deb(tmp, repo, _control(name, "1.0-1", f"Lock NVIDIA driver packages to branch {branch}"), files)
    if scheme == "debian" or branch != "580":  # unversioned names (Debian always, Ubuntu from 590 on)
        kmod = {"open": "nvidia-kernel-open-dkms", "proprietary": "nvidia-kernel-dkms"}
        if scheme == "ubuntu":
            kmod = {"open": "nvidia-dkms-open", "proprietary": "nvidia-dkms"}
        user = {"open": "nvidia-open", "proprietary": "cuda-drivers"}
        smi = {"debian": "nvidia-driver-cuda", "ubuntu": "nvidia-utils"}[scheme]
        older = {"Conflicts": "nvidia-driver-580-open, nvidia-driver-580"} if scheme == "ubuntu" else {}
        control = _control(smi, deb, "NVIDIA driver CUDA components (nvidia-smi)", **older)
        _build_deb(tmp, repo, control, smi_files["open"])  # Ubuntu: switching from 580 replaces its nvidia-smi
        for flavor in ("open", "proprietary"):
            other = kmod["proprietary" if flavor == "open" else "open"]
            _build_deb(
                tmp,
                repo,
                _control(kmod[flavor], deb, f"NVIDIA kernel module ({flavor})", Conflicts=other, Replaces=other),
                {},
                DRIVER_POSTINST.format(version=version, kind="Open" if flavor == "open" else "Proprietary"),
            )
            depends = f"python3, {smi} (= {deb}), {kmod[flavor]} (= {deb})"
            _build_deb(tmp, repo, _control(user[flavor], deb, f"NVIDIA driver ({flavor})", Depends=depends), {})
        return
    for flavor, suffix in (("open", "-open"), ("proprietary", "")):  # Ubuntu 580: the branch in every name
        other = "" if suffix else "-open"
        dkms, driver = f"nvidia-dkms-{branch}{suffix}", f"nvidia-driver-{branch}{suffix}"
        conflicts = {"Conflicts": f"nvidia-dkms-{branch}{other}", "Replaces": f"nvidia-dkms-{branch}{other}"}
        _build_deb(
            tmp,
            repo,
            _control(dkms, deb, f"NVIDIA DKMS package ({flavor})", **conflicts),
            {},
            DRIVER_POSTINST.format(version=version, kind="Open" if flavor == "open" else "Proprietary"),
        )
        conflicts = {"Conflicts": f"nvidia-driver-{branch}{other}", "Replaces": f"nvidia-driver-{branch}{other}"}
        control = _control(driver, deb, f"NVIDIA driver metapackage ({flavor})", Depends=f"python3, {dkms} (= {deb})")
        _build_deb(
            tmp, repo, control.replace("Depends:", f"Conflicts: {conflicts['Conflicts']}\nDepends:"), smi_files[flavor]
        )


def _toolkit(tmp: Path, repo: Path, version: str) -> None:
    """The four toolkit packages at `version` (the toolkit depends on the other three at the same version)."""
    deb = f"{version}-1"
    for name in TOOLKIT_PACKAGES:
        _build_deb(tmp, repo, _control(name, deb, f"{name} (stand-in)"), {})
    subst = {"TOOLKIT_VERSION": version}
    depends = ", ".join(["python3", *(f"{name} (= {deb})" for name in TOOLKIT_PACKAGES)])
    _build_deb(
        tmp,
        repo,
        _control("nvidia-container-toolkit", deb, "NVIDIA Container Toolkit", Depends=depends),
        {
            "/usr/bin/nvidia-ctk": stub_script("nvidia-ctk", **subst),
            "/usr/bin/nvidia-container-runtime": stub_script("nvidia-container-runtime", **subst),
            "/usr/bin/nvidia-container-runtime-hook": stub_script("nvidia-container-runtime-hook"),
        },
    )


def build(testbed_dir: Path) -> Path:
    """Return the root directory of the signed repositories, building it if the stubs changed."""
    cache = ensure_safe_dir(Path(testbed_dir) / "cache")
    root = cache / f"apt-{repo_key()}"
    if (root / ".ready").exists():
        return root
    t0 = time.monotonic()
    for old in cache.glob("apt-*"):  # earlier stub versions
        shutil.rmtree(old)
    repos = {name: root / name for name in (DRIVER_REPO, UBUNTU_DRIVER_REPO, TOOLKIT_REPO, DOCKER_REPO)}
    for repo in repos.values():
        repo.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="rigforge-apt-") as tmp:
        tmp = Path(tmp)
        for scheme, repo in (("debian", repos[DRIVER_REPO]), ("ubuntu", repos[UBUNTU_DRIVER_REPO])):
            for version in (DRIVER_VERSION, NEXT_DRIVER_VERSION):
                _driver_scheme(tmp / scheme, repo, scheme, version)
        for version in (TOOLKIT_VERSION, NEXT_TOOLKIT_VERSION):
            _toolkit(tmp / "build", repos[TOOLKIT_REPO], version)
        pool = repos[DOCKER_REPO] / "pool"
        pool.mkdir()
        _docker_repackages(tmp / "docker", pool, tarball_path(testbed_dir))
        gnupghome = tmp / "gnupg"
        gnupghome.mkdir(mode=0o700)
        gpg = ["gpg", "--homedir", str(gnupghome), "--batch", "--yes"]
        sh(
            [
                *gpg,
                "--passphrase",
                "",
                "--quick-gen-key",
                "rigforge testbed <testbed@rigforge.invalid>",
                "rsa3072",
                "sign",
                "never",
            ],
            capture=True,
        )
        armored = sh([*gpg, "--armor", "--export"], capture=True).stdout
        colons = sh([*gpg, "--with-colons", "--fingerprint"], capture=True).stdout
        fingerprint = next(line.split(":")[9] for line in colons.splitlines() if line.startswith("fpr:"))
        (root / FINGERPRINT_FILE).write_text(fingerprint + "\n")
        for key in (DRIVER_KEY, UBUNTU_DRIVER_KEY, TOOLKIT_KEY, DOCKER_KEY):
            (root / key).write_text(armored)
        for name in (DRIVER_REPO, UBUNTU_DRIVER_REPO, TOOLKIT_REPO):
            _index_and_sign(repos[name], gnupghome)
        _index_and_sign(repos[DOCKER_REPO], gnupghome, suite=DOCKER_SUITE)
        sh(["gpgconf", "--homedir", str(gnupghome), "--kill", "gpg-agent"], check=False)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    (root / ".ready").write_text("ok\n")
    log(f"signed apt repos built in {root} in {time.monotonic() - t0:.1f}s")
    return root


def fingerprint(root: Path) -> str:
    """Fingerprint of the key signing every repository under `root`."""
    return (Path(root) / FINGERPRINT_FILE).read_text().strip()
