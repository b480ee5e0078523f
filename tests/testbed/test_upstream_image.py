"""The booted testbed's upstream stand-in, without booting anything: the stand-in image's builder (deterministic
digests, at least 4 gzip layers, a manifest whose layers are the blobs built), the access-log counter tests use,
and the relay's throttle. The builder test takes its files from this machine's own root (chroot /, so root)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from rigforge.testbed import imagebuild, upstream
from rigforge.testbed.netns import Throttle

REF = "vllm/vllm-openai:nightly-test"


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.mark.testbed
@pytest.mark.skipif(os.geteuid() != 0, reason="the builder runs ldd in a chroot (root)")
def test_the_stand_in_image_is_multi_layer_and_its_digest_is_the_same_on_every_build(tmp_path):
    first = imagebuild.build_layers(Path("/"), tmp_path / "a")
    second = imagebuild.build_layers(Path("/"), tmp_path / "b")
    assert [layer["digest"] for layer in first] == [layer["digest"] for layer in second]
    assert [layer["name"] for layer in first] == imagebuild.LAYERS and len(first) >= 4
    assert imagebuild.load_layers(tmp_path / "a") == first
    assert first[2]["size"] > 1 << 20, first  # python and its libraries: a layer worth cutting a pull in

    names = set()
    for layer in first:
        blob = (tmp_path / "a" / layer["digest"].split(":")[1]).read_bytes()
        assert _sha(blob) == layer["digest"] and len(blob) == layer["size"]
        assert blob[:2] == b"\x1f\x8b" and blob[4:8] == b"\0\0\0\0", "gzip, with mtime 0"
        raw = gzip.decompress(blob)
        assert _sha(raw) == layer["diff_id"]
        with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
            members = tar.getmembers()
        assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 for m in members)
        assert not [m.name for m in members if m.islnk()], "no hard links across layers"
        names |= {m.name for m in members}
    assert {"usr/local/bin/vllm", "opt/rigforge-standin/openai_stub.py", "tmp", "etc/passwd"} <= names
    assert any(n.startswith("usr/lib/python3") and n.endswith("/json/__init__.py") for n in names)

    config = imagebuild.config_blob(first, REF, {"CUDA_VERSION": "13.0.0"})
    manifest = json.loads(imagebuild.manifest_blob(first, config))
    assert manifest["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    assert manifest["config"] == {
        "mediaType": "application/vnd.docker.container.image.v1+json",
        "size": len(config),
        "digest": _sha(config),
    }
    assert [(m["digest"], m["size"]) for m in manifest["layers"]] == [(x["digest"], x["size"]) for x in first]
    assert {m["mediaType"] for m in manifest["layers"]} == {"application/vnd.docker.image.rootfs.diff.tar.gzip"}
    image = json.loads(config)
    assert image["rootfs"]["diff_ids"] == [layer["diff_id"] for layer in first]
    assert image["config"]["Entrypoint"] == ["vllm", "serve"] and "CUDA_VERSION=13.0.0" in image["config"]["Env"]
    # the same reference gives the same manifest digest; another reference its own (deleting one keeps the other)
    digest = _sha(imagebuild.manifest_blob(first, config))
    assert (
        _sha(imagebuild.manifest_blob(second, imagebuild.config_blob(second, REF, {"CUDA_VERSION": "13.0.0"})))
        == digest
    )
    other = imagebuild.config_blob(first, "vllm/vllm-openai:other", {"CUDA_VERSION": "13.0.0"})
    assert _sha(imagebuild.manifest_blob(first, other)) != digest


def _line(method: str, path: str, status: int, size: int = 100) -> str:
    return (
        f'127.0.0.1 - - [02/Dec/2026:04:48:19 +0000] "{method} {path} HTTP/1.1" {status} {size} "" '
        '"docker/26.1.5+dfsg1 go/go1.24.4 UpstreamClient(Docker-Client/26.1.5+dfsg1 \\\\(linux\\\\))"\n'
    )


def test_the_log_counter_counts_successful_blob_gets_after_an_offset(tmp_path):
    log = tmp_path / "upstream.log"
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    log.write_text(
        _line("GET", "/v2/", 200)
        + _line("GET", f"/v2/vllm/vllm-openai/manifests/{a}", 200)
        + _line("GET", f"/v2/vllm/vllm-openai/blobs/{a}", 200, 10_000_000)
        + _line("HEAD", f"/v2/vllm/vllm-openai/blobs/{b}", 200)
    )
    since = log.stat().st_size
    with open(log, "a") as fh:
        fh.write(_line("GET", f"/v2/vllm/vllm-openai/blobs/{b}", 200))
        fh.write(_line("GET", f"/v2/vllm/vllm-openai/blobs/{a}", 404))
        fh.write(_line("GET", f"/v2/library/other/blobs/{a}", 200))
    assert len(upstream.blob_gets(log)) == 3
    assert upstream.blob_gets(log, since) == [
        {"name": "vllm/vllm-openai", "digest": b, "status": 200, "bytes": 100},
        {"name": "library/other", "digest": a, "status": 200, "bytes": 100},
    ]
    assert upstream.blob_gets(log)[0]["bytes"] == 10_000_000
    assert len(upstream.blob_gets(log, since, name="vllm/vllm-openai")) == 1
    assert upstream.blob_gets(tmp_path / "absent.log") == []


def test_the_relays_throttle_follows_its_file_while_data_flows(tmp_path):
    path = tmp_path / "throttle"
    throttle = Throttle(str(path))
    t0 = time.monotonic()
    for _ in range(8):  # no file: full speed
        throttle.take(65536)
    assert time.monotonic() - t0 < 0.2
    path.write_text("200000\n")
    time.sleep(0.3)  # re-read every THROTTLE_REREAD seconds
    assert throttle.chunk() == 10000
    t0 = time.monotonic()
    for _ in range(30):
        throttle.take(10000)  # 300 kB at 200 kB/s
    took = time.monotonic() - t0
    assert 1.2 < took < 2.5, took
    path.write_text("0\n")
    time.sleep(0.3)
    t0 = time.monotonic()
    throttle.take(1 << 20)
    assert time.monotonic() - t0 < 0.1
