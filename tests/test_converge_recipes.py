"""Tier 4: recipe-repo slugs end to end on a fresh testbed rig, over real SSH as a sudo user.

With RIGFORGE_RECIPES pointing at the club-3090 reference (copied into the testbed's local git remote; the
directory itself is never modified), deploy/site.py converges a rig with `rigforge_variant: vllm/dual`: the rig
checks out the recipe repo at the locked commit and runs the recipe's own compose file with its host override.
The second run changes nothing; switching to vllm/qwen-27b-dual-max fetches only the new weights and leaves one
enabled instance; switching back to the seed's dual-turbo works. No systemd runs in a chroot: units are installed,
verified and enabled, not started (rigforge_manage_services=False on the testbed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import REPO, changed, inventory_with, pyinfra_run
from test_recipes import REFERENCE

pytestmark = pytest.mark.testbed
SITE = REPO / "deploy" / "site.py"


def enabled_units(rig) -> list[str]:
    out = rig.run("ls /etc/systemd/system/multi-user.target.wants/ | grep '^rigforge-vllm@' || true").stdout
    return out.split()


def rigforge_cmd(cmd: str, inventory, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rigforge.cli", cmd, str(inventory), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def converge(tb, tmp_path_factory, variant: str):
    inv = inventory_with(tb, tmp_path_factory.mktemp("inv") / "inv.py", {"rig1": {"rigforge_variant": variant}})
    return pyinfra_run(inv, SITE)


@pytest.fixture(scope="module")
def runs(testbed_factory, tmp_path_factory):
    from rigforge.testbed import RigSpec

    saved = os.environ.get("RIGFORGE_RECIPES")
    os.environ["RIGFORGE_RECIPES"] = str(REFERENCE)  # testbed up builds its recipes remote from it; deploys read it
    try:
        tb = testbed_factory([RigSpec()], name="recipes")
        out = {"tb": tb}
        for step, variant in (("first", "vllm/dual"), ("second", "vllm/dual"), ("max", "vllm/qwen-27b-dual-max")):
            out[step] = converge(tb, tmp_path_factory, variant)
            out[f"{step}_units"] = enabled_units(tb.rig("rig1"))
            out[f"{step}_manifest"] = json.loads(tb.rig("rig1").run("cat /etc/rigforge/rig.json").stdout or "{}")
            if step == "max":
                extra = {"rig1": {"rigforge_variant": variant}}
                inv = inventory_with(tb, tmp_path_factory.mktemp("inv") / "inv.py", extra)
                out["verify"] = rigforge_cmd("verify", inv, "--json")
                out["status"] = rigforge_cmd("status", inv, "--json")
        knobs = {"rigforge_variant": "vllm/dual", "serving_api_key": "k1", "serving_extra_args": ["--x"]}
        inv = inventory_with(tb, tmp_path_factory.mktemp("inv") / "inv.py", {"rig1": knobs})
        out["unsupported"] = pyinfra_run(inv, SITE)
        out["back"] = converge(tb, tmp_path_factory, "dual-turbo")
        out["back_units"] = enabled_units(tb.rig("rig1"))
        yield out
    finally:
        if saved is None:
            os.environ.pop("RIGFORGE_RECIPES", None)
        else:
            os.environ["RIGFORGE_RECIPES"] = saved


def test_site_converges_a_fresh_rig_with_vllm_dual(runs):
    tb = runs["tb"]
    (results, err) = runs["first"]
    assert results["failed_hosts"] == [] and results["totals"]["error"] == 0, err[-6000:]
    assert runs["first_units"] == ["rigforge-vllm@vllm-dual.service"]
    manifest = runs["first_manifest"]
    assert manifest["recipe"] == "vllm/dual" and manifest["variant"] == "vllm-dual" and manifest["port"] == 8010
    assert manifest["image"] == "vllm/vllm-openai:v0.27.1"  # the lock's image (tag: no registry, no digest here)
    assert manifest["git"] == {"recipes": tb.git_commits["recipes"][-1]}


def test_the_rig_runs_the_recipe_file_from_its_own_checkout(runs):
    rig = runs["tb"].rig("rig1")
    upstream = "models/qwen3.6-27b/vllm/compose/dual/autoround-int4/fp8-mtp.yml"
    local = rig.run(f"sha256sum /opt/rigforge/src/recipes/{upstream}").stdout.split()[0]
    assert local == __import__("hashlib").sha256((REFERENCE / upstream).read_bytes()).hexdigest()  # verbatim
    assert rig.run("git -C /opt/rigforge/src/recipes status --porcelain").stdout == ""
    assert rig.run("stat -c '%a %U' /opt/rigforge/serve/vllm-dual/.env").stdout.split() == ["600", "root"]


def test_second_run_changes_nothing(runs):
    results, err = runs["second"]
    assert results["failed_hosts"] == [], err[-4000:]
    assert changed(results) == [], f"second run changed: {changed(results)}"


def test_switch_to_dual_max_fetches_only_the_new_weights_and_leaves_one_instance(runs):
    tb = runs["tb"]
    results, err = runs["max"]
    assert results["failed_hosts"] == [], err[-6000:]
    weights = [op for op in changed(results) if "| Weights " in op]
    assert len(weights) == 1 and "Qwen/Qwen3.6-27B-FP8" in weights[0] and "qwen3.6-27b-fp8" in weights[0]
    assert not any("| Check out" in op for op in changed(results))  # same recipe commit
    assert runs["max_units"] == ["rigforge-vllm@vllm-qwen-27b-dual-max.service"]
    assert runs["max_manifest"]["recipe"] == "vllm/qwen-27b-dual-max" and runs["max_manifest"]["port"] == 8013
    models = tb.rig("rig1").run("ls /opt/rigforge/models").stdout.split()
    assert models == ["qwen3.6-27b-autoround-int4", "qwen3.6-27b-fp8"]
    config = tb.rig("rig1").run("cd /opt/rigforge/serve/vllm-qwen-27b-dual-max && docker compose config --format json")
    assert config.returncode == 0, config.stderr
    svc = json.loads(config.stdout)["services"]["vllm-qwen36-27b-dual"]
    assert svc["command"][:2] == ["--model", "/root/.cache/huggingface/qwen3.6-27b-fp8"] and svc["restart"] == "no"


def test_every_unsupported_setting_is_refused_in_one_message_by_its_host_data_key(runs):
    results, err = runs["unsupported"]
    assert results["failed_hosts"] in ("all", ["rig1"]), err[-4000:]
    assert changed(results) == [] and err.count("rigforge refused on rig1:") == 1, err[-4000:]
    assert "vllm/dual: serving_extra_args, serving_api_key are not exposed by the recipe's compose file" in err


def test_switching_back_to_the_seed_dual_turbo_works(runs):
    results, err = runs["back"]
    assert results["failed_hosts"] == [] and results["totals"]["error"] == 0, err[-6000:]
    assert runs["back_units"] == ["rigforge-vllm@dual-turbo.service"]


def test_status_and_verify_know_a_recipe_slug(runs):
    verify = runs["verify"]
    report = json.loads(verify.stdout)
    checks = {c["name"]: c for c in report["hosts"]["rig1"]["checks"]}
    for name in ("manifest present", "sources at locked SHAs", "weights stamp valid", "unit enabled"):
        assert checks[name]["status"] == "pass", checks[name]
    assert "vllm-qwen-27b-dual-max" in checks["manifest present"]["detail"]
    assert "recipes@" in checks["sources at locked SHAs"]["detail"]
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-2000:]
    (row,) = json.loads(runs["status"].stdout)
    assert row["variant"] == "vllm-qwen-27b-dual-max", row
