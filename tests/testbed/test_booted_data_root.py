"""Booted: moving Docker's data-root with docker_daemon_options (issue 47, "roots and data that are not rigforge's").

A booted rig serves dual with Docker's default data-root. A deploy with `docker_daemon_options: {data-root:
/srv/docker}` warns, once preflight passed, that /var/lib/docker, the data-root in use, holds so many MB that
rigforge neither copies nor deletes; Docker then runs from /srv/docker, the rig serves again, and /var/lib/docker
is still there. `rigforge status` notes it with its size. A deploy straight back to Docker's default names
/srv/docker, within a minute of the move: docker.service's start limit (3 starts a minute) does not refuse it, as
the role resets the counter before the restart.

Marked `booted` and `testbed`; skipped with the reason when this machine cannot boot rigs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from support import PYINFRA, REPO, errored, inventory_with, pyinfra_run, why

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
PORT = 8010
MOVED = re.compile(
    r"rig1: WARNING: this run sets Docker's data-root to (\S+) in /etc/docker/daemon\.json; (\S+), the one it uses "
    r"now, holds ([0-9.]+) (MB|GB); rigforge neither copies nor deletes it; once the rig serves from \1, remove it "
    r"with: sudo rm -rf \2"
)


@pytest.fixture(scope="module")
def served(testbed_factory):
    """A booted rig serving dual with Docker's default data-root."""
    from rigforge.testbed import RigSpec

    missing = [tool for tool in ("systemd-nspawn", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"cannot boot rigs: {', '.join(missing)} not found (apt-get install systemd-container iproute2)")
    tb = testbed_factory([RigSpec()], name="dataroot", booted=True)
    results, stderr = pyinfra_run(tb.inventory, REPO / "deploy" / "dual.py")
    assert not errored(results, "rig1"), why(results, stderr)
    rig = tb.rig("rig1")
    assert docker_root(rig) == "/var/lib/docker" and serving(rig)
    return tb, rig


def with_data_root(tb, path, data_root: str):
    return inventory_with(tb, path, {"rig1": {"docker_daemon_options": {"data-root": data_root}}})


def docker_root(rig) -> str:
    return rig.run("docker info -f '{{.DockerRootDir}}'").stdout.strip()


def serving(rig) -> bool:
    res = rig.run(f"curl -sf --max-time 5 http://127.0.0.1:{PORT}/v1/models")
    return res.returncode == 0 and bool(json.loads(res.stdout)["data"])


def test_a_data_root_move_warns_with_the_old_ones_size_serves_and_deletes_nothing(served, tmp_path):
    tb, rig = served
    moved = with_data_root(tb, tmp_path / "moved.py", "/srv/docker")
    results, stderr = pyinfra_run(moved, REPO / "deploy" / "dual.py")
    assert not errored(results, "rig1"), why(results, stderr)
    (found,) = MOVED.findall(stderr)
    assert found[:2] == ("/srv/docker", "/var/lib/docker") and float(found[2]) > 0, found
    assert docker_root(rig) == "/srv/docker" and serving(rig)
    assert rig.run("test -d /var/lib/docker/image").returncode == 0  # the old data-root, left as it was

    status = subprocess.run(
        [PYINFRA.replace("pyinfra", "rigforge"), "status", str(moved)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert re.search(
        r"rig1: note: /etc/docker/daemon\.json sets Docker's data-root to /srv/docker; /var/lib/docker, an earlier "
        r"one that Docker no longer uses, holds [0-9.]+ (MB|GB);",
        status.stdout,
    ), status.stdout[-4000:] + status.stderr[-4000:]

    back = inventory_with(
        tb, tmp_path / "back.py", {"rig1": {"docker_daemon_options": {"data-root": "/var/lib/docker"}}}
    )
    results, stderr = pyinfra_run(back, REPO / "deploy" / "dual.py")
    assert not errored(results, "rig1"), why(results, stderr)
    (found,) = MOVED.findall(stderr)
    assert found[:2] == ("/var/lib/docker", "/srv/docker"), found
    assert docker_root(rig) == "/var/lib/docker" and serving(rig)
    assert rig.run("test -d /srv/docker/image").returncode == 0
