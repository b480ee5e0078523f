from collections.abc import Mapping
from dataclasses import dataclass

from rigforge.model import schema
from rigforge.model.knobs import Knobs, defaults_of, knob


@dataclass(frozen=True)
class GpuPower(Knobs):
    """The GPUs' power caps: set by the deploy, at boot, held after it (roles/gpu_power.py)."""

    gpu_power_limit_w: int = 230  # cap in watts for every GPU
    gpu_power_limits: dict[int, int] = knob({})  # per-GPU overrides {index: watts}
    # after boot, how long (seconds) rigforge-gpu-settle.service keeps setting back caps another writer changed
    # (a unit, a script, a @reboot cron job running late); 0: only once, right after the boot finished
    gpu_power_settle_window_s: int = schema.SETTLE_WINDOW_S
    # hold the caps from then on: rigforge-gpu-hold.timer sets back a cap another writer changes at any time (a late
    # cron job, a user's `nvidia-smi -pl`) within 15 s, naming the writer in the journal and counting it in
    # rigforge_gpu_cap_setbacks_total; false: the timer is stopped and disabled (caps set at boot and by the deploy)
    gpu_power_hold: bool = True
    # watts the rig's power supply can give its GPUs (the supply's rating less the rest of the system); the deploy
    # warns when the caps of every card add up to more (rigforge/model/power.py psu_warning). null: no check
    gpu_psu_watts: int | None = None


DEFAULTS = defaults_of(GpuPower)
PSU_WATTS = (100, 20000)  # what gpu_psu_watts may say


def validate(data: Mapping) -> list[str]:
    """Problems of the GPU power role's host-data keys (caps, settle window, hold, power supply)."""
    problems = schema.settings(data, {name: key for name, key in schema.HOST_KEYS.items() if key in DEFAULTS})
    problems += schema.boolean(data, "gpu_power_hold") if "gpu_power_hold" in data else []
    if data.get("gpu_psu_watts") is not None:
        problems += schema.integer(data, "gpu_psu_watts", *PSU_WATTS, " of watts")
    return problems
