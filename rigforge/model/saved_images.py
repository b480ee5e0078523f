"""Saved images (docs/images.md): the OCI image layout `rigforge images save DIR` writes on the controller, read
for what it holds (every blob at its size and hash-checked once) and for what a load sends a rig (`push_plan`);
the load itself is roles/images.py, the save rigforge/cli/images.py."""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigforge.model.pins import DIGEST
from rigforge.observe.obtain import DOCKER_HUB, INDEX_TYPES, parse

LAYOUT_FILE = "oci-layout"
INDEX = "index.json"
BLOBS = "blobs/sha256"
VERIFIED = ".rigforge-verified.json"  # {digest: size} of every blob whose sha256 was checked when it was written
REF_NAME = "org.opencontainers.image.ref.name"  # the lock's ref, e.g. vllm/vllm-openai:v0.27.1
IMAGE_NAME = "io.containerd.image.name"  # its fully qualified name, docker.io/vllm/vllm-openai:v0.27.1


class ImagesError(Exception):
    """An image could not be saved or loaded (one line, for the operator)."""


@dataclass(frozen=True)
class Saved:
    """One image of a layout's index.json."""

    ref: str
    digest: str
    media_type: str
    size: int


def hub_name(ref: str) -> tuple[str, str] | None:
    """(Docker Hub repository path, tag) of a ref Docker pulls from Docker Hub (`ubuntu`: library/ubuntu, latest)."""
    if (r := parse(ref)).registry not in (DOCKER_HUB, "index.docker.io", "registry-1.docker.io"):
        return None
    return (r.repository if "/" in r.repository else f"library/{r.repository}"), r.tag or "latest"


def qualified(ref: str) -> str:
    """The fully qualified name of a ref (containerd's `io.containerd.image.name`)."""
    return f"docker.io/{hub[0]}:{hub[1]}" if (hub := hub_name(ref)) else ref


# --- the layout on disk ----------------------------------------------------------------------------------------


def blob_path(directory: Path, digest: str) -> Path:
    return Path(directory) / BLOBS / digest.split(":", 1)[1]


def read_json(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def index_entries(directory: Path) -> list[Saved]:
    """The images a layout's index.json names (by the ref annotation), in file order."""
    index = read_json(Path(directory) / INDEX, {})
    return [
        Saved(ref, e["digest"], e.get("mediaType", ""), int(e.get("size", 0)))
        for e in (index.get("manifests") or [] if isinstance(index, dict) else [])
        if (ref := (e.get("annotations") or {}).get(REF_NAME)) and DIGEST.match(str(e.get("digest", "")))
    ]


def verified_ok(directory: Path, verified: dict, digest: str, size: int) -> bool:
    """The blob is in place with `size` bytes, and its sha256 was checked when it was written."""
    path = blob_path(directory, digest)
    return verified.get(digest) == size and path.exists() and path.stat().st_size == size


def descriptors(manifest: dict) -> list[dict]:
    return ([manifest["config"]] if manifest.get("config") else []) + list(manifest.get("layers") or [])


def children(manifest: dict) -> list[dict]:
    is_index = manifest.get("mediaType") in INDEX_TYPES or ("manifests" in manifest and "layers" not in manifest)
    return list(manifest.get("manifests") or []) if is_index else []


def saved(directory: str | os.PathLike, ref: str, digest: str) -> bool:
    """`ref` at `digest` complete in `directory`: indexed, each manifest and blob at its size and hash-checked once?"""
    if (entry := next((e for e in index_entries(directory) if e.ref == ref and e.digest == digest), None)) is None:
        return False
    verified = read_json(Path(directory) / VERIFIED, {})
    todo = [(digest, entry.size, True)]
    while todo:
        d, size, is_manifest = todo.pop()
        if not verified_ok(directory, verified, d, size):
            return False
        if is_manifest:
            manifest = read_json(blob_path(directory, d), None)
            if not isinstance(manifest, dict):
                return False
            todo += [(c["digest"], int(c["size"]), True) for c in children(manifest)]
            todo += [(b["digest"], int(b["size"]), False) for b in descriptors(manifest)]
    return True


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


# --- load: what a rig is sent --------------------------------------------------------------------------------


def push_plan(directory: str | os.PathLike, entries: list[Saved]) -> tuple[list[str], dict[str, int]]:
    """(load_images.sh's plan, the files it needs {digest: size}) for `entries` (Docker Hub images): each image's
    blobs and its manifests (an index's children first, so the registry accepts each), then `pull NAME@DIGEST` of
    each image."""
    lines, pulls, needed = [], [], {}
    for e in entries:
        repo, top = hub_name(e.ref)[0], read_json(blob_path(directory, e.digest), {})
        kids = [(c, read_json(blob_path(directory, c["digest"]), {})) for c in children(top)]
        manifests = [(c["digest"], int(c["size"]), m.get("mediaType") or c.get("mediaType")) for c, m in kids]
        manifests.append((e.digest, e.size, top.get("mediaType") or e.media_type))
        blobs = {b["digest"]: int(b["size"]) for m in [top, *(k for _, k in kids)] for b in descriptors(m)}
        lines += [f"blob {repo} {d}" for d in blobs]
        lines += [f"manifest {repo} {d} {media_type}" for d, _, media_type in manifests]
        pulls.append(f"pull {pinned(e)}")
        needed |= blobs | {d: size for d, size, _ in manifests}
    return lines + pulls, needed


def pinned(e: Saved) -> str:
    """`name@sha256:...` of a saved image (what Docker holds after a load, and what `docker image inspect` finds)."""
    name = e.ref.rsplit(":", 1)[0] if ":" in e.ref.rsplit("/", 1)[-1] else e.ref
    return f"{name}@{e.digest}"


def check_loadable(directory: Path) -> list[Saved]:
    """The images of `directory`, each complete and verified, loadable onto a rig; ImagesError naming what is not."""
    if not (entries := index_entries(directory)):
        raise ImagesError(f"{directory}: no saved image (no {INDEX} naming one): run `rigforge images save DIR` first")
    for e in entries:
        if not saved(directory, e.ref, e.digest):
            raise ImagesError(f"{directory}: {e.ref}@{e.digest} is incomplete: run `rigforge images save` again")
        if hub_name(e.ref) is None:
            raise ImagesError(f"{e.ref}: only Docker Hub images can be loaded (its registry would record another name)")
    return entries
