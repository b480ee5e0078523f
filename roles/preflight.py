"""Preflight: runs first, changes nothing, and stops a host that cannot run its variant.

Checked: supported OS (Ubuntu 22.04/24.04, Debian 12/13); with GPUs visible: GPU count, VRAM per card
(20 GB cards are told to use the override; DFlash variants are refused there), requested power caps
within every card's min..max; free disk at the model dir; the role switches (docker_source,
nvidia_driver_flavor). All problems come out as one message naming the host, the key and what to do.
With `pyinfra --dry` the message is printed as a warning and nothing fails.
"""

from __future__ import annotations

from collections.abc import Mapping

from pyinfra.api import deploy

from roles import docker_engine, gpu_power, host_state, nvidia_driver
from roles.operations import checks

DEFAULTS: dict = {}  # preflight has no knobs of its own; it checks the other roles' keys (defaults below)

CHECKED_KEYS = {
    **nvidia_driver.DEFAULTS,  # every driver / container-runtime key: roles/host_state.py
    **docker_engine.DEFAULTS,
    **{key: gpu_power.DEFAULTS[key] for key in ("gpu_power_limit_w", "gpu_power_limits")},
    "docker_source": docker_engine.DEFAULTS["docker_source"],
    "nvidia_driver_flavor": nvidia_driver.DEFAULTS["nvidia_driver_flavor"],
    "nvidia_allow_reboot": nvidia_driver.DEFAULTS["nvidia_allow_reboot"],
    "serving_kv_cache_dtype": None,
    "serving_gpu_memory_utilization": None,
}


@deploy("Preflight", data_defaults=DEFAULTS)
def check(needs: checks.Needs, data: Mapping):
    """`needs`: what the variant needs of the host; `data`: the plan's validated host data (roles/site.py)."""
    checks.host_checks(
        name=f"Preflight: can this host run {needs.variant}?",
        needs=needs,
        data={key: data.get(key, default) for key, default in CHECKED_KEYS.items()},
        host_problems=host_state.problems,
    )
