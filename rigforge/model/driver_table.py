"""Which NVIDIA driver packages a rig gets, by driver source (NVIDIA's CUDA repository or Ubuntu's archive), distro
family, branch scheme (580, or >=590) and flavour (open / proprietary kernel modules). Pure data; the install, the
hold, the unattended-upgrades rules, the reboot check and `rigforge verify` all take their names from here.

Where the names come from (vendor instructions):
- NVIDIA Driver Installation Guide, Debian / Ubuntu: pick the branch with `nvidia-driver-pinning-<branch>`
  first, then `nvidia-open` (open kernel modules) or `cuda-drivers` (proprietary).
  https://docs.nvidia.com/datacenter/tesla/driver-installation-guide/
- "Recent updates": Ubuntu packages drop the branch from their names from 590 on (`nvidia-dkms-580-open` ->
  `nvidia-dkms-open`, ...); Debian's were never branch-named (`nvidia-kernel-open-dkms`, `nvidia-kernel-dkms`).
- Ubuntu's archive: `nvidia-driver-<branch>-open` + prebuilt, signed `linux-modules-nvidia-<branch>-open-<flavour>`
  (https://ubuntu.com/server/docs/nvidia-drivers-installation).
"""

import re
from dataclasses import dataclass
from typing import Protocol

SOURCES = ("cuda", "ubuntu")
FLAVORS = ("open", "proprietary")
MIN_BRANCH = 580

# (source, family, scheme, flavour) -> (packages to install, package whose version is the driver's).
# scheme: "580" for branch 580, "590+" for later branches, "any" when the names do not depend on it.
# {branch} and {kernel} (the kernel flavour, e.g. generic) are filled in. A missing row = no such package.
TABLE: dict[tuple[str, str, str, str], tuple[tuple[str, ...], str]] = {
    ("cuda", "debian", "any", "open"): (("nvidia-open",), "nvidia-kernel-open-dkms"),
    ("cuda", "debian", "any", "proprietary"): (("cuda-drivers",), "nvidia-kernel-dkms"),
    ("cuda", "ubuntu", "580", "open"): (("nvidia-driver-580-open",), "nvidia-dkms-580-open"),
    ("cuda", "ubuntu", "580", "proprietary"): (("nvidia-driver-580",), "nvidia-dkms-580"),
    ("cuda", "ubuntu", "590+", "open"): (("nvidia-open",), "nvidia-dkms-open"),
    ("cuda", "ubuntu", "590+", "proprietary"): (("cuda-drivers",), "nvidia-dkms"),
    ("ubuntu", "ubuntu", "any", "open"): (
        ("nvidia-driver-{branch}-open", "linux-modules-nvidia-{branch}-open-{kernel}"),
        "nvidia-driver-{branch}-open",
    ),
    ("ubuntu", "ubuntu", "any", "proprietary"): (
        ("nvidia-driver-{branch}", "linux-modules-nvidia-{branch}-{kernel}"),
        "nvidia-driver-{branch}",
    ),
}
PINNING = {"cuda": "nvidia-driver-pinning-{branch}", "ubuntu": None}  # the CUDA repo's branch lock
# Package-name prefixes kept out of unattended upgrades, per source (besides every package in the hold).
UNATTENDED_PREFIXES = {
    "cuda": ("nvidia-", "libnvidia-", "cuda-", "libcuda", "xserver-xorg-video-nvidia"),
    "ubuntu": ("nvidia-", "libnvidia-"),
}
# Ubuntu's prebuilt modules follow the kernel: linux-modules-nvidia-<branch>-open-<flavour> must upgrade with
# linux-image-<flavour>, or the next kernel boots without an NVIDIA module. Never held, never blacklisted.
FOLLOWS_KERNEL = "linux-modules-nvidia-"


@dataclass(frozen=True)
class DriverPackages:
    pinning: str | None  # installed before the driver: locks the branch (CUDA repo)
    install: tuple[str, ...]  # what apt installs (after the pinning package)
    version_package: str  # its version is the installed driver version (reboot check, verify)

    @property
    def hold(self) -> tuple[str, ...]:
        """Every package rigforge holds: the pinning package, what it installs, the version package."""
        names = [self.pinning, *self.install, self.version_package]
        return tuple(dict.fromkeys(name for name in names if name and not name.startswith(FOLLOWS_KERNEL)))

    def unattended_patterns(self, source: str) -> tuple[str, ...]:
        """Regexes for Unattended-Upgrade::Package-Blacklist."""
        exact = [f"^{name.replace('.', '[.]')}$" for name in self.hold]
        return (*[f"^{prefix}" for prefix in UNATTENDED_PREFIXES[source]], *exact)


class DriverTableError(ValueError):
    """No package exists for the combination asked for (the message says what to choose instead)."""


class DriverChoice(Protocol):
    """What the table is asked by: a host's nvidia_driver_* knobs (rigforge/model/knobs/nvidia_driver.py `NvidiaDriver`,
    which imports this module for its choices: not imported here). Read-only, as a frozen dataclass's fields are."""

    @property
    def nvidia_driver_source(self) -> str: ...  # cuda or ubuntu

    @property
    def nvidia_driver_branch(self) -> int: ...  # 580 or later

    @property
    def nvidia_driver_flavor(self) -> str: ...  # open or proprietary

    @property
    def nvidia_driver_kernel_flavour(self) -> str: ...  # Ubuntu's linux-modules-nvidia-<branch>-open-<this>


def packages_for(knobs: DriverChoice, os_id: str) -> DriverPackages:
    """The driver packages for this host (its nvidia_driver_* knobs); DriverTableError when no such package exists."""
    source, branch, flavor = knobs.nvidia_driver_source, knobs.nvidia_driver_branch, knobs.nvidia_driver_flavor
    fam = "ubuntu" if os_id == "ubuntu" else "debian"
    try:
        branch = int(branch)
    except (TypeError, ValueError):
        raise DriverTableError(f"nvidia_driver_branch={branch!r} is not a branch number (580, 590, ...)") from None
    if branch < MIN_BRANCH:
        raise DriverTableError(f"nvidia_driver_branch={branch} is older than {MIN_BRANCH}; set 580 or later")
    scheme = "580" if branch == 580 else "590+"
    row = TABLE.get((source, fam, scheme, flavor)) or TABLE.get((source, fam, "any", flavor))
    if row is None:
        have = sorted({key[0] for key in TABLE if key[1] == fam and key[3] == flavor})
        raise DriverTableError(
            f"no {flavor} driver package for {fam} from nvidia_driver_source={source!r}"
            + (f"; use nvidia_driver_source: {' or '.join(have)}" if have else "")
        )
    fill = {"branch": branch, "kernel": knobs.nvidia_driver_kernel_flavour}
    install, version = row
    pinning = PINNING[source]  # None: this source has no pinning package
    return DriverPackages(
        pinning=pinning.format(**fill) if pinning else None,
        install=tuple(name.format(**fill) for name in install),
        version_package=version.format(**fill),
    )


# The newest CUDA each driver supports: NVIDIA's "CUDA Toolkit and Corresponding Driver Versions" table (CUDA Toolkit
# Release Notes, https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/ , Linux x86_64 column, each minor's GA row).
# A driver runs images built for its CUDA or older; a newer image needs forward compatibility, which GeForce cards
# do not have (error 804 once vLLM starts, noonghunna/club-3090 #633). Newest first: (CUDA, minimum driver).
CUDA_DRIVERS = (
    ("13.2", "595.45.04"),
    ("13.1", "590.44.01"),
    ("13.0", "580.65.06"),
    ("12.9", "575.51.03"),
    ("12.8", "570.26"),
    ("12.6", "560.28.03"),
    ("12.5", "555.42.02"),
    ("12.4", "550.54.14"),
    ("12.3", "545.23.06"),
    ("12.2", "535.54.03"),
    ("12.1", "530.30.02"),
    ("12.0", "525.60.13"),
)


def version_key(version: str) -> tuple[int, ...]:
    """'580.159.04' -> (580, 159, 4); '13.0' -> (13, 0) (for comparing driver and CUDA versions)."""
    return tuple(int(part) for part in re.findall(r"\d+", str(version)))


def cuda_for_driver(version: str) -> str | None:
    """The newest CUDA a driver version supports, from the table (None: older than every row)."""
    return next((cuda for cuda, low in CUDA_DRIVERS if version_key(version) >= version_key(low)), None)


def cuda_for_branch(branch: int | str) -> str | None:
    """The newest CUDA a driver branch supports (580 -> 13.0); None outside the table (newer: not known yet)."""
    if int(branch) > version_key(CUDA_DRIVERS[0][1])[0]:
        return None
    return next((cuda for cuda, low in CUDA_DRIVERS if int(branch) >= version_key(low)[0]), None)


def branch_for_cuda(cuda: str) -> int | None:
    """The oldest driver branch that supports `cuda` (13.2 -> 595), None when the table has no such branch."""
    rows = [low for have, low in CUDA_DRIVERS if version_key(have) >= version_key(cuda)[:2]]
    return version_key(rows[-1])[0] if rows else None


# NVIDIA's CUDA repository keys (https://github.com/NVIDIA/cuda-repo-management, issue #39): debian13 is signed
# with the newer 8793F200 key, every other repository still with 3bf863cc.
CUDA_KEYS = {
    "debian13": ("8793F200.pub", "02182E60104FCDC26EAE1B8597A5D4CB8793F200"),
    "default": ("3bf863cc.pub", "EB693B3035CD5710E231E123A4B469963BF863CC"),
}
CUDA_REPOS = "https://developer.download.nvidia.com/compute/cuda/repos"
CUDA_ARCH = {"amd64": "x86_64", "arm64": "sbsa"}


def cuda_distro(os_release: dict) -> str:
    """'ubuntu2404', 'debian13', ..."""
    return f"{os_release.get('id', '')}{os_release.get('version_id', '').replace('.', '')}"


def cuda_repo_url(os_release: dict, deb_arch: str) -> str:
    """NVIDIA's CUDA repo for the OS, e.g. .../repos/ubuntu2404/x86_64/."""
    return f"{CUDA_REPOS}/{cuda_distro(os_release)}/{CUDA_ARCH.get(deb_arch, deb_arch)}/"


def cuda_key(os_release: dict) -> tuple[str, str]:
    return CUDA_KEYS.get(cuda_distro(os_release), CUDA_KEYS["default"])


def branch_problem(running: dict, branch: int) -> str | None:
    """With nvidia_driver_manage false: why the running driver is not acceptable (None when its branch is `branch`)."""
    version = running.get("version")
    if not version:
        return (
            f"nvidia_driver_manage is false but no NVIDIA driver is running; install driver branch {branch} "
            "(or set nvidia_driver_manage: true to let rigforge install it)."
        )
    if version.split(".")[0] != str(branch):
        return (
            f"the running NVIDIA driver is {version}, not branch {branch} (nvidia_driver_manage is false, so "
            f"rigforge leaves it alone); set nvidia_driver_branch: {version.split('.')[0]} or change the driver."
        )
    return None
