"""The deploy's own knobs (roles/site.py): which variant, which lock; keys earlier releases read."""

import os
from collections.abc import Mapping
from dataclasses import dataclass

from rigforge.model import schema
from rigforge.model.knobs import Knobs, defaults_of
from rigforge.model.pins import default_lock_path


@dataclass(frozen=True)
class Site(Knobs):
    """The deploy's own knobs (roles/site.py): which variant, which lock, which recipes, a rig held back."""

    rigforge_variant: str | None = None  # variant this host serves (deploy/site.py); deploy/<variant>.py must agree
    rigforge_lock: str | os.PathLike = str(default_lock_path())  # lock file read on the controller
    rigforge_recipe_opt_in: bool = False  # allow a recipe-repo slug whose status is experimental/incubating/deprecated
    rollout_hold: bool = False  # true: `rigforge rollout` leaves this rig at the lock in use (named as held)


DEFAULTS = defaults_of(Site)
RETIRED = {  # host-data keys earlier releases read: refused rather than silently ignored
    "nvidia_driver_packages": "the driver table chooses the packages; set nvidia_driver_source, "
    "nvidia_driver_branch or nvidia_driver_flavor instead",
}


def validate(data: Mapping) -> list[str]:
    """Problems with the site's own keys: the lock's path, the two booleans, a retired key still set."""
    problems = []
    if not isinstance(data.get("rigforge_lock"), str | os.PathLike):
        problems.append(f"rigforge_lock must be the path of a lock file, got {data.get('rigforge_lock')!r}")
    problems += schema.boolean(data, "rigforge_recipe_opt_in") + schema.boolean(data, "rollout_hold")
    for key, advice in RETIRED.items():
        if data.get(key) is not None:
            problems.append(f"{key} is no longer read: {advice}; remove it from host data.")
    return problems
