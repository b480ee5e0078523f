"""Stand-in content: bare git repos for Genesis / vllm-src / club-3090 and small HF model repos.

File layouts follow the real repos where the deploy reads files. Commits use fixed dates and authors, so
the SHAs are the same on every machine. Everything here is generated once per testbed dir and cached.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

from ._util import hash_tree, sh

GENESIS_INIT = '"""Genesis vLLM patches (rigforge testbed stand-in)."""\n__version__ = "{version}"\n'
APPLY_ALL = '''"""Apply all Genesis patches (rigforge testbed stand-in: prints what it would patch)."""
import os

if __name__ == "__main__":
    enabled = sorted(k for k, v in os.environ.items() if k.startswith("GENESIS_ENABLE_") and v == "1")
    print(f"[Genesis] testbed stand-in {version}: {{len(enabled)}} patches enabled")
'''
MARLIN_PAD = '"""Marlin W4A16 kernel ({name}), padded sub-tile N (rigforge testbed stand-in)."""\n'
SIDECAR = '"""{name}: sidecar patch run before vllm serve (rigforge testbed stand-in)."""\nprint("{name} applied")\n'
CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}\n"
)
PADDING = "# padding so a sparse checkout matters\n" + "x = 0  # " + "." * 100 + "\n"

MIXED = "vllm/model_executor/kernels/linear/mixed_precision"
CLUB_PATCHES = "models/qwen3.6-27b/vllm/patches"

# name -> (list of commits: (message, {path: content}), default branch, extra branches {name: commit index})
GIT_REPOS = {
    "genesis": {
        "branch": "main",
        "commits": [
            (
                "Genesis v7.68",
                {
                    "README.md": "# genesis-vllm-patches (testbed)\n",
                    "vllm/_genesis/__init__.py": GENESIS_INIT.format(version="7.68"),
                    "vllm/_genesis/patches/__init__.py": "",
                    "vllm/_genesis/patches/apply_all.py": APPLY_ALL.format(version="v7.68"),
                    "vllm/_genesis/patches/p78_tolist.py": "ENABLED_BY = 'GENESIS_ENABLE_P78'\n",
                },
            ),
            (
                "Genesis v7.69 dev tip",
                {
                    "vllm/_genesis/__init__.py": GENESIS_INIT.format(version="7.69"),
                    "vllm/_genesis/patches/apply_all.py": APPLY_ALL.format(version="v7.69"),
                    "vllm/_genesis/patches/pn34_workspace_lock.py": "ENABLED_BY = 'GENESIS_ENABLE_PN34'\n",
                },
            ),
        ],
        "pin": -1,
        "sparse": [],
    },
    "vllm-src": {
        "branch": "marlin-pad-sub-tile-n",
        "commits": [
            (
                "fork base",
                {
                    "README.md": "# vLLM fork (testbed)\n",
                    f"{MIXED}/marlin.py": "# stock marlin.py\n",
                    f"{MIXED}/MPLinearKernel.py": "# stock MPLinearKernel.py\n",
                    **{f"vllm/padding/module_{i:02d}.py": PADDING * 200 for i in range(20)},
                    "csrc/quantization/marlin/kernel.cu": PADDING * 500,
                },
            ),
            (
                "[Kernel] Marlin: pad sub-tile N (vllm#40361)",
                {
                    f"{MIXED}/marlin.py": MARLIN_PAD.format(name="marlin.py"),
                    f"{MIXED}/MPLinearKernel.py": MARLIN_PAD.format(name="MPLinearKernel.py"),
                },
            ),
        ],
        "pin": -1,
        "sparse": [f"{MIXED}/marlin.py", f"{MIXED}/MPLinearKernel.py"],
    },
    "club-3090": {
        "branch": "master",
        "commits": [
            (
                "club-3090 recipes",
                {
                    "README.md": "# club-3090 (testbed)\n",
                    "scripts/setup.sh": "#!/bin/sh\necho testbed\n",
                    "models/qwen3.6-27b/vllm/compose/docker-compose.dual.yml": "services: {}\n",
                    f"{CLUB_PATCHES}/patch_tolist_cudagraph.py": SIDECAR.format(name="patch_tolist_cudagraph"),
                    f"{CLUB_PATCHES}/patch_workspace_lock_disable.py": SIDECAR.format(
                        name="patch_workspace_lock_disable"
                    ),
                    f"{CLUB_PATCHES}/carnice-chat-template.jinja": CHAT_TEMPLATE,
                    f"{CLUB_PATCHES}/vllm-marlin-pad/marlin.py": MARLIN_PAD.format(name="marlin.py"),
                    f"{CLUB_PATCHES}/vllm-marlin-pad/MPLinearKernel.py": MARLIN_PAD.format(name="MPLinearKernel.py"),
                    **{f"docs/padding_{i:02d}.md": PADDING * 100 for i in range(10)},
                },
            ),
            ("docs: dual card notes", {"docs/DUAL_CARD.md": "# Dual card (testbed)\n"}),
        ],
        "pin": -1,
        "sparse": [
            f"{CLUB_PATCHES}/patch_tolist_cudagraph.py",
            f"{CLUB_PATCHES}/patch_workspace_lock_disable.py",
            f"{CLUB_PATCHES}/carnice-chat-template.jinja",
            f"{CLUB_PATCHES}/vllm-marlin-pad/marlin.py",
            f"{CLUB_PATCHES}/vllm-marlin-pad/MPLinearKernel.py",
        ],
    },
}

# The recipe repo whose registry slugs rigforge serves: built from RIGFORGE_RECIPES (a checkout or a verbatim
# subset of club-3090) when set; without it the testbed has no `recipes` remote and recipe slugs are refused.
RECIPES_SPARSE = ["models/", "scripts/detect_nvlink.sh", "scripts/lib/profiles/"]

# lock key -> (repo id, gated, number of safetensors shards)
HF_REPOS = {
    "autoround-int4": ("Lorbus/Qwen3.6-27B-int4-AutoRound", False, 3),
    "dflash-draft": ("z-lab/Qwen3.6-27B-DFlash", True, 1),
    "carnice": ("wasifb/Carnice_V2_27B_INT4_BF16MTP", False, 2),
    "qwen3.6-27b-fp8": ("Qwen/Qwen3.6-27B-FP8", False, 2),  # vllm/qwen-27b-dual-max (recipe repo)
    "qwen3.6-27b-autoround-int4-v2": ("Lorbus/Qwen3.6-27B-int4-AutoRound-v2", False, 3),  # recipe commit B's slug
}
SPLIT_IQ2 = "UD-IQ2_XXS/DeepSeek-V4-Flash-0731-UD-IQ2_XXS"
# lock key -> (repo id, gated, {file: its size in shards}, the files the lock includes): GGUF repos, as the
# llama.cpp recipes' weights (a quant of a many-quant repo; its external MTP draft); a quant no recipe names is there
# so that fetching only the included files is proven
GGUF_REPOS = {
    "tess-4-27b-gguf-migtissera-q4km": (
        "migtissera/Tess-4-27B-GGUF",
        False,
        {"Tess-4-27B-Q4_K_M.gguf": 2, "mtp-Tess-4-27B-Q4_K_M.gguf": 1, "Tess-4-27B-Q8_0.gguf": 3},
        ("Tess-4-27B-Q4_K_M.gguf", "mtp-Tess-4-27B-Q4_K_M.gguf"),
    ),
    "qwen3.6-40b-deckard-gguf-piehsoft-q6k": (
        "PiehSoft/Qwen3.6-40B-Deckard-MTP-Q6_K",
        False,
        {"Qwen3.6-40B-Deckard-MTP-Q6_K.gguf": 3},
        ("Qwen3.6-40B-Deckard-MTP-Q6_K.gguf",),
    ),
    # a split GGUF (llama.cpp's -0000N-of-0000M parts) in a quant's folder, beside another quant's parts
    "deepseek-v4-flash-0731-gguf-unsloth-iq2-xxs": (
        "unsloth/DeepSeek-V4-Flash-0731-GGUF",
        False,
        {
            **{f"{SPLIT_IQ2}-0000{i}-of-00003.gguf": 1 for i in (1, 2, 3)},
            "UD-Q8_K_XL/DeepSeek-V4-Flash-0731-UD-Q8_K_XL-00001-of-00005.gguf": 1,
        },
        tuple(f"{SPLIT_IQ2}-0000{i}-of-00003.gguf" for i in (1, 2, 3)),
    ),
}
UNLOCKED = {"qwen3.6-27b-autoround-int4-v2"}  # served, but not in the testbed lock: `rigforge lock --recipes` adds it
HF_TOKEN = "hf_rigforgeTestbedToken0123456789abcdef"  # the stand-in's token for gated repos (not a secret)
SHARD_SIZE = 256 * 1024


def _git_env() -> dict:
    return {
        **os.environ,
        "GIT_AUTHOR_NAME": "rigforge testbed",
        "GIT_AUTHOR_EMAIL": "testbed@rigforge.invalid",
        "GIT_COMMITTER_NAME": "rigforge testbed",
        "GIT_COMMITTER_EMAIL": "testbed@rigforge.invalid",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_CONFIG_NOSYSTEM": "1",
    }


def build_git(dest: Path) -> dict:
    """Create bare repos under `dest`; return {name: {commits: [sha...], branch, pin, sparse, files}}."""
    meta_file = dest / "meta.json"
    if meta_file.exists():
        return json.loads(meta_file.read_text())
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    meta = {}
    env = _git_env()
    with tempfile.TemporaryDirectory(prefix="rigforge-git-") as tmp:
        for name, spec in GIT_REPOS.items():
            work = Path(tmp) / name
            sh(["git", "init", "-q", "-b", spec["branch"], str(work)], env=env)
            commits = []
            for i, (message, files) in enumerate(spec["commits"]):
                for path, text in files.items():
                    (work / path).parent.mkdir(parents=True, exist_ok=True)
                    (work / path).write_text(text)
                sh(["git", "add", "-A"], cwd=work, env=env)
                date = f"2026-05-0{i + 1}T12:00:00Z"
                sh(
                    ["git", "commit", "-q", "-m", message],
                    cwd=work,
                    env={**env, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date},
                )
                commits.append(sh(["git", "rev-parse", "HEAD"], cwd=work, capture=True, env=env).stdout.strip())
            bare = dest / f"{name}.git"
            sh(["git", "clone", "-q", "--bare", str(work), str(bare)], env=env)
            for key in ("allowAnySHA1InWant", "allowReachableSHA1InWant", "allowFilter"):
                sh(["git", "config", f"uploadpack.{key}", "true"], cwd=bare, env=env)
            sh(["git", "config", "uploadpack.allowTipSHA1InWant", "true"], cwd=bare, env=env)
            (bare / "git-daemon-export-ok").touch()
            files = {p: hashlib.sha256((work / p).read_bytes()).hexdigest() for p in spec["sparse"]}
            meta[name] = {
                "commits": commits,
                "branch": spec["branch"],
                "pin": commits[spec["pin"]],
                "sparse": spec["sparse"],
                "files": files,
            }
    meta_file.write_text(json.dumps(meta, indent=1))
    return meta


def recipes_dir() -> Path | None:
    value = os.environ.get("RIGFORGE_RECIPES")
    return Path(value) if value else None


def build_recipes(dest: Path) -> dict | None:
    """The `recipes` remote beside the other bare repos in `dest`, from RIGFORGE_RECIPES (None when unset).

    Kept apart from the generated repos' content key, so setting or changing RIGFORGE_RECIPES never rebuilds or
    restarts the other stand-ins: the git daemon serves the new bare repo as soon as it exists.
    """
    src = recipes_dir()
    if src is None:
        return None
    key = f"{hash_tree(src)}:{hash_tree(Path(__file__).with_name('recipe_commits.py'))}"
    meta_file = dest / "recipes.json"
    if meta_file.exists() and json.loads(meta_file.read_text()).get("key") == key:
        return json.loads(meta_file.read_text())["meta"]
    with tempfile.TemporaryDirectory(prefix="rigforge-recipes-") as tmp:
        meta = _build_recipes(src, Path(tmp) / "recipes", dest, _git_env())
    meta_file.write_text(json.dumps({"key": key, "meta": meta}, indent=1))
    return meta


def _build_recipes(src: Path, work: Path, dest: Path, env: dict) -> dict:
    """A bare `recipes.git` holding a copy of `src` (the directory itself is never modified) as commit A on
    master, then the later commits B and B-slow (recipe_commits.py), each tagged."""
    from .recipe_commits import STEPS

    shutil.copytree(src, work, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    sh(["git", "init", "-q", "-b", "master", str(work)], env=env)
    tags = {}
    for day, (tag, change, message) in enumerate((("A", None, f"recipes from {src}"), *STEPS)):
        if change:
            change(work)
        date = f"2026-08-{22 + day}T12:00:00Z"
        sh(["git", "add", "-A"], cwd=work, env=env)
        sh(
            ["git", "commit", "-q", "-m", message],
            cwd=work,
            env={**env, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date},
        )
        sh(["git", "tag", tag], cwd=work, env=env)
        tags[tag] = sh(["git", "rev-parse", "HEAD"], cwd=work, capture=True, env=env).stdout.strip()
    sh(["git", "branch", "-f", "bump", "B"], cwd=work, env=env)
    sh(["git", "branch", "-f", "bump-slow", "B-slow"], cwd=work, env=env)
    sh(["git", "reset", "-q", "--hard", "A"], cwd=work, env=env)  # master stays at A, what the lock pins
    commit = tags["A"]
    bare = dest / "recipes.git"
    if bare.exists():
        shutil.rmtree(bare)
    sh(["git", "clone", "-q", "--bare", str(work), str(bare)], env=env)
    for key in ("allowAnySHA1InWant", "allowReachableSHA1InWant", "allowFilter", "allowTipSHA1InWant"):
        sh(["git", "config", f"uploadpack.{key}", "true"], cwd=bare, env=env)
    (bare / "git-daemon-export-ok").touch()
    return {"commits": [commit], "branch": "master", "pin": commit, "sparse": RECIPES_SPARSE, "files": {}, "tags": tags}


def _blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {size}\n".encode()


def _safetensors(seed: str, size: int) -> bytes:
    """A valid safetensors file of about `size` bytes: one U8 tensor of deterministic pseudo-random data."""
    n = size
    header = json.dumps(
        {"__metadata__": {"format": "pt"}, "w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    out = bytearray(struct.pack("<Q", len(header)) + header)
    block = hashlib.sha256(seed.encode()).digest()
    counter = 0
    while len(out) < 8 + len(header) + n:
        out += hashlib.sha256(block + counter.to_bytes(8, "little")).digest()
        counter += 1
    return bytes(out[: 8 + len(header) + n])


def _gguf(seed: str, size: int) -> bytes:
    """A GGUF file of `size` bytes: the magic, version 3, no tensors and no metadata, then deterministic data."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
    block = hashlib.sha256(seed.encode()).digest()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(block + counter.to_bytes(8, "little")).digest()
        counter += 1
    return bytes(out[:size])


def shard_size() -> int:
    """Bytes per safetensors shard: RIGFORGE_TESTBED_SHARD_KIB (default 256 KiB)."""
    return int(os.environ.get("RIGFORGE_TESTBED_SHARD_KIB", SHARD_SIZE // 1024)) * 1024


def build_hf(dest: Path, shard_size: int = SHARD_SIZE) -> dict:
    """Write HF repos under `dest/<org>/<name>/`; return {lock key: meta} (meta as the server reads it)."""
    meta_file = dest / "meta.json"
    if meta_file.exists():
        return json.loads(meta_file.read_text())
    if dest.exists():
        shutil.rmtree(dest)
    result = {}
    repos = [(key, repo_id, gated, shards, None) for key, (repo_id, gated, shards) in HF_REPOS.items()]
    repos += [(key, repo_id, gated, parts, include) for key, (repo_id, gated, parts, include) in GGUF_REPOS.items()]
    for key, repo_id, gated, shards, include in repos:
        if include is not None:  # a GGUF repo: its .gguf files (shards: each one's size in shards) and a README
            files = {name: _gguf(f"{repo_id}/{name}", n * shard_size) for name, n in shards.items()}
            files["README.md"] = f"# {repo_id} (rigforge testbed stand-in)\n".encode()
            result[key] = _write_repo(dest, repo_id, gated, files) | {"include": list(include)}
            continue
        files: dict[str, bytes] = {
            "config.json": json.dumps({"model_type": "qwen3", "testbed": repo_id}, indent=2).encode(),
            "generation_config.json": b'{"do_sample": true, "temperature": 0.6}\n',
            "tokenizer_config.json": b'{"model_max_length": 262144}\n',
            "README.md": f"# {repo_id} (rigforge testbed stand-in)\n".encode(),
        }
        weight_map = {}
        for i in range(1, shards + 1):
            name = f"model-{i:05d}-of-{shards:05d}.safetensors"
            files[name] = _safetensors(f"{repo_id}/{name}", shard_size)
            weight_map[f"layer{i}.w"] = name
        files["model.safetensors.index.json"] = json.dumps({"weight_map": weight_map}, indent=2).encode()
        result[key] = _write_repo(dest, repo_id, gated, files)
    meta_file.write_text(json.dumps(result, indent=1))
    return result


def _write_repo(dest: Path, repo_id: str, gated: bool, files: dict[str, bytes]) -> dict:
    """Write one HF repo's `files` under `dest/<org>/<name>/` (weights as LFS files) and its meta; return the meta."""
    entries = []
    for path, data in sorted(files.items()):
        target = dest / repo_id / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        lfs = path.endswith((".safetensors", ".gguf"))
        oid = _blob_oid(_lfs_pointer(sha, len(data)) if lfs else data)
        entries.append({"path": path, "size": len(data), "sha256": sha, "git_oid": oid, "lfs": lfs})
    revision = hashlib.sha1(json.dumps(entries, sort_keys=True).encode()).hexdigest()
    meta = {"repo": repo_id, "revision": revision, "gated": gated, "token": HF_TOKEN, "files": entries}
    (dest / repo_id / ".rigforge-meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def content_key() -> str:
    return hash_tree(Path(__file__), extra=str(shard_size()))
