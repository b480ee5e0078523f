"""GPU power: persistence mode on and a power cap per GPU, now and at every boot (rigforge-gpu-power.service,
then rigforge-gpu-settle.service sets back caps other writers change during the settle window:
rigforge/observe/boot.py), and held from then on (rigforge-gpu-hold.timer, host data gpu_power_hold).
"""

from pyinfra.api import deploy

from rigforge.layout import HOLD_SCRIPT, SETTLE_SCRIPT
from rigforge.model.fleet import Plan
from roles.operations import nvidia, systemd_units


@deploy("GPU power caps")
def apply(plan: Plan) -> None:
    settings, layout = plan.settings, plan.layout
    overrides = dict(settings.power_limits)
    nvidia.persistence_mode(name="Turn on GPU persistence mode")
    nvidia.power_caps(
        name=f"Cap GPU power at {settings.power_limit_w} W (overrides: {overrides or 'none'})",
        default_w=settings.power_limit_w,
        overrides=overrides,
    )
    hold = plan.gpu_power_hold
    held = {name: plan.files[name] for name in (layout.hold_unit, layout.hold_timer)}
    systemd_units.script_and_units(
        layout,
        HOLD_SCRIPT,
        plan.files[HOLD_SCRIPT],
        "the cap hold's pass",
        held,
        enable=[layout.hold_timer] if hold else [],
    )
    units = {name: plan.files[name] for name in (layout.power_unit, layout.settle_unit)}
    script, unit = systemd_units.script_and_units(
        layout, SETTLE_SCRIPT, plan.files[SETTLE_SCRIPT], "the settle stage's script", units, enable=units
    )
    if not hold:
        systemd_units.disabled(
            name=f"Stop and disable {layout.hold_timer} (gpu_power_hold: false)", unit=layout.hold_timer
        )
    if plan.knobs.serving.rigforge_manage_services:
        systemd_units.running(layout.power_unit)
        restart = (
            f"Restart {layout.settle_unit} (its caps or script changed)",
            lambda: unit.did_change() or script.did_change(),
        )
        systemd_units.running(layout.settle_unit, restarted=restart)
        if hold:
            systemd_units.running(layout.hold_timer)
