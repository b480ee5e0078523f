"""`rigforge lock` against local stand-ins (a git daemon over bare repos, the testbed's HF server on 127.0.0.1),
never the internet: resolution of branches, short SHAs and HF revisions with per-file sha256, `--check`, and
clear, non-destructive failures."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from rigforge.cli.lock import cuda_of, manifest_url
from rigforge.model.pins import load_lock
from rigforge.testbed import content

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


IMAGE_DIGEST = "sha256:" + "7a" * 32
AMD64, ARM64, CONFIG = ("sha256:" + c * 64 for c in "abc")
# what the stand-in serves by digest: a multi-platform index, the amd64 image's manifest, its config blob (the
# CUDA_VERSION a CUDA base image sets; the arm64 image is never asked for)
BLOBS = {
    f"/v2/vllm/vllm-openai/manifests/{IMAGE_DIGEST}": {
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {"digest": ARM64, "platform": {"architecture": "arm64", "os": "linux"}},
            {"digest": AMD64, "platform": {"architecture": "amd64", "os": "linux"}},
        ],
    },
    f"/v2/vllm/vllm-openai/manifests/{AMD64}": {"config": {"digest": CONFIG}, "layers": []},
    f"/v2/vllm/vllm-openai/blobs/{CONFIG}": {
        "architecture": "amd64",
        "config": {"Env": ["PATH=/usr/bin", "NVARCH=x86_64", "CUDA_VERSION=13.0.1"], "Labels": {}},
    },
}


B_DIGEST, B_CONFIG = "sha256:" + "b1" * 32, "sha256:" + "b2" * 32
BLOBS[f"/v2/vllm/vllm-openai/manifests/{B_DIGEST}"] = {"config": {"digest": B_CONFIG}, "layers": []}
BLOBS[f"/v2/vllm/vllm-openai/blobs/{B_CONFIG}"] = {"architecture": "amd64", "config": {"Env": ["CUDA_VERSION=13.0.2"]}}


class Registry(BaseHTTPRequestHandler):
    """A container registry stand-in: the Distribution API's bearer challenge, then a manifest digest; manifests
    and the config blob by digest."""

    def log_message(self, *args):
        pass

    def do_GET(self):  # the token endpoint, then manifests and blobs by digest (with the token)
        if not self.path.startswith("/token?") and self.headers.get("Authorization") != "Bearer anon-token":
            return self.do_HEAD()  # the challenge
        body = b'{"token": "anon-token"}' if self.path.startswith("/token?") else b"{}"
        body = json.dumps(BLOBS[self.path]).encode() if self.path in BLOBS else body
        self.send_response(200 if self.path.startswith("/token?") or self.path in BLOBS else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self):
        if self.headers.get("Authorization") != "Bearer anon-token":
            self.send_response(401)
            realm = f"http://127.0.0.1:{self.server.server_port}/token"
            self.send_header("WWW-Authenticate", f'Bearer realm="{realm}",service="stand-in",scope="pull"')
        elif self.path == "/v2/vllm/vllm-openai/manifests/nightly-x" and "manifest.list" in self.headers["Accept"]:
            self.send_response(200)
            self.send_header("Docker-Content-Digest", IMAGE_DIGEST)
        elif self.path == "/v2/vllm/vllm-openai/manifests/v0.31.0":  # the recipe repo's commit B moves to it
            self.send_response(200)
            self.send_header("Docker-Content-Digest", B_DIGEST)
        else:
            self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """A git daemon and an HF stand-in on loopback, serving the testbed's generated content."""
    base = tmp_path_factory.mktemp("stand-ins")
    git_meta = content.build_git(base / "git")
    hf_meta = content.build_hf(base / "hf", shard_size=512 * 1024)
    git_port, hf_port = _free_port(), _free_port()
    procs = [
        subprocess.Popen(
            [
                "git",
                "daemon",
                "--reuseaddr",
                f"--base-path={base / 'git'}",
                "--export-all",
                "--listen=127.0.0.1",
                f"--port={git_port}",
                str(base / "git"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "rigforge/testbed/hfserver.py"),
                "--root",
                str(base / "hf"),
                "--port",
                str(hf_port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    registry = ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    threading.Thread(target=registry.serve_forever, daemon=True).start()
    saved = os.environ.get("RIGFORGE_REGISTRY")
    os.environ["RIGFORGE_REGISTRY"] = f"http://127.0.0.1:{registry.server_port}"  # never Docker Hub in tests
    try:
        _wait(git_port)
        _wait(hf_port)
        yield {
            "git_url": lambda name: f"git://127.0.0.1:{git_port}/{name}.git",
            "git": git_meta,
            "hf": hf_meta,
            "endpoint": f"http://127.0.0.1:{hf_port}",
            "token": content.HF_TOKEN,
            "dir": base,
        }
    finally:
        registry.shutdown()
        if saved is None:
            os.environ.pop("RIGFORGE_REGISTRY", None)
        else:
            os.environ["RIGFORGE_REGISTRY"] = saved
        for p in procs:
            p.terminate()
            p.wait(timeout=10)


def unresolved_lock(si) -> dict:
    """A lock for the stand-ins with every entry unresolved, refs as in the real lock's shapes."""
    vllm_base = si["git"]["vllm-src"]["commits"][0]  # not the branch tip: a short SHA inside its history
    return {
        "version": 1,
        "image": {"ref": "vllm/vllm-openai:nightly-x", "digest": None},
        "git": {
            "genesis": {"url": si["git_url"]("genesis"), "ref": "main", "commit": None},
            "vllm-src": {
                "url": si["git_url"]("vllm-src"),
                "ref": "marlin-pad-sub-tile-n",
                "short": vllm_base[:7],
                "commit": None,
                "sparse": si["git"]["vllm-src"]["sparse"],
            },
            "club-3090": {"url": si["git_url"]("club-3090"), "ref": si["git"]["club-3090"]["pin"][:8], "commit": None},
        },
        "hf": {key: {"repo": m["repo"], "revision": None, "gated": False, "files": []} for key, m in si["hf"].items()},
    }


def rigforge_lock(*args: str, token: str | None = None, endpoint: str | None = None, env: dict | None = None):
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "RIGFORGE_HF_TOKEN", "HF_ENDPOINT")}
    env |= extra
    env.setdefault("RIGFORGE_REGISTRY", "http://127.0.0.1:9")  # a closed port: never a real registry
    env.setdefault("RIGFORGE_TOOLKIT_REPO", "http://127.0.0.1:9/")  # nor NVIDIA's toolkit repo
    env.update({"HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(Path(args[-1]).parent / "hf-home")})
    if token:
        env["RIGFORGE_HF_TOKEN"] = token
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return subprocess.run(
        [sys.executable, "-m", "rigforge.cli", "lock", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_lock_resolves_branches_short_shas_and_hf_revisions(stand_ins, tmp_path):
    si = stand_ins
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(unresolved_lock(si)))
    proc = rigforge_lock("--lock", str(path), token=si["token"], endpoint=si["endpoint"])
    assert proc.returncode == 0, proc.stderr
    lock = load_lock(path)
    assert lock.git["genesis"].commit == si["git"]["genesis"]["pin"]  # branch tip via ls-remote
    assert lock.git["vllm-src"].commit == si["git"]["vllm-src"]["commits"][0]  # short SHA expanded, not the tip
    assert lock.git["club-3090"].commit == si["git"]["club-3090"]["pin"]
    for key, meta in si["hf"].items():
        pin = lock.hf[key]
        assert pin.revision == meta["revision"]
        assert pin.gated == meta["gated"]
        want = sorted((f["path"], f["size"], f["sha256"]) for f in meta["files"])
        assert sorted((f.path, f.size, f.sha256) for f in pin.files) == want  # LFS and small files alike
    assert lock.image.digest == IMAGE_DIGEST
    assert lock.image.cuda == "13.0"  # CUDA_VERSION=13.0.1 of the amd64 image's config, as major.minor
    assert lock.unresolved() == []
    assert "image: vllm/vllm-openai:nightly-x -> " + IMAGE_DIGEST + " (CUDA 13.0)" in proc.stdout
    assert "git.vllm-src: marlin-pad-sub-tile-n -> " + si["git"]["vllm-src"]["commits"][0] in proc.stdout

    # nothing left to resolve: the file is not rewritten
    mtime = path.stat().st_mtime_ns
    again = rigforge_lock("--lock", str(path), token=si["token"], endpoint=si["endpoint"])
    assert again.returncode == 0 and "nothing to resolve" in again.stdout
    assert path.stat().st_mtime_ns == mtime


def test_refresh_moves_an_entry_to_its_ref(stand_ins, tmp_path):
    si = stand_ins
    data = unresolved_lock(si)
    old = si["git"]["genesis"]["commits"][0]
    data["git"]["genesis"]["commit"] = old
    data["git"] = {"genesis": data["git"]["genesis"]}
    data["hf"] = {}
    data["image"]["digest"] = "sha256:" + "0" * 64
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(data))
    assert rigforge_lock("--lock", str(path)).stdout.strip() == "nothing to resolve"
    assert load_lock(path).git["genesis"].commit == old
    proc = rigforge_lock("--lock", str(path), "--refresh", "genesis")
    assert proc.returncode == 0, proc.stderr
    assert load_lock(path).git["genesis"].commit == si["git"]["genesis"]["pin"]
    assert rigforge_lock("--lock", str(path), "--refresh", "nope").returncode == 1


@pytest.mark.parametrize(
    "change, needs",
    [
        (lambda d: d["git"]["genesis"].update(ref="no-such-branch"), "git.genesis: ref 'no-such-branch' not found"),
        (lambda d: d["git"]["vllm-src"].update(short="abcdef1"), "git.vllm-src: cannot resolve abcdef1"),
        (lambda d: d["hf"]["autoround-int4"].update(repo="nobody/none"), "hf.autoround-int4: cannot read nobody/none"),
        (lambda d: d["image"].update(ref="vllm/vllm-openai:gone"), "image: vllm/vllm-openai:gone: registry answered"),
    ],
)
def test_resolution_failures_name_the_entry_and_leave_the_lock_alone(stand_ins, tmp_path, change, needs):
    data = unresolved_lock(stand_ins)
    change(data)
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(data))
    before = path.read_text()
    proc = rigforge_lock("--lock", str(path), token=stand_ins["token"], endpoint=stand_ins["endpoint"])
    assert proc.returncode == 1
    assert needs in proc.stderr
    assert path.read_text() == before


def test_lock_offline_names_every_entry_it_could_not_resolve(stand_ins, tmp_path):
    """No git remote, registry or hub answers: every unresolved entry is named, one line each, not just the first;
    nothing is written."""
    data = unresolved_lock(stand_ins)
    for pin in data["git"].values():
        pin["url"] = "git://127.0.0.1:9/gone.git"
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(data))
    before = path.read_text()
    proc = rigforge_lock(
        "--lock", str(path), endpoint="http://127.0.0.1:9", env={"RIGFORGE_REGISTRY": "http://127.0.0.1:9"}
    )
    assert proc.returncode == 1
    named = [line.split(": ")[1] for line in proc.stderr.splitlines() if ": could not resolve " in line]
    lock = load_lock(path)
    entries = ["image", *(f"git.{n}" for n in lock.git), *(f"hf.{n}" for n in lock.hf)]
    assert named == [f"could not resolve {e}" for e in entries], proc.stderr
    assert "on git://127.0.0.1:9/gone.git: 127.0.0.1[0: 127.0.0.1]: errno=Connection refused\n" in proc.stderr
    assert proc.stderr.endswith(f"rigforge lock: nothing written: {path} is as it was\n")
    assert path.read_text() == before


def test_gated_repo_without_token_is_named(stand_ins, tmp_path):
    data = unresolved_lock(stand_ins)
    data["git"] = {}
    data["image"]["digest"] = "sha256:" + "0" * 64
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = rigforge_lock("--lock", str(path), endpoint=stand_ins["endpoint"])
    assert proc.returncode == 1
    assert "hf.dflash-draft: cannot read z-lab/Qwen3.6-27B-DFlash@main" in proc.stderr
    assert "Gated" in proc.stderr


def test_check_is_offline_and_lists_offending_entries(tmp_path):
    proc = rigforge_lock("--check", "--lock", str(REPO / "rigforge.lock.yaml"))
    assert proc.returncode == 1
    for entry in ("git.vllm-src", "hf.autoround-int4", "hf.dflash-draft", "hf.carnice", "image", "images.vllm-stable"):
        assert entry in proc.stderr
    assert "git.genesis" not in proc.stderr and "git.club-3090" not in proc.stderr and "git.recipes" not in proc.stderr

    data = yaml.safe_load((REPO / "rigforge.lock.yaml").read_text())
    data["image"]["digest"] = "sha256:" + "1" * 64
    data["images"]["vllm-stable"]["digest"] = "sha256:" + "4" * 64
    data["images"]["llama-cpp-local"]["digest"] = "sha256:" + "5" * 64
    data["git"]["vllm-src"]["commit"] = "67f8c2b" + "0" * 33
    for entry in data["hf"].values():
        entry["revision"] = "2" * 40
        entry["files"] = [{"path": "config.json", "size": 3, "sha256": "3" * 64}]
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(data))
    proc = rigforge_lock("--check", "--lock", str(good))
    assert proc.returncode == 0, proc.stderr
    assert "all resolved" in proc.stdout

    data["git"]["vllm-src"]["commit"] = "1234567" + "0" * 33
    good.write_text(yaml.safe_dump(data))
    proc = rigforge_lock("--check", "--lock", str(good))
    assert proc.returncode == 1 and "does not start with short 67f8c2b" in proc.stderr

    data["git"]["vllm-src"]["commit"] = "short"
    good.write_text(yaml.safe_dump(data))
    proc = rigforge_lock("--check", "--lock", str(good))
    assert proc.returncode == 1 and "git.vllm-src.commit: expected a 40-hex commit SHA or null" in proc.stderr


@pytest.mark.parametrize(
    "ref, url",
    [
        ("vllm/vllm-openai:nightly-7a1e", "https://registry-1.docker.io/v2/vllm/vllm-openai/manifests/nightly-7a1e"),
        ("ubuntu", "https://registry-1.docker.io/v2/library/ubuntu/manifests/latest"),
        ("ghcr.io/org/img:1.0", "https://ghcr.io/v2/org/img/manifests/1.0"),
        ("localhost:5000/img:t", "https://localhost:5000/v2/img/manifests/t"),
    ],
)
def test_image_references_map_to_registry_manifest_urls(ref, url):
    assert manifest_url(ref) == url


def test_the_cuda_version_comes_from_the_config_env_or_a_label():
    assert cuda_of({"config": {"Env": ["CUDA_VERSION=13.2.0"]}}) == "13.2"
    assert cuda_of({"config": {"Env": [], "Labels": {"com.nvidia.cuda.version": "12.9.1"}}}) == "12.9"
    assert cuda_of({"config": {"Env": ["PATH=/bin"]}}) is None  # a CPU image: no CUDA recorded
    assert cuda_of({}) is None


RECIPES_REF = REPO / "tests/fixtures/club-3090-4a29ab57"  # vendored verbatim subset (PROVENANCE.md)


def test_recipe_images_get_their_digest_and_the_lock_pins_what_runs(stand_ins, tmp_path):
    data = unresolved_lock(stand_ins)
    data["images"] = {"vllm-stable": {"ref": "vllm/vllm-openai:nightly-x", "digest": None}}
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = rigforge_lock("--lock", str(path), token=stand_ins["token"], endpoint=stand_ins["endpoint"])
    assert proc.returncode == 0, proc.stderr
    lock = load_lock(path)
    assert lock.images["vllm-stable"].digest == IMAGE_DIGEST
    assert lock.pinned("vllm/vllm-openai:nightly-x") == f"vllm/vllm-openai:nightly-x@{IMAGE_DIGEST}"
    assert lock.pinned("vllm/vllm-openai:other") == "vllm/vllm-openai:other"  # not in the lock: the tag itself


def test_a_purged_tag_fails_in_one_line_naming_the_image_and_a_live_recipe(stand_ins, tmp_path, monkeypatch):
    monkeypatch.setenv("RIGFORGE_RECIPES", str(RECIPES_REF))
    data = unresolved_lock(stand_ins)
    data["images"] = {"vllm-nightly-mtp": {"ref": "vllm/vllm-openai:nightly-01d4d1ad", "digest": None}}
    data["image"]["digest"] = IMAGE_DIGEST
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(data))
    before = path.read_text()
    proc = rigforge_lock("--lock", str(path), token=stand_ins["token"], endpoint=stand_ins["endpoint"])
    assert proc.returncode == 1 and proc.stderr.count("\n") == 2, proc.stderr
    assert "images.vllm-nightly-mtp: vllm/vllm-openai:nightly-01d4d1ad: registry answered HTTP 404" in proc.stderr
    assert proc.stderr.endswith(f"rigforge lock: nothing written: {path} is as it was\n")
    # the first slug of the registry rigforge serves (any card count: vllm/minimal is its 1-card one)
    assert "rigforge_variant: vllm/minimal (vllm/vllm-openai:v0.27.1" in proc.stderr
    assert path.read_text() == before


def test_lock_caches_the_recipe_repo_at_its_commit_for_offline_render(stand_ins, tmp_path, monkeypatch):
    work = tmp_path / "club-3090"
    shutil.copytree(RECIPES_REF, work, symlinks=True)  # a copy in a temp git repo: the reference stays as is
    env = {
        **os.environ,
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    for cmd in (
        ["init", "-q"],
        ["add", "-A"],
        ["commit", "-qm", "recipes"],
        ["config", "uploadpack.allowAnySHA1InWant", "true"],
    ):
        subprocess.run(["git", *cmd], cwd=work, env=env, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=work, capture_output=True, text=True).stdout.strip()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("RIGFORGE_RECIPES", raising=False)
    data = unresolved_lock(stand_ins)
    data["image"]["digest"] = IMAGE_DIGEST
    data["git"] = {"recipes": {"url": f"file://{work}", "ref": "master", "commit": commit}}
    data["hf"] = {}
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = rigforge_lock("--lock", str(path))
    assert proc.returncode == 0, proc.stderr
    cached = tmp_path / "cache" / "rigforge" / "recipes" / commit
    assert f"git.recipes: cached {commit[:12]} at {cached}" in proc.stdout
    assert (cached / "scripts/lib/profiles/registry.yaml").read_bytes() == (
        RECIPES_REF / "scripts/lib/profiles/registry.yaml"
    ).read_bytes()
    from rigforge.model import recipes

    assert recipes.locate(commit) == cached  # without RIGFORGE_RECIPES, render reads this cache
    again = rigforge_lock("--lock", str(path))
    assert again.returncode == 0 and "cached" not in again.stdout


# NVIDIA's flat repo index lists every release of each package; 1.19.1-1 is the one that broke cuInit
# (NVIDIA/nvidia-container-toolkit#1967); a pre-release is never offered as "newer".
TOOLKIT_PACKAGES = "".join(
    f"Package: {name}\nVersion: {version}\nArchitecture: amd64\nDescription: stand-in\n multi-line field\n\n"
    for version in ("1.18.0-1", "1.19.0-1", "1.19.1-1", "1.20.0~rc.1-1")
    for name in ("nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container1")
)


def test_lock_keeps_the_toolkit_pin_and_says_when_a_newer_release_exists(tmp_path):
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo/Packages").write_text(TOOLKIT_PACKAGES)
    repo = ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "repo"))
    )
    threading.Thread(target=repo.serve_forever, daemon=True).start()
    lock = {
        "version": 1,
        "image": {"ref": "vllm/vllm-openai:nightly-x", "digest": IMAGE_DIGEST},
        "toolkit": {"version": "1.19.0-1", "note": "1.19.1 broke cuInit, NVIDIA/nvidia-container-toolkit#1967"},
    }
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(lock, sort_keys=False))
    before = path.read_text()
    try:
        os.environ["RIGFORGE_TOOLKIT_REPO"] = f"http://127.0.0.1:{repo.server_port}/"
        res = rigforge_lock("--lock", str(path))
    finally:
        os.environ.pop("RIGFORGE_TOOLKIT_REPO")
        repo.shutdown()
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [
        "nothing to resolve",
        "nvidia-container-toolkit: locked 1.19.0-1, newer 1.19.1-1 exists upstream; kept (1.19.1 broke cuInit, "
        "NVIDIA/nvidia-container-toolkit#1967); to move: set toolkit.version in the lock (or host data "
        "nvidia_toolkit_version) to 1.19.1-1 once it is known to work",
    ]
    assert path.read_text() == before  # never moved without being asked

    offline = rigforge_lock("--lock", str(path))  # the closed port: one line, the lock untouched
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.splitlines()[1:] == [
        "nvidia-container-toolkit: locked 1.19.0-1; could not check http://127.0.0.1:9/Packages for a newer "
        "release (ConnectionError)"
    ]
    assert path.read_text() == before


def test_toolkit_news_only_for_a_newer_release():
    from rigforge.cli.lock import toolkit_news
    from rigforge.model.pins import ToolkitPin

    assert toolkit_news(ToolkitPin("1.19.1-1"), TOOLKIT_PACKAGES) is None
    assert toolkit_news(ToolkitPin("1.20.0-1"), TOOLKIT_PACKAGES) is None  # 1.20.0~rc.1 is older, and a pre-release
    assert "newer 1.19.1-1 exists" in toolkit_news(ToolkitPin("1.18.0-1"), TOOLKIT_PACKAGES)


def recipes_remote(tmp_path) -> dict:
    """A bare recipe repo with the testbed's commits A (the vendored subset), B and B-slow, tagged."""
    return content._build_recipes(RECIPES_REF, tmp_path / "recipes-work", tmp_path, content._git_env())["tags"]


def lock_at_a(si, tmp_path, tags) -> Path:
    """A resolved lock whose recipe pin is commit A and whose vllm-stable image is A's, by digest."""
    data = unresolved_lock(si)
    data["image"]["digest"] = IMAGE_DIGEST
    data["git"] = {"recipes": {"url": f"file://{tmp_path / 'recipes.git'}", "ref": "A", "commit": tags["A"]}}
    data["images"] = {"vllm-stable": {"ref": "vllm/vllm-openai:v0.27.1", "digest": IMAGE_DIGEST, "cuda": "13.0"}}
    hf = si["hf"]["autoround-int4"]
    files = [{k: f[k] for k in ("path", "size", "sha256")} for f in hf["files"]]
    data["hf"] = {"autoround-int4": {"repo": hf["repo"], "revision": hf["revision"], "files": files}}
    path = tmp_path / "lock.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_lock_follows_the_recipe_repo_to_a_later_commit_into_a_candidate(stand_ins, tmp_path, monkeypatch):
    """`lock --recipes B --inventory INV --out FILE`: the recipe pin at B, B's engine image resolved to its digest, the
    new slug's weights resolved; the diff printed; the lock in use left as it was."""
    from rigforge.model import recipes
    from rigforge.testbed.recipe_commits import B_IMAGE, NEW_REPO, NEW_SLUG

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("RIGFORGE_RECIPES", raising=False)
    tags = recipes_remote(tmp_path)
    path = lock_at_a(stand_ins, tmp_path, tags)
    before, out = path.read_text(), tmp_path / "candidate.yaml"
    env = {"RIGFORGE_REGISTRY": os.environ["RIGFORGE_REGISTRY"], "XDG_CACHE_HOME": str(tmp_path / "cache")}
    inv = tmp_path / "inventory.py"  # the rig deploys B's new slug: its weights get an entry
    inv.write_text(f"rigs = [('rig1', {{'ssh_hostname': '127.0.0.1', 'rigforge_variant': {NEW_SLUG!r}}})]\n")
    proc = rigforge_lock(
        "--recipes",
        "B",
        "--inventory",
        str(inv),
        "--out",
        str(out),
        "--lock",
        str(path),
        endpoint=stand_ins["endpoint"],
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert path.read_text() == before and f"(the lock in use, {path}, is as it was)" in proc.stdout
    diff = proc.stdout
    assert f"-    commit: {tags['A']}" in diff and f"+    commit: {tags['B']}" in diff, diff
    assert "-    ref: vllm/vllm-openai:v0.27.1" in diff and f"+    ref: {B_IMAGE}" in diff, diff
    assert f"+    digest: {B_DIGEST}" in diff, diff
    assert f"+    repo: {NEW_REPO}" in diff, diff
    new = load_lock(out)
    assert new.git["recipes"].commit == tags["B"] and new.images["vllm-stable"].digest == B_DIGEST
    assert new.check() == []  # every entry resolved: a deploy takes it as it is
    live = recipes.find(NEW_SLUG, new, opt_in=False)  # the new slug deploys from the candidate, by digest
    assert live.image == f"{B_IMAGE}@{B_DIGEST}"
    again = rigforge_lock("--recipes", "B", "--lock", str(out), endpoint=stand_ins["endpoint"], env=env)
    assert again.returncode == 0 and "no change" in again.stdout and again.stdout.count("\n") == 1, again.stdout


def test_lock_recipes_offline_names_what_it_could_not_resolve_and_writes_nothing(stand_ins, tmp_path, monkeypatch):
    from rigforge.testbed.recipe_commits import NEW_SLUG

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tags = recipes_remote(tmp_path)
    path = lock_at_a(stand_ins, tmp_path, tags)
    before, out = path.read_text(), tmp_path / "candidate.yaml"
    env = {
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "RIGFORGE_REGISTRY": "http://127.0.0.1:9",
    }  # no registry, no hub
    proc = rigforge_lock("--recipes", "B", "--add", NEW_SLUG, "--out", str(out), "--lock", str(path), env=env)
    assert proc.returncode == 1, proc.stdout
    assert "could not resolve images.vllm-stable: cannot reach the registry for vllm/vllm-openai:v0.31.0" in proc.stderr
    assert "could not resolve hf.qwen3.6-27b-autoround-int4-v2: cannot read" in proc.stderr, proc.stderr
    assert f"nothing written: {out} was not created" in proc.stderr and "as it was" not in proc.stderr
    assert path.read_text() == before and not out.exists()
    gone = rigforge_lock("--recipes", "nope", "--lock", str(path), env=env)  # a ref the remote lacks
    assert gone.returncode == 1 and "ref 'nope' not found" in gone.stderr, gone.stderr
    assert f"nothing written: {path} is as it was" in gone.stderr
    assert path.read_text() == before


def test_a_failed_lock_recipes_says_as_it_was_only_of_a_file_that_was_there(stand_ins, tmp_path, monkeypatch):
    """With RIGFORGE_RECIPES pinning the recipe tree (as the README has users export it), `--out FILE` for a FILE
    that did not exist is said to be not created, and one that did exist is as it was, byte for byte."""
    from rigforge.testbed.recipe_commits import NEW_SLUG

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = lock_at_a(stand_ins, tmp_path, recipes_remote(tmp_path))
    env = {
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "RIGFORGE_RECIPES": str(RECIPES_REF),
        "HF_ENDPOINT": "http://127.0.0.1:9",  # no hub, no registry: the new entries cannot resolve
        "RIGFORGE_REGISTRY": "http://127.0.0.1:9",
    }
    absent, present = tmp_path / "new.yaml", tmp_path / "old-candidate.yaml"
    present.write_text("an earlier candidate\n")
    args = ("--recipes", "B", "--add", NEW_SLUG, "--lock", str(path))
    new = rigforge_lock(*args, "--out", str(absent), env=env)
    assert new.returncode == 1 and "could not resolve images.vllm-stable" in new.stderr, new.stderr
    assert f"nothing written: {absent} was not created" in new.stderr and "as it was" not in new.stderr
    assert not absent.exists()
    old = rigforge_lock(*args, "--out", str(present), env=env)
    assert old.returncode == 1 and f"nothing written: {present} is as it was" in old.stderr, old.stderr
    assert present.read_text() == "an earlier candidate\n"


def test_a_purged_image_at_ref_never_advises_the_lock_in_use(stand_ins, tmp_path, monkeypatch):
    """`lock --recipes B-slow` whose engine image the registry no longer has: the advice names a slug of B-slow's
    tree, never one of the lock in use (A, v0.27.1) nor of the tree RIGFORGE_RECIPES names (A too)."""
    from rigforge.testbed.recipe_commits import SLOW_IMAGE

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tags = recipes_remote(tmp_path)
    path = lock_at_a(stand_ins, tmp_path, tags)
    env = {
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "RIGFORGE_RECIPES": str(RECIPES_REF),
        "RIGFORGE_REGISTRY": os.environ["RIGFORGE_REGISTRY"],  # it answers 404 for SLOW_IMAGE
    }
    proc = rigforge_lock("--recipes", "B-slow", "--out", str(tmp_path / "c.yaml"), "--lock", str(path), env=env)
    assert proc.returncode == 1, proc.stdout
    assert f"could not resolve images.vllm-stable: {SLOW_IMAGE}: registry answered HTTP 404" in proc.stderr
    advice = "e.g. rigforge_variant: vllm/gemma-12b-single-int8-mtp (vllm/vllm-openai:gemma4-unified, the recipe repo"
    assert f"{advice} at {tags['B-slow'][:8]})" in proc.stderr, proc.stderr  # B-slow's own 1-card slug, another engine
    assert "v0.27.1" not in proc.stderr and tags["A"][:8] not in proc.stderr, proc.stderr


def test_lock_recipes_offline_names_every_entry_it_could_not_resolve(stand_ins, tmp_path, monkeypatch):
    """The recipe remote, the registry and the hub all unreachable: the recipe pin is named, and so is each image
    digest and weights revision of the lock it could not resolve either; the entries REF would add are said to be
    unknown, not silently left out."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = lock_at_a(stand_ins, tmp_path, recipes_remote(tmp_path))
    data = yaml.safe_load(path.read_text())
    data["git"]["recipes"]["url"] = "git://127.0.0.1:9/recipes.git"  # nothing listens
    data["images"]["vllm-stable"]["digest"] = None
    data["hf"]["carnice"] = {"repo": "nobody/carnice", "revision": None, "files": []}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    before, out = path.read_text(), tmp_path / "candidate.yaml"
    env = {
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "RIGFORGE_REGISTRY": "http://127.0.0.1:9",
    }
    proc = rigforge_lock("--recipes", "B", "--out", str(out), "--lock", str(path), env=env)
    assert proc.returncode == 1, proc.stdout
    named = [line.split(": ", 3)[1:3] for line in proc.stderr.splitlines() if "could not resolve" in line]
    assert named == [
        ["could not resolve git.recipes", "cannot resolve B on git://127.0.0.1:9/recipes.git"],
        ["could not resolve images.vllm-stable", "cannot reach the registry for vllm/vllm-openai:v0.27.1"],
        ["could not resolve hf.carnice", "cannot read nobody/carnice@main"],
    ], proc.stderr
    assert (
        "the image and weights entries B needs are not known until git.recipes resolves; the other entries named are "
        f"those of {path}"
    ) in proc.stderr
    assert f"nothing written: {out} was not created" in proc.stderr
    assert path.read_text() == before and not out.exists()


def test_the_rollout_preview_shows_each_rigs_image_flags_weights_and_restarts(stand_ins, tmp_path, monkeypatch):
    """`rigforge rollout --dry`'s preview of a lock at A against the candidate at B, for a rig at vllm/dual and one
    at B's new slug: what the rollout will change on each."""
    from types import SimpleNamespace

    from rigforge.cli import rollout
    from rigforge.cli.lock import cache_recipes
    from rigforge.testbed.recipe_commits import B_IMAGE, NEW_SLUG

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("RIGFORGE_RECIPES", raising=False)
    tags = recipes_remote(tmp_path)
    path, out = lock_at_a(stand_ins, tmp_path, tags), tmp_path / "candidate.yaml"
    env = {"RIGFORGE_REGISTRY": os.environ["RIGFORGE_REGISTRY"], "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = rigforge_lock(
        "--recipes",
        "B",
        "--add",
        NEW_SLUG,
        "--out",
        str(out),
        "--lock",
        str(path),
        endpoint=stand_ins["endpoint"],
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    cache_recipes(load_lock(path).git["recipes"])  # what `rigforge lock` caches for the lock in use
    rig = SimpleNamespace(name="rig1", groups=(), data={"rigforge_variant": "vllm/dual"})
    p = rollout.preview(rig, path, out)
    assert p["image"] == (f"vllm/vllm-openai:v0.27.1@{IMAGE_DIGEST}", f"{B_IMAGE}@{B_DIGEST}")
    assert p["flags"] == {"--max-num-batched-tokens": ("8192", "16384")}
    assert p["fetch"] == {} and p["restart"] == ["rigforge-vllm@vllm-dual.service"]
    text = rollout.show(p)
    assert f"image: vllm/vllm-openai:v0.27.1@{IMAGE_DIGEST} -> {B_IMAGE}@{B_DIGEST}" in text, text
    assert "flag --max-num-batched-tokens: 8192 -> 16384" in text, text


def test_the_hf_stand_in_gates_a_gated_repos_downloads_not_its_model_info(stand_ins):
    """As the Hub does (hub-docs "Gated models": downloading files needs a token with access; the model info and
    file list are served to anyone, `gated` set): huggingface_hub reads a gated repo's info without a token, and a
    download answers 401 without one, 403 with another's, 200 with the stand-in's token."""
    import requests
    from huggingface_hub import HfApi

    repo = stand_ins["hf"]["dflash-draft"]["repo"]
    info = HfApi(endpoint=stand_ins["endpoint"], token=False).model_info(repo, files_metadata=True)
    assert info.gated == "manual" and info.siblings
    url = f"{stand_ins['endpoint']}/{repo}/resolve/main/{info.siblings[0].rfilename}"
    answers = [
        requests.head(url, headers=auth, timeout=10)
        for auth in ({}, {"Authorization": "Bearer hf_other"}, {"Authorization": f"Bearer {stand_ins['token']}"})
    ]
    assert [a.status_code for a in answers] == [401, 403, 200]
    assert answers[0].headers["X-Error-Code"] == "GatedRepo"
