"""Docker engine + compose v2 (Docker's repository per docs.docker.com/engine/install/, or the distribution's), and the
NVIDIA Container Toolkit at the lock's version, held (1.19.1 broke cuInit, NVIDIA/nvidia-container-toolkit#1967).
"""

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.deb import DebArch
from pyinfra.operations import server, systemd

from rigforge.model import packages
from rigforge.model.fleet import Plan
from rigforge.model.knobs.docker_engine import DockerEngine, daemon_json_patch
from rigforge.observe.facts.system import OsRelease
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


def docker_repo_url(knobs: DockerEngine, os_id: str) -> str:
    return knobs.docker_repo_url or f"https://download.docker.com/linux/{os_id}"


def toolkit_repo_url(knobs: DockerEngine, arch: str) -> str:
    return knobs.nvidia_toolkit_repo_url.replace("{arch}", arch)


@deploy("Docker engine and NVIDIA Container Toolkit")
def install(plan: Plan) -> None:
    """Docker (from Docker's repository, its conflicting distro packages removed, or the distribution's) and the
    NVIDIA Container Toolkit (the lock's version, held), the nvidia runtime in daemon.json; when services are managed,
    docker.service running and restarted on a new daemon.json."""
    knobs = plan.knobs.docker
    os_release = host.get_fact(OsRelease)
    arch = host.get_fact(DebArch)
    docker = packages.docker(
        knobs.docker_source, os_release["id"], os_release["version_id"], knobs.docker_package_versions
    )
    toolkit = packages.toolkit(plan.toolkit_version)

    apt_repo.install_missing(name="Install apt repository prerequisites", packages=["ca-certificates", "curl", "gpg"])
    if knobs.docker_source == "docker":
        docker_url = docker_repo_url(knobs, os_release["id"])
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
            replaced_by=list(docker.specs),
        )
    apt_repo.install_missing(name=f"Install {docker.what}", packages=docker)
    apt_repo.add_repo(
        repo="rigforge-nvidia-container-toolkit",
        uris=toolkit_repo_url(knobs, arch),
        suites="/",
        key_url=knobs.nvidia_toolkit_repo_key_url,
        key_sha256=knobs.nvidia_toolkit_repo_key_sha256,
        key_fingerprint=knobs.nvidia_toolkit_repo_key_fingerprint,
    )
    apt_repo.install_missing(
        name=f"Install {toolkit.what}",
        packages=toolkit,
        change_held=True,  # moving the pinned version replaces packages rigforge itself held
    )
    if toolkit.held:
        apt_repo.hold(name="Hold the NVIDIA Container Toolkit packages", packages=toolkit)
    daemon = docker_daemon.merge_json(
        name=f"Add the nvidia runtime to {plan.layout.daemon_json}",
        path=plan.layout.daemon_json,
        patch=daemon_json_patch(knobs),
    )
    if plan.knobs.serving.rigforge_manage_services:
        systemd.service(name="Enable and start docker", service="docker.service", running=True, enabled=True)
        server.shell(
            # docker.service allows 3 starts a minute (StartLimitBurst=3): runs that move the data-root back and forth
            # must not find it refusing to start ("start of the service was attempted too often")
            name="Reset docker.service's start rate counter before its restart",
            commands=["systemctl reset-failed docker.service"],
            _if=daemon.did_change,
        )
        systemd.service(
            name="Restart docker for the new daemon.json",
            service="docker.service",
            restarted=True,
            _if=daemon.did_change,
        )
