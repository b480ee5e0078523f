from collections.abc import Mapping

from rigforge import schema

DEFAULTS = {
    "gpu_power_limit_w": 230,  # cap in watts for every GPU
    "gpu_power_limits": {},  # per-GPU overrides {index: watts}
    # after boot, how long (seconds) rigforge-gpu-settle.service keeps setting back caps another writer changed
    # (a unit, a script, a @reboot cron job running late); 0: only once, right after the boot finished
    "gpu_power_settle_window_s": schema.SETTLE_WINDOW_S,
}


def validate(data: Mapping) -> list[str]:
    return schema.settings(data, {name: key for name, key in schema.HOST_KEYS.items() if key in DEFAULTS})
