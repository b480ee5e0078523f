"""The testbed itself: simulated rigs reached over real SSH by pyinfra, the local signed apt repo, git remotes
and HF endpoint. (No systemd runs in the rigs: nothing here starts a service.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from rigforge.testbed import RigSpec, TestbedError, tools_rootfs, up

pytestmark = pytest.mark.testbed
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))


def ssh(tb, rig: str, cmd: str) -> subprocess.CompletedProcess:
    """Run `cmd` on a rig over SSH as its sudo user (the OpenSSH client, like an operator would)."""
    return subprocess.run(
        ["ssh", "-F", str(tb.ssh_config), "-o", "BatchMode=yes", rig, cmd],
        capture_output=True,
        text=True,
        timeout=300,
    )


def add_repo(tb, rig: str, name: str, url: str, key_url: str) -> subprocess.CompletedProcess:
    """Add a flat repo the way the roles add NVIDIA's: armored key in /etc/apt/keyrings + deb822 Signed-By."""
    return ssh(
        tb,
        rig,
        f"set -e; sudo install -d -m 0755 /etc/apt/keyrings; "
        f"curl -fsS {key_url} | sudo tee /etc/apt/keyrings/{name}.asc >/dev/null; "
        f"printf 'Types: deb\\nURIs: {url}\\nSuites: /\\nSigned-By: /etc/apt/keyrings/{name}.asc\\n' "
        f"| sudo tee /etc/apt/sources.list.d/{name}.sources >/dev/null; sudo apt-get update -qq",
    )


def test_pyinfra_reaches_both_rigs_over_ssh_as_sudo_user(testbed, tmp_path):
    res = subprocess.run(
        [PYINFRA, "-y", str(testbed.inventory), "exec", "--", "uname -a"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for rig in ("rig1", "rig2"):
        assert f"[{rig}] Success" in res.stdout + res.stderr

    (tmp_path / "payload.txt").write_text("hello from the controller\n")
    (tmp_path / "deploy.py").write_text(
        textwrap.dedent(
            """
            from pyinfra.operations import files, server
            server.shell(name="Record the SSH user", commands=["id -un > /tmp/ssh-user"], _sudo=False)
            files.put(name="Upload a root-owned file", src="payload.txt", dest="/root/payload.txt", mode="600")
            """
        )
    )
    res = subprocess.run(
        [PYINFRA, "-y", str(testbed.inventory), "deploy.py"], capture_output=True, text=True, cwd=tmp_path
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for rig in testbed.rigs:
        assert (rig.rootfs / "tmp/ssh-user").read_text().strip() == "rigadmin"
        payload = rig.rootfs / "root/payload.txt"
        assert payload.read_text() == "hello from the controller\n"
        assert payload.stat().st_uid == 0 and oct(payload.stat().st_mode & 0o777) == "0o600"


def test_signed_local_repo_installs_the_stub_driver(testbed):
    res = add_repo(testbed, "rig1", "rigforge-nvidia-cuda", testbed.driver_repo_url, testbed.driver_repo_key_url)
    assert res.returncode == 0, res.stderr
    # NVIDIA's Debian naming: the pinning package locks branch 580 although 590 is in the repo too
    apt = "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y"
    res = ssh(testbed, "rig1", f"{apt} nvidia-driver-pinning-580 && {apt} nvidia-open")
    assert res.returncode == 0, res.stdout + res.stderr
    res = ssh(
        testbed, "rig1", "dpkg-query -W -f '${Version}\\n' nvidia-kernel-open-dkms; cat /sys/module/nvidia/version"
    )
    assert res.stdout.split() == ["580.159.04-1", "580.159.04"]
    res = ssh(testbed, "rig1", "apt-cache policy nvidia-open")
    assert "Candidate: 580.159.04-1" in res.stdout and "590.48.01-1" in res.stdout
    res = ssh(testbed, "rig1", "nvidia-smi -L")
    assert res.returncode == 0 and res.stdout.count("NVIDIA GeForce RTX 3090") == 2

    # power limits: root only, inside min..max, persisted in the state file
    res = ssh(testbed, "rig1", "nvidia-smi -pl 230")
    assert res.returncode == 4 and "does not have permission" in res.stdout
    res = ssh(testbed, "rig1", "sudo nvidia-smi -pl 400")
    assert res.returncode == 2
    assert (
        "Provided power limit 400.00 W is not a valid power limit which should be between 100.00 W and "
        "350.00 W for GPU 00000000:01:00.0" in res.stdout
    )
    res = ssh(testbed, "rig1", "sudo nvidia-smi -i 1 -pl 230 && sudo nvidia-smi -pm 1")
    assert res.returncode == 0, res.stdout
    assert "Power limit for GPU 00000000:02:00.0 was set to 230.00 W from 350.00 W." in res.stdout
    res = ssh(testbed, "rig1", "nvidia-smi --query-gpu=index,power.limit,persistence_mode --format=csv,noheader")
    assert res.stdout.splitlines() == ["0, 350.00 W, Enabled", "1, 230.00 W, Enabled"]
    testbed.rig("rig1").simulate_reboot()  # caps do not survive a reboot by themselves
    res = testbed.rig("rig1").run("nvidia-smi --query-gpu=power.limit,persistence_mode --format=csv,noheader")
    assert res.stdout.splitlines() == ["350.00 W, Disabled", "350.00 W, Disabled"]

    # the two driver flavours conflict: installing the proprietary one (cuda-drivers) replaces the open module
    res = ssh(testbed, "rig1", "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y cuda-drivers")
    assert res.returncode == 0, res.stdout + res.stderr
    res = ssh(testbed, "rig1", "dpkg-query -W -f '${Package} ${Status} ${Version}\\n' 'nvidia-kernel-*'")
    assert "nvidia-kernel-dkms install ok installed 580.159.04-1" in res.stdout
    assert "nvidia-kernel-open-dkms install ok installed" not in res.stdout

    # the toolkit repo, and nvidia-ctk merging docker's daemon.json
    res = add_repo(testbed, "rig1", "rigforge-nvidia-toolkit", testbed.toolkit_repo_url, testbed.toolkit_repo_key_url)
    assert res.returncode == 0, res.stderr
    res = ssh(
        testbed,
        "rig1",
        "set -e; sudo DEBIAN_FRONTEND=noninteractive apt-get install -y nvidia-container-toolkit >/dev/null; "
        'sudo mkdir -p /etc/docker; echo \'{"log-driver": "local"}\' | sudo tee /etc/docker/daemon.json; '
        "sudo nvidia-ctk runtime configure --runtime=docker; sudo cat /etc/docker/daemon.json",
    )
    assert res.returncode == 0, res.stderr
    daemon = json.loads(res.stdout.split("\n", 1)[1])
    assert daemon == {"log-driver": "local", "runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}}}


def test_repo_with_the_wrong_key_is_refused(testbed):
    """Signatures are really checked: the same repo with another keyring fails apt-get update."""
    res = ssh(
        testbed,
        "rig2",
        f"printf 'Types: deb\\nURIs: {testbed.driver_repo_url}\\nSuites: /\\n"
        f"Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\\n' "
        f"| sudo tee /etc/apt/sources.list.d/wrong-key.sources >/dev/null; sudo apt-get update 2>&1; "
        f"rc=$?; sudo rm /etc/apt/sources.list.d/wrong-key.sources; exit $rc",
    )
    assert res.returncode == 100, res.stdout
    assert "Missing key" in res.stdout and "is not signed" in res.stdout, res.stdout


def test_clone_from_local_git_remotes(testbed):
    lock = yaml.safe_load(testbed.lock.read_text())
    genesis = lock["git"]["genesis"]
    assert genesis["url"] == testbed.git_url("genesis") and genesis["commit"] == testbed.git_commits["genesis"][-1]
    res = ssh(
        testbed,
        "rig1",
        f"set -e; rm -rf /tmp/genesis; git clone -q {genesis['url']} /tmp/genesis; cd /tmp/genesis; "
        f"git rev-parse HEAD; test -f vllm/_genesis/patches/apply_all.py; "
        f"git checkout -q {testbed.git_commits['genesis'][0]}; git rev-parse HEAD",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [genesis["commit"], testbed.git_commits["genesis"][0]]

    # sparse, blob-less checkout of a pinned commit (what the sources role does for vllm-src)
    src = lock["git"]["vllm-src"]
    res = ssh(
        testbed,
        "rig1",
        f"set -e; rm -rf /tmp/vsrc; git clone -q --filter=blob:none --no-checkout {src['url']} /tmp/vsrc; "
        f"cd /tmp/vsrc; git sparse-checkout set --no-cone {' '.join(src['sparse'])}; "
        f"git checkout -q {src['commit']}; git ls-files | wc -l; find . -path ./.git -prune -o -type f -print0 "
        f"| sort -z | xargs -0 sha256sum",
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert int(lines[0]) > len(src["sparse"])  # the repo has more files than the checkout
    got = {path.removeprefix("./"): sha for sha, path in (line.split() for line in lines[1:])}
    assert got == src["files"]

    # fetch a commit by SHA (uploadpack.allowAnySHA1InWant, like GitHub)
    res = ssh(
        testbed,
        "rig2",
        f"set -e; rm -rf /tmp/bysha; git init -q /tmp/bysha; cd /tmp/bysha; "
        f"git fetch -q --depth 1 {testbed.git_url('club-3090')} {lock['git']['club-3090']['commit']}; "
        f"git rev-parse FETCH_HEAD",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == lock["git"]["club-3090"]["commit"]


HF_SCRIPT = """
import hashlib, json, os, sys
from pathlib import Path
import huggingface_hub.constants
from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import GatedRepoError
# hub writes in 10 MiB chunks and resumes from the last whole chunk; our shards are smaller
huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE = 16384
out = {}
d = Path(sys.argv[1])
f = hf_hub_download("Lorbus/Qwen3.6-27B-int4-AutoRound", "model-00002-of-00003.safetensors", local_dir=d / "resume")
out["resumed"] = hashlib.sha256(Path(f).read_bytes()).hexdigest()
p = snapshot_download("Lorbus/Qwen3.6-27B-int4-AutoRound", local_dir=d / "autoround")
out["snapshot"] = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in Path(p).iterdir() if f.is_file()}
try:
    hf_hub_download("z-lab/Qwen3.6-27B-DFlash", "config.json", local_dir=d / "gated")
    out["gated_without_token"] = "downloaded"
except GatedRepoError as exc:
    out["gated_without_token"] = type(exc).__name__
f = hf_hub_download("z-lab/Qwen3.6-27B-DFlash", "config.json", local_dir=d / "gated", token=sys.argv[2])
out["gated_with_token"] = hashlib.sha256(Path(f).read_bytes()).hexdigest()
print(json.dumps(out))
"""


def test_huggingface_hub_downloads_from_local_endpoint_with_range_resume(testbed, tmp_path):
    lock = yaml.safe_load(testbed.lock.read_text())
    want = {f["path"]: f["sha256"] for f in lock["hf"]["autoround-int4"]["files"]}
    shard = "model-00002-of-00003.safetensors"
    testbed.hf_control(drop_after_bytes=100_000)  # the next file GET is cut after 100 kB
    (tmp_path / "dl.py").write_text(HF_SCRIPT)
    env = {
        "HF_ENDPOINT": testbed.hf_endpoint,
        "HF_HOME": str(tmp_path / "hfhome"),
        "PATH": "/usr/bin:/bin",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
    }
    before = testbed.hf_mark()
    res = subprocess.run(
        [sys.executable, str(tmp_path / "dl.py"), str(tmp_path), testbed.hf_token],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["snapshot"] == want
    assert out["resumed"] == want[shard]
    assert out["gated_without_token"] == "GatedRepoError"
    assert (
        out["gated_with_token"] == {f["path"]: f["sha256"] for f in lock["hf"]["dflash-draft"]["files"]}["config.json"]
    )
    log = testbed.hf_log(since=before)
    ranged = [e for e in log if e["method"] == "GET" and e["range"] and e["status"] == 206]
    assert [e["path"].rsplit("/", 1)[1] for e in ranged] == [shard], f"expected one resumed GET; log: {log}"
    assert any(e["status"] == 401 and "DFlash" in e["path"] for e in log)


def test_killed_download_resumes_with_range_on_a_rig(testbed):
    lock = yaml.safe_load(testbed.lock.read_text())
    entry = next(f for f in lock["hf"]["carnice"]["files"] if f["path"].endswith(".safetensors"))
    url = f"{testbed.hf_endpoint}/{lock['hf']['carnice']['repo']}/resolve/main/{entry['path']}"
    testbed.hf_control(throttle_bps=20_000)  # a 256 KiB shard takes 13 s: cut after 4 s, about 80 KB are in
    try:
        res = ssh(
            testbed,
            "rig2",
            f"rm -f /tmp/shard; curl -sS --max-time 4 -o /tmp/shard {url}; stat -c %s /tmp/shard || echo 0",
        )
        partial = int(res.stdout.split()[-1])
        assert 0 < partial < entry["size"], res.stdout + res.stderr
    finally:
        testbed.hf_control(throttle_bps=None)
    res = ssh(testbed, "rig2", f"curl -fsS -C - -o /tmp/shard {url} && sha256sum /tmp/shard")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0] == entry["sha256"]
    assert any(e["status"] == 206 and e["range"] == f"bytes={partial}-" for e in testbed.hf_log())


def test_testinfra_reaches_rigs_over_ssh(testbed):
    host = testbed.testinfra_host("rig1")
    assert host.file("/etc/os-release").contains("trixie")
    assert host.user().name == "root"  # through sudo
    plain = testbed.testinfra_host("rig2", sudo=False)
    assert plain.user().name == "rigadmin"
    assert plain.file("/etc/rigforge-sim/gpus.json").exists


def test_rigs_of_other_sizes_do_not_clash(testbed, testbed_factory):
    small = testbed_factory([RigSpec(gpus=1, vram_mib=20480, power_default=320, power_max=320)], name="small")
    assert {r.ssh_port for r in small.rigs}.isdisjoint({r.ssh_port for r in testbed.rigs})
    assert small.dir != testbed.dir
    rig = small.rig("rig1")
    res = ssh(
        small,
        "rig1",
        f"curl -fsS -o /tmp/d.deb {testbed.driver_repo_url}nvidia-driver-cuda_580.159.04-1_all.deb"
        f" && curl -fsS -o /tmp/k.deb {testbed.driver_repo_url}nvidia-kernel-open-dkms_580.159.04-1_all.deb"
        " && sudo dpkg -i /tmp/d.deb /tmp/k.deb >/dev/null"
        " && nvidia-smi --query-gpu=count,memory.total,power.max_limit --format=csv,noheader",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == "1, 20480 MiB, 320.00 W"
    assert rig.run("cat /etc/rigforge-sim/gpus.json").returncode == 0


def test_up_is_idempotent_and_warm_up_is_timed(testbed_factory, testbed_report):
    t0 = time.monotonic()
    tb = testbed_factory([RigSpec(), RigSpec()], name="timing")
    fresh = time.monotonic() - t0
    pids = [(r.dir / "sshd.pid").read_text() for r in tb.rigs]
    t0 = time.monotonic()
    again = up(tb.dir, [RigSpec(), RigSpec()], shared=tb.shared)
    reuse = time.monotonic() - t0
    assert [r.ssh_port for r in again.rigs] == [r.ssh_port for r in tb.rigs]
    assert [(r.dir / "sshd.pid").read_text() for r in again.rigs] == pids  # nothing restarted
    testbed_report.append(
        f"warm `testbed up` of 2 rigs: {fresh:.1f}s fresh from the cached tarball, "
        f"{reuse:.2f}s when already up (target < 20 s)"
    )
    res = ssh(again, "rig2", "true")
    assert res.returncode == 0, res.stderr


def test_tools_rootfs_validates_compose_and_units(testbed_dir):
    root = tools_rootfs(testbed_dir)
    work = root / "tmp/rigforge-check"
    work.mkdir(parents=True, exist_ok=True)
    (work / "good.yml").write_text("services:\n  web:\n    image: nginx:1\n    ports: ['8000:80']\n")
    (work / "bad.yml").write_text("services:\n  web:\n    image: nginx:1\n    prots: ['8000:80']\n")

    def chroot(cmd):
        return subprocess.run(["chroot", str(root), "/bin/sh", "-c", cmd], capture_output=True, text=True)

    assert chroot("docker compose -f /tmp/rigforge-check/good.yml config -q").returncode == 0
    bad = chroot("docker compose -f /tmp/rigforge-check/bad.yml config -q")
    assert bad.returncode != 0 and "prots" in bad.stderr
    (work / "good.service").write_text("[Unit]\nDescription=x\n[Service]\nType=oneshot\nExecStart=/bin/true\n")
    (work / "bad.service").write_text("[Unit]\nDescription=x\n[Service]\nType=oneshot\nExecStart=/bin/true\nBogus=1\n")
    good = chroot("systemd-analyze verify /tmp/rigforge-check/good.service")
    assert good.returncode == 0 and not (good.stdout + good.stderr).strip(), good.stderr
    bad = chroot("systemd-analyze verify /tmp/rigforge-check/bad.service")
    assert "Bogus" in bad.stdout + bad.stderr


def test_testbed_dir_must_be_root_owned_and_not_world_writable(tmp_path):
    with pytest.raises(TestbedError, match="component /tmp must be owned by root and not group/world writable"):
        up(tmp_path / "testbed", [RigSpec()])


def test_cli_rejects_bad_options_before_doing_anything():
    res = subprocess.run(
        [sys.executable, "-m", "rigforge.cli", "testbed", "up", "--power-max", "50", "--dir", "/nonexistent/x"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert res.returncode == 2
    assert "power limits must satisfy" in res.stderr and not Path("/nonexistent/x").exists()


def test_ubuntu_scheme_repo_behaves_the_same(testbed_factory):
    """The cuda-ubuntu repo publishes NVIDIA's Ubuntu naming (580: branch in the name; 590: unversioned); its stub
    driver answers like the Debian-scheme one."""
    tb = testbed_factory([RigSpec()], name="ubuntu-scheme")
    from rigforge.testbed import aptrepo

    url = f"{tb.apt_url}/{aptrepo.UBUNTU_DRIVER_REPO}/"
    res = add_repo(tb, "rig1", "cuda-ubuntu", url, f"{tb.apt_url}/{aptrepo.UBUNTU_DRIVER_KEY}")
    assert res.returncode == 0, res.stderr
    apt = "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q"
    res = ssh(tb, "rig1", f"{apt} nvidia-driver-pinning-580 >/dev/null && {apt} nvidia-driver-580-open >/dev/null")
    assert res.returncode == 0, res.stdout + res.stderr
    res = ssh(tb, "rig1", "dpkg-query -W -f '${Version}\\n' nvidia-dkms-580-open; cat /sys/module/nvidia/version")
    assert res.stdout.split() == ["580.159.04-1", "580.159.04"]
    res = ssh(tb, "rig1", "nvidia-smi -L")
    assert res.returncode == 0 and res.stdout.count("NVIDIA GeForce RTX 3090") == 2
    res = ssh(tb, "rig1", "apt-cache show nvidia-open nvidia-dkms-open | grep -E '^(Package|Version|Depends):'")
    assert "Package: nvidia-dkms-open\nVersion: 590.48.01-1" in res.stdout, res.stdout


@pytest.mark.parametrize(
    "asked",
    [
        {"specs": [RigSpec(gpus=1)]},
        {"specs": [RigSpec()], "booted": True},
        {"specs": [RigSpec()], "docker_source": "docker"},
    ],
    ids=["another spec", "booted", "another docker source"],
)
def test_a_converged_image_makes_only_rigs_like_the_one_it_was_made_from(testbed_dir, tmp_path, asked):
    """A rig from a converged image is that rig: a rig of another spec, a booted rig or one of another docker_source
    is refused before a rig directory is made."""
    from rigforge.testbed.rig import RigImage

    image = RigImage(tmp_path / "converged.tar", RigSpec(), "distro", "deploy/dual_turbo.py")
    fleet = testbed_dir / "fleets" / f"refused-{tmp_path.name}"
    try:
        with pytest.raises(TestbedError, match="a converged image makes chroot rigs like the one it was made from"):
            up(fleet, shared=testbed_dir, image=image, **asked)
        assert not (fleet / "rigs").exists()
    finally:
        shutil.rmtree(fleet, ignore_errors=True)
