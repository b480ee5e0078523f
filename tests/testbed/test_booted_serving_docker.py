"""Booted: the default Docker source (Docker's repository) on a rig that serves with Debian's docker.io (issue 32).

The booted rig behind the gateway that test_booted_serving uses (the fleet is shared) serves dual with Debian's
docker.io (`docker_source: distro`, the testbed's own setting), the way many rigs were set up by hand. Then the
testbed's `docker_source` is dropped from its host data, so rigforge's default, Docker's repository, applies:
- with Docker's repository unreachable, the run is refused and nothing is removed: docker.io is still installed and
  running, and so is the serving container (the same one, never restarted);
- with the testbed's Docker repository (Debian's Docker repackaged under Docker's names and relations,
  rigforge/testbed/aptrepo.py), docker-ce replaces docker.io, the rig serves again, and a re-run changes nothing.

Marked `booted` and `testbed`; skipped with the reason when this machine cannot boot rigs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support import REPO, changed, errored, pyinfra_run, why

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
CONTAINER, PORT = "vllm-qwen36-27b-dual", 8010


@pytest.fixture(scope="module")
def served(serving_fleet):
    """The serving fleet's rig (tests/conftest.py) serving dual with docker.io: as test_booted_serving left it (this
    deploy then changes nothing), or converged here when this module runs alone."""
    tb = serving_fleet
    results, stderr = pyinfra_run(tb.inventory, REPO / "deploy" / "dual.py")
    assert not errored(results, "rig1"), why(results, stderr)
    rig = tb.rig("rig1")
    assert packages(rig)["docker.io"] == "ii" and serving(rig)
    return tb, rig


def default_source(tb, path: Path, **data) -> Path:
    """The testbed's inventory without its `docker_source` (rigforge's default then applies), plus `data`."""
    path.write_text(
        f"exec(open({str(tb.inventory)!r}).read())\n_extra = {data!r}\n"
        "rigs = [(n, {**{k: v for k, v in d.items() if k != 'docker_source'}, **_extra}) for n, d in rigs]\n"
    )
    return path


def packages(rig) -> dict[str, str]:
    out = rig.run("dpkg-query -W -f '${Package} ${db:Status-Abbrev}\\n'").stdout
    return {name: status.strip() for name, status in (line.split(" ", 1) for line in out.splitlines())}


def container(rig) -> tuple[str, str]:
    """(id, start time) of the serving container."""
    res = rig.run(f"docker inspect -f '{{{{.Id}}}} {{{{.State.StartedAt}}}}' {CONTAINER}")
    assert res.returncode == 0, res.stdout + res.stderr
    cid, started = res.stdout.split()
    return cid, started


def serving(rig) -> bool:
    res = rig.run(f"curl -sf --max-time 5 http://127.0.0.1:{PORT}/v1/models")
    return res.returncode == 0 and bool(json.loads(res.stdout)["data"])


def test_docker_repository_unreachable_refuses_and_leaves_docker_io_serving(served, tmp_path):
    tb, rig = served
    before = container(rig)
    inventory = default_source(
        tb,
        tmp_path / "unreachable.py",
        docker_repo_url="http://127.0.0.1:9/docker",
        docker_repo_key_url=tb.docker_repo_key_url,
        docker_repo_key_fingerprint=tb.repo_key_fingerprint,
    )
    results, stderr = pyinfra_run(inventory, REPO / "deploy" / "dual.py")
    assert results["failed_hosts"] in ("all", ["rig1"]), stderr[-4000:]
    assert "Docker's repository could not be asked (connection refused: http://127.0.0.1:9/docker/" in stderr
    assert "nothing removed, docker.io, docker-compose, containerd, runc left installed and running" in stderr
    now = packages(rig)
    assert (now.get("docker.io"), now.get("containerd"), now.get("docker-ce")) == ("ii", "ii", None), now
    assert rig.run("systemctl is-active docker.service").stdout.strip() == "active"
    assert container(rig) == before  # the same container, never restarted
    assert serving(rig)


def test_the_default_source_replaces_docker_io_with_docker_ce_and_serves(served, tmp_path, testbed_report):
    tb, rig = served
    inventory = default_source(
        tb,
        tmp_path / "docker.py",
        docker_repo_url=tb.docker_repo_url,
        docker_repo_key_url=tb.docker_repo_key_url,
        docker_repo_key_fingerprint=tb.repo_key_fingerprint,
    )
    t0 = time.monotonic()
    results, stderr = pyinfra_run(inventory, REPO / "deploy" / "dual.py")
    assert not errored(results, "rig1"), why(results, stderr)
    testbed_report.append(f"docker: docker.io -> docker-ce, serving again, in {time.monotonic() - t0:.0f}s")
    now = packages(rig)
    for name in ("docker-ce", "docker-ce-cli", "containerd.io", "docker-buildx-plugin", "docker-compose-plugin"):
        assert now.get(name) == "ii", (name, now.get(name))
    for name in ("docker.io", "containerd", "runc"):
        assert now.get(name, "rc")[0] != "i", (name, now.get(name))
    assert rig.run("systemctl is-active docker.service rigforge-vllm@dual.service").stdout.split() == ["active"] * 2
    assert serving(rig)
    results, stderr = pyinfra_run(inventory, REPO / "deploy" / "dual.py")
    assert not errored(results, "rig1") and changed(results, "rig1") == [], (changed(results, "rig1"), stderr[-4000:])
