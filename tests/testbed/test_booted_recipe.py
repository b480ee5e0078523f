"""A live recipe on a booted rig: `rigforge_variant: vllm/dual` from the club-3090 reference (RIGFORGE_RECIPES),
its own compose file and entrypoint run by the rig's systemd and Docker engine from the lock's recipe image
(vllm/vllm-openai:v0.27.1, the booted tier's stand-in image pushed to the upstream stand-in under that tag, run at
the digest the testbed lock pins), through the same health gate.

Marked `booted` and `testbed`; skipped with the reason when this machine cannot boot rigs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import requests
from support import REPO, changed, errored, inventory_with, pyinfra_run
from test_booted import models, sh, started_at, unit
from test_recipes import REFERENCE

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
UNIT, CONTAINER, PORT = "rigforge-vllm@vllm-dual.service", "vllm-qwen36-27b-dual", 8010


@pytest.fixture(scope="module")
def booted_recipes(testbed_factory):
    missing = [tool for tool in ("systemd-nspawn", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"cannot boot rigs: {', '.join(missing)} not found (apt-get install systemd-container iproute2)")
    saved = os.environ.get("RIGFORGE_RECIPES")
    os.environ["RIGFORGE_RECIPES"] = str(REFERENCE)  # testbed up builds its recipes remote and images from it
    try:
        tb = testbed_factory(name="booted-recipe", booted=True)
        yield tb
        testbed_factory.release(tb)
    finally:
        if saved is None:
            os.environ.pop("RIGFORGE_RECIPES", None)
        else:
            os.environ["RIGFORGE_RECIPES"] = saved


def test_vllm_dual_converges_passes_the_gate_serves_and_a_second_run_changes_nothing(
    booted_recipes, tmp_path, testbed_report
):
    tb, rig = booted_recipes, booted_recipes.rig("rig1")
    inv = inventory_with(tb, tmp_path / "inventory.py", {"rig1": {"rigforge_variant": "vllm/dual"}})
    t0 = time.monotonic()
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py")
    testbed_report.append(f"booted: first vllm/dual converge {time.monotonic() - t0:.0f}s")
    assert not errored(results, "rig1"), stderr[-6000:]
    done = changed(results, "rig1")
    assert any(op.endswith(f"Run {UNIT}") for op in done), done
    assert any("Health gate" in op for op in done), done

    assert unit(rig, UNIT) == ("enabled", "active")
    image = "vllm/vllm-openai:v0.27.1"
    assert sh(rig, f"docker inspect -f '{{{{.Config.Image}}}} {{{{.State.Status}}}}' {CONTAINER}") == (
        f"{image}@{tb.upstream_digests[image]} running"  # the digest the testbed lock pins
    )
    assert models(rig, PORT) == ["qwen3.6-27b"]  # the recipe's --served-model-name, on its published port
    with rig.forward(PORT) as port:  # and from the controller, through the rig's published port
        listed = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == ["qwen3.6-27b"]
    # the recipe's own entrypoint ran in the container: its vendored patch applied, then `vllm serve`
    log = sh(rig, f"docker logs {CONTAINER} 2>&1")
    assert "[pr48375] applied" in log and "[spec] drafter ON - mtp n=3" in log, log
    assert "serving qwen3.6-27b from /root/.cache/huggingface/qwen3.6-27b-autoround-int4" in log, log

    before = started_at(rig, CONTAINER)
    t0 = time.monotonic()
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py")
    testbed_report.append(f"booted: second vllm/dual run {time.monotonic() - t0:.0f}s")
    assert not errored(results, "rig1"), stderr[-4000:]
    assert changed(results, "rig1") == []
    assert started_at(rig, CONTAINER) == before

    # a recipe slug on a digest-pinned lock: status shows no pin drift and status and verify agree on every check
    def as_json(command: str) -> subprocess.CompletedProcess:
        """`rigforge COMMAND INVENTORY --json`, reading the recipe slugs from the reference checkout."""
        return subprocess.run(
            [sys.executable, "-m", "rigforge.cli", command, str(inv), "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "RIGFORGE_RECIPES": str(REFERENCE)},
        )

    status = as_json("status")
    verify = as_json("verify")
    row = json.loads(status.stdout)[0]
    assert row["pin_drift"] == [], row["pin_drift"]
    checks = {c["name"]: c["status"] for c in row["checks"]}
    verified = {c["name"]: c["status"] for c in json.loads(verify.stdout)["hosts"]["rig1"]["checks"]}
    assert checks == {n: s for n, s in verified.items() if n in checks}
    assert set(checks.values()) == {"pass"}, checks


def test_a_recipe_bump_is_one_lock_command_and_a_slug_of_b_converges_on_bs_image_by_digest(
    booted_recipes, tmp_path, testbed_report
):
    """The testbed lock is at recipe commit A. `rigforge lock --recipes B --inventory INV --out FILE` (the inventory
    deploys B's new slug) prints the diff: B's engine image resolved to its digest by the upstream stand-in and the
    new slug's weights; the lock in use is untouched. A deploy of the new slug from that lock converges, runs B's
    image by digest, and a re-run changes nothing."""
    from rigforge.testbed.recipe_commits import B_IMAGE, NEW_REPO, NEW_SLUG

    tb, rig = booted_recipes, booted_recipes.rig("rig1")
    tags = tb.services["git"]["recipes"]["tags"]
    candidate, before = tmp_path / "lock-b.yaml", tb.lock.read_text()
    inv = inventory_with(
        tb, tmp_path / "inventory.py", {"rig1": {"rigforge_variant": NEW_SLUG, "rigforge_lock": str(candidate)}}
    )
    env = {
        **os.environ,
        "RIGFORGE_RECIPES": "",
        "RIGFORGE_REGISTRY": tb.upstream_url,
        "REQUESTS_CA_BUNDLE": str(tb.upstream_ca),
        "HF_ENDPOINT": tb.hf_endpoint,
    }
    cmd = [
        sys.executable,
        "-m",
        "rigforge.cli",
        "lock",
        "--lock",
        str(tb.lock),
        "--recipes",
        "B",
        "--inventory",
        str(inv),
        "--out",
        str(candidate),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr
    digest = tb.upstream_digests[B_IMAGE]
    assert f"+    commit: {tags['B']}" in res.stdout and f"+    ref: {B_IMAGE}" in res.stdout, res.stdout
    assert f"+    digest: {digest}" in res.stdout and f"+    repo: {NEW_REPO}" in res.stdout, res.stdout
    assert tb.lock.read_text() == before

    t0 = time.monotonic()
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py", env={"RIGFORGE_RECIPES": ""})
    testbed_report.append(f"booted: a slug of recipe commit B converged in {time.monotonic() - t0:.0f}s")
    assert not errored(results, "rig1"), stderr[-6000:]
    unit_b = "rigforge-vllm@vllm-qwen-27b-dual-v2.service"
    assert unit(rig, unit_b) == ("enabled", "active")
    assert sh(rig, f"docker inspect -f '{{{{.Config.Image}}}}' {CONTAINER}") == f"{B_IMAGE}@{digest}"
    env_file = sh(rig, "cat /opt/rigforge/serve/vllm-qwen-27b-dual-v2/.env")
    assert f"VLLM_IMAGE={B_IMAGE}@{digest}" in env_file  # set the recipe's way: the compose file is its own
    assert models(rig, PORT) == ["qwen3.6-27b"]
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py", env={"RIGFORGE_RECIPES": ""})
    assert not errored(results, "rig1") and changed(results, "rig1") == [], (changed(results, "rig1"), stderr[-3000:])
