"""Settings layering and rendering of what a rig gets: docker-compose.yml, .env and the systemd units.

Layering (lowest first): the variant's catalog values < group data < host data (pyinfra merges the last two;
`settings_from_host_data` reads the merged `serving_*` keys) < explicit `--set` overrides.
Templates get an explicit, fully computed context and are rendered with StrictUndefined.
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from rigforge.catalog import Variant
from rigforge.layout import POWER_UNIT, VLLM_TEMPLATE, HostLayout

TEMPLATES = (Path(__file__).parent / "data" / "templates").resolve()  # package data: a link to templates/ in a checkout
COMPOSE_FILE = "docker-compose.yml"
ENV_FILE = ".env"
VLLM_UNIT = VLLM_TEMPLATE
RECIPE_ONLY = ("spec_n", "nvlink_mode")  # knobs of the recipe repo's compose files, no seed variant has them
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e5m2", "fp8_e4m3", "turboquant_3bit_nc")


class SettingsError(ValueError):
    """A setting has an unknown name or a value of the wrong type or range."""


@dataclass(frozen=True)
class Settings:
    """Everything a rig's rendered files depend on besides the variant. None = the variant's value."""

    root: str = "/opt/rigforge"
    port: int | None = None
    bind_address: str | None = None
    model_dir: str | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    extra_args: tuple[str, ...] = ()
    image: str | None = None
    power_limit_w: int = 230
    power_limits: tuple[tuple[int, int], ...] = ()
    spec_n: int | None = None  # recipe-repo slugs only: the recipe's SPEC_N (0 = drafter off, vllm#50021)
    nvlink_mode: str | None = None  # recipe-repo slugs only: the recipe's NVLINK_MODE
    api_key: str | None = field(default=None, repr=False)
    hf_token: str | None = field(default=None, repr=False)

    @property
    def models(self) -> str:
        return self.layout().models

    def layout(self, variant: str = "") -> HostLayout:
        """Every path and name on the rig for these settings (and `variant`'s serve dir and unit)."""
        return HostLayout(root=self.root, model_dir=self.model_dir, variant=variant)


def _int(v: Any) -> int:
    if isinstance(v, bool) or not re.fullmatch(r"-?\d+", str(v).strip()):
        raise ValueError("an integer")
    return int(v)


def _int_in(low: int, high: int, what: str = "an integer"):
    def check(v: Any) -> int:
        try:
            n = _int(v)
        except ValueError:
            n = None
        if n is None or not low <= n <= high:
            raise ValueError(f"{what} in {low}..{high}")
        return n

    return check


_port = _int_in(1, 65535, "a port number")


def _fraction(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError("a number in (0, 1]") from None
    if not 0 < f <= 1:
        raise ValueError("a number in (0, 1]")
    return f


def _ip(v: Any) -> str:
    try:
        return str(ipaddress.ip_address(str(v)))
    except ValueError:
        raise ValueError("an IP address such as 127.0.0.1 or 0.0.0.0") from None


SAFE_PATH = re.compile(r"^/[A-Za-z0-9._+@/-]*$")


def _abs_path(v: Any) -> str:
    """An absolute path that is safe in a shell command, a compose volume and a unit file."""
    s = str(v) if isinstance(v, str) else ""
    if not SAFE_PATH.fullmatch(s) or "/../" in f"{s}/" or "//" in s:
        raise ValueError(
            "an absolute path of letters, digits and . _ + @ - / (no spaces, quotes, ':' or shell characters)"
        )
    return s.rstrip("/") or "/"


def _choice(*allowed: str):
    def check(v: Any) -> str:
        if str(v) not in allowed:
            raise ValueError(f"one of: {', '.join(allowed)}")
        return str(v)

    return check


def _args(v: Any) -> tuple[str, ...]:
    items = v if isinstance(v, list | tuple) else str(v).split()
    if not all(isinstance(x, str) and x and "\n" not in x for x in items):
        raise ValueError("a list of vLLM arguments such as ['--enable-log-requests']")
    return tuple(items)


IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")


def _image(v: Any) -> str:
    s = str(v) if isinstance(v, str) else ""
    if not IMAGE.fullmatch(s) or len(s) > 512:
        raise ValueError("an image reference such as vllm/vllm-openai:TAG[@sha256:DIGEST] (no quotes or spaces)")
    return s


def _secret(v: Any) -> str:
    s = str(v) if isinstance(v, str | int) and not isinstance(v, bool) else ""
    if not re.fullmatch(r"[A-Za-z0-9._~+/=-]+", s):
        raise ValueError("a single word of letters, digits and . _ ~ + / = - (no spaces or quotes)")
    return s


WATTS = (100, 600)  # any card's power cap lies in here; the card's own min..max is checked once the driver answers
_watts = _int_in(*WATTS, "whole watts")
MAX_GPUS = 16


def _count(v: Any) -> int:
    n = _int(v)
    if n < 0:
        raise ValueError("a non-negative integer")
    return n


def _per_gpu_watts(v: Any) -> tuple[tuple[int, int], ...]:
    if isinstance(v, str):
        try:
            v = yaml.safe_load(v or "{}")
        except yaml.YAMLError:
            v = None
    if not isinstance(v, dict):
        raise ValueError("a mapping of GPU index to watts, e.g. {0: 230, 1: 250}")
    out = []
    for k, w in v.items():
        try:
            index, watts = _int_in(0, MAX_GPUS - 1)(k), _watts(w)
        except ValueError:
            raise ValueError(
                f"a mapping of GPU index (0..{MAX_GPUS - 1}) to whole watts in {WATTS[0]}..{WATTS[1]}, "
                "e.g. {0: 230, 1: 250}"
            ) from None
        out.append((index, watts))
    return tuple(sorted(out))


# name -> parser; the names are what `rigforge render --set NAME=VALUE` uses; host data uses HOST_KEYS[name].
SETTINGS = {
    "port": _port,
    "bind_address": _ip,
    "model_dir": _abs_path,
    "gpu_memory_utilization": _fraction,
    "kv_cache_dtype": _choice(*KV_CACHE_DTYPES),
    "max_model_len": _int_in(1, 1_048_576),
    "max_num_seqs": _int_in(1, 1024),
    "extra_args": _args,
    "spec_n": _count,
    "nvlink_mode": _choice("auto", "force_on", "force_off", "pcie_p2p"),
    "image": _image,
    "root": _abs_path,
    "power_limit_w": _watts,
    "power_limits": _per_gpu_watts,
    "api_key": _secret,
    "hf_token": _secret,
}
SECRETS = ("api_key", "hf_token")
# setting -> the host-data key it comes from
HOST_KEYS = {
    **{name: f"serving_{name}" for name in SETTINGS},
    "root": "rigforge_root",
    "power_limit_w": "gpu_power_limit_w",
    "power_limits": "gpu_power_limits",
    "hf_token": "hf_token",
}


def setting_problems(raw: dict[str, Any], host_data: bool = False) -> list[str]:
    """Every problem with raw setting values (empty when all are fine), naming the key as the user wrote it:
    the host-data key (`serving_port`) when `host_data`, else the setting (`setting 'port'`)."""
    problems = []
    for key, value in raw.items():
        name = HOST_KEYS.get(key, key) if host_data else f"setting {key!r}"
        if key not in SETTINGS:
            problems.append(f"unknown setting {key!r}; allowed: {', '.join(SETTINGS)}")
            continue
        try:
            SETTINGS[key](value)
        except ValueError as exc:
            shown = "***" if key in SECRETS else repr(value)
            problems.append(f"{name} must be {exc}, got {shown}")
    return problems


def apply_overrides(base: Settings, overrides: dict[str, Any], where: str = "") -> Settings:
    """Validate and apply overrides; raise SettingsError naming every bad key and the allowed values."""
    problems = setting_problems(overrides)
    if problems:
        prefix = f"{where}: " if where else ""
        raise SettingsError(prefix + "; ".join(problems))
    return replace(base, **{key: SETTINGS[key](raw) for key, raw in overrides.items()})


def parse_set(items: list[str]) -> dict[str, str]:
    """`KEY=VALUE` strings to a dict (values still raw)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SettingsError(f"--set {item!r}: expected KEY=VALUE; keys: {', '.join(SETTINGS)}")
        out[key.strip()] = value
    return out


def variant_setting_problems(variant: Variant, s: Settings, host_data: bool = False) -> list[str]:
    """Settings that are valid alone but not for this variant."""
    for key in RECIPE_ONLY:
        if getattr(s, key) is not None:
            name = HOST_KEYS[key] if host_data else f"setting {key!r}"
            return [f"{name} cannot be used with {variant.name}: only recipe-repo slugs (vllm/...) have it"]
    if s.kv_cache_dtype and variant.uses_dflash:
        key = HOST_KEYS["kv_cache_dtype"] if host_data else "setting 'kv_cache_dtype'"
        return [
            f"{key} cannot be used with {variant.name}: DFlash forces FP16 KV "
            "(no fp8/TurboQuant path on Ampere); pick dual or dual-turbo for a 20 GB card"
        ]
    return []


def check_variant_settings(variant: Variant, s: Settings) -> None:
    problems = variant_setting_problems(variant, s)
    if problems:
        raise SettingsError("; ".join(problems))


def vllm_args(variant: Variant, s: Settings) -> list[str]:
    """The variant's vLLM flags in compose order, with overrides replacing values in place."""
    replaced = {
        "--gpu-memory-utilization": s.gpu_memory_utilization,
        "--kv-cache-dtype": s.kv_cache_dtype,
        "--max-model-len": s.max_model_len,
        "--max-num-seqs": s.max_num_seqs,
    }
    out: list[str] = []
    seen = set()
    for item in variant.args:
        flag = item[0]
        seen.add(flag)
        value = replaced.get(flag)
        out.append(flag)
        if len(item) > 1:
            out.append(str(value) if value is not None else item[1])
    for flag, value in replaced.items():
        if value is not None and flag not in seen:
            out += [flag, str(value)]
    if s.api_key:
        out += ["--api-key", "${RIGFORGE_API_KEY}"]  # compose interpolates from the 0600 .env
    out += list(s.extra_args)
    return out


def _host_path(template: str, s: Settings) -> str:
    layout = s.layout()
    return template.format(models=layout.models, cache=layout.cache, src=layout.src_root)


def compose_context(variant: Variant, s: Settings) -> dict[str, Any]:
    port = s.port or variant.port
    published = f"{s.bind_address}:{port}" if s.bind_address else str(port)
    volumes = [f"{_host_path(m.host, s)}:{m.container}{':ro' if m.read_only else ''}" for m in variant.mounts]
    script = None
    if variant.entrypoint:
        # bash -c SCRIPT -- ARGS...: the args arrive as "$@". Compose interpolates $VAR in the file,
        # so the script's own shell variables are escaped as $$.
        script = "\n".join(["set -e", *variant.entrypoint]).replace("$", "$$")
    return {
        "variant": variant.name,
        "service": variant.service,
        "container_name": variant.container_name,
        "image": s.image or variant.image,
        "restart": variant.restart,
        "entrypoint_script": script,
        "command": vllm_args(variant, s),
        "ports": [f"{published}:{variant.container_port}"],
        "environment": list(variant.environment),
        "volumes": volumes,
        "shm_size": variant.shm_size,
        "ipc": variant.ipc,
        "gpu_reservation": dict(variant.gpu_reservation),
    }


def _env() -> Environment:
    env = Environment(
        loader=FileSystemLoader(str(TEMPLATES)),
        undefined=StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda v: json.dumps(v, ensure_ascii=False)  # JSON scalars are valid YAML
    return env


def env_file_text(s: Settings) -> str:
    lines = ["# rigforge: secrets for this variant's compose file (mode 0600). Do not commit."]
    lines.append(f"HF_TOKEN={s.hf_token or ''}")
    if s.api_key:
        lines.append(f"RIGFORGE_API_KEY={s.api_key}")
    return "\n".join(lines) + "\n"


def power_caps(gpu_count: int, s: Settings) -> dict[int, int]:
    caps = {i: s.power_limit_w for i in range(gpu_count)}
    caps.update(dict(s.power_limits))
    return caps


def render_power_unit(caps: dict[int, int], nvidia_smi: str = "/usr/bin/nvidia-smi") -> str:
    return _env().get_template(POWER_UNIT + ".j2").render(caps=sorted(caps.items()), nvidia_smi=nvidia_smi)


def render_vllm_unit(s: Settings, docker: str = "/usr/bin/docker") -> str:
    return _env().get_template(VLLM_UNIT + ".j2").render(serve_dir=s.layout().serve_root, docker=docker)


def render_variant(variant: Variant, s: Settings, gpu_count: int | None = None) -> dict[str, str]:
    """Every file a rig gets for this variant: {file name: text}."""
    check_variant_settings(variant, s)
    compose = _env().get_template(COMPOSE_FILE + ".j2").render(**compose_context(variant, s))
    return {
        COMPOSE_FILE: compose,
        ENV_FILE: env_file_text(s),
        VLLM_UNIT: render_vllm_unit(s),
        POWER_UNIT: render_power_unit(power_caps(gpu_count or variant.gpus, s)),
    }


def recipe_knobs(recipe, s: Settings) -> dict[str, Any]:
    """The settings a recipe-repo slug takes through its compose knobs (None = the recipe's default)."""
    keys = ("bind_address", "max_model_len", "kv_cache_dtype", "gpu_memory_utilization", "max_num_seqs")
    knobs = {key: getattr(s, key) for key in (*keys, "spec_n", "nvlink_mode", "extra_args", "api_key")}
    return {"hf_token": s.hf_token or "", "model_dir": s.models, "port": s.port or recipe.port, **knobs}


def render_recipe(recipe, compose: dict, s: Settings, image: str, gpu_count: int | None = None) -> dict[str, str]:
    """Every file a rig gets for a recipe-repo slug (plus the effective compose, for reading): {file name: text}."""
    from rigforge import recipes

    files = recipes.rig_files(recipe, compose, root=s.root, image=s.image or image, knobs=recipe_knobs(recipe, s))
    return {
        **files,
        VLLM_UNIT: render_vllm_unit(s),
        POWER_UNIT: render_power_unit(power_caps(gpu_count or recipe.gpus, s)),
    }


def settings_from_host_data(data: Any) -> dict[str, Any]:
    """The settings' host-data keys (HOST_KEYS: `serving_*`, rigforge_root, power, hf_token) that are set, as raw
    overrides for apply_overrides (keyed by setting name)."""
    out = {}
    for key, host_key in HOST_KEYS.items():
        value = data.get(host_key)
        if value is None or (key in SECRETS and value == ""):
            continue
        out[key] = value
    return out
