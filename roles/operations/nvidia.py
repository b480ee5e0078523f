"""NVIDIA operations: persistence mode, power caps applied only where they differ, reboot when the driver needs it."""

from collections.abc import Mapping

from pyinfra import host
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.operations import server

from rigforge.model.driver_table import branch_problem
from rigforge.model.hardware import cap_problems, resolve_caps
from rigforge.observe import verdict
from rigforge.observe.facts.apt import DebInstalledVersion
from rigforge.observe.facts.nvidia import (
    NvidiaGpus,
    NvidiaModuleVersion,
    NvidiaRunningDriver,
    NvidiaSmiStatus,
    upstream_version,
)
from roles import rig_lock
from roles.operations.checks import fail_command
from roles.operations.shown import Commands, say, unchanged
from roles.operations.staged import connection

# Connectors that run on the controller itself: never reboot through them.
CONTROLLER_CONNECTORS = ("@local", "@chroot", "@docker", "@podman")


def on_controller() -> bool:
    """True when rebooting this host would reboot the controller (a testbed rig is a chroot on it)."""
    module = type(host.connector).__module__.rsplit(".", 1)[-1]
    address = str(connection("ssh_hostname") or host.name)
    loopback = address in ("localhost", "::1") or address.startswith("127.")
    return host.name.startswith(CONTROLLER_CONNECTORS) or module in ("local", "chroot", "docker", "podman") or loopback


@operation()
def persistence_mode() -> Commands:
    """``nvidia-smi -i N -pm 1`` for each GPU whose persistence mode is off (no arguments).

    **Example:**

    .. code:: python

        from roles.operations import nvidia
        nvidia.persistence_mode(name="Turn on GPU persistence mode")
    """
    gpus = host.get_fact(NvidiaGpus)
    if unchanged(not verdict.persistence(gpus), f"persistence mode already on for {len(gpus)} GPU(s)"):
        return
    off = [gpu["index"] for gpu in gpus if gpu.get("persistence_mode") is False]
    yield from (StringCommand("nvidia-smi", "-i", str(index), "-pm", "1") for index in off)


@operation()
def power_caps(default_w: int, overrides: dict[int, int] | None = None) -> Commands:
    """``nvidia-smi -i N -pl W`` only for GPUs whose current limit differs; a cap outside a card's range fails.

    + default_w: the cap in whole watts for every GPU
    + overrides: ``{gpu index: watts}`` for GPUs capped differently

    **Example:**

    .. code:: python

        from roles.operations import nvidia
        nvidia.power_caps(
            name="Cap GPU power at 230 W (overrides: {1: 250})",
            default_w=230,
            overrides={1: 250},
        )
    """
    gpus = host.get_fact(NvidiaGpus)
    if problems := cap_problems(gpus, default_w, overrides or {}):  # whole watts: the plan validated them
        yield fail_command(f"power caps refused on {host.name}: " + " ".join(problems))
        return
    caps = resolve_caps([gpu["index"] for gpu in gpus], default_w, overrides or {})
    differ = verdict.caps(gpus, caps)
    if unchanged(not differ, f"power caps already set: {caps}"):
        return
    yield say(f"{'; '.join(differ)}: setting the declared caps")
    todo = [g["index"] for g in gpus if verdict.caps([g], caps)]
    yield from (StringCommand("nvidia-smi", "-i", str(index), "-pl", str(caps[index])) for index in todo)


def reboot_reason(package_version: str | None, module_version: str | None, smi: Mapping[str, object]) -> str | None:
    """Why the driver needs a reboot to take effect, or None (also None when no driver is installed)."""
    installed = upstream_version(package_version)
    if not installed:
        return None
    if module_version and module_version != installed:
        return f"Driver/library version mismatch: loaded kernel module {module_version}, installed {installed}"
    if not module_version and not smi.get("ok"):
        detail = f" ({smi['message']})" if smi.get("message") else ""
        return f"driver {installed} is installed but not loaded{detail}"
    return None


@operation(is_idempotent=False)
def reboot_if_needed(package: str, allow_reboot: bool) -> Commands:
    """Reboot when the installed driver is not the one running, never through a controller-side connection.

    + package: the driver's apt package, whose installed version is compared with the loaded module
    + allow_reboot: reboot the rig (True) or fail the host with what to do

    **Example:**

    .. code:: python

        from roles.operations import nvidia
        nvidia.reboot_if_needed(
            name="Reboot if the installed driver is not the running one",
            package="nvidia-kernel-open-dkms",
            allow_reboot=False,
        )
    """
    reason = reboot_reason(
        host.get_fact(DebInstalledVersion, package=package),
        host.get_fact(NvidiaModuleVersion),
        host.get_fact(NvidiaSmiStatus),
    )
    if unchanged(reason is None, "the running NVIDIA driver matches the installed one"):
        return
    if allow_reboot is not True:
        yield fail_command(
            f"reboot needed on {host.name}: {reason}. Reboot the rig and re-run, "
            "or set nvidia_allow_reboot: true to let rigforge reboot it."
        )
    elif on_controller():
        yield fail_command(
            f"reboot needed on {host.name}: {reason}. rigforge never reboots the machine it runs on "
            "(local, chroot or loopback host): reboot it yourself and re-run."
        )
    else:
        yield from server.reboot._inner(delay=30, reboot_timeout=900)
        yield FunctionCommand(rig_lock.retake, (), {})  # the run's lock went with the old connection


@operation()
def running_branch(branch: int) -> Commands:
    """Fail the host unless the running driver is of ``branch``.

    + branch: the driver branch wanted, e.g. ``580``

    **Example:**

    .. code:: python

        from roles.operations import nvidia
        nvidia.running_branch(
            name="Check the running driver is branch 580 (nvidia_driver_manage: false)",
            branch=580,
        )
    """
    problem = branch_problem(host.get_fact(NvidiaRunningDriver), branch)
    if not unchanged(not problem, f"running driver is branch {branch}"):
        yield fail_command(f"{host.name}: {problem}")
