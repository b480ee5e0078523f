from collections.abc import Mapping

from rigforge import schema

DEFAULTS = {
    "registry_port": 5000,  # on the registry host: the port it serves on (every address)
    "registry_address": None,  # on the registry host: the address rigs reach it at, in its certificate
    # (None: its inventory name)
    "registry_insecure": False,  # on the registry host: plain HTTP, listed in the rigs' insecure-registries
    "registry_ca_dir": None,  # on the registry host: the controller's CA dir (None: ~/.config/rigforge/registry-ca)
}


def validate(data: Mapping) -> list[str]:
    problems = schema.integer(data, "registry_port", 1, 65535)
    problems += schema.boolean(data, "registry_insecure") + schema.hostname(data, "registry_address", optional=True)
    return problems + schema.matches(data, "registry_ca_dir", schema.NOT_BLANK, "a directory on the controller", True)
