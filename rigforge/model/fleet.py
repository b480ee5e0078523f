"""The desired state of every host of a run, built once on the controller (docs/architecture.md); a problem refuses
only the host whose data is wrong. `host_data` and `plan_for` are the only reads of host data. No pyinfra, no host.
"""

import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol

from rigforge.groups import GATEWAY, MONITOR, REGISTRY, RIG, is_rig
from rigforge.layout import AssetDir, HostLayout
from rigforge.model import recipes, schema
from rigforge.model.catalog import CatalogError, load_catalog
from rigforge.model.knobs import docker_engine, gpu_power, images, nvidia_driver, serving, site, weights
from rigforge.model.knobs import gateway as gateway_knobs
from rigforge.model.knobs import monitor as monitor_knobs
from rigforge.model.knobs import registry as registry_knobs
from rigforge.model.knobs.roles import RoleKnobs
from rigforge.model.pins import GitPin, HfPin, Lock, LockError, load_lock
from rigforge.model.recipes import RecipeError
from rigforge.model.registry import RegistryPlan
from rigforge.model.registry import build as registry_build
from rigforge.model.schema import Settings, SettingsError, apply_overrides, power_caps, settings_from_host_data
from rigforge.observe import obtain


class InventoryHost(Protocol):
    """What `build` reads of a host: pyinfra's Host, or any object with its name, groups and data (`.get`)."""

    name: str
    groups: Sequence[str]
    data: Any  # pyinfra's HostData, or a mapping


class ServedVariant(Protocol):
    """What a deploy, status and verify need of a variant, a catalog seed or a recipe-repo slug alike."""

    name: str
    image: str  # the image reference it runs (pinned by the lock when the lock knows its digest)
    port: int  # default API port
    gpus: int  # tensor-parallel size
    min_card_mib: int  # smallest card it fits without the 20 GB override
    uses_dflash: bool  # DFlash: FP16 KV, no 20 GB override
    sources: tuple[str, ...]  # lock git entries it mounts
    assets: tuple[str, ...]  # lock hf entries it loads
    asset_dirs: tuple[AssetDir, ...]  # where each of `assets` lands, and its size until the lock knows, in order
    served_model: str  # the model name /v1/models lists
    manifest_extra: Mapping[str, Any]  # what rig.json records about the variant's source
    successor: str | None  # the recipe repo's live variant to move to when this one's image is gone everywhere

    # serve dir and units; raises SettingsError / RecipeError naming a setting the variant cannot take
    def files(self, s: Settings, layout: HostLayout, gpu_count: int, host_data: bool = False) -> dict[str, str]: ...


@dataclass(frozen=True)
class PlannedAsset:
    name: str
    dir: str
    pin: HfPin
    approx_bytes: int = 0  # the variant's estimate, for the disk check while the lock has no sizes

    @property
    def bytes(self) -> int:
        return self.pin.total_size or self.approx_bytes


@dataclass(frozen=True)
class Plan:
    host: str
    variant: ServedVariant
    settings: Settings  # validated settings, image pinned (as the rig pulls it: obtain.pulled_as), token included
    layout: HostLayout  # every path and name on the rig
    sources: tuple[GitPin, ...]  # lock entries of the git sources, in the variant's order
    assets: tuple[PlannedAsset, ...]  # lock entries of the weights, in the variant's order
    caps: Mapping[int, int]  # power cap in watts per GPU index, covering the GPUs present
    knobs: RoleKnobs  # every role's knobs, typed, defaults applied, from the host data the plan was checked against
    files: Mapping[str, str] = field(repr=False)  # every rendered file: serve dir and units, {name: text}
    # the lock's image, `ref@sha256:...` (host data's serving_image if set): what the fleet registry copies from
    # upstream and the sources are asked for; `image` is the reference the rig pulls and runs it by
    locked_image: str
    lock: Lock | None = None
    # HF token: host data, else the controller's env; for the weights download only: no rendered file holds it
    token: str | None = field(default=None, repr=False)
    cap_units: tuple[str, ...] = ()  # the rig's other cap writers found at boot (shown; they order nothing)

    @property
    def image(self) -> str:
        """The reference the rig pulls and its compose file runs: the lock's image, or the fleet registry's copy of it
        for an image of another registry than Docker Hub (obtain.pulled_as)."""
        return self.settings.image or self.variant.image

    @property
    def port(self) -> int:
        return self.settings.port or self.variant.port

    @property
    def gpu_power_hold(self) -> bool:
        """Whether the cap hold's timer runs (host data gpu_power_hold, default on)."""
        return bool(self.knobs.gpu_power.gpu_power_hold)

    @property
    def boot_units(self) -> dict[str, bool]:
        """{unit: enabled at boot} for the units the deploy enables, or keeps disabled, besides the vLLM instance:
        the power and settle units and the metrics timer on, the cap hold's timer as gpu_power_hold says."""
        declared = {unit: True for unit in self.layout.enabled_at_boot}
        declared[self.layout.hold_timer] = self.gpu_power_hold
        return declared

    @property
    def toolkit_version(self) -> str | None:
        """The toolkit version installed and held: host data's, else the lock's; None: the latest, nothing held."""
        pin = self.lock.toolkit if self.lock else None
        return self.knobs.docker.nvidia_toolkit_version or (pin.version if pin else None)

    @property
    def manifest(self) -> dict:
        """rig.json's content, before the GPUs and the time the serving role adds."""
        return {
            "variant": self.variant.name,
            "unit": self.layout.vllm_unit,
            "port": self.port,
            "root": self.layout.root,  # a changed root is named (roles/site.py)
            "models": self.layout.models,
            "image": self.image,
            "git": {pin.name: pin.commit for pin in self.sources},
            "hf": {asset.name: asset.pin.revision for asset in self.assets},
            **self.variant.manifest_extra,
        }


def resolve(name: str, lock: Lock, opt_in: bool) -> ServedVariant:
    """The variant called `name`: a seed of the catalog, else a live slug of the locked recipe repo."""
    seeds = load_catalog().variants
    if name in seeds:
        return seeds[name]
    if "/" in name:  # engine/name: the registry's form
        return recipes.find(name, lock, opt_in)
    raise CatalogError(
        f"unknown variant {name!r}; choose one of: {', '.join(seeds)} (or a recipe-repo slug such as vllm/dual)"
    )


def variant_problems(entry_variant: str | None, data_variant: Any) -> tuple[str | None, list[str]]:
    """(this host's variant, problems): the entry point's and host data's must agree; never switched silently."""
    if data_variant is not None and not isinstance(data_variant, str):
        names = ", ".join(load_catalog().variants)
        return None, [f"rigforge_variant must be a variant name, got {data_variant!r}; choose one of: {names}"]
    if entry_variant and data_variant and data_variant != entry_variant:
        return None, [
            f"this entry point deploys {entry_variant} but host data sets rigforge_variant={data_variant!r}; "
            f"run deploy/site.py to serve {data_variant}, or set rigforge_variant: {entry_variant} "
            "(or remove it) to serve this one."
        ]
    if not (name := entry_variant or data_variant):
        return None, [f"rigforge_variant is not set; choose one of: {', '.join(load_catalog().variants)}"]
    return name, []


def port_problems(port: int, data: Mapping[str, Any]) -> list[str]:
    """The API port may not be the rig's SSH port (host data ssh_port, else 22), nor below 1024 unless host data
    serving_allow_privileged_port; empty when `port` is fine."""
    ssh = int(data.get("ssh_port") or 22)
    if port == ssh:
        return [f"serving_port {port} is this rig's SSH port; choose another, e.g. 8011 (the variants use 8010-8014)"]
    if port < 1024 and not data.get("serving_allow_privileged_port"):
        return [
            f"serving_port {port} is below 1024; choose 1024 or above, e.g. 8011, or set "
            "serving_allow_privileged_port: true to publish it there"
        ]
    return []


def build_plan(
    host: str,
    data: Mapping[str, Any],
    entry: str | ServedVariant | None = None,
    *,
    gpus: int | None = None,
    cap_units: Sequence[str] = (),
    problems: Sequence[str] = (),
    deployable: bool = True,
    registry: RegistryPlan | None = None,
) -> tuple[Plan | None, list[str]]:
    """(this host's plan, or None; every problem, the knob checks' `problems` first). `entry`: a variant name or object
    (None: host data's); `gpus`: None for the variant's; `deployable`: refuse unresolved lock entries (a deploy);
    `registry`: the fleet registry the rig pulls another registry's image from (obtain.pulled_as)."""
    given = None if isinstance(entry, str | None) else entry
    name, found = variant_problems(given.name if given else entry, data.get("rigforge_variant"))
    problems = [*problems, *found]
    try:  # looked up even when a knob is wrong: one refusal names every problem
        lock = load_lock(data["rigforge_lock"])
        if name is None:
            return None, problems
        if not deployable and not given and "/" in name:  # a slug not locked yet: shown with unresolved pins
            lock = recipes.provisional(name, lock, bool(data.get("rigforge_recipe_opt_in")))
        variant = given or resolve(name, lock, bool(data.get("rigforge_recipe_opt_in")))
        lock.require(git=variant.sources, hf=variant.assets, resolved=deployable)
    except (CatalogError, RecipeError, LockError) as exc:
        return None, [*problems, str(exc)]
    try:
        settings = apply_overrides(Settings(), settings_from_host_data(data))
    except SettingsError:
        return None, problems  # the roles' knob checks named every bad key already
    locked_image = settings.image or lock.pinned(variant.image)  # by digest once known
    settings = replace(settings, image=obtain.pulled_as(locked_image, registry))
    count = gpus or variant.gpus
    layout = HostLayout(root=settings.root, model_dir=settings.model_dir, variant=variant.name)
    try:
        files = variant.files(settings, layout, count, host_data=True)  # the power unit for these caps among them
    except (SettingsError, RecipeError) as exc:  # a setting valid alone that this variant cannot take
        problems.append(str(exc))
    problems += overrides_beyond(settings, count)
    problems += port_problems(settings.port or variant.port, data)
    if problems:
        return None, problems
    return Plan(
        host=host,
        variant=variant,
        settings=settings,
        layout=layout,
        sources=tuple(lock.git[name] for name in variant.sources),
        assets=tuple(PlannedAsset(a.asset, a.dir, lock.hf[a.asset], a.approx_bytes) for a in variant.asset_dirs),
        caps=MappingProxyType(power_caps(count, settings)),  # every index < count: checked above
        cap_units=tuple(cap_units),
        knobs=RoleKnobs.of(data),
        files=MappingProxyType(files),
        locked_image=locked_image,
        lock=lock,
        token=data.get("hf_token") or os.environ.get("RIGFORGE_HF_TOKEN") or os.environ.get("HF_TOKEN") or None,
    ), []


def overrides_beyond(settings: Settings, count: int) -> list[str]:
    """The refusal when gpu_power_limits names a GPU index the rig does not have (`count` GPUs)."""
    absent = sorted(index for index, _ in settings.power_limits if index >= count)
    if not absent:
        return []
    return [
        f"gpu_power_limits names GPU(s) {absent} but this rig has {count} GPU(s) (0..{count - 1}); "
        "remove those entries from gpu_power_limits."
    ]


def for_cards(plan: Plan, gpus: int | None, cap_units: Iterable[str]) -> tuple[Plan | None, list[str]]:
    """`plan` for the cards the rig's probe shows: `gpus` GPUs (None: as planned) and the other writers of caps it
    found (`cap_units`). The cheap pure step after the one build: the caps follow the count, and so do the files
    rendered from it (the power unit, the settle stage and the cap hold; on a rig with more cards than the variant's
    tensor-parallel size, the serve files that pin it to the first ones, hardware.serving_env), re-rendered from the
    plan's own settings. Nothing else is rebuilt: the lock is not read again, nor the variant resolved."""
    if gpus is None or gpus == len(plan.caps):
        return replace(plan, cap_units=tuple(cap_units)), []
    problems = overrides_beyond(plan.settings, gpus)
    if problems:
        return None, problems
    try:
        files = plan.variant.files(plan.settings, plan.layout, gpus, host_data=True)
    except (SettingsError, RecipeError) as exc:  # a setting this variant cannot take on this many cards
        return None, [str(exc)]
    caps = MappingProxyType(power_caps(gpus, plan.settings))
    return replace(plan, caps=caps, files=MappingProxyType(files), cap_units=tuple(cap_units)), []


# every role's knobs host data may set, checked by every plan
KNOBS = (nvidia_driver, docker_engine, gpu_power, weights, serving, gateway_knobs, registry_knobs, monitor_knobs)


@dataclass(frozen=True)
class Fleet:
    roles: Mapping[str, frozenset[str]]  # every host's roles, in inventory order
    plans: Mapping[str, Plan | None]  # every rig's plan (None: refused, see problems)
    problems: Mapping[str, tuple[str, ...]]  # every rig's problems with its plan
    registry_host: str | None = None
    registry: RegistryPlan | None = None
    registry_problems: tuple[str, ...] = ()
    # the monitor's scrape targets: {job: ((host, "address:port"), ...)}: every rig's node exporter and vLLM, every
    # gateway's HAProxy exporter
    targets: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    # every host's data with every knob's default applied (`host_data`), and how pyinfra's sudo is set for it
    settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    sudo: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def data(self, name: str) -> Mapping[str, Any]:
        """Host `name`'s data, defaults applied: what its fleet roles' knob checks (gateway, monitor) read."""
        return self.settings[name]

    def knobs(self, name: str) -> RoleKnobs:
        """Host `name`'s knobs, typed, defaults applied: what a host without a plan (a gateway, monitor or registry
        host) is set up from, once its role's knob checks passed. A rig's plan carries its own (`Plan.knobs`)."""
        return RoleKnobs.of(self.settings[name])

    def gateway_hosts(self) -> dict[str, bool]:
        """{gateway host: whether its commands run with sudo}, in inventory order: where a rig drains and rejoins."""
        return {name: bool(self.sudo[name].get("_sudo")) for name, roles in self.roles.items() if GATEWAY in roles}

    def has(self, name: str, role: str) -> bool:
        return role in self.roles.get(name, ())

    def is_rig(self, name: str) -> bool:
        return self.has(name, RIG)

    def rigs(self) -> list[Plan]:
        """The plans of the rigs this run deploys (refused ones left out), in inventory order."""
        return [p for p in self.plans.values() if p is not None]

    def left_out(self) -> dict[str, str]:
        """{rig: the first problem that refused its plan}: what the gateway and registry hosts warn about."""
        return {name: problems[0] for name, problems in self.problems.items() if self.plans.get(name) is None}

    @property
    def monitors(self) -> tuple[str, ...]:
        return tuple(name for name, roles in self.roles.items() if MONITOR in roles)

    @property
    def images(self) -> tuple[str, ...]:
        """The locked images (ref@sha256:...) the rigs run, of any registry: what the fleet registry holds."""
        refs: set[str] = set()
        for plan in self.rigs():
            if obtain.parse(plan.locked_image).digest:
                refs.add(plan.locked_image)
        return tuple(sorted(refs))

    def completed(self, name: str, gpus: int | None, cap_units: Iterable[str]) -> tuple[Plan | None, list[str]]:
        """(rig `name`'s plan with what its probe shows (`for_cards`), or None; problems); never built again."""
        plan = self.plans.get(name)
        if plan is None:
            return None, list(self.problems.get(name, ()))
        return for_cards(plan, gpus, cap_units)


def build(
    hosts: Iterable[InventoryHost],
    variant: str | ServedVariant | None = None,
    *,
    gpus: int | None = None,
    deployable: bool = True,
    opt_in: bool = False,
) -> Fleet:
    """The fleet of `hosts` (with .name, .groups, .data) for `variant` (plan_for's entry); `opt_in`: every recipe.
    The registry first: a rig's plan names the fleet registry's copy of an image it pulls from there."""
    roles, plans, problems, datas, sudo = {}, {}, {}, {}, {}
    for h in hosts:
        sudo[h.name] = {key: h.data.get(key) for key in SUDO_KEYS if h.data.get(key)}
        mine = {g for g in (GATEWAY, REGISTRY, MONITOR) if g in h.groups}  # the groups it is in
        if is_rig(h):
            mine.add(RIG)
        roles[h.name] = frozenset(mine)
        datas[h.name] = {**host_data(h.data), "rigforge_recipe_opt_in": True} if opt_in else h.data
    reg_name = next((name for name, mine in roles.items() if REGISTRY in mine), None)  # opt-in: the group's first
    reg_data = host_data(datas[reg_name]) if reg_name else {}
    reg_problems = registry_knobs.validate(reg_data) if reg_name else []
    reg = registry_build(reg_name, reg_data) if reg_name and not reg_problems else None
    for name, mine in roles.items():
        if RIG in mine:
            plans[name], found = plan_for(name, datas[name], variant, gpus, deployable, registry=reg)
            problems[name] = tuple(found)
    gateways = {name: host_data(datas[name]) for name, mine in roles.items() if GATEWAY in mine}
    return Fleet(
        roles=MappingProxyType(roles),
        plans=MappingProxyType(plans),
        problems=MappingProxyType(problems),
        registry_host=reg_name,
        registry=reg,
        registry_problems=tuple(reg_problems),
        targets=MappingProxyType(targets(plans.values(), gateways, {n for n, r in roles.items() if MONITOR in r})),
        settings=MappingProxyType({name: host_data(data) for name, data in datas.items()}),
        sudo=MappingProxyType(sudo),
    )


def targets(
    plans: Iterable[Plan | None], gateways: Mapping[str, Mapping], monitors: Collection[str] = ()
) -> dict[str, tuple[tuple[str, str], ...]]:
    """{job: ((host, "address:port"), ...)}: each rig and gateway where the monitor host reaches it. A rig is scraped
    at its gateway_address, else its name (node exporter, and its server); a gateway at its gateway_bind_address,
    else 127.0.0.1 when it is the monitor host itself, else its name (HAProxy's metrics port). A rig's server
    is a target of its engine's job: "vllm", or "llamacpp" when its llama.cpp recipe enables llama-server's metrics
    (--metrics; without it llama-server exports none, and the rig has no serving target)."""
    rigs = [(p.host, p.knobs.gateway.gateway_address or p.host, p) for p in plans if p is not None]
    engine = {p.host: getattr(p.variant, "engine", "vllm") for _, _, p in rigs}  # a seed variant is vLLM
    exported = {p.host: getattr(p.variant, "metrics", True) for _, _, p in rigs}
    gws = [(n, d.get("gateway_bind_address") or ("127.0.0.1" if n in monitors else n), d) for n, d in gateways.items()]
    return {
        "node": tuple((name, f"{addr}:{p.knobs.monitor.monitor_node_exporter_port}") for name, addr, p in rigs),
        "vllm": tuple((name, f"{addr}:{p.port}") for name, addr, p in rigs if engine[name] == "vllm"),
        "llamacpp": tuple(
            (name, f"{addr}:{p.port}") for name, addr, p in rigs if engine[name] == "llama.cpp" and exported[name]
        ),
        "haproxy": tuple((name, f"{addr}:{data['gateway_metrics_port']}") for name, addr, data in gws),
    }


SUDO_KEYS = ("_sudo", "_sudo_user")  # pyinfra's connection arguments a host's data may set


def data_of(host: InventoryHost) -> dict[str, Any]:
    """A host's data with every knob's default applied, read for an entry point that builds no fleet
    (deploy/images_load.py); a fleet's hosts' data is the fleet's (`Fleet.data`)."""
    return host_data(host.data)


def host_data(data: Mapping[str, Any]) -> dict[str, Any]:
    """A host's data (host.data or a mapping) for every role's knob and setting, defaults applied."""
    defaults = {key: value for module in (*KNOBS, images) for key, value in module.DEFAULTS.items()} | site.DEFAULTS
    keys = {*defaults, *schema.HOST_KEYS.values(), *site.RETIRED, "ssh_port"}
    return {key: data.get(key, defaults.get(key)) for key in sorted(keys)}


def plan_for(
    name: str,
    data: Mapping[str, Any],
    entry: str | ServedVariant | None = None,
    gpus: int | None = None,
    deployable: bool = True,
    cap_units: Sequence[str] = (),
    registry: RegistryPlan | None = None,
) -> tuple[Plan | None, list[str]]:
    """(host `name`'s plan, or None; every problem of the knob checks and `build_plan`) from its host data;
    `registry`: the fleet's (`Fleet.registry`), None when it has none."""
    data = host_data(data)
    problems = [problem for module in (site, *KNOBS) for problem in module.validate(data)]
    try:
        return build_plan(
            name,
            data,
            entry,
            gpus=gpus,
            cap_units=cap_units,
            problems=problems,
            deployable=deployable,
            registry=registry,
        )
    except (CatalogError, LockError, RecipeError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return None, [*problems, f"cannot prepare this host: {type(exc).__name__}: {exc}"]
