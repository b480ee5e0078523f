"""One validated plan per host: everything the roles need, decided once on the controller.

`roles/site.py` gathers every role's `validate(data)` and the variant's needs; only when there is no problem
does it build a `Plan` with `build_plan`. The roles take the plan and read nothing else: no raw host data, no
lock lookups, no token lookups. Pure data: no pyinfra, no host calls (site reads the facts it needs and
passes the results in).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from rigforge.catalog import Variant
from rigforge.layout import HostLayout
from rigforge.pins import GitPin, HfPin, Lock
from rigforge.render import Settings, power_caps


@dataclass(frozen=True)
class PlannedAsset:
    """One Hugging Face asset of the variant: its lock entry and the dir it lands in under the model dir."""

    name: str
    dir: str
    pin: HfPin


@dataclass(frozen=True)
class Plan:
    host: str
    variant: Variant  # any object with the catalog Variant's attributes (a seed variant or a recipe)
    settings: Settings  # validated serving/power settings (host-data keys applied)
    layout: HostLayout  # every path and name on the rig
    sources: tuple[GitPin, ...]  # lock entries of the git sources, in the variant's order
    assets: tuple[PlannedAsset, ...]  # lock entries of the weights, in the variant's order
    caps: Mapping[int, int]  # power cap in watts per GPU index, covering the GPUs present
    data: Mapping[str, Any]  # validated host-data knobs of every role, defaults applied
    lock: Lock | None = None
    token: str | None = field(default=None, repr=False)  # HF token, only set when an asset needs fetching

    @property
    def image(self) -> str:
        return self.settings.image or self.variant.image

    @property
    def port(self) -> int:
        return self.settings.port or self.variant.port

    @property
    def pins(self) -> dict:
        """What rig.json records about the pinned inputs."""
        return {
            "image": self.image,
            "git": {pin.name: pin.commit for pin in self.sources},
            "hf": {asset.name: asset.pin.revision for asset in self.assets},
        }


def gpu_count(variant_gpus: int, smi_gpus: int | None, pci_gpus: int | None) -> int:
    """How many GPUs the caps cover: what nvidia-smi shows, else what the PCI bus shows, else the variant's."""
    return smi_gpus or pci_gpus or variant_gpus


def cap_index_problems(settings: Settings, count: int) -> list[str]:
    """Per-GPU overrides that name a GPU this rig does not have."""
    absent = sorted(index for index, _ in settings.power_limits if index >= count)
    if not absent:
        return []
    return [
        f"gpu_power_limits names GPU(s) {absent} but this rig has {count} GPU(s) (0..{count - 1}); "
        "remove those entries from gpu_power_limits."
    ]


def variant_problems(entry_variant: str | None, data_variant: Any, names: list[str]) -> tuple[str | None, list[str]]:
    """Which variant this host serves, and problems choosing it.

    deploy/<variant>.py passes `entry_variant`; deploy/site.py passes None and host data decides. When both are
    set they must agree: a host whose `rigforge_variant` names another variant is refused, never switched
    silently (run deploy/site.py to follow host data, or change rigforge_variant).
    """
    if data_variant is not None and not isinstance(data_variant, str):
        choose = ", ".join(names)
        return None, [f"rigforge_variant must be a variant name, got {data_variant!r}; choose one of: {choose}"]
    if entry_variant and data_variant and data_variant != entry_variant:
        return None, [
            f"this entry point deploys {entry_variant} but host data sets rigforge_variant={data_variant!r}; "
            f"run deploy/site.py to serve {data_variant}, or set rigforge_variant: {entry_variant} "
            "(or remove it) to serve this one."
        ]
    name = entry_variant or data_variant
    if not name:
        return None, [f"rigforge_variant is not set; choose one of: {', '.join(names)}"]
    if name not in names:
        return None, [f"unknown variant {name!r}; choose one of: {', '.join(names)}"]
    return name, []


def build_plan(
    host: str,
    variant: Variant,
    settings: Settings,
    lock: Lock,
    asset_dirs: Mapping[str, str],
    gpus: int,
    data: Mapping[str, Any],
    token: str | None = None,
) -> Plan:
    """The frozen plan; call only once every problem check came back empty."""
    caps = power_caps(gpus, settings)
    return Plan(
        host=host,
        variant=variant,
        settings=settings,
        layout=settings.layout(variant.name),
        sources=tuple(lock.git[name] for name in variant.sources),
        assets=tuple(PlannedAsset(name, asset_dirs[name], lock.hf[name]) for name in variant.assets),
        caps=MappingProxyType(dict(sorted(caps.items()))),
        data=MappingProxyType(dict(data)),
        lock=lock,
        token=token,
    )
