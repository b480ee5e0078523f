"""The checks of `rigforge status` and `verify`: a rig's observed state (rigforge/observe/hosts.py) against its plan,
each check defined once; nothing here asks a rig or a registry.
"""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from pyinfra.facts.deb import DebPackages
from pyinfra.facts.files import File, Sha256File

from rigforge.model import driver_table, packages, power
from rigforge.model.fleet import Plan, ServedVariant
from rigforge.model.gateway import backend_name as gateway_backend
from rigforge.model.hardware import (
    interconnect,
    missing_cards,
    missing_problem,
    serving_cards,
    serving_indices,
    small_override,
    vram_problems,
)
from rigforge.model.knobs.docker_engine import daemon_json_patch
from rigforge.model.schema import Settings, power_caps
from rigforge.observe import boot, obtain, verdict
from rigforge.observe.boot import watts
from rigforge.observe.facts import cycles
from rigforge.observe.facts import nvidia as nvidia_facts
from rigforge.observe.facts.apt import DebInstalledVersion
from rigforge.observe.facts.files import JsonFile
from rigforge.observe.facts.gitpin import GitCheckout
from rigforge.observe.facts.hfweights import WeightsState
from rigforge.observe.facts.nvidia import BootCaps, NvidiaGpus, NvidiaModuleVersion, NvidiaRunningDriver, NvidiaTopology
from rigforge.observe.facts.serving import ComposeImages, ServiceState, runs_digest, serving
from rigforge.observe.facts.system import AptHeldPackages, OsRelease, ProvidedFiles, SystemdUnitEnabled
from rigforge.observe.hosts import Observed, RigContext, boot_units, managed_files, weights_at

PASS, FAIL, SKIP = "pass", "fail", "skip"
SKIPPED = "skipped (services not managed on this host)"


@dataclass
class Check:
    name: str
    status: str
    detail: str = ""


def check(name: str, problems: list[str], fine: str, hint: str = "") -> Check:
    return Check(name, FAIL, "; ".join(problems) + hint) if problems else Check(name, PASS, fine)


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
    """The rig's pins against what was provisioned: each checkout's HEAD at the commit the manifest records. A dirty
    tree or a file edited by hand is no pin: their own checks ("sources at locked SHAs", "files as rendered") say it."""
    if ctx.plan is None:
        return []
    recorded, moved = ctx.manifest_pins()["git"], []
    for pin in ctx.plan.sources:
        state = obs.get_fact(GitCheckout, path=ctx.plan.layout.src(pin.name))
        want = recorded.get(pin.name) or pin.commit
        if state and want and state["head"] != want:
            moved.append(f"git {pin.name}: HEAD {state['head'][:12] or '?'}, provisioned {want[:12]}")
    return moved


def sources(obs: Observed, plan: Plan, want: Mapping[str, str | None], label: str = "lock") -> Iterator[str]:
    """Each checkout as `verdict.checkout` decides, at `want`'s commit ({source: commit}: the lock's; the
    manifest's, label "provisioned")."""
    for pin in plan.sources:
        path = plan.layout.src(pin.name)
        state = obs.get_fact(GitCheckout, path=path)
        yield from verdict.checkout(pin, path, state, want.get(pin.name), label)


def weights(obs: Observed, plan: Plan) -> Iterator[str]:
    """Each asset as `verdict.weights` decides: its stamp is the lock's, every file as stamped (size, mtime)."""
    for asset in plan.assets:
        where = weights_at(plan, asset)
        yield from verdict.weights(asset.pin, where["dest"], obs.get_fact(WeightsState, **where))


def files(obs: Observed, plan: Plan) -> Iterator[str]:
    """Every file rigforge renders whole, as `verdict.rendered_file` decides (by sha256: no secret read or shown)."""
    for path, (text, mode) in managed_files(plan).items():
        info, sha256 = obs.get_fact(File, path=path), obs.get_fact(Sha256File, path=path)
        yield from verdict.rendered_file(path, text, mode, info, sha256)


def gpus_with_targets(obs: Observed, ctx: RigContext) -> list[dict]:
    gpus = obs.get_fact(NvidiaGpus) or []
    targets = power_caps(len(gpus), ctx.settings)
    return [{**gpu, "target_w": targets.get(gpu["index"])} for gpu in gpus]


def power_view(obs: Observed, ctx: RigContext) -> dict:
    """The caps beside the recipe repo's figures, the other cap writers and the interconnect (rig.json's, else now)."""
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


def answer(code: int | None) -> str:
    return f"HTTP {code}" if code else "no answer"


def driver(obs: Observed, ctx: RigContext) -> Check:
    """The loaded module is the driver table's package as installed (nvidia_driver_manage false: the branch runs)."""
    from rigforge.observe.facts.nvidia import upstream_version

    name, wanted = "driver module = package", ctx.knobs.driver
    if not wanted.nvidia_driver_manage:
        running = obs.get_fact(NvidiaRunningDriver)
        problem = driver_table.branch_problem(running, int(wanted.nvidia_driver_branch))
        fine = f"running {(running or {}).get('version')} (nvidia_driver_manage false: not installed by rigforge)"
        return check(name, [problem] if problem else [], fine)
    try:
        pkg = driver_table.packages_for(wanted, obs.get_fact(OsRelease)["id"]).version_package
    except driver_table.DriverTableError as error:
        return Check(name, FAIL, f"{error} (host data)")
    module, version = obs.get_fact(NvidiaModuleVersion), obs.get_fact(DebInstalledVersion, package=pkg)
    if not version:
        return Check(name, FAIL, f"{pkg} is not installed (run the deploy: nvidia_driver role)")
    if not module:
        return Check(
            name,
            FAIL,
            f"{pkg} {version} installed but the nvidia module is not loaded: reboot the rig "
            "(with Secure Boot on, the module must be signed/enrolled)",
        )
    if upstream_version(version) != module:
        return Check(
            name,
            FAIL,
            f"module {module} loaded, package {pkg} {version} installed: driver/library "
            "mismatch, reboot the rig to load the installed driver",
        )
    return Check(name, PASS, f"module {module} = {pkg} {version}")


def cuda_versions(obs: Observed, ctx: RigContext) -> dict:
    """{"driver": the CUDA version the running driver supports, "image": the lock's for the image}, None: unknown."""
    running = obs.get_fact(NvidiaRunningDriver) or {}
    driver = running.get("cuda")
    if driver is None and running.get("version"):  # an older nvidia-smi prints no CUDA version: the driver's table
        driver = driver_table.cuda_for_driver(running["version"])
    image = ctx.plan.locked_image if ctx.plan else (ctx.manifest or {}).get("image")
    return {"driver": driver, "image": ctx.lock.image_cuda(image) if ctx.lock and image else None}


def cuda(obs: Observed, ctx: RigContext) -> Check:
    """The running driver supports the image's CUDA (GeForce has no forward compatibility: error 804 in vLLM)."""
    name, have = "CUDA driver >= image", cuda_versions(obs, ctx)
    seen = f"CUDA: driver {have['driver'] or '?'}, image {have['image'] or '?'}"
    if not have["driver"]:
        return Check(name, FAIL, f"{seen}: no running driver reports its CUDA version (driver not loaded?)")
    if not have["image"]:
        why = variant_needed(ctx) if not ctx.plan else "the lock records no `cuda` for the image"
        return Check(name, PASS if ctx.plan else FAIL, f"{seen} ({why})")
    if driver_table.version_key(have["driver"]) < driver_table.version_key(have["image"]):
        fix = f"set nvidia_driver_branch: {driver_table.branch_for_cuda(have['image']) or '?'} and re-run the deploy"
        return Check(
            name,
            FAIL,
            f"{seen}: the driver is too old for the image; {fix}, or use an image built for CUDA <= {have['driver']}",
        )
    return Check(name, PASS, seen)


def gpu_checks(obs: Observed, ctx: RigContext) -> list[Check]:
    """GPUs visible (as many as the variant needs, none off the PCI bus), VRAM fits the variant (on the cards it runs
    on), power caps hold (each GPU at its target), persistence mode on; all four fail when nvidia-smi lists no GPU."""
    gpus = gpus_with_targets(obs, ctx)
    if not gpus:
        return [Check("GPUs visible", FAIL, "nvidia-smi lists no GPU (driver not installed or not loaded)")] + [
            Check(n, FAIL, "no GPU to read") for n in ("VRAM fits variant", "power caps hold", "persistence mode on")
        ]
    need = ctx.variant.gpus if ctx.variant else 0
    seen = f"{len(gpus)} GPU(s): {', '.join(sorted({g.get('name') or '?' for g in gpus}))}"
    caps = ", ".join(f"GPU{g['index']} {watts(g.get('power_limit'))} W" for g in gpus)
    targets = ", ".join(sorted({str(g["target_w"]) for g in gpus}))
    declared = {g["index"]: g["target_w"] for g in gpus}
    visible = [f"{seen}; {ctx.variant_name} needs {need}"] if len(gpus) < need else []
    if 0 < need < len(gpus):  # a slug over fewer cards than the rig has runs on the first ones (hardware.serving_env)
        used = serving_indices(need, len(gpus))
        idle = ", ".join(str(g["index"]) for g in gpus if int(g["index"]) not in used)
        seen += f"; {ctx.variant_name} runs on GPU {', '.join(map(str, used))}, GPU {idle} idle"
    if missing := missing_cards(gpus, obs.get_fact(nvidia_facts.NvidiaPciGpus)):  # a card off the bus, by address
        visible = [missing_problem(missing, len(gpus))]
    return [
        check("GPUs visible", visible, seen),
        vram(serving_cards(gpus, need) if need else gpus, ctx.variant, ctx.settings),  # the cards it runs on
        check(
            "power caps hold",
            verdict.caps(gpus, declared),
            f"{caps} (target {targets} W)",
            " (re-run the deploy or restart rigforge-gpu-power.service)",
        ),
        check("persistence mode on", verdict.persistence(gpus), f"on for {len(gpus)} GPU(s)"),
    ]


def packages_check(obs: Observed, plan: Plan) -> Check:
    """Every package set the deploy installs, as `verdict.packages` decides: installed, held, its files present."""
    installed, held = obs.get_fact(DebPackages), obs.get_fact(AptHeldPackages)
    problems, count = [], 0
    for wanted in packages.for_rig(plan.knobs, obs.get_fact(OsRelease), plan.toolkit_version):
        provided = obs.get_fact(ProvidedFiles, paths=list(wanted.provides)) if wanted.provides else {}
        problems += verdict.packages(wanted, installed, held, provided)
        count += len(wanted.specs)
    fine = f"{count} packages installed, held where declared"
    return check("packages as declared", problems, fine, " (re-run the deploy)")


def boot_units_check(obs: Observed, plan: Plan) -> Check:
    """The units rigforge enables at boot, or keeps disabled, besides the vLLM instance (`verdict.unit_enabled`)."""
    problems = []
    for unit, declared in plan.boot_units.items():
        problems += verdict.unit_enabled(unit, obs.get_fact(SystemdUnitEnabled, unit=unit), declared)
    said = [unit if declared else f"{unit} disabled" for unit, declared in plan.boot_units.items()]
    return check("units enabled at boot", problems, ", ".join(said), " (re-run the deploy)")


def caps_set_last(obs: Observed, ctx: RigContext) -> Check:
    """rigforge's caps were the last written at this boot, without an ordering cycle (rigforge/observe/boot.py)."""
    found = boot.boot_caps(obs.get_fact(BootCaps, **boot_units(ctx)), ctx) if ctx.manage else (SKIP, SKIPPED)
    return Check("caps set last at this boot", *found)


def boot_order(obs: Observed, ctx: RigContext) -> Check:
    """No ordering cycle holds a unit of rigforge's: `systemd-analyze verify` of the boot, and this boot's journal
    where systemd runs (rigforge/observe/facts/cycles.py); with services not managed too (the units are installed)."""
    found = obs.get_fact(cycles.OrderingCycles, **cycles.arguments(ctx.unit))
    return Check("boot order has no cycle", *cycles.judge(found))


def vram(gpus: list[dict], v: ServedVariant, s: Settings) -> Check:
    """Every card has the VRAM variant `v` needs with settings `s` (20 GB cards: only with the documented override)."""
    name = "VRAM fits variant"
    if not gpus or not v:
        return Check(name, FAIL, "no GPU to read" if not gpus else "variant unknown")
    override = small_override(s.kv_cache_dtype, s.gpu_memory_utilization)
    sizes = "/".join(str(m) for m in sorted({g.get("memory_total") for g in gpus}))
    fine = f"{sizes} MiB per card, {v.name} needs {v.min_card_mib}" + (" (20 GB override)" * override)
    problems = vram_problems(gpus, v.name, v.min_card_mib, v.uses_dflash, override)
    return check(name, [" ".join(problems)] if problems else [], fine)


def runtime(obs: Observed, ctx: RigContext) -> Check:
    """daemon.json is merged, not rendered: the keys the docker_engine role merges in (the nvidia runtime and
    docker_daemon_options), as `verdict.json_keys` decides for the deploy too."""
    name, path = "nvidia runtime", ctx.layout.daemon_json
    daemon = obs.get_fact(JsonFile, path=path)
    if daemon is None:
        return Check(name, FAIL, f"no readable {path} (run the deploy: docker_engine role)")
    problems = verdict.json_keys(path, daemon, daemon_json_patch(ctx.knobs.docker))
    runtime = (daemon.get("runtimes") or {}).get("nvidia") or {}
    return check(name, problems, f"nvidia -> {runtime.get('path', '?')} in {path}", " (re-run the deploy)")


def unit_state(obs: Observed, ctx: RigContext) -> dict:
    """The unit's state: enabled, systemd's ActiveState, `serving` (rigforge/observe/facts/serving.py), serving_rest."""
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
    return list(sources(obs, plan, {p.name: p.commit for p in plan.sources})), fine


def _weights_valid(obs: Observed, plan: Plan) -> tuple[list[str], str]:
    fine = ", ".join(f"{a.name} ({len(a.pin.files)} files @ {str(a.pin.revision)[:12]})" for a in plan.assets)
    return list(weights(obs, plan)), fine or "no weights for this variant"


def checks(obs: Observed, ctx: RigContext) -> list[Check]:
    """Every drift check of the rig, in `rigforge verify`'s order (the API probes come after them)."""
    out = [Check("host data", FAIL, problem) for problem in ctx.problems]
    missing = f"no readable {ctx.layout.rig_json}: not provisioned by rigforge (run the deploy)"
    problems = [missing] if ctx.manifest is None else [] if ctx.variant else [variant_needed(ctx)]
    out.append(check("manifest present", problems, f"variant {ctx.variant_name}"))
    out += [driver(obs, ctx), cuda(obs, ctx), *gpu_checks(obs, ctx), caps_set_last(obs, ctx), runtime(obs, ctx)]
    out.append(boot_order(obs, ctx))
    plan = ctx.plan
    unplanned = f"lock unreadable: {ctx.lock_error}" if ctx.lock is None else None if plan else variant_needed(ctx)
    for name, find, hint in (
        ("sources at locked SHAs", lambda: _sources_at_lock(obs, plan), " (re-run the deploy: sources role)"),
        ("weights stamp valid", lambda: _weights_valid(obs, plan), " (re-run the deploy: weights role)"),
        ("files as rendered", lambda: (list(files(obs, plan)), f"{len(managed_files(plan))} files"), ""),
    ):
        out.append(Check(name, FAIL, unplanned) if unplanned else check(name, *find(), hint))
    if plan:
        out += [packages_check(obs, plan), boot_units_check(obs, plan)]
    unit = unit_state(obs, ctx)
    out.append(pins_check(ctx))
    name = unit["unit"]
    if not name:
        why = variant_needed(ctx)
        active = (FAIL, why) if ctx.manage else (SKIP, SKIPPED)
        return [*out, Check("unit enabled", FAIL, why), Check("unit active", *active), Check(RUNS_DIGEST, *active)]
    if unit["rest"] == "stopped":
        out.append(
            check(
                "unit enabled",
                [f"{name} is enabled at boot (run the deploy)"] * bool(unit["enabled"]),
                f"{name} disabled on purpose (serving_rest: stopped)",
            )
        )
    else:
        enabled = f"{name} {'enabled' if unit['enabled'] else 'not enabled (run the deploy)'}"
        out.append(Check("unit enabled", PASS if unit["enabled"] else FAIL, enabled))
    if not ctx.manage:
        return [*out, Check("unit active", SKIP, SKIPPED), Check(RUNS_DIGEST, SKIP, SKIPPED)]
    if unit["rest"] == "stopped":
        bad = [f"{name} is {unit['active']} (run the deploy to stop it)"] * (unit["serving"] not in STOPPED)
        return [
            *out,
            check("unit active", bad, f"{name} stopped on purpose (serving_rest: stopped)"),
            Check(RUNS_DIGEST, SKIP, "resting stopped (serving_rest: stopped)"),
        ]
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
    """The unit's container runs the plan's image at its locked digest (its RepoDigests, `docker inspect`)."""
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


@dataclass(frozen=True)
class GatewayPlace:
    """Where a rig declares itself at the fleet's gateways: its model's backend, at its port."""

    backend: str
    port: int | None


def gateway_place(ctx: RigContext) -> GatewayPlace | None:
    """The rig's declared place at the gateways (None: no variant, so no model)."""
    if ctx.variant is None:
        return None
    return GatewayPlace(gateway_backend(ctx.variant.served_model), ctx.port)


def gateway_check(rig: str, place: GatewayPlace | None, rest: str | None, views: Mapping[str, dict]) -> Check | None:
    """The rig at every gateway that lists it as it declares: at `place`, serving, or drained with `rest`
    (`verdict.gateway_server`: the same list the deploy's rejoin and drain act on); None: no gateway lists it."""
    seen = {gw: view["servers"][rig] for gw, view in views.items() if rig in (view.get("servers") or {})}
    if not seen:
        return None
    said = ", ".join(f"{views[gw]['rigs'][rig]} at {gw}" for gw in sorted(seen))
    if place is None:
        return Check("serving at the gateways", SKIP, f"{said} (no variant: its model and port are unknown)")
    bad = []
    for gw, servers in sorted(seen.items()):
        for problem in verdict.gateway_server(servers, place.backend, place.port, rest):
            bad.append(f"{problem} at {gw}")
    if not bad:
        resting = f": resting on purpose (serving_rest: {rest})" if rest else ""
        return Check("serving at the gateways", PASS, said + resting)
    fix = "re-run the deploy to drain it" if rest else "re-run the deploy to rejoin"
    return Check("serving at the gateways", FAIL, f"{'; '.join(bad)} ({fix})")


def fleet_checks(
    checks: list[Check], rig: str, place: GatewayPlace | None, rest: str | None, gateways: Mapping, monitors: Mapping
) -> list[Check]:
    """A rig's `checks` with "serving at the gateways" after its container's and "scraped" last, where they apply."""
    after_container = next((i + 1 for i, c in enumerate(checks) if c.name == RUNS_DIGEST), len(checks))
    out = list(checks[:after_container])
    served = gateway_check(rig, place, rest, gateways)
    if served is not None:
        out.append(served)
    out.extend(checks[after_container:])
    scraped = monitor_check(rig, rest, monitors)
    if scraped is not None:
        out.append(scraped)
    return out


def monitor_check(rig: str, rest: str | None, views: Mapping[str, dict | None]) -> Check | None:
    """The check "scraped": the rig's targets (label `rig`) up at every monitor; None: no monitor. vLLM (or
    llama.cpp) down while resting stopped is fine. A monitor not asked, or a target not scraped yet, is unknown, never
    up: the check is skipped for it unless something else failed."""
    if not views:
        return None
    problems, unknown, fine = [], [], []
    for mon, view in sorted(views.items()):
        if view is None or view["targets"] is None:
            why = "host not read" if view is None else answer(view["http"])
            unknown.append(f"the monitor {mon} could not be asked ({why})")
            continue
        mine = [t for t in view["targets"] if (t.get("labels") or {}).get("rig") == rig]
        if not mine:
            problems.append(f"not among {mon}'s targets (re-run the deploy on the monitor)")
        for t in sorted(mine, key=lambda t: t["labels"].get("job", "")):
            job, health = t["labels"].get("job", "?"), t.get("health")
            if health == "up":
                fine.append(f"{job} up")
            elif job in ("vllm", "llamacpp") and rest == "stopped":
                fine.append(f"{job} {health}: resting stopped on purpose (serving_rest)")
            elif health == "down":
                problems.append(f"{job} down at {mon}: {t.get('lastError') or 'no error given'}")
            else:
                unknown.append(f"{job} {health or 'unknown'} at {mon} (not scraped yet)")
    if problems:
        return Check("scraped", FAIL, "; ".join(problems + unknown))
    if unknown:
        return Check("scraped", SKIP, "unknown: " + "; ".join(unknown + fine))
    return Check("scraped", PASS, f"{', '.join(fine)} at {', '.join(sorted(views))}")


def monitor_line(views: Mapping[str, dict | None]) -> str:
    """'monitor: mon1 (http://mon1:9090): Prometheus answers, 6 targets, 6 up', or that the inventory has none."""
    if not views:
        return "monitor: no monitor in the inventory (group monitor): no rig is scraped"
    said = []
    for mon, view in sorted(views.items()):
        if view is None:
            said.append(f"{mon} (could not be read)")
        elif view["targets"] is None:
            said.append(f"{mon} ({view['url']}): Prometheus did not answer ({answer(view['http'])})")
        else:
            up = sum(t.get("health") == "up" for t in view["targets"])
            said.append(f"{mon} ({view['url']}): Prometheus answers, {len(view['targets'])} targets, {up} up")
    return "monitor: " + "; ".join(said)


# ---------------------------------------------------------------- the fleet gateway, observed
