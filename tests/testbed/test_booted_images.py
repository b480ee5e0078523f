"""`rigforge images save` then `rigforge images load` on a fresh booted rig with no registry (issue 22): the rig's
Docker then holds the locked digest, `docker image inspect REF@sha256:...` resolves (the RepoDigests Docker's own
`docker load` would drop, moby#22011), daemon.json is byte for byte the user's again, no temporary registry or
mirror is left, and a second load changes nothing.

The images come from a Distribution registry on the controller's 127.0.0.1 (tests/registry_support.py), which the
rig cannot reach: only the saved directory carries them. (The testbed's upstream registry stand-in, when it lands,
can replace it for the locked serving image itself.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from registry_support import push_image, running_registry
from support import REPO, changed, pyinfra_run

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
REF = "vllm/vllm-openai:v0.27.1"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A lock naming two images (an OCI index with an attestation, and a plain manifest of an official image),
    saved into a directory; (dir, {ref: digest})."""
    tmp = tmp_path_factory.mktemp("images")
    with running_registry(tmp / "registry") as reg:
        index = push_image(reg, "vllm/vllm-openai", "v0.27.1", index=True, oci=True, layers=4, seed="booted ")
        plain = push_image(reg, "busybox", "1.37", seed="booted plain ")
        digests = {REF: index["digest"], "busybox:1.37": plain["digest"]}
        lock = tmp / "lock.yaml"
        lock.write_text(
            json.dumps(
                {
                    "version": 1,
                    "image": {"ref": REF, "digest": index["digest"]},
                    "images": {"bb": {"ref": "busybox:1.37", "digest": plain["digest"]}},
                }
            )
        )
        out = tmp / "saved"
        cmd = [
            sys.executable,
            "-m",
            "rigforge.cli",
            "images",
            "save",
            str(out),
            "--lock",
            str(lock),
            "--registry",
            reg.url,
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
    return out, digests


@pytest.fixture(scope="module")
def rig(testbed_factory, testbed_report):
    from rigforge.testbed import RigSpec

    t0 = time.monotonic()
    tb = testbed_factory([RigSpec()], name="images", booted=True)
    testbed_report.append(f"images: a fresh booted rig up in {time.monotonic() - t0:.0f}s")
    yield tb
    testbed_factory.release(tb)


def test_save_then_load_on_a_fresh_rig_with_no_registry_gives_the_locked_digest(rig, saved, testbed_report):
    out, digests = saved
    host = rig.rigs[0]
    daemon_before = host.run("sha256sum /etc/docker/daemon.json").stdout
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "rigforge.cli", "images", "load", str(out), str(rig.inventory)]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    testbed_report.append(f"images: load of 2 images onto a fresh rig in {time.monotonic() - t0:.0f}s")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert "docker pulls Docker Hub images through http://127.0.0.1:" in res.stdout + res.stderr
    for ref, digest in digests.items():
        name = ref.rsplit(":", 1)[0]
        inspect = host.run(f"docker image inspect {name}@{digest} --format '{{{{json .RepoDigests}}}}'")
        assert inspect.returncode == 0 and json.loads(inspect.stdout) == [f"{name}@{digest}"], inspect
    assert host.run("sha256sum /etc/docker/daemon.json").stdout == daemon_before  # the user's file, byte for byte
    assert host.run("docker info --format '{{json .RegistryConfig.Mirrors}}'").stdout.strip() in ("null", "[]")
    assert host.run("pgrep -f '[d]ocker-registry serve /opt/rigforge'").returncode == 1  # the temporary one is gone
    assert host.run("ls -A /opt/rigforge/images").stdout.split() == ["load_images.sh"]  # work dir and layout gone

    second, err = pyinfra_run(
        rig.inventory, REPO / "deploy" / "images_load.py", "--data", f"rigforge_images_dir={Path(out).resolve()}"
    )
    assert second["failed_hosts"] == [] and changed(second) == [], changed(second)
