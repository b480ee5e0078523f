"""The host packages the testbed needs: found, installed (as root on Debian/Ubuntu), or named in one line."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ._util import TestbedError, log, sh

# tool the testbed runs -> Debian/Ubuntu package providing it
TOOLS = {
    "debootstrap": "debootstrap",
    "/usr/sbin/sshd": "openssh-server",
    "ssh-keygen": "openssh-client",
    "apt-ftparchive": "apt-utils",
    "gpg": "gnupg",
    "git": "git",
    "dpkg-deb": "dpkg",
    "chroot": "coreutils",
}
# and for booted testbeds (`up --booted`): the upstream registry stand-in and its throwaway CA (upstream.py)
BOOTED_TOOLS = {
    "/usr/bin/docker-registry": "docker-registry",
    "openssl": "openssl",
}
# services a package starts on install that the testbed runs itself, with its own config
DISTRO_SERVICES = {"docker-registry": "docker-registry.service"}


def missing(tools: dict[str, str] = TOOLS) -> list[str]:
    """Packages (in `tools` order, no repeats) whose tool is not on this machine."""
    return list(dict.fromkeys(pkg for tool, pkg in tools.items() if not shutil.which(tool)))


def _os_release() -> dict[str, str]:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {k: v.strip().strip('"') for k, v in pairs}


def debian_like() -> bool:
    rel = _os_release()
    ids = {rel.get("ID", ""), *rel.get("ID_LIKE", "").split()}
    return bool(ids & {"debian", "ubuntu"}) and shutil.which("apt-get") is not None


def ensure(booted: bool = False) -> None:
    """Install the missing host packages (as root on Debian/Ubuntu, saying so); else raise with one line saying
    what to install. Also refuses a non-root user, who cannot run the testbed. `booted`: BOOTED_TOOLS too."""
    tools = {**TOOLS, **(BOOTED_TOOLS if booted else {})}
    pkgs = missing(tools)
    root = os.geteuid() == 0
    if pkgs and not debian_like():
        rel = _os_release().get("PRETTY_NAME", "this system")
        names = ", ".join(f"{tool.rsplit('/', 1)[-1]} ({pkg})" for tool, pkg in tools.items() if pkg in pkgs)
        raise TestbedError(
            f"{rel} is not Debian/Ubuntu: install these with its package manager, then run again as root: {names}"
        )
    if not root:
        need = f"apt-get install {' '.join(pkgs)}, then " if pkgs else ""
        raise TestbedError(f"the testbed needs root (chroot, sshd per rig, useradd): as root, {need}run it again")
    if not pkgs:
        return
    log(f"installing the testbed's host packages: apt-get install {' '.join(pkgs)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    sh(["apt-get", "update", "-qq"], capture=True, env=env)
    sh(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *pkgs], capture=True, env=env)
    still = missing(tools)
    if still:
        raise TestbedError(f"apt-get install did not provide: {' '.join(still)}")
    log(f"installed {' '.join(pkgs)}")
    for pkg in pkgs:  # e.g. Debian's docker-registry starts its own registry on :5000 where systemd runs
        if pkg in DISTRO_SERVICES and shutil.which("systemctl"):
            unit = DISTRO_SERVICES[pkg]
            if sh(["systemctl", "disable", "--now", unit], check=False, capture=True).returncode == 0:
                log(f"{unit} disabled: the testbed runs {pkg} itself, with its own config")
