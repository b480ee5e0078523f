from collections.abc import Mapping

from rigforge import schema

DEFAULTS = {
    "gpu_power_limit_w": 230,  # cap in watts for every GPU
    "gpu_power_limits": {},  # per-GPU overrides {index: watts}
    # after boot, how long (seconds) rigforge-gpu-settle.service keeps setting back caps another writer changed
    # (a unit, a script, a @reboot cron job running late); 0: only once, right after the boot finished
    "gpu_power_settle_window_s": schema.SETTLE_WINDOW_S,
    # hold the caps from then on: rigforge-gpu-hold.timer sets back a cap another writer changes at any time (a late
    # cron job, a user's `nvidia-smi -pl`) within 15 s, naming the writer in the journal and counting it in
    # rigforge_gpu_cap_setbacks_total; false: the timer is stopped and disabled (caps set at boot and by the deploy)
    "gpu_power_hold": True,
}


def validate(data: Mapping) -> list[str]:
    problems = schema.settings(data, {name: key for name, key in schema.HOST_KEYS.items() if key in DEFAULTS})
    return problems + (schema.boolean(data, "gpu_power_hold") if "gpu_power_hold" in data else [])
