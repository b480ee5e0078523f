"""Docker engine with the compose v2 plugin, and the NVIDIA Container Toolkit.

`docker_source: docker` installs from Docker's apt repository (deb822 + keyring: docker-ce, docker-ce-cli,
containerd.io, docker-buildx-plugin, docker-compose-plugin, versions pinnable); `distro` installs the
distribution's docker.io + compose v2 (the testbed's path). The toolkit comes from NVIDIA's flat repo.
/etc/docker/daemon.json has one writer: the nvidia runtime is merged into it as JSON, user keys kept
(nvidia-ctk is not run on it). Docker is restarted only when daemon.json changed, and only when
`rigforge_manage_services` is true.
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.deb import DebArch
from pyinfra.operations import systemd

from roles.facts.system import OsRelease
from roles.operations import apt_repo, docker_daemon

DEFAULTS = {
    "docker_source": "docker",  # docker (Docker's apt repo) or distro (docker.io + compose v2 from the OS)
    "docker_repo_url": None,  # default https://download.docker.com/linux/<ubuntu|debian>
    "docker_repo_key_url": None,  # default <docker repo url>/gpg
    "docker_repo_key_sha256": None,  # pin the key file's sha256
    "docker_package_versions": {},  # {package: version} pins, e.g. {"docker-ce": "5:28.5.1-1~ubuntu.24.04~noble"}
    "docker_daemon_options": {},  # extra daemon.json keys, merged in beside the nvidia runtime
    "nvidia_toolkit_repo_url": "https://nvidia.github.io/libnvidia-container/stable/deb/{arch}/",  # flat repo
    "nvidia_toolkit_repo_key_url": "https://nvidia.github.io/libnvidia-container/gpgkey",  # armored key
    "nvidia_toolkit_repo_key_sha256": None,  # pin the key file's sha256
    "nvidia_toolkit_version": None,  # pin nvidia-container-toolkit, e.g. "1.18.0-1"
}

DAEMON_JSON = "/etc/docker/daemon.json"
DOCKER_CE_PACKAGES = ["docker-ce", "docker-ce-cli", "containerd.io", "docker-buildx-plugin", "docker-compose-plugin"]


def docker_packages(source: str, os_id: str, versions: dict | None = None) -> list[str]:
    """Packages for `source`; Docker's packages take `name=version` pins from `versions`."""
    if source == "distro":
        return ["docker.io", "docker-compose-v2" if os_id == "ubuntu" else "docker-compose"]
    versions = versions or {}
    return [f"{name}={versions[name]}" if versions.get(name) else name for name in DOCKER_CE_PACKAGES]


@deploy("Docker engine and NVIDIA Container Toolkit", data_defaults=DEFAULTS)
def install():
    data = host.data
    os_release = host.get_fact(OsRelease)
    arch = host.get_fact(DebArch)

    apt_repo.install_missing(name="Install apt repository prerequisites", packages=["ca-certificates", "curl"])
    if data.docker_source == "docker":
        docker_url = data.docker_repo_url or f"https://download.docker.com/linux/{os_release['id']}"
        apt_repo.add_repo(
            repo="rigforge-docker",
            uris=docker_url,
            suites=os_release["codename"],
            components="stable",
            architectures=arch,
            key_url=data.docker_repo_key_url or f"{docker_url}/gpg",
            key_sha256=data.docker_repo_key_sha256,
        )
    apt_repo.install_missing(
        name=f"Install Docker engine and compose v2 ({data.docker_source} packages)",
        packages=docker_packages(data.docker_source, os_release["id"], data.docker_package_versions),
    )
    apt_repo.add_repo(
        repo="rigforge-nvidia-container-toolkit",
        uris=data.nvidia_toolkit_repo_url.replace("{arch}", arch),
        suites="/",
        key_url=data.nvidia_toolkit_repo_key_url,
        key_sha256=data.nvidia_toolkit_repo_key_sha256,
    )
    toolkit = "nvidia-container-toolkit"
    apt_repo.install_missing(
        name="Install the NVIDIA Container Toolkit",
        packages=[f"{toolkit}={data.nvidia_toolkit_version}" if data.nvidia_toolkit_version else toolkit],
    )
    daemon = docker_daemon.merge_json(
        name="Add the nvidia runtime to /etc/docker/daemon.json",
        path=DAEMON_JSON,
        patch=docker_daemon.deep_merge(data.docker_daemon_options or {}, docker_daemon.NVIDIA_RUNTIME),
    )
    if host.data.get("rigforge_manage_services", True):
        systemd.service(name="Enable and start docker", service="docker.service", running=True, enabled=True)
        systemd.service(
            name="Restart docker for the new daemon.json",
            service="docker.service",
            restarted=True,
            _if=daemon.did_change,
        )
