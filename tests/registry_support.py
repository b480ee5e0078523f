"""A real Distribution registry on 127.0.0.1 for tests (Debian's `docker-registry`), and a small image pushed to
it with requests: layers, config, manifest (and an index over it), as a registry holds any image."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import shutil
import socket
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest_of(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


@dataclass
class Registry:
    url: str
    root: Path
    log: Path
    process: subprocess.Popen

    def requests_for(self, what: str) -> int:
        """How many requests the access log shows whose line contains `what` (e.g. '/blobs/')."""
        return sum(1 for line in self.log.read_text().splitlines() if "http.request.uri" in line and what in line)

    def push_blob(self, name: str, data: bytes) -> str:
        digest = digest_of(data)
        start = requests.post(f"{self.url}/v2/{name}/blobs/uploads/", timeout=10)
        assert start.status_code == 202, start.text
        location = start.headers["Location"]
        location = location if location.startswith("http") else f"{self.url}{location}"
        sep = "&" if "?" in location else "?"
        put = requests.put(
            f"{location}{sep}digest={digest}",
            data=data,
            timeout=10,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert put.status_code == 201, put.text
        return digest

    def push_manifest(self, name: str, ref: str, body: bytes, media_type: str) -> str:
        resp = requests.put(
            f"{self.url}/v2/{name}/manifests/{ref}", data=body, timeout=10, headers={"Content-Type": media_type}
        )
        assert resp.status_code == 201, resp.text
        return resp.headers["Docker-Content-Digest"]


@contextlib.contextmanager
def running_registry(tmp: Path, tls: tuple[Path, Path, Path] | None = None):
    """docker-registry serving plain HTTP (or HTTPS with `tls` = (certificate, key, CA) files) on a free 127.0.0.1 port,
    storage in `tmp`, deletes enabled."""
    binary = shutil.which("docker-registry")
    if not binary:
        import pytest

        pytest.skip("needs Debian's docker-registry (apt-get install docker-registry)")
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log: {level: info, accesslog: {disabled: false}}\n"
        f"storage: {{filesystem: {{rootdirectory: {tmp / 'storage'}}}, delete: {{enabled: true}}}}\n"
        f"http: {{addr: '127.0.0.1:{port}'"
        + (f", tls: {{certificate: {tls[0]}, key: {tls[1]}}}" if tls else "")
        + "}\n"
    )
    log = tmp / "registry.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([binary, "serve", str(config)], stdout=out, stderr=subprocess.STDOUT)
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    verify = str(tls[2]) if tls else False
    try:
        for _ in range(100):
            try:
                if requests.get(f"{url}/v2/", timeout=1, verify=verify).status_code == 200:
                    break
            except (requests.ConnectionError, requests.exceptions.SSLError):
                time.sleep(0.1)
        else:
            raise RuntimeError(f"docker-registry did not start: {log.read_text()[-2000:]}")
        yield Registry(url, tmp, log, proc)
    finally:
        proc.terminate()
        proc.wait(10)


def layer(files: dict[str, bytes]) -> bytes:
    """A gzipped tar layer holding `files` (fixed times, so the bytes are the same every time)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def push_image(
    reg: Registry, name: str, tag: str, layers: int = 3, index: bool = False, seed: str = "", oci: bool = False
) -> dict:
    """Push an image of `layers` layers under name:tag (with `index`: a manifest list over it; with `oci` too: an OCI
    index holding it and a build attestation, as `docker buildx` pushes); returns {digest, manifest, blobs}."""
    manifest_type, config_type, layer_type = (
        (OCI_MANIFEST, OCI_CONFIG, OCI_LAYER) if oci else (DOCKER_MANIFEST, DOCKER_CONFIG, DOCKER_LAYER)
    )
    blobs = {}
    descs = []
    diff_ids = []
    for i in range(layers):
        tar = layer({f"layer{i}/file.txt": f"{seed}layer {i}\n".encode() * (2000 * (i + 1))})
        d = reg.push_blob(name, tar)
        blobs[d] = tar
        descs.append({"mediaType": layer_type, "size": len(tar), "digest": d})
        diff_ids.append(digest_of(gzip.decompress(tar)))
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "config": {"Env": ["CUDA_VERSION=13.0.1"], "Cmd": ["/bin/true"]},
        }
    ).encode()
    cd = reg.push_blob(name, config)
    blobs[cd] = config
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": manifest_type,
            "config": {"mediaType": config_type, "size": len(config), "digest": cd},
            "layers": descs,
        },
        indent=3,
    ).encode()
    if not index:
        digest = reg.push_manifest(name, tag, manifest, manifest_type)
        return {"digest": digest, "manifest": manifest, "blobs": blobs}
    child = reg.push_manifest(name, digest_of(manifest), manifest, manifest_type)
    children = [
        {
            "mediaType": manifest_type,
            "size": len(manifest),
            "digest": child,
            "platform": {"architecture": "amd64", "os": "linux"},
        }
    ]
    if oci:  # buildx's provenance attestation: an image manifest for platform unknown/unknown
        statement = json.dumps({"_type": "https://in-toto.io/Statement/v0.1", "subject": [{"digest": child}]}).encode()
        sd = reg.push_blob(name, statement)
        empty = b"{}"
        ed = reg.push_blob(name, empty)
        blobs |= {sd: statement, ed: empty}
        attestation = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "size": 2, "digest": ed},
                "layers": [{"mediaType": "application/vnd.in-toto+json", "size": len(statement), "digest": sd}],
            }
        ).encode()
        ad = reg.push_manifest(name, digest_of(attestation), attestation, OCI_MANIFEST)
        children.append(
            {
                "mediaType": OCI_MANIFEST,
                "size": len(attestation),
                "digest": ad,
                "platform": {"architecture": "unknown", "os": "unknown"},
                "annotations": {
                    "vnd.docker.reference.digest": child,
                    "vnd.docker.reference.type": "attestation-manifest",
                },
            }
        )
    top_type = OCI_INDEX if oci else DOCKER_LIST
    top = json.dumps({"schemaVersion": 2, "mediaType": top_type, "manifests": children}).encode()
    digest = reg.push_manifest(name, tag, top, top_type)
    return {"digest": digest, "manifest": top, "child": manifest, "blobs": blobs}
