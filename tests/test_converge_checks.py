"""Tier 4 (issue 32): what can be checked before the first change is, on FRESH testbed rigs.

Each case sets the rig up as a user's rig may be (a hand-edited /etc/docker/daemon.json, ...), takes a snapshot
(installed packages, holds, every file under /etc/apt, /etc/docker, /etc/systemd/system and /opt/rigforge with
its checksum), runs the user's entry point over real SSH, and compares: a refused run leaves the rig byte-identical,
and `pyinfra --dry` exits 1 with the same line.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from support import PYINFRA, REPO, changed, inventory_with, pyinfra_run

pytestmark = pytest.mark.testbed
TREES = "/etc/apt /etc/docker /etc/systemd/system /opt/rigforge"
SNAPSHOT = (
    "dpkg -l | sort; echo '-- holds'; apt-mark showhold | sort; echo '-- files'; "
    f"find {TREES} -xdev -printf '%p %s %m %l\\n' 2>/dev/null | sort; "
    f"find {TREES} -xdev -type f -exec sha256sum {{}} + 2>/dev/null | sort"
)
NO_TOKEN = {"RIGFORGE_HF_TOKEN": "", "HF_TOKEN": ""}


@pytest.fixture(scope="module")
def rigs(testbed_factory):
    """rig1: a fresh 2x 24 GB rig every case leaves as it found it; rig2: the same, for the case that installs the
    driver before its refusal."""
    from rigforge.testbed import RigSpec

    return testbed_factory([RigSpec(), RigSpec()], name="checks")


def snapshot(rig) -> str:
    return rig.run(SNAPSHOT).stdout


def dry(inv, entry: str, *rigs: str) -> tuple[int, str]:
    """`pyinfra --dry INVENTORY deploy/<entry>.py --limit RIG...`: (exit code, output)."""
    limits = [arg for rig in rigs for arg in ("--limit", rig)]
    proc = subprocess.run(
        [PYINFRA, "--dry", str(inv), str(REPO / "deploy" / f"{entry}.py"), *limits],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **NO_TOKEN},
    )
    return proc.returncode, proc.stdout + proc.stderr


def refused(tb, tmp_path, rig: str, data: dict, expect: str, header: str, entry: str = "dual_turbo") -> str:
    """Deploy `entry` on `rig`, then the same with `--dry`: both refuse the host with the line `expect`, under
    `header`, before any change, and exit non-zero; returns the line as the run printed it."""
    inv = inventory_with(tb, tmp_path / f"inv-{rig}.py", {rig: data})
    results, err = pyinfra_run(inv, REPO / "deploy" / f"{entry}.py", "--limit", rig, env=NO_TOKEN)
    assert results.get("failed_hosts") in ("all", [rig]), err[-3000:]
    assert f"{header} {rig}:" in err and expect in err, err[-4000:]
    assert err.count(f"{header} {rig}:") == 1 and changed(results, rig) == []
    (line,) = {line for line in err.splitlines() if expect in line}
    returncode, out = dry(inv, entry, rig)
    assert returncode == 1, out[-4000:]
    assert line in out.splitlines(), out[-4000:]
    return line


@pytest.mark.parametrize(
    "text",
    ['{\n  // the nvidia runtime goes here\n  "log-driver": "json-file"\n}\n', '{\n  "log-driver": "json-file",\n}\n'],
    ids=["comment", "trailing-comma"],
)
def test_an_invalid_daemon_json_is_refused_before_the_first_change(rigs, tmp_path, text):
    rig = rigs.rig("rig1")
    assert rig.run("test -e /etc/docker").returncode == 1  # a fresh rig: no Docker config yet
    rig.run(f"mkdir -p /etc/docker && printf %s {shlex.quote(text)} > /etc/docker/daemon.json", True)
    try:
        before = snapshot(rig)
        assert "/etc/docker/daemon.json" in before and "docker.io" not in before
        line = refused(
            rigs, tmp_path, "rig1", {}, "/etc/docker/daemon.json on rig1 is not valid JSON (", "preflight failed on"
        )
        assert line.endswith("fix it (no comments, no trailing commas) or remove it, then re-run."), line
        assert snapshot(rig) == before
    finally:
        rig.run("rm -rf /etc/docker", True)


def test_a_driver_branch_the_repository_does_not_publish_is_refused_before_the_first_change(rigs, tmp_path):
    """Issue 32 case 3: branch 595 on the testbed's CUDA repository (it publishes 580 and 590) is refused in
    preflight, read from the repository's index with curl, naming the published branches; nothing changed."""
    rig = rigs.rig("rig1")
    before = snapshot(rig)
    line = refused(
        rigs,
        tmp_path,
        "rig1",
        {"nvidia_driver_branch": 595},
        "nvidia_driver_branch 595: NVIDIA's repository",
        "preflight failed on",
    )
    assert "does not publish nvidia-driver-pinning-595; it publishes driver branches 580, 590" in line, line
    assert snapshot(rig) == before


def test_dry_on_a_fresh_rig_names_the_remote_sources_it_asked_and_that_they_answer(rigs):
    """The same pass, when every source answers: `--dry` says which were asked (what a first run fetches from)."""
    returncode, out = dry(rigs.inventory, "dual_turbo", "rig1")
    assert returncode == 0, out[-4000:]
    (line,) = [line for line in out.splitlines() if "remote sources this run fetches from answer" in line]
    assert (
        "rig1: 2 of 2 remote sources this run fetches from answer (NVIDIA's container toolkit repository, "
        "Hugging Face repository Lorbus/Qwen3.6-27B-int4-AutoRound)" in line
    ), line


def test_a_docker_repository_without_this_suite_is_refused_before_the_first_change(rigs, tmp_path):
    """Issue 32: preflight asks each remote source the run fetches from, from the rig, before any change. Docker's
    repository answering 404 for this release's suite is a definite no: refused, nothing changed, --dry the same."""
    rig = rigs.rig("rig1")
    before = snapshot(rig)
    data = {
        "docker_source": "docker",
        "docker_repo_url": f"{rigs.apt_url}/no-docker-here",
        "docker_repo_key_url": rigs.docker_repo_key_url,
        "docker_repo_key_fingerprint": rigs.repo_key_fingerprint,
    }
    line = refused(rigs, tmp_path, "rig1", data, "Docker's repository says HTTP 404 for", "preflight failed on")
    assert f"{rigs.apt_url}/no-docker-here/dists/trixie/InRelease: it has no 'trixie' suite" in line, line
    assert snapshot(rig) == before


ROOT_CASES = [  # (host data, the refusal): trees something else manages, for the root and the model dir alike
    (
        {"rigforge_root": "/var/lib/docker"},
        "rigforge_root must be a directory of its own outside /var/lib/docker, "
        "Docker's default data-root (e.g. /opt/rigforge), got '/var/lib/docker'",
    ),
    ({"rigforge_root": "/etc/rigforge"}, "outside /etc/rigforge, rigforge's own config dir"),
    ({"rigforge_root": "/etc/systemd"}, "rigforge_root must be a directory of its own outside /etc/systemd"),
    ({"rigforge_root": "/proc/x"}, "outside /proc, the kernel's process file system (e.g. /opt/rigforge)"),
    ({"serving_model_dir": "/tmp/models"}, "serving_model_dir must be a directory of its own outside /tmp"),
    ({"serving_model_dir": "/boot/models"}, "outside /boot, the kernels and boot loader"),
]


def test_roots_inside_trees_something_else_manages_are_refused_before_the_first_change(rigs, tmp_path):
    rig = rigs.rig("rig1")
    fresh = snapshot(rig)
    for data, expect in ROOT_CASES:
        line = refused(rigs, tmp_path, "rig1", data, expect, "rigforge refused on")
        assert "/tmp/rigforge" not in line and "/boot/rigforge" not in line
        assert snapshot(rig) == fresh, data


def test_a_root_inside_the_data_root_the_rigs_daemon_json_sets_is_refused(rigs, tmp_path):
    rig = rigs.rig("rig1")
    rig.run("""mkdir -p /etc/docker && echo '{"data-root": "/srv/docker"}' > /etc/docker/daemon.json""", True)
    try:
        before = snapshot(rig)
        refused(
            rigs,
            tmp_path,
            "rig1",
            {"rigforge_root": "/srv/docker/rigforge"},
            "rigforge_root /srv/docker/rigforge is inside /srv/docker, Docker's data-root set in "
            "/etc/docker/daemon.json; choose a directory of its own outside it (e.g. /opt/rigforge)",
            "preflight failed on",
        )
        assert snapshot(rig) == before
    finally:
        rig.run("rm -rf /etc/docker", True)


def test_a_changed_root_is_named_with_the_old_trees_size(rigs, tmp_path):
    """rig.json records the root an earlier deploy used; a deploy with another root warns, once preflight passed,
    naming the old tree, its size and how to remove it (nothing is removed)."""
    rig = rigs.rig("rig1")
    recorded = """'{"root": "/srv/old-rf", "models": "/srv/old-rf/models"}'"""
    rig.run(
        "mkdir -p /etc/rigforge /srv/old-rf/models && truncate -s 2500000000 /srv/old-rf/models/w.safetensors"
        f" && echo {recorded} > /etc/rigforge/rig.json",
        True,
    )
    try:
        inv = inventory_with(rigs, tmp_path / "inv.py", {"rig1": {}})
        returncode, out = dry(inv, "dual_turbo", "rig1")
        assert returncode == 0, out[-4000:]
        assert (
            "rig1: WARNING: rigforge_root changed: /srv/old-rf, the earlier deploy's (recorded in "
            "/etc/rigforge/rig.json), holds 2.5 GB and is no longer used; rigforge leaves it as it is; once the rig "
            "serves from the new one, remove it with: sudo rm -rf /srv/old-rf"
        ) in out, out[-4000:]
    finally:
        rig.run("rm -rf /etc/rigforge /srv/old-rf", True)


def test_a_refused_hf_token_is_not_called_a_problem_in_host_data(rigs, tmp_path):
    rig = rigs.rig("rig1")
    fresh = snapshot(rig)
    data = {"hf_token": "hf_notTheRightOne"}
    refused(
        rigs,
        tmp_path,
        "rig1",
        data,
        "the HF token was refused by http://127.0.0.1:",
        "rigforge refused on",
        entry="dual_dflash",
    )
    inv = inventory_with(rigs, tmp_path / "dry.py", {"rig1": data})
    _, out = dry(inv, "dual_dflash", "rig1")
    listed = [line for line in out.splitlines() if "rigforge site |" in line and "Refuse" in line]
    assert listed and all("Refuse rig1: no usable HF token for the gated weights" in line for line in listed), out
    assert "in host data" not in out, out[-3000:]
    assert snapshot(rig) == fresh


def test_a_cap_the_cards_refuse_is_never_warned_as_kept(rigs, tmp_path):
    """400 W: outside the recipe repo's 220..330 W (a warning) and outside the cards' own 100..350 W (a refusal,
    right after the driver on a fresh rig, in preflight once the driver answers). No warning says it is kept."""
    inv = inventory_with(rigs, tmp_path / "inv.py", {"rig2": {"gpu_power_limit_w": 400}})
    results, err = pyinfra_run(inv, REPO / "deploy" / "dual_turbo.py", "--limit", "rig2", env=NO_TOKEN)
    assert "GPU check failed on rig2:" in err and "power cap 400 W (gpu_power_limit_w) is outside" in err, err[-3000:]
    warned = [line for line in err.splitlines() if "WARNING: power cap 400 W" in line]
    kept = "kept as set if the cards' own range allows it (checked once the driver answers)"
    assert warned and all(line.endswith(kept) for line in warned), warned
    results, err = pyinfra_run(inv, REPO / "deploy" / "dual_turbo.py", "--limit", "rig2", env=NO_TOKEN)
    assert "preflight failed on rig2:" in err and "power cap 400 W (gpu_power_limit_w) is outside" in err, err[-3000:]
    assert "WARNING: power cap" not in err and "kept as set" not in err, err[-3000:]


def test_one_machine_under_two_inventory_names_is_refused_naming_both(rigs, tmp_path):
    """rig1 and rig1-again reach the same machine (machine-id and SSH host key): each is refused before the first
    change, naming both; rig2 (a machine-id of its own) is not its twin."""
    rig1, rig2 = rigs.rig("rig1"), rigs.rig("rig2")
    ids = [rig.run("cat /etc/machine-id", True).stdout.strip() for rig in (rig1, rig2)]
    assert len(ids[0]) == 32 and ids[0] != ids[1]
    fresh = snapshot(rig1)
    inv = tmp_path / "twins.py"
    inv.write_text(f"exec(open({str(rigs.inventory)!r}).read())\nrigs = [*rigs, ('rig1-again', dict(rigs)['rig1'])]\n")
    results, err = pyinfra_run(
        inv, REPO / "deploy" / "dual_turbo.py", "--limit", "rig1", "--limit", "rig1-again", env=NO_TOKEN
    )
    assert results.get("failed_hosts") in ("all", ["rig1", "rig1-again"]), err[-3000:]
    lines = sorted(line for line in err.splitlines() if "are one machine" in line)
    assert len(lines) == 2, err[-4000:]
    for name, other in (("rig1", "rig1-again"), ("rig1-again", "rig1")):
        (line,) = [line for line in lines if f"rigforge refused on {name}: " in line]
        assert f"{name} and {other} are one machine (machine-id {ids[0]}, SSH host key SHA256:" in line
        assert line.endswith("): keep one of these names in the inventory; nothing was changed.")
    assert "being provisioned by" not in err
    returncode, out = dry(inv, "dual_turbo", "rig1", "rig1-again")
    assert returncode == 1 and all(line in out.splitlines() for line in lines), out[-4000:]
    assert snapshot(rig1) == fresh


def test_without_a_machine_id_the_lock_still_names_the_other_inventory_name(rigs, tmp_path):
    """A machine with no /etc/machine-id cannot be told by it: the second name finds the rig's lock held by this
    very run, and says which name holds it instead of blaming 'another run' (--dry: nothing changes)."""
    rig1 = rigs.rig("rig1")
    machine_id = rig1.run("cat /etc/machine-id", True).stdout
    inv = tmp_path / "twins.py"
    inv.write_text(f"exec(open({str(rigs.inventory)!r}).read())\nrigs = [*rigs, ('rig1-again', dict(rigs)['rig1'])]\n")
    rig1.run("rm /etc/machine-id", True)
    try:
        returncode, out = dry(inv, "dual_turbo", "rig1", "rig1-again")
    finally:
        rig1.run(f"printf %s {shlex.quote(machine_id)} > /etc/machine-id", True)
    assert returncode == 1, out[-4000:]
    expect = (
        " are one machine (this run holds its lock /run/lock/rigforge.lock as ",
        "): remove one of the two names from the inventory; nothing was changed.",
    )
    lines = [line for line in out.splitlines() if expect[0] in line]
    assert len(lines) == 1 and lines[0].endswith(expect[1]), out[-4000:]
    assert "rig1-again and rig1 are" in lines[0] or "rig1 and rig1-again are" in lines[0]
    assert "being provisioned by" not in out


def test_sudo_that_asks_for_a_password_is_one_line_in_the_deploy_status_and_verify(rigs, tmp_path):
    """rig1's sudo asks for a password: the deploy refuses it before anything else in one line naming the user and
    what is needed; `status` and `verify` with no TTY put that line in rig1's row and report rig2 in full."""
    rig1 = rigs.rig("rig1")
    sudoers = f"/etc/sudoers.d/{rig1.user}"
    kept = rig1.run(f"cat {sudoers}", True).stdout
    fresh = snapshot(rig1)
    rig1.run(f"echo '{rig1.user} ALL=(ALL) ALL' > {sudoers}", True)
    expect = (
        f"rigforge refused on rig1: sudo asks {rig1.user} for a password on rig1: rigforge needs passwordless sudo "
        f"for {rig1.user} (a sudoers line '{rig1.user} ALL=(ALL) NOPASSWD:ALL') or the password in host data "
        "_sudo_password."
    )
    try:
        line = refused(rigs, tmp_path, "rig1", {}, expect, "rigforge refused on")
        assert line.strip() == expect or line.strip().endswith(f"] {expect}"), line
        inv = inventory_with(rigs, tmp_path / "all.py", {})
        for command in ("status", "verify"):
            proc = subprocess.run(
                [PYINFRA.replace("pyinfra", "rigforge"), command, str(inv)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=600,
                stdin=subprocess.DEVNULL,
            )
            out = proc.stdout + proc.stderr
            assert "Traceback" not in out and "sudo password" not in out, out[-4000:]
            (row,) = [row for row in proc.stdout.splitlines() if row.startswith("rig1 ")]
            assert row.split(None, 1)[1].strip() == f"ERROR  {expect.split(': ', 1)[1][:-1]}" or (
                expect.split(": ", 1)[1][:-1] in row
            ), row
            rig2 = [row for row in proc.stdout.splitlines() if row.startswith("rig2 ") and "ERROR" not in row]
            assert rig2, out[-4000:]  # rig2's full row (status) or checks (verify)
            assert proc.returncode in (1, 2), out[-4000:]
    finally:
        rig1.run(f"printf %s {shlex.quote(kept)} > {sudoers}", True)
    assert snapshot(rig1) == fresh


def hold_apt_lock(rig, seconds: float) -> subprocess.Popen:
    """A process that holds the rig's dpkg frontend lock (fcntl, as apt does) for `seconds`, then lets it go."""
    lock = rig.rootfs / "var/lib/dpkg/lock-frontend"
    code = (
        f"import fcntl, sys, time; f = open({str(lock)!r}, 'a'); fcntl.lockf(f, fcntl.LOCK_EX); "
        f"print('held', flush=True); time.sleep({seconds})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_an_apt_lock_held_past_the_wait_is_refused_naming_the_holder_with_nothing_changed(rigs, tmp_path):
    rig = rigs.rig("rig1")
    fresh = snapshot(rig)
    holder = hold_apt_lock(rig, 600)
    try:
        inv = inventory_with(rigs, tmp_path / "inv.py", {"rig1": {"apt_lock_wait": 3}})
        results, err = pyinfra_run(inv, REPO / "deploy" / "dual_turbo.py", "--limit", "rig1", env=NO_TOKEN)
        expect = (
            f"rigforge refused on rig1: the apt/dpkg lock /var/lib/dpkg/lock-frontend is held by pid {holder.pid} "
            "after 3 s of waiting (apt_lock_wait); nothing was changed: re-run once it is done, or raise apt_lock_wait."
        )
        assert results.get("failed_hosts") in ("all", ["rig1"]) and expect in err, err[-4000:]
        assert changed(results, "rig1") == []
        returncode, out = dry(inv, "dual_turbo", "rig1")  # --dry cannot know whether it will be let go: it says so
        assert (
            f"rig1: the apt/dpkg lock /var/lib/dpkg/lock-frontend is held by pid {holder.pid}; the run waits up to 3 s "
            "(apt_lock_wait) for it before its first change"
        ) in out, out[-4000:]
    finally:
        holder.kill()
        holder.wait()
    assert snapshot(rig) == fresh


def test_an_apt_lock_released_during_the_wait_lets_the_run_go_on(rigs, tmp_path):
    rig = rigs.rig("rig2")  # the driver is in (the 400 W case): the rest converges
    holder = hold_apt_lock(rig, 30)  # past the run's start on a loaded machine (5 s was not), well within its wait
    try:
        inv = inventory_with(rigs, tmp_path / "inv.py", {"rig2": {"apt_lock_wait": 120}})
        results, err = pyinfra_run(inv, REPO / "deploy" / "dual_turbo.py", "--limit", "rig2", env=NO_TOKEN)
    finally:
        holder.kill()
        holder.wait()
    assert results["failed_hosts"] == [], err[-4000:]
    assert (
        f"rig2: the apt/dpkg lock /var/lib/dpkg/lock-frontend was held by pid {holder.pid} when the run was prepared; "
        "it was free after "
    ) in err and " s of waiting; going on" in err, err[-4000:]
    assert json.loads(rig.run("cat /etc/rigforge/rig.json", True).stdout)["variant"] == "dual-turbo"
