"""The power unit as the last writer, the recipe repo's power figures as data, and the GPUs' interconnect.

Cited files: the recipe repo's own cap unit (tests/fixtures/club-3090-4a29ab57/scripts/systemd/
nvidia-power-cap.service), its hardware profile (scripts/lib/profiles/hardware/rtx-3090.yml) and docs/HARDWARE.md;
real `nvidia-smi topo` output in tests/fixtures/nvidia-smi/.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rigforge import power
from rigforge.hardware import interconnect
from rigforge.render import POWER_UNIT, render_power_unit
from rigforge.status import power_lines
from roles import site
from roles.facts.nvidia import UNIT_DIRS, PowerCapUnits, parse_cap_units, parse_topo_matrix, parse_topology

FIXTURES = Path(__file__).parent / "fixtures"
RECIPES = FIXTURES / "club-3090-4a29ab57"
RECIPE_UNIT = RECIPES / "scripts/systemd/nvidia-power-cap.service"
SMI = FIXTURES / "nvidia-smi"


def cap_units_on(tmp_path: Path, files: dict[str, str]) -> dict:
    """Run PowerCapUnits' own command with systemd's unit dirs moved under tmp_path."""
    dirs = [tmp_path / d.strip("/") for d in UNIT_DIRS]
    for d in dirs:
        d.mkdir(parents=True)
    for path, text in files.items():
        (tmp_path / path.strip("/")).write_text(text)
    command = PowerCapUnits().command().replace(" ".join(UNIT_DIRS), " ".join(map(str, dirs)))
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout
    return parse_cap_units(out.splitlines())


def test_the_recipe_unit_a_tuning_unit_and_any_unit_running_nvidia_smi_pl_are_found(tmp_path):
    found = cap_units_on(
        tmp_path,
        {
            "/etc/systemd/system/nvidia-power-cap.service": RECIPE_UNIT.read_text(),
            "/lib/systemd/system/gpu-tune.service": "[Service]\nExecStart=/usr/local/bin/gpu-tune --apply\n",
            "/usr/lib/systemd/system/cap.service": "[Service]\nExecStart=nvidia-smi --power-limit=300\n",
            "/etc/systemd/system/other.service": "[Service]\nExecStart=/usr/bin/nvidia-smi -pm 1\n",
            f"/etc/systemd/system/{POWER_UNIT}": render_power_unit({0: 230, 1: 230}),
        },
    )
    assert found == {
        "cap.service": {"path": f"{tmp_path}/usr/lib/systemd/system/cap.service", "watts": [300]},
        "gpu-tune.service": {"path": f"{tmp_path}/lib/systemd/system/gpu-tune.service", "watts": []},
        "nvidia-power-cap.service": {
            "path": f"{tmp_path}/etc/systemd/system/nvidia-power-cap.service",
            "watts": [250],
        },
    }


def test_a_rig_without_other_cap_units_finds_none(tmp_path):
    assert cap_units_on(tmp_path, {}) == {}
    assert PowerCapUnits.default() == {}


def test_the_first_unit_dir_wins_as_in_systemd():
    lines = ["unit=a.service /etc/systemd/system/a.service", "ExecStart=/usr/bin/nvidia-smi -i 0 -pl 250",
             "unit=a.service /lib/systemd/system/a.service", "ExecStart=/usr/bin/nvidia-smi -pl 280"]  # fmt: skip
    assert parse_cap_units(lines) == {"a.service": {"path": "/etc/systemd/system/a.service", "watts": [250]}}


def plan(**kwargs):
    plan, problems = site.plan_for("r", {}, "dual-turbo", deployable=False, **kwargs)
    assert not problems, problems
    return plan


def test_the_power_unit_runs_after_the_other_cap_units_without_pulling_them_in():
    text = plan(gpus=2, cap_units=("gpu-tune.service", "nvidia-power-cap.service")).files[POWER_UNIT]
    assert "After=nvidia-persistenced.service gpu-tune.service nvidia-power-cap.service\n" in text
    assert "Wants=nvidia-persistenced.service\n" in text and text.count("Wants=") == 1
    assert "-i 0 -pl 230" in text and "-i 1 -pl 230" in text


def test_without_other_cap_units_the_power_unit_is_unchanged():
    """A rig without other writers gets the unit it always got: a converged rig stays a no-op."""
    text = plan(gpus=2).files[POWER_UNIT]
    assert text == render_power_unit({0: 230, 1: 230})
    assert "After=nvidia-persistenced.service\n" in text


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
    assert "docs/HARDWARE.md" in above


def test_a_deploy_warns_about_a_cap_outside_the_range_and_goes_on(monkeypatch):
    monkeypatch.setenv("RIGFORGE_RECIPES", str(RECIPES))
    p, problems = site.plan_for("r", {"gpu_power_limit_w": 350}, "dual-turbo", gpus=2, deployable=False)
    assert p is not None and not problems  # not a refusal
    (warning,) = power.warnings(p.caps, power.locate_profile(p.lock))
    assert "350 W" in warning and "docs/HARDWARE.md" in warning


def test_status_names_the_other_writer_and_the_recipe_range():
    row = {
        "host": "rig1",
        "power": {
            "caps": {0: 230, 1: 230},
            "order": power.other_writers({"nvidia-power-cap.service": {"watts": [250]}}, POWER_UNIT),
            "recipe": power.recipe_range(power.profile(RECIPES)),
            "warnings": [],
            "interconnect_summary": "PCIe (PHB), no NVLink, P2P read: not supported (CNS: chipset not supported)",
        },
    }
    assert power_lines(row) == [
        "rig1: power caps: 230 W (rigforge-gpu-power.service runs after nvidia-power-cap.service, which sets "
        "250 W at boot); recipe: TP=2 flat 220..330 W (docs/HARDWARE.md); prefill 250, optimal 290, max 350 W "
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
