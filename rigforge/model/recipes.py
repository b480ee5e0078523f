"""The recipe repo (club-3090)'s registry slugs as variants; what is served or refused: README.md "Live recipes".
The GPU floor is upstream's (scripts/preflight.sh "fallback_sm replaces required_sm as the hard floor").
"""

import contextlib
import hashlib
import os
import posixpath
import re
import shlex
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from rigforge.layout import AssetDir, HostLayout
from rigforge.model.hardware import serving_env
from rigforge.model.pins import HfPin, ImagePin, LockError
from rigforge.model.render import COMPOSE_FILE, setting_name, units

RECIPES_ENV = "RIGFORGE_RECIPES"
GIT_NAME = "recipes"  # the lock's git entry for the recipe repo that provides the slugs
REGISTRY = "scripts/lib/profiles/registry.yaml"
RIG_SM = 8.6  # RTX 3090 (Ampere)
SELECTABLE = ("production", "caveats")
# the engine profile `type`s rigforge serves, each only as install.method docker_image: {type: how it is named}
SERVED_ENGINES = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}
SERVED_INSTALL = "docker_image"
# where each served engine answers "ready" on its own API: vLLM's /v1/models, llama-server's /health (503 "Loading
# model" while it loads, 200 {"status":"ok"} after: the llama.cpp server README)
HEALTH_PATHS = {"vllm": "/v1/models", "llama.cpp": "/health"}
OPT_IN = ("experimental", "incubating", "deprecated", "preview")  # upstream launches them with --force
# rigforge setting -> the compose variable it sets (a recipe that does not reference it cannot take it), in the
# .env's order
KNOBS = {
    "model_dir": "MODEL_DIR",
    "port": "PORT",
    "bind_address": "BIND_HOST",
    "max_model_len": "MAX_MODEL_LEN",
    "kv_cache_dtype": "KV_CACHE_DTYPE",
    "gpu_memory_utilization": "GPU_MEMORY_UTILIZATION",
    "max_num_seqs": "MAX_NUM_SEQS",
    "spec_n": "SPEC_N",
    "nvlink_mode": "NVLINK_MODE",
}
NO_KNOB = ("extra_args", "api_key")  # settings the recipes have no knob for: refused for a slug
# vLLM's compile caches in the container -> their dir under <root>/cache: a bind mount of either comes from there,
# whatever its source or variable, so the caches stay rigforge's and survive a bump of the recipe checkout
CACHE_TARGETS = {"/root/.cache/vllm/torch_compile_cache": "torch_compile", "/root/.triton/cache": "triton"}


class RecipeError(ValueError):
    """The recipe repo is missing or malformed, or a slug cannot be served; the message says what to do."""


@dataclass(frozen=True)
class Weights:
    id: str  # the model profile's weights key
    hf_repo: str
    local_subdir: str
    size_gb: float | None  # None when the profile says "variable"
    files: tuple[str, ...] = ()  # the profile's `files` (a GGUF quant of a many-quant repo, or its split parts): only
    # these of the repo are fetched; () = every file of the repo (safetensors weights)


@dataclass(frozen=True)
class Recipe:
    slug: str
    model: str
    status: str
    port: int
    tp: int
    compose_path: str
    engine: str
    engine_type: str
    install_method: str
    image: str
    weights: tuple[Weights, ...]
    required_sm: float  # the floor: fallback_sm, else required_sm, at least the engine's min_sm
    refused: str | None  # why rigforge cannot serve it (None: selectable, maybe with opt-in)
    native_sm: float | None = None  # the registry's required_sm (full speed) when fallback_sm lowers the floor
    category: str | None = None
    default_arch_allow: tuple[str, ...] = ()  # archs upstream's DEFAULTS may pick this slug for ("8.6")
    sampler_profiles: dict = field(default_factory=dict, hash=False, compare=False)  # {profile: {param: value}}
    image_env: str | None = None  # the engine profile's variable that sets the image (upstream's launchers set it)
    extra: dict = field(default_factory=dict, hash=False, compare=False)  # entry keys rigforge does not read: kept

    @property
    def name(self) -> str:
        """File-system and unit-instance safe name: vllm/dual -> vllm-dual."""
        return self.slug.replace("/", "-")

    @property
    def needs_opt_in(self) -> bool:
        return self.status in OPT_IN

    @property
    def weights_label(self) -> str:
        return ", ".join(f"{w.hf_repo} ({w.size_gb:g} GB)" if w.size_gb else w.hf_repo for w in self.weights) or "-"


def _yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise RecipeError(f"recipe repo: cannot read {path}: {exc}") from None


def _sm(value: Any) -> float:
    with contextlib.suppress(TypeError, ValueError):
        return float(value or 0)
    return 0.0


def _size(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class RecipeRepo:
    root: Path
    recipes: dict[str, Recipe]

    def recipe(self, slug: str, opt_in: bool = False) -> Recipe:
        """The slug if rigforge can serve it; else RecipeError with one line naming the slug and why."""
        r = self.recipes.get(slug)
        if r is None:
            raise RecipeError(f"unknown variant {slug!r}: not a seed variant nor a slug of the recipe registry")
        if r.refused:
            raise RecipeError(f"{slug}: refused: {r.refused}")
        if r.needs_opt_in and not opt_in:
            raise RecipeError(
                f"{slug}: status {r.status} needs an explicit opt-in "
                "(host data rigforge_recipe_opt_in: True, or `rigforge render --opt-in`)"
            )
        return r

    def compose(self, r: Recipe) -> dict:
        return _yaml(self.root / r.compose_path)


def _weights(root: Path, e: dict) -> tuple[tuple[Weights, ...], str | None]:
    model = str(e.get("model"))
    path = root / "scripts/lib/profiles/models" / f"{model}.yml"
    if not path.exists():
        return (), f"no model profile models/{model}.yml"
    weights = (_yaml(path) or {}).get("weights") or {}
    out = []
    for wid in [e.get("weights_variant"), *(e.get("weights_companions") or [])]:
        w = weights.get(wid)
        if w is None:  # a companion may be a drafter profile
            d = root / "scripts/lib/profiles/drafters" / f"{wid}.yml"
            w = _yaml(d) if d.exists() else None
        if not isinstance(w, dict) or not w.get("hf_repo") or not (w.get("local_subdir") or w.get("path")):
            return (), f"weights {wid!r} of {model} have no hf_repo/local_subdir in the model profile"
        listed = tuple(str(f) for f in w.get("files") or () if isinstance(f, str))
        out.append(Weights(wid, w["hf_repo"], w.get("local_subdir") or w["path"], _size(w.get("size_gb")), listed))
    return tuple(out), None


def _classify(e: dict, engine: dict | None, sm: float) -> str | None:
    """Why rigforge cannot serve the registry entry `e` run by `engine` (its profile) at GPU floor `sm`, or None:
    an engine without a profile, one rigforge does not serve (named, with the engines it serves), a floor above
    the RTX 3090's, a card count, an unknown status."""
    if engine is None:
        return f"engine {e.get('engine')!r} has no profile in engines/"
    install = engine.get("install") or {}
    if engine.get("type") not in SERVED_ENGINES or install.get("method") != SERVED_INSTALL:
        how = f"{engine.get('type')} installed by {install.get('method')}"
        served = " and ".join(SERVED_ENGINES.values())
        return f"engine {engine.get('id')} is {how}: rigforge serves {served} engines installed by {SERVED_INSTALL}"
    if sm > RIG_SM:
        return f"needs sm_{sm * 10:.0f} or newer (fallback_sm/required_sm/min_sm {sm:.1f}); an RTX 3090 is sm_86"
    if isinstance(e.get("tp"), bool) or not isinstance(e.get("tp"), int) or e.get("tp") < 1:
        return f"tp {e.get('tp')!r} is not a card count (the registry's tp: how many GPUs the slug runs on)"
    if e.get("status") not in SELECTABLE + OPT_IN:
        return f"unknown status {e.get('status')!r}"
    return None


ENTRY_KEYS = {  # the registry entry keys rigforge reads; any other (origin, kv_offload, mem_util, ...) is kept as data
    "model",
    "status",
    "default_port",
    "tp",
    "compose_path",
    "engine",
    "fallback_sm",
    "required_sm",
    "weights_variant",
    "weights_companions",
    "category",
    "default_arch_allow",
    "sampler_profiles",
}


def parse_repo(root: Path) -> RecipeRepo:
    root = Path(root)
    registry = _yaml(root / REGISTRY)
    if not isinstance(registry, dict) or not isinstance(registry.get("entries"), dict):
        raise RecipeError(f"recipe repo {root}: {REGISTRY} has no 'entries' mapping")
    profiles = [(path, _yaml(path) or {}) for path in sorted((root / "scripts/lib/profiles/engines").glob("*.yml"))]
    engines = {str(data.get("id") or path.stem): data for path, data in profiles}
    recipes: dict[str, Recipe] = {}
    for slug, e in registry["entries"].items():
        engine = engines.get(str(e.get("engine")))
        image_env = str((engine or {}).get("image_env"))
        floor = e.get("fallback_sm") if e.get("fallback_sm") is not None else e.get("required_sm")
        sm = max(_sm(floor), _sm((engine or {}).get("min_sm")))
        weights, problem = _weights(root, e)
        refused = _classify(e, engine, sm) or problem
        if not refused and not (root / str(e.get("compose_path"))).is_file():
            refused = f"compose file {e.get('compose_path')} is not in the checkout"
        recipes[slug] = Recipe(
            slug=slug,
            model=str(e.get("model")),
            status=str(e.get("status")),
            port=int(e.get("default_port") or 0),
            tp=int(e.get("tp") or 0),
            compose_path=str(e.get("compose_path")),
            engine=str(e.get("engine")),
            engine_type=str((engine or {}).get("type")),
            install_method=str(((engine or {}).get("install") or {}).get("method")),
            image=str(((engine or {}).get("install") or {}).get("spec")),
            weights=weights,
            required_sm=sm,
            refused=refused,
            native_sm=_sm(e["required_sm"]) if e.get("fallback_sm") is not None and "required_sm" in e else None,
            category=e.get("category"),
            default_arch_allow=tuple(str(a) for a in e.get("default_arch_allow") or ()),
            sampler_profiles=dict(e.get("sampler_profiles") or {}),
            image_env=image_env if re.fullmatch(r"[A-Z_][A-Z0-9_]*", image_env) else None,
            extra={k: v for k, v in e.items() if k not in ENTRY_KEYS},
        )
    names = [r.name for r in recipes.values()]
    if dupes := {n for n in names if names.count(n) > 1}:
        raise RecipeError(f"recipe repo {root}: slugs collide as file names: {sorted(dupes)}")
    return RecipeRepo(root=root, recipes=recipes)


_load = cache(parse_repo)  # a checkout is read once per process


def cache_root() -> Path:
    """The controller's cache of recipe-repo commits, one directory each (filled by `rigforge lock`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rigforge" / "recipes"


def cache_dir(commit: str) -> Path:
    """The controller cache of the recipe repo at `commit` (filled by `rigforge lock`)."""
    return cache_root() / commit


PROFILES = "scripts/lib/profiles"
SKIPPED_DIRS = {"_archive", "diagnostics"}  # upstream's retired composes and debugging aids: rigforge reads neither
# the per-model directories of the engines rigforge serves (models/<model>/<dir>/compose/...), whose composes mount
# their neighbours: vLLM's, and the llama.cpp builds' (mainline, ik_llama, beellama, club-3090's own)
ENGINE_DIRS = ("vllm", "llama-cpp", "ik-llama", "beellama", "llamacpp-club3090")


def _read_files(root: Path) -> list[str]:
    """The files rigforge reads of a recipe-repo tree, relative and sorted: the catalog (every YAML file under
    scripts/lib/profiles/) and the recipes of the engines it serves (every file under models/*/<ENGINE_DIRS>/,
    whose composes mount their neighbours), past _archive/ and diagnostics/. The vendored subset (tests/fixtures,
    PROVENANCE.md) holds all of them verbatim, so it has the digest of the commit it was taken from."""
    catalog = [p for p in (root / PROFILES).rglob("*") if p.suffix in (".yml", ".yaml")]
    served = [p for d in ENGINE_DIRS for p in root.glob(f"models/*/{d}/**/*")]
    served = [p for p in served if not SKIPPED_DIRS & set(p.relative_to(root).parts)]
    return sorted(p.relative_to(root).as_posix() for p in [*catalog, *served] if p.is_file())


@cache
def content_digest(root: Path) -> str:
    """`sha256:...` of the files rigforge reads at `root` (`_read_files`): each path and its content's sha256. What
    the lock records for the recipe pin (git.recipes `content`), to identify a tree that has no .git."""
    listing = "".join(f"{hashlib.sha256((root / rel).read_bytes()).hexdigest()}  {rel}\n" for rel in _read_files(root))
    return "sha256:" + hashlib.sha256(listing.encode()).hexdigest()


@cache
def _head(root: Path) -> str | None:
    """The commit checked out in the git checkout `root` (None when git cannot tell)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", out.stdout.strip()) else None


def _cached_commit(digest: str) -> str | None:
    """A commit in the controller cache whose tree has `digest`, if any (to name what a tree without .git holds)."""
    found = [d for d in sorted(cache_root().glob("*")) if (d / REGISTRY).is_file() and content_digest(d) == digest]
    return found[0].name if found else None


def _follows(env: str, commit: str, content: str | None) -> None:
    """Refuse the tree at RIGFORGE_RECIPES=`env` unless it is the recipe repo at the locked `commit`: a git
    checkout by its HEAD, any other tree by its content (`content_digest`) against the lock's `content`, or the
    cached checkout of `commit` when the lock records none."""
    root = Path(env)
    unset = (
        f"unset {RECIPES_ENV} (the controller then reads the locked commit from the cache `rigforge lock` fills), "
        f"or point it at a checkout of {commit[:12]}"
    )
    if (root / ".git").exists():
        head = _head(root)
        if head is None:
            raise RecipeError(f"{RECIPES_ENV}={env}: git cannot tell its commit; {unset}")
        if head != commit:
            raise RecipeError(
                f"{RECIPES_ENV}={env} is the recipe repo at {head[:12]}, the lock pins git.{GIT_NAME} at "
                f"{commit[:12]}: {unset}"
            )
        return
    expected = content
    if expected is None and (cache_dir(commit) / REGISTRY).is_file():
        expected = content_digest(cache_dir(commit))
    if expected is None:
        raise RecipeError(
            f"{RECIPES_ENV}={env} has no .git and the lock records no content digest for git.{GIT_NAME} at "
            f"{commit[:12]}, so rigforge cannot tell which commit it holds: {unset}, or run `rigforge lock` to "
            "record the digest"
        )
    actual = content_digest(root)
    if actual == expected:
        return
    if other := _cached_commit(actual):
        raise RecipeError(
            f"{RECIPES_ENV}={env} holds the recipe repo at {other[:12]} (told by its content: it has no .git), the "
            f"lock pins git.{GIT_NAME} at {commit[:12]}: {unset}"
        )
    raise RecipeError(
        f"{RECIPES_ENV}={env} is not the recipe repo at {commit[:12]}, the commit the lock pins git.{GIT_NAME} at: "
        f"it has no .git, and the files rigforge reads there (content {actual[:19]}) differ from that commit's "
        f"({expected[:19]}): {unset}"
    )


def locate(commit: str | None, content: str | None = None) -> Path:
    """Where the controller reads the recipe repo: RIGFORGE_RECIPES if it holds the locked `commit` (its
    `content` digest, when the lock records one), else the lock's cached commit."""
    if env := os.environ.get(RECIPES_ENV):
        if not (Path(env) / REGISTRY).is_file():
            raise RecipeError(f"{RECIPES_ENV}={env} is not a checkout of the recipe repo (no {REGISTRY})")
        if commit:
            _follows(env, commit, content)
        return Path(env)
    if commit and (cache_dir(commit) / REGISTRY).is_file():
        return cache_dir(commit)
    raise RecipeError(
        f"the recipe repo is not on this controller: set {RECIPES_ENV}=DIR to a checkout of it, "
        f"or run `rigforge lock` to cache the locked commit{f' {commit[:12]}' if commit else ''}"
    )


def load_repo(commit: str | None, content: str | None = None) -> RecipeRepo:
    return _load(locate(commit, content))


# --- compose interpolation (compose spec: $VAR, ${VAR}, ${VAR:-d}, ${VAR-d}, ${VAR:?e}, ${VAR?e}, ${VAR:+r},
# ${VAR+r}, nesting, $$ for a literal $; an unset variable without default is an empty string) ---

_REF = re.compile(r"\$\{?([_a-zA-Z][_a-zA-Z0-9]*)")
_DOLLAR = re.compile(r"\$(\$|\{|[_a-zA-Z][_a-zA-Z0-9]*)?")  # $$, ${, $NAME or a lone $
# inside ${...}: NAME, or NAME then a default (:- -), an error (:? ?) or an alternative (:+ +)
_BRACED = re.compile(r"([_a-zA-Z][_a-zA-Z0-9]*)(?:(:?)([-?+])(.*))?", re.S)
_NESTING = re.compile(r"\$\$|\$\{|\}")  # a literal $, a nested ${, a closing }


def _close(s: str, i: int) -> int:
    depth = 1
    for m in _NESTING.finditer(s, i):
        depth += {"$$": 0, "${": 1, "}": -1}[m.group()]
        if depth == 0:
            return m.start()
    raise RecipeError(f"unterminated ${{ in {s!r}")


def interpolate(s: str, env: dict[str, str]) -> str:
    out, i = [], 0
    while m := _DOLLAR.search(s, i):
        out.append(s[i : m.start()])
        token, i = m.group(1), m.end()
        if token == "{":
            end = _close(s, i)
            out.append(_braced(s[i:end], env))
            i = end + 1
        elif token in (None, "$"):  # a lone $ stays, $$ is a literal $
            out.append("$")
        else:
            out.append(env.get(token, ""))
    out.append(s[i:])
    return "".join(out)


def _braced(inner: str, env: dict[str, str]) -> str:
    m = _BRACED.fullmatch(inner)
    if not m:
        raise RecipeError(f"invalid interpolation ${{{inner}}}")
    name, colon, op, arg = m.groups()
    value = env.get(name)
    if op is None:
        return value or ""
    unset_or_empty = value is None or (colon == ":" and value == "")
    if op == "?" and unset_or_empty:
        raise RecipeError(f"required variable {name} is missing: {interpolate(arg, env)}")
    if op in ("-", "?"):  # ${VAR-default}, ${VAR:-default}; ${VAR?error} once set: its value
        return interpolate(arg, env) if unset_or_empty else value
    return "" if unset_or_empty else interpolate(arg, env)  # op "+": ${VAR+alternative}, ${VAR:+alternative}


def _walk(data: Any, fn: Callable[[str], Any]) -> Any:
    if isinstance(data, dict):
        return {k: _walk(v, fn) for k, v in data.items()}
    if isinstance(data, list):
        return [_walk(v, fn) for v in data]
    return fn(data) if isinstance(data, str) else data


def variables(compose: dict) -> set[str]:
    """Every variable the compose file interpolates (its knobs)."""
    used: set[str] = set()
    _walk(compose, lambda s: used.update(_REF.findall(s.replace("$$", ""))))
    return used


def interpolated(compose: dict, env: dict[str, str]) -> dict:
    return _walk(compose, lambda s: interpolate(s, env))


# --- what rigforge adds for a host ---


def knob_env(r: Recipe, compose: dict, values: dict[str, Any], host_keys: bool = False) -> dict[str, str]:
    """The .env variables for `values` ({setting: value}, None: the recipe's default). Every setting the recipe has
    no knob for is refused in one RecipeError, named as a setting, or as its host-data key when `host_keys`."""
    knobs = variables(compose)
    given = {key: value for key, value in values.items() if value is not None and value != () and value != ""}
    if missing := [key for key in given if key in NO_KNOB or KNOBS.get(key) not in knobs]:
        names = [setting_name(key, host_keys) for key in missing]
        holes = ", ".join("${" + KNOBS[key] + "}" if KNOBS.get(key) else f"no knob for {key}" for key in missing)
        one = len(missing) == 1
        raise RecipeError(
            f"{r.slug}: {', '.join(names)} {'is' if one else 'are'} not exposed by the recipe's compose file "
            f"({r.compose_path} has {'no ' if not holes.startswith('no ') else ''}{holes}); "
            f"remove {'it' if one else 'them'} for this variant"
        )
    return {KNOBS[key]: str(value) for key, value in given.items()}


def _volume(v: Any) -> tuple[str, str, str]:
    """(source, target, options) of a short-syntax volume."""
    parts = str(v).split(":")
    return ("", parts[0], "") if len(parts) == 1 else (parts[0], parts[1], ":".join(parts[2:]))


def service_name(r: Recipe, compose: dict) -> str:
    services = compose.get("services") or {}
    if len(services) != 1:
        raise RecipeError(f"{r.slug}: {r.compose_path} has {len(services)} services; rigforge serves one")
    return next(iter(services))


def _with_env(environment: Any, pin: dict[str, str]) -> Any:
    """A service's `environment` (list or mapping) with `pin`'s variables set, as compose merges an override's."""
    if not pin:
        return environment
    if isinstance(environment, dict):
        return {**environment, **pin}
    kept = [item for item in environment or [] if str(item).split("=", 1)[0] not in pin]
    return kept + [f"{key}={value}" for key, value in pin.items()]


def override(
    r: Recipe, compose: dict, env: dict[str, str], image: str, layout: HostLayout, pin: dict[str, str]
) -> dict:
    """The host override file: the lock's `image` (unless the .env's `env` sets the recipe's `image_env`), no restart
    policy (the unit owns restarts), host caches (the rig's cache dir at each cache target the recipe bind-mounts)
    and `pin`, the environment that names the cards it serves on (hardware.serving_env; {} when it uses every card:
    then no environment)."""
    svc = service_name(r, compose)
    host: dict[str, Any] = {"restart": "no"} if r.image_env in env else {"image": image, "restart": "no"}
    if pin:
        host["environment"] = dict(pin)
    for v in interpolated(compose, env)["services"][svc].get("volumes") or []:
        source, target, opts = _volume(v)
        bind = "/" in source or source.startswith((".", "~"))  # else a named volume: Docker's, not a directory
        name = CACHE_TARGETS.get(posixpath.normpath(target))
        if bind and name:
            host.setdefault("volumes", []).append(f"{layout.cache}/{name}:{target}" + (f":{opts}" if opts else ""))
    return {"services": {svc: host}}


def effective_compose(r: Recipe, compose: dict, env: dict[str, str], host_override: dict, checkout: str) -> dict:
    """What `docker compose -f RECIPE -f OVERRIDE config` resolves with the .env's `env` and `host_override`: scalars
    replaced, the environment merged (the override's variables set), volumes merged by target (the override's
    winning), relative bind sources resolved against the recipe's directory in the rig's pinned `checkout`."""
    out = interpolated(compose, env)
    base_dir = posixpath.join(checkout, posixpath.dirname(r.compose_path))
    for svc, extra in host_override["services"].items():
        service = out["services"][svc]
        for key, value in extra.items():
            if key == "volumes":  # merged by target, the override's winning
                value = list({_volume(v)[1]: v for v in [*(service.get("volumes") or []), *value]}.values())
            elif key == "environment":  # the recipe's own, with the override's variables set
                value = _with_env(service.get("environment"), value)
            service[key] = value
        vols = []
        for v in service.get("volumes") or []:
            source, target, opts = _volume(v)
            if source.startswith("."):
                source = posixpath.normpath(posixpath.join(base_dir, source))
            vols.append(":".join(x for x in (source, target, opts) if x))
        service["volumes"] = vols
    return out


class _Dumper(yaml.SafeDumper):
    def represent_str(self, s: str) -> yaml.ScalarNode:
        return self.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _Dumper.represent_str)


def dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True, default_flow_style=False)


# --- the files a rig gets for a slug ---

OVERRIDE_FILE = "compose.override.yml"
EFFECTIVE_FILE = "effective-compose.yml"  # what `docker compose config` resolves: for reading, not for running


# --- a slug as the roles see a variant ---

_VRAM = re.compile(r"^#\s*Requires-min-vram-gb:\s*(\d+(?:\.\d+)?)\s*$", re.M)


@dataclass(frozen=True)
class LiveVariant:
    """The registry adapter of the variant protocol (rigforge/model/fleet.py `ServedVariant`): a recipe-repo slug."""

    recipe: Recipe
    compose: dict = field(repr=False, hash=False, compare=False)  # the recipe's compose file, parsed
    image: str  # what runs: the lock's ref@digest (or tag while the digest is unresolved)
    asset_dirs: tuple[AssetDir, ...]  # each weights' lock entry, dir and bytes (the model profile's size_gb)
    served_model: str
    min_card_mib: int
    sources: tuple[str, ...] = (GIT_NAME,)
    uses_dflash: bool = False  # 20 GB cards: the recipe's own knobs (kv dtype, memory) apply
    successor: str | None = None  # a live slug is its own way forward

    @property
    def name(self) -> str:
        return self.recipe.name

    @property
    def assets(self) -> tuple[str, ...]:
        return tuple(a.asset for a in self.asset_dirs)  # lock hf names

    @property
    def gpus(self) -> int:
        return self.recipe.tp

    @property
    def port(self) -> int:
        return self.recipe.port

    @property
    def manifest_extra(self) -> dict[str, str]:
        return {"recipe": self.recipe.slug}

    @property
    def engine(self) -> str:
        """The engine profile's type: "vllm" or "llama.cpp" (SERVED_ENGINES)."""
        return self.recipe.engine_type

    @property
    def health_path(self) -> str:
        """Where the server answers 200 once it serves (vLLM: /v1/models; llama-server: /health, 503 while loading)."""
        return HEALTH_PATHS[self.engine]

    @property
    def metrics(self) -> bool:
        """Whether the server exports Prometheus metrics at /metrics: vLLM always; llama-server only when the
        recipe's command passes --metrics."""
        return self.engine == "vllm" or "--metrics" in command_args(self.compose)

    def files(self, s: Any, layout: HostLayout, gpu_count: int, host_data: bool = False) -> dict[str, str]:
        """Every file a rig gets: the serve dir's, the effective compose (for reading) and the units. RecipeError
        for a setting the recipe has no knob for (named as its host-data key when `host_data`; knob_env)."""
        r, compose, image = self.recipe, self.compose, s.image or self.image
        # the settings a slug takes through its compose knobs (None: the recipe's default); never the HF token (the
        # rig fetches the weights)
        knobs = {key: getattr(s, key) for key in (*KNOBS, *NO_KNOB)}
        env = knob_env(r, compose, knobs | {"model_dir": layout.models, "port": s.port or r.port}, host_data)
        if r.image_env in variables(compose):  # the engine's `image_env` sets the image, as upstream's launchers do
            env[r.image_env] = image
        pin = serving_env(r.tp, gpu_count)  # a rig with more cards than tp: vLLM runs on the first tp
        checkout = layout.src(GIT_NAME)  # the rig's pinned checkout of the recipe repo
        host = override(r, compose, env, image, layout, pin)
        effective = effective_compose(r, compose, env, host, checkout)
        wrapper = {
            "name": f"rigforge-{r.name}",
            "include": [{"path": [f"{checkout}/{r.compose_path}", OVERRIDE_FILE], "env_file": ".env"}],
        }
        # literal $ as $$: itself a valid compose file
        escaped = _walk({"name": wrapper["name"], **effective}, lambda t: t.replace("$", "$$"))
        lines = [f"# rigforge: host knobs of {r.slug} ({r.compose_path}); mode 0600, may hold secrets. Do not commit."]
        lines += [f"{k}={v}" for k, v in env.items()]
        note = f"# Rendered by rigforge for {r.slug}. Do not edit: change host data and re-run rigforge.\n"
        return {
            COMPOSE_FILE: note
            + "# Runs the recipe's own compose file from the pinned checkout, with this host's override.\n"
            + dump(wrapper),
            OVERRIDE_FILE: note
            + "# Host-specific only: the lock's image (unless .env sets the recipe's image_env), no restart policy\n"
            + "# (the unit owns restarts), caches; on a rig with more cards than the slug's tp, the cards it runs on.\n"
            + dump(host),
            ".env": "\n".join(lines) + "\n",
            EFFECTIVE_FILE: note
            + "# What the rig runs: the recipe's compose file resolved with the .env and the override,\n"
            "# as `docker compose config` shows it (host paths; $$ is a literal $).\n" + dump(escaped),
            **units(s, layout, gpu_count),
        }


def find(slug: str, lock: Any, opt_in: bool) -> LiveVariant:
    """A recipe-repo slug at the locked commit, its image and weights found in the lock (by ref, by repo id); else
    RecipeError / LockError naming the slug and what to do (refused, opt-in, missing lock entry)."""
    if (pin := lock.git.get(GIT_NAME)) is None:
        raise LockError(f"lock {lock.path}: no git.{GIT_NAME} entry (the recipe repo) to serve {slug} from")
    repo = load_repo(pin.commit, pin.content)
    recipe = repo.recipe(slug, opt_in=opt_in)
    if "@" not in recipe.image and lock.image_pin(recipe.image) is None:
        raise LockError(
            f"lock {lock.path}: no image entry for {recipe.image} ({slug}'s engine {recipe.engine}): add "
            f"images.{recipe.engine}: {{ref: {recipe.image}, digest: null}} and run `rigforge lock`"
        )
    names = {w: lock_entry(lock.hf, w) for w in recipe.weights}
    if w := next((w for w in recipe.weights if names[w] is None), None):
        raise LockError(
            f"lock {lock.path}: no hf entry for {w.hf_repo}{_files_note(w)} ({slug}): add hf.{weights_pin(w).name}: "
            f"{{repo: {w.hf_repo}, ref: main, revision: null{_include_yaml(w)}}} and run `rigforge lock`"
        )
    assets = [AssetDir(names[w], w.local_subdir, int((w.size_gb or 0) * 1e9)) for w in recipe.weights]
    return of(repo, recipe, lock.pinned(recipe.image), assets)


def lock_entry(hf: Any, w: Weights) -> str | None:
    """The name of the first lock hf entry (of the mapping `hf`) that pins the weights `w`: its repo, and exactly
    its `files` as the entry's `include` (none for weights that are the whole repo); None when there is none."""
    return next((n for n, p in hf.items() if p.repo == w.hf_repo and set(p.include) == set(w.files)), None)


def weights_pin(w: Weights) -> HfPin:
    """The unresolved lock entry the weights `w` need, `rigforge lock` resolves it; named by their dir, a '/' in it
    as '-' (the name is a file name on the rig: its staging dir, its token file), and by their id too when they are
    some files of their repo and the dir does not name them (two quants of one repo may share a dir)."""
    name = w.local_subdir.replace("/", "-")
    if w.files and w.id not in name:
        name = f"{name}-{w.id}"
    return HfPin(name=name, repo=w.hf_repo, revision=None, include=w.files)


def _files_note(w: Weights) -> str:
    """' (files a, b)' for weights that are some files of their repo, '' for a whole repo."""
    return f" (files {', '.join(w.files)})" if w.files else ""


def _include_yaml(w: Weights) -> str:
    """', include: [a, b]' as the lock entry `find` advises writes it, '' for a whole repo."""
    return f", include: [{', '.join(w.files)}]" if w.files else ""


def provisional(slug: str, lock: Any, opt_in: bool) -> Any:
    """`lock` plus an unresolved entry (named as `find` advises) for each image and weights repo `slug` needs and
    the lock lacks: what render, status and verify show for a slug not locked yet (a deploy refuses)."""
    if (pin := lock.git.get(GIT_NAME)) is None:
        return lock
    recipe = load_repo(pin.commit, pin.content).recipe(slug, opt_in=opt_in)
    images, hf = dict(lock.images), dict(lock.hf)
    if "@" not in recipe.image and lock.image_pin(recipe.image) is None:
        images[recipe.engine] = ImagePin(ref=recipe.image)
    for w in recipe.weights:
        if lock_entry(hf, w) is None:
            pin = weights_pin(w)
            hf[pin.name] = pin
    return lock if (images, hf) == (dict(lock.images), dict(lock.hf)) else replace(lock, images=images, hf=hf)


def command_args(compose: dict) -> list[str]:
    """The serving service's command as arguments, interpolated with the compose file's own defaults (rigforge
    sets none of the variables a server name or flag comes from): a list as written, or a string (llama.cpp
    recipes fold theirs, `command: >-`) split as compose splits it (shell words)."""
    services = compose.get("services") or {}
    service = next(iter(services.values()), {}) if services else {}
    command = interpolated({"command": service.get("command") or []}, {})["command"]
    if isinstance(command, str):
        return shlex.split(command)
    return [str(c) for c in command]


def served_model(compose: dict) -> str | None:
    """The model name the server lists (/v1/models): the value of the command's first --served-model-name (vLLM)
    or --alias / -a (llama-server); None when it names none (the slug is the name then)."""
    cmd = command_args(compose)
    for i, arg in enumerate(cmd[:-1]):
        if arg in ("--served-model-name", "--alias", "-a"):
            return cmd[i + 1]
    return None


def min_card_mib(compose_text: str) -> int:
    """The compose header's `# Requires-min-vram-gb: N` (what the recipe's preflight reads) in the seed's MiB terms
    (N x 1000); 24000 when the header has none."""
    m = _VRAM.search(compose_text)
    return int(float(m.group(1)) * 1000) if m else 24000


def of(repo: RecipeRepo, recipe: Recipe, image: str, assets: Sequence[AssetDir] = ()) -> LiveVariant:
    """`recipe` of `repo` as a variant running `image`; `assets`: where its weights land (lock name, dir, bytes)."""
    compose = repo.compose(recipe)
    return LiveVariant(
        recipe=recipe,
        compose=compose,
        image=image,
        asset_dirs=tuple(assets),
        served_model=served_model(compose) or recipe.slug,
        min_card_mib=min_card_mib((repo.root / recipe.compose_path).read_text()),
    )
