"""The lock file (rigforge.lock.yaml): every external input of a rig pinned, read into frozen dataclasses; a
malformed entry raises `LockError` naming file and key. No host, no network.
Schema: docs/contracts.md; unresolved entries: docs/pins.md.
"""

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NoReturn

import yaml

SHA40 = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
SHORT = re.compile(r"^[0-9a-f]{4,39}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
REFUSE_HINT = "run `rigforge lock` on a networked controller"
# the keys of each kind of entry, in the file's order
IMAGE_KEYS = ("ref", "digest", "cuda", "note")
CUDA = re.compile(r"^\d+\.\d+$")  # an image's CUDA version, major.minor
GIT_KEYS = ("url", "ref", "short", "commit", "sparse", "files", "content", "note")
HF_KEYS = ("repo", "ref", "revision", "gated", "include", "files", "note")
TOOLKIT_KEYS = ("version", "note")
# NVIDIA's flat apt repository of the Container Toolkit (its install guide); `{arch}` is the rig's dpkg arch
TOOLKIT_REPO_URL = "https://nvidia.github.io/libnvidia-container/stable/deb/{arch}/"
DEB_VERSION = re.compile(r"^[0-9][A-Za-z0-9.+~:-]*$")
HEADER = (
    "# rigforge lock: every external input of a rig, pinned. Schema: docs/contracts.md, policy: docs/pins.md.\n"
    "# Validate offline: `rigforge lock --check`. Resolve null entries on a networked controller: `rigforge lock`.\n"
    "# `commit: null` / `revision: null` / `digest: null` = unresolved: a deploy that needs such an entry\n"
    "# refuses before changing the host.\n"
)


class LockError(ValueError):
    """The lock file is missing, malformed, or lacks what a deploy needs; the message says what to do."""


@dataclass(frozen=True)
class ImagePin:
    ref: str
    digest: str | None = None
    note: str | None = None
    cuda: str | None = None  # the CUDA version the image is built for ("13.0"), None when unknown


@dataclass(frozen=True)
class GitPin:
    name: str
    url: str
    ref: str
    commit: str | None
    sparse: tuple[str, ...] = ()
    files: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    short: str | None = None
    note: str | None = None
    # the recipe repo: `sha256:...` of the files rigforge reads at `commit` (rigforge/model/recipes.py
    # `content_digest`), how a copy without .git is told apart from another commit's
    content: str | None = None

    @property
    def resolved(self) -> bool:
        """Whether the lock names the commit."""
        return self.commit is not None


@dataclass(frozen=True)
class HfFile:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class HfPin:
    name: str
    repo: str
    revision: str | None
    gated: bool = False
    files: tuple[HfFile, ...] = ()
    ref: str = "main"
    note: str | None = None
    # the repo's files the asset is (a GGUF quant of a many-quant repo, or its split parts: the recipe's `files`);
    # () = every file. `rigforge lock` pins only these.
    include: tuple[str, ...] = ()

    @property
    def resolved(self) -> bool:
        """Whether the lock names the revision and its files."""
        return self.revision is not None and bool(self.files)

    @property
    def total_size(self) -> int:
        """The bytes of the pinned files."""
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class ToolkitPin:
    """The NVIDIA Container Toolkit version all four of its packages are installed at and held (a Debian version)."""

    version: str
    note: str | None = None


@dataclass(frozen=True)
class Lock:
    path: str
    image: ImagePin
    git: Mapping[str, GitPin]
    hf: Mapping[str, HfPin]
    version: int = 1
    images: Mapping[str, ImagePin] = field(default_factory=lambda: MappingProxyType({}))  # recipe engines' images
    toolkit: ToolkitPin | None = None  # None: the toolkit is not pinned (latest, not held)

    def image_pin(self, ref: str) -> ImagePin | None:
        """The lock's entry for an image reference (the seed `image` or one of `images`), None if unpinned."""
        return next((p for p in (self.image, *self.images.values()) if p.ref == ref), None)

    def image_cuda(self, image: str) -> str | None:
        """The CUDA version the lock records for an image (`ref` or `ref@sha256:...`), None when unknown."""
        pin = self.image_pin(image.split("@", 1)[0])
        return pin.cuda if pin else None

    def pinned(self, ref: str) -> str:
        """What runs for `ref`: `ref@sha256:...` when the lock knows its digest, else the tag itself."""
        pin = self.image_pin(ref)
        return f"{ref}@{pin.digest}" if pin and pin.digest else ref

    def unresolved(self) -> list[str]:
        """Entries still to be resolved by `rigforge lock`, as 'git.NAME', 'hf.NAME', 'image'."""
        out = [] if self.image.digest else ["image (digest: null)"]
        out += [f"images.{n} (digest: null)" for n, p in self.images.items() if not p.digest]
        out += [f"git.{n} (commit: null)" for n, p in self.git.items() if not p.resolved]
        hf = {n: "revision: null" if p.revision is None else "files: []" for n, p in self.hf.items() if not p.resolved}
        return out + [f"hf.{n} ({what})" for n, what in hf.items()]

    def check(self) -> list[str]:
        """Every problem an offline check can find: unresolved entries and inconsistent ones."""
        problems = [f"{u}: unresolved, {REFUSE_HINT}" for u in self.unresolved()]
        for n, p in self.git.items():
            for path in p.files:
                if p.sparse and not any(path == s or (s.endswith("/") and path.startswith(s)) for s in p.sparse):
                    problems.append(f"git.{n}: file {path} is outside the sparse paths {list(p.sparse)}")
            for what, prefix in (("short", p.short), ("ref", p.ref if SHORT.match(p.ref) else None)):
                if p.commit and prefix and not p.commit.startswith(prefix):
                    problems.append(f"git.{n}: commit {p.commit} does not start with {what} {prefix}")
        return problems

    def require(self, *, git: Iterable[str] = (), hf: Iterable[str] = (), resolved: bool = True) -> None:
        """Raise LockError unless every named entry exists and (`resolved`) is resolved (a deploy's precondition)."""
        bad = []
        for kind, names, table in (("git", git, self.git), ("hf", hf, self.hf)):
            for name in names:
                pin = table.get(name)
                if pin is None:
                    raise LockError(f"lock {self.path}: no {kind} entry '{name}' (known: {', '.join(table)})")
                if resolved and not pin.resolved:
                    bad.append(f"{kind}.{name}")
        if bad:
            raise LockError(
                f"lock {self.path}: unresolved entr{'y' if len(bad) == 1 else 'ies'} {', '.join(bad)}; "
                f"refusing to deploy: {REFUSE_HINT} and commit the updated lock"
            )

    def to_data(self) -> dict[str, Any]:
        """Plain data in the file's own shape and key order (for rewriting the lock)."""
        data: dict[str, Any] = {"version": self.version, "image": _entry(self.image, IMAGE_KEYS)}
        if self.images:
            data["images"] = {n: _entry(p, IMAGE_KEYS) for n, p in self.images.items()}
        if self.toolkit:
            data["toolkit"] = _entry(self.toolkit, TOOLKIT_KEYS)
        data["git"] = {n: _entry(p, GIT_KEYS) for n, p in self.git.items()}
        data["hf"] = {n: _entry(p, HF_KEYS) for n, p in self.hf.items()}
        return data


def _entry(pin: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """A pin's `keys` as the lock file writes them: empty optional keys left out, mappings and tuples as plain data."""
    out = {}
    for key in keys:
        value = getattr(pin, key)
        if key in ("short", "note", "cuda", "content", "include") and not value:
            continue
        if isinstance(value, Mapping):
            value = dict(value)
        elif isinstance(value, tuple):  # sparse paths, hf files
            value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
        out[key] = value
    return out


class _Reader:
    """Typed access to one mapping of the lock (with only the `allowed` keys); errors name file and key."""

    def __init__(self, path: str, where: str, data: Any, allowed: Iterable[str]) -> None:
        self.path = path
        self.where = where
        self.data = data
        if not isinstance(data, dict):
            self.fail(f"expected a mapping, got {type(data).__name__}")
        if extra := set(data) - set(allowed):
            self.fail(f"unknown key(s) {sorted(extra)} (allowed: {sorted(allowed)})")

    def fail(self, msg: str, key: str | None = None) -> NoReturn:
        """Raise LockError naming the lock file and the key."""
        where = f"{self.where}.{key}" if key else self.where
        raise LockError(f"lock {self.path}: {where}: {msg}")

    def get(
        self,
        key: str,
        kind: type | tuple[type, ...],
        *,
        required: bool = True,
        default: Any = None,
        pattern: re.Pattern[str] | None = None,
        what: str = "",
    ) -> Any:
        """`key`'s value, of `kind` (a bool is no int) and matching `pattern`; `default` when absent and not
        `required` (or null where allowed); LockError naming the key otherwise."""
        if key not in self.data:
            if required:
                self.fail("missing", key)
            return default
        value = self.data[key]
        if value is None and (not required or pattern is not None and what.endswith("or null")):
            return default
        wrong = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
        if wrong or (pattern is not None and not pattern.match(value)):
            self.fail(f"expected {what or kind.__name__}, got {value!r}", key)
        return value


def _relpath(r: _Reader, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value or value.startswith("/") or ".." in value.split("/"):
        r.fail(f"expected a relative path inside the repo, got {value!r}", key)
    return value


def _git(path: str, name: str, data: Any) -> GitPin:
    r = _Reader(path, f"git.{name}", data, GIT_KEYS)
    sparse = r.get("sparse", list, required=False, default=[])
    files = r.get("files", dict, required=False, default={})
    for f, sha in files.items():
        _relpath(r, "files", f)
        if not isinstance(sha, str) or not SHA256.match(sha):
            r.fail(f"{f}: expected a 64-hex sha256, got {sha!r}", "files")
    short = r.get("short", str, required=False)
    if short is not None and not SHORT.match(short):
        r.fail(f"expected 4-39 hex digits, got {short!r}", "short")
    return GitPin(
        name=name,
        url=r.get("url", str),
        ref=str(r.get("ref", (str, int))),
        commit=r.get("commit", str, pattern=SHA40, what="a 40-hex commit SHA or null"),
        sparse=tuple(_relpath(r, "sparse", s) for s in sparse),
        files=MappingProxyType(dict(files)),
        short=short,
        note=r.get("note", str, required=False),
        content=r.get("content", str, required=False, pattern=DIGEST, what="'sha256:<64 hex>' or null"),
    )


def _hf(path: str, name: str, data: Any) -> HfPin:
    r = _Reader(path, f"hf.{name}", data, HF_KEYS)
    files = []
    for i, item in enumerate(r.get("files", list, required=False, default=[])):
        fr = _Reader(path, f"hf.{name}.files[{i}]", item, {"path", "size", "sha256"})
        f = HfFile(
            path=_relpath(fr, "path", fr.get("path", str)),
            size=fr.get("size", int),
            sha256=fr.get("sha256", str, pattern=SHA256, what="a 64-hex sha256"),
        )
        if f.size < 0 or f.path in {g.path for g in files}:
            fr.fail("negative size" if f.size < 0 else f"duplicate path {f.path}")
        files.append(f)
    return HfPin(
        name=name,
        repo=r.get("repo", str, pattern=HF_REPO, what="an 'owner/name' repo id"),
        revision=r.get("revision", str, pattern=SHA40, what="a 40-hex revision SHA or null"),
        gated=r.get("gated", bool, required=False, default=False),
        files=tuple(files),
        ref=r.get("ref", str, required=False, default="main"),
        note=r.get("note", str, required=False),
        include=tuple(_relpath(r, "include", i) for i in r.get("include", list, required=False, default=[])),
    )


def _image(path: str, where: str, data: Any) -> ImagePin:
    ir = _Reader(path, where, data, IMAGE_KEYS)
    ref = ir.get("ref", str)
    if "@" in ref:
        ir.fail(f"expected a tag reference without @digest (the digest goes in 'digest'), got {ref!r}", "ref")
    return ImagePin(
        ref=ref,
        digest=ir.get("digest", str, pattern=DIGEST, what="'sha256:<64 hex>' or null"),
        note=ir.get("note", str, required=False),
        cuda=ir.get("cuda", str, required=False, pattern=CUDA, what="a quoted CUDA version such as '13.0'"),
    )


def _toolkit(path: str, data: Any) -> ToolkitPin:
    r = _Reader(path, "toolkit", data, TOOLKIT_KEYS)
    version = r.get("version", str, pattern=DEB_VERSION, what="a Debian package version such as 1.19.0-1")
    return ToolkitPin(version=version, note=r.get("note", str, required=False))


def parse_lock(data: Any, path: str = "<lock>") -> Lock:
    """The Lock of a lock file's loaded YAML `data`; LockError naming `path` and the key on anything unexpected."""
    r = _Reader(path, "top level", data, {"version", "image", "images", "toolkit", "git", "hf"})
    if r.get("version", int) != 1:
        r.fail(f"unsupported version {data['version']!r} (this rigforge reads version 1)", "version")
    image = _image(path, "image", r.get("image", dict))
    images = {str(n): _image(path, f"images.{n}", d) for n, d in (r.get("images", dict, required=False) or {}).items()}
    git = {str(n): _git(path, str(n), d) for n, d in (r.get("git", dict, required=False) or {}).items()}
    hf = {str(n): _hf(path, str(n), d) for n, d in (r.get("hf", dict, required=False) or {}).items()}
    toolkit = _toolkit(path, data["toolkit"]) if data.get("toolkit") is not None else None
    return Lock(
        path, image, MappingProxyType(git), MappingProxyType(hf), images=MappingProxyType(images), toolkit=toolkit
    )


_LOADED: dict[tuple[str, bytes], Lock] = {}  # (path, content) -> its Lock (frozen): every rig of a run reads one lock


def load_lock(path: str | Path) -> Lock:
    """The lock file at `path`, parsed once per content; LockError when missing, not YAML or not a valid lock."""
    path = str(path)
    try:
        content = Path(path).read_bytes()
    except FileNotFoundError:
        raise LockError(f"lock {path}: file not found (set host data rigforge_lock or pass --lock)") from None
    if (path, content) not in _LOADED:
        try:
            data = yaml.load(content, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml: ~10x faster
        except yaml.YAMLError as e:
            raise LockError(f"lock {path}: not valid YAML: {e}") from None
        _LOADED[(path, content)] = parse_lock(data, path)
    return _LOADED[(path, content)]


def dump_lock(lock: Lock) -> str:
    """The lock file's text for `lock`: the header comment, then its YAML."""
    return HEADER + yaml.safe_dump(lock.to_data(), sort_keys=False, width=200, default_flow_style=False)


def default_lock_path() -> Path:
    """rigforge.lock.yaml at the top of a checkout (package data links to it; an installed package ships a copy)."""
    return (Path(__file__).parents[1] / "data" / "rigforge.lock.yaml").resolve()
