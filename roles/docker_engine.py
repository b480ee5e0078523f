"""Docker engine + compose v2 (Docker's repository per docs.docker.com/engine/install/, or the distribution's), and the
NVIDIA Container Toolkit at the lock's version, held (1.19.1 broke cuInit, NVIDIA/nvidia-container-toolkit#1967).
"""

from collections.abc import Mapping

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.deb import DebArch
from pyinfra.operations import systemd

from rigforge.facts.system import OsRelease
from rigforge.fleet import Plan
from rigforge.knobs.docker_engine import DEFAULTS, DOCKER_CE_PACKAGES, DockerEngine
from rigforge.knobs.serving import Serving
from rigforge.layout import NVIDIA_RUNTIME
from roles.operations import apt_repo, docker_daemon

# Docker's "Uninstall old versions" list (Ubuntu's; Debian's is the same without docker-compose-v2), and Debian's
# docker-buildx: it ships the file docker-buildx-plugin ships (/usr/libexec/docker/cli-plugins/docker-buildx), and
# Docker's package declares no Conflicts with it (docker-ce-packaging deb/common/control), so dpkg would refuse to
# unpack Docker's over it.
DOCKER_CONFLICTS = [
    "docker.io",
    "docker-doc",
    "docker-compose",
    "docker-compose-v2",
    "podman-docker",
    "containerd",
    "runc",
    "docker-buildx",
]
TOOLKIT_PACKAGES = [
    "nvidia-container-toolkit",
    "nvidia-container-toolkit-base",
    "libnvidia-container-tools",
    "libnvidia-container1",
]


def docker_repo_url(data: Mapping, os_id: str) -> str:
    return data["docker_repo_url"] or f"https://download.docker.com/linux/{os_id}"


def toolkit_repo_url(data: Mapping, arch: str) -> str:
    return data["nvidia_toolkit_repo_url"].replace("{arch}", arch)


def toolkit_packages(version: str | None) -> list[str]:
    """The toolkit; with a version, all four of its packages pinned to it (NVIDIA's install guide)."""
    return [f"{name}={version}" for name in TOOLKIT_PACKAGES] if version else [TOOLKIT_PACKAGES[0]]


def docker_packages(source: str, os_id: str, versions: dict | None = None) -> list[str]:
    """Packages for `source`; Docker's packages take `name=version` pins from `versions`."""
    if source == "distro":
        return ["docker.io", "docker-compose-v2" if os_id == "ubuntu" else "docker-compose"]
    return [f"{name}={versions[name]}" if (versions or {}).get(name) else name for name in DOCKER_CE_PACKAGES]


@deploy("Docker engine and NVIDIA Container Toolkit", data_defaults=DEFAULTS)
def install(plan: Plan):
    data, knobs = plan.data, DockerEngine.of(plan.data)
    os_release = host.get_fact(OsRelease)
    arch = host.get_fact(DebArch)

    apt_repo.install_missing(name="Install apt repository prerequisites", packages=["ca-certificates", "curl", "gpg"])
    if knobs.docker_source == "docker":
        docker_url = docker_repo_url(data, os_release["id"])
        apt_repo.add_repo(
            repo="rigforge-docker",
            uris=docker_url,
            suites=os_release["codename"],
            components="stable",
            architectures=arch,
            key_url=knobs.docker_repo_key_url or f"{docker_url}/gpg",
            key_sha256=knobs.docker_repo_key_sha256,
            key_fingerprint=knobs.docker_repo_key_fingerprint,
        )
        apt_repo.remove_installed(  # last before the install: only once Docker's packages were fetched
            name="Remove the distribution's conflicting Docker packages",
            packages=DOCKER_CONFLICTS,
            replaced_by=docker_packages("docker", os_release["id"], knobs.docker_package_versions),
        )
    apt_repo.install_missing(
        name=f"Install Docker engine and compose v2 ({knobs.docker_source} packages)",
        packages=docker_packages(knobs.docker_source, os_release["id"], knobs.docker_package_versions),
    )
    apt_repo.add_repo(
        repo="rigforge-nvidia-container-toolkit",
        uris=toolkit_repo_url(data, arch),
        suites="/",
        key_url=knobs.nvidia_toolkit_repo_key_url,
        key_sha256=knobs.nvidia_toolkit_repo_key_sha256,
        key_fingerprint=knobs.nvidia_toolkit_repo_key_fingerprint,
    )
    version = plan.toolkit_version
    apt_repo.install_missing(
        name=f"Install the NVIDIA Container Toolkit{f' {version}' if version else ''}",
        packages=toolkit_packages(version),
        change_held=True,  # moving the pinned version replaces packages rigforge itself held
    )
    if version:
        apt_repo.hold(name="Hold the NVIDIA Container Toolkit packages", packages=TOOLKIT_PACKAGES)
    daemon = docker_daemon.merge_json(
        name=f"Add the nvidia runtime to {plan.layout.daemon_json}",
        path=plan.layout.daemon_json,
        patch=docker_daemon.deep_merge(knobs.docker_daemon_options or {}, NVIDIA_RUNTIME),
    )
    if Serving.of(plan.data).rigforge_manage_services:
        systemd.service(name="Enable and start docker", service="docker.service", running=True, enabled=True)
        systemd.service(
            name="Restart docker for the new daemon.json",
            service="docker.service",
            restarted=True,
            _if=daemon.did_change,
        )
