"""Booted rigs: the serving path for real. systemd starts the units, a real Docker engine runs the compose file
(with its NVIDIA GPU reservation) from a local stand-in of the pinned image, the health gate talks to the live
server and rolls back. One booted rig is shared by the tests of this module, in order: each test starts from
the state the one before left (and says so), because a boot plus a first converge costs about two minutes.

Marked `booted` and `testbed` (`pytest -m "not testbed"` skips them). Skipped with the reason when this machine
cannot boot rigs (not root, no systemd-nspawn / nsenter / ip).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import changed, errored, inventory_with, pyinfra_run

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
REPO = Path(__file__).resolve().parents[2]
TURBO, DUAL = "rigforge-vllm@dual-turbo.service", "rigforge-vllm@dual.service"
TURBO_PORT, DUAL_PORT = 8011, 8010
MODEL = "qwen3.6-27b-autoround"


@pytest.fixture(scope="module")
def booted(testbed_factory, testbed_report):
    missing = [tool for tool in ("systemd-nspawn", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"cannot boot rigs: {', '.join(missing)} not found (apt-get install systemd-container iproute2)")
    tb = testbed_factory(name="booted", booted=True)
    return tb


def sh(rig, cmd: str) -> str:
    res = rig.run(cmd)
    assert res.returncode == 0, f"{cmd}: rc={res.returncode}\n{res.stdout}{res.stderr}"
    return res.stdout.strip()


def unit(rig, name: str) -> tuple[str, str]:
    """(is-enabled, is-active) of a unit, as systemd on the rig says."""
    res = rig.run(f"systemctl is-enabled {name}; systemctl is-active {name}")
    enabled, active = (res.stdout.split() + ["?", "?"])[:2]
    return enabled, active


def models(rig, port: int) -> list[str] | None:
    """Model ids /v1/models lists through the compose file's published port (None: nothing answers)."""
    res = rig.run(f"curl -sf --max-time 5 http://127.0.0.1:{port}/v1/models")
    return [m["id"] for m in json.loads(res.stdout)["data"]] if res.returncode == 0 else None


def wait_models(rig, port: int, timeout: float = 60) -> list[str] | None:
    """/v1/models once it answers (a unit just started or rolled back to needs a moment), None at the timeout."""
    deadline = time.monotonic() + timeout
    while (listed := models(rig, port)) is None and time.monotonic() < deadline:
        time.sleep(1)
    return listed


def started_at(rig, container: str) -> str:
    return sh(rig, f"docker inspect -f '{{{{.State.StartedAt}}}}' {container}")


def deploy(tb, tmp_path, name: str, **host_data) -> tuple[dict, str, float]:
    inv = inventory_with(tb, tmp_path / "inventory.py", {"rig1": host_data}) if host_data else tb.inventory
    t0 = time.monotonic()
    results, stderr = pyinfra_run(inv, REPO / "deploy" / f"{name}.py")
    return results, stderr, time.monotonic() - t0


def test_dual_turbo_converges_serves_verifies_and_a_second_run_changes_nothing(booted, tmp_path, testbed_report):
    rig = booted.rig("rig1")
    results, stderr, took = deploy(booted, tmp_path, "dual_turbo")
    testbed_report.append(f"booted: first dual-turbo converge {took:.0f}s")
    assert not errored(results, "rig1"), stderr[-6000:]
    done = changed(results, "rig1")
    assert any(op.endswith(f"Run {TURBO}") for op in done), done
    assert any("Health gate" in op for op in done), done

    assert unit(rig, TURBO) == ("enabled", "active")
    assert unit(rig, "rigforge-gpu-power.service") == ("enabled", "active")
    assert sh(rig, "docker inspect -f '{{.State.Status}}' vllm-qwen36-27b-dual-turbo") == "running"
    assert models(rig, TURBO_PORT) == [MODEL]
    # the dual-turbo entrypoint ran its steps in the stand-in image before `vllm serve`
    log = sh(rig, "docker logs vllm-qwen36-27b-dual-turbo 2>&1")
    assert "[Genesis] testbed stand-in v7.69" in log and "patch_tolist_cudagraph applied" in log, log
    assert f"serving {MODEL} from /root/.cache/huggingface/qwen3.6-27b-autoround-int4" in log, log

    res = subprocess.run(
        [sys.executable, "-m", "rigforge.cli", "verify", str(booted.inventory), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    checks = json.loads(res.stdout)["hosts"]["rig1"]["checks"]
    assert res.returncode == 0 and all(c["status"] == "pass" for c in checks), res.stdout
    # 13 + "VRAM fits variant" + "files as rendered" + "CUDA driver >= image" + "container runs the locked digest"
    # + "pins as locked" + "caps set last at this boot" + "boot order has no cycle"
    # + "packages as declared" + "units enabled at boot"
    assert len(checks) == 22, [c["name"] for c in checks]
    cuda = next(c for c in checks if c["name"] == "CUDA driver >= image")
    assert "CUDA: driver 13.0, image 13.0" in cuda["detail"], cuda
    running = next(c for c in checks if c["name"] == "container runs the locked digest")
    assert running["detail"].startswith("vllm/vllm-openai@sha256:"), running  # the testbed lock has the digest

    before = started_at(rig, "vllm-qwen36-27b-dual-turbo")
    results, stderr, took = deploy(booted, tmp_path, "dual_turbo")
    testbed_report.append(f"booted: second dual-turbo run {took:.0f}s")
    assert not errored(results, "rig1"), stderr[-4000:]
    assert changed(results, "rig1") == []
    assert started_at(rig, "vllm-qwen36-27b-dual-turbo") == before


def test_switch_to_dual_stops_the_old_instance_and_starts_the_new(booted, tmp_path):
    """From dual-turbo (the test before)."""
    rig = booted.rig("rig1")
    results, stderr, _ = deploy(booted, tmp_path, "dual")
    assert not errored(results, "rig1"), stderr[-6000:]
    assert any("Health gate" in op for op in changed(results, "rig1"))
    assert unit(rig, DUAL) == ("enabled", "active")
    assert unit(rig, TURBO) == ("disabled", "inactive")
    assert sh(rig, "ls /etc/systemd/system/multi-user.target.wants/ | grep '^rigforge-vllm@'") == DUAL
    assert models(rig, DUAL_PORT) == [MODEL]
    assert models(rig, TURBO_PORT) is None
    assert sh(rig, "docker ps --format '{{.Names}}'") == "vllm-qwen36-27b-dual"


def test_a_variant_whose_server_exits_at_start_rolls_back_to_the_previous_one(booted, tmp_path):
    """From dual (the test before): dual-turbo on an image whose server exits at start."""
    from rigforge.testbed.booted import BROKEN_IMAGE, BROKEN_MESSAGE

    rig = booted.rig("rig1")
    results, stderr, took = deploy(booted, tmp_path, "dual_turbo", serving_image=BROKEN_IMAGE)
    assert results.get("failed_hosts") == "all" or errored(results, "rig1")
    assert "the server exited while starting" in stderr, stderr[-6000:]
    assert BROKEN_MESSAGE in stderr, stderr[-6000:]  # the container's own log line, in the log tail
    assert "rigforge health gate: rolled back" in stderr
    assert took < 180, f"the gate took {took:.0f}s to notice a server that exits at start"
    assert unit(rig, DUAL) == ("enabled", "active")
    assert unit(rig, TURBO)[0] == "disabled" and unit(rig, TURBO)[1] != "active"
    assert wait_models(rig, DUAL_PORT) == [MODEL]


def test_a_same_variant_update_that_breaks_rolls_back_to_prev(booted, tmp_path):
    """From dual, serving (the test before): the same variant, now on the broken image."""
    from rigforge.testbed.booted import BROKEN_IMAGE
    from rigforge.testbed.rig import IMAGE_REF

    rig = booted.rig("rig1")
    compose = "/opt/rigforge/serve/dual/docker-compose.yml"
    good = sh(rig, f"cat {compose}")
    results, stderr, _ = deploy(booted, tmp_path, "dual", serving_image=BROKEN_IMAGE)
    assert results.get("failed_hosts") == "all" or errored(results, "rig1")
    assert "rigforge health gate: rolled back" in stderr, stderr[-6000:]
    assert sh(rig, f"cat {compose}") == good and IMAGE_REF in good
    assert unit(rig, DUAL) == ("enabled", "active")
    assert wait_models(rig, DUAL_PORT) == [MODEL]
    # and the rig is converged again: the good deploy finds nothing to do
    results, stderr, _ = deploy(booted, tmp_path, "dual")
    assert not errored(results, "rig1"), stderr[-4000:]
    assert changed(results, "rig1") == []


def test_power_caps_and_serving_come_back_after_a_reboot_without_a_deploy(booted, testbed_report):
    """From dual, serving. The simulated GPUs forget their limits at boot (tmpfs state): only
    rigforge-gpu-power.service can put 230 W back."""
    rig = booted.rig("rig1")
    sh(rig, "nvidia-smi -pl 300 >/dev/null")  # a limit that only the boot unit can undo
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "rigforge.cli", "testbed", "reboot", "rig1", "--dir", str(booted.dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and "testbed reboot: rig1 (booted) in" in res.stderr, res.stdout + res.stderr
    testbed_report.append(f"booted: reboot {time.monotonic() - t0:.1f}s")
    caps = sh(rig, "nvidia-smi --query-gpu=power.limit,persistence_mode --format=csv,noheader,nounits")
    assert [line.split(", ") for line in caps.splitlines()] == [["230.00", "Enabled"]] * 2, caps
    assert "rigforge-gpu-power.service" in sh(rig, "journalctl -b -u rigforge-gpu-power.service --no-pager")
    assert wait_models(rig, DUAL_PORT, 90) == [MODEL], "rigforge-vllm@dual did not serve again after the reboot"
    assert unit(rig, DUAL) == ("enabled", "active")


def test_the_recipe_repos_own_cap_unit_runs_and_rigforges_caps_are_set_last(booted, tmp_path, testbed_report):
    """Any state serving dual (the tests before, or a fresh rig: this one deploys dual itself). The recipe repo's
    nvidia-power-cap.service (250 W at boot) is installed and enabled before the deploy: rigforge's power unit is
    ordered after no other writer (it can never close an ordering cycle), both units run at boot, rigforge's
    settle stage makes 230 W the last caps written, and `rigforge status` says what ran
    (tests/testbed/test_booted_boot_order.py covers the other kinds of writer)."""
    rig = booted.rig("rig1")
    recipe_unit = REPO / "tests/fixtures/club-3090-4a29ab57/scripts/systemd/nvidia-power-cap.service"
    shutil.copy(recipe_unit, rig.rootfs / "etc/systemd/system/nvidia-power-cap.service")
    sh(rig, "systemctl daemon-reload && systemctl enable nvidia-power-cap.service 2>&1")
    results, stderr, took = deploy(booted, tmp_path, "dual")
    testbed_report.append(f"booted: dual with the recipe's cap unit {took:.0f}s")
    assert not errored(results, "rig1"), stderr[-6000:]
    after = sh(rig, "systemctl show -p After --value rigforge-gpu-power.service").split()
    assert "nvidia-power-cap.service" not in after, after
    assert "nvidia-power-cap.service" not in sh(rig, "systemctl show -p Wants --value rigforge-gpu-power.service")
    manifest = json.loads(sh(rig, "cat /etc/rigforge/rig.json"))
    assert manifest["interconnect"] == {"links": {"0-1": "PHB"}, "p2p_read": {"0-1": "CNS"}}, manifest
    results, stderr, _ = deploy(booted, tmp_path, "dual")
    assert not errored(results, "rig1") and changed(results, "rig1") == [], stderr[-4000:]

    took = rig.reboot()
    testbed_report.append(f"booted: reboot with two cap units {took:.1f}s")
    assert unit(rig, "nvidia-power-cap.service") == ("enabled", "active")  # it ran at this boot and set 250 W
    deadline = time.monotonic() + 180  # the settle stage watches for a minute after the boot
    while sh(rig, "systemctl show -p SubState --value rigforge-gpu-settle.service") != "exited":
        assert time.monotonic() < deadline, "the settle stage did not finish"
        time.sleep(1)
    caps = sh(rig, "nvidia-smi --query-gpu=power.limit --format=csv,noheader,nounits")
    assert caps.splitlines() == ["230.00"] * 2, caps
    assert "ordering cycle" not in sh(rig, "journalctl -b --no-pager -o cat")
    res = subprocess.run(
        [sys.executable, "-m", "rigforge.cli", "status", str(booted.inventory)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "power caps: 230 W, set last at this boot (after nvidia-power-cap.service set 250 W; " in res.stdout
    assert "interconnect: PCIe (PHB), no NVLink, P2P read: not supported (CNS" in res.stdout, res.stdout
    assert wait_models(rig, DUAL_PORT, 90) == [MODEL]


def test_bench_measures_the_booted_rigs_server_beside_the_published_figures(booted):
    """From dual, serving: `rigforge bench` on the controller, at the rig's API as the testbed publishes it on
    the controller's loopback (the rig's own address there, the same port number), no tunnel."""
    rig = booted.rig("rig1")
    assert rig.api_address.startswith("127.1.")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rigforge.cli",
            "bench",
            f"http://{rig.api_address}:{DUAL_PORT}",
            "--variant",
            "dual",
        ]
        + ["--warmups", "1", "--runs", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert report["model"] == MODEL and report["variant"] == "dual"
    # published figures (design document) beside the measured ones
    assert report["prompts"]["narr"]["published"]["tps"] == 69.0
    assert report["prompts"]["code"]["published"]["tps"] == 89.0
    for name, p in report["prompts"].items():
        s = p["summary"]
        # the stand-in's schedule: first token 100 ms after the request, then one every 10 ms, 40 tokens; so no
        # run can see its first token sooner than 100 ms or finish sooner than 490 ms (at most 81.6 tokens/s)
        assert s["tokens"]["mean"] == 40 and s["tokens_from"] == ["usage"], (name, s)
        assert 100 <= s["ttft_ms"]["min"] and s["ttft_ms"]["mean"] < 1000, (name, s)
        assert 20 < s["wall_tps"]["mean"] and s["wall_tps"]["max"] <= 40 / 0.49, (name, s)


def test_up_fresh_stops_the_old_booted_rig_before_it_rebuilds(booted):
    """Last in this module: `up --fresh` over a booted rig (here as a chroot rig) powers the old one off first:
    no systemd-nspawn, no network namespace (its own or the testbed LAN's), no relay left holding its ports."""
    from rigforge.testbed import RigSpec, up
    from rigforge.testbed._util import pid_alive
    from rigforge.testbed.booted import lan_name, netns_path

    rig = booted.rig("rig1")
    assert pid_alive(rig.dir / "nspawn.pid") and Path(netns_path(rig.dir)).exists()
    assert Path(f"/run/netns/{lan_name(booted.dir)}").exists()
    api = (rig.api_address, DUAL_PORT)
    socket.create_connection(api, timeout=5).close()  # published while the booted rig runs
    tb = up(booted.dir, [RigSpec()], fresh=True, shared=booted.shared)
    assert not pid_alive(rig.dir / "nspawn.pid") and not Path(netns_path(rig.dir)).exists()
    assert not Path(f"/run/netns/{lan_name(booted.dir)}").exists()
    assert not pid_alive(rig.dir / "relay.pid")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(api, timeout=5)
    assert tb.rig("rig1").run("cat /etc/rigforge-sim/gpus.json").returncode == 0  # the chroot rig is up
