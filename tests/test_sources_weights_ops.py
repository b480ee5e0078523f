# ruff: noqa: F811 - `stand_ins` is a fixture imported from test_lock
"""Tiers 1-2 for sources and weights: fact parsing (also against real command output), operations against
faked facts (pyinfra's @fake connector: commands out, no-op cases, refusals), the checkout script against a
real git daemon, and fetch_weights.py against the HF stand-in (resume, tamper, mismatch, disk, gated)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from pyinfra.api import Config, FileUploadCommand, FunctionCommand, Inventory, State, StringCommand
from pyinfra.api.connect import connect_all
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host, ctx_state
from test_lock import stand_ins  # noqa: F401 - the git daemon + HF stand-in fixture

from rigforge.layout import STAMP, HostLayout
from rigforge.model.fleet import PlannedAsset
from rigforge.model.knobs.weights import Weights
from rigforge.model.pins import GitPin, HfFile, HfPin, parse_lock
from rigforge.observe import verdict
from rigforge.observe.facts.gitpin import GitCheckout
from rigforge.observe.facts.hfweights import FileDigests, WeightsState
from roles.operations import gitpin, hfweights

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "rigforge/remote/fetch_weights.py"
SHA = "a" * 40


# --- helpers -------------------------------------------------------------------------------------------


def sh(cmd: str, cwd=None) -> list[str]:
    return subprocess.run(["sh", "-c", cmd], cwd=cwd, capture_output=True, text=True, check=True).stdout.splitlines()


def fake_state(responses: dict) -> tuple[State, object]:
    data = {"fake_responses": responses, "fake_delay": 0, "fake_delay_jitter": 0}
    inventory = Inventory(([("@fake/rig", data)], {}))
    state = State(inventory, Config(), check_for_changes=True)
    connect_all(state)
    state.set_stage(StateStage.Prepare)
    return state, inventory.get_host("@fake/rig")


def describe(command) -> str:
    if isinstance(command, StringCommand):
        return command.get_raw_value()
    if isinstance(command, FileUploadCommand):
        return f"upload {command.dest}"
    if isinstance(command, FunctionCommand):
        return f"fail: {command.args[0]}"
    return str(command)


def commands(responses: dict, op, *args, **kwargs) -> list[str]:
    state, host = fake_state(responses)
    with ctx_state.use(state), ctx_host.use(host):
        return [describe(c) for c in op._inner(*args, **kwargs)]


def uploaded_texts(responses: dict, op, *args, **kwargs) -> dict[str, str]:
    state, host = fake_state(responses)
    out = {}
    with ctx_state.use(state), ctx_host.use(host):
        for c in op._inner(*args, **kwargs):
            if isinstance(c, FileUploadCommand) and hasattr(c.src, "getvalue"):
                out[c.dest] = c.src.getvalue()
    return out


# --- tier 1: facts ---------------------------------------------------------------------------------------


def test_git_checkout_fact_parses_state():
    assert GitCheckout().process(["absent"]) is None
    state = GitCheckout().process(
        [
            f"head={SHA}",
            "url=git://h/r.git",
            "sparse=true",
            "pattern=/a/b.py",
            "dirty= M a/b.py",
            "dirty=?? junk",
            f"file={'b' * 64}  a/b.py",
        ]
    )
    assert state == {
        "head": SHA,
        "url": "git://h/r.git",
        "sparse": True,
        "patterns": ["/a/b.py"],
        "dirty": [" M a/b.py", "?? junk"],
        "files": {"a/b.py": "b" * 64},
    }


def test_weights_fact_parses_stamp_and_exact_nanoseconds():
    stamp = {"revision": SHA, "files": {"a": {"size": 1, "mtime_ns": 5, "sha256": "c" * 64}}}
    state = WeightsState().process(
        [
            json.dumps(stamp),
            "--files--",
            "1 1732912345.1234567890 a",
            "7 1732912345.0000000010 sub/b c",
            "--staging--",
            "300 x.safetensors.0123456789abcdef.part",
        ]
    )
    assert state["stamp"] == stamp
    assert state["files"] == {"a": [1, 1732912345123456789], "sub/b c": [7, 1732912345000000001]}
    assert state["staging"] == {"x.safetensors.0123456789abcdef.part": 300}
    empty = {"stamp": None, "files": {}, "staging": {}, "staging_dir": False}
    assert WeightsState().process(["", "--files--", "--staging--"]) == empty
    assert WeightsState().process(["", "--files--", "--staging--", "--staging-dir--"])["staging_dir"] is True


def test_weights_fact_command_agrees_with_python_stat(tmp_path):
    """The real command's output: sizes and mtimes equal os.stat's, the stamp is read, nothing is hashed."""
    dest, staging = tmp_path / "m", tmp_path / "s"
    (dest / "sub").mkdir(parents=True)
    staging.mkdir()
    (dest / "a.bin").write_bytes(b"x" * 1000)
    (dest / "sub" / "b c.json").write_text("{}")
    (dest / ".rigforge-stamp.json").write_text(json.dumps({"revision": SHA, "files": {}}, indent=1))
    (staging / "a.bin.0123.part").write_bytes(b"y" * 10)
    state = WeightsState().process(sh(WeightsState().command(str(dest), str(staging))))
    for rel in ("a.bin", "sub/b c.json"):
        st = os.stat(dest / rel)
        assert state["files"][rel] == [st.st_size, st.st_mtime_ns]
    assert state["stamp"] == {"revision": SHA, "files": {}}
    assert state["staging"] == {"a.bin.0123.part": 10} and state["staging_dir"] is True


# --- tier 2: pinned checkout -----------------------------------------------------------------------------


CHECKOUT = dict(
    pin=GitPin("vllm-src", "git://h/v.git", "main", SHA, sparse=("a/b.py",), files={"a/b.py": "b" * 64}),
    dest="/opt/rigforge/src/vllm-src",
)


def git_fact(head=SHA, dirty=(), sha="b" * 64, url="git://h/v.git", patterns=("/a/b.py",)):
    return {
        "git status --porcelain": [f"head={head}", f"url={url}", "sparse=true"]
        + [f"pattern={p}" for p in patterns]
        + [f"dirty={d}" for d in dirty]
        + [f"file={sha}  a/b.py"]
    }


def test_checkout_is_a_noop_when_head_matches_and_tree_is_clean():
    assert commands(git_fact(), gitpin.checkout, **CHECKOUT) == []


@pytest.mark.parametrize(
    "fact",
    [
        {"git status --porcelain": ["absent"]},
        git_fact(head="b" * 40),
        git_fact(dirty=["?? stray.py"]),
        git_fact(url="git://elsewhere/v.git"),
        git_fact(patterns=("/a/",)),
    ],
    ids=["absent", "other-head", "dirty", "other-url", "other-sparse"],
)
def test_checkout_runs_one_pinned_step_otherwise(fact):
    *said, script = commands(
        fact, gitpin.checkout, **CHECKOUT
    )  # said: what differs (rigforge.observe.verdict.checkout)
    assert len(said) == 1
    assert f"git fetch --progress --depth 1 --filter=blob:none origin {SHA}" in script
    assert "git config core.sparseCheckoutCone false" in script and "printf '/a/b.py\\n'" in script
    assert f"checkout --progress --force --detach {SHA}" in script
    assert f"= {'b' * 64} ]" in script  # the locked file is verified after checkout


def test_checkout_with_a_wrong_locked_file_hash_fails_naming_it():
    (cmd,) = commands(git_fact(sha="c" * 64), gitpin.checkout, **CHECKOUT)
    assert cmd.startswith("fail: ") and "vllm-src: a/b.py" in cmd and "does not match the lock" in cmd


def test_checkout_script_against_a_real_git_daemon(stand_ins, tmp_path):
    """The same script the operation yields: sparse partial fetch, no-op fact afterwards, repair, wrong SHA."""
    meta = stand_ins["git"]["vllm-src"]
    url, dest = stand_ins["git_url"]("vllm-src"), tmp_path / "vllm-src"
    args = ("vllm-src", url, meta["pin"], str(dest), meta["sparse"], meta["files"])
    out = subprocess.run(["sh", "-c", gitpin.checkout_script(*args)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file() and ".git" not in p.parts)
    assert files == sorted(meta["sparse"])
    fact = lambda: GitCheckout().process(sh(GitCheckout().command(str(dest), tuple(meta["files"]))))  # noqa: E731
    pin = GitPin("vllm-src", url, "main", meta["pin"], sparse=tuple(meta["sparse"]), files=meta["files"])

    def is_current(state) -> bool:
        return not verdict.checkout(pin, str(dest), state)

    assert is_current(fact()) and not verdict.files_not_locked(fact(), meta["files"])

    # a dirty tree (edited file + stray file) is repaired and reported
    target = dest / meta["sparse"][0]
    target.write_text("local edit\n")
    (dest / "stray.txt").write_text("x")
    assert not is_current(fact())
    out = subprocess.run(["sh", "-c", gitpin.checkout_script(*args)], capture_output=True, text=True)
    assert out.returncode == 0 and "dirty tree" in out.stdout and "stray.txt" in out.stdout
    assert is_current(fact()) and not (dest / "stray.txt").exists()

    # a killed git left its lock files behind: without removing them `git checkout` fails
    target.write_text("local edit\n")
    (dest / ".git/index.lock").write_text("")
    (dest / ".git/shallow.lock").write_text("")
    out = subprocess.run(["sh", "-c", gitpin.checkout_script(*args)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "removing .git/index.lock left by an interrupted run" in out.stdout
    assert is_current(fact()) and not (dest / ".git/index.lock").exists()

    # a `git init` killed half-way left a .git git does not recognise: it is made again, then checked out
    half = tmp_path / "half"
    (half / ".git/refs").mkdir(parents=True)
    (half / ".git/description").write_text("Unnamed repository\n")
    half_args = (args[0], url, meta["pin"], str(half), meta["sparse"], meta["files"])
    out = subprocess.run(["sh", "-c", gitpin.checkout_script(*half_args)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "removing a half-made .git left by an interrupted run" in out.stdout
    fact_half = GitCheckout().process(sh(GitCheckout().command(str(half), tuple(meta["files"]))))
    assert is_current(fact_half)

    # a wrong pinned SHA is an error naming the repo; a wrong file hash names the file
    wrong = "deadbeef" * 5
    out = subprocess.run(
        ["sh", "-c", gitpin.checkout_script("vllm-src", url, wrong, str(tmp_path / "w"), [], {})],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and f"pinned commit {wrong} of vllm-src ({url}) is not on the remote" in out.stderr
    bad = dict(meta["files"], **{meta["sparse"][0]: "0" * 64})
    out = subprocess.run(["sh", "-c", gitpin.checkout_script(*args[:5], bad)], capture_output=True, text=True)
    assert out.returncode != 0 and f"vllm-src: {meta['sparse'][0]} does not match the lock" in out.stderr


# --- tier 2: weights operation ---------------------------------------------------------------------------

PIN = HfPin(
    name="autoround-int4",
    repo="Lorbus/Qwen3.6-27B-int4-AutoRound",
    revision=SHA,
    files=(HfFile("config.json", 10, "c" * 64), HfFile("model.safetensors", 1000, "d" * 64)),
)
KNOBS = Weights.of({"hf_endpoint": "http://127.0.0.1:1"})
FETCH = dict(asset=PlannedAsset(PIN.name, "ar", PIN), layout=HostLayout(root="/r", model_dir="/m"), knobs=KNOBS)


def weights_fact(tampered=(), free=10**9, stamp_revision=SHA, staging=()):
    files = {"config.json": [10, 111], "model.safetensors": [1000, 222]}
    stamp = {
        "revision": stamp_revision,
        "files": {
            "config.json": {"size": 10, "mtime_ns": 111, "sha256": "c" * 64},
            "model.safetensors": {"size": 1000, "mtime_ns": 222, "sha256": "d" * 64},
        },
    }
    lines = [json.dumps(stamp), "--files--"]
    lines += [f"{s} {m // 10**9}.{m % 10**9:09d}0 {p}" for p, (s, m) in files.items() if p not in tampered]
    lines += [f"{files[p][0]} 999.0000000000 {p}" for p in tampered]
    lines += ["--staging--"] + list(staging)
    return {"--files--": lines, "stat -f -c '%a %S'": [f"{free} 1"]}


def test_weights_noop_when_the_stamp_matches_the_stat():
    assert commands(weights_fact(), hfweights.fetched, **FETCH) == []


def test_weights_leftovers_of_an_interrupted_run_are_removed_from_a_stamped_asset():
    """Killed after the last file moved into place (parts of old revisions, the staging dir) or before the
    token file was removed: the next run removes them, and only them."""
    parts = weights_fact(staging=["--staging-dir--", "5 model.safetensors.0123456789abcdef.part"])
    assert commands(parts, hfweights.fetched, **FETCH) == ["rm -rf /m/.rigforge-staging/autoround-int4"]
    path = "/r/run/weights/autoround-int4.token"
    stat = f"user=root group=root mode=-rw------- atime=0 mtime=0 ctime=0 size=3 '{path}'"
    token = {**weights_fact(), f"stat -c 'user=%U group=%G mode=%A atime=%X mtime=%Y ctime=%Z size=%s %N' {path}": stat}
    assert commands(token, hfweights.fetched, **FETCH) == ["rm -rf /r/run/weights/autoround-int4.token"]


def test_weights_fetch_when_a_file_changed_and_the_manifest_lists_the_lock():
    cmds = commands(weights_fact(tampered=["model.safetensors"]), hfweights.fetched, **FETCH)
    assert cmds[0].startswith("mkdir -p /m/.rigforge-staging/autoround-int4 /m/ar && install -d -m 0700 /r/run/weights")
    assert cmds[1] == "upload /r/run/weights/autoround-int4.json"
    assert cmds[2] == "/r/venv/bin/python /r/lib/fetch_weights.py --manifest /r/run/weights/autoround-int4.json"
    (manifest,) = uploaded_texts(weights_fact(tampered=["config.json"]), hfweights.fetched, **FETCH).values()
    m = json.loads(manifest)
    assert (m["repo"], m["revision"], m["dest"], m["staging"]) == (
        PIN.repo,
        SHA,
        "/m/ar",
        "/m/.rigforge-staging/autoround-int4",
    )
    assert m["files"] == [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in PIN.files]


def test_weights_new_revision_runs_the_script():
    assert len(commands(weights_fact(stamp_revision="b" * 40), hfweights.fetched, **FETCH)) == 3


def test_deep_verify_rehashes_on_the_host_and_changes_something_only_to_repair():
    sums = {"config.json": "c" * 64, "model.safetensors": "d" * 64}
    digests = {"sha256sum --": [f"{digest}  {path}" for path, digest in sums.items()]}
    deep = FETCH | {"knobs": replace(KNOBS, weights_deep_verify=True)}
    assert commands({**weights_fact(), **digests}, hfweights.fetched, **deep) == []
    silent = {"sha256sum --": [f"{'c' * 64}  config.json", f"{'e' * 64}  model.safetensors"]}
    cmds = commands({**weights_fact(), **silent}, hfweights.fetched, **deep)
    assert cmds[-1].endswith("--deep")
    assert FileDigests().process([f"{'a' * 64}  dir/with space.bin", "sha256sum: x: No such file"]) == {
        "dir/with space.bin": "a" * 64
    }


def test_weights_token_travels_as_a_file_never_in_a_command():
    token = "hf_secretTokenValue0123456789"
    cmds = commands(weights_fact(tampered=["config.json"]), hfweights.fetched, **FETCH, token=token)
    assert not any(token in c for c in cmds)
    assert "install -m 0600 /dev/null /r/run/weights/autoround-int4.token" in cmds
    assert "upload /r/run/weights/autoround-int4.token" in cmds
    assert cmds[-1].endswith(
        "--token-file /r/run/weights/autoround-int4.token; rc=$?; rm -f /r/run/weights/autoround-int4.token; exit $rc"
    )
    texts = uploaded_texts(weights_fact(tampered=["config.json"]), hfweights.fetched, **FETCH, token=token)
    assert texts["/r/run/weights/autoround-int4.token"] == token.encode()
    assert token not in texts["/r/run/weights/autoround-int4.json"]


def test_weights_disk_preflight_counts_only_missing_bytes():
    # 1000-byte file missing; 1050 needed with 5% headroom
    fact = weights_fact(tampered=["model.safetensors"], free=1049)
    fact["--files--"] = [line for line in fact["--files--"] if not line.endswith(" model.safetensors")]
    (cmd,) = commands(fact, hfweights.fetched, **FETCH)
    assert cmd.startswith("fail: @fake/rig: not enough disk space for autoround-int4 at /m/ar")
    assert "free space or set serving_model_dir" in cmd
    # 600 bytes of it already in staging: 420 bytes needed
    fact["--files--"] = fact["--files--"][:-1] + ["--staging--", f"600 model.safetensors.{'d' * 16}.part"]
    fact["stat -f -c '%a %S'"] = ["421 1"]
    assert len(commands(fact, hfweights.fetched, **FETCH)) == 3


def test_weights_controller_source_uploads_into_staging(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(hfweights, "controller_cache", lambda pin, *a: cache)
    controller = FETCH | {"knobs": replace(KNOBS, weights_source="controller")}
    cmds = commands(weights_fact(tampered=["config.json"]), hfweights.fetched, **controller)
    assert "upload /m/.rigforge-staging/autoround-int4/config.json" in cmds
    assert "upload /m/.rigforge-staging/autoround-int4/model.safetensors" not in cmds
    assert cmds[-1].endswith("--staged-only")


# --- tier 2: role refusals (pyinfra's real prepare/execute on a fake host) -------------------------------


def lock_for_roles(**hf_changes):
    entry = {
        "repo": "z-lab/Qwen3.6-27B-DFlash",
        "revision": SHA,
        "gated": True,
        "files": [{"path": "config.json", "size": 1, "sha256": "c" * 64}],
        **hf_changes,
    }
    return parse_lock(
        {
            "version": 1,
            "image": {"ref": "x", "digest": None},
            "git": {"vllm-src": {"url": "git://h/v.git", "ref": "b", "commit": None}},
            "hf": {"dflash-draft": entry},
        },
        "t.yaml",
    )


# Refusals of unresolved lock entries and of gated repos without a token happen while the plan is built
# (roles/site.py), before any role runs: tests/test_plan.py.


# --- fetch_weights.py against the HF stand-in ------------------------------------------------------------


def manifest(si, tmp_path, key="autoround-int4", **changes) -> dict:
    meta = si["hf"][key]
    m = {
        "name": key,
        "repo": meta["repo"],
        "revision": meta["revision"],
        "gated": meta["gated"],
        "endpoint": si["endpoint"],
        "dest": str(tmp_path / "models" / key),
        "staging": str(tmp_path / "models" / ".staging" / key),
        "stamp": str(tmp_path / "models" / key / STAMP),
        "files": [{k: f[k] for k in ("path", "size", "sha256")} for f in meta["files"]],
    }
    m.update(changes)
    return m


def fetch(m: dict, *args: str, token: str | None = None, tmp_path: Path | None = None):
    extra = []
    if token:
        tf = Path(m["dest"]).parent / "token"
        tf.parent.mkdir(parents=True, exist_ok=True)
        tf.write_text(token)
        extra = ["--token-file", str(tf)]
    return subprocess.run(
        [sys.executable, str(SCRIPT), *extra, *args], input=json.dumps(m), capture_output=True, text=True, timeout=120
    )


def control(si, **kw):
    body = json.dumps({"throttle_bps": None, "drop_after_bytes": None, **kw}).encode()
    urllib.request.urlopen(urllib.request.Request(f"{si['endpoint']}/_testbed/control", data=body, method="POST"))


def hf_log(si) -> list[dict]:
    """The stand-in's request log, without its own /_testbed requests."""
    with urllib.request.urlopen(f"{si['endpoint']}/_testbed/log") as resp:
        return [e for e in json.load(resp) if not e["path"].startswith("/_testbed/")]


def big_file(m: dict) -> dict:
    return max(m["files"], key=lambda f: f["size"])


def test_fetch_downloads_verifies_stamps_and_reruns_from_the_stamp(stand_ins, tmp_path):
    m = manifest(stand_ins, tmp_path)
    out = fetch(m)
    assert out.returncode == 0, out.stderr
    dest = Path(m["dest"])
    stamp = json.loads((dest / ".rigforge-stamp.json").read_text())
    assert stamp["revision"] == m["revision"]
    for f in m["files"]:
        data = (dest / f["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f["sha256"]
        st = os.stat(dest / f["path"])
        assert stamp["files"][f["path"]] == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": f["sha256"]}
    assert "sha256 verified, in place" in out.stdout
    assert not Path(m["staging"]).exists()
    # a part left by an older lock revision is dropped once everything is in place
    (stale := Path(m["staging"]) / "old.safetensors.0123456789abcdef.part").parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    (Path(m["dest"]) / m["files"][0]["path"]).unlink()
    assert fetch(m).returncode == 0 and not Path(m["staging"]).exists()
    # a file whose mtime moved is only re-hashed, and the staging dir the operation made first is not left behind
    os.utime(dest / m["files"][0]["path"], ns=(0, 1577836800 * 10**9))
    Path(m["staging"]).mkdir(parents=True)
    out = fetch(m)
    assert out.returncode == 0 and "hashing" in out.stdout and not Path(m["staging"]).exists(), out.stdout
    n = len(hf_log(stand_ins))
    again = fetch(m)
    assert again.returncode == 0 and "verified (stamp)" in again.stdout and "hashing" not in again.stdout
    assert len(hf_log(stand_ins)) == n + 0, "a stamped re-run talked to the hub"


def test_fetch_resumes_a_dropped_transfer_with_a_range_request(stand_ins, tmp_path):
    m = manifest(stand_ins, tmp_path, files=[big_file(manifest(stand_ins, tmp_path))])
    f = m["files"][0]
    control(stand_ins, drop_after_bytes=200_000)
    out = fetch(m)
    assert out.returncode == 0, out.stderr
    assert "transfer ended early" in out.stdout and "resuming at" in out.stdout
    gets = [e for e in hf_log(stand_ins) if e["method"] == "GET" and e["path"].endswith(f["path"])]
    assert gets[-2]["range"] is None and gets[-1] == {**gets[-1], "range": "bytes=200000-", "status": 206}
    assert hashlib.sha256((Path(m["dest"]) / f["path"]).read_bytes()).hexdigest() == f["sha256"]


def test_fetch_refetches_a_tampered_file_and_deep_finds_a_silent_one(stand_ins, tmp_path):
    m = manifest(stand_ins, tmp_path)
    assert fetch(m).returncode == 0
    f = big_file(m)
    path = Path(m["dest"]) / f["path"]
    with open(path, "r+b") as fh:
        fh.seek(100)
        fh.write(b"XXXX")
    out = fetch(m)
    assert out.returncode == 0 and f"{f['path']}: does not match the lock" in out.stdout
    assert hashlib.sha256(path.read_bytes()).hexdigest() == f["sha256"]

    st = os.stat(path)
    with open(path, "r+b") as fh:
        fh.seek(100)
        fh.write(b"YYYY")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: the stamp cannot see it
    assert "verified (stamp)" in fetch(m).stdout
    out = fetch(m, "--deep")
    assert out.returncode == 0 and f"{f['path']}: does not match the lock" in out.stdout
    assert hashlib.sha256(path.read_bytes()).hexdigest() == f["sha256"]


def test_fetch_hub_bytes_not_matching_the_lock_fail_naming_the_file(stand_ins, tmp_path):
    m = manifest(stand_ins, tmp_path)
    f = big_file(m)
    f["sha256"] = "0" * 64
    out = fetch(m)
    assert out.returncode == 4
    assert f"{f['path']}: verification failed" in out.stderr and "fetching it again" in out.stdout
    assert not (Path(m["dest"]) / f["path"]).exists()
    assert not list(Path(m["staging"]).rglob("*.part"))


def test_fetch_checks_disk_space_and_token_before_downloading(stand_ins, tmp_path):
    m = manifest(stand_ins, tmp_path)
    big_file(m)["size"] = 2**50
    n = len(hf_log(stand_ins))
    out = fetch(m)
    assert out.returncode == 3 and "not enough disk space" in out.stderr
    assert len(hf_log(stand_ins)) == n, "downloaded despite the disk check"

    g = manifest(stand_ins, tmp_path, key="dflash-draft")
    out = fetch(g)
    assert out.returncode == 2 and "z-lab/Qwen3.6-27B-DFlash is gated" in out.stderr
    out = fetch(g, token=stand_ins["token"])
    assert out.returncode == 0, out.stderr
    assert stand_ins["token"] not in out.stdout + out.stderr


def test_fetch_gets_a_split_ggufs_parts_into_their_folder_verified_and_resumes_a_cut_part(stand_ins, tmp_path):
    """A split GGUF (-0000N-of-0000M parts in a quant's folder): the lock's included parts only, under their folder,
    sha256-verified; a part cut mid-transfer resumes with a range request."""
    key = "deepseek-v4-flash-0731-gguf-unsloth-iq2-xxs"
    meta = stand_ins["hf"][key]
    parts = [f for f in manifest(stand_ins, tmp_path, key)["files"] if f["path"] in meta["include"]]
    assert [f["path"][-20:] for f in parts] == [f"-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    m = manifest(stand_ins, tmp_path, key, files=parts)
    control(stand_ins, drop_after_bytes=100_000)
    out = fetch(m)
    assert out.returncode == 0, out.stderr
    assert "resuming at" in out.stdout, out.stdout
    dest = Path(m["dest"])
    assert sorted(p.name for p in (dest / "UD-IQ2_XXS").iterdir()) == sorted(f["path"].split("/")[1] for f in parts)
    assert not (dest / "UD-Q8_K_XL").exists()  # the other quant of the repo is not fetched
    for f in parts:
        data = (dest / f["path"]).read_bytes()
        assert data[:4] == b"GGUF" and hashlib.sha256(data).hexdigest() == f["sha256"]
    assert "verified (stamp)" in fetch(m).stdout
