"""The README's quick start takes rigforge's default Docker source (issue 47): `rigforge testbed up` writes an
inventory without `docker_source`, pointing Docker's repository at the testbed's stand-in of it, and the README's
`pyinfra -y INVENTORY deploy/dual_turbo.py` converges a chroot rig with Docker's packages; a second run changes nothing.
"""

from __future__ import annotations

import pytest
from support import REPO, changed, errored, pyinfra_run, why

pytestmark = pytest.mark.testbed
DOCKER_CE = ("docker-ce", "docker-ce-cli", "containerd.io", "docker-buildx-plugin", "docker-compose-plugin")


def packages(rig) -> dict[str, str]:
    out = rig.run("dpkg-query -W -f '${Package} ${db:Status-Abbrev}\\n'").stdout
    return {name: status.strip() for name, status in (line.split(" ", 1) for line in out.splitlines())}


def test_the_quick_start_converges_with_the_default_docker_source_then_changes_nothing(testbed_factory):
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec()], name="quickstart", docker_source="docker")  # what `rigforge testbed up` does
    inventory = tb.inventory.read_text()
    assert "docker_source" not in inventory and f"'docker_repo_url': '{tb.docker_repo_url}'" in inventory
    rig = tb.rig("rig1")
    first, stderr = pyinfra_run(tb.inventory, REPO / "deploy" / "dual_turbo.py")
    assert not errored(first, "rig1") and first["failed_hosts"] == [], why(first, stderr)
    done = changed(first, "rig1")
    assert any(name.endswith("| Install Docker engine and compose v2 (docker packages)") for name in done), done
    now = packages(rig)
    assert [now.get(name) for name in DOCKER_CE] == ["ii"] * len(DOCKER_CE), now
    assert now.get("docker.io") is None
    assert rig.run("docker compose version").returncode == 0
    second, stderr = pyinfra_run(tb.inventory, REPO / "deploy" / "dual_turbo.py")
    assert not errored(second, "rig1") and changed(second, "rig1") == [], (changed(second, "rig1"), stderr[-4000:])
