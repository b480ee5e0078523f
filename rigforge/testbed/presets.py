"""Rig presets: rigs set up the way people set them up by hand, before rigforge ever ran.

- `handmade`: Docker's and NVIDIA's published instructions followed by hand: Debian's docker.io installed, with
  Debian's compose v2 and buildx plugins (docker-compose, docker-buildx),
  Docker's one-line /etc/apt/sources.list.d/docker.list (signed-by /etc/apt/keyrings/docker.asc) and the
  toolkit's nvidia-container-toolkit.list (signed-by /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg),
  pointing at the testbed's stand-ins for those repositories.
- `unowned`: a running driver that no package owns (NVIDIA's .run installer): nvidia-smi in /usr/bin, the module
  version in /sys/module/nvidia/version and /proc/driver/nvidia/version, nothing in dpkg.
"""

from __future__ import annotations

from pathlib import Path

from ._util import in_chroot, sh
from .aptrepo import DOCKER_KEY, DOCKER_REPO, DOCKER_SUITE, DRIVER_VERSION, TOOLKIT_KEY, TOOLKIT_REPO, stub_script

PRESETS = ("", "handmade", "unowned")


def apply(preset: str, root: Path, apt_root: Path, apt_url: str) -> None:
    """Set up the rig's root file system `root` as `preset` describes (nothing for "")."""
    if preset == "handmade":
        in_chroot(
            root,
            "apt-get install -y -q --no-install-recommends docker.io docker-compose docker-buildx >/dev/null",
            capture=True,
        )
        key = (apt_root / DOCKER_KEY).read_text()
        (root / "etc/apt/keyrings").mkdir(parents=True, exist_ok=True)
        (root / "etc/apt/keyrings/docker.asc").write_text(key)
        (root / "etc/apt/sources.list.d/docker.list").write_text(
            f"deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.asc] {apt_url}/{DOCKER_REPO} {DOCKER_SUITE} stable\n"
        )
        keyring = root / "usr/share/keyrings/nvidia-container-toolkit-keyring.gpg"
        keyring.parent.mkdir(parents=True, exist_ok=True)
        sh(["gpg", "--batch", "--yes", "--dearmor", "-o", str(keyring), str(apt_root / TOOLKIT_KEY)])
        keyring.chmod(0o644)
        (root / "etc/apt/sources.list.d/nvidia-container-toolkit.list").write_text(
            f"deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] {apt_url}/{TOOLKIT_REPO}/ /\n"
        )
        in_chroot(root, "apt-get update -q >/dev/null", capture=True)
    elif preset == "unowned":
        version = DRIVER_VERSION
        for tool in ("nvidia-smi", "nvidia-persistenced"):
            path = root / "usr/bin" / tool
            path.write_text(stub_script(tool, DRIVER_VERSION=version, FLAVOR="open"))
            path.chmod(0o755)
        (root / "sys/module/nvidia").mkdir(parents=True, exist_ok=True)
        (root / "sys/module/nvidia/version").write_text(version + "\n")
        (root / "proc/driver/nvidia").mkdir(parents=True, exist_ok=True)
        (root / "proc/driver/nvidia/version").write_text(
            f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  (run installer)\n"
        )
