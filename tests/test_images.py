"""`rigforge images save` against a real Distribution registry on 127.0.0.1 (Debian's docker-registry, plain HTTP,
its access log counted), and the load role's operations on pyinfra's @fake connector."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import requests
from registry_support import push_image, running_registry

from rigforge import images
from rigforge.cli import main
from rigforge.pins import ImagePin, parse_lock

REF = "vllm/vllm-openai:v0.27.1"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with running_registry(tmp_path_factory.mktemp("registry")) as reg:
        reg.image = push_image(reg, "vllm/vllm-openai", "v0.27.1")
        reg.multi = push_image(reg, "vllm/vllm-openai", "nightly-multi", index=True, seed="multi ")
        yield reg


def lock_file(tmp_path: Path, **digests) -> Path:
    data = {"version": 1, "image": {"ref": REF, "digest": digests.get("image")}, "images": {}}
    for name, (ref, digest) in digests.get("images", {}).items():
        data["images"][name] = {"ref": ref, "digest": digest}
    path = tmp_path / "lock.yaml"
    path.write_text(json.dumps(data))
    parse_lock(data, str(path))  # a lock of the real shape
    return path


def blob_names_hash_to_their_content(directory: Path) -> int:
    blobs = list((directory / images.BLOBS).iterdir())
    for blob in blobs:
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name, blob
    return len(blobs)


def test_save_writes_an_oci_layout_naming_the_ref_with_the_registrys_digest(registry, tmp_path, capsys):
    lock = lock_file(tmp_path, image=registry.image["digest"])
    assert main(["images", "save", str(tmp_path / "out"), "--lock", str(lock), "--registry", registry.url]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((out / "index.json").read_text())
    [entry] = index["manifests"]
    head = requests.head(f"{registry.url}/v2/vllm/vllm-openai/manifests/v0.27.1",
                         headers={"Accept": images.MANIFEST_TYPES}, timeout=5)  # fmt: skip
    assert entry["digest"] == head.headers["Docker-Content-Digest"] == registry.image["digest"]
    assert entry["annotations"] == {images.REF_NAME: REF, images.IMAGE_NAME: f"docker.io/{REF}"}
    assert images.blob_path(out, entry["digest"]).read_bytes() == registry.image["manifest"]  # byte for byte
    assert blob_names_hash_to_their_content(out) == 5  # manifest, config, 3 layers
    assert images.saved(out, REF, registry.image["digest"])
    assert not images.saved(out, REF, "sha256:" + "0" * 64) and not images.saved(out, "other:tag", entry["digest"])
    said = capsys.readouterr().out
    assert "saving from http://127.0.0.1:" in said and "(100%), verified" in said


def test_a_multi_platform_index_keeps_the_index_and_its_child_manifests(registry, tmp_path):
    pin = ImagePin("vllm/vllm-openai:nightly-multi", registry.multi["digest"])
    assert images.save_image(tmp_path, pin, registry.url) == 4  # config + 3 layers
    assert images.blob_path(tmp_path, pin.digest).read_bytes() == registry.multi["manifest"]
    child = json.loads(registry.multi["manifest"])["manifests"][0]["digest"]
    assert images.blob_path(tmp_path, child).read_bytes() == registry.multi["child"]
    assert blob_names_hash_to_their_content(tmp_path) == 6 and images.saved(tmp_path, pin.ref, pin.digest)


def test_a_second_save_fetches_nothing(registry, tmp_path, capsys):
    lock = lock_file(tmp_path, image=registry.image["digest"])
    args = ["images", "save", str(tmp_path / "out"), "--lock", str(lock), "--registry", registry.url]
    assert main(args) == 0
    before = registry.requests_for("/v2/vllm/")
    assert main(args) == 0
    assert registry.requests_for("/v2/vllm/") == before  # not one request
    assert "already saved" in capsys.readouterr().out


def test_a_cut_save_fetches_only_the_missing_blobs(registry, tmp_path):
    pin = ImagePin(REF, registry.image["digest"])
    images.save_image(tmp_path, pin, registry.url)
    manifest = json.loads(registry.image["manifest"])
    gone = manifest["layers"][1]["digest"]
    images.blob_path(tmp_path, gone).unlink()
    before = registry.requests_for("/blobs/")
    assert not images.saved(tmp_path, REF, pin.digest)
    assert images.save_image(tmp_path, pin, registry.url) == 1
    assert registry.requests_for("/blobs/") == before + 1 and images.saved(tmp_path, REF, pin.digest)


def test_a_corrupt_blob_is_refused_and_not_renamed_into_place(registry, tmp_path, monkeypatch):
    pin = ImagePin(REF, registry.image["digest"])
    layer = json.loads(registry.image["manifest"])["layers"][0]
    real = images._Source.get

    def corrupting(self, kind, digest, *args, **kwargs):
        resp = real(self, kind, digest, *args, **kwargs)
        if digest == layer["digest"]:
            body = bytearray(resp.content)
            body[100] ^= 0xFF
            resp.iter_content = lambda size: iter([bytes(body)])
        return resp

    monkeypatch.setattr(images._Source, "get", corrupting)
    with pytest.raises(images.ImagesError, match=f"{layer['digest']}: refused, got {layer['size']} bytes with sha256:"):
        images.save_image(tmp_path, pin, registry.url)
    final = images.blob_path(tmp_path, layer["digest"])
    assert not final.exists() and not final.with_name(f".{final.name}.part").exists()
    assert not images.saved(tmp_path, REF, pin.digest)


def test_a_missing_image_is_one_clear_line_and_exit_1(registry, tmp_path, capsys):
    missing = "sha256:" + "ab" * 32
    lock = lock_file(tmp_path, image=missing)
    assert main(["images", "save", str(tmp_path / "out"), "--lock", str(lock), "--registry", registry.url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"rigforge images save: {REF}@{missing}: not obtainable: {registry.url} answered HTTP 404 for manifest "
        f"{missing} (the registry does not have it)"
    ]


def test_a_resumed_blob_download_asks_for_the_rest_only(registry, tmp_path):
    pin = ImagePin(REF, registry.image["digest"])
    layer = json.loads(registry.image["manifest"])["layers"][2]
    images.save_image(tmp_path, pin, registry.url)
    final = images.blob_path(tmp_path, layer["digest"])
    data = final.read_bytes()
    final.unlink()
    final.with_name(f".{final.name}.part").write_bytes(data[: len(data) // 2])  # a cut download
    assert images.save_image(tmp_path, pin, registry.url) == 1
    assert final.read_bytes() == data


def test_locked_images_are_those_with_a_digest_each_once():
    lock = parse_lock({"version": 1, "image": {"ref": REF, "digest": "sha256:" + "1" * 64},
                       "images": {"a": {"ref": REF, "digest": "sha256:" + "1" * 64},
                                  "b": {"ref": "vllm/vllm-openai:v2", "digest": None}}})  # fmt: skip
    pins, unresolved = images.locked_images(lock)
    assert [p.ref for p in pins] == [REF] and unresolved == ["images.b (vllm/vllm-openai:v2)"]


def test_hub_names():
    assert images.hub_name("vllm/vllm-openai:v1") == ("vllm/vllm-openai", "v1")
    assert images.hub_name("ubuntu") == ("library/ubuntu", "latest")
    assert images.hub_name("docker.io/library/ubuntu:24.04") == ("library/ubuntu", "24.04")
    assert images.hub_name("ghcr.io/o/i:1") is None and images.hub_name("localhost:5000/i:1") is None
    assert images.qualified("ubuntu:24.04") == "docker.io/library/ubuntu:24.04"
