"""NVIDIA driver from NVIDIA's CUDA apt repository (deb822 source, Signed-By keyring, no apt-key).

Branch 580 with the open kernel modules by default (`nvidia-driver-580-open`; proprietary:
`nvidia-driver-580`). The driver packages are held and kept out of unattended upgrades, nouveau is
blacklisted, and the rig is rebooted only when the installed driver is not the one running (a fresh
install, or a "Driver/library version mismatch") and only if `nvidia_allow_reboot` is set; otherwise the
host stops with a message saying a reboot is needed. The controller itself (@local) is never rebooted.
"""

from __future__ import annotations

import re
from io import StringIO

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.deb import DebArch
from pyinfra.operations import files, server

from roles.facts.system import OsRelease
from roles.operations import apt_repo, nvidia

DEFAULTS = {
    "nvidia_driver_branch": 580,  # driver branch
    "nvidia_driver_flavor": "open",  # open (open kernel modules) or proprietary
    "nvidia_driver_packages": None,  # package list override; default nvidia-driver-<branch>[-open]
    "nvidia_driver_repo_url": None,  # flat apt repo (Suites: /); default NVIDIA's CUDA repo for the OS
    "nvidia_driver_repo_key_url": None,  # armored repo key; default <repo url>3bf863cc.pub
    "nvidia_driver_repo_key_sha256": None,  # pin the key file's sha256 (checked after download)
    "nvidia_allow_reboot": False,  # reboot the rig when the installed driver is not the running one
}

KEY_NAME = "rigforge-nvidia-cuda"
CUDA_REPOS = "https://developer.download.nvidia.com/compute/cuda/repos"
CUDA_ARCH = {"amd64": "x86_64", "arm64": "sbsa"}
NOUVEAU_CONF = "/etc/modprobe.d/rigforge-blacklist-nouveau.conf"
NOUVEAU_TEXT = """# managed by rigforge: the NVIDIA driver needs nouveau unloaded
blacklist nouveau
options nouveau modeset=0
"""
UNATTENDED_CONF = "/etc/apt/apt.conf.d/51rigforge-nvidia-unattended-upgrades"
UNATTENDED_TEXT = """// managed by rigforge: NVIDIA driver and CUDA packages change only through rigforge (held)
Unattended-Upgrade::Package-Blacklist {
    "^nvidia-";
    "^libnvidia-";
    "^cuda-";
    "^libcuda";
    "^xserver-xorg-video-nvidia";
};
"""


def cuda_repo_url(os_release: dict, deb_arch: str) -> str:
    """NVIDIA's CUDA repo for the OS, e.g. .../repos/ubuntu2404/x86_64/."""
    distro = f"{os_release.get('id', '')}{os_release.get('version_id', '').replace('.', '')}"
    return f"{CUDA_REPOS}/{distro}/{CUDA_ARCH.get(deb_arch, deb_arch)}/"


def driver_packages(branch, flavor: str, override: list | None = None) -> list[str]:
    """Driver packages: nvidia-driver-<branch>-open (open flavor) or nvidia-driver-<branch>."""
    if override:
        return list(override)
    return [f"nvidia-driver-{branch}-open" if flavor == "open" else f"nvidia-driver-{branch}"]


@deploy("NVIDIA driver", data_defaults=DEFAULTS)
def install():
    data = host.data
    repo_url = data.nvidia_driver_repo_url or cuda_repo_url(host.get_fact(OsRelease), host.get_fact(DebArch))
    packages = driver_packages(data.nvidia_driver_branch, data.nvidia_driver_flavor, data.nvidia_driver_packages)

    apt_repo.install_missing(name="Install apt repository prerequisites", packages=["ca-certificates", "curl"])
    apt_repo.add_repo(
        repo=KEY_NAME,
        uris=repo_url,
        suites="/",
        key_url=data.nvidia_driver_repo_key_url or f"{repo_url}3bf863cc.pub",
        key_sha256=data.nvidia_driver_repo_key_sha256,
    )
    files.put(
        name="Keep NVIDIA and CUDA packages out of unattended upgrades",
        src=StringIO(UNATTENDED_TEXT),
        dest=UNATTENDED_CONF,
        mode="644",
    )
    blacklist = files.put(
        name="Blacklist the nouveau driver", src=StringIO(NOUVEAU_TEXT), dest=NOUVEAU_CONF, mode="644"
    )
    server.shell(
        name="Rebuild the initramfs without nouveau",
        commands=["if command -v update-initramfs >/dev/null 2>&1; then update-initramfs -u; fi"],
        _if=blacklist.did_change,
    )
    apt_repo.install_missing(name=f"Install NVIDIA {data.nvidia_driver_branch} driver packages", packages=packages)
    apt_repo.hold(
        name="Hold the NVIDIA driver packages",
        packages=[spec.partition("=")[0] for spec in packages],
        installed_pattern=rf"^(lib)?nvidia-[a-z0-9-]*-{re.escape(str(data.nvidia_driver_branch))}(-open|-server|-server-open)?$",
    )
    nvidia.reboot_if_needed(
        name="Reboot if the installed driver is not the running one",
        package=packages[0].partition("=")[0],
        allow_reboot=data.nvidia_allow_reboot,
    )
