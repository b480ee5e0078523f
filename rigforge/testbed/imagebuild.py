"""The stand-in serving image as a real registry image: Docker schema2, gzip layers, built deterministically.

The content is the booted tier's stand-in (bash, python3 with its standard library and the libraries they need,
the `vllm serve` and `llama-server` stand-ins from image/, rigforge's OpenAI stub, the one vLLM source line the
recipes' patch anchors on), taken from the booted rigs' root file system and split into LAYERS so that a pull
fetches several blobs (and a cut pull has some to resume). Every entry has uid/gid 0, mtime 0 and a sorted place
in its layer, and gzip writes mtime 0 and no name, so the same root file system gives the same blobs and digests
on every build. The layers are built once per testbed cache (`build_layers`); each image is then only a config
blob (its env, entrypoint and a label naming its reference, so no two references share a manifest) and a
manifest.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

from ._util import in_chroot

BUILD_VERSION = "2"  # bump when the layer split or the entries' metadata change
IMAGE_DIR = Path(__file__).with_name("image")
OPENAI_STUB = Path(__file__).resolve().parent / "openai_stub.py"
IMAGE_BINARIES = ["bash", "dash", "sh", "env", "cat", "ls", "sleep", "python3"]
VLLM_TREE = "usr/local/lib/python3.12/dist-packages/vllm"
MAMBA_ANCHOR = """class MambaManager:  # rigforge testbed stand-in: only what recipe patches anchor on
    def find_longest_cache_hit(self, max_length, block_size, drop_eagle_block=False):
        max_num_blocks = max_length // block_size
        return max_num_blocks
"""
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_TYPE = "application/vnd.docker.container.image.v1+json"
LAYER_TYPE = "application/vnd.docker.image.rootfs.diff.tar.gzip"
# in pull order: small ones first and the biggest late, as in a real serving image (a small OS base, then CUDA and
# torch), so that a pull cut in the middle has some layers registered and the next one fetches only the rest
LAYERS = ["base", "python-stdlib", "python-runtime", "stand-ins"]
EPOCH = "1970-01-01T00:00:00Z"
SKIP = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "__pycache__", "pydoc_data", "lib2to3"}

_CLOSURE = """
py=$(readlink -f /usr/bin/python3); v=$(basename "$py")
bins=""; for b in {bins}; do bins="$bins /usr/bin/$b"; done
canon() {{ echo "$(readlink -f "$(dirname "$1")")/$(basename "$1")"; }}
for f in $bins "$py"; do canon "$f"; done
for l in $(ldd "$py" $bins /usr/lib/"$v"/lib-dynload/*.so 2>/dev/null | grep -o '/[^ :]*' | sort -u); do
  canon "$l"; readlink -f "$l"
done
echo /usr/lib/"$v"
"""
_BASE = """
canon() {{ echo "$(readlink -f "$(dirname "$1")")/$(basename "$1")"; }}
bins=""; for b in {bins}; do bins="$bins /usr/bin/$b"; canon /usr/bin/$b; done
for l in $(ldd $bins 2>/dev/null | grep -o '/[^ :]*' | sort -u); do canon "$l"; readlink -f "$l"; done
"""


def stand_in_files() -> dict[str, tuple[bytes, int]]:
    """{path in the image: (content, mode)} of the stand-ins rigforge adds (the last layer)."""
    return {
        "usr/local/bin/vllm": ((IMAGE_DIR / "vllm").read_bytes(), 0o755),
        "usr/local/bin/pip": ((IMAGE_DIR / "pip").read_bytes(), 0o755),
        # where llama.cpp's server images hold llama-server (their ENTRYPOINT), which the recipes' wrapper execs
        "app/llama-server": ((IMAGE_DIR / "llama-server").read_bytes(), 0o755),
        "opt/rigforge-standin/openai_stub.py": (OPENAI_STUB.read_bytes(), 0o644),
        f"{VLLM_TREE}/__init__.py": (b'__version__ = "0+rigforge.standin"\n', 0o644),
        # the class and line the recipes' vendored vllm#48375 patch anchors on (it refuses to boot without them)
        f"{VLLM_TREE}/v1/core/single_type_kv_cache_manager.py": (MAMBA_ANCHOR.encode(), 0o644),
    }


def content_key(base: str) -> str:
    """What the layers depend on: the root file system they come from (its tarball's name) and the stand-ins."""
    recipe = f"{BUILD_VERSION}\0{base}\0{_CLOSURE}\0{_BASE}\0{sorted(SKIP)}\0{IMAGE_BINARIES}\0{LAYERS}"
    h = hashlib.sha256(recipe.encode())
    for name, (data, mode) in sorted(stand_in_files().items()):
        h.update(f"\0{name}\0{mode}\0".encode() + data)
    return h.hexdigest()[:12]


def layer_of(arcname: str, base: set[str], is_dir: bool = False) -> int:
    """Which of LAYERS an entry from the root file system goes into: python's standard library; the shell tools
    and their libraries (`base`), directories and /etc; everything else (python and the libraries only it
    needs: libcrypto, libsqlite3, ...)."""
    parts = arcname.split("/")
    if len(parts) >= 4 and parts[0] == "usr" and parts[1] == "lib" and parts[2].startswith("python3"):
        return 1
    if arcname in base or is_dir or "/" not in arcname or parts[0] == "etc":
        return 0
    return 2


def _base(root: Path) -> set[str]:
    """The non-python binaries of the image and the libraries they load (paths relative to `root`)."""
    bins = " ".join(b for b in IMAGE_BINARIES if b != "python3")
    return {p.lstrip("/") for p in in_chroot(root, _BASE.format(bins=bins), capture=True).stdout.split()}


def _tree(root: Path) -> dict[str, Path]:
    """{arcname: source} of every entry the image takes from `root`: the closure of the binaries, python's
    standard library (minus SKIP), the top-level links of a merged /usr, and a few files of /etc."""
    paths = in_chroot(root, _CLOSURE.format(bins=" ".join(IMAGE_BINARIES)), capture=True).stdout.split()
    out: dict[str, Path] = {}

    def put(rel: str) -> None:
        if rel in out or SKIP & set(rel.split("/")):
            return
        for parent in reversed(Path(rel).parents[:-1]):  # real directories, so extraction never follows links
            out.setdefault(str(parent), root / parent)
        out[rel] = root / rel

    for top in ("bin", "sbin", "lib", "lib64"):
        if (root / top).is_symlink():
            out[top] = root / top
    for name in ("etc/passwd", "etc/group", "etc/ld.so.cache"):
        put(name)
    for path in sorted(set(paths)):
        rel = path.lstrip("/")
        src = root / rel
        put(rel)
        if src.is_dir() and not src.is_symlink():
            for dirpath, dirnames, filenames in os.walk(src):
                dirnames[:] = sorted(d for d in dirnames if d not in SKIP)
                base = Path(dirpath).relative_to(root)
                for name in [*dirnames, *sorted(filenames)]:
                    put(str(base / name))
    return out


def _reset(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mtime = 0
    return info


def _layer_tar(entries: list[tuple[str, Path | tuple[bytes, int] | None]]) -> bytes:
    """An uncompressed layer tar of `entries` ([(arcname, source path | (content, mode) | None = a dir)]), with
    each entry's parent directories first."""
    buf = io.BytesIO()
    done: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:

        def add_dir(name: str, mode: int = 0o755) -> None:
            info = _reset(tarfile.TarInfo(name))
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
            done.add(name)

        for arcname, src in sorted(entries, key=lambda e: e[0]):
            for parent in reversed(Path(arcname).parents[:-1]):
                if str(parent) not in done:
                    add_dir(str(parent))
            if arcname in done:
                continue
            done.add(arcname)
            if src is None:
                add_dir(arcname, 0o1777 if arcname == "tmp" else 0o755)
            elif isinstance(src, tuple):
                data, mode = src
                info = _reset(tarfile.TarInfo(arcname))
                info.size, info.mode = len(data), mode
                tar.addfile(info, io.BytesIO(data))
            else:
                info = _reset(tar.gettarinfo(str(src), arcname))
                if info.islnk():  # a hard link may point into another layer: store the file itself
                    info.type, info.linkname, info.size = tarfile.REGTYPE, "", src.stat().st_size
                if info.isreg():
                    with open(src, "rb") as fh:
                        tar.addfile(info, fh)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def _gzip(data: bytes) -> bytes:
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=6) as gz:
        gz.write(data)
    return out.getvalue()


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def build_layers(root: Path, out: Path) -> list[dict]:
    """Build the image's layers from the root file system `root` into `out/` (a gzip blob per layer, named by
    its digest's hex, and layers.json); return [{name, digest, diff_id, size, files}] in order."""
    tree, base = _tree(root), _base(root)
    groups: list[list] = [[] for _ in LAYERS]
    for arcname, src in tree.items():
        groups[layer_of(arcname, base, src.is_dir() and not src.is_symlink())].append((arcname, src))
    groups[3] += [("tmp", None), *stand_in_files().items()]
    out.mkdir(parents=True, exist_ok=True)
    layers = []
    for name, entries in zip(LAYERS, groups, strict=True):
        raw = _layer_tar(entries)
        blob = _gzip(raw)
        digest = sha256(blob)
        (out / digest.split(":")[1]).write_bytes(blob)
        layers.append(
            {"name": name, "digest": digest, "diff_id": sha256(raw), "size": len(blob), "files": len(entries)}
        )
    (out / "layers.json").write_text(json.dumps(layers, indent=1) + "\n")
    return layers


def load_layers(out: Path) -> list[dict] | None:
    """The layers built earlier into `out`, or None when not (all) there."""
    try:
        layers = json.loads((out / "layers.json").read_text())
    except (OSError, ValueError):
        return None
    if all((out / layer["digest"].split(":")[1]).exists() for layer in layers):
        return layers
    return None


def image_env(image_env: dict[str, str]) -> dict[str, str]:
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        # the recipes mount vLLM's python3.12 tree (Genesis, Marlin files); the stand-in's python finds it here
        "PYTHONPATH": "/usr/local/lib/python3.12/dist-packages",
        **image_env,
    }


def config_blob(layers: list[dict], ref: str, env: dict[str, str]) -> bytes:
    """The image config (Docker's image JSON): `vllm serve` as its entrypoint, the env, and a label naming
    `ref` (each reference its own digest, as upstream's tags have)."""
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": EPOCH,
        "config": {
            "Env": [f"{k}={v}" for k, v in image_env(env).items()],
            "Entrypoint": ["vllm", "serve"],
            "Cmd": None,
            "WorkingDir": "/",
            "Labels": {"org.rigforge.testbed.ref": ref},
        },
        "rootfs": {"type": "layers", "diff_ids": [layer["diff_id"] for layer in layers]},
        "history": [{"created": EPOCH, "created_by": f"rigforge testbed: {layer['name']}"} for layer in layers],
    }
    return json.dumps(config, sort_keys=True, separators=(",", ":")).encode()


def manifest_blob(layers: list[dict], config: bytes) -> bytes:
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "size": len(config), "digest": sha256(config)},
        "layers": [{"mediaType": LAYER_TYPE, "size": layer["size"], "digest": layer["digest"]} for layer in layers],
    }
    return json.dumps(manifest, indent=3).encode()
