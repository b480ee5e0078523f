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

from roles.facts.nvidia import NvidiaGpus, NvidiaPciGpus
from roles.facts.system import FreeDiskBytes, OsRelease, SecureBoot

SUPPORTED_OS = {("ubuntu", "22.04"), ("ubuntu", "24.04"), ("debian", "12"), ("debian", "13")}
SMALL_CARD_MIB = 24000  # below this a card is a "20 GB card"
SMALL_CARD_OVERRIDE = {"serving_kv_cache_dtype": "fp8_e5m2", "serving_gpu_memory_utilization": 0.82}
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
    for (cap, key, low, high), cards in refused.items():
        problems.append(
            f"power cap {cap} W ({key}) is outside {_cards(cards)} range {low:g}..{high:g} W; "
            f"set {key} to a value in {low:g}..{high:g}."
        )
    return problems


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
    try:
        default_w = int(data.get("gpu_power_limit_w"))
        overrides = {int(k): int(v) for k, v in (data.get("gpu_power_limits") or {}).items()}
    except (TypeError, ValueError, AttributeError):
        problems.append(
            "gpu_power_limit_w must be whole watts and gpu_power_limits a mapping {gpu index: watts}; "
            f"got {data.get('gpu_power_limit_w')!r} and {data.get('gpu_power_limits')!r}."
        )
        default_w, overrides = None, {}

    if not gpus and pci_gpus is not None and pci_gpus < needs.gpus:
        problems.append(
            f"variant {needs.variant} needs {needs.gpus} GPUs, the PCI bus shows {pci_gpus} NVIDIA GPU(s); "
            "choose a variant for this GPU count (rigforge_variant) or add GPUs."
        )
    if gpus:
        if len(gpus) < needs.gpus:
            problems.append(
                f"variant {needs.variant} needs {needs.gpus} GPUs, nvidia-smi shows {len(gpus)}; "
                "choose a variant for this GPU count (rigforge_variant) or add GPUs."
            )
        small_override = data.get("serving_kv_cache_dtype") == SMALL_CARD_OVERRIDE["serving_kv_cache_dtype"] and _float(
            data.get("serving_gpu_memory_utilization")
        ) <= float(SMALL_CARD_OVERRIDE["serving_gpu_memory_utilization"])
        short = [gpu for gpu in gpus if (gpu.get("memory_total") or 0) < needs.card_mib]
        vram = min((gpu.get("memory_total") or 0 for gpu in short), default=0)
        cards = f"{_cards(short)} {'has' if len(short) == 1 else 'have'} {vram} MiB"
        if short and vram < SMALL_CARD_MIB and needs.dflash:
            problems.append(
                f"{cards}; {needs.variant} (DFlash) needs 24 GB cards and has no 20 GB override; "
                "choose dual or dual-turbo with the 20 GB override."
            )
        elif short and vram < SMALL_CARD_MIB and not small_override:
            problems.append(
                f"{cards}, less than the {needs.card_mib} MiB {needs.variant} needs; for 20 GB cards set "
                "serving_kv_cache_dtype: fp8_e5m2 and serving_gpu_memory_utilization: 0.82 in host data."
            )
        elif short and vram >= SMALL_CARD_MIB:
            problems.append(f"{cards}, less than the {needs.card_mib} MiB {needs.variant} needs.")
        if default_w is not None:
            problems += cap_problems(gpus, default_w, overrides)

    if free_bytes is not None and free_bytes < needs.disk_bytes:
        problems.append(
            f"free disk at {needs.disk_path} is {free_bytes / 1e9:.1f} GB, {needs.variant} needs "
            f"{needs.disk_bytes / 1e9:.1f} GB; free space or point serving_model_dir at a bigger disk."
        )
    return problems


def _cards(gpus: list[dict]) -> str:
    names = sorted({str(gpu.get("name")) for gpu in gpus})
    return f"GPU {', '.join(str(gpu['index']) for gpu in gpus)} ({', '.join(names)})"


def _float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("inf")


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


@operation(is_idempotent=False)
def refuse(message: str):
    """Fail this host with `message`: its later operations never run."""
    yield fail_command(message)
