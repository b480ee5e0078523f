"""Preflight: runs first, changes nothing, and stops a host that cannot run its variant (OS, GPUs, VRAM, caps,
CUDA, disk, daemon.json, the role switches) with one message naming the host, the key and what to do. The refusal
is printed while the deploy is prepared, so `pyinfra --dry` shows it and exits 1.
"""

from collections.abc import Mapping

from pyinfra import host, logger

from rigforge.facts.nvidia import NvidiaGpus, NvidiaPciGpus, NvidiaRunningDriver
from rigforge.facts.system import FreeDiskBytes, OsRelease, SecureBoot
from rigforge.hardware import Needs, find_problems, format_problems
from roles import host_state
from roles.operations.checks import refuse_now


def check(needs: Needs, data: Mapping, more: list[str] = ()) -> bool:
    """Refuse this host now, while the deploy is prepared, when it cannot run `needs.variant`; True when it can.
    `data`: the plan's validated host data; `more`: problems found on the controller (roles/site.py)."""
    problems = find_problems(
        host.get_fact(OsRelease),
        host.get_fact(NvidiaGpus),
        host.get_fact(FreeDiskBytes, path=needs.disk_path),
        needs=needs,
        data=data,
        pci=host.get_fact(NvidiaPciGpus),
        running=host.get_fact(NvidiaRunningDriver),
    )
    # the driver and container-runtime roles' host-state checks, then the controller's
    problems += host_state.problems(data) + list(more)
    if host.get_fact(SecureBoot) == "enabled":
        host.log_styled(
            "Secure Boot is enabled: DKMS-built NVIDIA modules must be signed with an enrolled MOK key; on Ubuntu, "
            "nvidia_driver_source: ubuntu installs Ubuntu's prebuilt, signed modules instead.",
            fg="yellow",
            log_func=logger.warning,
        )
    if problems:
        refuse_now(f"Preflight refused {host.name}", format_problems(host.name, problems))
        return False
    host.noop(f"preflight passed for {needs.variant}")
    return True
