"""The testbed's Docker repository, used the way Docker's published instructions use download.docker.com.

Written from "Install Docker Engine on Debian" (docs.docker.com/engine/install/debian/) and Docker's packaging
(docker/docker-ce-packaging deb/common/control, docker/containerd-packaging debian/control), not from the stand-in:
on a rig set up with Debian's docker.io, run the "Uninstall old versions" loop, add the key and the one-line
docker.list, install the five packages; Docker's binaries then run, Debian's packages are gone, and each package
declares the relations Docker's control files give it.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.testbed

DOCKER_INSTALL = """set -e
for pkg in docker.io docker-doc docker-compose podman-docker containerd runc; do apt-get remove -y $pkg; done
apt-get update
apt-get install -y ca-certificates curl
install -m 0755 -d /etc/apt/keyrings
curl -fsSL {url}/gpg -o /etc/apt/keyrings/docker.asc
chmod a+r /etc/apt/keyrings/docker.asc
echo "deb [arch=$(dpkg --print-architecture) signed-by=/etc/apt/keyrings/docker.asc] {url} \\
  $(. /etc/os-release && echo "$VERSION_CODENAME") stable" | tee /etc/apt/sources.list.d/docker.list > /dev/null
apt-get update
apt-get install -y docker-ce docker-ce-cli containerd.io docker-buildx-plugin docker-compose-plugin
"""
# Docker's control files, field by field (docker-ce-packaging deb/common/control; containerd-packaging debian/control)
DOCKER_RELATIONS = {
    "docker-ce": {
        "Conflicts": "docker (<< 1.5~), docker-engine, docker.io",
        "Replaces": "docker-engine, docker-ce-cli (<< 5:28.0.0)",
    },
    "docker-ce-cli": {
        "Conflicts": "docker (<< 1.5~), docker-engine, docker.io",
        "Replaces": "docker-ce (<< 5:0)",
        "Breaks": "docker-ce (<< 5:0)",
    },
    "containerd.io": {"Provides": "containerd, runc", "Conflicts": "containerd, runc", "Replaces": "containerd, runc"},
    "docker-buildx-plugin": {"Replaces": "docker-ce-cli", "Enhances": "docker-ce-cli"},
    "docker-compose-plugin": {
        "Conflicts": "docker-compose",
        "Replaces": "docker-compose",
        "Breaks": "docker-compose",
        "Enhances": "docker-ce-cli",
    },
}


def installed(rig) -> dict[str, str]:
    out = rig.run("dpkg-query -W -f '${Package} ${db:Status-Abbrev}\\n'").stdout
    return {name: status.strip() for name, status in (line.split(" ", 1) for line in out.splitlines())}


@pytest.fixture(scope="module")
def rig(testbed_factory):
    """A rig set up with Debian's docker.io, then Docker's instructions followed on it."""
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec()], name="docker-repo")
    rig = tb.rig("rig1")
    res = rig.run("DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io 2>&1")
    assert res.returncode == 0, res.stdout
    assert installed(rig).get("docker.io") == "ii"
    res = rig.run(f"export DEBIAN_FRONTEND=noninteractive; {DOCKER_INSTALL.format(url=tb.docker_repo_url)} 2>&1")
    assert res.returncode == 0, res.stdout[-4000:]
    return rig


def test_dockers_instructions_replace_debians_docker_with_dockers_packages_that_run(rig):
    now = installed(rig)
    for name in DOCKER_RELATIONS:
        assert now.get(name) == "ii", (name, now.get(name))
    for debian in ("docker.io", "docker-cli", "containerd", "runc", "docker-compose"):
        assert now.get(debian, "rc").startswith("r") or debian not in now, (debian, now.get(debian))
    versions = rig.run(
        "dockerd --version && docker --version && docker compose version && docker buildx version && "
        "containerd --version && runc --version"
    )
    assert versions.returncode == 0, versions.stdout + versions.stderr
    assert "Docker version" in versions.stdout and "Docker Compose version" in versions.stdout
    assert rig.run("test -f /usr/lib/systemd/system/docker.service && getent group docker").returncode == 0


@pytest.mark.parametrize("package", sorted(DOCKER_RELATIONS))
def test_each_package_declares_dockers_relations(rig, package):
    out = rig.run(f"dpkg-query -W -f '${{Conflicts}}|${{Replaces}}|${{Breaks}}|${{Provides}}|${{Enhances}}' {package}")
    assert out.returncode == 0, out.stderr
    fields = dict(zip(["Conflicts", "Replaces", "Breaks", "Provides", "Enhances"], out.stdout.split("|"), strict=True))
    for field, value in DOCKER_RELATIONS[package].items():
        assert fields[field] == value, (package, field, fields[field])
