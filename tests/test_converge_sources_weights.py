"""Tier 4: the sources and weights roles on testbed rigs over real SSH as a sudo user, against the testbed's
local git daemon and HF stand-in (tests/deploys/sources_weights.py, pyinfra as a subprocess).

Converge twice (zero changes the second time, no re-hashing), a killed download resumes with a Range request,
a tampered file is re-fetched (and with an unchanged mtime only `weights_deep_verify` finds it), a lock/hub
mismatch stops naming the file and leaves no bad file, a wrong pinned SHA names the repo, a full disk is
reported before any download, unresolved entries and a gated repo without a token stop the host untouched,
and `weights_source: controller` downloads once for two rigs.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from support import PYINFRA, REPO, changed, errored, inventory_with, pyinfra_run

DEPLOY = REPO / "tests" / "deploys" / "sources_weights.py"
ROOT = "/opt/rigforge"
pytestmark = pytest.mark.testbed


@pytest.fixture(scope="module")
def tb(testbed_factory):
    from rigforge.testbed import RigSpec

    return testbed_factory([RigSpec(), RigSpec()], name="srcw")


@pytest.fixture(scope="module")
def lock_data(tb) -> dict:
    return yaml.safe_load(tb.lock.read_text())


def run(tb, inventory=None, *args, token=True, sources=None, assets=None, limit="rig1", lock=None, data=None):
    env = {"HF_TOKEN": tb.hf_token if token else "", "RIGFORGE_HF_TOKEN": ""}
    if sources is not None:
        env["RIGFORGE_TEST_SOURCES"] = sources
    if assets is not None:
        env["RIGFORGE_TEST_ASSETS"] = assets
    extra = (["--limit", limit] if limit else []) + list(args)
    if lock or data:
        per_host = {**({"rigforge_lock": str(lock)} if lock else {}), **(data or {})}
        inventory = inventory_with(tb, tb.dir / "inventory-srcw.py", {r.name: per_host for r in tb.rigs})
    return pyinfra_run(inventory or tb.inventory, DEPLOY, *extra, env=env)


def failed(results: dict, host: str) -> bool:
    """The host failed (pyinfra prints no results when every host in the run failed)."""
    every_host = results.get("failed_hosts") == "all" or results.get("all_failed")  # both shapes of support.py
    return bool(every_host or errored(results, host))


def write_lock(tb, data: dict, name: str) -> Path:
    path = tb.dir / f"{name}.lock.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def sh(tb, cmd: str, rig: str = "rig1") -> str:
    return tb.rig(rig).run(cmd, check=True).stdout


def sha256_on_rig(tb, path: str, rig: str = "rig1") -> str:
    return hashlib.sha256((tb.rig(rig).rootfs / path.lstrip("/")).read_bytes()).hexdigest()


def fetch_pids(rootfs: Path) -> list[int]:
    """PIDs of fetch_weights.py runs inside this rig's chroot (started by this test's deploy)."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if b"fetch_weights.py" in (p / "cmdline").read_bytes() and (p / "root").resolve() == rootfs.resolve():
                pids.append(int(p.name))
        except (OSError, ValueError):
            continue
    return pids


def shard(lock_data: dict, key: str = "autoround-int4") -> dict:
    return next(f for f in lock_data["hf"][key]["files"] if f["path"].endswith(".safetensors"))


def test_converge_twice_second_run_changes_nothing(tb, lock_data):
    results, err = run(tb, None, "-vvv")  # with every command and its output shown
    assert not errored(results, "rig1"), err[-3000:]
    assert changed(results, "rig1")
    # progress is visible, the (gated) dflash-draft was fetched with the token, and the token never shows
    assert "rigforge: fetching genesis" in err and "model-00001-of-00001.safetensors: sha256 verified" in err
    assert tb.hf_token not in err
    for name, pin in lock_data["git"].items():
        head = sh(tb, f"git -C {ROOT}/src/{name} rev-parse HEAD").strip()
        assert head == pin["commit"], name
        for path, sha in pin["files"].items():
            assert sha256_on_rig(tb, f"{ROOT}/src/{name}/{path}") == sha
    # sparse: vllm-src holds only its two locked files, not the fork's tree
    tracked = sh(tb, f"cd {ROOT}/src/vllm-src && find . -path ./.git -prune -o -type f -print").split()
    assert sorted(p[2:] for p in tracked) == sorted(lock_data["git"]["vllm-src"]["files"])
    for key, hf in lock_data["hf"].items():
        for f in hf["files"]:
            assert sha256_on_rig(tb, f"{ROOT}/models/{key}/{f['path']}") == f["sha256"], f["path"]

    again, err = run(tb)
    assert changed(again, "rig1") == [], err[-3000:]
    assert not errored(again, "rig1")


def test_killed_download_resumes_with_range_request(tb, lock_data):
    f = shard(lock_data)
    final = f"{ROOT}/models/autoround-int4/{f['path']}"
    sh(tb, f"rm -f {final}")
    part_glob = tb.rig("rig1").rootfs / "opt/rigforge/models/.rigforge-staging/autoround-int4"
    tb.hf_control(throttle_bps=32 * 1024)
    env = {**os.environ, "HF_TOKEN": tb.hf_token, "RIGFORGE_TEST_SOURCES": "", "RIGFORGE_TEST_ASSETS": "autoround-int4"}
    proc = subprocess.Popen(
        [PYINFRA, "-y", "--limit", "rig1", str(tb.inventory), str(DEPLOY)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        part, deadline = None, time.monotonic() + 120
        while time.monotonic() < deadline:
            parts = list(part_glob.glob(f"{f['path']}.*.part"))
            if parts and parts[0].stat().st_size >= 64 * 1024:
                part = parts[0]
                break
            time.sleep(0.2)
        assert part is not None, "download never started"
        # kill the fetch on the rig (our own process, found by its manifest path) as a power cut would
        pids = fetch_pids(tb.rig("rig1").rootfs)
        assert pids
        for pid in pids:
            os.kill(pid, 9)
        out, _ = proc.communicate(timeout=120)
    finally:
        tb.hf_control(throttle_bps=None)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-2000:]
    fetched = part.stat().st_size
    assert 0 < fetched < f["size"]
    assert not (tb.rig("rig1").rootfs / final.lstrip("/")).exists(), "a partial file reached the final path"

    results, err = run(tb, sources="", assets="autoround-int4")
    assert not errored(results, "rig1"), err[-3000:]
    assert sha256_on_rig(tb, final) == f["sha256"]
    gets = [e for e in tb.hf_log() if e["method"] == "GET" and e["path"].endswith(f["path"])]
    last = gets[-1]
    assert last["status"] == 206 and last["range"] and int(last["range"][6:].split("-")[0]) >= fetched, gets[-3:]


def test_tampered_file_is_refetched_and_deep_verify_finds_a_silent_one(tb, lock_data):
    f = shard(lock_data)
    final = f"{ROOT}/models/autoround-int4/{f['path']}"
    # same size, new mtime: the stamp no longer matches the stat, the file is hashed and re-fetched
    sh(tb, f"printf 'XXXX' | dd of={final} bs=1 seek=100 conv=notrunc status=none")
    results, err = run(tb, sources="", assets="autoround-int4")
    assert any("autoround-int4" in op for op in changed(results, "rig1")), err[-3000:]
    assert sha256_on_rig(tb, final) == f["sha256"]

    # same size, mtime put back: invisible to the stat check by design; weights_deep_verify re-hashes
    sh(
        tb,
        f"cp -p {final} /tmp/ref && printf 'YYYY' | dd of={final} bs=1 seek=100 conv=notrunc status=none "
        f"&& touch -r /tmp/ref {final} && rm /tmp/ref",
    )
    results, _ = run(tb, sources="", assets="autoround-int4")
    assert changed(results, "rig1") == []
    assert sha256_on_rig(tb, final) != f["sha256"]
    results, err = run(tb, sources="", assets="autoround-int4", data={"weights_deep_verify": True})
    assert not errored(results, "rig1"), err[-3000:]
    assert sha256_on_rig(tb, final) == f["sha256"]
    # deep again over intact files: re-hashed on the rig, nothing to repair, so nothing changed
    results, err = run(tb, sources="", assets="autoround-int4", data={"weights_deep_verify": True})
    assert changed(results, "rig1") == [] and not errored(results, "rig1"), err[-3000:]


def test_hub_file_not_matching_the_lock_stops_naming_it(tb, lock_data):
    data = yaml.safe_load(yaml.safe_dump(lock_data))
    bad = shard(data, "carnice")
    bad["sha256"] = "0" * 64
    lock = write_lock(tb, data, "badsha")
    sh(tb, f"rm -rf {ROOT}/models/carnice")
    results, err = run(tb, sources="", assets="carnice", lock=lock)
    assert failed(results, "rig1"), err[-3000:]
    assert f"{bad['path']}: verification failed" in err
    assert not (tb.rig("rig1").rootfs / f"opt/rigforge/models/carnice/{bad['path']}").exists()
    assert not list((tb.rig("rig1").rootfs / "opt/rigforge/models/.rigforge-staging").rglob(f"{bad['path']}*"))


def test_wrong_pinned_sha_names_the_repo(tb, lock_data):
    data = yaml.safe_load(yaml.safe_dump(lock_data))
    data["git"]["genesis"]["commit"] = "deadbeef" * 5
    lock = write_lock(tb, data, "wrongsha")
    results, err = run(tb, sources="genesis", assets="", lock=lock)
    assert failed(results, "rig1"), err[-3000:]
    assert f"pinned commit {'deadbeef' * 5} of genesis ({data['git']['genesis']['url']})" in err


def test_full_disk_is_reported_before_downloading(tb, lock_data):
    data = yaml.safe_load(yaml.safe_dump(lock_data))
    huge = dict(shard(data, "dflash-draft"), size=2**50)
    data["hf"]["dflash-draft"]["files"] = [huge]
    lock = write_lock(tb, data, "huge")
    before = tb.hf_mark()
    results, err = run(tb, sources="", assets="dflash-draft=huge-draft", lock=lock)
    assert failed(results, "rig1"), err[-3000:]
    assert "not enough disk space for dflash-draft" in err and "huge-draft" in err
    fetched = [e for e in tb.hf_log(since=before) if "DFlash" in e["path"] and e["method"] != "HEAD"]
    assert not fetched, "something was downloaded"  # a HEAD is the controller checking the token, not a download


def test_unresolved_entries_and_missing_token_stop_the_host_untouched(tb, lock_data):
    data = yaml.safe_load(yaml.safe_dump(lock_data))
    data["git"]["vllm-src"]["commit"] = None
    data["hf"]["carnice"]["revision"] = None
    lock = write_lock(tb, data, "unresolved")
    results, err = run(tb, lock=lock, limit="rig2")
    assert failed(results, "rig2")
    assert "git.vllm-src" in err and "run `rigforge lock` on a networked controller" in err
    assert not (tb.rig("rig2").rootfs / "opt/rigforge/src").exists()

    results, err = run(tb, token=False, sources="", assets="dflash-draft", limit="rig2")
    assert failed(results, "rig2")
    assert "z-lab/Qwen3.6-27B-DFlash is gated, not yet fetched, and no HF token is set" in err
    assert not (tb.rig("rig2").rootfs / "opt/rigforge/models").exists()


def test_controller_source_downloads_once_for_two_rigs(tb, lock_data, tmp_path):
    for rig in ("rig1", "rig2"):
        sh(tb, f"rm -rf {ROOT}/models/pushed", rig)
    before = tb.hf_mark()
    data = {"weights_source": "controller", "weights_cache_dir": str(tmp_path / "cache")}
    results, err = run(tb, sources="", assets="autoround-int4=pushed", limit=None, data=data)
    for rig in ("rig1", "rig2"):
        assert not errored(results, rig), err[-3000:]
        for f in lock_data["hf"]["autoround-int4"]["files"]:
            assert sha256_on_rig(tb, f"{ROOT}/models/pushed/{f['path']}", rig) == f["sha256"]
    gets = [e for e in tb.hf_log(since=before) if e["method"] == "GET" and "/resolve/" in e["path"]]
    assert len(gets) == len(lock_data["hf"]["autoround-int4"]["files"]), gets
    again, _ = run(tb, sources="", assets="autoround-int4=pushed", limit=None, data=data)
    assert changed(again) == []
