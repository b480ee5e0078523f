"""The order of roles for one rig: validate, preflight, driver, container runtime, power, sources, weights, serving.

Everything that can be checked on the controller (variant name, settings, lock) is checked first; a problem
fails only that host, with one message, before any operation changes it.
"""

from __future__ import annotations

import os
from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.files import File
from pyinfra.facts.server import Command

from rigforge.catalog import CatalogError, load_catalog
from rigforge.pins import LockError, load_lock
from rigforge.render import (
    Settings,
    SettingsError,
    apply_overrides,
    check_variant_settings,
    power_caps,
    render_power_unit,
    settings_from_host_data,
)
from roles import docker_engine, gpu_power, nvidia_driver, preflight, serving, sources, weights
from roles.operations.checks import Needs, refuse

IMAGE_GB = 9  # the vLLM nightly image on disk (HARDWARE.md)
REPO = Path(__file__).resolve().parent.parent
DEFAULTS = {
    "rigforge_variant": None,  # variant this host serves (deploy/site.py); deploy/<variant>.py sets it
    "rigforge_lock": str(REPO / "rigforge.lock.yaml"),  # lock file read on the controller
}


def _settings() -> Settings:
    raw = settings_from_host_data(host.data)
    token = host.data.get("hf_token") or os.environ.get("RIGFORGE_HF_TOKEN") or os.environ.get("HF_TOKEN")
    if token:
        raw["hf_token"] = token
    return apply_overrides(Settings(), raw, where=f"host data of {host.name}")


def plan(variant_name: str | None):
    """Everything the roles need, validated on the controller. Raises with a message naming host and key."""
    catalog = load_catalog()
    name = variant_name or host.data.get("rigforge_variant")
    if not name:
        raise CatalogError(f"rigforge_variant is not set; choose one of: {', '.join(catalog.names)}")
    variant = catalog.variant(name)
    settings = _settings()
    check_variant_settings(variant, settings)
    lock = load_lock(host.data.get("rigforge_lock") or DEFAULTS["rigforge_lock"])
    lock.require(git=variant.sources, hf=variant.assets)
    return variant, settings, lock


def _disk_needed(variant, settings, lock, assets) -> int:
    """Bytes still to land on the model disk: weights not yet stamped, plus the image when it will be pulled."""
    needed = sum(
        lock.hf[name].total_size
        for name, dirname in assets.items()
        if not host.get_fact(File, path=f"{settings.models}/{dirname}/.rigforge-stamp.json")
    )
    image = settings.image or variant.image
    if host.data.get("rigforge_manage_services", True):
        present = host.get_fact(Command, command=f"docker image inspect {image} >/dev/null 2>&1 && echo yes || true")
        needed += 0 if present == "yes" else int(IMAGE_GB * 1e9)
    return needed


@deploy("rigforge site", data_defaults=DEFAULTS)
def provision(variant_name: str | None = None):
    try:
        variant, settings, lock = plan(variant_name)
    except (CatalogError, SettingsError, LockError) as exc:
        refuse(name=f"Refuse {host.name}: {exc}", message=f"{host.name}: {exc}")
        return

    assets = {name: load_catalog().assets[name].dir for name in variant.assets}
    needed = _disk_needed(variant, settings, lock, assets)
    preflight.check(
        Needs(variant.name, variant.gpus, variant.min_card_mib, variant.uses_dflash, settings.models, needed)
    )
    nvidia_driver.install()
    docker_engine.install()
    gpu_power.apply(render_power_unit(power_caps(variant.gpus, settings)))
    sources.apply(lock, list(variant.sources))
    weights.apply(lock, assets)
    pins = {
        "image": settings.image or variant.image,
        "git": {name: lock.git[name].commit for name in variant.sources},
        "hf": {name: lock.hf[name].revision for name in variant.assets},
    }
    serving.apply(variant, settings, pins)
