"""`rigforge images save DIR` and `load DIR INVENTORY` (docs/images.md, issue 22): the lock's images kept in an OCI
image layout, put onto a rig at their locked digests (deploy/images_load.py) where no fleet registry serves it. The
layout itself, as read, is rigforge/model/saved_images.py."""

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rigforge.cli.lock import manifest_url, write_atomically
from rigforge.model.pins import DIGEST, ImagePin, Lock, LockError, default_lock_path, load_lock
from rigforge.model.saved_images import (
    BLOBS,
    IMAGE_NAME,
    INDEX,
    LAYOUT_FILE,
    REF_NAME,
    VERIFIED,
    ImagesError,
    blob_path,
    check_loadable,
    children,
    descriptors,
    human_bytes,
    qualified,
    read_json,
    saved,
    verified_ok,
)
from rigforge.observe.obtain import MANIFEST_TYPES, registry_request

if TYPE_CHECKING:  # imported where used: requests is slow to import
    import requests

CHUNK = 1 << 20
PROGRESS_STEP = 10  # a progress line every this many percent of a blob


def locked_images(lock: Lock) -> tuple[list[ImagePin], list[str]]:
    """(the lock's images with a digest, each (ref, digest) once; the entries without one, by name)."""
    entries = [("image", lock.image), *((f"images.{n}", p) for n, p in lock.images.items())]
    pins = {(p.ref, p.digest): p for _, p in entries if p.digest}
    return list(pins.values()), [f"{key} ({pin.ref})" for key, pin in entries if not pin.digest]


def _write_json(path: Path, data: dict) -> None:
    write_atomically(path, json.dumps(data, indent=2) + "\n")


# --- save ------------------------------------------------------------------------------------------------------


class _Source:
    """One image's repository on a registry, over the Distribution API (anonymous bearer tokens as needed)."""

    def __init__(self, ref: str, registry: str | None, ca_cert: str | None) -> None:
        self.ref = ref
        self.base = manifest_url(ref, registry).rsplit("/manifests/", 1)[0]
        self.headers = {"Accept": MANIFEST_TYPES}
        self.verify = ca_cert or True

    def get(self, kind: str, digest: str, extra: dict | None = None, **kwargs: Any) -> "requests.Response":
        import requests

        url = f"{self.base}/{kind}/{digest}"
        try:
            resp = registry_request("GET", url, self.headers, extra, verify=self.verify, **kwargs)
        except (requests.RequestException, ValueError, KeyError) as error:
            raise ImagesError(f"{self.ref}@{digest}: cannot reach {url}: {error}") from None
        if resp.status_code == 404:
            raise ImagesError(
                f"{self.ref}@{digest}: not obtainable: {self.base.split('/v2/')[0]} answered HTTP 404 for {kind[:-1]} "
                f"{digest} (the registry does not have it)"
            )
        if resp.status_code not in (200, 206):
            raise ImagesError(f"{self.ref}@{digest}: {url} answered HTTP {resp.status_code}")
        return resp


def _fetch_blob(src: _Source, directory: Path, verified: dict, desc: dict, label: str) -> bool:
    """The blob `desc` in place, verified; False when it already was (nothing fetched)."""
    digest, size = desc["digest"], int(desc["size"])
    if not DIGEST.match(digest):
        raise ImagesError(f"{src.ref}: {label} has an unsupported digest {digest!r} (sha256 only)")
    final = blob_path(directory, digest)
    if verified_ok(directory, verified, digest, size):
        return False
    part = final.with_name(f".{final.name}.part")
    hasher, have = hashlib.sha256(), 0
    if part.exists() and 0 < part.stat().st_size < size:  # a cut download: hash what is there, ask for the rest
        with open(part, "rb") as fh:
            hasher = hashlib.file_digest(fh, "sha256")
        have = part.stat().st_size
    else:
        part.unlink(missing_ok=True)
    resp = src.get("blobs", digest, {"Range": f"bytes={have}-"} if have else {}, stream=True)
    if have and resp.status_code != 206:  # the registry sent it whole: start over
        hasher, have = hashlib.sha256(), 0
    got, step = have, max(size * PROGRESS_STEP // 100, 1)
    said = got // step
    with resp, open(part, "ab" if have else "wb") as fh:
        for chunk in resp.iter_content(CHUNK):
            fh.write(chunk)
            hasher.update(chunk)
            got += len(chunk)
            if got > size:
                break
            if size and got // step > said and got < size:
                said = got // step
                print(
                    f"  {label} {digest[7:19]}: {human_bytes(got)} of {human_bytes(size)} ({100 * got // size}%)",
                    flush=True,
                )
    actual = f"sha256:{hasher.hexdigest()}"
    if got != size or actual != digest:
        part.unlink(missing_ok=True)
        raise ImagesError(
            f"{src.ref}: {label} {digest}: refused, got {got} bytes with {actual}, expected {size} bytes; not kept"
        )
    os.chmod(part, 0o644)
    os.replace(part, final)
    verified[digest] = size
    _write_json(directory / VERIFIED, verified)
    print(f"  {label} {digest[7:19]}: {human_bytes(size)} (100%), verified", flush=True)
    return True


def _fetch_manifest(src: _Source, directory: Path, verified: dict, digest: str) -> tuple[dict, str, int]:
    """(the manifest at `digest`, its Content-Type ("" when kept), its size), kept byte for byte once verified."""
    path = blob_path(directory, digest)
    if verified_ok(directory, verified, digest, verified.get(digest)):
        body = path.read_bytes()
        return json.loads(body), "", len(body)
    resp = src.get("manifests", digest)
    body = resp.content
    if f"sha256:{hashlib.sha256(body).hexdigest()}" != digest:
        raise ImagesError(f"{src.ref}: manifest {digest}: refused, the registry's bytes hash to another digest")
    try:
        manifest = json.loads(body)
    except ValueError:
        raise ImagesError(f"{src.ref}: manifest {digest} is not JSON") from None
    path.write_bytes(body)
    verified[digest] = len(body)
    _write_json(directory / VERIFIED, verified)
    return manifest, resp.headers.get("Content-Type", "").split(";")[0], len(body)


def save_image(directory: Path, pin: ImagePin, registry: str | None = None, ca_cert: str | None = None) -> int:
    """Save one locked image into the layout `directory`; the number of blobs fetched (0: it was there)."""
    directory = Path(directory)
    (directory / BLOBS).mkdir(parents=True, exist_ok=True)
    if not (directory / LAYOUT_FILE).exists():
        _write_json(directory / LAYOUT_FILE, {"imageLayoutVersion": "1.0.0"})
    if saved(directory, pin.ref, pin.digest):
        print(f"{pin.ref}@{pin.digest}: already saved in {directory}", flush=True)
        return 0
    src = _Source(pin.ref, registry, ca_cert)
    verified = read_json(directory / VERIFIED, {})
    print(f"{pin.ref}@{pin.digest}: saving from {src.base.split('/v2/')[0]}", flush=True)
    top, content_type, top_size = _fetch_manifest(src, directory, verified, pin.digest)
    images = [top, *(_fetch_manifest(src, directory, verified, c["digest"])[0] for c in children(top))]
    blobs = [b for m in images for b in descriptors(m)]
    fetched = sum(_fetch_blob(src, directory, verified, b, f"blob {i}/{len(blobs)}") for i, b in enumerate(blobs, 1))
    entry = {"mediaType": top.get("mediaType") or content_type, "digest": pin.digest, "size": top_size}
    entry["annotations"] = {REF_NAME: pin.ref, IMAGE_NAME: qualified(pin.ref)}
    index = read_json(directory / INDEX, {})
    if not isinstance(index, dict) or not isinstance(index.get("manifests"), list):
        index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []}
    others = [m for m in index["manifests"] if (m.get("annotations") or {}).get(REF_NAME) != pin.ref]
    index["manifests"] = [*others, entry]
    _write_json(directory / INDEX, index)
    total = sum(int(b["size"]) for b in blobs)
    print(
        f"{pin.ref}@{pin.digest}: saved ({len(blobs)} blobs, {human_bytes(total)}; {fetched} fetched now)", flush=True
    )
    return fetched


# --- the command -----------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="images_command", required=True)
    save = sub.add_parser("save", help="keep the lock's images (those with a digest) in DIR, an OCI image layout")
    save.add_argument("dir", type=Path, help="the directory (created; a re-run fetches only what is missing)")
    save.add_argument("--lock", type=Path, help="lock file (default: rigforge.lock.yaml)")
    save.add_argument(
        "--registry", metavar="URL", help="read from this registry (a base URL, https://host:5000), not Docker Hub"
    )
    save.add_argument("--ca-cert", metavar="PEM", help="the CA certificate that registry's TLS uses")
    load = sub.add_parser("load", help="put the images saved in DIR on the rigs of INVENTORY, at their digests")
    load.add_argument("dir", type=Path, help="a directory `rigforge images save` wrote")
    load.add_argument("inventory", help="pyinfra inventory (e.g. inventories/home.py)")
    load.add_argument("--limit", metavar="HOST", help="only this host (or group)")


def save(directory: Path, lock: Lock, registry: str | None = None, ca_cert: str | None = None) -> int:
    """Save every locked image with a digest; the number of blobs fetched."""
    pins, unresolved = locked_images(lock)
    for name in unresolved:
        print(f"{name}: no digest in the lock, not saved (run `rigforge lock` on a networked controller)", flush=True)
    if not pins:
        raise ImagesError(f"lock {lock.path}: no image has a digest; nothing to save")
    return sum(save_image(directory, pin, registry, ca_cert) for pin in pins)


ENTRY = Path(__file__).resolve().parents[2] / "deploy" / "images_load.py"


def run(args: argparse.Namespace) -> int:
    try:
        if args.images_command == "save":
            save(args.dir, load_lock(args.lock or default_lock_path()), args.registry, args.ca_cert)
            return 0
        check_loadable(args.dir)
        if not ENTRY.is_file():
            raise ImagesError(f"{ENTRY} not found: run `rigforge images load` from a checkout of rigforge")
        cmd = [
            sys.executable,
            "-m",
            "pyinfra",
            "-y",
            args.inventory,
            str(ENTRY),
            "--data",
            f"rigforge_images_dir={Path(args.dir).resolve()}",
        ]
        rc = subprocess.call(cmd + (["--limit", args.limit] if args.limit else []))
        return 128 - rc if rc < 0 else rc  # pyinfra killed by a signal: 128 + its number, as a shell says
    except (ImagesError, LockError) as error:
        print(f"rigforge images {args.images_command}: {error}", file=sys.stderr)
        return 1
