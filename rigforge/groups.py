"""The inventory groups that give a host its roles in the fleet, and which hosts are rigs. Imports nothing at run
time, so a deploy file's first step (roles/rig_lock.py `ask_first`) can tell a rig before the roles load."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyinfra.api import Host

RIG = "rig"  # with GATEWAY, REGISTRY and MONITOR: the roles a host can have in the fleet
GATEWAY = "gateway"  # the inventory group of the fleet's gateway hosts
REGISTRY = "registry"  # the inventory group of the fleet registry host
MONITOR = "monitor"  # the inventory group of the host that runs Prometheus (docs/monitoring.md)


def is_rig(h: "Host") -> bool:
    """Every host is a rig but those only in `gateway`, `registry` or `monitor` (unless also in `rigs`)."""
    return not {GATEWAY, REGISTRY, MONITOR} & set(h.groups) or "rigs" in h.groups
