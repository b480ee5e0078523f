"""The seed adapter of the variant protocol (rigforge/model/fleet.py `ServedVariant`): the design document's five
variants, from rigforge/data/variants.yaml, validated (CatalogError names the variant and the key), and their files
(`seed_files`: the compose file and .env rendered from templates/, with render.py's units). No host here.
"""

from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from rigforge.layout import AssetDir, HostLayout
from rigforge.model.hardware import serving_env
from rigforge.model.render import COMPOSE_FILE, ENV_FILE, setting_name, template, units
from rigforge.model.schema import Settings, SettingsError

CATALOG_PATH = Path(__file__).parents[1] / "data" / "variants.yaml"
DEFAULTS = ("image", "container_port", "restart", "shm_size", "ipc")  # and gpu_reservation: every variant's
DERIVED = ("served_model", "uses_dflash")  # worked out from its args
MOUNT_ROOTS = ("{models}", "{cache}", "{src}")
RECIPE_ONLY = ("spec_n", "nvlink_mode")  # knobs of the recipe repo's compose files, no seed variant has them
# variant keys checked for their type alone (in this order)
ASSET_KEYS = dict(dir=str, approx_gb=(int, float), hf_repo=str)
SCALARS = dict(summary=str, pick_when=str, service=str, container_name=str, min_card_mib=int, fits_20gb_cards=bool)


class CatalogError(ValueError):
    """The catalog file, or a lookup in it, is invalid."""


@dataclass(frozen=True)
class Asset:
    name: str
    dir: str
    approx_gb: float
    hf_repo: str


@dataclass(frozen=True)
class Variant:
    name: str
    summary: str
    pick_when: str
    port: int
    service: str
    container_name: str
    gpus: int
    min_card_mib: int
    fits_20gb_cards: bool
    assets: tuple[str, ...]
    sources: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    mounts: tuple[tuple[str, str], ...]  # (host with a {models}/{cache}/{src} root, container[:ro])
    args: tuple[tuple[str, ...], ...]  # (flag,) or (flag, value), compose order
    entrypoint: tuple[str, ...] | None
    measured: tuple[tuple[str, Any], ...]
    image: str
    container_port: int
    restart: str
    shm_size: str
    ipc: str
    gpu_reservation: tuple[tuple[str, Any], ...]
    asset_dirs: tuple[AssetDir, ...] = ()  # where each of `assets` lands, and its size until the lock knows
    successor: str | None = None  # the recipe repo's live slug that took its place (its image may be purged)
    served_model: str = ""  # what /v1/models lists: --served-model-name, else the variant's name
    uses_dflash: bool = False  # a DFlash draft in --speculative-config
    manifest_extra = MappingProxyType({})  # what rig.json records besides the plan's pins: nothing for a seed

    def files(self, s: Settings, layout: HostLayout, gpu_count: int, host_data: bool = False) -> dict[str, str]:
        """The variant protocol's files, {name: text}: `seed_files`."""
        return seed_files(self, s, layout, gpu_count, host_data)

    @property
    def figures(self) -> dict[str, Any]:
        """The design document's measured figures, as a dict (\"narr_tps\": \"~145\", ...)."""
        return dict(self.measured)

    def arg(self, flag: str) -> str | None:
        """Value of a vLLM flag (None if absent or bare)."""
        return next((a[1] if len(a) > 1 else None for a in self.args if a[0] == flag), None)


@dataclass(frozen=True)
class Catalog:
    variants: dict[str, Variant]
    assets: dict[str, Asset]


def _need(d: dict, key: str, kind: type | tuple, where: str) -> Any:
    """`d[key]`, which must be of `kind` (a bool is no int); CatalogError naming `where` otherwise."""
    if key not in d:
        raise CatalogError(f"{where}: missing key {key!r}")
    value = d[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise CatalogError(f"{where}: {key!r} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _variant(name: str, raw: dict, defaults: dict, assets: dict[str, Asset]) -> Variant:
    where = f"variant {name!r}"

    def check(ok: Any, problem: str) -> None:
        if not ok:
            raise CatalogError(f"{where}: {problem}")

    check(isinstance(raw, dict), "must be a mapping")
    # a variant sets every field of Variant but its name and what the catalog's defaults and assets give it
    known = {f.name for f in fields(Variant)} - {"name", "asset_dirs", "gpu_reservation", *DEFAULTS, *DERIVED}
    check(not (unknown := set(raw) - known), f"unknown keys {sorted(unknown)}; allowed: {sorted(known)}")
    port = _need(raw, "port", int, where)
    check(1 <= port <= 65535, f"port {port} out of range 1..65535")
    gpus = _need(raw, "gpus", int, where)
    check(gpus >= 1, "gpus must be >= 1")
    for a in _need(raw, "assets", list, where):
        check(a in assets, f"unknown asset {a!r}; known: {', '.join(assets)}")
    env = _need(raw, "environment", dict, where)
    for k, v in env.items():
        check(isinstance(v, str), f"environment {k} must be a string, got {v!r}")
    mounts = []
    for m in _need(raw, "mounts", list, where):
        ok = isinstance(m, dict) and {"host", "container"} <= set(m)
        check(ok, f"each mount needs host and container, got {m!r}")
        check(m["host"].startswith(MOUNT_ROOTS), f"mount host {m['host']!r} must start with one of {MOUNT_ROOTS}")
        mounts.append((m["host"], m["container"] + (":ro" if m.get("read_only") else "")))
    args = []
    for a in _need(raw, "args", list, where):
        ok = isinstance(a, list) and 1 <= len(a) <= 2 and all(isinstance(x, str) for x in a)
        check(ok, f"each arg is [flag] or [flag, value] of strings, got {a!r}")
        check(a[0].startswith("--"), f"arg {a[0]!r} is not a --flag")
        args.append(tuple(a))
    flags = dict(a for a in args if len(a) == 2)
    check(flags.get("--tensor-parallel-size") == str(gpus), f"--tensor-parallel-size must equal gpus ({gpus})")
    successor = raw.get("successor")
    check(isinstance(raw.get("successor", ""), str), f"successor must be a recipe slug (a string), got {successor!r}")
    entrypoint = raw.get("entrypoint")
    check(entrypoint is None or all(isinstance(s, str) for s in entrypoint), "entrypoint must be a list of shell lines")
    return Variant(
        name=name,
        served_model=flags.get("--served-model-name") or name,
        uses_dflash='"dflash"' in flags.get("--speculative-config", ""),
        **{key: _need(raw, key, kind, where) for key, kind in SCALARS.items()},
        port=port,
        gpus=gpus,
        assets=tuple(raw["assets"]),
        sources=tuple(_need(raw, "sources", list, where)),
        environment=tuple(env.items()),
        mounts=tuple(mounts),
        args=tuple(args),
        entrypoint=tuple(entrypoint) if entrypoint else None,
        measured=tuple(_need(raw, "measured", dict, where).items()),
        **{key: defaults[key] for key in DEFAULTS},
        gpu_reservation=tuple(defaults["gpu_reservation"].items()),
        asset_dirs=tuple(AssetDir(a, assets[a].dir, int(assets[a].approx_gb * 1e9)) for a in raw["assets"]),
        successor=successor,
    )


def parse_catalog(data: Any) -> Catalog:
    """The Catalog of the catalog file's loaded YAML `data`; CatalogError naming what is missing or mistyped."""
    if not isinstance(data, dict):
        raise CatalogError("catalog: top level must be a mapping")
    if data.get("version") != 1:
        raise CatalogError(f"catalog: unsupported version {data.get('version')!r} (expected 1)")
    defaults = _need(data, "defaults", dict, "catalog")
    for key in (*DEFAULTS, "gpu_reservation"):
        _need(defaults, key, object, "catalog defaults")
    assets = {
        name: Asset(name, *(_need(a, key, kind, f"asset {name!r}") for key, kind in ASSET_KEYS.items()))
        for name, a in _need(data, "assets", dict, "catalog").items()
    }
    variants = {
        name: _variant(name, raw, defaults, assets) for name, raw in _need(data, "variants", dict, "catalog").items()
    }
    if not variants:
        raise CatalogError("catalog: no variants")
    return Catalog(variants=variants, assets=assets)


@cache
def load_catalog(path: Path | str = CATALOG_PATH) -> Catalog:
    """The catalog file at `path` (`parse_catalog`); CatalogError when unreadable or not YAML."""
    try:
        data = yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, yaml.YAMLError) as exc:
        raise CatalogError(f"catalog {path}: {exc}") from exc
    return parse_catalog(data)


# --- the seed variant's files -----------------------------------------------------------------------------


def vllm_args(variant: Variant, s: Settings) -> list[str]:
    """The variant's vLLM flags in compose order, with overrides replacing values in place."""
    overrides = ("gpu_memory_utilization", "kv_cache_dtype", "max_model_len", "max_num_seqs")  # each a vLLM flag
    replaced = {"--" + name.replace("_", "-"): getattr(s, name) for name in overrides}
    out: list[str] = []
    for flag, *value in variant.args:  # a bare flag has no value to replace
        new = replaced.pop(flag, None)
        out += [flag, *([str(new)] if new is not None and value else value[:1])]
    for flag, value in replaced.items():  # the overrides the variant does not set
        out += [flag, str(value)] if value is not None else []
    if s.api_key:
        out += ["--api-key", "${RIGFORGE_API_KEY}"]  # compose interpolates from the 0600 .env
    return out + list(s.extra_args)


def compose_context(variant: Variant, s: Settings, layout: HostLayout, gpu_count: int) -> dict[str, Any]:
    """The compose template's context, each value worked out here (the template only places them): the variant `v`
    for the fields it takes as they are, the image (the settings' or the variant's), the entrypoint script, the vLLM
    args, the published port, the environment, the mounts under the rig's roots and the GPU reservation."""
    port = s.port or variant.port
    published = f"{s.bind_address}:{port}" if s.bind_address else str(port)
    roots = dict(models=layout.models, cache=layout.cache, src=layout.src_root)  # a mount's host path starts with one
    # bash -c SCRIPT -- ARGS...: the args arrive as "$@". Compose interpolates $VAR in the file,
    # so the script's own shell variables are escaped as $$.
    script = "\n".join(["set -e", *variant.entrypoint]).replace("$", "$$") if variant.entrypoint else None
    return dict(
        v=variant,  # name, service, container_name, restart, shm_size, ipc as they are
        # its environment, then the cards it serves on when the rig has more (hardware.serving_env)
        environment=[*variant.environment, *serving_env(variant.gpus, gpu_count).items()],
        image=s.image or variant.image,
        entrypoint_script=script,
        command=vllm_args(variant, s),
        ports=[f"{published}:{variant.container_port}"],
        volumes=[f"{host.format(**roots)}:{container}" for host, container in variant.mounts],
        gpu_reservation=dict(variant.gpu_reservation),
    )


def env_file_text(s: Settings) -> str:
    """The compose file's secrets (mode 0600): the API key, if any. Never the HF token: the weights are on the rig
    before vLLM starts, so the container has no use for it (only the weights download has it)."""
    key = f"RIGFORGE_API_KEY={s.api_key}\n" if s.api_key else ""
    return "# rigforge: secrets for this variant's compose file (mode 0600). Do not commit.\n" + key


def seed_files(
    variant: Variant, s: Settings, layout: HostLayout, gpu_count: int, host_data: bool = False
) -> dict[str, str]:
    """Every file a rig gets for a catalog variant (`Variant.files`), {name: text}. SettingsError for a setting
    valid alone but not for this variant (named as its host-data key when `host_data`)."""
    why = dict.fromkeys(RECIPE_ONLY, "only recipe-repo slugs (vllm/...) have it")
    if variant.uses_dflash:
        why["kv_cache_dtype"] = (
            "DFlash forces FP16 KV (no fp8/TurboQuant path on Ampere); pick dual or dual-turbo for a 20 GB card"
        )
    for name, reason in why.items():
        if getattr(s, name) is not None:
            raise SettingsError(f"{setting_name(name, host_data)} cannot be used with {variant.name}: {reason}")
    compose = template(COMPOSE_FILE + ".j2").render(**compose_context(variant, s, layout, gpu_count))
    return {COMPOSE_FILE: compose, ENV_FILE: env_file_text(s), **units(s, layout, gpu_count)}
