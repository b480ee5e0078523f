"""The order of roles for one rig: plan, preflight, repair of an interrupted run, driver, GPU check, container
runtime, power, sources, weights, serving.

`prepare()` builds the host's plan on the controller, once: every role module's `validate(data)` (host-data keys
with the roles' defaults applied), the variant, the lock entries it needs, the settings for this variant, the
GPU count and the token. Every problem comes out in one message naming the host and the host-data keys, as the
host's first operation, so nothing on it changes; other hosts carry on, and no bad value can raise while
operations are prepared. The roles then take the plan and read nothing else.

Which variant: `deploy/<variant>.py` deploys that variant; `deploy/site.py` deploys the host's
`rigforge_variant`. A host whose `rigforge_variant` names another variant than the entry point is refused
(never switched silently): use deploy/site.py for fleets with a variant per host.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.server import Command

from rigforge import knobs, recipes
from rigforge.catalog import CatalogError, Variant, load_catalog
from rigforge.hardware import Needs, format_problems
from rigforge.pins import LockError, default_lock_path, load_lock
from rigforge.plan import Plan, build_plan, cap_index_problems, gpu_count, variant_problems
from rigforge.recipes import RecipeError
from rigforge.render import (
    HOST_KEYS,
    Settings,
    apply_overrides,
    settings_from_host_data,
    variant_setting_problems,
)
from roles import docker_engine, gpu_power, nvidia_driver, preflight, serving, sources, speedups, weights
from roles.facts import snapshot
from roles.facts.hfweights import WeightsState
from roles.facts.nvidia import NvidiaGpus, NvidiaPciGpus
from roles.operations import recover
from roles.operations.checks import gpus_fit, refuse
from roles.operations.hfweights import stale_files

IMAGE_GB = 9  # the vLLM nightly image on disk (HARDWARE.md)
DEFAULTS = {
    "rigforge_variant": None,  # variant this host serves (deploy/site.py); deploy/<variant>.py must agree
    "rigforge_lock": str(default_lock_path()),  # lock file read on the controller
    "rigforge_recipe_opt_in": False,  # allow a recipe-repo slug whose status is experimental/incubating/deprecated
}
ROLES = (preflight, nvidia_driver, docker_engine, gpu_power, sources, weights, serving)
RETIRED = {  # host-data keys earlier releases read: refused rather than silently ignored
    "nvidia_driver_packages": "the driver table chooses the packages; set nvidia_driver_source, "
    "nvidia_driver_branch or nvidia_driver_flavor instead",
}
snapshot.install()  # facts from one batched probe per rig while nothing changed (roles/facts/snapshot.py)
speedups.install()  # pyinfra's per-operation controller work, same results (roles/speedups.py)


def validate(data) -> list[str]:
    problems = []
    if not isinstance(data.get("rigforge_lock"), str | os.PathLike):
        problems.append(f"rigforge_lock must be the path of a lock file, got {data.get('rigforge_lock')!r}")
    problems += knobs.boolean(data, "rigforge_recipe_opt_in")
    for key, advice in RETIRED.items():
        if data.get(key) is not None:
            problems.append(f"{key} is no longer read: {advice}; remove it from host data.")
    return problems


def host_data() -> dict:
    """This host's data for every role's knobs and the settings' keys, role defaults applied."""
    defaults = {key: value for module in ROLES for key, value in module.DEFAULTS.items()} | DEFAULTS
    keys = {*defaults, *HOST_KEYS.values(), *RETIRED}
    return {key: host.data.get(key, defaults.get(key)) for key in sorted(keys)}


def _token(data: dict) -> str | None:
    return data.get("hf_token") or os.environ.get("RIGFORGE_HF_TOKEN") or os.environ.get("HF_TOKEN") or None


def _gather(entry: str | Variant | None, asset_dirs: Mapping[str, str] | None) -> tuple[Plan | None, list[str]]:
    data = host_data()
    problems = validate(data)
    for module in ROLES:
        check = getattr(module, "validate", None)  # a role without knobs to check has none
        if check:
            problems += check(data)
    catalog = load_catalog()
    given = entry if isinstance(entry, Variant) else None
    names = [*catalog.names, *([given.name] if given else [])]
    wanted = (given.name if given else entry) or data.get("rigforge_variant")
    if isinstance(wanted, str) and "/" in wanted and wanted not in names:
        names.append(wanted)  # a recipe-repo slug: looked up below in the locked recipe repo
    name, variant_issues = variant_problems(given.name if given else entry, data.get("rigforge_variant"), names)
    problems += variant_issues
    lock = None
    try:
        lock = load_lock(data["rigforge_lock"])
    except LockError as exc:
        problems.append(str(exc))
    if problems or name is None or lock is None:
        return None, problems

    token = _token(data)  # host data hf_token, else the controller's RIGFORGE_HF_TOKEN / HF_TOKEN: into .env too
    settings = apply_overrides(Settings(), {**settings_from_host_data(data), **({"hf_token": token} if token else {})})
    if given is None and name not in catalog.variants:
        try:
            variant = recipes.live_variant(name, settings, lock, bool(data.get("rigforge_recipe_opt_in")))
        except (RecipeError, LockError) as exc:
            return None, [*problems, str(exc)]
        settings = replace(settings, image=variant.image)
        asset_dirs = {**dict(variant.asset_dirs), **(asset_dirs or {})}
    else:
        variant = given or catalog.variant(name)
        problems += variant_setting_problems(variant, settings, host_data=True)
        settings = replace(settings, image=settings.image or lock.pinned(variant.image))  # by digest once known
    try:
        lock.require(git=variant.sources, hf=variant.assets)
    except LockError as exc:
        problems.append(str(exc))
        return None, problems

    smi = host.get_fact(NvidiaGpus)
    gpus = gpu_count(variant.gpus, len(smi), host.get_fact(NvidiaPciGpus))
    problems += cap_index_problems(settings, gpus)

    dirs = {asset: (asset_dirs or {}).get(asset) or catalog.assets[asset].dir for asset in variant.assets}
    layout = settings.layout(variant.name)
    stale = {
        asset: stale_files(
            lock.hf[asset],
            host.get_fact(WeightsState, dest=layout.asset_dir(dirs[asset]), staging=layout.weights_staging(asset)),
        )
        for asset in variant.assets
    }
    gated = [lock.hf[asset].repo for asset in variant.assets if lock.hf[asset].gated and stale[asset]]
    if gated and not token:
        problems.append(
            f"{', '.join(gated)} {'is' if len(gated) == 1 else 'are'} gated, not yet fetched, and no HF token is set: "
            "set host data hf_token or RIGFORGE_HF_TOKEN / HF_TOKEN on the controller"
        )
    if problems:
        return None, problems
    plan = build_plan(host.name, variant, settings, lock, dirs, gpus, data, token)
    return plan, []


def prepare(variant: str | Variant | None = None, asset_dirs: Mapping[str, str] | None = None) -> Plan | None:
    """This host's plan, or None after queueing one operation that refuses the host naming every problem.

    `variant`: a catalog name (deploy/<variant>.py), None (deploy/site.py: host data's rigforge_variant), or a
    variant object; `asset_dirs` overrides the catalog's dir of an asset under the model dir.
    """
    try:
        plan, problems = _gather(variant, asset_dirs)
    except (CatalogError, LockError, ValueError, TypeError, KeyError, AttributeError) as exc:
        plan, problems = None, [f"cannot prepare this host: {type(exc).__name__}: {exc}"]
    if plan is None:
        message = format_problems(host.name, problems, what="rigforge refused")
        refuse(name=f"Refuse {host.name}: {len(problems)} problem(s) in host data", message=message)
    return plan


def _disk_needed(plan: Plan) -> int:
    """Bytes still to land on the model disk: weights not yet stamped, plus the image when it will be pulled."""
    needed = 0
    for asset in plan.assets:
        state = host.get_fact(
            WeightsState, dest=plan.layout.asset_dir(asset.dir), staging=plan.layout.weights_staging(asset.name)
        )
        if stale_files(asset.pin, state):  # the lock's size; a recipe's size_gb until the lock knows it
            needed += asset.pin.total_size or dict(getattr(plan.variant, "sizes", ())).get(asset.name, 0)
    if plan.data["rigforge_manage_services"]:
        present = host.get_fact(
            Command, command=f"docker image inspect {plan.image} >/dev/null 2>&1 && echo yes || true"
        )
        needed += 0 if present == "yes" else int(IMAGE_GB * 1e9)
    return needed


def needs(plan: Plan) -> Needs:
    v = plan.variant
    return Needs(v.name, v.gpus, v.min_card_mib, v.uses_dflash, plan.layout.models, _disk_needed(plan))


@deploy("rigforge site", data_defaults=DEFAULTS)
def provision(variant_name: str | None = None):
    plan = prepare(variant_name)
    if plan is None:
        return
    host_needs = needs(plan)
    preflight.check(host_needs, plan.data)
    recover.packages(name="Repair packages an interrupted run left half-installed (dpkg --configure -a)")
    recover.uploads_cleared(name="Remove uploads an interrupted run left in the upload dir")
    nvidia_driver.install()
    gpus_fit(
        name=f"Check the GPUs now that the driver answers ({plan.variant.gpus}x {plan.variant.min_card_mib} MiB)",
        needs=host_needs,
        caps=dict(plan.caps),
        data=dict(plan.data),
    )
    docker_engine.install()
    gpu_power.apply(plan)
    sources.apply(plan)
    weights.apply(plan)
    serving.apply(plan)
