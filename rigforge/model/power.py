"""Power caps against what the recipe repo (club-3090) measured: its hardware profile (PROFILE) and the range its
docs/HARDWARE.md gives in prose (MEASURED_W; tests/test_power.py checks the sentence is still there). A cap outside
them is a warning naming the source, never a refusal: the user's cap is theirs to choose.

Every figure is per card and was measured at TP=2 (on a 4-card rig serving TP=2 on two of its cards: HARDWARE.md
"Dual-card TP=2 anchor"); the recipe repo publishes no TP=4 or TP=8 sweep. A rig with more cards gets the same cap
per card, checked against the same per-card range, and the sum over its cards against what host data
`gpu_psu_watts` says its power supply gives the GPUs (psu_warning).
"""

from collections.abc import Mapping
from pathlib import Path

import yaml

from rigforge.model import recipes
from rigforge.model.pins import Lock

PROFILE = "scripts/lib/profiles/hardware/rtx-3090.yml"
HARDWARE_DOC = "docs/HARDWARE.md"
# HARDWARE.md, "Dual-card TP=2 anchor": "the TP=2 anchor below is already flat from 220–330W/card on `dual-fast`"
MEASURED_W = (220, 330)


def profile(root: Path | str | None) -> dict | None:
    """The power figures {"prefill", "optimal", "max", "min_driver"} of the recipe-repo checkout at `root`, or None."""
    if root is None or not (Path(root) / PROFILE).is_file():
        return None
    data = yaml.safe_load((Path(root) / PROFILE).read_text()) or {}
    caps = {key: data.get(f"power_cap_w_{key}") for key in ("prefill", "optimal", "max")}
    return caps | {"min_driver": (data.get("driver_pin_recommended") or {}).get("min")}


def locate_profile(lock: Lock | None) -> dict | None:
    """`profile` of the controller's recipe repo for `lock` (recipes.locate), None when it has no checkout."""
    pin = lock.git.get(recipes.GIT_NAME) if lock is not None else None
    try:
        return profile(recipes.locate(pin.commit if pin else None, pin.content if pin else None))
    except recipes.RecipeError:
        return None


def warnings(caps: Mapping[int, int], prof: dict | None, kept: str = "kept as set") -> list[str]:
    """One warning per cap outside what the recipe repo measured, naming its source and ending with `kept`."""
    low, high = MEASURED_W
    out = []
    for watts in sorted(set(caps.values())):
        gpus = ", ".join(str(i) for i, w in sorted(caps.items()) if w == watts)
        if prof and prof.get("max") and watts > prof["max"]:
            out.append(
                f"power cap {watts} W (GPU {gpus}) is above the recipe repo's maximum {prof['max']} W "
                f"({PROFILE} power_cap_w_max); {kept}"
            )
        elif not low <= watts <= high:
            out.append(
                f"power cap {watts} W (GPU {gpus}) is outside {low}..{high} W, the range where the recipe repo "
                f"measured TP=2 throughput flat ({HARDWARE_DOC}, Dual-card TP=2 anchor); {kept}"
            )
    return out


def psu_warning(caps: Mapping[int, int], psu_watts: int | None) -> str | None:
    """The warning when the caps of every card (`caps`, {index: W}) add up to more than `psu_watts`, what host data
    gpu_psu_watts says the power supply gives the GPUs; None when they fit or it is not set."""
    if not psu_watts or not caps:
        return None
    total = sum(caps.values())
    if total <= int(psu_watts):
        return None
    each = " + ".join(f"GPU {i} {w} W" for i, w in sorted(caps.items()))
    fits = int(psu_watts) // len(caps)
    return (
        f"the power caps of this rig's {len(caps)} GPUs add up to {total} W ({each}), more than the {psu_watts} W "
        f"gpu_psu_watts says the power supply gives the GPUs: under full load the supply can trip or the rig "
        f"reset; set gpu_power_limit_w to at most {fits} W, or correct gpu_psu_watts (kept as set)"
    )


def recipe_range(prof: dict | None) -> str:
    """The recipe's figures, shown beside the cap."""
    measured = "recipe: TP=2 flat {}..{} W ({})".format(*MEASURED_W, HARDWARE_DOC)
    if not prof:
        return measured
    figures = ", ".join(f"{key} {prof[key]}" for key in ("prefill", "optimal", "max"))
    return f"{measured}; {figures} W ({Path(PROFILE).name})"
