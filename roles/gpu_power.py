"""GPU power: persistence mode on and a power cap per GPU, now and at every boot.

The cap (`gpu_power_limit_w`, per-GPU `gpu_power_limits` overrides) is applied now only to GPUs whose
current limit differs, and made permanent by rigforge-gpu-power.service, a oneshot rendered from the plan's
caps, which cover every GPU the rig has. Values outside 100..600 W are refused with the other host-data
problems before anything changes; a cap outside a card's own min..max is refused as soon as the driver
answers (preflight on a rig that has one, the GPU check right after the driver role on a fresh rig).
"""

from __future__ import annotations

from collections.abc import Mapping

from pyinfra.api import deploy
from pyinfra.operations import systemd

from rigforge import schema
from rigforge.plan import Plan
from rigforge.render import POWER_UNIT
from roles.operations import nvidia, systemd_units
from roles.operations.staged import staged_files, systemd_verify

DEFAULTS = {
    "gpu_power_limit_w": 230,  # cap in watts for every GPU
    "gpu_power_limits": {},  # per-GPU overrides {index: watts}
}


def validate(data: Mapping) -> list[str]:
    return schema.settings(data, {"power_limit_w": "gpu_power_limit_w", "power_limits": "gpu_power_limits"})


@deploy("GPU power caps", data_defaults=DEFAULTS)
def apply(plan: Plan):
    settings, layout = plan.settings, plan.layout
    overrides = dict(settings.power_limits)
    nvidia.persistence_mode(name="Turn on GPU persistence mode")
    nvidia.power_caps(
        name=f"Cap GPU power at {settings.power_limit_w} W (overrides: {overrides or 'none'})",
        default_w=settings.power_limit_w,
        overrides=overrides,
    )
    unit = staged_files(
        name=f"Install {layout.power_unit} (validated by systemd-analyze verify)",
        dest=layout.unit_dir,
        files={layout.power_unit: (plan.files[POWER_UNIT], "644")},
        validate=systemd_verify(layout.power_unit),
        keep_previous=False,
    )
    systemd.daemon_reload(name="Reload systemd units", _if=unit.did_change)
    systemd_units.enabled(name=f"Enable {layout.power_unit} at boot", unit=layout.power_unit)
    if plan.data["rigforge_manage_services"]:
        systemd.service(name=f"Run {layout.power_unit}", service=layout.power_unit, running=True)
