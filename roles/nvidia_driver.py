"""NVIDIA driver from NVIDIA's CUDA repository (branch locked by `nvidia-driver-pinning-<branch>`) or Ubuntu's prebuilt,
signed modules (no DKMS, works with Secure Boot); held, and rebooted into only with `nvidia_allow_reboot`.
"""

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.deb import DebArch
from pyinfra.operations import server

from rigforge.layout import NOUVEAU_CONF, UBUNTU_PIN, UNATTENDED_CONF
from rigforge.model import driver_table
from rigforge.model import packages as package_sets
from rigforge.model.fleet import Plan
from rigforge.model.knobs.nvidia_driver import NvidiaDriver
from rigforge.observe.facts.system import OsRelease
from roles.operations import apt_repo, nvidia

KEY_NAME = "rigforge-nvidia-cuda"
NOUVEAU_TEXT = """# managed by rigforge: the NVIDIA driver needs nouveau unloaded
blacklist nouveau
options nouveau modeset=0
"""
CUDA_ORIGIN = "developer.download.nvidia.com"  # the origin apt gives NVIDIA's CUDA repository's packages


def cuda_repo(knobs: NvidiaDriver, os_release: dict, deb_arch: str) -> tuple[str, str, str]:
    """(repo URL, key URL, key fingerprint) of the CUDA repository for this host."""
    url = knobs.nvidia_driver_repo_url or driver_table.cuda_repo_url(os_release, deb_arch)
    key_file, fingerprint = driver_table.cuda_key(os_release)
    key_url = knobs.nvidia_driver_repo_key_url or f"{url}{key_file}"
    return url, key_url, knobs.nvidia_driver_repo_key_fingerprint or fingerprint


def ubuntu_pin_text(packages: driver_table.DriverPackages) -> str:
    """apt preferences: the driver packages never come from NVIDIA's repository (Ubuntu's archive wins)."""
    names = " ".join(["nvidia-*", "libnvidia-*", *packages.install])
    return (
        "# managed by rigforge: nvidia_driver_source=ubuntu, NVIDIA's CUDA repository must not win\n"
        f'Package: {names}\nPin: origin "{CUDA_ORIGIN}"\nPin-Priority: -1\n'
    )


def unattended_text(packages: driver_table.DriverPackages, source: str) -> str:
    """apt.conf: unattended-upgrades leaves the driver packages of `source` alone (they change only through
    rigforge, held)."""
    lines = "".join(f'    "{pattern}";\n' for pattern in packages.unattended_patterns(source))
    return (
        "// managed by rigforge: NVIDIA driver packages change only through rigforge (held)\n"
        f"Unattended-Upgrade::Package-Blacklist {{\n{lines}}};\n"
    )


@deploy("NVIDIA driver")
def install(plan: Plan) -> None:
    """The driver table's packages for this host (nvidia_driver_source's repository), held and kept out of unattended
    upgrades, nouveau blacklisted, and a reboot when the running driver is not the installed one; with
    nvidia_driver_manage: false, only a check of the running branch."""
    knobs = plan.knobs.driver
    if not knobs.nvidia_driver_manage:
        nvidia.running_branch(
            name=f"Check the running driver is branch {knobs.nvidia_driver_branch} (nvidia_driver_manage: false)",
            branch=int(knobs.nvidia_driver_branch),
        )
        return
    os_release = host.get_fact(OsRelease)
    try:
        packages = driver_table.packages_for(knobs, os_release["id"])
    except driver_table.DriverTableError:
        return  # no such package: preflight has already failed this host, naming what to choose
    source = knobs.nvidia_driver_source

    apt_repo.install_missing(name="Install apt repository prerequisites", packages=["ca-certificates", "curl", "gpg"])
    if source == "cuda":
        url, key_url, fingerprint = cuda_repo(knobs, os_release, host.get_fact(DebArch))
        apt_repo.add_repo(
            repo=KEY_NAME,
            uris=url,
            suites="/",
            key_url=key_url,
            key_fingerprint=fingerprint,
            key_sha256=knobs.nvidia_driver_repo_key_sha256,
        )
    else:
        apt_repo.put_file("Pin the NVIDIA driver to Ubuntu's archive", ubuntu_pin_text(packages), UBUNTU_PIN)
    unattended = unattended_text(packages, source)
    apt_repo.put_file("Keep the NVIDIA driver packages out of unattended upgrades", unattended, UNATTENDED_CONF)
    blacklist = apt_repo.put_file("Blacklist the nouveau driver", NOUVEAU_TEXT, NOUVEAU_CONF)
    server.shell(
        name="Rebuild the initramfs without nouveau",
        commands=["if command -v update-initramfs >/dev/null 2>&1; then update-initramfs -u; fi"],
        _if=blacklist.did_change,
    )
    if pinning := package_sets.pinning(knobs, os_release["id"]):
        apt_repo.install_missing(name=f"Lock the driver branch: install {pinning.specs[0]}", packages=pinning)
    driver = package_sets.driver(knobs, os_release["id"])
    apt_repo.install_missing(name=f"Install {driver.what}", packages=driver)
    apt_repo.hold(name="Hold the NVIDIA driver packages", packages=driver)
    nvidia.reboot_if_needed(
        name="Reboot if the installed driver is not the running one",
        package=packages.version_package,
        allow_reboot=knobs.nvidia_allow_reboot,
    )
