"""Debian 13 (trixie) root file systems for testbed rigs: built once with debootstrap, cached as a tarball.

The tarball also holds the .debs the roles will install (docker.io, docker-compose, containerd, runc) in
/var/cache/apt/archives, so a converge does not download them again, and a policy-rc.d that keeps package
postinsts from starting services (there is no init in a chroot).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TextIO

from ._util import TestbedError, ensure_safe_dir, in_chroot, log, sh

MIRROR = "http://deb.debian.org/debian"
SUITE = "trixie"
BASE_PACKAGES = ["sudo", "python3", "python3-venv", "ca-certificates", "curl", "gnupg", "systemd", "git"]
PREFETCH_PACKAGES = ["docker.io", "docker-cli", "docker-compose", "containerd", "runc"]  # trixie: CLI is docker-cli
# what every rig's metrics role installs (roles/monitor.py, without recommends): fetched once here, not per converge
PREFETCH_NO_RECOMMENDS = ["prometheus-node-exporter", "dbus"]
TOOLS_PACKAGES = ["docker.io", "docker-cli", "docker-compose", "systemd"]
RECIPE_VERSION = "2"

POLICY_RC_D = (
    "#!/bin/sh\n# rigforge testbed: no init in a chroot, never start services from maintainer scripts\nexit 101\n"
)
SOURCES = f"""Types: deb
URIs: {MIRROR}
Suites: {SUITE} {SUITE}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: {SUITE}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def _recipe_key() -> str:
    recipe = ",".join([RECIPE_VERSION, SUITE, MIRROR, *BASE_PACKAGES, *PREFETCH_PACKAGES, "-", *PREFETCH_NO_RECOMMENDS])
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def tarball_path(testbed_dir: Path) -> Path:
    return Path(testbed_dir) / "cache" / f"rootfs-{SUITE}-{_recipe_key()}.tar"


HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def copy_host_network_config(root: Path) -> None:
    """The rig shares the controller's network: same resolver, and pip trusts the same CAs (a registry
    proxy on this network may present its own CA, which the controller host already trusts)."""
    resolv = root / "etc/resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    resolv.write_text(Path("/etc/resolv.conf").read_text())
    if HOST_CA_BUNDLE.exists():
        (root / "etc/ssl").mkdir(parents=True, exist_ok=True)
        (root / "etc/ssl/rigforge-host-ca.crt").write_bytes(HOST_CA_BUNDLE.read_bytes())
        (root / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/rigforge-host-ca.crt\n")


def locked(cache: Path, name: str) -> TextIO:
    """An exclusive lock on a build step of this cache (several processes may start a testbed at once)."""
    lock_f = open(cache / f".{name}.lock", "w")  # noqa: SIM115 - released by closing
    fcntl.flock(lock_f, fcntl.LOCK_EX)
    return lock_f


def build_tarball(testbed_dir: Path) -> Path:
    """Return the cached rootfs tarball, building it with debootstrap if missing."""
    tarball = tarball_path(testbed_dir)
    if tarball.exists():
        return tarball
    cache = ensure_safe_dir(Path(testbed_dir) / "cache")
    with locked(cache, "rootfs"):
        if not tarball.exists():
            _debootstrap(cache, tarball)
    return tarball


def _debootstrap(cache: Path, tarball: Path) -> None:
    if not shutil.which("debootstrap"):
        raise TestbedError("debootstrap is not installed on this machine: apt-get install debootstrap")
    build = cache / f"rootfs.build.{os.getpid()}"
    if build.exists():
        sh(["rm", "-rf", "--one-file-system", str(build)])
    t0 = time.monotonic()
    log(f"debootstrap {SUITE} (minbase) from {MIRROR} into {build} ...")
    sh(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            SUITE,
            str(build),
            MIRROR,
        ],
        capture=True,
    )
    prefetch = " ".join(PREFETCH_PACKAGES + PREFETCH_NO_RECOMMENDS)
    log(f"debootstrap done in {time.monotonic() - t0:.0f}s; pre-downloading {prefetch}")
    (build / "usr/sbin/policy-rc.d").write_text(POLICY_RC_D)
    (build / "usr/sbin/policy-rc.d").chmod(0o755)
    (build / "etc/apt/sources.list").unlink(missing_ok=True)
    (build / "etc/apt/sources.list.d/debian.sources").write_text(SOURCES)
    copy_host_network_config(build)
    in_chroot(
        build,
        "apt-get update -qq && apt-get install -y -qq --download-only "
        + " ".join(PREFETCH_PACKAGES)
        + " && apt-get install -y -qq --download-only --no-install-recommends "
        + " ".join(PREFETCH_NO_RECOMMENDS),
        capture=True,
    )
    (build / "etc/resolv.conf").write_text("")
    pack(build, tarball, replaces="rootfs-*.tar")
    log(f"rootfs tarball {tarball} ({tarball.stat().st_size >> 20} MiB) built in {time.monotonic() - t0:.0f}s")


def pack(build: Path, tarball: Path, replaces: str) -> None:
    """Tar the root file system `build` into `tarball` (a partial file renamed into place), remove `build`, and
    remove the other tarballs next to it matching the glob `replaces` (older builds)."""
    tmp = tarball.with_suffix(f".part.{os.getpid()}")
    sh(["tar", "-C", str(build), "--numeric-owner", "--xattrs", "-cf", str(tmp), "."])
    tmp.rename(tarball)
    sh(["rm", "-rf", "--one-file-system", str(build)])
    for old in tarball.parent.glob(replaces):
        if old != tarball:
            old.unlink()


def extract(tarball: Path, dest: Path) -> None:
    """Unpack the rootfs tarball into `dest` (removed first if present)."""
    if dest.exists():
        sh(["rm", "-rf", "--one-file-system", str(dest)])
    dest.mkdir(parents=True, mode=0o755)
    sh(["tar", "-C", str(dest), "--numeric-owner", "--xattrs", "-xf", str(tarball)])


def tools_rootfs(testbed_dir: Path = Path("/var/lib/rigforge-testbed")) -> Path:
    """A rootfs with docker.io, docker-compose and systemd installed, for `chroot ROOT docker compose config`
    and `chroot ROOT systemd-analyze verify` on rendered files. Built once per recipe, then cached."""
    testbed_dir = ensure_safe_dir(Path(testbed_dir))
    root = testbed_dir / "cache" / f"tools-{_recipe_key()}"
    if (root / ".rigforge-tools-ready").exists():
        return root
    tarball = build_tarball(testbed_dir)
    with locked(testbed_dir / "cache", "tools"):
        if (root / ".rigforge-tools-ready").exists():
            return root
        t0 = time.monotonic()
        extract(tarball, root)
        copy_host_network_config(root)
        in_chroot(root, "apt-get install -y -qq --no-install-recommends " + " ".join(TOOLS_PACKAGES), capture=True)
        (root / ".rigforge-tools-ready").write_text("ok\n")
        for old in (testbed_dir / "cache").glob("tools-*"):
            if old != root:
                sh(["rm", "-rf", "--one-file-system", str(old)])
        log(f"tools rootfs {root} ready in {time.monotonic() - t0:.0f}s")
    return root


def new_machine_id(root: Path) -> None:
    """A machine-id of its own for the root file system `root` (systemd's, and D-Bus's copy when it has one)."""
    (root / "etc/machine-id").write_text(f"{uuid.uuid4().hex}\n")
    dbus = root / "var/lib/dbus/machine-id"
    if dbus.is_file() and not dbus.is_symlink():
        dbus.write_text((root / "etc/machine-id").read_text())


def prepare_rig(root: Path, uid: int, user: str) -> None:
    """A rig's root file system made ready to boot as a rig: the host's network config and hostname, a machine-id
    of its own (the cached root file system's is every rig's otherwise), and the SSH user `user` (with `uid`,
    passwordless sudo)."""
    copy_host_network_config(root)
    new_machine_id(root)
    hostname = os.uname().nodename
    (root / "etc/hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n::1\tlocalhost ip6-localhost\n")
    in_chroot(
        root,
        f"groupadd --gid {uid} {user} 2>/dev/null || true; "
        f"useradd --uid {uid} --gid {uid} --create-home --shell /bin/bash {user}; "
        f"echo '{user} ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/{user}; chmod 0440 /etc/sudoers.d/{user}",
        capture=True,
    )
