"""GPU power: persistence mode on and a power cap per GPU, now and at every boot (rigforge-gpu-power.service,
then rigforge-gpu-settle.service sets back caps other writers change during the settle window: rigforge/boot.py).
"""

from pyinfra.api import deploy
from pyinfra.operations import systemd

from rigforge.fleet import Plan
from rigforge.knobs.gpu_power import DEFAULTS
from rigforge.knobs.serving import Serving
from rigforge.layout import SETTLE_SCRIPT
from roles.operations import nvidia, systemd_units
from roles.operations.staged import staged_files, systemd_verify


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
    script = staged_files(
        name=f"Install {layout.settle_script} (the settle stage's script)",
        dest=layout.libexec,
        files={SETTLE_SCRIPT: (plan.files[SETTLE_SCRIPT], "755")},
        validate=f"sh -n {SETTLE_SCRIPT}",
        keep_previous=False,
    )
    units = (layout.power_unit, layout.settle_unit)
    unit = staged_files(
        name=f"Install {' and '.join(units)} (validated by systemd-analyze verify)",
        dest=layout.unit_dir,
        files={name: (plan.files[name], "644") for name in units},
        validate=" && ".join(f"( {systemd_verify(name)} )" for name in units),
        keep_previous=False,
    )
    systemd.daemon_reload(name="Reload systemd units", _if=unit.did_change)
    for name in units:
        systemd_units.enabled(name=f"Enable {name} at boot", unit=name)
    if Serving.of(plan.data).rigforge_manage_services:
        systemd.service(name=f"Run {layout.power_unit}", service=layout.power_unit, running=True)
        systemd.service(name=f"Run {layout.settle_unit}", service=layout.settle_unit, running=True)
        systemd.service(
            name=f"Restart {layout.settle_unit} (its caps or script changed)",
            service=layout.settle_unit,
            restarted=True,
            _if=lambda: unit.did_change() or script.did_change(),
        )
