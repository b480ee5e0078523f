from collections.abc import Mapping
from dataclasses import dataclass

from rigforge.model import schema
from rigforge.model.knobs import Knobs, defaults_of


@dataclass(frozen=True)
class Registry(Knobs):
    """The fleet registry (roles/registry.py, Distribution) on the host of the group `registry`."""

    registry_port: int = 5000  # on the registry host: the port it serves on (every address)
    # on the registry host: the address rigs reach it at, in its certificate (None: its inventory name)
    registry_address: str | None = None
    registry_insecure: bool = False  # on the registry host: plain HTTP, listed in the rigs' insecure-registries
    # on the registry host: the controller's CA dir (None: ~/.config/rigforge/registry-ca)
    registry_ca_dir: str | None = None


DEFAULTS = defaults_of(Registry)


def validate(data: Mapping) -> list[str]:
    problems = schema.integer(data, "registry_port", 1, 65535)
    problems += schema.boolean(data, "registry_insecure") + schema.hostname(data, "registry_address", optional=True)
    return problems + schema.matches(
        data, "registry_ca_dir", schema.NOT_BLANK, "a directory on the controller", optional=True
    )
