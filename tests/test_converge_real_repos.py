"""Tier 4: the host roles against repositories named like the vendors' and rigs set up by hand (simulated GPUs).

- A rig set up by hand from Docker's and NVIDIA's instructions (`testbed up --preset handmade`: docker.io with
  Debian's compose and buildx plugins, Docker's one-line docker.list + docker.asc, the toolkit's
  nvidia-container-toolkit.list): with adoption off, preflight refuses it naming the files and nothing changes;
  then it converges with one source file per URI and a clean `apt-get update`, Docker's packages in place of
  Debian's, and a second run changes nothing. The Debian-scheme driver is installed (pinning package first: the
  repo also has branch 590), held, and `rigforge verify`'s driver check passes.
- A key whose fingerprint is not the pinned one is refused before apt sees it.
- A running driver that no package owns (`--preset unowned`, as NVIDIA's .run installer leaves a rig) is refused
  in preflight with one line; with `nvidia_driver_manage: false` rigforge leaves it alone and checks its branch.
No systemd runs in the chroot rigs: services are installed, not started (rigforge_manage_services=False).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import support
from test_converge_host import DEPLOY, rig_snapshot

from rigforge.observe.facts.apt import AptSourceFiles, normalize_uri

pytestmark = pytest.mark.testbed


def run(tb, *data: str) -> tuple[dict, str]:
    args = [arg for item in data for arg in ("--data", item)]
    return support.pyinfra_run(tb.inventory, DEPLOY, *args)


def docker_repo(tb) -> list[str]:
    """Docker's packages from the testbed's Docker-layout repository (the hand-set-up docker.list points there)."""
    return [
        "docker_source=docker",
        f"docker_repo_url={tb.docker_repo_url}",
        f"docker_repo_key_url={tb.docker_repo_key_url}",
        f"docker_repo_key_fingerprint={tb.repo_key_fingerprint}",
    ]


def sources_by_uri(rig) -> dict[str, list[str]]:
    files = AptSourceFiles().process(rig.run(AptSourceFiles.command).stdout.splitlines())
    by_uri: dict[str, list[str]] = {}
    for path, uris in files.items():
        for uri in uris:
            by_uri.setdefault(normalize_uri(uri), []).append(path)
    return by_uri


@pytest.fixture(scope="module")
def handmade(testbed_factory):
    from rigforge.testbed import RigSpec

    return testbed_factory([RigSpec(preset="handmade")], name="handmade")


def test_handmade_rig_is_what_the_instructions_leave(handmade):
    rig = handmade.rig("rig1")
    listed = rig.run("dpkg -l docker.io docker-compose docker-buildx").stdout
    assert all(f"ii  {name} " in listed for name in ("docker.io", "docker-compose", "docker-buildx")), listed
    docker_list = (rig.rootfs / "etc/apt/sources.list.d/docker.list").read_text()
    assert docker_list.startswith("deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.asc] ")
    assert (rig.rootfs / "etc/apt/keyrings/docker.asc").exists()
    assert (rig.rootfs / "etc/apt/sources.list.d/nvidia-container-toolkit.list").exists()


def test_adoption_off_refuses_in_preflight_with_nothing_changed(handmade):
    rig = handmade.rig("rig1")
    before = rig_snapshot(rig)
    results, err = run(handmade, *docker_repo(handmade), "apt_adopt_sources=false")
    assert results["failed_hosts"] == "all", err[-3000:]
    assert support.changed(results) == []
    assert "preflight failed on rig1" in err
    for name in ("docker.list", "nvidia-container-toolkit.list"):
        assert f"/etc/apt/sources.list.d/{name} already points at" in err, err[-3000:]
    assert "apt_adopt_sources: true" in err
    assert rig_snapshot(rig) == before


@pytest.fixture(scope="module")
def adopted(handmade):
    first, err = run(handmade, *docker_repo(handmade))
    assert first.get("failed_hosts") == [], err[-6000:]
    second, err2 = run(handmade, *docker_repo(handmade))
    return handmade, first, second, err2


def test_handmade_rig_converges_with_one_source_per_uri(adopted):
    tb, first, _, _ = adopted
    rig = tb.rig("rig1")
    changed = support.changed(first)
    assert any("Remove the distribution's conflicting Docker packages" in n for n in changed)
    assert any(f"Replace other apt sources for {tb.docker_repo_url}" in n for n in changed)
    by_uri = sources_by_uri(rig)
    assert all(len(paths) == 1 for paths in by_uri.values()), by_uri
    assert by_uri[normalize_uri(tb.docker_repo_url)] == ["/etc/apt/sources.list.d/rigforge-docker.sources"]
    assert by_uri[normalize_uri(tb.toolkit_repo_url)] == [
        "/etc/apt/sources.list.d/rigforge-nvidia-container-toolkit.sources"
    ]
    kept = rig.rootfs / "etc/apt/sources.list.d/docker.list.rigforge-bak"
    assert kept.read_text().startswith("deb [arch=amd64 signed-by=/etc/apt/keyrings/docker.asc]")
    update = rig.run("apt-get update 2>&1")
    assert update.returncode == 0, update.stdout
    assert [line for line in update.stdout.splitlines() if line[:2] in ("W:", "E:", "N:")] == [], update.stdout
    packages = rig.run("dpkg-query -W -f '${Package} ${db:Status-Abbrev}\\n'").stdout
    assert "docker.io ii" not in packages and "docker-ce ii" in packages
    # Debian's buildx plugin shares a file with Docker's and declares no conflict with it: removed first
    assert "docker-buildx ii" not in packages and "docker-buildx-plugin ii" in packages
    assert rig.run("docker buildx version && docker compose version").returncode == 0


def test_second_run_changes_nothing(adopted):
    _, _, second, err = adopted
    assert second.get("failed_hosts") == [], err[-4000:]
    assert support.changed(second) == [], support.changed(second)


@pytest.fixture(scope="module")
def handmade_distro(testbed_factory):
    from rigforge.testbed import RigSpec

    return testbed_factory([RigSpec(preset="handmade")], name="handmade-distro")


def test_a_handmade_rig_converges_with_the_distro_docker_set_cli_included(handmade_distro):
    """Debian 13's docker.io only recommends docker-cli (/usr/bin/docker): a rig set up with --no-install-recommends
    has no `docker`. The distro Docker set installs it, so the compose file's validation (`docker compose config`)
    finds it; then a second run changes nothing."""
    rig = handmade_distro.rig("rig1")
    assert rig.run("test -e /usr/bin/docker").returncode == 1
    first, err = run(handmade_distro, "docker_source=distro")
    assert first.get("failed_hosts") == [], err[-6000:]
    assert any("Install Docker engine and compose v2 (distro packages)" in n for n in support.changed(first))
    packages = rig.run("dpkg-query -W -f '${Package} ${db:Status-Abbrev}\\n'").stdout
    assert "docker.io ii" in packages and "docker-cli ii" in packages and "docker-ce ii" not in packages
    assert rig.run("docker compose version").returncode == 0
    second, err = run(handmade_distro, "docker_source=distro")
    assert second.get("failed_hosts") == [] and support.changed(second) == [], err[-4000:]


def test_debian_scheme_driver_is_installed_held_and_verified(adopted):
    tb = adopted[0]
    rig = tb.rig("rig1")
    versions = rig.run("dpkg-query -W -f '${Package} ${Version}\\n' 'nvidia-*'").stdout.splitlines()
    assert "nvidia-open 580.159.04-1" in versions and "nvidia-kernel-open-dkms 580.159.04-1" in versions
    assert "nvidia-driver-pinning-580 1.0-1" in versions
    held = rig.run("apt-mark showhold").stdout.split()
    driver = ["nvidia-driver-cuda", "nvidia-driver-pinning-580", "nvidia-kernel-open-dkms", "nvidia-open"]
    toolkit = ["libnvidia-container-tools", "libnvidia-container1", "nvidia-container-toolkit"]
    assert sorted(held) == sorted([*driver, *toolkit, "nvidia-container-toolkit-base"])  # the toolkit: the lock's pin
    proc = subprocess.run(
        [sys.executable, "-m", "rigforge.cli", "verify", str(tb.inventory), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    checks = {c["name"]: c for c in json.loads(proc.stdout)["hosts"]["rig1"]["checks"]}
    driver = checks["driver module = package"]
    assert driver["status"] == "pass", driver
    assert driver["detail"] == "module 580.159.04 = nvidia-kernel-open-dkms 580.159.04-1"


def test_a_key_with_another_fingerprint_never_reaches_apt(adopted):
    tb = adopted[0]
    rig = tb.rig("rig1")
    keyring = rig.rootfs / "etc/apt/keyrings/rigforge-nvidia-cuda.asc"
    keyring.unlink()
    nvidia_key = "EB693B3035CD5710E231E123A4B469963BF863CC"  # NVIDIA's real key: not what the testbed signs with
    results, err = run(tb, *docker_repo(tb), f"nvidia_driver_repo_key_fingerprint={nvidia_key}")
    assert results["failed_hosts"] == "all", err[-3000:]
    assert f"key fingerprint {tb.repo_key_fingerprint}, expected {nvidia_key}" in err, err[-3000:]
    assert not keyring.exists()
    again, err = run(tb, *docker_repo(tb))
    assert again.get("failed_hosts") == [], err[-3000:]
    assert keyring.exists()


@pytest.fixture(scope="module")
def unowned(testbed_factory):
    from rigforge.testbed import RigSpec

    return testbed_factory([RigSpec(preset="unowned")], name="unowned")


def test_running_driver_no_package_owns_is_refused_in_one_line(unowned):
    rig = unowned.rig("rig1")
    assert rig.run("dpkg -S /usr/bin/nvidia-smi").returncode != 0
    before = rig_snapshot(rig)
    results, err = run(unowned)
    assert results["failed_hosts"] == "all", err[-3000:]
    (line,) = [line for line in err.splitlines() if "no package owns" in line]
    assert "NVIDIA driver 580.159.04 is running but no package owns /usr/bin/nvidia-smi" in line
    assert "nvidia_driver_manage: false" in line
    assert rig_snapshot(rig) == before


def test_driver_left_alone_with_manage_false(unowned):
    rig = unowned.rig("rig1")
    wrong, err = run(unowned, "nvidia_driver_manage=false", "nvidia_driver_branch=590")
    assert wrong["failed_hosts"] == "all" and "the running NVIDIA driver is 580.159.04, not branch 590" in err
    first, err = run(unowned, "nvidia_driver_manage=false")
    assert first.get("failed_hosts") == [], err[-4000:]
    assert not any(n.startswith("NVIDIA driver | ") and "Check the running" not in n for n in support.changed(first))
    assert rig.run("dpkg -l 'nvidia-open' 'nvidia-driver-pinning-*' 2>/dev/null | grep -c '^ii'").stdout.strip() == "0"
    assert not (rig.rootfs / "etc/apt/sources.list.d/rigforge-nvidia-cuda.sources").exists()
    second, err = run(unowned, "nvidia_driver_manage=false")
    assert support.changed(second) == [], err[-3000:]
