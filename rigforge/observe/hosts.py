"""A rig (in one batched probe, rigforge/observe/facts/probe.py `read`), a gateway or a monitor host read, changing
nothing."""

import json
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api import FactBase
from pyinfra.api.host import Host
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.files import File, Sha256File

from rigforge.layout import (
    HOLD_SCRIPT,
    HOLD_TIMER,
    HOLD_UNIT,
    SERVE_FILES,
    SETTLE_SCRIPT,
    SETTLE_UNIT,
    HostLayout,
)
from rigforge.model import fleet, gateway, monitor, packages
from rigforge.model.driver_table import DriverTableError, packages_for
from rigforge.model.fleet import Plan, PlannedAsset, ServedVariant
from rigforge.model.hardware import gpu_count
from rigforge.model.knobs.roles import RoleKnobs
from rigforge.model.knobs.serving import REST
from rigforge.model.pins import LockError, load_lock
from rigforge.model.registry import RegistryPlan
from rigforge.model.render import POWER_UNIT, VLLM_UNIT
from rigforge.model.schema import Settings
from rigforge.observe import inventory, obtain, verdict
from rigforge.observe.facts import cycles, nvidia, probe
from rigforge.observe.facts.apt import DebInstalledVersion
from rigforge.observe.facts.docker import DockerImagePresent
from rigforge.observe.facts.files import JsonFile
from rigforge.observe.facts.gitpin import GitCheckout
from rigforge.observe.facts.hfweights import WeightsState
from rigforge.observe.facts.nvidia import BootCaps, NvidiaGpus, NvidiaModuleVersion, NvidiaRunningDriver, NvidiaTopology
from rigforge.observe.facts.serving import ComposeImages, ServiceState
from rigforge.observe.facts.system import AptHeldPackages, OsRelease, ProvidedFiles, SystemdUnitEnabled


class Observed:
    """The rig as read for a plan: answers from one batched probe, anything else read live (as host.get_fact)."""

    def __init__(self, host: Host, requests: Sequence[tuple[type, dict]] = ()) -> None:
        self.host = host
        self.answers = probe.read(host, list(requests)) if requests else {}

    def get_fact(self, cls: type[FactBase], **kwargs: Any) -> Any:  # each fact's own shape (ANN401 is off)
        key = probe.fact_key(cls, kwargs)
        return self.answers[key] if key in self.answers else self.host.get_fact(cls, **kwargs)


@dataclass
class RigContext:
    """What the controller knows about a rig: its plan (None: host data or the lock give none), manifest, problems."""

    name: str
    data: dict  # host data, the roles' defaults applied (rigforge/model/fleet.py host_data)
    plan: Plan | None = None
    layout: HostLayout = field(default_factory=HostLayout)
    variant_name: str | None = None
    variant_from: str = ""
    lock: Any = None  # rigforge.model.pins.Lock or None
    lock_error: str | None = None
    manifest: dict | None = None
    problems: list[str] = field(default_factory=list)
    cap_units: dict = field(default_factory=dict)  # the rig's other cap writers at boot (PowerCapUnits)
    rest_from: str = "host data serving_rest"  # where data["serving_rest"] comes from (rest_record)

    @property
    def knobs(self) -> RoleKnobs:
        """Every role's knobs of this rig, typed: its plan's, else its host data's (a rig with no plan yet)."""
        return self.plan.knobs if self.plan else RoleKnobs.of(self.data)

    @property
    def manage(self) -> bool:
        return self.knobs.serving.rigforge_manage_services

    @property
    def variant(self) -> ServedVariant | None:
        return self.plan.variant if self.plan else None

    @property
    def settings(self) -> Settings:
        return self.plan.settings if self.plan else Settings()

    @property
    def port(self) -> int | None:
        manifest = self.manifest or {}
        return self.plan.port if self.plan else int(manifest["port"]) if manifest.get("port") else None

    @property
    def unit(self) -> str | None:
        manifest = self.manifest or {}
        return manifest.get("unit") or (self.layout.instance(self.variant_name) if self.variant_name else None)

    def manifest_pins(self) -> dict:
        m = self.manifest or {}
        pins = m.get("pins") if isinstance(m.get("pins"), dict) else m
        return {"git": pins.get("git") or {}, "hf": pins.get("hf") or {}, "image": pins.get("image")}


def requests(ctx: RigContext, os_release: dict) -> list[tuple[type, dict]]:
    """Every fact the checks read for this rig's plan (on `os_release`, OsRelease's), for one batched probe."""
    os_id = os_release.get("id")
    out = [(cls, {}) for cls in (NvidiaGpus, OsRelease, NvidiaModuleVersion, NvidiaRunningDriver, NvidiaTopology)]
    out.append((nvidia.NvidiaPciGpus, {}))  # a card nvidia-smi does not list (drift.gpu_checks)
    driver = ctx.knobs.driver
    with suppress(DriverTableError):  # the driver table's package whose version is the driver's (none: not read)
        if driver.nvidia_driver_manage:
            out.append((DebInstalledVersion, {"package": packages_for(driver, os_id).version_package}))
    out.append((JsonFile, {"path": ctx.layout.daemon_json}))
    if ctx.manage:  # what ran at this boot (rigforge/observe/boot.py)
        out.append((BootCaps, boot_units(ctx)))
    out.append((cycles.OrderingCycles, cycles.arguments(ctx.unit)))  # boot-order cycles: status and verify only
    if ctx.unit:
        out += [(SystemdUnitEnabled, {"unit": ctx.unit}), (ServiceState, {"unit": ctx.unit})]
    if plan := ctx.plan:
        out += [(DebPackages, {}), (AptHeldPackages, {})]
        for wanted in packages.for_rig(plan.knobs, os_release, plan.toolkit_version):
            out += [(ProvidedFiles, {"paths": list(wanted.provides)})] if wanted.provides else []
        out += [(SystemdUnitEnabled, {"unit": unit}) for unit in plan.boot_units]
        out += [(GitCheckout, {"path": plan.layout.src(name)}) for name in plan.variant.sources]
        out += [(WeightsState, weights_at(plan, asset)) for asset in plan.assets]
        out += [(cls, {"path": path}) for path in managed_files(plan) for cls in (File, Sha256File)]
    if plan and ctx.manage:
        out += [(ComposeImages, {"serve_dir": plan.layout.serve_dir}), (DockerImagePresent, {"image": plan.image})]
    return out


def observe(host: Host, fl: fleet.Fleet) -> tuple[RigContext, Observed]:
    """The rig's plan (`fl`'s, unless the manifest and GPUs read first say otherwise) and the rig read for it."""
    data = fleet.host_data(host.data)
    ctx = RigContext(name=host.name, data=data)
    layout = HostLayout(root=data["rigforge_root"] or HostLayout.root)
    reads = [(JsonFile, {"path": layout.rig_json}), (NvidiaGpus, {}), (OsRelease, {}), (nvidia.PowerCapUnits, {})]
    reads += [(nvidia.NvidiaPciGpus, {})]  # a card off the bus still counts (hardware.gpu_count)
    first = Observed(host, reads)
    ctx.cap_units = first.get_fact(nvidia.PowerCapUnits) or {}
    ctx.manifest = first.get_fact(JsonFile, path=layout.rig_json)
    manifest = ctx.manifest or {}
    rest_record(ctx, layout.rig_json)
    wanted = data["rigforge_variant"]
    recorded = manifest.get("recipe") or manifest.get("variant")
    ctx.variant_name = manifest.get("variant") or wanted
    ctx.variant_from = layout.rig_json if recorded else ("host data rigforge_variant" if wanted else "")
    try:
        ctx.lock = load_lock(data["rigforge_lock"])
    except (LockError, OSError) as exc:
        ctx.lock_error = str(exc)
    if (recorded or wanted) and ctx.lock is not None:
        gpus = gpu_count(first.get_fact(NvidiaGpus), first.get_fact(nvidia.NvidiaPciGpus))
        serve = {**data, "rigforge_variant": recorded or wanted, "rigforge_recipe_opt_in": True}
        if not recorded or recorded == wanted:  # the variant the fleet built the plan for
            ctx.plan, ctx.problems = fl.completed(host.name, gpus, ctx.cap_units)
        else:  # the rig runs another variant than the inventory's: its plan is that variant's
            ctx.plan, ctx.problems = fleet.plan_for(
                host.name, serve, None, gpus, False, tuple(ctx.cap_units), registry=fl.registry
            )
    if ctx.plan:
        ctx.layout, ctx.variant_name = ctx.plan.layout, ctx.plan.variant.name
    return ctx, Observed(host, requests(ctx, first.get_fact(OsRelease)))


def rest_record(ctx: RigContext, rig_json: str) -> None:
    """The rest the rig's manifest records (the last deploy's serving_rest, e.g. given with --data) when host data
    sets none: the rig rests on purpose; host data's own serving_rest is what is declared, and wins."""
    recorded = (ctx.manifest or {}).get("serving_rest")
    if ctx.data["serving_rest"] is None and recorded in REST and recorded is not None:
        ctx.data = {**ctx.data, "serving_rest": recorded}
        ctx.rest_from = f"{rig_json} records serving_rest: {recorded}, from the last deploy"


def weights_at(plan: Plan, asset: PlannedAsset) -> dict[str, str]:
    return {"dest": plan.layout.asset_dir(asset.dir), "staging": plan.layout.weights_staging(asset.name)}


def managed_files(plan: Plan) -> dict[str, tuple[str, str]]:
    """{path on the rig: (the plan's text, its mode in octal digits)} of every file rigforge renders whole."""
    layout, files = plan.layout, plan.files
    out = {f"{layout.serve_dir}/{name}": (files[name], SERVE_FILES[name]) for name in SERVE_FILES if name in files}
    units = (VLLM_UNIT, POWER_UNIT, SETTLE_UNIT, HOLD_UNIT, HOLD_TIMER)
    out |= {layout.unit_path(name): (files[name], "644") for name in units if name in files}
    scripts = {layout.settle_script: SETTLE_SCRIPT, layout.hold_script: HOLD_SCRIPT}
    return out | {path: (files[name], "755") for path, name in scripts.items() if name in files}


def image_origin(obs: Observed, ctx: RigContext, reg: RegistryPlan | None) -> dict | None:
    """{"image", "on_rig", "from", "warning"} (obtain.py `origin`), its sources asked now; `reg`: the fleet registry's
    plan. None: no plan, or services not managed."""
    plan = ctx.plan
    if not plan or not ctx.manage:
        return None
    knobs = plan.knobs.serving
    found = obtain.sources(plan.locked_image, reg, knobs.serving_image_upstream, knobs.serving_image_upstream_ca)
    on_rig = bool(obs.get_fact(DockerImagePresent, image=plan.image))
    text, warning = obtain.origin(on_rig, found)
    return {"image": plan.image, "on_rig": on_rig, "from": text, "warning": warning}  # what `on_rig` looked for


def boot_units(ctx: RigContext) -> dict:
    """BootCaps' arguments: the other writers' units, whose results at this boot it reads."""
    return {"units": " ".join(n for n, w in ctx.cap_units.items() if w.get("kind", "unit") == "unit")}


def observe_gateway(host: Host, data: Mapping) -> dict:
    """The gateway on `host`: HAProxy's unit, its /health, /v1/models through it, each rig's state (`show stat`)."""
    bind = data.get("gateway_bind_address") or "127.0.0.1"
    url = f"http://{'127.0.0.1' if bind == '0.0.0.0' else bind}:{data['gateway_port']}"  # asked on the host
    where = bind if data.get("gateway_bind_address") not in (None, "0.0.0.0") else None
    address = where or getattr(host, "data", {}).get("ssh_hostname") or host.name
    public = data.get("gateway_url") or f"http://{address}:{data['gateway_port']}"  # where clients reach it
    servers = gateway_servers(inventory.sh(host, gateway.read_servers_script()))
    code, body = inventory.http_on_rig(host, f"{url}/v1/models", 5, api_key=data.get("gateway_api_key"))
    try:
        models = [m["id"] for m in json.loads(body)["data"]]
    except (ValueError, KeyError, TypeError):
        models = None
    return {
        "url": url,
        "public": public,
        "unit": inventory.sh(host, "systemctl is-active haproxy.service").strip() or "unknown",
        "health": inventory.http_on_rig(host, f"{url}/health", 5)[0],
        "models_http": code,
        "models": models,
        "servers": servers,  # {rig: {backend: its record}}: what drift.gateway_check decides on
        "rigs": {rig: rig_at_gateway(by_backend) for rig, by_backend in servers.items()},
    }


def observe_monitor(host: Host) -> dict:
    """The monitor's Prometheus, asked on `host`: {"url" (the host's address), "http", "targets" (None: no answer)}."""
    data = getattr(host, "data", {})
    url = data.get("monitor_url") or f"http://{data.get('ssh_hostname') or host.name}:{monitor.PORT}"
    code, body = inventory.http_on_rig(host, f"http://127.0.0.1:{monitor.PORT}{monitor.TARGETS_PATH}", 10)
    return {"url": url, "http": code, "targets": monitor.active_targets(code, body)}


ADMIN_MAINT_BITS = 0x01 | 0x02 | 0x04 | 0x20 | 0x40  # HAProxy's SRV_ADMF_*: forced, inherited, from DNS ...
ADMIN_DRAIN_BITS = 0x08 | 0x10  # SRV_ADMF_FDRAIN, SRV_ADMF_IDRAIN
OP_STATE_UP = (2, 3)  # SRV_ST_RUNNING, SRV_ST_STOPPING: up (STOPPED 0, STARTING 1: not yet)


def _table(lines: list[str], separator: str | None) -> list[dict[str, str]]:
    """Rows of one of HAProxy's runtime API tables: a `# name name ...` header, then the rows."""
    header = next((i for i, line in enumerate(lines) if line.startswith("# ")), None)
    if header is None:
        return []
    names = lines[header][2:].split(separator)
    rows = []
    for line in lines[header + 1 :]:
        if line.strip():
            rows.append(dict(zip(names, line.split(separator), strict=False)))
    return rows


def gateway_servers(answer: str) -> dict[str, dict[str, dict]]:
    """{rig: {backend: record}} from `gateway.read_servers_script`'s answer. A record: "admin" (ready, drain or maint),
    "up" (its health checks), "port" (where the gateway sends it), "since_s" and "last_check" (from `show stat`)."""
    state_text, _, stat_text = answer.partition(gateway.STAT_MARK)
    stat = {}
    for row in _table(stat_text.splitlines(), ","):
        stat[(row.get("pxname"), row.get("svname"))] = row
    servers: dict[str, dict[str, dict]] = {}
    for row in _table(state_text.splitlines(), None):
        backend, name = row.get("be_name"), row.get("srv_name")
        if not backend or not name or backend == "no_model":
            continue
        admin_bits = int(row.get("srv_admin_state") or 0)
        admin = "maint" if admin_bits & ADMIN_MAINT_BITS else "drain" if admin_bits & ADMIN_DRAIN_BITS else "ready"
        shown = stat.get((backend, name), {})
        code = shown.get("check_code") or ""
        check = [shown.get("check_status") or "", f"HTTP {code}" if code else "", shown.get("last_chk") or ""]
        since = shown.get("lastchg") or ""
        port = row.get("srv_port") or ""
        servers.setdefault(name, {})[backend] = {
            "admin": admin,
            "up": int(row.get("srv_op_state") or 0) in OP_STATE_UP,
            "port": int(port) if port.isdigit() else None,
            "since_s": int(since) if since.isdigit() else None,
            "last_check": " ".join(part for part in check if part),
        }
    return servers


def rig_at_gateway(by_backend: Mapping[str, Mapping]) -> str:
    """A rig's state at one gateway, as status shows it: in the backend where it is not in maintenance (a rig is in
    every backend, taken out of the models it does not serve), else MAINT."""
    serving = [server for server in by_backend.values() if server["admin"] != "maint"]
    return verdict.gateway_said(serving[0]) if serving else "MAINT"
