"""NVIDIA driver, from NVIDIA's CUDA apt repository or Ubuntu's own archive, packages chosen from one table.

`nvidia_driver_source: cuda` (default): NVIDIA's CUDA repository for the OS (deb822 source, Signed-By keyring
whose fingerprint is checked: debian13 is signed with 8793F200, every other repo with 3bf863cc), then
`nvidia-driver-pinning-<branch>` (locks the branch), then the driver packages for the distro, branch and
flavour (rigforge/driver_table.py). `ubuntu`: Ubuntu's `nvidia-driver-<branch>[-open]` plus the prebuilt, signed
`linux-modules-nvidia-<branch>[-open]-<kernel flavour>` (no DKMS, works with Secure Boot), apt-pinned so
NVIDIA's repository cannot win. The same table names what is held, kept out of unattended upgrades, and
compared with the loaded kernel module: the rig is rebooted only when the installed driver is not the one
running, and only with `nvidia_allow_reboot` (never the controller).

`nvidia_driver_manage: false` leaves the driver alone (a driver installed by hand or with NVIDIA's .run
installer) and only checks that the running driver is of the branch asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from io import StringIO

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.deb import DebArch
from pyinfra.operations import files, server

from rigforge import driver_table, schema
from rigforge.driver_table import packages_for
from rigforge.facts.system import OsRelease
from rigforge.layout import NOUVEAU_CONF, UBUNTU_PIN, UNATTENDED_CONF
from rigforge.plan import Plan
from roles.operations import apt_repo, nvidia

DEFAULTS = {
    "nvidia_driver_source": "cuda",  # cuda (NVIDIA's CUDA repo) or ubuntu (Ubuntu's archive, prebuilt signed modules)
    "nvidia_driver_manage": True,  # false: leave an existing driver alone, only check its branch
    "nvidia_driver_branch": 580,  # driver branch (580 or later)
    "nvidia_driver_flavor": "open",  # open (open kernel modules) or proprietary
    "nvidia_driver_kernel_flavour": "generic",  # source ubuntu: linux-modules-nvidia-<branch>-open-<this>
    "nvidia_driver_repo_url": None,  # flat apt repo (Suites: /); default NVIDIA's CUDA repo for the OS
    "nvidia_driver_repo_key_url": None,  # armored repo key; default <repo url><8793F200|3bf863cc>.pub
    "nvidia_driver_repo_key_fingerprint": None,  # default NVIDIA's fingerprint for the OS; a differing key is refused
    "nvidia_driver_repo_key_sha256": None,  # pin the key file's sha256 too (checked after download)
    "nvidia_allow_reboot": False,  # reboot the rig when the installed driver is not the running one
    "apt_adopt_sources": True,  # replace other source files for the same URI (kept as *.rigforge-bak)
    "apt_lock_wait": 300,  # seconds to wait, before the first change, for an apt/dpkg lock another process holds
}

KEY_NAME = "rigforge-nvidia-cuda"
NOUVEAU_TEXT = """# managed by rigforge: the NVIDIA driver needs nouveau unloaded
blacklist nouveau
options nouveau modeset=0
"""
CUDA_ORIGIN = "developer.download.nvidia.com"
BOOLEAN_KEYS = ("nvidia_driver_manage", "nvidia_allow_reboot", "apt_adopt_sources")


def validate(data: Mapping) -> list[str]:
    """Problems with this role's host-data keys (defaults applied); each names the key, value and what is allowed."""
    problems = []
    source, flavor, branch = data["nvidia_driver_source"], data["nvidia_driver_flavor"], data["nvidia_driver_branch"]
    if source not in driver_table.SOURCES:
        problems.append(f"nvidia_driver_source={source!r} is not one of: {', '.join(driver_table.SOURCES)}.")
    if flavor not in driver_table.FLAVORS:
        problems.append(f"nvidia_driver_flavor={flavor!r} is not one of: {', '.join(driver_table.FLAVORS)}.")
    if isinstance(branch, bool) or not str(branch).isdigit() or int(branch) < driver_table.MIN_BRANCH:
        problems.append(f"nvidia_driver_branch={branch!r} must be a branch number, 580 or later (e.g. 580, 590).")
    for key in BOOLEAN_KEYS:
        if data[key] not in (True, False):
            problems.append(f"{key}={data[key]!r} must be true or false.")
    problems += schema.integer(data, "apt_lock_wait", 0, 86400, " of seconds")
    fpr = data["nvidia_driver_repo_key_fingerprint"]
    if fpr is not None and (not isinstance(fpr, str) or len(fpr.replace(" ", "")) != 40):
        problems.append(f"nvidia_driver_repo_key_fingerprint={fpr!r} must be a 40-hex-digit key fingerprint.")
    kernel = data["nvidia_driver_kernel_flavour"]
    if not isinstance(kernel, str) or not kernel or not all(c.isalnum() or c in "-." for c in kernel):
        problems.append(f"nvidia_driver_kernel_flavour={kernel!r} must be a kernel flavour such as generic.")
    return problems


def cuda_repo(data: Mapping, os_release: dict, deb_arch: str) -> tuple[str, str, str]:
    """(repo URL, key URL, key fingerprint) of the CUDA repository for this host."""
    url = data["nvidia_driver_repo_url"] or driver_table.cuda_repo_url(os_release, deb_arch)
    key_file, fingerprint = driver_table.cuda_key(os_release)
    return (
        url,
        data["nvidia_driver_repo_key_url"] or f"{url}{key_file}",
        (data["nvidia_driver_repo_key_fingerprint"] or fingerprint),
    )


def unattended_text(packages: driver_table.DriverPackages, source: str) -> str:
    lines = "".join(f'    "{pattern}";\n' for pattern in packages.unattended_patterns(source))
    return (
        "// managed by rigforge: NVIDIA driver packages change only through rigforge (held)\n"
        f"Unattended-Upgrade::Package-Blacklist {{\n{lines}}};\n"
    )


def ubuntu_pin_text(packages: driver_table.DriverPackages) -> str:
    """apt preferences: the driver packages never come from NVIDIA's repository (Ubuntu's archive wins)."""
    names = " ".join(["nvidia-*", "libnvidia-*", *packages.install])
    return (
        "# managed by rigforge: nvidia_driver_source=ubuntu, NVIDIA's CUDA repository must not win\n"
        f'Package: {names}\nPin: origin "{CUDA_ORIGIN}"\nPin-Priority: -1\n'
    )


@deploy("NVIDIA driver", data_defaults=DEFAULTS)
def install(plan: Plan):
    data = plan.data
    if not data["nvidia_driver_manage"]:
        nvidia.running_branch(
            name=f"Check the running driver is branch {data['nvidia_driver_branch']} (nvidia_driver_manage: false)",
            branch=int(data["nvidia_driver_branch"]),
        )
        return
    os_release = host.get_fact(OsRelease)
    try:
        packages = packages_for(data, os_release["id"])
    except driver_table.DriverTableError:
        return  # no such package: preflight has already failed this host, naming what to choose
    source = data["nvidia_driver_source"]

    apt_repo.install_missing(name="Install apt repository prerequisites", packages=["ca-certificates", "curl", "gpg"])
    if source == "cuda":
        url, key_url, fingerprint = cuda_repo(data, os_release, host.get_fact(DebArch))
        apt_repo.add_repo(
            repo=KEY_NAME,
            uris=url,
            suites="/",
            key_url=key_url,
            key_fingerprint=fingerprint,
            key_sha256=data["nvidia_driver_repo_key_sha256"],
        )
    else:
        files.put(
            name="Pin the NVIDIA driver to Ubuntu's archive",
            src=StringIO(ubuntu_pin_text(packages)),
            dest=UBUNTU_PIN,
            mode="644",
        )
    files.put(
        name="Keep the NVIDIA driver packages out of unattended upgrades",
        src=StringIO(unattended_text(packages, source)),
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
    if packages.pinning:
        apt_repo.install_missing(
            name=f"Lock the driver branch: install {packages.pinning}", packages=[packages.pinning]
        )
    apt_repo.install_missing(
        name=f"Install NVIDIA {data['nvidia_driver_branch']} driver packages ({', '.join(packages.install)})",
        packages=list(packages.install),
    )
    apt_repo.hold(
        name="Hold the NVIDIA driver packages",
        packages=list(packages.hold),
        same_version_as=packages.version_package,
        prefixes=driver_table.UNATTENDED_PREFIXES[source],
    )
    nvidia.reboot_if_needed(
        name="Reboot if the installed driver is not the running one",
        package=packages.version_package,
        allow_reboot=data["nvidia_allow_reboot"],
    )
