"""Where a rig gets its locked image (rigforge/obtain.py), against a real CNCF Distribution registry (Debian's
docker-registry) on 127.0.0.1: the fleet's copy, upstream, neither; the one-line refusal; `rigforge lock`
resolving a tag upstream lost from the fleet's copy; the fill operation on pyinfra's @fake connector."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import shutil
import socket
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import requests

from rigforge import lock as locking
from rigforge import obtain, registry
from rigforge.pins import ImagePin, load_lock
from roles import registry as registry_role

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"
pytestmark = pytest.mark.skipif(
    not Path(REGISTRY_BIN).exists(), reason="needs Debian's docker-registry (apt install docker-registry)"
)
REF = "vllm/vllm-openai:v0.27.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def registry_config(root: Path, addr: str) -> str:
    storage = {"filesystem": {"rootdirectory": str(root)}, "delete": {"enabled": True}}
    return json.dumps({"version": 0.1, "log": {"level": "error"}, "storage": storage, "http": {"addr": addr}})


@pytest.fixture
def distribution(tmp_path):
    """A plain-HTTP Distribution registry on 127.0.0.1 (a fresh one per test), its URL."""
    port = _free_port()
    config = tmp_path / "config.yml"
    config.write_text(registry_config(tmp_path / "data", f"127.0.0.1:{port}"))
    proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if requests.get(f"{url}/v2/", timeout=1).status_code == 200:
                break
        except requests.ConnectionError:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


def push(url: str, repository: str, tag: str, env: list[str] = ("CUDA_VERSION=13.0.1",)) -> str:
    """Push a one-layer schema2 image; its manifest digest."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = f"{repository}:{tag}\n".encode()
        info = tarfile.TarInfo("hello.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    layer = gzip.compress(buf.getvalue(), mtime=0)
    diff_id = "sha256:" + hashlib.sha256(buf.getvalue()).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": list(env)},
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        }  # fmt: skip
    ).encode()
    for blob in (layer, config):
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        start = requests.post(f"{url}/v2/{repository}/blobs/uploads/", timeout=10)
        location = start.headers["Location"]
        location = location if location.startswith("http") else url + location
        sep = "&" if "?" in location else "?"
        requests.put(f"{location}{sep}digest={digest}", data=blob, timeout=10).raise_for_status()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {
                "mediaType": "application/vnd.docker.container.image.v1+json",
                "size": len(config),
                "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
            },
            "layers": [
                {
                    "mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                    "size": len(layer),
                    "digest": "sha256:" + hashlib.sha256(layer).hexdigest(),
                }
            ],
        }  # fmt: skip
    ).encode()
    resp = requests.put(
        f"{url}/v2/{repository}/manifests/{tag}",
        data=manifest,
        headers={"Content-Type": "application/vnd.docker.distribution.manifest.v2+json"},
        timeout=10,
    )
    resp.raise_for_status()
    return resp.headers["Docker-Content-Digest"]


def delete(url: str, repository: str, digest: str) -> None:
    requests.delete(f"{url}/v2/{repository}/manifests/{digest}", timeout=10).raise_for_status()


def fleet_at(url: str) -> registry.RegistryPlan:
    host, port = url.removeprefix("http://").split(":")
    return registry.build("gw", {**registry_role.DEFAULTS, "registry_address": host, "registry_port": int(port),
                                 "registry_insecure": True})  # fmt: skip


def test_references_are_read_as_docker_reads_them():
    assert obtain.parse("vllm/vllm-openai:v1@sha256:" + "a" * 64) == obtain.ImageRef(
        "docker.io", "vllm/vllm-openai", "v1", "sha256:" + "a" * 64
    )
    assert obtain.parse("ubuntu").repository == "library/ubuntu" and obtain.parse("ubuntu").tag is None
    assert obtain.parse("127.0.0.1:5000/x/y:t").registry == "127.0.0.1:5000"
    assert obtain.parse("ghcr.io/a/b:c").on_docker_hub is False
    assert obtain.parse("vllm/vllm-openai:v1@sha256:" + "a" * 64).pinned == "vllm/vllm-openai@sha256:" + "a" * 64
    with pytest.raises(ValueError):
        obtain.parse("x@sha256:abc")


def test_a_rig_gets_the_image_from_the_fleet_after_upstream_deleted_it(distribution):
    upstream = distribution  # one registry stands for both here: what differs is the name each is asked by
    digest = push(distribution, "vllm/vllm-openai", "v0.27.1")
    image = f"{REF}@{digest}"
    fleet = fleet_at(distribution)
    found = obtain.sources(image, fleet, upstream, None)
    assert [(s.kind, s.has) for s in found] == [("fleet", True), ("upstream", True)]
    assert obtain.problem(image, found, "vllm/dual") is None
    assert obtain.origin(True, found) == ("the fleet registry and upstream", False)

    delete(distribution, "vllm/vllm-openai", digest)  # gone everywhere
    found = obtain.sources(image, fleet, upstream, None)
    assert [(s.kind, s.has, s.detail) for s in found] == [("fleet", False, "HTTP 404"), ("upstream", False, "HTTP 404")]
    line = obtain.problem(image, found, "vllm/dual")
    assert line == (
        f"image {image} is in no source this rig can pull from (the fleet registry {fleet.endpoint}: HTTP 404; "
        "upstream (docker.io): HTTP 404), and the rig does not hold it: move to the recipe repo's live successor: "
        "rigforge_variant: vllm/dual, or `rigforge images load DIR` a saved copy onto the rig"
    )
    text, warn = obtain.origin(True, found)
    assert warn and text.startswith("this rig alone: no other copy exists")


def test_only_the_fleet_copy_left(distribution):
    digest = push(distribution, "vllm/vllm-openai", "v0.27.1")
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens: upstream unreachable
    found = obtain.sources(f"{REF}@{digest}", fleet_at(distribution), dead, None)
    assert [(s.kind, s.has) for s in found] == [("fleet", True), ("upstream", None)]
    assert found[1].detail.startswith("unreachable: ConnectionError")
    assert obtain.unasked("x", found) is None  # the fleet has it
    gone = obtain.sources(f"{REF}@sha256:{'c' * 64}", fleet_at(distribution), dead, None)
    assert [(s.kind, s.has) for s in gone] == [("fleet", False), ("upstream", None)]
    assert obtain.problem("x", gone, None) is None  # upstream could not be asked: not refused, but said
    assert obtain.unasked("x", gone).startswith("could not tell whether any source has image x (the fleet registry")
    assert obtain.origin(False, found) == ("the fleet registry (gone upstream); not on the rig yet", False)


def test_a_fleet_does_not_stand_for_other_registries_than_docker_hub(distribution):
    digest = push(distribution, "a/b", "c")
    found = obtain.sources(f"ghcr.io/a/b:c@{digest}", fleet_at(distribution), None, None)
    assert [s.kind for s in found] == ["upstream"]  # Docker asks its mirrors for Docker Hub images only


def test_lock_resolves_a_tag_upstream_lost_from_the_fleets_copy(distribution, tmp_path):
    upstream = f"http://127.0.0.1:{_free_port()}"  # a second, empty registry for upstream
    config = tmp_path / "up.yml"
    config.write_text(registry_config(tmp_path / "updata", upstream.removeprefix("http://")))
    proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                requests.get(f"{upstream}/v2/", timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.05)
        digest = push(distribution, "vllm/vllm-openai", "v0.27.1", env=["CUDA_VERSION=13.0.2"])
        lock = load_lock(locking.default_lock_path())
        lock = dataclasses.replace(lock, image=ImagePin(REF), images={}, git={}, hf={})
        with pytest.raises(locking.LockError, match="HTTP 404, it no longer has this tag"):
            locking.resolve(lock, [], None, None, upstream)
        new, report = locking.resolve(lock, [], None, None, upstream, fleet=(distribution, False))
        assert new.image.digest == digest and new.image.cuda == "13.0"
        assert report[0] == (
            f"image: {REF} -> {digest} (CUDA 13.0) (from the fleet registry {distribution}: upstream no longer has "
            "this tag)"
        )
        delete(distribution, "vllm/vllm-openai", digest)
        with pytest.raises(locking.LockError, match="the fleet registry .* has no copy either"):
            locking.resolve(lock, [], None, None, upstream, fleet=(distribution, False))
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_fill_copies_once_keeping_the_digest_and_skips_a_held_image():
    from pyinfra.api import deploy
    from test_roles_host_ops import converge, executed, rig

    from roles.facts.docker import RegistryHasImage
    from roles.operations.fleet_copy import image_in_fleet

    digest = "sha256:" + "b" * 64
    image = f"{REF}@{digest}"

    @deploy("fill")
    def fill():
        image_in_fleet(name="fill", image=image, endpoint="127.0.2.1:5000")

    state = converge({"gw": rig()}, fill)
    cmds = executed(state, "gw")
    assert (
        "skopeo copy --all --preserve-digests --retry-times 3 "
        f"docker://docker.io/vllm/vllm-openai@{digest} docker://127.0.2.1:5000/vllm/vllm-openai:v0.27.1"
    ) in cmds
    held = rig()
    fact = RegistryHasImage().command("127.0.2.1:5000", "vllm/vllm-openai", digest).get_raw_value()
    held["fake_responses"] = {fact: ["yes"], **held["fake_responses"]}
    state = converge({"gw": held}, fill)
    assert not any(c.startswith("skopeo copy") for c in executed(state, "gw"))
