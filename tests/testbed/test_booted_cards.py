"""A 4-card rig (issue 50): `rigforge testbed up --booted --gpus 4` as a test. `vllm/qwen-27b-multi-fast`, the
recipe's TP=4 slug, converges on one booted rig with 4 simulated RTX 3090s from the club-3090 reference
(RIGFORGE_RECIPES): caps and persistence on every card, the recipe's compose run by the rig's systemd and Docker
through the health gate; a second run changes nothing; `rigforge verify` and `rigforge bench` pass. Then the same
rig serves the TP=2 `vllm/dual`: on GPU 0 and 1 (CUDA_VISIBLE_DEVICES in PCI bus order), GPU 2 and 3 idle and
still capped. One rig, one module (CI time).

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
from support import REPO, changed, errored, inventory_with, pyinfra_run
from test_booted import models, sh, started_at, unit
from test_recipes import REFERENCE

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
SLUG, UNIT, PORT = "vllm/qwen-27b-multi-fast", "rigforge-vllm@vllm-qwen-27b-multi-fast.service", 8014
ENV = {**os.environ, "RIGFORGE_RECIPES": str(REFERENCE)}


def cli(*args: str) -> subprocess.CompletedProcess:
    """`rigforge ARGS` on the controller, reading the club-3090 reference."""
    cmd = [sys.executable, "-m", "rigforge.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=REPO)


def caps(rig) -> list[str]:
    """`index, power.limit, persistence_mode` of every simulated card, as the rig's nvidia-smi shows them."""
    out = sh(rig, "nvidia-smi --query-gpu=index,power.limit,persistence_mode --format=csv,noheader,nounits")
    return out.splitlines()


@pytest.fixture(scope="module")
def four_cards(testbed_factory):
    from rigforge.testbed import RigSpec

    missing = [tool for tool in ("systemd-nspawn", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"cannot boot rigs: {', '.join(missing)} not found (apt-get install systemd-container iproute2)")
    saved = os.environ.get("RIGFORGE_RECIPES")
    os.environ["RIGFORGE_RECIPES"] = str(REFERENCE)  # testbed up builds its recipes remote and images from it
    try:
        tb = testbed_factory([RigSpec(gpus=4)], name="booted-cards", booted=True)
        yield tb
        testbed_factory.release(tb)
    finally:
        if saved is None:
            os.environ.pop("RIGFORGE_RECIPES", None)
        else:
            os.environ["RIGFORGE_RECIPES"] = saved


def test_a_tp4_slug_converges_on_four_cards_serves_verifies_benches_and_a_second_run_changes_nothing(
    four_cards, tmp_path, testbed_report
):
    tb, rig = four_cards, four_cards.rig("rig1")
    inv = inventory_with(tb, tmp_path / "inventory.py", {"rig1": {"rigforge_variant": SLUG}})
    t0 = time.monotonic()
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py")
    testbed_report.append(f"booted: {SLUG} on 4 cards converged in {time.monotonic() - t0:.0f}s")
    assert not errored(results, "rig1"), stderr[-6000:]
    done = changed(results, "rig1")
    assert any(op.endswith(f"Run {UNIT}") for op in done) and any("Health gate" in op for op in done), done
    assert unit(rig, UNIT) == ("enabled", "active")
    assert caps(rig) == [f"{i}, 230.00, Enabled" for i in range(4)]  # every card capped, persistence on
    assert unit(rig, "rigforge-gpu-settle.service")[0] == "enabled"
    container = sh(rig, "docker ps --format '{{.Names}}'").split()
    assert container == ["vllm-qwen36-27b-multi4"], container  # the recipe's container_name default
    env = sh(rig, "docker inspect -f '{{range .Config.Env}}{{println .}}{{end}}' vllm-qwen36-27b-multi4")
    assert "CUDA_VISIBLE_DEVICES=" not in env  # exactly its 4 cards: no pin
    assert models(rig, PORT) == ["qwen3.6-27b"]
    log = sh(rig, "docker logs vllm-qwen36-27b-multi4 2>&1")
    assert "serving qwen3.6-27b from /root/.cache/huggingface/qwen3.6-27b-autoround-int4" in log, log

    before = started_at(rig, "vllm-qwen36-27b-multi4")
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py")
    assert not errored(results, "rig1"), stderr[-4000:]
    assert changed(results, "rig1") == []
    assert started_at(rig, "vllm-qwen36-27b-multi4") == before

    verify = cli("verify", str(inv), "--json")
    checks = {
        c["name"]: (c["status"], c.get("detail", "")) for c in json.loads(verify.stdout)["hosts"]["rig1"]["checks"]
    }
    assert verify.returncode == 0 and {s for s, _ in checks.values()} == {"pass"}, checks
    assert checks["GPUs visible"][1].startswith("4 GPU(s)"), checks["GPUs visible"]
    bench = cli("bench", f"http://{rig.api_address}:{PORT}", "--warmups", "1", "--runs", "2", "--json")
    assert bench.returncode == 0, bench.stdout + bench.stderr
    report = json.loads(bench.stdout)
    assert report["model"] == "qwen3.6-27b"
    assert all(p["summary"]["tokens"]["mean"] > 0 for p in report["prompts"].values()), report["prompts"]


def test_a_tp2_slug_on_the_four_card_rig_runs_on_gpu_0_and_1_and_leaves_2_and_3_idle(four_cards, tmp_path):
    tb, rig = four_cards, four_cards.rig("rig1")
    inv = inventory_with(tb, tmp_path / "inventory.py", {"rig1": {"rigforge_variant": "vllm/dual"}})
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py")
    assert not errored(results, "rig1"), stderr[-6000:]
    assert unit(rig, "rigforge-vllm@vllm-dual.service") == ("enabled", "active")
    env = sh(rig, "docker inspect -f '{{range .Config.Env}}{{println .}}{{end}}' vllm-qwen36-27b-dual").splitlines()
    assert {"CUDA_DEVICE_ORDER=PCI_BUS_ID", "CUDA_VISIBLE_DEVICES=0,1"} <= set(env), env
    assert models(rig, 8010) == ["qwen3.6-27b"]
    assert caps(rig) == [f"{i}, 230.00, Enabled" for i in range(4)]  # the idle cards stay capped
    verify = cli("verify", str(inv), "--json")
    checks = {
        c["name"]: (c["status"], c.get("detail", "")) for c in json.loads(verify.stdout)["hosts"]["rig1"]["checks"]
    }
    assert checks["GPUs visible"][0] == "pass", checks["GPUs visible"]
    assert "vllm-dual runs on GPU 0, 1, GPU 2, 3 idle" in checks["GPUs visible"][1], checks["GPUs visible"]
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py")
    assert not errored(results, "rig1") and changed(results, "rig1") == [], (changed(results, "rig1"), stderr[-3000:])
