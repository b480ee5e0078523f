"""The testbed's env.sh (issue 47): the stand-ins' endpoints that `rigforge lock` needs against the testbed's lock,
written by `testbed up` and read by a shell, in the variables rigforge/cli/lock.py reads (no rig needed here)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from rigforge.cli import lock
from rigforge.testbed import core

SERVICES = {"apt_port": 18721, "hf_port": 18722, "git_port": 18723, "git": {}, "hf": {}}
UPSTREAM = {"url": "https://127.0.0.1:18724", "ca": "/var/lib/rigforge-testbed/upstream/ca.crt"}


def sourced(tb: core.Testbed) -> dict[str, str]:
    """The variables a shell has after `. DIR/env.sh`, from an empty environment."""
    out = subprocess.run(["bash", "-c", f". {tb.env_file} && env -0"], capture_output=True, text=True, env={})
    assert out.returncode == 0, out.stderr
    pairs = (item.partition("=") for item in out.stdout.split("\0") if item)
    return {name: value for name, _, value in pairs if name not in ("PWD", "SHLVL", "_")}


@pytest.mark.parametrize("booted", [False, True])
def test_env_sh_points_rigforge_lock_at_the_stand_ins(tmp_path, monkeypatch, booted):
    services = {**SERVICES, **({"upstream": UPSTREAM} if booted else {})}
    tb = core.Testbed(dir=tmp_path, shared=tmp_path, rigs=[], services=services)
    core._write_env(tb)
    env = sourced(tb)
    want = {
        "HF_ENDPOINT": "http://127.0.0.1:18722",
        "RIGFORGE_HF_TOKEN": tb.hf_token,
        "RIGFORGE_TOOLKIT_REPO": "http://127.0.0.1:18721/libnvidia-container/",
    }
    if booted:
        want |= {"RIGFORGE_REGISTRY": UPSTREAM["url"], "REQUESTS_CA_BUNDLE": UPSTREAM["ca"]}
    assert env == want
    text = tb.env_file.read_text()
    assert ("only `up --booted` runs one" in text) is not booted  # no Docker Hub stand-in: said so
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = argparse.Namespace(fleet_registry=None, fleet_ca=None)
    endpoint, token, registry, _ = lock._endpoints(args)  # what `rigforge lock` then asks
    assert (endpoint, token, registry) == (want["HF_ENDPOINT"], tb.hf_token, want.get("RIGFORGE_REGISTRY"))


def test_the_testbed_inventory_takes_rigforges_default_docker_source_unless_asked(tmp_path):
    services = {**SERVICES, "apt_fingerprint": "F" * 40}
    rig = argparse.Namespace(ssh_port=2201, user="rigforge", key=Path("/k"), booted=False)
    default = core.host_data(core.Testbed(dir=tmp_path, shared=tmp_path, rigs=[], services=services), rig)
    assert "docker_source" not in default  # rigforge's default: Docker's repository, here the testbed's stand-in
    assert default["docker_repo_url"] == "http://127.0.0.1:18721/docker"
    assert default["docker_repo_key_fingerprint"] == "F" * 40
    distro = core.Testbed(dir=tmp_path, shared=tmp_path, rigs=[], services=services, docker_source="distro")
    data = core.host_data(distro, rig)
    assert data["docker_source"] == "distro" and "docker_repo_url" not in data
    slug = core.Testbed(dir=tmp_path, shared=tmp_path, rigs=[], services=services, variant="vllm/dual")
    assert core.host_data(slug, rig)["rigforge_variant"] == "vllm/dual"


def test_testbed_up_takes_the_docker_source_and_the_variant():
    from rigforge.testbed import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    default = parser.parse_args(["up"])
    assert (default.docker_source, default.variant) == ("docker", None)
    given = parser.parse_args(["up", "--docker-source", "distro", "--variant", "vllm/dual"])
    assert (given.docker_source, given.variant) == ("distro", "vllm/dual")
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--docker-source", "snap"])
