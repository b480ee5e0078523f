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

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
COMPOSE_FILE = "docker-compose.yml"
ENV_FILE = ".env"
VLLM_UNIT = "rigforge-vllm@.service"
POWER_UNIT = "rigforge-gpu-power.service"
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
    api_key: str | None = field(default=None, repr=False)
    hf_token: str | None = field(default=None, repr=False)

    @property
    def models(self) -> str:
        return self.model_dir or f"{self.root}/models"


def _int(v: Any) -> int:
    if isinstance(v, bool) or not re.fullmatch(r"-?\d+", str(v).strip()):
        raise ValueError("an integer")
    return int(v)


def _port(v: Any) -> int:
    n = _int(v)
    if not 1 <= n <= 65535:
        raise ValueError("a port number 1..65535")
    return n


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


def _abs_path(v: Any) -> str:
    s = str(v)
    if not s.startswith("/") or "\n" in s:
        raise ValueError("an absolute path")
    return s.rstrip("/") or "/"


def _choice(*allowed: str):
    def check(v: Any) -> str:
        if str(v) not in allowed:
            raise ValueError(f"one of: {', '.join(allowed)}")
        return str(v)

    return check


def _args(v: Any) -> tuple[str, ...]:
    items = v if isinstance(v, list | tuple) else str(v).split()
    if not all(isinstance(x, str) and x for x in items):
        raise ValueError("a list of vLLM arguments such as ['--enable-log-requests']")
    return tuple(items)


def _secret(v: Any) -> str:
    s = str(v)
    if not s or "\n" in s:
        raise ValueError("a non-empty single-line string")
    return s


def _watts(v: Any) -> int:
    n = _int(v)
    if n <= 0:
        raise ValueError("a positive number of watts")
    return n


def _per_gpu_watts(v: Any) -> tuple[tuple[int, int], ...]:
    if isinstance(v, str):
        v = yaml.safe_load(v or "{}")
    if not isinstance(v, dict):
        raise ValueError("a mapping of GPU index to watts, e.g. {0: 230, 1: 250}")
    return tuple(sorted((_int(k), _watts(w)) for k, w in v.items()))


# name -> parser; the names are what `rigforge render --set NAME=VALUE` and `serving_NAME` host data use.
SETTINGS = {
    "port": _port,
    "bind_address": _ip,
    "model_dir": _abs_path,
    "gpu_memory_utilization": _fraction,
    "kv_cache_dtype": _choice(*KV_CACHE_DTYPES),
    "max_model_len": _int,
    "max_num_seqs": _int,
    "extra_args": _args,
    "image": _secret,
    "root": _abs_path,
    "power_limit_w": _watts,
    "power_limits": _per_gpu_watts,
    "api_key": _secret,
    "hf_token": _secret,
}


def apply_overrides(base: Settings, overrides: dict[str, Any], where: str = "") -> Settings:
    """Validate and apply overrides; raise SettingsError naming the key and the allowed values."""
    prefix = f"{where}: " if where else ""
    changes = {}
    for key, raw in overrides.items():
        if key not in SETTINGS:
            raise SettingsError(f"{prefix}unknown setting {key!r}; allowed: {', '.join(SETTINGS)}")
        try:
            changes[key] = SETTINGS[key](raw)
        except ValueError as exc:
            shown = "***" if key in ("api_key", "hf_token") else repr(raw)
            raise SettingsError(f"{prefix}setting {key!r} must be {exc}, got {shown}") from None
    return replace(base, **changes)


def parse_set(items: list[str]) -> dict[str, str]:
    """`KEY=VALUE` strings to a dict (values still raw)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SettingsError(f"--set {item!r}: expected KEY=VALUE; keys: {', '.join(SETTINGS)}")
        out[key.strip()] = value
    return out


def check_variant_settings(variant: Variant, s: Settings) -> None:
    """Settings that are valid alone but not for this variant."""
    if s.kv_cache_dtype and variant.uses_dflash:
        raise SettingsError(
            f"setting 'kv_cache_dtype' cannot be used with {variant.name}: DFlash forces FP16 KV "
            "(no fp8/TurboQuant path on Ampere); pick dual or dual-turbo for a 20 GB card"
        )


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
    return template.format(models=s.models, cache=f"{s.root}/cache", src=f"{s.root}/src")


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
    return _env().get_template(VLLM_UNIT + ".j2").render(serve_dir=f"{s.root}/serve", docker=docker)


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


def settings_from_host_data(data: Any) -> dict[str, Any]:
    """The `serving_*`, power and secret keys of pyinfra host data, as raw overrides for apply_overrides."""
    out = {}
    for key in SETTINGS:
        for name in (f"serving_{key}", key if key in ("hf_token",) else None):
            value = data.get(name) if name else None
            if value is not None:
                out[key] = value
    if data.get("rigforge_root"):
        out["root"] = data.get("rigforge_root")
    if data.get("gpu_power_limit_w") is not None:
        out["power_limit_w"] = data.get("gpu_power_limit_w")
    if data.get("gpu_power_limits"):
        out["power_limits"] = data.get("gpu_power_limits")
    return out
