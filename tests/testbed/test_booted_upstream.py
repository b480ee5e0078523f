"""The booted testbed's upstream registry stand-in (rigforge/testbed/upstream.py): a real Distribution registry on
the controller playing Docker Hub. A booted rig pulls the locked digest from it as it would from Docker Hub
(registry-1.docker.io through the rig's relay, the testbed CA in its system trust store), the relay's throttle
slows a pull, `rigforge testbed upstream-delete` makes an image answer 404, and `up` with one more rig adds it and
keeps the running one (here with --fleet-registry and no gateway host: rig1 is the registry host).

One booted rig is shared by the tests of this module, in order. Marked `booted` and `testbed`.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time

import pytest
import yaml

pytestmark = [pytest.mark.testbed, pytest.mark.booted]


@pytest.fixture(scope="module")
def tb(testbed_factory):
    missing = [tool for tool in ("systemd-nspawn", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"cannot boot rigs: {', '.join(missing)} not found (apt-get install systemd-container iproute2)")
    return testbed_factory(name="upstream", booted=True)


def sh(rig, cmd: str) -> str:
    res = rig.run(cmd)
    assert res.returncode == 0, f"{cmd}: rc={res.returncode}\n{res.stdout}{res.stderr}"
    return res.stdout.strip()


def timed_pull(rig, ref: str) -> float:
    t0 = time.monotonic()
    sh(rig, f"docker pull -q {ref}")
    return time.monotonic() - t0


def rigforge_testbed(*argv: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "rigforge.cli", "testbed", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_rig_pulls_the_locked_digest_from_the_stand_in_as_from_docker_hub(tb, testbed_report):
    from rigforge.testbed.rig import IMAGE_REF
    from rigforge.testbed.upstream import HOSTNAME, HOSTNAMES, RIG_ADDRESS

    rig = tb.rig("rig1")
    digest = yaml.safe_load(tb.lock.read_text())["image"]["digest"]
    assert digest == tb.upstream_digests[IMAGE_REF] and digest.startswith("sha256:"), digest
    assert tb.upstream_url.startswith("https://127.0.0.1:") and tb.upstream_ca.exists()
    assert sh(rig, f"getent hosts {HOSTNAME}").split() == [RIG_ADDRESS, *HOSTNAMES]  # one /etc/hosts line
    assert sh(rig, f"curl -sS -o /dev/null -w '%{{http_code}}' https://{HOSTNAME}/v2/") == "200"  # system roots
    assert sh(rig, "docker image ls -q") == "", "nothing is pre-loaded: the deploy pulls"

    since = tb.upstream_log_size()
    took = timed_pull(rig, f"{IMAGE_REF}@{digest}")
    testbed_report.append(f"upstream: pull of the stand-in image {took:.1f}s")
    repo_digests = json.loads(sh(rig, f"docker image inspect -f '{{{{json .RepoDigests}}}}' {IMAGE_REF}@{digest}"))
    assert repo_digests == [f"vllm/vllm-openai@{digest}"], repo_digests
    layers = tb.upstream["layers"]
    assert len(layers) >= 4
    assert tb.upstream_blob_gets(since) == len(layers) + 1  # every layer and the config, once
    assert tb.upstream_blob_gets(since, name="library/other") == 0
    assert sh(rig, f"docker run --rm --entrypoint python3 {IMAGE_REF}@{digest} -c 'print(6 * 7)'") == "42"


def test_the_throttle_slows_a_pull_and_0_turns_it_off(tb, testbed_report):
    from rigforge.testbed.rig import IMAGE_REF

    rig = tb.rig("rig1")
    ref = f"{IMAGE_REF}@{tb.upstream_digests[IMAGE_REF]}"
    size = sum(layer["size"] for layer in tb.upstream["layers"])
    sh(rig, f"docker rmi -f {ref} >/dev/null")
    fast = timed_pull(rig, ref)
    sh(rig, f"docker rmi -f {ref} >/dev/null")
    rate = size // 16  # about 16 s for the whole image
    throttled_at_least = 0.7 * size / rate  # what no throttled pull can beat, however idle the machine
    res = rigforge_testbed("upstream-throttle", str(rate), "--dir", str(tb.shared))
    assert res.returncode == 0 and f"upstream throttle: {rate} bytes/s per host" in res.stderr, res.stderr
    try:
        slow = timed_pull(rig, ref)
    finally:
        res = rigforge_testbed("upstream-throttle", "0", "--dir", str(tb.shared))
    assert res.returncode == 0 and "upstream throttle: off" in res.stderr, res.stderr
    testbed_report.append(f"upstream: pull {fast:.1f}s, throttled to {rate >> 10} KiB/s {slow:.1f}s")
    assert fast < throttled_at_least <= slow, (fast, slow, size, rate)
    sh(rig, f"docker rmi -f {ref} >/dev/null")
    assert timed_pull(rig, ref) < throttled_at_least, "throttle off: faster than any throttled pull"


def test_upstream_delete_makes_tag_and_digest_answer_404(tb):
    from rigforge.testbed.rig import IMAGE_REF
    from rigforge.testbed.upstream import Client

    rig = tb.rig("rig1")
    ref = "vllm/vllm-openai:rigforge-testbed-deleted"  # a tag of its own: other modules pull IMAGE_REF
    digest = tb.upstream_push(ref, {"CUDA_VERSION": "13.0.0"})
    client = Client(tb.upstream_url, tb.upstream_ca)
    assert client.status(ref) == 200 and digest != tb.upstream_digests[IMAGE_REF]
    res = rigforge_testbed("upstream-delete", ref, "--dir", str(tb.shared))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"upstream-delete: deleted {ref} ({digest}) from {tb.upstream_url}", res.stdout
    assert client.status(ref) == 404 and client.status(f"vllm/vllm-openai@{digest}") == 404
    gone = rig.run(f"docker pull {ref}")
    assert gone.returncode != 0 and "not found" in gone.stderr, gone.stderr
    assert client.status(IMAGE_REF) == 200  # the others stay
    again = rigforge_testbed("upstream-delete", ref, "--dir", str(tb.shared))
    assert again.returncode == 1 and "is not in the upstream stand-in" in again.stderr, again.stderr


def test_up_with_one_more_rig_adds_it_and_keeps_the_running_one(tb, testbed_report):
    """With --fleet-registry and no gateway host: rig1 becomes the registry host, rig2 and the controller reach
    it at the testbed's registry_address (checked with a stand-in listener on rig1's port 5000)."""
    from rigforge.testbed import RigSpec, up
    from rigforge.testbed.booted import REGISTRY_PORT, init_pid
    from rigforge.testbed.upstream import HOSTNAME

    rig1 = tb.rig("rig1")
    pid = init_pid(rig1.dir)
    sh(rig1, "touch /run/rigforge-still-running")  # /run is a tmpfs: a reboot forgets it
    t0 = time.monotonic()
    bigger = up(tb.dir, [RigSpec(), RigSpec()], shared=tb.shared, booted=True, fleet_registry=True)
    testbed_report.append(f"upstream: up with a second rig {time.monotonic() - t0:.1f}s")
    assert [r.name for r in bigger.rigs] == ["rig1", "rig2"]
    assert init_pid(rig1.dir) == pid and sh(rig1, "ls /run/rigforge-still-running")
    rig2 = bigger.rig("rig2")
    assert sh(rig2, "docker image ls -q") == ""
    assert sh(rig2, f"curl -sS -o /dev/null -w '%{{http_code}}' https://{HOSTNAME}/v2/") == "200"

    address = bigger.registry_address
    assert bigger.registry_host.name == "rig1" and address.startswith("127.2.")
    inventory = bigger.inventory.read_text()
    assert "registry = ['rig1']" in inventory and f"'registry_address': '{address}'" in inventory
    server = sh(rig1, f"cd /tmp && setsid python3 -m http.server {REGISTRY_PORT} >/dev/null 2>&1 </dev/null & echo $!")
    try:
        url = f"http://{address}:{REGISTRY_PORT}/"
        curl = f"curl -sS --retry 10 --retry-delay 1 --retry-all-errors -o /dev/null -w '%{{http_code}}' {url}"
        assert sh(rig2, curl) == "200"  # rig2 -> rig1's namespace
        with socket.create_connection((address, REGISTRY_PORT), timeout=10) as conn:  # the controller -> rig1
            conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert conn.recv(64).startswith(b"HTTP/1.0 200"), "controller -> registry host"
    finally:
        rig1.run(f"kill {server}")
