"""GPU power: persistence mode on and a power cap per GPU, now and at every boot.

The cap (`gpu_power_limit_w`, per-GPU `gpu_power_limits` overrides) is applied now only to GPUs whose
current limit differs, and made permanent by rigforge-gpu-power.service (a oneshot whose text is rendered
by rigforge.render and passed in). A cap outside a card's min..max is refused with the card's range.
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import systemd

from roles.operations import nvidia, systemd_units
from roles.operations.staged import staged_files, systemd_verify

DEFAULTS = {
    "gpu_power_limit_w": 230,  # cap in watts for every GPU
    "gpu_power_limits": {},  # per-GPU overrides {index: watts}
}

UNIT_NAME = "rigforge-gpu-power.service"
UNIT_DIR = "/etc/systemd/system"


@deploy("GPU power caps", data_defaults=DEFAULTS)
def apply(unit_text: str):
    nvidia.persistence_mode(name="Turn on GPU persistence mode")
    nvidia.power_caps(
        name=f"Cap GPU power at {host.data.gpu_power_limit_w} W (overrides: {host.data.gpu_power_limits or 'none'})",
        default_w=host.data.gpu_power_limit_w,
        overrides=host.data.gpu_power_limits or {},
    )
    unit = staged_files(
        name=f"Install {UNIT_NAME} (validated by systemd-analyze verify)",
        dest=UNIT_DIR,
        files={UNIT_NAME: (unit_text, "644")},
        validate=systemd_verify(UNIT_NAME),
        keep_previous=False,
    )
    systemd.daemon_reload(name="Reload systemd units", _if=unit.did_change)
    systemd_units.enabled(name=f"Enable {UNIT_NAME} at boot", unit=UNIT_NAME)
    if host.data.get("rigforge_manage_services", True):
        systemd.service(name=f"Run {UNIT_NAME}", service=UNIT_NAME, running=True)
