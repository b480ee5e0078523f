"""The booted testbed's upstream registry stand-in: a real CNCF Distribution registry playing Docker Hub and ghcr.io.

`testbed up --booted` runs Debian's `docker-registry` (Distribution 2.8) on the controller's 127.0.0.1:PORT,
serving TLS with a certificate for `registry-1.docker.io` and `ghcr.io` (and IP 127.0.0.1) signed by a throwaway
testbed CA (made here with `openssl`, in `<testbed dir>/upstream/`), deletes enabled, blobs under `<testbed dir>/
upstream/storage`. It holds the stand-in serving image (imagebuild.py) under IMAGE_REF, every recipe engine's image
and BROKEN_IMAGE, pushed with plain registry API calls; the testbed lock pins their manifest digests.

Booted hosts reach it as they would reach Docker Hub or GitHub's registry (where llama.cpp's images are): their
/etc/hosts maps `registry-1.docker.io` and `ghcr.io` (HOSTNAMES) to RIG_ADDRESS, where the rig's relay (netns.py)
listens on port 443 and carries the connection to the controller's 127.0.0.1:PORT, throttled to the bytes per
second in `<testbed dir>/run/upstream-throttle` (0 or absent = full speed; re-read while copying); the CA is in
each host's system trust store, which dockerd uses for both. A ghcr.io image is held under its repository without
the host (`ghcr.io/ggml-org/llama.cpp:tag` as `ggml-org/llama.cpp:tag`), the path Docker asks ghcr.io for; Docker
Hub's names and these have no owner in common.

The registry's access log (one Apache combined-format line per request, from its stdout) is
`<testbed dir>/run/upstream.log`; its own log (stderr) is `upstream-registry.log` beside it.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from ._util import TestbedError, log, sh
from .imagebuild import MANIFEST_TYPE, config_blob, manifest_blob, sha256

HOSTNAME = "registry-1.docker.io"  # where Docker pulls docker.io/... images from
GHCR = "ghcr.io"  # GitHub's container registry: llama.cpp's server images (the recipes' llama.cpp engines)
HOSTNAMES = (HOSTNAME, GHCR)  # the registries the stand-in plays: its certificate's names, the hosts' /etc/hosts
RIG_ADDRESS = "127.0.3.1"  # in every booted host: HOSTNAME's address, the relay's listener on port 443
CA_NAME = "rigforge-testbed-upstream-ca"
BLOB_GET = re.compile(
    r'"GET /v2/(?P<name>[^ ]+)/blobs/(?P<digest>sha256:[0-9a-f]{64}) HTTP/[0-9.]+" (?P<status>\d{3}) (?P<bytes>\d+|-) '
)


def files(shared: Path) -> dict[str, Path]:
    up = shared / "upstream"
    return {
        "dir": up,
        "ca": up / "ca.crt",
        "ca_key": up / "ca.key",
        "cert": up / "server.crt",
        "key": up / "server.key",
        "config": up / "config.yml",
        "storage": up / "storage",
        "deleted": up / "deleted.json",  # refs and digests `upstream-delete` removed: `up` does not push them back
        "log": shared / "run" / "upstream.log",
        "errlog": shared / "run" / "upstream-registry.log",
        "throttle": shared / "run" / "upstream-throttle",
    }


def ensure_tls(shared: Path) -> None:
    """The testbed CA (EC P-256) and the registry's certificate for HOSTNAMES + IP:127.0.0.1, made once (again when
    an earlier testbed's certificate names fewer hosts)."""
    f = files(shared)
    f["dir"].mkdir(mode=0o755, exist_ok=True)
    names = f["dir"] / "server.names"
    same = names.exists() and names.read_text().split() == list(HOSTNAMES)
    if f["ca"].exists() and f["cert"].exists() and f["key"].exists() and same:
        return
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    sh(
        [
            "openssl",
            "req",
            "-x509",
            *ec,
            "-keyout",
            str(f["ca_key"]),
            "-out",
            str(f["ca"]),
            "-days",
            "3650",
            "-subj",
            f"/CN={CA_NAME}",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ],
        capture=True,
    )
    csr = f["dir"] / "server.csr"
    sh(
        ["openssl", "req", "-new", *ec, "-keyout", str(f["key"]), "-out", str(csr), "-subj", f"/CN={HOSTNAME}"],
        capture=True,
    )
    ext = f["dir"] / "server.ext"
    ext.write_text(
        f"subjectAltName={','.join(f'DNS:{h}' for h in HOSTNAMES)},IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
    )
    sh(
        [
            "openssl",
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(f["ca"]),
            "-CAkey",
            str(f["ca_key"]),
            "-CAcreateserial",
            "-out",
            str(f["cert"]),
            "-days",
            "825",
            "-extfile",
            str(ext),
        ],
        capture=True,
    )
    for key in (f["ca_key"], f["key"]):
        key.chmod(0o600)
    csr.unlink()
    names.write_text("\n".join(HOSTNAMES) + "\n")


def config(shared: Path, port: int) -> str:
    f = files(shared)
    return f"""# rigforge testbed: the upstream registry stand-in (Docker Hub), generated by `rigforge testbed up`
version: 0.1
log:
  level: warn
  formatter: text
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: {f["storage"]}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:{port}
  tls:
    certificate: {f["cert"]}
    key: {f["key"]}
"""


def command(shared: Path, port: int) -> list[str]:
    """Write the config for `port`; the command that serves it (access log on stdout, its own log appended to
    errlog)."""
    f = files(shared)
    f["storage"].mkdir(parents=True, exist_ok=True)
    f["config"].write_text(config(shared, port))
    return ["/bin/sh", "-c", f'exec /usr/bin/docker-registry serve "{f["config"]}" 2>>"{f["errlog"]}"']


# --- the registry API ---------------------------------------------------------------------------------------


def _split(ref: str) -> tuple[str, str]:
    """('vllm/vllm-openai', 'tag' or 'sha256:...') of a Docker Hub reference (an optional docker.io/ prefix) or of a
    ghcr.io one (its repository: `ghcr.io/ggml-org/llama.cpp:tag` -> ('ggml-org/llama.cpp', 'tag'))."""
    ref = ref.removeprefix("docker.io/").removeprefix(f"{GHCR}/")
    if "@" in ref:
        name, _, digest = ref.partition("@")
        return name.rsplit(":", 1)[0] if ":" in name.split("/")[-1] else name, digest
    name, _, tag = ref.rpartition(":")
    if not name or "/" in tag:
        raise TestbedError(f"expected a reference name:tag or name@sha256:..., got {ref!r}")
    if "/" not in name:
        name = f"library/{name}"
    return name, tag


class Client:
    """Plain registry API calls to the stand-in at `url` (https://127.0.0.1:PORT), trusting only `ca`."""

    def __init__(self, url: str, ca: Path) -> None:
        import requests

        self.url, self.session = url, requests.Session()
        self.session.verify = str(ca)
        self.session.trust_env = False  # else REQUESTS_CA_BUNDLE (or a proxy) from the environment wins

    def manifest_digest(self, ref: str) -> str | None:
        """The digest the registry holds for `ref` (None: 404)."""
        name, ref_ = _split(ref)
        r = self.session.head(f"{self.url}/v2/{name}/manifests/{ref_}", headers={"Accept": MANIFEST_TYPE}, timeout=30)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.headers["Docker-Content-Digest"]

    def status(self, ref: str) -> int:
        name, ref_ = _split(ref)
        r = self.session.get(f"{self.url}/v2/{name}/manifests/{ref_}", headers={"Accept": MANIFEST_TYPE}, timeout=30)
        return r.status_code

    def push_blob(self, name: str, digest: str, data: bytes) -> bool:
        """Upload a blob unless present (monolithic: POST, then PUT with the digest); True when uploaded."""
        if self.session.head(f"{self.url}/v2/{name}/blobs/{digest}", timeout=30).status_code == 200:
            return False
        r = self.session.post(f"{self.url}/v2/{name}/blobs/uploads/", timeout=30)
        if r.status_code != 202:
            raise TestbedError(f"upstream stand-in: starting an upload to {name} answered {r.status_code}: {r.text}")
        location = r.headers["Location"]
        if location.startswith("/"):
            location = self.url + location
        r = self.session.put(
            location,
            params={"digest": digest},
            data=data,
            headers={"Content-Type": "application/octet-stream"},
            timeout=300,
        )
        if r.status_code != 201:
            raise TestbedError(f"upstream stand-in: uploading {digest} to {name} answered {r.status_code}: {r.text}")
        return True

    def push_manifest(self, ref: str, manifest: bytes) -> str:
        name, tag = _split(ref)
        r = self.session.put(
            f"{self.url}/v2/{name}/manifests/{tag}", data=manifest, headers={"Content-Type": MANIFEST_TYPE}, timeout=60
        )
        if r.status_code != 201:
            raise TestbedError(f"upstream stand-in: pushing {ref} answered {r.status_code}: {r.text}")
        return r.headers["Docker-Content-Digest"]

    def delete(self, ref: str) -> str | None:
        """Delete the manifest `ref` (a tag is looked up to its digest first); its digest, or None if absent."""
        name, _ = _split(ref)
        digest = self.manifest_digest(ref)
        if digest is None:
            return None
        r = self.session.delete(f"{self.url}/v2/{name}/manifests/{digest}", timeout=30)
        if r.status_code != 202:
            raise TestbedError(f"upstream stand-in: DELETE {name}@{digest} answered {r.status_code}: {r.text}")
        return digest


def push_images(
    client: Client, layers: list[dict], blob_dir: Path, images: dict[str, dict[str, str]], deleted: set[str] = ()
) -> dict:
    """Push each of `images` ({ref: its env}) made of `layers` (blobs in `blob_dir`), unless the registry already
    holds that manifest or it was deleted on purpose (its ref or digest in `deleted`); return {ref: manifest
    digest}, pushed or not."""
    t0, pushed, digests = time.monotonic(), [], {}
    for ref, env in images.items():
        config = config_blob(layers, ref, env)
        manifest = manifest_blob(layers, config)
        want = sha256(manifest)
        if want in deleted or ref in deleted or client.manifest_digest(ref) == want:
            digests[ref] = want
            continue
        name, _ = _split(ref)
        for layer in layers:
            client.push_blob(name, layer["digest"], (blob_dir / layer["digest"].split(":")[1]).read_bytes())
        client.push_blob(name, sha256(config), config)
        got = client.push_manifest(ref, manifest)
        if got != want:
            raise TestbedError(f"upstream stand-in: {ref} stored as {got}, pushed {want}")
        digests[ref] = got
        pushed.append(ref)
    if pushed:
        size = sum(layer["size"] for layer in layers) >> 20
        log(
            f"upstream stand-in: pushed {', '.join(pushed)} ({len(layers)} layers, {size} MiB) "
            f"in {time.monotonic() - t0:.1f}s"
        )
    return digests


def deleted(shared: Path) -> set[str]:
    """The refs and manifest digests `upstream-delete` removed from the stand-in (kept until `down --purge`)."""
    path = files(shared)["deleted"]
    return set(json.loads(path.read_text())) if path.exists() else set()


def mark_deleted(shared: Path, *names: str, undo: bool = False) -> None:
    """Record (or, `undo`, forget) refs and digests deleted on purpose."""
    path = files(shared)["deleted"]
    now = deleted(shared) - set(names) if undo else deleted(shared) | {n for n in names if n}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sorted(now)))


# --- the log and the throttle -------------------------------------------------------------------------------


def blob_gets(log_file: Path, since: int = 0, name: str | None = None) -> list[dict]:
    """The successful blob GETs (`GET /v2/<name>/blobs/sha256:...`, 2xx) in the access log after byte `since`:
    [{name, digest, status, bytes}]. A request is logged when it ends; one cut short (the client killed mid-pull)
    is still logged 200, with the bytes sent so far."""
    try:
        with open(log_file, "rb") as fh:
            fh.seek(since)
            text = fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return []
    out = []
    for m in BLOB_GET.finditer(text):
        if m["status"].startswith("2") and (name is None or m["name"] == name):
            sent = int(m["bytes"]) if m["bytes"] != "-" else 0
            out.append({"name": m["name"], "digest": m["digest"], "status": int(m["status"]), "bytes": sent})
    return out


def set_throttle(shared: Path, bytes_per_second: int) -> Path:
    """Throttle every booted host's path to the stand-in (per relay, i.e. per host); 0 turns it off."""
    if bytes_per_second < 0:
        raise TestbedError(f"a throttle is 0 (off) or bytes per second, got {bytes_per_second}")
    path = files(shared)["throttle"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{bytes_per_second}\n")
    tmp.rename(path)
    return path


def describe(shared: Path, port: int, digests: dict[str, str]) -> dict:
    f = files(shared)
    return {
        "port": port,
        "url": f"https://127.0.0.1:{port}",
        "ca": str(f["ca"]),
        "log": str(f["log"]),
        "throttle_file": str(f["throttle"]),
        "digests": digests,
    }


def ensure_layers(shared: Path, tarball: Path) -> tuple[list[dict], Path]:
    """The stand-in image's layers, built once per testbed cache from the booted root file system `tarball`:
    (layers, the directory holding their blobs)."""
    from .imagebuild import build_layers, content_key, load_layers
    from .rootfs import extract, locked

    cache = shared / "cache"
    out = cache / f"upstream-image-{content_key(tarball.name)}"
    layers = load_layers(out)
    if layers:
        return layers, out
    with locked(cache, "upstream-image"):
        layers = load_layers(out)
        if layers:
            return layers, out
        t0 = time.monotonic()
        build = cache / f"upstream-image.build.{os.getpid()}"
        extract(tarball, build)
        try:
            sh(["rm", "-rf", str(out)])
            layers = build_layers(build, out)
        finally:
            sh(["rm", "-rf", "--one-file-system", str(build)])
        for old in cache.glob("upstream-image-*"):
            if old != out:
                sh(["rm", "-rf", str(old)])
        sizes = ", ".join(f"{layer['name']} {layer['size'] / 2**20:.1f} MiB" for layer in layers)
        log(f"upstream stand-in image: {len(layers)} layers ({sizes}) built in {time.monotonic() - t0:.0f}s")
    return layers, out
