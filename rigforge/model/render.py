"""Rendering: templates/ parsed once (`template`), and the files every variant gets whatever its adapter: the systemd
units (vLLM, power, settle, cap hold) and the GPU metrics collector. The adapters (catalog.py, recipes.py) render
their compose files with these; this module imports neither.

Templates get an explicit, fully computed context and are rendered with StrictUndefined.
"""

import json
from collections.abc import Sequence
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined, Template

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
from rigforge.model.schema import HOST_KEYS, Settings, power_caps

TEMPLATES = (
    Path(__file__).parents[1] / "data" / "templates"
).resolve()  # package data: a link to templates/ in a checkout
COMPOSE_FILE = "docker-compose.yml"
ENV_FILE = ".env"
VLLM_UNIT = VLLM_TEMPLATE
NVIDIA_SMI = "/usr/bin/nvidia-smi"


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


def _label_value(value: str) -> str:
    """A Prometheus label value as the text format quotes it (backslash, double quote, newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_gpu_metrics(
    caps: dict[int, int], variant: str, image: str, rest: str | None = None, layout: HostLayout | None = None
) -> str:
    """The GPU textfile collector (installed at `HostLayout.gpu_metrics_script`): the declared caps, variant, image
    and rest state are rendered in; nvidia-smi, sysfs and the kernel log are read at every run (docs/monitoring.md).
    `layout`: where its cap set-backs file is (the default layout's when None)."""
    return template(GPU_METRICS_SCRIPT + ".j2").render(
        caps=sorted(caps.items()),
        variant=_label_value(variant),
        image=_label_value(image),
        rest=_label_value(rest or ""),
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
