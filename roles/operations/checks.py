"""Checks that stop one host with one clear message, before anything on it changes.

How a host is stopped: an operation yields `fail_command(message)`, a python callback that logs the
message and returns False. pyinfra then marks that operation failed, drops the host from the run (its
later operations never execute) and carries on with the other hosts. Nothing is raised while pyinfra
prepares operations (an exception there would abort every host), and a `--dry` run, which only prepares,
prints the problems as warnings instead of failing.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, operation
from pyinfra.context import ctx_host

from rigforge.hardware import cards, small_override, vram_problems
from roles.facts.nvidia import NvidiaGpus, NvidiaPciGpus
from roles.facts.system import FreeDiskBytes, OsRelease, SecureBoot

SUPPORTED_OS = {("ubuntu", "22.04"), ("ubuntu", "24.04"), ("debian", "12"), ("debian", "13")}
DOCKER_SOURCES = ("docker", "distro")
DRIVER_FLAVORS = ("open", "proprietary")


@dataclass(frozen=True)
class Needs:
    """What a variant needs of a host (from the catalog and the lock), checked by preflight."""

    variant: str
    gpus: int  # tensor-parallel size
    card_mib: int  # smallest card it fits without the 20 GB override
    dflash: bool  # DFlash variants have no 20 GB override
    disk_path: str  # the model dir
    disk_bytes: int  # bytes still to land there


def _fail(state, host, message):  # pyinfra passes (state, host) to callbacks whose arguments use those names
    if message:
        host.log_styled(message, fg="red", log_func=logger.error)
    return False


def fail_command(message: str) -> FunctionCommand:
    """A command that fails the current host with `message` when executed."""
    return FunctionCommand(_fail, (message,), {})


def resolve_caps(indices: list[int], default_w: int, overrides: dict) -> dict[int, int]:
    """Watts per GPU index: `overrides` ({index: W}, keys may be strings) win over `default_w`."""
    per_gpu = {int(index): int(watts) for index, watts in (overrides or {}).items()}
    return {index: per_gpu.get(index, int(default_w)) for index in indices}


def cap_problems(gpus: list[dict], default_w: int, overrides: dict) -> list[str]:
    """Problems with the requested power caps against each card's min..max (empty when fine)."""
    problems = []
    indices = [gpu["index"] for gpu in gpus]
    unknown = sorted({int(index) for index in (overrides or {})} - set(indices))
    if gpus and unknown:
        problems.append(
            f"gpu_power_limits names GPU(s) {unknown} but nvidia-smi shows GPU(s) {indices}; "
            "remove those entries from gpu_power_limits."
        )
    refused: dict[tuple, list] = {}  # one line per (cap, key, range), naming every card it concerns
    for gpu in gpus:
        cap = resolve_caps([gpu["index"]], default_w, overrides)[gpu["index"]]
        low, high = gpu.get("power_min_limit"), gpu.get("power_max_limit")
        if low is not None and high is not None and not low <= cap <= high:
            key = "gpu_power_limits" if int(gpu["index"]) in {int(i) for i in overrides or {}} else "gpu_power_limit_w"
            refused.setdefault((cap, key, low, high), []).append(gpu)
    for (cap, key, low, high), refused_cards in refused.items():
        problems.append(
            f"power cap {cap} W ({key}) is outside {cards(refused_cards)} range {low:g}..{high:g} W; "
            f"set {key} to a value in {low:g}..{high:g}."
        )
    return problems


def gpu_problems(gpus: list[dict], needs: Needs, data: dict) -> list[str]:
    """What nvidia-smi's GPUs lack for `needs.variant`: count, VRAM per card, each card's power-cap range."""
    if not gpus:
        return []
    problems = []
    if len(gpus) < needs.gpus:
        problems.append(
            f"variant {needs.variant} needs {needs.gpus} GPUs, nvidia-smi shows {len(gpus)}; "
            "choose a variant for this GPU count (rigforge_variant) or add GPUs."
        )
    override = small_override(data.get("serving_kv_cache_dtype"), data.get("serving_gpu_memory_utilization"))
    problems += vram_problems(gpus, needs.variant, needs.card_mib, needs.dflash, override)
    try:
        default_w = int(data.get("gpu_power_limit_w"))
        overrides = {int(k): int(v) for k, v in (data.get("gpu_power_limits") or {}).items()}
    except (TypeError, ValueError, AttributeError):
        return problems + [
            "gpu_power_limit_w must be whole watts and gpu_power_limits a mapping {gpu index: watts}; "
            f"got {data.get('gpu_power_limit_w')!r} and {data.get('gpu_power_limits')!r}."
        ]
    return problems + cap_problems(gpus, default_w, overrides)


def find_problems(
    os_release: dict, gpus: list[dict], free_bytes: int | None, *, needs: Needs, data: dict, pci_gpus: int | None = None
) -> list[str]:
    """Every reason this host cannot run `needs.variant` (empty list when it can).

    Before a driver is installed nvidia-smi shows no GPUs; the GPU count is then taken from the PCI bus
    (`pci_gpus`, None when unknown) and the VRAM and power-cap checks wait for the driver.

    `data` holds the host-data keys the checks read: gpu_power_limit_w, gpu_power_limits,
    serving_kv_cache_dtype, serving_gpu_memory_utilization, docker_source, nvidia_driver_flavor.
    """
    problems = []
    os_key = (os_release.get("id", ""), os_release.get("version_id", ""))
    if os_key not in SUPPORTED_OS:
        problems.append(
            f"unsupported OS {os_key[0] or '?'} {os_key[1] or '?'}; supported: Ubuntu 22.04, Ubuntu 24.04, "
            "Debian 12, Debian 13. Install one of those on the rig."
        )
    docker_source = data.get("docker_source")
    if docker_source not in DOCKER_SOURCES:
        problems.append(f"docker_source={docker_source!r} is not one of: {', '.join(DOCKER_SOURCES)}.")
    elif docker_source == "distro" and os_key == ("debian", "12"):
        problems.append("docker_source='distro' has no compose v2 package on Debian 12; set docker_source: docker.")
    if data.get("nvidia_allow_reboot", False) not in (True, False):
        problems.append(f"nvidia_allow_reboot={data.get('nvidia_allow_reboot')!r} must be true or false.")
    flavor = data.get("nvidia_driver_flavor")
    if flavor not in DRIVER_FLAVORS:
        problems.append(f"nvidia_driver_flavor={flavor!r} is not one of: {', '.join(DRIVER_FLAVORS)}.")
    if not gpus and pci_gpus is not None and pci_gpus < needs.gpus:
        problems.append(
            f"variant {needs.variant} needs {needs.gpus} GPUs, the PCI bus shows {pci_gpus} NVIDIA GPU(s); "
            "choose a variant for this GPU count (rigforge_variant) or add GPUs."
        )
    problems += gpu_problems(gpus, needs, data)

    if free_bytes is not None and free_bytes < needs.disk_bytes:
        problems.append(
            f"free disk at {needs.disk_path} is {free_bytes / 1e9:.1f} GB, {needs.variant} needs "
            f"{needs.disk_bytes / 1e9:.1f} GB; free space or point serving_model_dir at a bigger disk."
        )
    return problems


def format_problems(host_name: str, problems: list[str], what: str = "preflight failed") -> str:
    lines = [f"{what} on {host_name}:"] + [f"  - {problem}" for problem in problems]
    return "\n".join(lines + ["Nothing was changed on this host."])


@operation()
def host_checks(needs: Needs, data: dict, host_problems=None):
    """Fail this host with one message listing every problem; no-op when the host can run the variant."""
    problems = find_problems(
        host.get_fact(OsRelease),
        host.get_fact(NvidiaGpus),
        host.get_fact(FreeDiskBytes, path=needs.disk_path),
        needs=needs,
        data=data,
        pci_gpus=host.get_fact(NvidiaPciGpus),
    )
    problems += host_problems(data) if host_problems else []  # the roles' own host-state checks
    if host.get_fact(SecureBoot) == "enabled":
        host.log_styled(
            "Secure Boot is enabled: DKMS-built NVIDIA modules must be signed with an enrolled MOK key; on Ubuntu, "
            "nvidia_driver_source: ubuntu installs Ubuntu's prebuilt, signed modules instead.",
            fg="yellow",
            log_func=logger.warning,
        )
    if not problems:
        host.noop(f"preflight passed for {needs.variant}")
        return
    message = format_problems(host.name, problems)
    if not state.is_executing:  # change detection / --dry: report now; a real run fails when executed
        host.log_styled(message, fg="yellow", log_func=logger.warning)
    yield fail_command(message)


@operation()
def gpus_fit(needs: Needs, caps: dict[int, int], data: dict):
    """Right after the driver role: fail this host unless nvidia-smi's GPUs fit `needs` (count, VRAM per card,
    each card's cap range) and `caps` (the power unit's caps) covers exactly the GPUs present.

    pyinfra runs an operation's body again when it executes it, and facts are not cached, so the GPUs are read
    when this runs: after a driver installed (and a reboot taken) earlier in the same run, before Docker, caps,
    sources, weights or serving. While only preparing a fresh rig (no driver yet) it reports nothing.
    """
    gpus = host.get_fact(NvidiaGpus)
    if not gpus and not state.is_executing:
        host.noop("GPUs are checked when this runs, once the driver answers")
        return
    problems = gpu_problems(gpus, needs, data)
    if not gpus:
        problems.append(
            "nvidia-smi shows no GPU although the driver role finished; check `nvidia-smi` and `dmesg` on the rig."
        )
    present = sorted(int(gpu["index"]) for gpu in gpus)
    if gpus and present != sorted(caps):
        problems.append(
            f"the power unit would cap GPU(s) {sorted(caps)} but nvidia-smi shows GPU(s) {present}; re-run so "
            "the plan counts the GPUs again (and remove gpu_power_limits entries for absent GPUs)."
        )
    if not problems:
        vram = sorted({gpu.get("memory_total") for gpu in gpus})
        host.noop(f"{len(gpus)} GPU(s) with {'/'.join(map(str, vram))} MiB fit {needs.variant}; caps in range")
        return
    message = format_problems(host.name, problems, what="GPU check failed")
    if not state.is_executing:
        host.log_styled(message, fg="yellow", log_func=logger.warning)
    yield fail_command(message)


def refuse_now(name: str, message: str) -> None:
    """Refuse this host while its operations are prepared: print `message` in full now (so `pyinfra --dry`,
    with or without -y, shows it), count the host as failed (so the run, dry or not, exits 1) and queue the one
    operation that stops it when the run executes."""
    host.log_styled(message, fg="red", log_func=logger.error)
    state.failed_hosts.add(ctx_host.get())  # the host itself, not pyinfra's context proxy
    refuse(name=name, message=message, said=True)


@operation(is_idempotent=False)
def refuse(message: str, said: bool = False):
    """Fail this host with `message`: its later operations never run.

    + message: what is wrong and what to do, naming the host
    + said: the message was printed already (refuse_now): fail without printing it again
    """
    yield fail_command("" if said else message)
