"""`rigforge lock`: resolve (networked) or `--check` (offline) the pins in rigforge.lock.yaml; `--recipes REF` moves
the recipe pin (rigforge/cli/follow.py). How each kind of entry is resolved, and the endpoints: docs/pins.md.
"""

import argparse
import dataclasses
import hashlib
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from rigforge.cli import follow
from rigforge.model import recipes
from rigforge.model.driver_table import version_key
from rigforge.model.pins import (
    DIGEST,
    SHA40,
    SHORT,
    TOOLKIT_REPO_URL,
    GitPin,
    HfFile,
    HfPin,
    ImagePin,
    Lock,
    LockError,
    ToolkitPin,
    default_lock_path,
    dump_lock,
    load_lock,
)
from rigforge.observe.obtain import MANIFEST_TYPES, fleet_repository, parse, registry_request

_Pin = TypeVar("_Pin", ImagePin, GitPin, HfPin)  # what `resolve` resolves, each entry to its own kind


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true", help="validate offline; exit 1 listing problems")
    parser.add_argument("--lock", type=Path, default=None, help="lock file (default: rigforge.lock.yaml)")
    parser.add_argument(
        "--refresh",
        nargs="+",
        default=[],
        metavar="NAME",
        help="re-resolve these entries (git/hf names, 'image', 'images.NAME')",
    )
    parser.add_argument(
        "--fleet-registry",
        metavar="URL",
        default=None,
        help="the fleet registry (https://HOST:PORT): resolve an image upstream no longer has from its copy there",
    )
    parser.add_argument(
        "--fleet-ca",
        metavar="PEM",
        default=None,
        help="the fleet CA's certificate (default: ca.crt of the default registry CA dir)",
    )
    parser.add_argument(
        "--recipes",
        metavar="REF",
        default=None,
        help="move the recipe repo's pin to REF (tag, branch or commit): derive the image and hf "
        "entries, resolve them, print the lock's diff",
    )
    parser.add_argument(
        "--inventory",
        metavar="INVENTORY",
        default=None,
        help="with --recipes: add hf entries for the slugs this pyinfra inventory deploys",
    )
    parser.add_argument(
        "--add", nargs="+", default=[], metavar="SLUG", help="with --recipes: add entries for these slugs too"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the new lock to FILE (a candidate), leaving the lock in use as it is",
    )


def resolve_git(pin: GitPin) -> str:
    """Full commit SHA for the pin's ref (and `short`, if given)."""
    import git

    want = pin.short or (pin.ref if SHORT.match(pin.ref) or SHA40.match(pin.ref) else None)
    if want and SHA40.match(want):
        return want
    try:
        if not want:
            lines = git.cmd.Git().ls_remote(pin.url, pin.ref).splitlines()
            refs = dict(reversed(line.split("\t", 1)) for line in lines if "\t" in line)
            for name in (f"refs/tags/{pin.ref}^{{}}", f"refs/tags/{pin.ref}", f"refs/heads/{pin.ref}", pin.ref):
                if name in refs:
                    return refs[name]
            raise LockError(f"git.{pin.name}: ref {pin.ref!r} not found on {pin.url}")
        with tempfile.TemporaryDirectory(prefix="rigforge-lock-") as tmp:
            repo = git.Repo.init(tmp, bare=True)
            everywhere = ["+refs/heads/*:refs/heads/*", "+refs/tags/*:refs/tags/*"]  # for a ref that is a short SHA
            specs = everywhere if SHORT.match(pin.ref) else [f"+refs/heads/{pin.ref}:refs/heads/{pin.ref}"]
            repo.git.fetch("--filter=tree:0", "--no-tags", pin.url, *specs)  # commits only: small even for vllm
            return repo.git.rev_parse("--verify", "--end-of-options", f"{want}^{{commit}}").strip()
    except git.GitCommandError as e:
        raise LockError(f"git.{pin.name}: cannot resolve {want or pin.ref} on {pin.url}: {_last_line(e)}") from None


def _last_line(e: Exception) -> str:
    """The last line git printed (GitPython quotes its stderr: `  stderr: 'fatal: ...\n'`)."""
    text = (getattr(e, "stderr", None) or str(e)).strip().removesuffix("'").strip()
    return text.splitlines()[-1] if text else str(e)


def resolve_hf(pin: HfPin, endpoint: str | None, token: str | None) -> HfPin:
    """The pin with revision, gated flag and the size and sha256 of every file (of its `include`d files only, when
    it lists some: a GGUF quant of a many-quant repo) from the hub; an included file the hub lacks is an error."""
    from huggingface_hub import HfApi, hf_hub_download

    hub = {"endpoint": endpoint, "token": token or False}
    files = []
    try:  # a gated repo's info is public: its token is asked by the downloads of its small (non-LFS) files
        info = HfApi(**hub).model_info(pin.repo, revision=pin.ref, files_metadata=True)
        siblings = sorted(info.siblings or [], key=lambda s: s.rfilename)
        if pin.include:
            missing = sorted(set(pin.include) - {s.rfilename for s in siblings})
            if missing:
                raise LockError(f"hf.{pin.name}: {pin.repo}@{info.sha} has no {', '.join(missing)}")
            siblings = [s for s in siblings if s.rfilename in pin.include]
        with tempfile.TemporaryDirectory(prefix="rigforge-lock-") as tmp:
            for s in siblings:
                if s.lfs is not None:
                    files.append(HfFile(s.rfilename, int(s.lfs.size), s.lfs.sha256))
                    continue
                local = hf_hub_download(pin.repo, s.rfilename, revision=info.sha, local_dir=tmp, **hub)
                data = Path(local).read_bytes()
                files.append(HfFile(s.rfilename, len(data), hashlib.sha256(data).hexdigest()))
    except LockError:
        raise
    except Exception as e:  # noqa: BLE001 - report hub errors (gated, missing, network) by entry
        raise LockError(f"hf.{pin.name}: cannot read {pin.repo}@{pin.ref}: {type(e).__name__}: {e}") from None
    return dataclasses.replace(pin, revision=info.sha, gated=bool(info.gated), files=tuple(files))


def manifest_url(ref: str, registry: str | None = None, repository: str | None = None) -> str:
    """The Distribution API manifest URL of an image reference `[host/]name[:tag]`: at the registry its host names
    (ghcr.io/ggml-org/llama.cpp -> https://ghcr.io, repository ggml-org/llama.cpp), Docker Hub without one; at
    `registry` instead when given (a stand-in for every upstream: the repository without the host), or at its
    `repository` there when given (the fleet registry's copy: obtain.fleet_repository)."""
    name, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "latest")
    first = name.split("/", 1)[0]
    if ("." in first or ":" in first or first == "localhost") and "/" in name:
        registry, name = registry or f"https://{first}", name.split("/", 1)[1]
    registry = (registry or "https://registry-1.docker.io").rstrip("/")
    if "/" not in name and registry.endswith("registry-1.docker.io"):
        name = f"library/{name}"
    return f"{registry}/v2/{repository or name}/manifests/{tag}"


def cuda_of(config: dict) -> str | None:
    """The CUDA version (major.minor) in an image's config blob: its CUDA_VERSION variable, else a CUDA label."""
    inner = config.get("config") or {}
    env = dict(item.partition("=")[::2] for item in inner.get("Env") or [])
    labels = inner.get("Labels") or {}
    found = env.get("CUDA_VERSION") or next(
        (v for k, v in labels.items() if k.lower().replace("-", "_").endswith(("cuda_version", "cuda.version"))), None
    )
    match = re.match(r"^\d+\.\d+", str(found or ""))  # "13.0.1" -> "13.0"
    return match.group(0) if match else None


def resolve_image(
    ref: str,
    registry: str | None = None,
    verify: str | bool = True,
    known: str | None = None,
    repository: str | None = None,
) -> tuple[str, str | None]:
    """(the digest `docker pull` would get for `ref`, from `registry` (a base URL) when given, at its `repository`
    there when given (manifest_url); `cuda_of` its config blob (for a multi-platform index: the linux/amd64 image's,
    else the first image's), None when the digest is `known`)."""
    import requests

    url = manifest_url(ref, registry, repository)
    headers = {"Accept": MANIFEST_TYPES}

    def get(path: str) -> dict:
        resp = registry_request("GET", f"{url.rsplit('/manifests/', 1)[0]}/{path}", headers, verify=verify)
        resp.raise_for_status()
        return resp.json()

    try:
        resp = registry_request("HEAD", url, headers, verify=verify)
    except (requests.RequestException, ValueError, KeyError) as e:
        raise LockError(f"image: cannot reach the registry for {ref}: {e}") from None
    digest = resp.headers.get("Docker-Content-Digest", "")
    if resp.status_code == 404:
        raise LockError(f"image: {ref}: registry answered HTTP 404, it no longer has this tag (purged)")
    if resp.status_code != 200 or not DIGEST.match(digest):
        raise LockError(f"image: {ref}: registry answered HTTP {resp.status_code} without a sha256 digest")
    if digest == known:
        return digest, None
    try:
        manifest = get(f"manifests/{digest}")
        if "manifests" in manifest:  # an index: the linux/amd64 image (else the first)
            entries = manifest["manifests"]
            amd64 = [m for m in entries if (m.get("platform") or {}).get("architecture") == "amd64"]
            manifest = get(f"manifests/{(amd64 or entries)[0]['digest']}")
        return digest, cuda_of(get(f"blobs/{manifest['config']['digest']}"))
    except (requests.RequestException, ValueError, KeyError, IndexError, TypeError) as e:
        raise LockError(f"image: {ref}: cannot read its config for the CUDA version: {e}") from None


def live_recipe(dead: str, lock: Lock) -> str:
    """What to do about the purged image `dead` (for the 404 hint): a slug rigforge can serve whose image is not
    `dead`, from the recipe tree `lock` pins (the controller's cache of its commit, else what `recipes.load_repo`
    reads for it). Never a slug of another commit's tree, so the advice never moves the lock back."""
    pin = lock.git.get(recipes.GIT_NAME)
    commit = pin.commit if pin else None
    try:
        if commit and (recipes.cache_dir(commit) / recipes.REGISTRY).is_file():
            repo = recipes.parse_repo(recipes.cache_dir(commit))
        else:
            repo = recipes.load_repo(commit, pin.content if pin else None)
    except (LockError, recipes.RecipeError):
        return "move to a recipe with a live image, e.g. a recipe-repo slug from `rigforge render --list`"
    where = f"the recipe repo at {commit[:8]}" if commit else f"the recipe repo in {repo.root}"
    for r in repo.recipes.values():
        if not r.refused and not r.needs_opt_in and r.image != dead:
            return f"move to a recipe with a live image, e.g. rigforge_variant: {r.slug} ({r.image}, {where})"
    return (
        f"no slug of {where} runs another image: move the recipe pin to a later commit whose images the registry "
        "has (`rigforge lock --recipes REF`)"
    )


def cache_recipes(pin: GitPin) -> Path | None:
    """Fill the controller cache of the recipe repo at the pinned commit (what `render` reads offline)."""
    import git

    dest = recipes.cache_dir(pin.commit)
    if (dest / recipes.REGISTRY).is_file():
        return None
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{pin.commit[:12]}-", dir=dest.parent) as tmp:
        try:
            repo = git.Repo.init(tmp)
            repo.git.fetch("--depth", "1", pin.url, pin.commit)
            repo.git.checkout("--detach", pin.commit)
        except git.GitCommandError as e:
            raise LockError(f"git.{pin.name}: cannot fetch {pin.commit} from {pin.url}: {_last_line(e)}") from None
        os.replace(tmp, dest)
        os.makedirs(tmp)  # for the context manager's clean-up
    return dest


def resolve(
    lock: Lock,
    refresh: list[str],
    endpoint: str | None,
    token: str | None,
    registry: str | None = None,
    fleet: tuple[str, str | bool] | None = None,
    errors: list[str] | None = None,
) -> tuple[Lock, list[str]]:
    """Resolve unresolved (and `refresh`ed) entries: (the new lock, a report line per change). `fleet`: (base URL,
    CA path or False for plain HTTP) resolves an image upstream no longer has (HTTP 404) from the fleet's copy. With
    `errors`, an entry that cannot be resolved is kept and its problem added there; else the first one raises
    LockError."""
    if unknown := set(refresh) - set(lock.git) - set(lock.hf) - {"image"} - {f"images.{n}" for n in lock.images}:
        raise LockError(f"--refresh: no git or hf entry {sorted(unknown)} (known: {', '.join([*lock.git, *lock.hf])})")
    report = []

    def attempt(
        resolver: Callable[[str, _Pin], _Pin], label: str, key: str, pin: _Pin, resolved: str | bool | None
    ) -> _Pin:
        if resolved and key not in refresh:
            return pin
        try:
            return resolver(key, pin)
        except LockError as e:
            if errors is None:
                raise
            errors.append(f"{label}: " + str(e).removeprefix("image: ").removeprefix(f"{label}: "))
            return pin

    def image(key: str, pin: ImagePin) -> ImagePin:
        where = ""
        try:
            digest, cuda = resolve_image(pin.ref, registry, known=pin.digest)
        except LockError as gone:
            if "HTTP 404" not in str(gone):
                raise
            live = live_recipe(pin.ref, lock)
            if fleet is None:
                raise LockError(f"{gone}; {live}") from None
            parsed = parse(pin.ref)
            base, verify = fleet  # the fleet registry holds its copy at fleet_repository: `library/x`, `ghcr.io/o/x`
            where = f" (from the fleet registry {base}: upstream no longer has this tag)"
            try:
                digest, cuda = resolve_image(pin.ref, base, verify, pin.digest, repository=fleet_repository(parsed))
            except LockError as e:
                raise LockError(f"{gone}; the fleet registry {base} has no copy either ({e}); {live}") from None
        if digest == pin.digest:
            return pin
        cuda = cuda or pin.cuda  # none in the config: keep the lock's
        report.append(f"{key}: {pin.ref} -> {digest}" + (f" (CUDA {cuda})" if cuda else "") + where)
        return dataclasses.replace(pin, digest=digest, cuda=cuda)

    def commit_of(name: str, pin: GitPin) -> GitPin:
        commit = resolve_git(dataclasses.replace(pin, short=None) if name in refresh else pin)
        if commit != pin.commit:
            report.append(f"git.{name}: {pin.ref} -> {commit}")
        content = pin.content if commit == pin.commit else None  # another commit's digest would name a wrong tree
        return dataclasses.replace(pin, commit=commit, content=content)

    def revision_of(name: str, pin: HfPin) -> HfPin:
        new = resolve_hf(pin, endpoint, token)
        if new != pin:
            report.append(f"hf.{name}: {pin.repo}@{pin.ref} -> {new.revision} ({len(new.files)} files)")
        return new

    seed = attempt(image, "image", "image", lock.image, lock.image.digest)
    images = {n: attempt(image, f"images.{n}", f"images.{n}", p, p.digest) for n, p in lock.images.items()}
    git = {n: attempt(commit_of, f"git.{n}", n, p, p.commit) for n, p in lock.git.items()}
    hf = {n: attempt(revision_of, f"hf.{n}", n, p, p.resolved) for n, p in lock.hf.items()}
    return dataclasses.replace(lock, image=seed, images=images, git=git, hf=hf), report


TOOLKIT = "nvidia-container-toolkit"


def toolkit_news(pin: ToolkitPin, packages_text: str) -> str | None:
    """One line when the apt Packages index lists a release newer than the pinned one (`~rc` pre-releases aside)."""
    stanzas = (
        dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line[0].isspace())
        for stanza in packages_text.split("\n\n")
    )
    versions = (fields["Version"] for fields in stanzas if fields.get("Package") == TOOLKIT and "Version" in fields)
    newest = max((v for v in versions if "~" not in v), key=version_key, default=None)
    if newest is None or version_key(newest) <= version_key(pin.version):
        return None
    why = f" ({pin.note})" if pin.note else ""
    return (
        f"{TOOLKIT}: locked {pin.version}, newer {newest} exists upstream; kept{why}; to move: set toolkit.version "
        f"in the lock (or host data nvidia_toolkit_version) to {newest} once it is known to work"
    )


def check_toolkit(pin: ToolkitPin, repo: str | None = None) -> str | None:
    """`toolkit_news` from the flat repo's Packages file; one line saying it could not check when unreachable."""
    import requests

    url = (repo or TOOLKIT_REPO_URL.replace("{arch}", "amd64")).rstrip("/") + "/Packages"
    try:
        resp = requests.get(url, timeout=15)
        resp.raise_for_status()
    except requests.RequestException as e:
        return f"{TOOLKIT}: locked {pin.version}; could not check {url} for a newer release ({type(e).__name__})"
    return toolkit_news(pin, resp.text)


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _endpoints(args: argparse.Namespace) -> tuple:
    """(HF endpoint, HF token, registry, fleet registry) as `resolve` takes them, from the environment and args."""
    token = os.environ.get("RIGFORGE_HF_TOKEN") or os.environ.get("HF_TOKEN")
    fleet = None
    if args.fleet_registry:
        from rigforge.model.registry import default_ca_dir

        url = args.fleet_registry
        verify: str | bool = False  # plain HTTP: no CA
        if not url.startswith("http://"):
            verify = args.fleet_ca or str(default_ca_dir() / "ca.crt")
        fleet = (url, verify)
    return os.environ.get("HF_ENDPOINT"), token, os.environ.get("RIGFORGE_REGISTRY"), fleet


def used_slugs(inventory_path: str | None) -> list[str]:
    """The recipe slugs (engine/name) the rigs of a pyinfra inventory deploy (host data rigforge_variant). Read in
    a child process: loading an inventory patches sockets for gevent, which breaks TLS in this one."""
    if not inventory_path:
        return []
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(_slugs_in, (inventory_path,))


def _slugs_in(inventory_path: str) -> list[str]:
    from rigforge.model import fleet
    from rigforge.observe.inventory import open_inventory

    hosts = open_inventory(inventory_path).inventory
    variants = (fleet.host_data(h.data)["rigforge_variant"] for h in hosts if fleet.is_rig(h))
    return [v for v in variants if v and "/" in v]


def follow_recipes(args: argparse.Namespace, path: Path) -> int:
    """`lock --recipes REF`: the lock at REF, resolved, its diff printed; written only when every entry resolved.
    When the recipe pin itself cannot be resolved, the entries REF adds are unknown; each entry of the lock as it is
    that cannot be resolved either is still named."""
    from rigforge.observe.inventory import InventoryError

    out = Path(args.out or path)
    errors: list[str] = []

    def fetch(pin: GitPin) -> tuple[GitPin, Path]:
        try:
            pin = dataclasses.replace(pin, commit=resolve_git(pin))
            return pin, cache_recipes(pin) or recipes.cache_dir(pin.commit)
        except LockError as e:
            errors.append(str(e))  # the recipe pin: named with the entries below
            raise

    try:
        lock = load_lock(path)
        try:
            moved, _ = follow.follow(lock, args.recipes, [*used_slugs(args.inventory), *args.add], fetch)
        except LockError:
            if not errors:
                raise
            moved = lock
        new, report = resolve(moved, list(args.refresh), *_endpoints(args), errors=errors)
    except (LockError, recipes.RecipeError, InventoryError) as e:
        print(f"rigforge lock: {e}", file=sys.stderr)
        print(f"rigforge lock: {nothing_written(out)}", file=sys.stderr)
        return 1
    if errors:
        for e in errors:
            print(f"rigforge lock: could not resolve {e}", file=sys.stderr)
        if moved is lock:
            others = f"; the other entries named are those of {path}" if len(errors) > 1 else ""
            print(
                f"rigforge lock: the image and weights entries {args.recipes} needs are not known until "
                f"git.{recipes.GIT_NAME} resolves{others}",
                file=sys.stderr,
            )
        print(f"rigforge lock: {nothing_written(out)}", file=sys.stderr)
        return 1
    text = follow.diff(lock, new, str(path))
    print(text or f"{path}: already at {args.recipes} ({new.git[recipes.GIT_NAME].commit[:12]}): no change")
    for line in report:
        print(line)
    if text or out != path:
        write_atomically(out, dump_lock(new))
        print(f"wrote {out}" + ("" if out == path else f" (the lock in use, {path}, is as it was)"))
    return 0


def nothing_written(out: Path) -> str:
    """What a failed `lock --recipes` left of `out`: as it was when it was there, else still absent."""
    if out.exists():
        return f"nothing written: {out} is as it was"
    return f"nothing written: {out} was not created"


def run(args: argparse.Namespace) -> int:
    path = Path(args.lock or default_lock_path())
    if args.recipes:
        return follow_recipes(args, path)
    if args.out or args.add or args.inventory:
        print("rigforge lock: --out, --add and --inventory go with --recipes REF", file=sys.stderr)
        return 2
    try:
        lock = load_lock(path)
        if args.check:
            problems = lock.check()
            for p in problems:
                print(f"{path}: {p}", file=sys.stderr)
            if not problems:
                print(f"{path}: ok ({len(lock.git)} git, {len(lock.hf)} hf entries, all resolved)")
            return 1 if problems else 0
        errors: list[str] = []
        new, report = resolve(lock, list(args.refresh), *_endpoints(args), errors=errors)
        if errors:  # each entry named; none written, not even those that resolved
            for e in errors:
                print(f"rigforge lock: could not resolve {e}", file=sys.stderr)
            print(f"rigforge lock: nothing written: {path} is as it was", file=sys.stderr)
            return 1
        if report:
            write_atomically(path, dump_lock(new))
        pin = new.git.get(recipes.GIT_NAME)
        cached = cache_recipes(pin) if pin and pin.commit else None
    except LockError as e:
        print(f"rigforge lock: {e}", file=sys.stderr)
        return 1
    if cached:
        report.append(f"git.{recipes.GIT_NAME}: cached {pin.commit[:12]} at {cached} (what `rigforge render` reads)")
    for line in report or ["nothing to resolve"]:
        print(line)
    if new.toolkit and (news := check_toolkit(new.toolkit, os.environ.get("RIGFORGE_TOOLKIT_REPO"))):
        print(news)
    return 0
