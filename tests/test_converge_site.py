"""Tier 4: the user's entry points end to end on a 3-rig testbed, over real SSH as a sudo user.

deploy/site.py converges three rigs with different variants in parallel; a second run changes nothing;
switching a rig to another variant leaves exactly one enabled vLLM instance and the variant's assets; a compose
file that `docker compose config` rejects never replaces the working one; an unknown variant fails only its host,
before anything on it changes. No systemd runs in a chroot, so units are installed, verified and enabled but not
started, and the health gate is off (rigforge_manage_services=False on the testbed).
"""

from __future__ import annotations

import json

import pytest
from support import REPO, changed, errored, inventory_with, pyinfra_run

pytestmark = pytest.mark.testbed
VARIANTS = {"rig1": "dual-turbo", "rig2": "dual", "rig3": "carnice-bf16mtp"}


def enabled_units(rig) -> list[str]:
    out = rig.run("ls /etc/systemd/system/multi-user.target.wants/ | grep '^rigforge-vllm@' || true").stdout
    return out.split()


@pytest.fixture(scope="module")
def fleet(testbed_factory, tmp_path_factory):
    from rigforge.testbed import RigSpec

    tb = testbed_factory([RigSpec(), RigSpec(), RigSpec()], name="site")
    inv = inventory_with(
        tb, tmp_path_factory.mktemp("inv") / "fleet.py", {name: {"rigforge_variant": v} for name, v in VARIANTS.items()}
    )
    first, err1 = pyinfra_run(inv, REPO / "deploy" / "site.py")
    second, err2 = pyinfra_run(inv, REPO / "deploy" / "site.py")
    return tb, inv, first, err1, second, err2


def test_site_converges_three_rigs_with_their_variants(fleet):
    tb, _, first, err, _, _ = fleet
    assert first["failed_hosts"] == [] and first["totals"]["error"] == 0, err[-6000:]
    for name, variant in VARIANTS.items():
        rig = tb.rig(name)
        manifest = json.loads(rig.run("cat /etc/rigforge/rig.json").stdout)
        assert manifest["variant"] == variant
        assert len(manifest["gpus"]) == 2 and manifest["gpus"][0]["power_limit"] == 230
        assert enabled_units(rig) == [f"rigforge-vllm@{variant}.service"]
        compose = rig.run(f"cd /opt/rigforge/serve/{variant} && docker compose config --format json")
        assert compose.returncode == 0, compose.stderr


def test_second_run_changes_nothing(fleet):
    *_, second, err = fleet
    assert second["failed_hosts"] == [], err[-4000:]
    assert changed(second) == [], f"second run changed: {changed(second)}"


def test_env_file_is_root_only_and_not_in_compose(fleet):
    tb, *_ = fleet
    rig = tb.rig("rig1")
    assert rig.run("stat -c '%a %U' /opt/rigforge/serve/dual-turbo/.env").stdout.split() == ["600", "root"]
    assert "HF_TOKEN" not in rig.run("grep -v '^#' /opt/rigforge/serve/dual-turbo/docker-compose.yml").stdout.replace(
        "${HF_TOKEN:-}", ""
    )


def test_only_needed_assets_and_sources_per_variant(fleet):
    tb, *_ = fleet
    models = {name: tb.rig(name).run("ls /opt/rigforge/models").stdout.split() for name in VARIANTS}
    assert models["rig2"] == ["qwen3.6-27b-autoround-int4"]
    assert models["rig3"] == ["carnice-v2-27b-int4-recipe-d-bf16mtp"]
    assert tb.rig("rig1").run("test -f /opt/rigforge/src/genesis/vllm/_genesis/patches/apply_all.py").returncode == 0
    assert tb.rig("rig2").run("test -e /opt/rigforge/src/genesis").returncode != 0  # dual is Genesis-less


def test_switching_a_rig_leaves_one_instance_and_the_right_assets(fleet, tmp_path):
    tb, _, *_ = fleet
    inv = inventory_with(tb, tmp_path / "switch.py", {"rig1": {"rigforge_variant": "dual-dflash"}})
    token = {"RIGFORGE_HF_TOKEN": tb.hf_token}  # the DFlash draft is gated (as MULTI_CARD.md says)
    results, err = pyinfra_run(inv, REPO / "deploy" / "site.py", "--limit", "rig1", env=token)
    assert results["failed_hosts"] == [], err[-6000:]
    assert tb.hf_token not in err
    rig = tb.rig("rig1")
    assert tb.hf_token not in rig.run("cat /var/log/* /opt/rigforge/serve/*/docker-compose.yml 2>/dev/null").stdout
    # sudo uploads pass through the SSH user's own 0700 dir, never a world-readable temp file, and are removed
    upload_dir = "/tmp/.rigforge-upload-rigadmin"
    assert rig.run(f"stat -c '%a %U' {upload_dir}").stdout.split() == ["700", "rigadmin"]
    assert rig.run(f"ls -A {upload_dir}").stdout == ""
    assert enabled_units(rig) == ["rigforge-vllm@dual-dflash.service"]
    assert sorted(rig.run("ls /opt/rigforge/models").stdout.split()) == [
        "qwen3.6-27b-autoround-int4",
        "qwen3.6-27b-dflash",
    ]
    assert json.loads(rig.run("cat /etc/rigforge/rig.json").stdout)["variant"] == "dual-dflash"
    again, _ = pyinfra_run(inv, REPO / "deploy" / "site.py", "--limit", "rig1", env=token)
    assert changed(again) == []


def test_stamped_gated_weights_reconverge_without_the_token(fleet, tmp_path):
    """rig1 serves dual-dflash (gated draft stamped): drift in its compose is repaired with no token on the
    controller; the token is in no file of the serve dir (it was only with the download)."""
    tb, *_ = fleet
    rig = tb.rig("rig1")
    inv = inventory_with(tb, tmp_path / "notoken.py", {"rig1": {"rigforge_variant": "dual-dflash"}})
    compose = "/opt/rigforge/serve/dual-dflash/docker-compose.yml"
    good = rig.run(f"sha256sum {compose}").stdout
    rig.run(f"sed -i 's/--max-num-seqs/--max-num-seqz/' {compose}", check=True)
    no_token = {"RIGFORGE_HF_TOKEN": "", "HF_TOKEN": ""}
    results, err = pyinfra_run(inv, REPO / "deploy" / "site.py", "--limit", "rig1", env=no_token)
    assert results["failed_hosts"] == [], err[-4000:]
    assert [n for n in changed(results) if "compose file and .env" in n], changed(results)
    assert rig.run(f"sha256sum {compose}").stdout == good
    assert (
        tb.hf_token not in rig.run("cat /opt/rigforge/serve/dual-dflash/.env /opt/rigforge/serve/dual-dflash/*").stdout
    )
    again, err = pyinfra_run(inv, REPO / "deploy" / "site.py", "--limit", "rig1", env=no_token)
    assert changed(again) == [], err[-3000:]


def test_compose_rejected_by_docker_compose_config_never_replaces_the_working_one(fleet, tmp_path):
    tb, *_ = fleet
    rig = tb.rig("rig2")
    before = rig.run("sha256sum /opt/rigforge/serve/dual/docker-compose.yml /opt/rigforge/serve/dual/.env").stdout
    inv = inventory_with(tb, tmp_path / "broken.py", {})
    results, err = pyinfra_run(inv, REPO / "tests" / "deploys" / "broken_compose.py", "--limit", "rig2")
    assert results["failed_hosts"] == "all"
    assert "Additional property shm_sise is not allowed" in err
    assert "rigforge: validation failed, /opt/rigforge/serve/dual left unchanged" in err
    after = rig.run("sha256sum /opt/rigforge/serve/dual/docker-compose.yml /opt/rigforge/serve/dual/.env").stdout
    assert after == before
    assert rig.run("test -e /opt/rigforge/serve/dual/.staging").returncode != 0


def test_unknown_variant_fails_only_that_host_before_any_change(fleet, tmp_path):
    tb, *_ = fleet
    snapshot = "find /etc /opt -xdev -printf '%p %s %m\\n' 2>/dev/null | sort; dpkg-query -W | sort"
    before = tb.rig("rig3").run(snapshot).stdout
    inv = inventory_with(
        tb,
        tmp_path / "bad.py",
        {
            "rig2": {"rigforge_variant": "dual"},
            "rig3": {"rigforge_variant": "dual-tubro"},
        },
    )
    results, err = pyinfra_run(inv, REPO / "deploy" / "site.py", "--limit", "rig2", "--limit", "rig3")
    assert results["failed_hosts"] == ["rig3"]
    assert "rigforge refused on rig3:" in err and "unknown variant 'dual-tubro'; choose one of: dual, dual-turbo" in err
    assert changed(results, "rig3") == [] and len(errored(results, "rig3")) == 1
    assert tb.rig("rig3").run(snapshot).stdout == before
    assert changed(results, "rig2") == [] and errored(results, "rig2") == []  # the other rig carried on
