"""Rendering: a variant and its settings to the files a rig gets (compose file, .env, the systemd units)."""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from jinja2 import Environment, FileSystemLoader, StrictUndefined, Template

from rigforge.hardware import serving_env
from rigforge.layout import (
    CRON_FILES,
    GPU_METRICS_FILE,
    GPU_METRICS_INTERVAL_S,
    GPU_METRICS_SCRIPT,
    GPU_METRICS_TIMER,
    GPU_METRICS_UNIT,
    HOLD_INTERVAL_S,
    HOLD_SCRIPT,
    HOLD_TIMER,
    HOLD_UNIT,
    POWER_UNIT,
    SETTLE_SCRIPT,
    SETTLE_UNIT,
    TEXTFILE_DIR,
    UDEV_RULES_DIRS,
    UNIT_SEARCH_PATH,
    VLLM_TEMPLATE,
    HostLayout,
)
from rigforge.schema import HOST_KEYS, Settings, SettingsError, power_caps

if TYPE_CHECKING:  # rigforge.catalog imports this module
    from rigforge.catalog import Variant

TEMPLATES = (Path(__file__).parent / "data" / "templates").resolve()  # package data: a link to templates/ in a checkout
COMPOSE_FILE = "docker-compose.yml"
ENV_FILE = ".env"
VLLM_UNIT = VLLM_TEMPLATE
NVIDIA_SMI = "/usr/bin/nvidia-smi"
RECIPE_ONLY = ("spec_n", "nvlink_mode")  # knobs of the recipe repo's compose files, no seed variant has them


def vllm_args(variant: "Variant", s: Settings) -> list[str]:
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


_ENV = Environment(loader=FileSystemLoader(str(TEMPLATES)), undefined=StrictUndefined, keep_trailing_newline=True)
_ENV.filters["q"] = lambda v: json.dumps(v, ensure_ascii=False)  # JSON scalars are valid YAML


def template(name: str) -> Template:
    """A template of templates/, parsed once per process."""
    return _ENV.get_template(name)


def render_power_unit(caps: dict[int, int], nvidia_smi: str = NVIDIA_SMI) -> str:
    """The power unit for `caps`: early at boot, after no other cap writer (it can never close an ordering cycle)."""
    return template(POWER_UNIT + ".j2").render(caps=sorted(caps.items()), nvidia_smi=nvidia_smi)


def settle_files(
    caps: dict[int, int], window_s: int, layout: HostLayout, nvidia_smi: str = NVIDIA_SMI
) -> dict[str, str]:
    """The settle stage's unit and script: after boot, sets back caps others changed, then watches `window_s` s."""
    context = dict(
        caps=sorted(caps.items()),
        window=int(window_s),
        script=layout.settle_script,
        hold=layout.hold_script,
        state=layout.cap_setbacks,
        nvidia_smi=nvidia_smi,
    )
    return {
        SETTLE_UNIT: template(SETTLE_UNIT + ".j2").render(**context),
        SETTLE_SCRIPT: template(SETTLE_SCRIPT + ".j2").render(),
    }


def hold_script(
    unit_dirs: Sequence[str] = UNIT_SEARCH_PATH,
    cron_files: Sequence[str] = CRON_FILES,
    udev_dirs: Sequence[str] = UDEV_RULES_DIRS,
) -> str:
    """One pass of the cap hold, looking for the writers it names in these places (the rig's own by default)."""
    context = dict(unit_dirs=unit_dirs, cron_files=cron_files, udev_dirs=udev_dirs, interval_s=HOLD_INTERVAL_S)
    return template(HOLD_SCRIPT + ".j2").render(**context)


def hold_files(caps: dict[int, int], layout: HostLayout, nvidia_smi: str = NVIDIA_SMI) -> dict[str, str]:
    """The cap hold: its one-pass script (the settle stage runs it too), the unit that runs it and its timer."""
    context = dict(
        caps=sorted(caps.items()),
        script=layout.hold_script,
        state=layout.cap_setbacks,
        nvidia_smi=nvidia_smi,
        interval_s=HOLD_INTERVAL_S,
    )
    units = {name: template(name + ".j2").render(**context) for name in (HOLD_UNIT, HOLD_TIMER)}
    return {HOLD_SCRIPT: hold_script()} | units


def render_gpu_metrics(
    caps: dict[int, int], variant: str, image: str, rest: str | None = None, layout: HostLayout | None = None
) -> str:
    """The GPU textfile collector (`HostLayout.gpu_metrics_script`, docs/monitoring.md), these labels rendered in."""
    labels = dict(variant=variant, image=image, rest=rest or "")  # quoted as Prometheus's text format quotes them
    return template(GPU_METRICS_SCRIPT + ".j2").render(
        caps=sorted(caps.items()),
        **{k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()},
        nvidia_smi=NVIDIA_SMI,
        textfile_dir=TEXTFILE_DIR,
        prom_file=GPU_METRICS_FILE,
        setbacks=(layout or HostLayout()).cap_setbacks,
        timeout_s=30,
    )


def gpu_metrics_units(layout: HostLayout, nvidia_smi: str = NVIDIA_SMI) -> dict[str, str]:
    """The oneshot unit that runs the GPU collector and its timer (every GPU_METRICS_INTERVAL_S seconds)."""
    context = dict(
        script=layout.gpu_metrics_script,
        nvidia_smi=nvidia_smi,
        textfile_dir=layout.textfile_dir,
        prom_file=GPU_METRICS_FILE,
        interval_s=GPU_METRICS_INTERVAL_S,
    )
    return {name: template(name + ".j2").render(**context) for name in (GPU_METRICS_UNIT, GPU_METRICS_TIMER)}


def units(s: Settings, layout: HostLayout, gpu_count: int) -> dict[str, str]:
    """The units every variant gets: the vLLM template unit, the power unit for `gpu_count` GPUs, the settle stage
    and the cap hold (rendered whatever gpu_power_hold says: the knob enables or disables its timer)."""
    caps = power_caps(gpu_count, s)
    vllm = template(VLLM_UNIT + ".j2").render(serve_dir=layout.serve_root, docker="/usr/bin/docker")
    files = {VLLM_UNIT: vllm, POWER_UNIT: render_power_unit(caps)} | settle_files(caps, s.settle_window_s, layout)
    return files | hold_files(caps, layout)


def setting_name(name: str, host_data: bool) -> str:
    """How a refusal names a setting: by its host-data key when it came from host data."""
    return HOST_KEYS[name] if host_data else f"setting {name!r}"


def seed_files(
    variant: "Variant", s: Settings, layout: HostLayout, gpu_count: int, host_data: bool = False
) -> dict[str, str]:
    """`Variant.files`, {name: text}. SettingsError names a setting it cannot take (host-data key if `host_data`)."""
    why = dict.fromkeys(RECIPE_ONLY, "only recipe-repo slugs (vllm/...) have it")
    if variant.uses_dflash:
        why["kv_cache_dtype"] = (
            "DFlash forces FP16 KV (no fp8/TurboQuant path on Ampere); pick dual or dual-turbo for a 20 GB card"
        )
    for name, reason in why.items():
        if getattr(s, name) is not None:
            raise SettingsError(f"{setting_name(name, host_data)} cannot be used with {variant.name}: {reason}")
    port = s.port or variant.port
    published = f"{s.bind_address}:{port}" if s.bind_address else str(port)
    roots = dict(models=layout.models, cache=layout.cache, src=layout.src_root)  # a mount's host path starts with one
    # bash -c SCRIPT -- ARGS...: the args arrive as "$@". Compose interpolates $VAR in the file,
    # so the script's own shell variables are escaped as $$.
    script = "\n".join(["set -e", *variant.entrypoint]).replace("$", "$$") if variant.entrypoint else None
    compose = template(COMPOSE_FILE + ".j2").render(
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
    # the .env: the API key, if any; never the HF token (the weights are on the rig before vLLM starts)
    key = f"RIGFORGE_API_KEY={s.api_key}\n" if s.api_key else ""
    env = "# rigforge: secrets for this variant's compose file (mode 0600). Do not commit.\n" + key
    return {COMPOSE_FILE: compose, ENV_FILE: env, **units(s, layout, gpu_count)}
