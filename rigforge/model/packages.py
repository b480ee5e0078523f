"""The apt package sets the roles install: which packages, which of them are held, which files they must provide.

Pure data per host (its knobs, its OS): the roles install and hold these sets, and `rigforge.observe.verdict.packages`
decides for the deploy, status and verify alike whether a rig has them as declared.
"""

from collections.abc import Mapping
from dataclasses import dataclass

from rigforge.layout import NODE_EXPORTER_PACKAGE
from rigforge.model import driver_table
from rigforge.model.knobs.docker_engine import DOCKER_CE_PACKAGES
from rigforge.model.knobs.nvidia_driver import NvidiaDriver
from rigforge.model.knobs.roles import RoleKnobs

# The toolkit's four packages, installed and held at one version (NVIDIA's install guide).
TOOLKIT_PACKAGES = (
    "nvidia-container-toolkit",
    "nvidia-container-toolkit-base",
    "libnvidia-container-tools",
    "libnvidia-container1",
)

# What rigforge runs of each set, as the vendors' packages ship it (checked with `dpkg -c` on their .debs).
DOCKER_CLI = "/usr/bin/docker"  # docker-ce-cli; Debian 13's docker-cli; Ubuntu's docker.io
COMPOSE_PLUGIN = "/usr/libexec/docker/cli-plugins/docker-compose"  # docker-compose-plugin; docker-compose(-v2)
NVIDIA_SMI = "/usr/bin/nvidia-smi"
NVIDIA_CTK = "/usr/bin/nvidia-ctk"  # nvidia-container-toolkit-base
RUNTIME_HOOK = "/usr/bin/nvidia-container-runtime-hook"  # nvidia-container-toolkit

# The distribution's Docker packages per OS. Debian 13 split the CLI out of docker.io into docker-cli, which
# docker.io only recommends: an install without recommends has no `docker` (Debian's docker.io 26.1.5+dfsg1-9).
# Ubuntu's docker.io still ships the CLI. Debian 12's docker-compose is compose v1 (python): no `docker compose`.
DISTRO_DOCKER = {
    ("debian", "13"): ("docker.io", "docker-cli", "docker-compose"),
    ("ubuntu", "22.04"): ("docker.io", "docker-compose-v2"),
    ("ubuntu", "24.04"): ("docker.io", "docker-compose-v2"),
}


@dataclass(frozen=True)
class PackageSet:
    """One set of apt packages a role installs (its operation is named after `what`)."""

    what: str  # e.g. "Docker engine and compose v2 (distro packages)"
    specs: tuple[str, ...]  # package names; `name=version` pins a version
    held: tuple[str, ...] = ()  # names kept at their version with `apt-mark hold`
    held_with: str = ""  # also hold the installed packages of `held_prefixes` at this package's upstream version
    held_prefixes: tuple[str, ...] = ()
    provides: tuple[str, ...] = ()  # files rigforge runs, which the set's packages must have put on the rig

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.partition("=")[0] for spec in self.specs)


def distro_docker(os_id: str, version: str) -> tuple[str, ...] | None:
    """The distribution's Docker packages with compose v2 on this OS, None where its archive has no compose v2."""
    return DISTRO_DOCKER.get((os_id, version))


def docker(source: str, os_id: str, os_version: str, versions: Mapping[str, str] | None = None) -> PackageSet:
    """Docker engine, CLI and compose v2: Docker's packages (`name=version` from `versions`) or the OS's."""
    provides = (DOCKER_CLI, COMPOSE_PLUGIN)
    if source == "distro":
        names = distro_docker(os_id, os_version) or ("docker.io", "docker-compose")  # preflight refuses the latter
        return PackageSet("Docker engine and compose v2 (distro packages)", names, provides=provides)
    pinned = versions or {}
    specs = tuple(f"{name}={pinned[name]}" if pinned.get(name) else name for name in DOCKER_CE_PACKAGES)
    return PackageSet("Docker engine and compose v2 (docker packages)", specs, provides=provides)


def toolkit(version: str | None) -> PackageSet:
    """The NVIDIA Container Toolkit; with a version, all four of its packages pinned to it and held."""
    what = f"the NVIDIA Container Toolkit{f' {version}' if version else ''}"
    provides = (NVIDIA_CTK, RUNTIME_HOOK)
    if not version:
        return PackageSet(what, (TOOLKIT_PACKAGES[0],), provides=provides)
    return PackageSet(what, tuple(f"{n}={version}" for n in TOOLKIT_PACKAGES), TOOLKIT_PACKAGES, provides=provides)


def driver(knobs: NvidiaDriver, os_id: str) -> PackageSet:
    """The NVIDIA driver packages of the driver table, held with their libraries; DriverTableError: none exists."""
    packages = driver_table.packages_for(knobs, os_id)
    return PackageSet(
        f"NVIDIA {knobs.nvidia_driver_branch} driver packages ({', '.join(packages.install)})",
        tuple(packages.install),
        tuple(packages.hold),
        held_with=packages.version_package,
        held_prefixes=tuple(driver_table.UNATTENDED_PREFIXES[knobs.nvidia_driver_source]),
        provides=(NVIDIA_SMI,),
    )


def pinning(knobs: NvidiaDriver, os_id: str) -> PackageSet | None:
    """NVIDIA's pinning package that locks the driver branch (None where the driver source has none)."""
    name = driver_table.packages_for(knobs, os_id).pinning
    return PackageSet(f"the driver branch lock {name}", (name,)) if name else None


def node_exporter() -> PackageSet:
    """Debian's node exporter and dbus, which its systemd collector asks."""
    what = f"{NODE_EXPORTER_PACKAGE} (Debian's) and dbus for its systemd collector"
    return PackageSet(what, (NODE_EXPORTER_PACKAGE, "dbus"))


PREREQUISITES = PackageSet("apt repository prerequisites", ("ca-certificates", "curl", "gpg"))


def for_rig(knobs: RoleKnobs, os_release: Mapping | None, toolkit_version: str | None) -> list[PackageSet]:
    """Every package set the deploy installs on a rig with validated `knobs` (a plan's) and `os_release`
    (OsRelease), in the roles' order; the driver's only when rigforge manages it and the driver table has it."""
    os_id, version = (os_release or {}).get("id", ""), (os_release or {}).get("version_id", "")
    sets = [PREREQUISITES]
    if knobs.driver.nvidia_driver_manage:
        try:
            sets += [s for s in (pinning(knobs.driver, os_id), driver(knobs.driver, os_id)) if s]
        except driver_table.DriverTableError:
            pass  # preflight refuses such a rig, naming what to choose
    sets.append(docker(knobs.docker.docker_source, os_id, version, knobs.docker.docker_package_versions))
    return [*sets, toolkit(toolkit_version), node_exporter()]
