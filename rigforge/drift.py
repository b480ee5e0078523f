"""Drift: the rig's observed state against its plan. Every check lives here once; `rigforge status` shows them
as a table, `rigforge verify` prints them and adds its live API probes.

    observe(host) -> (RigContext, Observed)      the plan for the rig, and the rig read in one batched probe
    checks(ctx, observed) -> [Check]              drift, one check per managed concern

The plan is the deploy's own (roles/site.py `plan_for`), for the variant the rig's manifest records, else host
data's. The rig is read through facts, the plan's requests in one remote command (roles/facts/probe.py `read`);
a fact the probe cannot answer is read on its own. Nothing on a rig is changed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pyinfra.facts.files import Sha256File

from rigforge import boot, inventory, obtain, power
from rigforge.driver_table import (
    DriverTableError,
    branch_for_cuda,
    branch_problem,
    cuda_for_driver,
    packages_for,
    version_key,
)
from rigforge.hardware import interconnect, small_override, vram_problems
from rigforge.layout import GATEWAY_ADMIN_SOCKET, NVIDIA_RUNTIME, SERVE_FILES, SETTLE_SCRIPT, SETTLE_UNIT, HostLayout
from rigforge.pins import LockError, load_lock
from rigforge.plan import Plan
from rigforge.render import POWER_UNIT, VLLM_UNIT
from rigforge.schema import Settings, power_caps
from roles.facts import probe
from roles.facts.apt import DebInstalledVersion
from roles.facts.docker import DockerImagePresent
from roles.facts.files import JsonFile
from roles.facts.gitpin import GitCheckout
from roles.facts.hfweights import WeightsState
from roles.facts.nvidia import (
    BootCaps,
    NvidiaGpus,
    NvidiaModuleVersion,
    NvidiaRunningDriver,
    NvidiaTopology,
    PowerCapUnits,
)
from roles.facts.serving import ApiAnswers, ComposeImages, ServiceState, runs_digest, serving
from roles.facts.system import OsRelease, SystemdUnitEnabled

PASS, FAIL, SKIP = "pass", "fail", "skip"
SKIPPED = "skipped (services not managed on this host)"


@dataclass
class Check:
    name: str
    status: str
    detail: str = ""


def check(name: str, problems: list[str], fine: str, hint: str = "") -> Check:
    """A check that fails with every problem (and `hint`), or passes saying what was fine."""
    return Check(name, FAIL, "; ".join(problems) + hint) if problems else Check(name, PASS, fine)


class Observed:
    """The rig as read for a plan: answers from one batched probe, anything else read live (same interface as
    pyinfra's host.get_fact)."""

    def __init__(self, host, requests=()):
        self.host = host
        self.answers = probe.read(host, list(requests)) if requests else {}

    def get_fact(self, cls, **kwargs):
        key = probe.fact_key(cls, kwargs)
        return self.answers[key] if key in self.answers else self.host.get_fact(cls, **kwargs)


@dataclass
class RigContext:
    """What the controller knows about a rig: its plan (None when host data or the lock cannot give one), its
    manifest, and the problems building the plan."""

    name: str
    data: dict  # host data, the roles' defaults applied (roles/site.py host_data)
    plan: Plan | None = None
    layout: HostLayout = field(default_factory=HostLayout)
    variant_name: str | None = None
    variant_from: str = ""
    lock: Any = None  # rigforge.pins.Lock or None
    lock_error: str | None = None
    manifest: dict | None = None
    problems: list[str] = field(default_factory=list)
    cap_units: dict = field(default_factory=dict)  # the rig's other cap writers at boot (PowerCapUnits)

    @property
    def manage(self) -> bool:
        return bool(self.data["rigforge_manage_services"])

    @property
    def variant(self):
        return self.plan.variant if self.plan else None

    @property
    def settings(self) -> Settings:
        return self.plan.settings if self.plan else Settings()

    @property
    def port(self) -> int | None:
        if self.plan:
            return self.plan.port
        return int(self.manifest["port"]) if self.manifest and self.manifest.get("port") else None

    @property
    def unit(self) -> str | None:
        if self.manifest and self.manifest.get("unit"):
            return self.manifest["unit"]
        return self.layout.instance(self.variant_name) if self.variant_name else None

    def manifest_pins(self) -> dict:
        m = self.manifest or {}
        pins = m.get("pins") if isinstance(m.get("pins"), dict) else m
        return {"git": pins.get("git") or {}, "hf": pins.get("hf") or {}, "image": pins.get("image")}


def requests(ctx: RigContext, os_id: str | None) -> list[tuple[type, dict]]:
    """Every fact the checks read for this rig's plan (on an OS `os_id`), for one batched probe."""
    out = [
        (NvidiaGpus, {}),
        (OsRelease, {}),
        (NvidiaModuleVersion, {}),
        (NvidiaRunningDriver, {}),
        (NvidiaTopology, {}),
    ]
    package = _driver_package(ctx.data, os_id)
    if package:
        out.append((DebInstalledVersion, {"package": package}))
    out.append((JsonFile, {"path": ctx.layout.daemon_json}))
    if ctx.manage:  # what ran at this boot (rigforge/boot.py)
        out.append((BootCaps, boot_units(ctx)))
    if ctx.unit:
        out += [(SystemdUnitEnabled, {"unit": ctx.unit}), (ServiceState, {"unit": ctx.unit})]
    plan = ctx.plan
    if plan and ctx.manage:
        out += [(ApiAnswers, api_at(ctx)), (ComposeImages, {"serve_dir": plan.layout.serve_dir})]
    if plan:
        out += [(GitCheckout, {"path": plan.layout.src(name)}) for name in plan.variant.sources]
        out += [(WeightsState, _weights_at(plan, asset)) for asset in plan.assets]
        out += [(Sha256File, {"path": path}) for path in managed_files(plan)]
        if ctx.manage:
            out.append((DockerImagePresent, {"image": plan.image}))
    return out


def observe(host) -> tuple[RigContext, Observed]:
    """The rig's plan and the rig read for it: its manifest and GPUs first (they choose the variant and the caps),
    then everything the checks need in one probe."""
    from roles import site

    data = site.host_data(host.data)
    ctx = RigContext(name=host.name, data=data)
    layout = HostLayout(root=data["rigforge_root"] or HostLayout.root)
    reads = [(JsonFile, {"path": layout.rig_json}), (NvidiaGpus, {}), (OsRelease, {}), (PowerCapUnits, {})]
    first = Observed(host, reads)
    ctx.cap_units = first.get_fact(PowerCapUnits) or {}
    ctx.manifest = first.get_fact(JsonFile, path=layout.rig_json)
    wanted = data["rigforge_variant"]
    recorded = (ctx.manifest or {}).get("recipe") or (ctx.manifest or {}).get("variant")
    ctx.variant_name = (ctx.manifest or {}).get("variant") or wanted
    ctx.variant_from = layout.rig_json if recorded else ("host data rigforge_variant" if wanted else "")
    try:
        ctx.lock = load_lock(data["rigforge_lock"])
    except (LockError, OSError) as exc:
        ctx.lock_error = str(exc)
    if (recorded or wanted) and ctx.lock is not None:
        gpus = len(first.get_fact(NvidiaGpus) or []) or None
        serve = {**data, "rigforge_variant": recorded or wanted, "rigforge_recipe_opt_in": True}
        ctx.plan, ctx.problems = site.plan_for(
            host.name, serve, gpus=gpus, deployable=False, cap_units=tuple(ctx.cap_units)
        )
    if ctx.plan:
        ctx.layout, ctx.variant_name = ctx.plan.layout, ctx.plan.variant.name
    return ctx, Observed(host, requests(ctx, first.get_fact(OsRelease)["id"]))


# ---------------------------------------------------------------- the checks


def pin_drift(ctx: RigContext) -> dict:
    """Pins recorded in the manifest vs the lock: {"drift": [...], "pins": {...}}; None without both."""
    if ctx.manifest is None or ctx.lock is None:
        return {"drift": None, "pins": None}
    pins, drift = ctx.manifest_pins(), []
    for kind, table, attr in (("git", ctx.lock.git, "commit"), ("hf", ctx.lock.hf, "revision")):
        for name, have in sorted(pins[kind].items()):
            want = getattr(table[name], attr) if name in table else None
            if have != want:
                drift.append(f"{kind} {name}: rig {str(have)[:12]}, lock {str(want)[:12]}")
    want = ctx.plan.image if ctx.plan else None  # the plan's image: the lock's pin for this rig's variant or slug
    if pins["image"] and want and pins["image"] != want:
        drift.append(f"image: rig {pins['image']}, lock {want}")
    return {"drift": drift, "pins": pins}


def rig_drift(obs: Observed, ctx: RigContext) -> list[str]:
    """The rig against what was provisioned: checkouts at the manifest's commits without local changes, weight
    files as stamped, and every file rigforge renders as the plan renders it."""
    if ctx.plan is None:
        return []
    recorded = ctx.manifest_pins()["git"]
    want = {pin.name: recorded.get(pin.name) or pin.commit for pin in ctx.plan.sources}
    stamped = [line for line in weights(obs, ctx.plan) if "stamp revision" not in line]
    return sources(obs, ctx.plan, want, "provisioned") + stamped + files(obs, ctx.plan)


def sources(obs: Observed, plan: Plan, want: Mapping[str, str | None], label: str = "lock") -> list[str]:
    """Each checkout at `want`'s commit ({source: commit}: the lock's, or the manifest's with `label`
    "provisioned"), with no local changes."""
    bad = []
    for name in plan.variant.sources:
        commit, path = want.get(name), plan.layout.src(name)
        state = obs.get_fact(GitCheckout, path=path)
        if state is None:
            bad.append(f"git {name}: no checkout at {path}")
        elif not commit:
            bad.append(f"git {name}: no resolved commit to compare with")
        elif state["head"] != commit:
            bad.append(f"git {name}: HEAD {str(state['head'])[:12] or '?'}, {label} {commit[:12]}")
        elif state["dirty"]:
            n, first = len(state["dirty"]), state["dirty"][0].strip()
            bad.append(f"git {name}: dirty checkout at {path} ({n} file(s), e.g. {first})")
    return bad


def _weights_at(plan: Plan, asset) -> dict:
    return {"dest": plan.layout.asset_dir(asset.dir), "staging": plan.layout.weights_staging(asset.name)}


def weights(obs: Observed, plan: Plan) -> list[str]:
    """Each asset's stamp is the lock's revision and sha256s, and every file is as stamped (size, mtime)."""
    bad = []
    for asset in plan.assets:
        pin, where = asset.pin, _weights_at(plan, asset)
        state = obs.get_fact(WeightsState, **where)
        stamp = state["stamp"]
        if not stamp:
            bad.append(f"hf {asset.name}: no stamp in {where['dest']}")
            continue
        if stamp.get("revision") != pin.revision:
            have, want = str(stamp.get("revision"))[:12], str(pin.revision)[:12]
            bad.append(f"hf {asset.name}: stamp revision {have}, lock {want}")
            continue
        entries, problems = stamp.get("files") or {}, []
        for f in pin.files:
            entry, on_disk = entries.get(f.path), state["files"].get(f.path)
            if not entry or entry.get("sha256") != f.sha256:
                problems.append(f"{f.path} not stamped with the lock's sha256")
            elif on_disk is None:
                problems.append(f"{f.path} missing")
            elif on_disk[0] != f.size:
                problems.append(f"{f.path} is {on_disk[0]} bytes, lock {f.size}")
            elif on_disk[1] != entry.get("mtime_ns"):
                problems.append(f"{f.path} modified since it was verified (mtime differs from the stamp)")
        if problems:
            bad.append(f"hf {asset.name}: {'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}")
    return bad


def managed_files(plan: Plan) -> dict[str, str]:
    """{path on the rig: the plan's text} of every file rigforge renders whole."""
    layout, files = plan.layout, plan.files
    out = {f"{layout.serve_dir}/{name}": files[name] for name in SERVE_FILES if name in files}
    out |= {layout.unit_path(name): files[name] for name in (VLLM_UNIT, POWER_UNIT, SETTLE_UNIT) if name in files}
    return out | ({layout.settle_script: files[SETTLE_SCRIPT]} if SETTLE_SCRIPT in files else {})


def files(obs: Observed, plan: Plan) -> list[str]:
    """Every file rigforge renders whole is on the rig as the plan renders it (compared by sha256: no secret is
    read or shown). A hand edit shows here, naming the file."""
    bad = []
    for path, text in managed_files(plan).items():
        on_rig = obs.get_fact(Sha256File, path=path)
        if on_rig is None:
            bad.append(f"{path} is missing")
        elif on_rig != hashlib.sha256(text.encode()).hexdigest():
            bad.append(f"{path} differs from what rigforge renders (edited by hand? re-run the deploy)")
    return bad


def gpus_with_targets(obs: Observed, ctx: RigContext) -> list[dict]:
    gpus = obs.get_fact(NvidiaGpus) or []
    targets = power_caps(len(gpus), ctx.settings)
    return [{**gpu, "target_w": targets.get(gpu["index"])} for gpu in gpus]


def power_view(obs: Observed, ctx: RigContext) -> dict:
    """The caps beside the recipe repo's figures, the rig's other boot-time cap writers and the GPUs'
    interconnect (rig.json's, else read now)."""
    caps = dict(ctx.plan.caps) if ctx.plan else power_caps(len(obs.get_fact(NvidiaGpus) or []), ctx.settings)
    prof = power.locate_profile(ctx.lock)
    topology = (ctx.manifest or {}).get("interconnect") or obs.get_fact(NvidiaTopology)
    return {
        "caps": caps,
        "recipe": power.recipe_range(prof),
        "warnings": power.warnings(caps, prof),
        "other_writers": ctx.cap_units,
        "order": boot.summary(obs.get_fact(BootCaps, **boot_units(ctx)) if ctx.manage else {}, ctx),
        "interconnect": topology,
        "interconnect_summary": interconnect(topology),
    }


def watts(v) -> str:
    """Watts as shown ('?' when unknown)."""
    return "?" if v is None else f"{v:g}"


def _driver_package(data: Mapping, os_id: str | None) -> str | None:
    """The driver table's package whose version is the driver's, for this rig's data and OS (None: none)."""
    try:
        return packages_for(data, os_id).version_package if data["nvidia_driver_manage"] else None
    except DriverTableError:
        return None


def driver(obs: Observed, ctx: RigContext) -> Check:
    """The loaded module is the installed driver package (the driver table's, for this OS, branch, flavour and
    source); with nvidia_driver_manage false, the running driver is of the branch asked for."""
    from roles.facts.nvidia import upstream_version

    name, data = "driver module = package", ctx.data
    if not data["nvidia_driver_manage"]:
        running = obs.get_fact(NvidiaRunningDriver)
        problem = branch_problem(running, int(data["nvidia_driver_branch"]))
        fine = f"running {(running or {}).get('version')} (nvidia_driver_manage false: not installed by rigforge)"
        return check(name, [problem] if problem else [], fine)
    try:
        pkg = packages_for(data, obs.get_fact(OsRelease)["id"]).version_package
    except DriverTableError as error:
        return Check(name, FAIL, f"{error} (host data)")
    module, version = obs.get_fact(NvidiaModuleVersion), obs.get_fact(DebInstalledVersion, package=pkg)
    if not version:
        return Check(name, FAIL, f"{pkg} is not installed (run the deploy: nvidia_driver role)")
    if not module:
        return Check(name, FAIL, f"{pkg} {version} installed but the nvidia module is not loaded: reboot the rig "
                     "(with Secure Boot on, the module must be signed/enrolled)")  # fmt: skip
    if upstream_version(version) != module:
        return Check(name, FAIL, f"module {module} loaded, package {pkg} {version} installed: driver/library "
                     "mismatch, reboot the rig to load the installed driver")  # fmt: skip
    return Check(name, PASS, f"module {module} = {pkg} {version}")


def image_origin(obs: Observed, ctx: RigContext, hosts) -> dict | None:
    """Where the rig's locked image comes from (rigforge/obtain.py), asked now from the controller: {"image",
    "on_rig", "from", "warning"}; `warning` when the rig alone holds it (no other copy) or nothing does. None
    without a plan, or when services are not managed (nothing is pulled there)."""
    from roles import site

    if not ctx.plan or not ctx.manage:
        return None
    plan = ctx.plan
    reg, _ = site.registry_plan(hosts)
    found = obtain.sources(plan.image, reg, plan.data["serving_image_upstream"], plan.data["serving_image_upstream_ca"])
    on_rig = bool(obs.get_fact(DockerImagePresent, image=plan.image))
    text, warning = obtain.origin(on_rig, found)
    return {"image": plan.image, "on_rig": on_rig, "from": text, "warning": warning}


def cuda_versions(obs: Observed, ctx: RigContext) -> dict:
    """{"driver": the CUDA version the running driver supports (nvidia-smi's header, else NVIDIA's table for its
    version), "image": the one the rig's image is built for (the lock's `cuda`)}, None where unknown."""
    running = obs.get_fact(NvidiaRunningDriver) or {}
    driver = running.get("cuda") or (cuda_for_driver(running["version"]) if running.get("version") else None)
    image = ctx.plan.image if ctx.plan else (ctx.manifest or {}).get("image")
    return {"driver": driver, "image": ctx.lock.image_cuda(image) if ctx.lock and image else None}


def cuda(obs: Observed, ctx: RigContext) -> Check:
    """The running driver supports the CUDA version the image is built for (GeForce cards have no forward
    compatibility: a newer image fails with error 804 once vLLM starts)."""
    name, have = "CUDA driver >= image", cuda_versions(obs, ctx)
    seen = f"CUDA: driver {have['driver'] or '?'}, image {have['image'] or '?'}"
    if not have["driver"]:
        return Check(name, FAIL, f"{seen}: no running driver reports its CUDA version (driver not loaded?)")
    if not have["image"]:
        why = variant_needed(ctx) if not ctx.plan else "the lock records no `cuda` for the image"
        return Check(name, PASS if ctx.plan else FAIL, f"{seen} ({why})")
    if version_key(have["driver"]) < version_key(have["image"]):
        fix = f"set nvidia_driver_branch: {branch_for_cuda(have['image']) or '?'} and re-run the deploy"
        return Check(name, FAIL, f"{seen}: the driver is too old for the image; {fix}, or use an image built for "
                     f"CUDA <= {have['driver']}")  # fmt: skip
    return Check(name, PASS, seen)


def gpu_checks(obs: Observed, ctx: RigContext) -> list[Check]:
    """GPUs visible, VRAM fits the variant, power caps hold, persistence mode on."""
    gpus = gpus_with_targets(obs, ctx)
    if not gpus:
        none = "no GPU to read"
        return [Check("GPUs visible", FAIL, "nvidia-smi lists no GPU (driver not installed or not loaded)")] + [
            Check(n, FAIL, none) for n in ("VRAM fits variant", "power caps hold", "persistence mode on")
        ]
    need = ctx.variant.gpus if ctx.variant else 0
    names = ", ".join(sorted({g.get("name") or "?" for g in gpus}))
    seen = f"{len(gpus)} GPU(s): {names}"
    off = [g for g in gpus if g.get("power_limit") != g["target_w"]]
    caps = ", ".join(f"GPU{g['index']} {watts(g.get('power_limit'))} W" for g in gpus)
    targets = ", ".join(sorted({str(g["target_w"]) for g in gpus}))
    not_persistent = [str(g["index"]) for g in gpus if g.get("persistence_mode") is not True]
    return [
        check("GPUs visible", [f"{seen}; {ctx.variant_name} needs {need}"] if len(gpus) < need else [], seen),
        vram(gpus, ctx.variant, ctx.settings),
        check(
            "power caps hold",
            [f"GPU{g['index']} at {watts(g.get('power_limit'))} W, target {g['target_w']} W" for g in off],
            f"{caps} (target {targets} W)",
            " (re-run the deploy or restart rigforge-gpu-power.service)",
        ),
        check(
            "persistence mode on",
            [f"off on GPU {', '.join(not_persistent)}"] if not_persistent else [],
            f"on for {len(gpus)} GPU(s)",
        ),
    ]


def boot_units(ctx: RigContext) -> dict:
    """BootCaps' arguments: the other writers' units, whose results at this boot it reads."""
    return {"units": " ".join(n for n, w in ctx.cap_units.items() if w.get("kind", "unit") == "unit")}


def caps_set_last(obs: Observed, ctx: RigContext) -> Check:
    """rigforge's caps were the last written at this boot, without an ordering cycle (rigforge/boot.py)."""
    name = "caps set last at this boot"
    if not ctx.manage:
        return Check(name, SKIP, SKIPPED)
    return Check(name, *boot.boot_caps(obs.get_fact(BootCaps, **boot_units(ctx)), ctx))


def vram(gpus: list[dict], v, s: Settings) -> Check:
    """Every card has the VRAM variant `v` needs with settings `s` (20 GB cards: only with the documented
    override)."""
    name = "VRAM fits variant"
    if not gpus or not v:
        return Check(name, FAIL, "no GPU to read" if not gpus else "variant unknown")
    override = small_override(s.kv_cache_dtype, s.gpu_memory_utilization)
    sizes = "/".join(str(m) for m in sorted({g.get("memory_total") for g in gpus}))
    fine = f"{sizes} MiB per card, {v.name} needs {v.min_card_mib}" + (" (20 GB override)" * override)
    problems = vram_problems(gpus, v.name, v.min_card_mib, v.uses_dflash, override)
    return check(name, [" ".join(problems)] if problems else [], fine)


def runtime(obs: Observed, ctx: RigContext) -> Check:
    """daemon.json is merged, not rendered: only the key rigforge owns (the nvidia runtime) is compared."""
    name, path = "nvidia runtime", ctx.layout.daemon_json
    daemon = obs.get_fact(JsonFile, path=path)
    if daemon is None:
        return Check(name, FAIL, f"no readable {path} (run the deploy: docker_engine role)")
    runtime = (daemon.get("runtimes") or {}).get("nvidia")
    if runtime != NVIDIA_RUNTIME["runtimes"]["nvidia"]:
        return Check(name, FAIL, f"{path} registers {'no' if runtime is None else 'another'} nvidia runtime "
                     f"({runtime!r}; run the deploy)")  # fmt: skip
    return Check(name, PASS, f"nvidia -> {runtime.get('path', '?')} in {path}")


def api_at(ctx: RigContext) -> dict:
    """ApiAnswers' arguments for the rig's API (from the rig, as the health gate asks it)."""
    url = f"http://{ctx.data['serving_health_host'] or '127.0.0.1'}:{ctx.port}"
    return {"url": url, "env_file": f"{ctx.plan.layout.serve_dir}/.env"}


def unit_state(obs: Observed, ctx: RigContext) -> dict:
    """{"unit", "enabled", "active" (systemd's ActiveState), "serving" (roles/facts/serving.py `serving`),
    "rest" (host data serving_rest)}."""
    unit, rest = ctx.unit, ctx.data.get("serving_rest")
    if not unit:
        return {"unit": None, "enabled": None, "active": None, "serving": None, "rest": rest}
    enabled = obs.get_fact(SystemdUnitEnabled, unit=unit)
    state = obs.get_fact(ServiceState, unit=unit)
    return {"unit": unit, "enabled": bool(enabled), "active": state["active"], "serving": serving(state), "rest": rest}


def variant_needed(ctx: RigContext) -> str:
    if ctx.variant_name and not ctx.variant:
        return f"unknown variant {ctx.variant_name!r}"
    return f"variant unknown: no {ctx.layout.rig_json} and no rigforge_variant in host data"


def _sources_at_lock(obs: Observed, plan: Plan) -> tuple[list[str], str]:
    fine = ", ".join(f"{p.name}@{str(p.commit)[:12]}" for p in plan.sources) or "no sources for this variant"
    return sources(obs, plan, {p.name: p.commit for p in plan.sources}), fine


def _weights_valid(obs: Observed, plan: Plan) -> tuple[list[str], str]:
    fine = ", ".join(f"{a.name} ({len(a.pin.files)} files @ {str(a.pin.revision)[:12]})" for a in plan.assets)
    return weights(obs, plan), fine or "no weights for this variant"


def checks(obs: Observed, ctx: RigContext) -> list[Check]:
    """Every drift check of the rig, in `rigforge verify`'s order (the API probes come after them)."""
    out = [Check("host data", FAIL, problem) for problem in ctx.problems]
    if ctx.manifest is None:
        missing = f"no readable {ctx.layout.rig_json}: not provisioned by rigforge (run the deploy)"
        out.append(Check("manifest present", FAIL, missing))
    else:
        out.append(
            check("manifest present", [] if ctx.variant else [variant_needed(ctx)], f"variant {ctx.variant_name}")
        )
    out += [driver(obs, ctx), cuda(obs, ctx), *gpu_checks(obs, ctx), caps_set_last(obs, ctx), runtime(obs, ctx)]
    plan = ctx.plan
    for name, find, hint in (
        ("sources at locked SHAs", lambda: _sources_at_lock(obs, plan), " (re-run the deploy: sources role)"),
        ("weights stamp valid", lambda: _weights_valid(obs, plan), " (re-run the deploy: weights role)"),
        ("files as rendered", lambda: (files(obs, plan), f"{len(managed_files(plan))} files"), ""),
    ):
        if ctx.lock is None:
            out.append(Check(name, FAIL, f"lock unreadable: {ctx.lock_error}"))
        elif plan is None:
            out.append(Check(name, FAIL, variant_needed(ctx)))
        else:
            out.append(check(name, *find(), hint))
    unit = unit_state(obs, ctx)
    if not unit["unit"]:
        why = variant_needed(ctx)
        return [
            *out,
            pins_check(ctx),
            Check("unit enabled", FAIL, why),
            Check("unit active", *((FAIL, why) if ctx.manage else (SKIP, SKIPPED))),
            Check(RUNS_DIGEST, *((FAIL, why) if ctx.manage else (SKIP, SKIPPED))),
        ]
    out.append(pins_check(ctx))
    name = unit["unit"]
    if unit["rest"] == "stopped":
        out.append(check("unit enabled", [f"{name} is enabled at boot (run the deploy)"] * bool(unit["enabled"]),
                         f"{name} disabled on purpose (serving_rest: stopped)"))  # fmt: skip
    else:
        enabled = f"{name} {'enabled' if unit['enabled'] else 'not enabled (run the deploy)'}"
        out.append(Check("unit enabled", PASS if unit["enabled"] else FAIL, enabled))
    if not ctx.manage:
        return [*out, Check("unit active", SKIP, SKIPPED), Check(RUNS_DIGEST, SKIP, SKIPPED)]
    if unit["rest"] == "stopped":
        bad = [f"{name} is {unit['active']} (run the deploy to stop it)"] * (unit["serving"] not in STOPPED)
        return [*out, check("unit active", bad, f"{name} stopped on purpose (serving_rest: stopped)"),
                Check(RUNS_DIGEST, SKIP, "resting stopped (serving_rest: stopped)")]  # fmt: skip
    active = unit["active"] == "active"
    how = f"{unit['active']}, {unit['serving']}" if unit["serving"] != unit["active"] else unit["active"]
    hint = "" if active else f" (journalctl -u {name}; re-run the deploy to start it)"
    return [*out, Check("unit active", PASS if active else FAIL, f"{name} is {how}{hint}"), running_image(obs, ctx)]


STOPPED = ("stopped", "failed", "unknown")
RUNS_DIGEST = "container runs the locked digest"


def pins_check(ctx: RigContext) -> Check:
    """The pins rig.json records are the lock's for this rig (the plan's image, with its digest)."""
    pins = pin_drift(ctx)
    if pins["drift"] is None:
        return Check("pins as locked", FAIL, "no rig.json or no lock to compare")
    return check("pins as locked", pins["drift"], "rig.json records the lock's pins", " (re-run the deploy)")


def running_image(obs: Observed, ctx: RigContext) -> Check:
    """The container the unit runs is the locked digest: its image's RepoDigests (`docker inspect`) hold
    `repo@sha256:...` of the plan's image."""
    if not ctx.plan:
        return Check(RUNS_DIGEST, FAIL, variant_needed(ctx))
    want = obtain.parse(ctx.plan.image)
    if not want.digest:
        return Check(RUNS_DIGEST, FAIL, f"the lock has no digest for {ctx.plan.image} (run `rigforge lock`)")
    images = obs.get_fact(ComposeImages, serve_dir=ctx.plan.layout.serve_dir)
    runs = runs_digest(images, want.digest)
    if runs is None:
        return Check(RUNS_DIGEST, FAIL, f"no container of {ctx.plan.layout.serve_dir} runs (docker compose ps)")
    seen = ", ".join(d for digests in images for d in digests) or "an image with no digest"
    return Check(RUNS_DIGEST, PASS if runs else FAIL, want.pinned if runs else f"runs {seen}, lock {want.pinned}")


def gateway_check(rig: str, rest: str | None, views: Mapping[str, dict]) -> Check | None:
    """The rig's server at every gateway that lists it (the gateways' views, `observe_gateway`): serving, or
    drained on purpose with serving_rest; None when no gateway lists it."""
    seen = {gw: view["rigs"][rig] for gw, view in views.items() if rig in (view.get("rigs") or {})}
    if not seen:
        return None
    said = ", ".join(f"{state} at {gw}" for gw, state in sorted(seen.items()))
    if rest:
        bad = [f"{said}: resting {rest} (serving_rest), re-run the deploy to drain it"] * any(
            s == "serving" for s in seen.values()
        )
        return check("serving at the gateways", bad, f"{said}: resting on purpose (serving_rest: {rest})")
    bad = [f"{said} (re-run the deploy to rejoin)"] * any(s != "serving" for s in seen.values())
    return check("serving at the gateways", bad, said)


# ---------------------------------------------------------------- the fleet gateway, observed

GATEWAY_STATES = {"UP": "serving", "DRAIN": "draining"}  # HAProxy's server status; any other: out
GATEWAY_FINE = ("serving", "draining", "out (maint)")  # maint: taken out on purpose (a model it no longer serves)
GATEWAY_CHAT = {"messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        "max_tokens": 30, "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip


def observe_gateway(host, data: Mapping) -> dict:
    """The gateway on `host` (its knobs in `data`): HAProxy's unit, the gateway's own /health, /v1/models
    through it, and each rig's state in its backends (HAProxy's `show stat`)."""
    bind = data.get("gateway_bind_address") or "127.0.0.1"
    url = f"http://{'127.0.0.1' if bind == '0.0.0.0' else bind}:{data['gateway_port']}"
    stat = inventory.sh(host, f"echo 'show stat' | socat stdio UNIX-CONNECT:{shlex.quote(GATEWAY_ADMIN_SOCKET)}")
    rigs = gateway_servers(stat)
    code, body = inventory.http_on_rig(host, f"{url}/v1/models", 5, api_key=data.get("gateway_api_key"))
    try:
        models = [m["id"] for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        models = None
    return {
        "url": url,
        "unit": inventory.sh(host, "systemctl is-active haproxy.service").strip() or "unknown",
        "health": inventory.http_on_rig(host, f"{url}/health", 5)[0],
        "models_http": code,
        "models": models,
        "rigs": rigs,
    }


def gateway_servers(stat: str) -> dict[str, str]:
    """Each rig's state at the gateway from HAProxy's `show stat` (CSV, read by its header): serving, draining,
    out (maint), or out (down N s; last check: L4CON Connection refused), naming the last health check's error.
    A rig in several backends (it left a model's backend: maint there) shows its state where it serves."""
    lines = [line for line in stat.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("# "):
        return {}
    rigs: dict[str, str] = {}
    for row in csv.DictReader(lines[1:], fieldnames=lines[0][2:].split(",")):
        name, status = row.get("svname") or "", (row.get("status") or "").split(" ")[0]
        if name in ("FRONTEND", "BACKEND", "") or row.get("pxname") == "no_model":
            continue
        state = GATEWAY_STATES.get(status, f"out ({status.lower()})")
        if status == "DOWN":
            code = row.get("check_code") or ""
            why = row.get("last_chk") or row.get("check_desc") or ""
            check = " ".join(x for x in (row.get("check_status"), f"HTTP {code}" if code else "", why) if x)
            since = f" {row['lastchg']} s" if (row.get("lastchg") or "").isdigit() else ""
            state = f"out (down{since}; last check: {check or 'none yet'})"
        if name not in rigs or rigs[name] == "out (maint)":
            rigs[name] = state
    return rigs


def gateway_checks(host, data: Mapping, view: dict) -> list[Check]:
    """verify's checks of a gateway: every rig in it serving (a down one names its last check's error),
    /v1/models answers through it, and one chat completion per model."""
    resting = {h.name for h in getattr(host, "inventory", ()) if h.data.get("serving_rest")}  # out on purpose
    bad = {name: state for name, state in view["rigs"].items() if state not in GATEWAY_FINE and name not in resting}
    states = "; ".join(f"{n} {s}" for n, s in sorted((bad or view["rigs"]).items())) or "no rig"
    out = [Check("gateway rigs up", FAIL if bad or not view["rigs"] else PASS, states)]
    if view["models_http"] != 200 or not view["models"]:
        why = f"HTTP {view['models_http']}" if view["models_http"] else "no answer"
        return out + [Check("gateway /v1/models answers", FAIL, f"{view['url']}/v1/models: {why}, {view['models']}")]
    out.append(Check("gateway /v1/models answers", PASS, f"{view['url']} lists {', '.join(view['models'])}"))
    for model in view["models"]:
        body = {"model": model, **GATEWAY_CHAT}
        code, text = inventory.http_on_rig(host, f"{view['url']}/v1/chat/completions", 120, body,
                                           data.get("gateway_api_key"))  # fmt: skip
        ok = code == 200 and "paris" in text.lower()
        out.append(Check(f"gateway chat: {model}", PASS if ok else FAIL, f"HTTP {code or 'no answer'}: {text[:80]}"))
    return out
