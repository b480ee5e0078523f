"""The fleet registry for real: a booted rig and a booted gateway host that serves the registry too
(`testbed up --booted --gateway --fleet-registry`: the gateway host is also in the inventory group `registry`).
After the deploy, Debian's docker-registry runs under the gateway host's systemd and answers the Registry API
over HTTPS to a client that trusts only the CA rigforge made on the controller (the rig's copy in Docker's
certs.d); the CA key never leaves the controller; a second run changes nothing.
"""

from __future__ import annotations

import stat
import time

import pytest
from support import REPO, changed, pyinfra_run

pytestmark = [pytest.mark.testbed, pytest.mark.booted]


@pytest.fixture(scope="module")
def fleet(testbed_factory, testbed_report):
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec()], name="registry", booted=True, gateway=True, registry=True)
    t0 = time.monotonic()
    results, err = pyinfra_run(tb.inventory, REPO / "deploy" / "dual_turbo.py")
    testbed_report.append(f"registry: 1 rig + gateway/registry host converged in {time.monotonic() - t0:.0f}s")
    assert results["failed_hosts"] == [] and results["totals"]["error"] == 0, err[-6000:]
    return tb


def test_the_registry_answers_over_tls_to_the_fleet_ca_only_and_a_second_run_changes_nothing(fleet):
    import requests

    from rigforge.testbed.booted import REGISTRY_PORT

    rig, gw = fleet.rigs[0], fleet.gateway
    endpoint = f"{fleet.registry_address}:{REGISTRY_PORT}"
    ca = f"/etc/docker/certs.d/{endpoint}/ca.crt"
    curl = f"curl -sS --max-time 20 -o /dev/null -w '%{{http_code}}' --cacert {ca} https://{endpoint}/v2/"
    answer = rig.run(curl.replace("curl ", "curl --retry 10 --retry-delay 1 --retry-all-errors ", 1))
    assert (answer.returncode, answer.stdout) == (0, "200"), answer.stderr
    untrusted = rig.run(f"curl -sS --max-time 20 -o /dev/null https://{endpoint}/v2/")
    assert untrusted.returncode == 60, untrusted  # the system's CAs do not vouch for it: only the fleet CA does
    plain = rig.run(f"curl -sS --max-time 20 http://{endpoint}/v2/")
    assert "Client sent an HTTP request to an HTTPS server" in plain.stdout, plain  # TLS only, by default

    ca_dir = fleet.dir / "registry-ca"
    assert rig.run(f"cat {ca}").stdout == (ca_dir / "ca.crt").read_text()
    session = requests.Session()
    session.trust_env = False  # no CA bundle or proxy from the environment: the fleet CA only
    assert session.get(f"https://{endpoint}/v2/", verify=str(ca_dir / "ca.crt"), timeout=20).status_code == 200
    # ^ the controller reaches it at the same address as the rigs
    assert stat.S_IMODE((ca_dir / "ca.key").stat().st_mode) == 0o600
    key = gw.run("stat -c '%a %U' /etc/docker/registry/tls/registry.key").stdout.split()
    assert key == ["600", "docker-registry"]
    assert gw.run("grep -rl 'PRIVATE KEY' /etc/docker /etc/rigforge 2>/dev/null").stdout.split() == [
        "/etc/docker/registry/tls/registry.key"
    ]  # the registry's own key only: the CA key stays on the controller
    assert gw.run("systemctl is-active docker-registry.service").stdout.strip() == "active"

    second, err = pyinfra_run(fleet.inventory, REPO / "deploy" / "dual_turbo.py")
    assert second["failed_hosts"] == [] and changed(second) == [], changed(second)
    assert rig.run(curl).stdout == "200"
