"""The desired state of one rig: a frozen `Plan`, built once from its host data, the lock and the variant source.

    host data + lock + variant source --build--> Plan --render/roles--> files and operations on the rig

`build()` is the only place that turns host data into settings and a variant: the deploy (roles/site.py),
`rigforge status`, `rigforge verify` and `rigforge render` all call it, so they agree on what a rig should be.
Every problem comes back at once, each naming the host-data key and what to do; a plan is built only when there
is none. Pure data: no pyinfra, no host (the caller passes the GPU count it observed).

A variant is anything with the `ServedVariant` shape. Two adapters implement it: the seed catalog
(rigforge/catalog.py, the design document's five) and the recipe registry (rigforge/recipes.py, live slugs of
the pinned recipe repo); no other code asks which kind a variant is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Protocol

from rigforge import recipes
from rigforge.boot import SETTLE_WINDOW_S
from rigforge.catalog import CatalogError, load_catalog
from rigforge.layout import HostLayout
from rigforge.pins import GitPin, HfPin, Lock, LockError, load_lock
from rigforge.recipes import RecipeError
from rigforge.render import settle_files
from rigforge.schema import Settings, SettingsError, apply_overrides, power_caps, settings_from_host_data


class ServedVariant(Protocol):
    """What a deploy, status and verify need of a variant, whichever source it comes from."""

    name: str
    image: str  # the image reference it runs (pinned by the lock when the lock knows its digest)
    port: int  # default API port
    gpus: int  # tensor-parallel size
    min_card_mib: int  # smallest card it fits without the 20 GB override
    uses_dflash: bool  # DFlash: FP16 KV, no 20 GB override
    sources: tuple[str, ...]  # lock git entries it mounts
    assets: tuple[str, ...]  # lock hf entries it loads
    asset_dirs: tuple[tuple[str, str], ...]  # (asset, dir under the model dir)
    sizes: tuple[tuple[str, int], ...]  # (asset, approximate bytes) until the lock knows the sizes
    served_model: str  # the model name /v1/models lists
    manifest_extra: Mapping[str, Any]  # what rig.json records about the variant's source
    successor: str | None  # the recipe repo's live variant to move to when this one's image is gone everywhere

    def files(self, s: Settings, layout: HostLayout, gpu_count: int) -> dict[str, str]: ...  # serve dir, units

    def setting_problems(self, s: Settings, host_data: bool = False) -> list[str]: ...


@dataclass(frozen=True)
class PlannedAsset:
    """One Hugging Face asset of the variant: its lock entry and the dir it lands in under the model dir."""

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
    settings: Settings  # validated settings, image pinned, token included
    layout: HostLayout  # every path and name on the rig
    sources: tuple[GitPin, ...]  # lock entries of the git sources, in the variant's order
    assets: tuple[PlannedAsset, ...]  # lock entries of the weights, in the variant's order
    caps: Mapping[int, int]  # power cap in watts per GPU index, covering the GPUs present
    data: Mapping[str, Any]  # validated host-data knobs of every role, defaults applied
    files: Mapping[str, str] = field(repr=False)  # every rendered file: serve dir and units, {name: text}
    lock: Lock | None = None
    token: str | None = field(default=None, repr=False)  # HF token: host data, else the controller's env
    cap_units: tuple[str, ...] = ()  # the rig's other cap writers found at boot (shown; they order nothing)

    @property
    def image(self) -> str:
        return self.settings.image or self.variant.image

    @property
    def port(self) -> int:
        return self.settings.port or self.variant.port

    @property
    def toolkit_version(self) -> str | None:
        """The NVIDIA Container Toolkit version installed and held: host data nvidia_toolkit_version, else the lock's
        `toolkit` pin; None (neither set) installs the latest and holds nothing."""
        pin = self.lock.toolkit if self.lock else None
        return self.data.get("nvidia_toolkit_version") or (pin.version if pin else None)

    @property
    def pins(self) -> dict:
        """What rig.json records about the pinned inputs."""
        return {
            "image": self.image,
            "git": {pin.name: pin.commit for pin in self.sources},
            "hf": {asset.name: asset.pin.revision for asset in self.assets},
        }

    @property
    def manifest(self) -> dict:
        """rig.json's content, before the GPUs and the time the serving role adds."""
        v = self.variant
        where = {"root": self.layout.root, "models": self.layout.models}  # a changed root is named (roles/site.py)
        return {"variant": v.name, "unit": self.layout.vllm_unit, "port": self.port, **where, **self.pins,
                **v.manifest_extra}  # fmt: skip


def resolve(name: str, lock: Lock, opt_in: bool) -> ServedVariant:
    """The variant called `name`: a seed of the catalog, else a live slug of the locked recipe repo."""
    catalog = load_catalog()
    if name in catalog.variants:
        return catalog.variants[name]
    if "/" in name:  # engine/name: the registry's form
        return recipes.find(name, lock, opt_in)
    raise CatalogError(
        f"unknown variant {name!r}; choose one of: {', '.join(catalog.names)} (or a recipe-repo slug such as vllm/dual)"
    )


def variant_problems(entry_variant: str | None, data_variant: Any) -> tuple[str | None, list[str]]:
    """Which variant this host serves, and problems choosing it.

    deploy/<variant>.py passes `entry_variant`; deploy/site.py passes None and host data decides. When both are
    set they must agree: a host whose `rigforge_variant` names another variant is refused, never switched
    silently (run deploy/site.py to follow host data, or change rigforge_variant).
    """
    names = ", ".join(load_catalog().names)
    if data_variant is not None and not isinstance(data_variant, str):
        return None, [f"rigforge_variant must be a variant name, got {data_variant!r}; choose one of: {names}"]
    if entry_variant and data_variant and data_variant != entry_variant:
        return None, [
            f"this entry point deploys {entry_variant} but host data sets rigforge_variant={data_variant!r}; "
            f"run deploy/site.py to serve {data_variant}, or set rigforge_variant: {entry_variant} "
            "(or remove it) to serve this one."
        ]
    name = entry_variant or data_variant
    if not name:
        return None, [f"rigforge_variant is not set; choose one of: {names}"]
    return name, []


def cap_index_problems(settings: Settings, count: int) -> list[str]:
    """Per-GPU overrides that name a GPU this rig does not have."""
    absent = sorted(index for index, _ in settings.power_limits if index >= count)
    if not absent:
        return []
    return [
        f"gpu_power_limits names GPU(s) {absent} but this rig has {count} GPU(s) (0..{count - 1}); "
        "remove those entries from gpu_power_limits."
    ]


def port_problems(port: int, data: Mapping) -> list[str]:
    """The API port may not be the rig's SSH port, nor below 1024 unless serving_allow_privileged_port."""
    ssh = int(data.get("ssh_port") or 22)
    if port == ssh:
        return [f"serving_port {port} is this rig's SSH port; choose another, e.g. 8011 (the variants use 8010-8014)"]
    if port < 1024 and not data.get("serving_allow_privileged_port"):
        return [
            f"serving_port {port} is below 1024; choose 1024 or above, e.g. 8011, or set "
            "serving_allow_privileged_port: true to publish it there"
        ]
    return []


def token_of(data: Mapping) -> str | None:
    """The HF token: host data hf_token, else the controller's RIGFORGE_HF_TOKEN / HF_TOKEN."""
    return data.get("hf_token") or os.environ.get("RIGFORGE_HF_TOKEN") or os.environ.get("HF_TOKEN") or None


def build(
    host: str,
    data: Mapping[str, Any],
    entry: str | ServedVariant | None = None,
    *,
    gpus: int | None = None,
    cap_units: Sequence[str] = (),
    problems: Sequence[str] = (),
    deployable: bool = True,
) -> tuple[Plan | None, list[str]]:
    """This host's plan, or None and every problem found.

    `data`: the host's knobs with the roles' defaults applied (rigforge/fleet.py `host_data`); `entry`: the variant of
    the entry point (deploy/<variant>.py) or a variant object, None to follow host data's rigforge_variant;
    `gpus`: the GPU count the rig shows (nvidia-smi, else the PCI bus), None for the variant's; `cap_units`: the
    rig's other cap writers at boot (facts/nvidia.py PowerCapUnits: shown, they order nothing); `problems`: ones
    the caller already found (the roles' own knob checks), reported with these; `deployable`: refuse lock entries
    the variant needs that are not resolved yet (a deploy), else accept them (status, verify, render).
    """
    problems = list(problems)
    given = None if entry is None or isinstance(entry, str) else entry
    name, found = variant_problems(given.name if given else entry, data.get("rigforge_variant"))
    problems += found
    lock = None
    try:
        lock = load_lock(data["rigforge_lock"])
    except LockError as exc:
        problems.append(str(exc))
    token = token_of(data)  # for the weights download only: no rendered file holds it
    try:
        settings = apply_overrides(Settings(), settings_from_host_data(data))
    except SettingsError:
        settings = None  # the roles' knob checks named every bad key already
    if problems or name is None or lock is None or settings is None:
        return None, problems
    try:
        if not deployable and not given and "/" in name:  # a slug not locked yet: shown with unresolved pins
            lock = recipes.provisional(name, lock, bool(data.get("rigforge_recipe_opt_in")))
        variant = given or resolve(name, lock, bool(data.get("rigforge_recipe_opt_in")))
        lock.require(git=variant.sources, hf=variant.assets, resolved=deployable)
    except (CatalogError, RecipeError, LockError) as exc:
        return None, [*problems, str(exc)]
    settings = replace(settings, image=settings.image or lock.pinned(variant.image))  # by digest once known
    count = gpus or variant.gpus
    problems += variant.setting_problems(settings, host_data=True) + cap_index_problems(settings, count)
    problems += port_problems(settings.port or variant.port, data)
    if problems:
        return None, problems
    caps = power_caps(count, settings)
    dirs, sizes = dict(variant.asset_dirs), dict(variant.sizes)
    layout = HostLayout(root=settings.root, model_dir=settings.model_dir, variant=variant.name)
    window = int(data.get("gpu_power_settle_window_s", SETTLE_WINDOW_S))
    files = dict(variant.files(settings, layout, count))  # the power unit for these caps among them
    if window != SETTLE_WINDOW_S:  # the settle stage as rendered there has the default window
        files |= settle_files(caps, window, layout)
    return Plan(
        host=host,
        variant=variant,
        settings=settings,
        layout=layout,
        sources=tuple(lock.git[name] for name in variant.sources),
        assets=tuple(PlannedAsset(a, dirs[a], lock.hf[a], sizes.get(a, 0)) for a in variant.assets),
        caps=MappingProxyType(dict(sorted(caps.items()))),
        cap_units=tuple(cap_units),
        data=MappingProxyType(dict(data)),
        files=MappingProxyType(files),
        lock=lock,
        token=token,
    ), []
