"""Tier 1: system facts. Parsers on real file contents; shell commands run for real on this machine."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from rigforge.observe.facts.system import (
    AptHeldPackages,
    FreeDiskBytes,
    OsRelease,
    SecureBoot,
    SystemdUnitEnabled,
)

FIXTURES = Path(__file__).parent / "fixtures" / "nvidia-smi" / "h200x2-driver580"

DEBIAN_13 = """PRETTY_NAME="Debian GNU/Linux 13 (trixie)"
NAME="Debian GNU/Linux"
VERSION_ID="13"
VERSION="13 (trixie)"
VERSION_CODENAME=trixie
DEBIAN_VERSION_FULL=13.2
ID=debian
"""
UBUNTU_2204 = """PRETTY_NAME="Ubuntu 22.04.5 LTS"
NAME="Ubuntu"
VERSION_ID="22.04"
VERSION="22.04.5 LTS (Jammy Jellyfish)"
VERSION_CODENAME=jammy
ID=ubuntu
ID_LIKE=debian
UBUNTU_CODENAME=jammy
"""


def run(command) -> list[str]:
    out = subprocess.run(
        ["sh", "-c", command.get_raw_value() if hasattr(command, "get_raw_value") else command],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.splitlines()


def test_os_release_from_real_ubuntu_2404_capture():
    misc = FIXTURES.joinpath("misc.txt").read_text()
    block = misc.split("+ cat /etc/os-release\n", 1)[1].split("+ echo", 1)[0]
    assert OsRelease().process(block.splitlines()) == {"id": "ubuntu", "version_id": "24.04", "codename": "noble"}


def test_os_release_debian_and_ubuntu_2204():
    assert OsRelease().process(DEBIAN_13.splitlines()) == {"id": "debian", "version_id": "13", "codename": "trixie"}
    assert OsRelease().process(UBUNTU_2204.splitlines())["codename"] == "jammy"
    assert OsRelease().process([]) == {"id": "", "version_id": "", "codename": ""}


def test_os_release_command_on_this_machine():
    facts = OsRelease().process(run(OsRelease.command))
    assert facts["id"] and facts["version_id"]


def test_secure_boot_states():
    assert SecureBoot().process(["SecureBoot enabled"]) == "enabled"
    assert SecureBoot().process(["SecureBoot disabled", "Platform is in Setup Mode"]) == "disabled"
    assert SecureBoot().process(["efivar=1"]) == "enabled"
    assert SecureBoot().process(["efivar=0"]) == "disabled"
    assert SecureBoot().process(["noefi"]) == "disabled"
    assert SecureBoot().process(["unknown"]) == "unknown"
    assert SecureBoot().process(["EFI variables are not supported on this system"]) == "unknown"
    assert SecureBoot().process(run(SecureBoot.command)) in ("enabled", "disabled", "unknown")


def test_free_disk_bytes_matches_statvfs_and_walks_up_to_an_existing_parent(tmp_path):
    fact = FreeDiskBytes()
    st = os.statvfs(tmp_path)
    expected = st.f_bavail * st.f_frsize
    measured = fact.process(run(fact.command(path=str(tmp_path / "not" / "there yet" / "models"))))
    # the same filesystem, measured a moment apart
    assert abs(measured - expected) < 64 * 1024 * 1024
    assert fact.process(run(fact.command(path=str(tmp_path)))) > 0
    assert fact.process([]) is None


def test_free_disk_bytes_quotes_the_path(tmp_path):
    odd = tmp_path / "a b; touch pwned"
    odd.mkdir()
    assert FreeDiskBytes().process(run(FreeDiskBytes().command(path=str(odd)))) > 0
    assert not Path("pwned").exists()


def test_held_packages_read_from_a_real_dpkg_database(tmp_path, monkeypatch):
    """dpkg-query against a status file of held, installed and Multi-Arch: same packages (DPKG_ADMINDIR)."""
    entry = "Package: {0}\nStatus: {1} ok installed\nArchitecture: {2}\nVersion: 1\nMulti-Arch: same\n\n"
    (tmp_path / "status").write_text(
        entry.format("nvidia-open", "hold", "amd64")
        + entry.format("docker-ce", "install", "amd64")
        + entry.format("libnvidia-compute-580", "hold", "amd64")
        + entry.format("libnvidia-compute-580", "hold", "i386")
    )
    (tmp_path / "info").mkdir()
    (tmp_path / "updates").mkdir()
    monkeypatch.setenv("DPKG_ADMINDIR", str(tmp_path))
    assert AptHeldPackages().process(run(AptHeldPackages.command)) == ["libnvidia-compute-580", "nvidia-open"]


def test_held_packages_and_unit_enabled():
    assert AptHeldPackages().process(["nvidia-driver-580-open", "", "libnvidia-compute-580"]) == [
        "libnvidia-compute-580",
        "nvidia-driver-580-open",
    ]
    fact = SystemdUnitEnabled()
    assert "is-enabled" in str(fact.command(unit="rigforge-gpu-power.service"))
    assert fact.process(["enabled"]) is True
    assert fact.process(["disabled"]) is False
    assert fact.process([]) is False
