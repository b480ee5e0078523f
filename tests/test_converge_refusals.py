"""Tier 4: bad input and unfit hardware are refused on FRESH testbed rigs, before anything on them changes.

Each case runs a user's entry point (deploy/<variant>.py, deploy/site.py) over real SSH as the sudo user and
compares a snapshot of the rig (installed packages, /etc/apt, /opt/rigforge, /etc/systemd/system, with file
checksums) before and after. A refused run leaves the rig exactly as it was, so the host-data cases share one
fresh rig: the unchanged snapshot after each case is the proof that it is still fresh for the next one.

Hardware that only the driver can show (VRAM per card, a card's own power range) is checked right after the
driver role, on the same run: the driver is then the only change (no Docker, nothing under /opt/rigforge, no
units). Once the driver is in, the next run refuses in preflight with nothing changed at all. A GPU count short
of the variant's shows on the PCI bus and is refused before the driver.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from support import PYINFRA, REPO, changed, errored, inventory_with, pyinfra_run

pytestmark = pytest.mark.testbed
SNAPSHOT = (
    "dpkg-query -W -f '${Package} ${Version} ${db:Status-Abbrev}\\n' | sort; "
    "find /etc/apt /opt/rigforge /etc/systemd/system -xdev -printf '%p %s %m %l\\n' 2>/dev/null | sort; "
    "find /etc/apt /opt/rigforge /etc/systemd/system -xdev -type f -exec sha256sum {} + 2>/dev/null | sort"
)
NO_TOKEN = {"RIGFORGE_HF_TOKEN": "", "HF_TOKEN": ""}

# (entry point, host data, expected message); all refused while the plan is built, on the controller
HOST_DATA_CASES = [
    ("dual_turbo", {"gpu_power_limit_w": 90}, "gpu_power_limit_w must be whole watts in 100..600, got 90"),
    ("dual_turbo", {"gpu_power_limit_w": 5000}, "gpu_power_limit_w must be whole watts in 100..600, got 5000"),
    ("dual_turbo", {"gpu_power_limits": {2: 250}}, "gpu_power_limits names GPU(s) [2] but this rig has 2 GPU(s)"),
    ("dual_turbo", {"serving_max_model_len": -5}, "serving_max_model_len must be an integer in 1..1048576, got -5"),
    ("dual_turbo", {"serving_max_num_seqs": 0}, "serving_max_num_seqs must be an integer in 1..1024, got 0"),
    ("dual_turbo", {"serving_health_timeout": -1}, "serving_health_timeout must be a whole number of seconds"),
    ("dual_turbo", {"serving_health_timeout": "ten minutes"}, "got 'ten minutes'"),
    ("dual_turbo", {"serving_image": 'vllm/vllm-openai:x" y'}, "serving_image must be an image reference"),
    ("dual_turbo", {"serving_port": 70000}, "serving_port must be a port number in 1..65535, got 70000"),
    ("dual_turbo", {"rigforge_root": "/opt/rf;x"}, "rigforge_root must be an absolute path of letters, digits"),
    ("dual_turbo", {"rigforge_root": "/"}, "rigforge_root must be a directory of its own, not the system directory /"),
    ("dual_turbo", {"serving_model_dir": "/home"}, "not the system directory /home (e.g. /home/rigforge)"),
    ("dual_turbo", {"serving_port": 80}, "serving_port 80 is below 1024; choose 1024 or above"),
    ("dual_turbo", {"weights_source": "torrent"}, "weights_source must be one of: hub, controller; got 'torrent'"),
    ("dual_turbo", {"rigforge_variant": "dual"}, "this entry point deploys dual-turbo but host data sets"),
    ("dual_dflash", {}, "z-lab/Qwen3.6-27B-DFlash is gated, not yet fetched, and no HF token is set"),
    ("dual_dflash", {"hf_token": "hf_notTheRightOne"}, "the HF token was refused by http://127.0.0.1:"),
    ("dual_dflash", {"serving_kv_cache_dtype": "fp8_e5m2"}, "serving_kv_cache_dtype cannot be used with dual-dflash"),
    ("site", {"rigforge_variant": "dual-tubro"}, "unknown variant 'dual-tubro'; choose one of: dual, dual-turbo"),
    ("site", {}, "rigforge_variant is not set; choose one of: dual, dual-turbo"),
]


@pytest.fixture(scope="module")
def rigs(testbed_factory):
    """rig1: 2x 24 GB (the host-data cases), rig2: one GPU, rig3: 2x 20 GB cards whose PCI ID rigforge does not
    know (RTX 4000 Ada), rig4: 2x 24 GB (converges), rig5: 2x RTX 3060 (12 GB, told by its PCI ID)."""
    from rigforge.testbed import RigSpec

    ada = RigSpec(gpu_name="NVIDIA RTX 4000 Ada Generation", vram_mib=20475, pci_device="27b2")
    rtx3060 = RigSpec(gpu_name="NVIDIA GeForce RTX 3060", vram_mib=12288, pci_device="2503")
    return testbed_factory([RigSpec(), RigSpec(gpus=1), ada, RigSpec(), rtx3060], name="refusals")


def snapshot(rig) -> str:
    return rig.run(SNAPSHOT).stdout


def deploy(tb, tmp_path, rig: str, entry: str, data: dict, env: dict | None = None, *extra: str):
    inv = inventory_with(tb, tmp_path / f"inv-{rig}.py", {rig: data})
    return pyinfra_run(inv, REPO / "deploy" / f"{entry}.py", "--limit", rig, *extra, env={**NO_TOKEN, **(env or {})})


def assert_refused(results: dict, err: str, rig: str, expect: str, header: str = "rigforge refused on"):
    assert results.get("failed_hosts") in ("all", [rig]), err[-3000:]
    assert f"{header} {rig}:" in err and expect in err, err[-4000:]
    if header != "GPU check failed on":  # refused before anything changed
        assert changed(results, rig) == []


def said_before_the_driver(err: str, rig: str) -> None:
    """A refusal that comes right after the driver was said to come before it, and lists what the run installed
    (from the run's own record), instead of claiming that nothing changed."""
    assert f"{rig}: no NVIDIA driver answers yet: the cards' VRAM and power range are checked right after" in err
    message = err[err.index(f"GPU check failed on {rig}:") :]
    assert "Nothing was changed on this host." not in message.split("\n\n")[0], message[:2000]
    assert "This run changed this host before the check (the rest of the deploy did not run):" in message
    assert "Install NVIDIA" in message and "driver packages" in message, message[:2000]


def test_bad_host_data_is_refused_on_a_fresh_rig_with_nothing_changed(rigs, tmp_path):
    rig = rigs.rig("rig1")
    fresh = snapshot(rig)
    assert "docker.io" not in fresh and "/opt/rigforge" not in fresh
    ssh_port = rig.ssh_port  # the testbed's sshd listens on its own port, not 22
    ssh_case = ("dual_turbo", {"serving_port": ssh_port}, f"serving_port {ssh_port} is this rig's SSH port")
    for entry, data, expect in [*HOST_DATA_CASES, ssh_case]:
        results, err = deploy(rigs, tmp_path, "rig1", entry, data)
        assert_refused(results, err, "rig1", expect)
        assert err.count("rigforge refused on rig1:") == 1  # one message
        assert snapshot(rig) == fresh, f"{entry} {data} changed the rig"


def test_one_gpu_rig_is_refused_by_the_pci_count_before_the_driver(rigs, tmp_path):
    rig = rigs.rig("rig2")
    fresh = snapshot(rig)
    results, err = deploy(rigs, tmp_path, "rig2", "dual_turbo", {})
    assert_refused(
        results, err, "rig2", "dual-turbo needs 2 GPUs, the PCI bus shows 1 NVIDIA GPU(s)", "preflight failed on"
    )
    assert "this rig has 1 GPU(s) and the variant runs tensor-parallel over 2: add 1 GPU(s)" in err
    assert "choose a variant for this GPU count" not in err  # no such variant exists
    assert snapshot(rig) == fresh


def test_small_cards_are_refused_by_their_pci_device_id_before_the_driver(rigs, tmp_path):
    """An RTX 3060's 12 GB is known from its PCI device ID (10de:2503) before any driver exists: the refusal comes
    before anything changes, instead of after the driver went on."""
    rig = rigs.rig("rig5")
    fresh = snapshot(rig)
    results, err = deploy(rigs, tmp_path, "rig5", "dual_turbo", {})
    assert_refused(
        results,
        err,
        "rig5",
        "by PCI device ID (largest known build of the card; before any driver)",
        "preflight failed on",
    )
    assert "(GeForce RTX 3060, PCI ID 10de:2503) have 12288 MiB; every variant needs 24 GB cards" in err
    assert "Nothing was changed on this host." in err and "no NVIDIA driver answers yet" not in err
    assert snapshot(rig) == fresh


def test_dry_run_shows_every_refusal_in_full_and_exits_1(rigs, tmp_path):
    """`pyinfra --dry` is the fleet's pre-flight: every refusal in full, for every host, with or without -y; a
    refused host lists no operation after its refusal; exit 1; nothing changes."""
    rig1, rig2 = rigs.rig("rig1"), rigs.rig("rig2")
    before = snapshot(rig1), snapshot(rig2)
    inv = inventory_with(rigs, tmp_path / "dry.py", {"rig1": {"gpu_power_limit_w": 90}})
    for flags in (["--dry"], ["--dry", "-y"]):
        proc = subprocess.run(
            [PYINFRA, *flags, str(inv), str(REPO / "deploy" / "dual_turbo.py"), "--limit", "rig1", "--limit", "rig2"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out[-4000:]
        assert "rigforge refused on rig1:" in out and "gpu_power_limit_w must be whole watts in 100..600, got 90" in out
        assert "preflight failed on rig2:" in out and "needs 2 GPUs, the PCI bus shows 1 NVIDIA GPU(s)" in out
        listed = [line for line in out.split("Detected changes:")[-1].splitlines() if "rigforge site |" in line]
        if "-y" not in flags:  # the change listing: only the refusals
            assert listed and all("Refuse" in line or "refused" in line for line in listed), listed
    assert (snapshot(rig1), snapshot(rig2)) == before


def test_20gb_cards_are_refused_right_after_the_driver_then_in_preflight(rigs, tmp_path):
    rig = rigs.rig("rig3")
    fresh = snapshot(rig)
    results, err = deploy(rigs, tmp_path, "rig3", "dual_dflash", {}, {"RIGFORGE_HF_TOKEN": rigs.hf_token})
    assert_refused(results, err, "rig3", "dual-dflash (DFlash) needs 24 GB cards", "GPU check failed on")
    said_before_the_driver(err, "rig3")
    after = rig.run(SNAPSHOT).stdout
    # the driver is the only change: no Docker, nothing under /opt/rigforge, no units
    assert "docker.io" not in after and "/opt/rigforge" not in after
    units = [line for line in after.splitlines() if line.startswith("/etc/systemd/system")]
    assert units == [line for line in fresh.splitlines() if line.startswith("/etc/systemd/system")]
    assert rig.run("dpkg-query -W -f '${db:Status-Abbrev}' nvidia-open").stdout.strip() == "hi"  # held

    before = snapshot(rig)  # the driver answers now: preflight sees the cards and nothing changes
    results, err = deploy(rigs, tmp_path, "rig3", "dual_turbo", {})
    assert_refused(results, err, "rig3", "for 20 GB cards set serving_kv_cache_dtype: fp8_e5m2", "preflight failed on")
    assert snapshot(rig) == before


def test_a_cap_outside_the_cards_own_range_is_refused_right_after_the_driver(rigs, tmp_path):
    rig = rigs.rig("rig1")  # still fresh: every host-data case left it unchanged
    results, err = deploy(rigs, tmp_path, "rig1", "dual_turbo", {"gpu_power_limit_w": 400})
    assert_refused(
        results, err, "rig1", "power cap 400 W (gpu_power_limit_w) is outside GPU 0, 1", "GPU check failed on"
    )
    said_before_the_driver(err, "rig1")
    after = snapshot(rig)
    assert "docker.io" not in after and "/opt/rigforge" not in after
    assert "rigforge-gpu-power.service" not in after


def test_two_rigs_one_bad_knob_the_other_converges(rigs, tmp_path):
    """rig2 is refused (a knob that cannot even be parsed); rig4 converges in the same run, then changes nothing."""
    rig2, rig4 = rigs.rig("rig2"), rigs.rig("rig4")
    before = snapshot(rig2)
    inv = inventory_with(rigs, tmp_path / "two.py", {"rig2": {"serving_health_timeout": "ten minutes"}})
    results, err = pyinfra_run(inv, REPO / "deploy" / "dual_turbo.py", "--limit", "rig2", "--limit", "rig4")
    assert results["failed_hosts"] == ["rig2"], err[-4000:]
    assert "rigforge refused on rig2:" in err and "serving_health_timeout" in err
    assert len(errored(results, "rig2")) == 1 and changed(results, "rig2") == []
    assert snapshot(rig2) == before
    assert changed(results, "rig4") and errored(results, "rig4") == []
    assert json.loads(rig4.run("cat /etc/rigforge/rig.json").stdout)["variant"] == "dual-turbo"
    again, err = pyinfra_run(inv, REPO / "deploy" / "dual_turbo.py", "--limit", "rig4")
    assert again["failed_hosts"] == [] and changed(again) == [], err[-3000:]


@pytest.fixture(scope="module")
def cuda_rig(testbed_factory):
    """One fresh 2x 24 GB rig whose testbed images carry CUDA 13.2 (`testbed up --image-cuda 13.2`): the testbed
    lock is the fleet's, so it is a fleet of its own."""
    from rigforge.testbed import RigSpec

    return testbed_factory([RigSpec(image_cuda="13.2")], name="cuda")


def test_an_image_newer_than_the_drivers_cuda_is_refused_before_anything_changes(cuda_rig, tmp_path):
    """Driver branch 580 supports CUDA 13.0 (NVIDIA's table); a CUDA 13.2 image would fail with error 804 once
    vLLM starts on GeForce cards: preflight refuses on the fresh rig, in one line naming both versions, and
    `--dry` shows the same refusal."""
    rig = cuda_rig.rig("rig1")
    fresh = snapshot(rig)
    assert "cuda: '13.2'" in cuda_rig.lock.read_text()
    expect = (
        "image vllm/vllm-openai:nightly-7a1eb8ac2ec4ea69338c51dc7afd4b15010abfa8 needs CUDA 13.2, driver branch 580 "
        "supports CUDA 13.0 at most (GeForce cards fail with error 804 once vLLM starts); "
        "set nvidia_driver_branch: 595 (CUDA 13.2), or use an image built for CUDA <= 13.0."
    )
    results, err = deploy(cuda_rig, tmp_path, "rig1", "dual_turbo", {})
    assert_refused(results, err, "rig1", f"  - {expect}\nNothing was changed on this host.", "preflight failed on")
    assert snapshot(rig) == fresh
    inv = inventory_with(cuda_rig, tmp_path / "dry.py", {"rig1": {}})
    proc = subprocess.run(
        [PYINFRA, "--dry", str(inv), str(REPO / "deploy" / "dual_turbo.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1 and expect in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]
    assert snapshot(rig) == fresh


NOT_RIGFORGES = [  # (host data, the refusal): state that belongs to a package manager or a container runtime
    (
        {"rigforge_root": "/var/lib/dpkg"},
        "rigforge_root must be a directory of its own outside /var/lib/dpkg, dpkg's "
        "package database (e.g. /opt/rigforge), got '/var/lib/dpkg'",
    ),
    ({"rigforge_root": "/var/lib/apt"}, "outside /var/lib/apt, apt's package lists and state (e.g. /opt/rigforge)"),
    (
        {"serving_model_dir": "/var/lib/containerd/models"},
        "serving_model_dir must be a directory of its own outside "
        "/var/lib/containerd, containerd's images and containers",
    ),
    (
        {"docker_daemon_options": {"data-root": "/opt/rigforge/docker"}},
        "docker_daemon_options data-root='/opt/rigforge/docker' is inside rigforge_root /opt/rigforge: Docker's "
        "data-root and rigforge's dirs never share a tree; choose a data-root apart from it (e.g. /var/lib/docker).",
    ),
]
STATE_DIRS = "/var/lib/dpkg /var/lib/apt /var/lib/containerd"


def rigforge_dirs_in_state_dirs(rig) -> str:
    """What rigforge would make inside the state dirs (models/, serve/, src/, venv/): '' when none is there."""
    names = "-name models -o -name serve -o -name src -o -name venv"
    return rig.run(f"find {STATE_DIRS} -maxdepth 1 \\( {names} \\) 2>/dev/null").stdout


def test_roots_and_data_roots_that_are_not_rigforges_are_refused_with_nothing_changed(rigs, tmp_path):
    """dpkg's, apt's and containerd's state dirs, and a Docker data-root inside the root, are refused on a fresh rig
    by the host-data checks: one message, nothing changed, no rigforge dir made inside them."""
    rig = rigs.rig("rig1")
    fresh = snapshot(rig)
    for data, expect in NOT_RIGFORGES:
        results, err = deploy(rigs, tmp_path, "rig1", "dual_turbo", data)
        assert_refused(results, err, "rig1", expect)
        assert err.count("rigforge refused on rig1:") == 1  # one message
        assert snapshot(rig) == fresh, f"{data} changed the rig"
        assert rigforge_dirs_in_state_dirs(rig) == "", data


def test_a_rigs_data_root_holding_the_root_is_refused_with_an_example_outside_it(rigs, tmp_path):
    """The rig's own daemon.json sets data-root /opt: the default root /opt/rigforge is refused in preflight, and the
    refusal offers a root outside /opt, never /opt/rigforge, the very path it refuses."""
    rig = rigs.rig("rig1")
    rig.run("""mkdir -p /etc/docker && echo '{"data-root": "/opt"}' > /etc/docker/daemon.json""", True)
    try:
        before = snapshot(rig)
        results, err = deploy(rigs, tmp_path, "rig1", "dual_turbo", {})
        assert_refused(
            results,
            err,
            "rig1",
            "rigforge_root /opt/rigforge is inside /opt, Docker's data-root set in /etc/docker/daemon.json; choose a "
            "directory of its own outside it (e.g. /srv/rigforge)",
            "preflight failed on",
        )
        assert "e.g. /opt/rigforge" not in err
        assert snapshot(rig) == before
    finally:
        rig.run("rm -rf /etc/docker", True)


def test_a_data_root_move_names_the_old_one_with_its_size_and_deletes_nothing(rigs, tmp_path):
    """`--dry` with docker_daemon_options moving Docker's data-root: the rig's /var/lib/docker (5 MB here) is named
    with its size once preflight passed, as a warning, not a change; it stays as it was. Once the rig's daemon.json
    sets the new data-root, `rigforge status` notes the old one the same way."""
    rig = rigs.rig("rig1")
    rig.run("mkdir -p /var/lib/docker && head -c 5000000 /dev/zero > /var/lib/docker/blob", True)
    try:
        before = snapshot(rig)
        data = {"docker_daemon_options": {"data-root": "/srv/docker"}}
        inv = inventory_with(rigs, tmp_path / "move.py", {"rig1": data})
        proc = subprocess.run(
            [PYINFRA, "--dry", str(inv), str(REPO / "deploy" / "dual_turbo.py"), "--limit", "rig1"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, **NO_TOKEN},
        )
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        assert (
            "rig1: WARNING: this run sets Docker's data-root to /srv/docker in /etc/docker/daemon.json; "
            "/var/lib/docker, the one it uses now, holds 5.0 MB; rigforge neither copies nor deletes it; once the rig "
            "serves from /srv/docker, remove it with: sudo rm -rf /var/lib/docker"
        ) in out, out[-4000:]
        assert "refused" not in out and out.count("/var/lib/docker, the one it uses now") == 1
        assert snapshot(rig) == before
        assert rig.run("stat -c %s /var/lib/docker/blob", True).stdout.strip() == "5000000"
        rig.run("""mkdir -p /etc/docker && echo '{"data-root": "/srv/docker"}' > /etc/docker/daemon.json""", True)
        status = subprocess.run(
            [PYINFRA.replace("pyinfra", "rigforge"), "status", str(inv)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
        assert (
            "rig1: note: /etc/docker/daemon.json sets Docker's data-root to /srv/docker; /var/lib/docker, an earlier "
            "one that Docker no longer uses, holds 5.0 MB; rigforge neither copies nor deletes it; once the rig serves "
            "from /srv/docker, remove it with: sudo rm -rf /var/lib/docker"
        ) in status.stdout, status.stdout[-4000:] + status.stderr[-4000:]
        assert "rig2: note:" not in status.stdout  # Docker's default data-root, in use
        assert rig.run("stat -c %s /var/lib/docker/blob", True).stdout.strip() == "5000000"
    finally:
        rig.run("rm -rf /var/lib/docker /etc/docker", True)
