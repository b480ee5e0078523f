"""The rig's other boot-time cap writers found, the power unit ordered after none of them, the recipe repo's
power figures as data, and the GPUs' interconnect.

Cited files: the recipe repo's own cap unit (tests/fixtures/club-3090-4a29ab57/scripts/systemd/
nvidia-power-cap.service), its hardware profile (scripts/lib/profiles/hardware/rtx-3090.yml) and docs/HARDWARE.md;
real `nvidia-smi topo` output in tests/fixtures/nvidia-smi/.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rigforge.cli.status import notes
from rigforge.layout import RC_LOCAL, SETTLE_UNIT, UDEV_RULES_DIRS, UNIT_SEARCH_PATH, HostLayout
from rigforge.model import fleet, power
from rigforge.model.hardware import interconnect
from rigforge.model.render import POWER_UNIT, render_power_unit
from rigforge.observe.facts.nvidia import (
    CRON_FILES,
    PowerCapUnits,
    parse_topo_matrix,
    parse_topology,
)

FIXTURES = Path(__file__).parent / "fixtures"
RECIPES = FIXTURES / "club-3090-4a29ab57"
RECIPE_UNIT = RECIPES / "scripts/systemd/nvidia-power-cap.service"
SMI = FIXTURES / "nvidia-smi"


def cap_units_on(tmp_path: Path, files: dict[str, str]) -> dict:
    """Run PowerCapUnits' own command with systemd's unit dirs, the cron files, rc.local and udev's rules dirs moved
    under tmp_path."""
    dirs = [str(tmp_path / d.strip("/")) for d in UNIT_SEARCH_PATH]
    rules = [str(tmp_path / d.strip("/")) for d in UDEV_RULES_DIRS]
    made = (tmp_path / "etc/cron.d", tmp_path / "var/spool/cron/crontabs", tmp_path / "usr/local/bin")
    for d in (*dirs, *rules, *made):
        Path(d).mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        (tmp_path / path.strip("/")).write_text(text.replace("@TMP@", str(tmp_path)))
    crons = [str(tmp_path / c.strip("/")) for c in CRON_FILES]
    command = PowerCapUnits().command(dirs, crons, str(tmp_path / RC_LOCAL.strip("/")), rules)
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    return PowerCapUnits().process(out.stdout.splitlines(), dirs)


HOMEMADE = """[Unit]
Description=home-made cap
After=multi-user.target

[Service]
Type=oneshot
ExecStart=/usr/bin/nvidia-smi -pl 250

[Install]
WantedBy=multi-user.target
"""
SCRIPT = "#!/bin/sh\n# caps for both cards\nnvidia-smi -pm 1\nnvidia-smi -i 0 -pl 250\nnvidia-smi -i 1 -pl 250\n"


def test_every_kind_of_boot_time_cap_writer_is_found(tmp_path):
    """The recipe repo's unit, a tuning unit known by name, a unit calling nvidia-smi -pl (with After=
    multi-user.target), a unit running a script that does, and @reboot cron jobs (root's crontab, /etc/cron.d)."""
    found = cap_units_on(
        tmp_path,
        {
            "/etc/systemd/system/nvidia-power-cap.service": RECIPE_UNIT.read_text(),
            "/lib/systemd/system/gpu-tune.service": "[Service]\nExecStart=/usr/local/bin/gpu-tune --apply\n",
            "/usr/lib/systemd/system/cap.service": "[Service]\nExecStart=nvidia-smi --power-limit=300\n",
            "/etc/systemd/system/homemade-cap.service": HOMEMADE,
            "/usr/local/bin/gpu-setup.sh": SCRIPT,
            "/etc/systemd/system/gpu-setup.service": "[Service]\nExecStart=@TMP@/usr/local/bin/gpu-setup.sh\n",
            "/etc/systemd/system/shell.service": "[Service]\nExecStart=/bin/sh @TMP@/usr/local/bin/gpu-setup.sh\n",
            "/etc/systemd/system/other.service": "[Service]\nExecStart=/usr/bin/nvidia-smi -pm 1\n",
            "/etc/systemd/system/true.service": "[Service]\nExecStart=/usr/bin/true\n",
            "/etc/cron.d/gpu-cap": "SHELL=/bin/sh\n@reboot root @TMP@/usr/local/bin/gpu-setup.sh >/dev/null\n"
            "@reboot root /usr/bin/date\n",
            "/var/spool/cron/crontabs/root": "# m h dom mon dow command\n@reboot sleep 20; nvidia-smi -pl 240\n",
            f"/etc/systemd/system/{POWER_UNIT}": render_power_unit({0: 230, 1: 230}),
            f"/etc/systemd/system/{SETTLE_UNIT}": "[Service]\nExecStart=/x/rigforge-gpu-settle nvidia-smi 60 0:230\n",
        },
    )
    script = f"{tmp_path}/usr/local/bin/gpu-setup.sh"
    assert found == {
        f"@reboot in {tmp_path}/etc/cron.d/gpu-cap": {
            "kind": "cron",
            "path": f"{tmp_path}/etc/cron.d/gpu-cap",
            "watts": [250],
            "script": script,
            "command": f"{script} >/dev/null",
        },
        f"@reboot in {tmp_path}/var/spool/cron/crontabs/root": {
            "kind": "cron",
            "path": f"{tmp_path}/var/spool/cron/crontabs/root",
            "watts": [240],
            "script": None,
            "command": "sleep 20; nvidia-smi -pl 240",
        },
        "cap.service": {
            "kind": "unit",
            "path": f"{tmp_path}/usr/lib/systemd/system/cap.service",
            "watts": [300],
            "script": None,
            "timer": None,
        },
        "gpu-setup.service": {
            "kind": "unit",
            "path": f"{tmp_path}/etc/systemd/system/gpu-setup.service",
            "watts": [250],
            "script": script,
            "timer": None,
        },
        "gpu-tune.service": {
            "kind": "unit",
            "path": f"{tmp_path}/lib/systemd/system/gpu-tune.service",
            "watts": [],
            "script": None,
            "timer": None,
        },
        "homemade-cap.service": {
            "kind": "unit",
            "path": f"{tmp_path}/etc/systemd/system/homemade-cap.service",
            "watts": [250],
            "script": None,
            "timer": None,
        },
        "nvidia-power-cap.service": {
            "kind": "unit",
            "path": f"{tmp_path}/etc/systemd/system/nvidia-power-cap.service",
            "watts": [250],
            "script": None,
            "timer": None,
        },
        "shell.service": {
            "kind": "unit",
            "path": f"{tmp_path}/etc/systemd/system/shell.service",
            "watts": [250],
            "script": script,
            "timer": None,
        },
    }


def test_cron_jobs_of_any_schedule_timers_rc_local_and_udev_rules_are_found(tmp_path):
    """Issue 47: a writer is named by what it is. A job every 5 minutes in /etc/crontab, a daily one in a user's
    crontab, a unit started by a timer of its own name and one by a timer's Unit=, /etc/rc.local, a udev rule."""
    found = cap_units_on(
        tmp_path,
        {
            "/etc/crontab": "SHELL=/bin/sh\n*/5 * * * * root nvidia-smi -i 1 -pl 260\n17 * * * * root run-parts x\n",
            "/var/spool/cron/crontabs/alice": "30 2 * * * sudo nvidia-smi --power-limit 270\n",
            "/usr/local/bin/gpu-setup.sh": SCRIPT,
            "/etc/systemd/system/recap.service": "[Service]\nExecStart=@TMP@/usr/local/bin/gpu-setup.sh\n",
            "/etc/systemd/system/recap.timer": "[Timer]\nOnCalendar=hourly\n",
            "/lib/systemd/system/late.service": "[Service]\nExecStart=/usr/bin/nvidia-smi -pl 280\n",
            "/lib/systemd/system/later.timer": "[Timer]\nOnBootSec=5min\nUnit=late.service\n",
            "/etc/rc.local": "#!/bin/sh -e\n# nvidia-smi -pl 100 (a comment)\nnvidia-smi -pl 290\nexit 0\n",
            "/etc/udev/rules.d/90-gpu.rules": 'ACTION=="add", SUBSYSTEM=="pci", RUN+="/usr/bin/nvidia-smi -pl 300"\n',
            "/lib/udev/rules.d/91-other.rules": 'ACTION=="add", RUN+="/usr/bin/true"\n',
        },
    )
    script = f"{tmp_path}/usr/local/bin/gpu-setup.sh"
    crontab, user = f"{tmp_path}/etc/crontab", f"{tmp_path}/var/spool/cron/crontabs/alice"
    rules, rc_local = f"{tmp_path}/etc/udev/rules.d/90-gpu.rules", f"{tmp_path}/etc/rc.local"
    assert found == {
        f"*/5 * * * * in {crontab}": {
            "kind": "cron",
            "path": crontab,
            "watts": [260],
            "script": None,
            "command": "nvidia-smi -i 1 -pl 260",
        },
        f"30 2 * * * in {user}": {
            "kind": "cron",
            "path": user,
            "watts": [270],
            "script": None,
            "command": "sudo nvidia-smi --power-limit 270",
        },
        rc_local: {"kind": "rc.local", "path": rc_local, "watts": [290], "script": None},
        "late.service": {
            "kind": "unit",
            "path": f"{tmp_path}/lib/systemd/system/late.service",
            "watts": [280],
            "script": None,
            "timer": "later.timer",
        },
        "recap.service": {
            "kind": "unit",
            "path": f"{tmp_path}/etc/systemd/system/recap.service",
            "watts": [250],
            "script": script,
            "timer": "recap.timer",
        },
        f"udev rule in {rules}": {"kind": "udev", "path": rules, "watts": [300], "script": None},
    }


def test_a_rig_without_other_cap_writers_finds_none(tmp_path):
    assert cap_units_on(tmp_path, {}) == {}
    assert PowerCapUnits().default() == {}


def test_the_first_unit_dir_wins_as_in_systemd():
    """Captured lines of the command (a unit overridden in /etc by one that only turns persistence on)."""
    lines = [
        "line=/etc/systemd/system/a.service:ExecStart=/usr/bin/nvidia-smi -pm 1",
        "line=/lib/systemd/system/a.service:ExecStart=/usr/bin/nvidia-smi -pl 280",
        "line=/etc/systemd/system/b.service:ExecStart=/usr/bin/nvidia-smi -i 0 -pl 250",
        "line=/lib/systemd/system/b.service:ExecStart=/usr/bin/nvidia-smi -pl 280",
    ]
    assert PowerCapUnits().process(lines) == {
        "b.service": {
            "kind": "unit",
            "path": "/etc/systemd/system/b.service",
            "watts": [250],
            "script": None,
            "timer": None,
        }
    }


def plan(**kwargs):
    plan, problems = fleet.plan_for("r", {}, "dual-turbo", deployable=False, **kwargs)
    assert not problems, problems
    return plan


def test_the_power_unit_is_ordered_after_no_other_writer_whatever_the_rig_has():
    """No After= on other writers: a home-made unit After=multi-user.target cannot close a cycle with it."""
    text = plan(gpus=2, cap_units=("gpu-tune.service", "nvidia-power-cap.service", "homemade-cap.service")).files
    assert text[POWER_UNIT] == plan(gpus=2).files[POWER_UNIT] == render_power_unit({0: 230, 1: 230})
    assert "\nAfter=nvidia-persistenced.service\n" in text[POWER_UNIT] and "Before=docker.service" in text[POWER_UNIT]
    assert "-i 0 -pl 230" in text[POWER_UNIT] and "-i 1 -pl 230" in text[POWER_UNIT]
    settle = text[SETTLE_UNIT]
    assert [ln for ln in settle.splitlines() if ln.startswith(("After=", "Before=", "Wants=", "Requires="))] == [
        f"After={POWER_UNIT}"
    ]
    assert "Type=exec\n" in settle and "WantedBy=multi-user.target" in settle
    layout = HostLayout()
    run = f"{layout.settle_script} {layout.hold_script} /usr/bin/nvidia-smi {layout.cap_setbacks} 60 0:230 1:230"
    assert f"ExecStart={run}\n" in settle


def test_the_settle_window_and_per_gpu_caps_are_rendered_from_host_data():
    p, problems = fleet.plan_for(
        "r", {"gpu_power_settle_window_s": 5, "gpu_power_limits": {1: 250}}, "dual-turbo", gpus=2, deployable=False
    )
    assert not problems
    assert " /usr/bin/nvidia-smi /var/lib/rigforge/gpu-cap-setbacks 5 0:230 1:250\n" in p.files[SETTLE_UNIT]
    _, problems = fleet.plan_for("r", {"gpu_power_settle_window_s": -1}, "dual-turbo", deployable=False)
    assert problems == ["gpu_power_settle_window_s must be a whole number of seconds in 0..3600, got -1"]


def test_the_recipe_profile_is_read_as_data():
    """scripts/lib/profiles/hardware/rtx-3090.yml: min driver 580.0; prefill 250, optimal 290, max 350 W."""
    assert power.profile(RECIPES) == {"prefill": 250, "optimal": 290, "max": 350, "min_driver": "580.0"}
    assert power.profile(None) is None


def test_the_measured_range_is_what_hardware_md_says():
    """docs/HARDWARE.md: the TP=2 anchor is flat from 220 to 330 W per card."""
    text = (RECIPES / power.HARDWARE_DOC).read_text()
    assert "the TP=2 anchor below is already flat from 220–330W/card" in text
    assert "swept the two cards serving `dual-fast` TP=2 from **220 to 330W/card**" in text
    assert power.MEASURED_W == (220, 330)


@pytest.mark.parametrize("watts", [220, 230, 290, 330])
def test_a_cap_inside_the_measured_range_warns_nothing(watts):
    assert power.warnings({0: watts, 1: watts}, power.profile(RECIPES)) == []


def test_a_cap_outside_the_measured_range_is_a_warning_naming_the_source():
    prof = power.profile(RECIPES)
    (low,) = power.warnings({0: 200, 1: 230}, prof)
    assert "200 W (GPU 0)" in low and "220..330" in low and "docs/HARDWARE.md" in low
    (high,) = power.warnings({0: 360, 1: 360}, prof)
    assert "360 W (GPU 0, 1)" in high and "350 W" in high and power.PROFILE in high
    (above,) = power.warnings({0: 340}, None)  # no recipe repo on the controller: the measured range still holds
    assert "docs/HARDWARE.md" in above and above.endswith("; kept as set")
    (unknown,) = power.warnings({0: 400}, None, kept="kept as set if the cards' own range allows it")
    assert unknown.endswith("TP=2 anchor); kept as set if the cards' own range allows it")


def test_a_deploy_warns_about_a_cap_outside_the_range_and_goes_on(monkeypatch):
    monkeypatch.setenv("RIGFORGE_RECIPES", str(RECIPES))
    p, problems = fleet.plan_for("r", {"gpu_power_limit_w": 350}, "dual-turbo", gpus=2, deployable=False)
    assert p is not None and not problems  # not a refusal
    (warning,) = power.warnings(p.caps, power.locate_profile(p.lock))
    assert "350 W" in warning and "docs/HARDWARE.md" in warning


def test_status_says_what_ran_at_this_boot_and_the_recipe_range():
    row = {
        "host": "rig1",
        "power": {
            "caps": {0: 230, 1: 230},
            "order": "set last at this boot (after nvidia-power-cap.service set 250 W; 1 correction by the settle "
            "stage)",
            "recipe": power.recipe_range(power.profile(RECIPES)),
            "warnings": [],
            "interconnect_summary": "PCIe (PHB), no NVLink, P2P read: not supported (CNS: chipset not supported)",
        },
    }
    assert [f"rig1: {n}" for n in notes(row)] == [
        "rig1: power caps: 230 W, set last at this boot (after nvidia-power-cap.service set 250 W; 1 correction by "
        "the settle stage); recipe: TP=2 flat 220..330 W (docs/HARDWARE.md); prefill 250, optimal 290, max 350 W "
        "(rtx-3090.yml)",
        "rig1: interconnect: PCIe (PHB), no NVLink, P2P read: not supported (CNS: chipset not supported)",
    ]


def test_topo_m_of_two_nvlinked_gpus_real_output():
    """h200x2-driver580/misc.txt: `nvidia-smi topo -m` on 2x H200 (NV18), the header underlined (ANSI)."""
    lines = (SMI / "h200x2-driver580/misc.txt").read_text().splitlines()
    matrix = lines[1 : lines.index("+ echo ---")]
    assert parse_topo_matrix(matrix) == {"0-1": "NV18"}
    assert interconnect({"links": {"0-1": "NV18"}, "p2p_read": {"0-1": "OK"}}) == "NVLink (NV18), P2P read: OK"


def test_topo_of_one_gpu_real_output_has_no_pair():
    real = SMI / "h200x1-580.159.04-ubuntu2404"
    lines = ["--- topo -m", *(real / "topo-m.txt").read_text().splitlines()]
    lines += ["--- topo -p2p r", *(real / "topo-p2p-r.txt").read_text().splitlines()]
    assert parse_topology(lines) == {"links": {}, "p2p_read": {}}
    assert interconnect(parse_topology(lines)) == ""


def test_topo_of_two_pcie_gpus_without_nvlink():
    """The real format (tabs, underlined header, leading space in -p2p) with a 3090 pair's cells."""
    lines = [
        "--- topo -m",
        "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m",
        "GPU0\t X \tPHB\t0-15\t0\t\tN/A",
        "GPU1\tPHB\t X \t0-15\t0\t\tN/A",
        "",
        "Legend:",
        "--- topo -p2p r",
        " \t\x1b[4mGPU0\tGPU1\t\x1b[0m",
        " GPU0\tX\tCNS\t",
        " GPU1\tCNS\tX\t",
        "",
        "Legend:",
    ]
    topology = parse_topology(lines)
    assert topology == {"links": {"0-1": "PHB"}, "p2p_read": {"0-1": "CNS"}}
    assert interconnect(topology) == "PCIe (PHB), no NVLink, P2P read: not supported (CNS: chipset not supported)"
