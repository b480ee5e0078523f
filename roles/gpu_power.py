"""GPU power: persistence mode on and a power cap per GPU, now and at every boot (rigforge-gpu-power.service,
then rigforge-gpu-settle.service sets back caps other writers change during the settle window: rigforge/boot.py).
"""

from pyinfra.api import deploy

from rigforge.fleet import Plan
from rigforge.knobs.gpu_power import DEFAULTS
from rigforge.knobs.serving import Serving
from rigforge.layout import SETTLE_SCRIPT
from roles.operations import nvidia, systemd_units


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
    units = {name: plan.files[name] for name in (layout.power_unit, layout.settle_unit)}
    script, unit = systemd_units.script_and_units(
        layout, SETTLE_SCRIPT, plan.files[SETTLE_SCRIPT], "the settle stage's script", units, enable=units
    )
    if Serving.of(plan.data).rigforge_manage_services:
        systemd_units.running(layout.power_unit)
        restart = (
            f"Restart {layout.settle_unit} (its caps or script changed)",
            lambda: unit.did_change() or script.did_change(),
        )
        systemd_units.running(layout.settle_unit, restarted=restart)
