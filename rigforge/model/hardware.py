"""Can a rig run a variant? Pure checks, no host access: GPUs (nvidia-smi's or the PCI bus's), the OS, free disk,
the role switches, and the layout's roots against Docker's data-root and an earlier deploy's. Shared by the deploy's
checks (roles/operations/) and `rigforge verify`.
"""

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from rigforge.layout import DAEMON_JSON, HostLayout
from rigforge.model import schema
from rigforge.model.driver_table import branch_for_cuda, cuda_for_branch, cuda_for_driver, version_key
from rigforge.model.knobs.gpu_power import GpuPower
from rigforge.model.knobs.nvidia_driver import NvidiaDriver
from rigforge.model.knobs.roles import RoleKnobs
from rigforge.model.packages import distro_docker
from rigforge.model.schema import Settings

SMALL_CARD_MIB = 24000  # below this a card is a "20 GB card"
SMALL_CARD_FLOOR_MIB = 20000  # below this not even the 20 GB override fits the model


def cards(gpus: list[dict]) -> str:
    names = sorted({str(gpu.get("name")) for gpu in gpus})
    return f"GPU {', '.join(str(gpu['index']) for gpu in gpus)} ({', '.join(names)})"


def small_override(kv_cache_dtype: object, gpu_memory_utilization: Any) -> bool:
    """Whether the documented 20 GB-card override is set (fp8_e5m2 KV and at most 0.82 of the memory)."""
    try:
        return kv_cache_dtype == "fp8_e5m2" and float(gpu_memory_utilization) <= 0.82
    except (TypeError, ValueError):
        return False


def vram_problems(gpus: list[dict], variant: str, card_mib: int, dflash: bool, override: bool) -> list[str]:
    """Cards with less VRAM than `variant` needs (empty when every card fits, or fits with the 20 GB override)."""
    short = [gpu for gpu in gpus if (gpu.get("memory_total") or 0) < card_mib]
    if not short:
        return []
    vram = min(gpu.get("memory_total") or 0 for gpu in short)
    seen = f"{cards(short)} {'has' if len(short) == 1 else 'have'} {vram} MiB"
    if vram < SMALL_CARD_FLOOR_MIB:
        return [f"{seen}; every variant needs 24 GB cards ({card_mib} MiB), or 20 GB ones with the override."]
    if vram >= SMALL_CARD_MIB:
        return [f"{seen}, less than the {card_mib} MiB {variant} needs."]
    if dflash:
        return [
            f"{seen}; {variant} (DFlash) needs 24 GB cards and has no 20 GB override; "
            "choose dual or dual-turbo with the 20 GB override."
        ]
    if not override:
        return [
            f"{seen}, less than the {card_mib} MiB {variant} needs; for 20 GB cards set "
            "serving_kv_cache_dtype: fp8_e5m2 and serving_gpu_memory_utilization: 0.82 in host data."
        ]
    return []


# Stock VRAM by PCI device ID (vendor 10de), known before any driver exists. Names and IDs: the PCI ID Repository
# (https://pci-ids.ucw.cz/read/PC/10de); VRAM: NVIDIA's product specifications, in MiB as nvidia-smi shows it.
# The third field is the VRAM of boards sold modded under the same ID (a 20 GB 3080 carries a stock 3080's ID):
# for those only the driver can tell, so the check waits for it (roles/site.py says so before the driver).
PCI_CARDS: dict[str, tuple[str, int, int | None]] = {
    "2204": ("GeForce RTX 3090", 24576, None),
    "2203": ("GeForce RTX 3090 Ti", 24576, None),
    "2206": ("GeForce RTX 3080", 10240, 20480),
    "2216": ("GeForce RTX 3080 LHR", 10240, 20480),
    "220a": ("GeForce RTX 3080 12GB", 12288, None),
    "2208": ("GeForce RTX 3080 Ti", 12288, None),
    "2484": ("GeForce RTX 3070", 8192, None),
    "2503": ("GeForce RTX 3060", 12288, None),
    "2684": ("GeForce RTX 4090", 24564, 49140),
}


def pci_problems(pci: list[tuple[str, str]], needs: "Needs", override: bool) -> list[str]:
    """Too few NVIDIA GPUs, or too little VRAM even in the largest known build; unknown IDs wait for the driver."""
    if len(pci) < needs.gpus:
        seen = f"the PCI bus shows {len(pci)} NVIDIA GPU(s)"
        return [f"variant {needs.variant} needs {needs.gpus} GPUs, {seen}; {too_few(needs.gpus, len(pci))}"]
    known = [
        {"index": address, "name": f"{name}, PCI ID 10de:{device}", "memory_total": max(stock, modded or 0)}
        for address, device in sorted(pci, key=lambda pair: bus_address(pair[0]))[: needs.gpus]  # its cards
        if device in PCI_CARDS
        for name, stock, modded in [PCI_CARDS[device]]
    ]
    problems = vram_problems(known, needs.variant, needs.card_mib, needs.dflash, override)
    return [f"by PCI device ID (largest known build of the card; before any driver): {problem}" for problem in problems]


SUPPORTED_OS = {("ubuntu", "22.04"), ("ubuntu", "24.04"), ("debian", "12"), ("debian", "13")}


def too_few(needed: int, has: int) -> str:
    """What to do when a rig has `has` GPUs and its variant runs tensor-parallel over `needed`."""
    more = needed - has
    return (
        f"this rig has {has} GPU(s) and the variant runs tensor-parallel over {needed}: add {more} GPU(s), or "
        f"choose a variant for at most {has} card(s) (a slug's tp in the recipe registry is how many it needs)."
    )


def serving_indices(tp: int, gpu_count: int) -> list[int]:
    """The GPU indices (nvidia-smi's, PCI bus order) a variant running tensor-parallel over `tp` serves on: the
    first `tp`; on a rig with more cards the others stay idle (capped, persistence on, not used by vLLM)."""
    return list(range(min(tp, gpu_count) if gpu_count else tp))


def serving_env(tp: int, gpu_count: int) -> dict[str, str]:
    """The container environment that pins vLLM to `serving_indices` when the rig has more cards than `tp` ({}
    when it uses every card). CUDA numbers devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, which makes
    CUDA_VISIBLE_DEVICES's indices nvidia-smi's (the recipes' composes pass CUDA_VISIBLE_DEVICES through, their
    own GPU mask: `count: all` reservations hand every card to the container)."""
    if not gpu_count or gpu_count <= tp:
        return {}
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in serving_indices(tp, gpu_count)),
    }


@dataclass(frozen=True)
class Needs:
    """What a variant needs of a host (from the catalog and the lock), checked by preflight."""

    variant: str
    gpus: int  # tensor-parallel size
    card_mib: int  # smallest card it fits without the 20 GB override
    dflash: bool  # DFlash variants have no 20 GB override
    disk_path: str  # the model dir
    disk_bytes: int  # bytes still to land there
    image: str = ""  # the image it runs
    image_cuda: str | None = None  # the CUDA version that image is built for (the lock's `cuda`), None: unknown
    nvlink: bool = False  # the recipe's requires_nvlink: every pair of its cards NVLinked
    homogeneous: bool = False  # the recipe's requires_homogeneous_arch: its cards share one compute capability


def driver_cuda(running: dict | None, driver: NvidiaDriver) -> tuple[str | None, str]:
    """(CUDA the driver supports once the deploy ran, which driver): the running one if kept, else the branch's."""
    version, branch = (running or {}).get("version"), driver.nvidia_driver_branch
    if version and (driver.nvidia_driver_manage is False or version.split(".")[0] == str(branch)):
        return (running or {}).get("cuda") or cuda_for_driver(version), f"the running driver {version}"
    try:
        return cuda_for_branch(branch), f"driver branch {int(branch)}"
    except (TypeError, ValueError):
        return None, ""  # a bad branch is refused by the driver role's own check


def cuda_problems(needs: Needs, running: dict | None, knobs: NvidiaDriver) -> list[str]:
    """The image needs a newer CUDA than the rig's driver supports (empty when it fits or either is unknown)."""
    want = needs.image_cuda
    have, driver = driver_cuda(running, knobs)
    if not want or not have or version_key(have) >= version_key(want)[:2]:
        return []
    branch = branch_for_cuda(want)
    fix = f"set nvidia_driver_branch: {branch} (CUDA {want})" if branch else f"use a driver with CUDA {want}"
    if branch and knobs.nvidia_driver_manage is False:
        fix = f"install driver branch {branch} and set nvidia_driver_branch: {branch}"
    return [
        f"image {needs.image or '?'} needs CUDA {want}, {driver} supports CUDA {have} at most (GeForce cards fail "
        f"with error 804 once vLLM starts); {fix}, or use an image built for CUDA <= {have}."
    ]


def resolve_caps(indices: list[int], default_w: int, overrides: dict) -> dict[int, int]:
    """Watts per GPU index: `overrides` ({index: W}, keys may be strings) win over `default_w`."""
    per_gpu = {int(index): int(watts) for index, watts in (overrides or {}).items()}
    return {index: per_gpu.get(index, int(default_w)) for index in indices}


def cap_problems(gpus: list[dict], default_w: int, overrides: dict) -> list[str]:
    """Problems with the requested power caps against each card's min..max (empty when fine)."""
    indices = [gpu["index"] for gpu in gpus]
    caps = resolve_caps(indices, default_w, overrides)
    named = {int(index) for index in overrides or {}}
    problems = []
    if gpus and (unknown := sorted(named - set(indices))):
        problems.append(
            f"gpu_power_limits names GPU(s) {unknown} but nvidia-smi shows GPU(s) {indices}; "
            "remove those entries from gpu_power_limits."
        )
    refused: dict[tuple, list] = {}  # one line per (cap, key, range), naming every card it concerns
    for gpu in gpus:
        low = gpu.get("power_min_limit")
        high = gpu.get("power_max_limit")
        if low is None or high is None:  # the card did not say its range: nothing to check against
            continue
        cap = caps[gpu["index"]]
        if not low <= cap <= high:
            key = "gpu_power_limits" if int(gpu["index"]) in named else "gpu_power_limit_w"
            refused.setdefault((cap, key, low, high), []).append(gpu)
    return problems + [
        f"power cap {cap} W ({key}) is outside {cards(refused_cards)} range {low:g}..{high:g} W; "
        f"set {key} to a value in {low:g}..{high:g}."
        for (cap, key, low, high), refused_cards in refused.items()
    ]


def bus_address(address: str | None) -> str:
    """A PCI address as sysfs spells it: nvidia-smi's "00000000:02:00.0" -> "0000:02:00.0" (lower case)."""
    text = (address or "").strip().lower()
    head, _, function = text.rpartition(":")
    domain, _, bus = head.rpartition(":")
    return f"{domain[-4:].rjust(4, '0')}:{bus}:{function}" if domain else text


def gpu_count(gpus: list[dict] | None, pci: list | None) -> int | None:
    """How many GPUs the plan renders the caps for: nvidia-smi's, or the PCI bus's when it shows more (a card off
    the bus is still the rig's: its files are not re-rendered for one card less); None when neither shows one."""
    return max(len(gpus or []), len(pci or [])) or None


class MissingCard(NamedTuple):
    """An NVIDIA card the PCI bus shows and nvidia-smi does not list."""

    gpu: int  # its GPU index in PCI bus order, as nvidia-smi numbered it while it listed every card
    address: str  # its PCI address, as sysfs spells it ("0000:02:00.0")
    device: str  # its PCI device ID ("2204": an RTX 3090)


def missing_cards(gpus: list[dict], pci: list | None) -> list[MissingCard]:
    """NVIDIA GPUs on the PCI bus that nvidia-smi does not list (none while it lists none), each with its index in
    PCI bus order: the one nvidia-smi gave it while it listed every card."""
    listed = {bus_address(gpu.get("pci_bus_id")) for gpu in gpus}
    on_the_bus = sorted(pci or [], key=lambda card: bus_address(card[0]))
    return [
        MissingCard(gpu, address, device)
        for gpu, (address, device) in enumerate(on_the_bus)
        if gpus and bus_address(address) not in listed
    ]


def missing_problem(missing: list[MissingCard], shown: int) -> str:
    """The sentence for GPUs the PCI bus shows and nvidia-smi does not: which (GPU index and bus address), and what
    to check."""
    cards = ", ".join(
        f"GPU {card.gpu} (PCI {card.address}, "
        f"10de:{card.device}{', ' + PCI_CARDS[card.device][0] if card.device in PCI_CARDS else ''})"
        for card in missing
    )
    one = len(missing) == 1
    return (
        f"nvidia-smi shows {shown} GPU(s); the PCI bus shows {shown + len(missing)}: {cards} "
        f"{'is' if one else 'are'} on the bus but nvidia-smi does not list {'it' if one else 'them'} "
        f"(fallen off the bus?): check {'its' if one else 'their'} power cables and seating, and the kernel's Xid "
        "lines (`journalctl -k | grep -i xid`)"
    )


def serving_cards(gpus: list[dict], tp: int) -> list[dict]:
    """The cards of nvidia-smi's `gpus` a variant over `tp` runs on (serving_indices); all of them when fewer."""
    wanted = set(serving_indices(tp, len(gpus)))
    return [gpu for gpu in gpus if int(gpu.get("index", -1)) in wanted] or list(gpus)


def arch_problems(serving: list[dict], needs: Needs) -> list[str]:
    """The recipe's requires_homogeneous_arch against the serving cards' compute capabilities (empty when met,
    not required, or one card; the recipe's scripts/preflight.sh refuses mixed ones the same way, club-3090 #762)."""
    caps = sorted({str(gpu.get("compute_cap")) for gpu in serving if gpu.get("compute_cap")})
    if not needs.homogeneous or len(caps) < 2:
        return []
    each = ", ".join(f"GPU {gpu['index']} sm_{gpu.get('compute_cap')}" for gpu in serving)
    return [
        f"variant {needs.variant} requires one GPU architecture across its {len(serving)} cards (the recipe's "
        f"requires_homogeneous_arch: its arch-gated kernels fail on the lower card), the cards span compute "
        f"capabilities {', '.join(caps)} ({each}): serve it on cards of one architecture."
    ]


def interconnect_problems(topology: dict | None, needs: Needs, gpu_count: int) -> list[str]:
    """The recipe's requires_nvlink against `nvidia-smi topo -m` (parse_topology): every pair of the serving cards
    must be NV# linked. Empty when met, not required, or the topology is unknown (no driver yet: checked again
    once it answers)."""
    links = (topology or {}).get("links") or {}
    if not needs.nvlink or not links:
        return []
    serving = serving_indices(needs.gpus, gpu_count)
    pairs = [f"{a}-{b}" for a in serving for b in serving if a < b]
    unlinked = [f"GPU {pair} {links.get(pair, '?')}" for pair in pairs if not links.get(pair, "").startswith("NV")]
    if not unlinked:
        return []
    return [
        f"variant {needs.variant} requires NVLink between its {len(serving)} cards (the recipe's requires_nvlink), "
        f"`nvidia-smi topo -m` shows {', '.join(unlinked)} (no NVLink): bridge them, or choose a slug that does "
        "not require it."
    ]


def gpu_problems(
    gpus: list[dict],
    needs: Needs,
    power: GpuPower,
    settings: Settings,
    pci: list | None = None,
    topology: dict | None = None,
) -> list[str]:
    """What nvidia-smi's GPUs (else the PCI bus's `pci` pairs) lack for `needs.variant`: count, the serving
    cards' VRAM, architecture and links (`topology`: parse_topology's, None: not read), every card's power caps
    (`power`'s; `settings` may set the 20 GB-card override). A card the PCI bus shows and nvidia-smi does not is named
    with its bus address (missing_problem)."""
    override = small_override(settings.kv_cache_dtype, settings.gpu_memory_utilization)
    if not gpus:
        return [] if pci is None else pci_problems(pci, needs, override)
    problems = []
    if missing := missing_cards(gpus, pci):
        problems.append(missing_problem(missing, len(gpus)))
    if len(gpus) < needs.gpus and len(gpus) + len(missing) < needs.gpus:
        problems.append(
            f"variant {needs.variant} needs {needs.gpus} GPUs, nvidia-smi shows {len(gpus)}; "
            f"{too_few(needs.gpus, len(gpus))}"
        )
    serving = serving_cards(gpus, needs.gpus)  # the VRAM it needs is on the cards it runs on
    problems += vram_problems(serving, needs.variant, needs.card_mib, needs.dflash, override)
    problems += arch_problems(serving, needs) + interconnect_problems(topology, needs, len(gpus))
    try:
        default_w = int(power.gpu_power_limit_w)
        overrides = {int(k): int(v) for k, v in (power.gpu_power_limits or {}).items()}
    except (TypeError, ValueError, AttributeError):
        return problems + [
            "gpu_power_limit_w must be whole watts and gpu_power_limits a mapping {gpu index: watts}; "
            f"got {power.gpu_power_limit_w!r} and {power.gpu_power_limits!r}."
        ]
    return problems + cap_problems(gpus, default_w, overrides)


def find_problems(
    os_release: dict,
    gpus: list[dict],
    free_bytes: int | None,
    *,
    needs: Needs,
    knobs: RoleKnobs,
    settings: Settings,
    pci: list | None = None,
    running: dict | None = None,
    topology: dict | None = None,
) -> list[str]:
    """Every reason this host cannot run `needs.variant` with its `knobs` and `settings` (empty list when it can).
    With no driver yet the GPU count comes from the PCI bus and each card's VRAM from its device ID (the largest
    known build); a card's power range and a modded card's VRAM wait for the driver (`pci`, `topology`: see
    gpu_problems). `running`: NvidiaRunningDriver, or None."""
    problems = []
    os_key = (os_release.get("id", ""), os_release.get("version_id", ""))
    if os_key not in SUPPORTED_OS:
        problems.append(
            f"unsupported OS {os_key[0] or '?'} {os_key[1] or '?'}; supported: Ubuntu 22.04, Ubuntu 24.04, "
            "Debian 12, Debian 13. Install one of those on the rig."
        )
    if knobs.docker.docker_source == "distro" and os_key in SUPPORTED_OS and not distro_docker(*os_key):
        name = f"{'Debian' if os_key[0] == 'debian' else 'Ubuntu'} {os_key[1]}"
        problems.append(
            f"docker_source='distro' leaves no `docker compose`: {name}'s archive has no compose v2 package; "
            "set docker_source: docker."
        )
    problems += gpu_problems(gpus, needs, knobs.gpu_power, settings, pci, topology)
    problems += cuda_problems(needs, running, knobs.driver)

    if free_bytes is not None and free_bytes < needs.disk_bytes:
        problems.append(
            f"free disk at {needs.disk_path} is {free_bytes / 1e9:.1f} GB, {needs.variant} needs "
            f"{needs.disk_bytes / 1e9:.1f} GB; free space or point serving_model_dir at a bigger disk."
        )
    return problems


def format_problems(
    host_name: str, problems: list[str], what: str = "preflight failed", changed: Sequence[str] = ()
) -> str:
    """One message naming the host, every problem, then what this run changed on it (`changed`) or that nothing was."""
    lines = [f"{what} on {host_name}:"] + [f"  - {problem}" for problem in problems]
    if not changed:
        return "\n".join(lines + ["Nothing was changed on this host."])
    lines += ["This run changed this host before the check (the rest of the deploy did not run):"]
    return "\n".join(lines + [f"  * {name}" for name in changed])


P2P_STATUS = {  # `nvidia-smi topo -p2p` legend
    "OK": "OK",
    "CNS": "not supported (CNS: chipset not supported)",
    "GNS": "not supported (GNS: GPU not supported)",
    "TNS": "not supported (TNS: topology not supported)",
    "NS": "not supported (NS)",
    "U": "unknown (U)",
}


def interconnect(topology: dict | None) -> str:
    """parse_topology's links, e.g. 'PCIe (PHB), no NVLink, P2P read: OK'; '' with fewer than two GPUs or no driver."""
    links = sorted(set(((topology or {}).get("links") or {}).values()))
    if not links:
        return ""
    nvlink = [link for link in links if link.startswith("NV")]
    pcie = [link for link in links if not link.startswith("NV")]
    parts = [f"PCIe ({'/'.join(pcie)})"] if pcie else []
    parts.append(f"NVLink ({'/'.join(nvlink)})" if nvlink else "no NVLink")
    if reads := sorted(set((topology.get("p2p_read") or {}).values())):
        parts.append("P2P read: " + ", ".join(P2P_STATUS.get(r, r) for r in reads))
    return ", ".join(parts)


def data_root_of(daemon_json: list[str] | None) -> str:
    """Docker's data-root from daemon.json's lines: its `data-root`, else Docker's default."""
    configured = None
    with contextlib.suppress(ValueError, AttributeError):
        configured = json.loads("\n".join(daemon_json or []) or "{}").get("data-root")
    return configured.rstrip("/") if isinstance(configured, str) and configured.strip("/") else schema.DOCKER_DATA_ROOT


def data_root_left(now: str, after: str, size_of: Callable[[str], int | None]) -> str | None:
    """The warning for a Docker data-root this run leaves unused, None when there is none: `now`, the rig's, when
    `after` (the one daemon.json sets once this run wrote it) differs; else Docker's default when `after` is not it.
    `size_of(path)`: its bytes, None when it does not exist. rigforge never deletes it."""
    moving = after != now
    old = now if moving else schema.DOCKER_DATA_ROOT if after != schema.DOCKER_DATA_ROOT else None
    if old is None or (size := size_of(old)) is None:
        return None
    if moving:
        said = f"this run sets Docker's data-root to {after} in {DAEMON_JSON}; {old}, the one it uses now,"
    else:
        said = f"{DAEMON_JSON} sets Docker's data-root to {after}; {old}, an earlier one that Docker no longer uses,"
    how = f"once the rig serves from {after}, remove it with: sudo rm -rf {old}"
    if _inside(after, old):
        how = f"{after} is inside it: remove the rest of it by hand"
    return f"{said} holds {_size(size)}; rigforge neither copies nor deletes it; {how}"


def _size(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def roots_inside(layout: HostLayout, data_root: str) -> list[str]:
    """rigforge_root and the model dir inside Docker's configured data-root, or holding it (its default:
    rigforge/model/schema.py)."""
    out = []
    for key, path in (("rigforge_root", layout.root), ("serving_model_dir", layout.models)):
        if key == "serving_model_dir" and _inside(path, layout.root):
            continue  # named with the root
        if problem := schema.data_root_overlap(key, path, data_root, f"Docker's data-root set in {DAEMON_JSON}"):
            out.append(problem)
    return out


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(f"{tree.rstrip('/')}/")


def changed_roots(layout: HostLayout, recorded: dict | None, size_of: Callable[[str], int | None]) -> list[str]:
    """Warnings for the trees an earlier deploy used (rig.json's `root` and `models`: `recorded`) that `layout` no
    longer uses, each with its size (`size_of(path)`: bytes, None when it is gone) and how to remove it (by hand when
    this run's trees are inside it); nothing is removed."""
    recorded = recorded or {}
    now = (layout.root, layout.models)
    out = []
    for key, name in (("root", "rigforge_root"), ("models", "serving_model_dir")):
        tree = recorded.get(key)
        if not isinstance(tree, str) or not tree.startswith("/") or any(_inside(tree, new) for new in now):
            continue  # not recorded, or still in use
        if key == "models" and isinstance(recorded.get("root"), str) and _inside(tree, recorded["root"]):
            continue  # named with the old root
        if (size := size_of(tree)) is None:
            continue  # gone already
        how = f"once the rig serves from the new one, remove it with: sudo rm -rf {tree}"
        if inside := [new for new in now if _inside(new, tree)]:
            are = "is" if len(inside) == 1 else "are"
            how = f"this run's {' and '.join(inside)} {are} inside it: remove the rest of it by hand"
        out.append(
            f"{name} changed: {tree}, the earlier deploy's (recorded in {layout.rig_json}), holds "
            f"{size / 1e9:.1f} GB and is no longer used; rigforge leaves it as it is; {how}"
        )
    return out
