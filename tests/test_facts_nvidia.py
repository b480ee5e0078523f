"""Tier 1: NVIDIA facts parse real nvidia-smi output (tests/fixtures/nvidia-smi, captured on 2x H200, driver 580)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigforge.observe.facts.apt import DebInstalledVersion
from rigforge.observe.facts.nvidia import (
    QUERY_FIELDS,
    NvidiaGpus,
    NvidiaModuleVersion,
    NvidiaSmiStatus,
    upstream_version,
)

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia-smi" / "h200x2-driver580"
# The field list the fixture was captured with (see its README).
FIXTURE_FIELDS = (
    "index,uuid,name,pci.bus_id,memory.total,memory.used,memory.free,power.limit,power.default_limit,"
    "power.min_limit,power.max_limit,enforced.power.limit,power.draw,persistence_mode,driver_version,"
    "compute_cap,temperature.gpu,clocks.max.sm"
).split(",")


def read(name: str) -> str:
    return (FIXTURES / name).read_text()


def query_rows() -> list[str]:
    """The fixture's rows cut to the columns NvidiaGpus queries (QUERY_FIELDS), in its order."""
    columns = [FIXTURE_FIELDS.index(field) for field in QUERY_FIELDS]
    return [", ".join(line.split(", ")[i] for i in columns) for line in read("query-gpu.csv").splitlines()]


def test_query_gpu_noheader_nounits_is_typed():
    gpus = NvidiaGpus().process(query_rows())
    assert [gpu["index"] for gpu in gpus] == [0, 1]
    first = gpus[0]
    assert first["uuid"] == "GPU-53ff009b-e4c5-51d5-6e89-fcfc88582c2d"
    assert first["name"] == "NVIDIA H200"
    assert first["pci_bus_id"] == "00000000:00:06.0"
    assert first["memory_total"] == 143771 and isinstance(first["memory_total"], int)
    assert first["memory_used"] == 0
    assert (first["power_limit"], first["power_default_limit"]) == (700.0, 700.0)
    assert (first["power_min_limit"], first["power_max_limit"]) == (200.0, 700.0)
    assert first["persistence_mode"] is True
    assert first["driver_version"] == "580.159.04"
    assert first["compute_cap"] == "9.0"
    assert gpus[1]["pci_bus_id"] == "00000000:00:07.0"


def test_na_values_become_none():
    line = "0, GPU-x, RTX 3090, 00000000:01:00.0, 24576, [N/A], [N/A], N/A, 100.00, 350.00, Disabled, 580, 8.6"
    (gpu,) = NvidiaGpus().process([line])
    assert gpu["memory_used"] is None and gpu["power_limit"] is None and gpu["power_default_limit"] is None
    assert gpu["power_min_limit"] == 100.0 and gpu["persistence_mode"] is False
    assert gpu["memory_total"] == 24576


@pytest.mark.parametrize("name", ["query-bad-index.txt", "query-bad-field.txt"])
def test_error_output_means_no_gpus(name):
    assert NvidiaGpus().process(read(name).splitlines()) == []


def test_driver_mismatch_and_no_driver_texts_mean_no_gpus():
    assert (
        NvidiaGpus().process(
            ["Failed to initialize NVML: Driver/library version mismatch", "NVML library version: 580.95"]
        )
        == []
    )
    assert NvidiaGpus().process(["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."]) == []
    assert NvidiaGpus().process([]) == []


def test_nvidia_gpus_fact_queries_the_fields_it_parses():
    fact = NvidiaGpus()
    command = str(fact.command)
    assert "--query-gpu=" + ",".join(QUERY_FIELDS) in command
    assert "--format=csv,noheader,nounits" in command
    assert command.startswith("if command -v nvidia-smi >/dev/null 2>&1; then")  # missing: [], no warning
    assert not hasattr(fact, "requires_command") or fact.requires_command() is None
    assert NvidiaGpus().default() == []
    # The real fixture has extra columns: with our field list those rows do not parse as GPUs.
    assert fact.process(read("query-gpu.csv").splitlines()) == []
    rows = [
        "0, GPU-a, RTX 3090, 00000000:01:00.0, 24576, 1, 230.00, 350.00, 100.00, 350.00, Enabled, 580.95.05, 8.6",
        "1, GPU-b, RTX 3090, 00000000:02:00.0, 24576, 1, 350.00, 350.00, 100.00, 390.00, Disabled, 580.95.05, 8.6",
    ]
    gpus = fact.process(rows)
    assert [(g["index"], g["power_limit"], g["power_max_limit"], g["persistence_mode"]) for g in gpus] == [
        (0, 230.0, 350.0, True),
        (1, 350.0, 390.0, False),
    ]


def test_module_version_from_sysfs_text():
    misc = read("misc.txt").splitlines()
    sysfs = misc[misc.index("+ cat /sys/module/nvidia/version") + 1]
    assert NvidiaModuleVersion().process([sysfs]) == "580.159.04"
    assert NvidiaModuleVersion().process([]) is None
    assert NvidiaModuleVersion().process([""]) is None


def test_package_version_and_upstream():
    fact = DebInstalledVersion()  # what the driver role reads of its package
    assert "dpkg-query" in str(fact.command(package="nvidia-driver-580-open"))
    assert fact.process(["installed 580.159.04-0ubuntu0.24.04.1"]) == "580.159.04-0ubuntu0.24.04.1"
    assert fact.process(["not-installed "]) is None
    assert fact.process(["config-files 580.95.05-1"]) is None
    assert fact.process([]) is None
    assert upstream_version("580.159.04-0ubuntu0.24.04.1") == "580.159.04"
    assert upstream_version("1:580.95.05-1") == "580.95.05"
    assert upstream_version("580.95.05") == "580.95.05"
    assert upstream_version(None) is None


def test_smi_status():
    fact = NvidiaSmiStatus()
    ok = fact.process(["rc=0"] + read("nvidia-smi-L.txt").splitlines())
    assert ok == {"installed": True, "ok": True, "message": ""}
    mismatch = fact.process(
        ["rc=18", "Failed to initialize NVML: Driver/library version mismatch", "NVML library version: 580.95"]
    )
    assert mismatch["installed"] and not mismatch["ok"] and "version mismatch" in mismatch["message"]
    assert fact.process(["rc=missing"]) == {"installed": False, "ok": False, "message": ""}


def test_pci_gpu_count():
    import subprocess

    from rigforge.observe.facts.nvidia import NvidiaPciGpus

    fact = NvidiaPciGpus()
    two = ["pci 0000:01:00.0 0x2204", "pci 0000:02:00.0 0x2206", "end"]
    assert fact.process(two) == [("0000:01:00.0", "2204"), ("0000:02:00.0", "2206")]
    assert fact.process(["end"]) == []
    assert fact.process(["none"]) is None and fact.process([]) is None
    out = subprocess.run(["sh", "-c", fact.command], capture_output=True, text=True, check=True).stdout
    assert fact.process(out.splitlines()) == ([] if Path("/sys/bus/pci/devices").is_dir() else None)  # no GPU here


def test_pci_gpus_read_from_a_sysfs_shaped_tree(tmp_path):
    """The fact's own shell command over a sysfs-shaped tree (vendor, device, class files per function): only
    NVIDIA display controllers count, not their HDMI audio function or other vendors' devices."""
    import subprocess

    from rigforge.observe.facts.nvidia import NvidiaPciGpus

    for address, vendor, device, cls in [
        ("0000:00:00.0", "0x8086", "0x1237", "0x060000"),
        ("0000:01:00.0", "0x10de", "0x2204", "0x030000"),
        ("0000:01:00.1", "0x10de", "0x1aef", "0x040300"),
        ("0000:02:00.0", "0x10de", "0x2204", "0x030200"),
    ]:
        (tmp_path / address).mkdir()
        for name, value in (("vendor", vendor), ("device", device), ("class", cls)):
            (tmp_path / address / name).write_text(value + "\n")
    command = NvidiaPciGpus.command.replace("/sys/bus/pci/devices", str(tmp_path))
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout
    assert NvidiaPciGpus().process(out.splitlines()) == [("0000:01:00.0", "2204"), ("0000:02:00.0", "2204")]
