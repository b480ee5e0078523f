import re
from collections.abc import Mapping
from dataclasses import dataclass

from rigforge.model import schema
from rigforge.model.knobs import Knobs, defaults_of


@dataclass(frozen=True)
class Images(Knobs):
    """Saved images loaded onto a rig (roles/images.py, deploy/images_load.py)."""

    rigforge_images_dir: str | None = None  # the controller's directory of saved images (`rigforge images save DIR`)
    # the temporary registry's port on the rig's 127.0.0.1 (None: the first free of 5800-5899)
    images_port: int | None = None


DEFAULTS = defaults_of(Images)


def validate(data: Mapping) -> list[str]:
    problems = schema.matches(
        data, "rigforge_images_dir", re.compile(".+", re.S), what="a directory `rigforge images save` wrote"
    )
    problems += schema.settings(data, {"root": "rigforge_root"})  # the images' work dir lies under it
    port = data.get("images_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        problems.append(f"images_port must be a whole number in 1..65535 or unset, got {port!r}")
    return problems
