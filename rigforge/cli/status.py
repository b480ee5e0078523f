"""`rigforge status INVENTORY`: one row per rig, every rig read in parallel and shown against its plan
(rigforge/observe/drift.py, docs/operators.md); nothing on a rig is changed.

Exit: 0 every rig read, 1 some rig could not be read, 2 the inventory could not be loaded.
"""

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from pyinfra.api import Host

from rigforge.model import fleet
from rigforge.model.driver_table import version_key
from rigforge.model.hardware import data_root_left, data_root_of
from rigforge.model.pins import LockError, default_lock_path, load_lock
from rigforge.observe import drift, hosts, inventory
from rigforge.observe.boot import watts
from rigforge.observe.facts.docker import DataRootLeft
from rigforge.observe.facts.files import JsonFile

ROLLOUT_MARKER = ".rollout.json"  # beside the lock in use while `rigforge rollout` runs or stopped midway

DEFAULT_LOCK = default_lock_path()


def status_row(host: Host, fl: fleet.Fleet) -> dict:
    """A rig's row of `rigforge status` (one batched probe): its variant, pins and drift, GPUs and caps, image source,
    service, checks (verify's, without the live chat/tool probes), gateway place and its API's answer."""
    ctx, obs = hosts.observe(host, fl)
    pins = drift.pin_drift(ctx)
    if pins["drift"] is not None:  # what the rig holds now, beside what its manifest records
        pins["drift"] += drift.rig_drift(obs, ctx)
    row = {
        "host": host.name,
        "error": None,
        "variant": ctx.variant_name,
        "variant_from": ctx.variant_from,
        "variant_in_inventory": ctx.data["rigforge_variant"],
        "recipe": recipe_of(ctx),  # a recipe-repo slug's registry name (vllm/dual), else None
        "provisioned_at": (ctx.manifest or {}).get("provisioned_at"),
        "manifest": ctx.manifest is not None,
        "lock": str(ctx.data["rigforge_lock"] or DEFAULT_LOCK),
        "lock_error": ctx.lock_error,
        "pins": pins["pins"],
        "pin_drift": pins["drift"],
        "gpus": [
            {
                "index": g["index"],
                "name": g.get("name"),
                "power_limit_w": g.get("power_limit"),
                "target_w": g["target_w"],
                "cap_ok": g.get("power_limit") is not None and g.get("power_limit") == g["target_w"],
                "memory_used_mib": g.get("memory_used"),
                "memory_total_mib": g.get("memory_total"),
                "persistence_mode": g.get("persistence_mode"),
            }
            for g in drift.gpus_with_targets(obs, ctx)
        ],
        "cuda": drift.cuda_versions(obs, ctx),  # {"driver": "13.0", "image": "13.0"}
        "power": drift.power_view(obs, ctx),
        "image": hosts.image_origin(obs, ctx, fl.registry),  # where the locked image comes from
        "services_managed": ctx.manage,
        "service": drift.unit_state(obs, ctx),
        "checks": [asdict(c) for c in drift.checks(obs, ctx)],  # verify's, without its live chat/tool probes
        "problems": ctx.problems,
        "rest": ctx.data["serving_rest"],  # host data's, else the rig's own record (rig.json)
        "gateway_place": place_of(ctx),  # its model's backend and its port at the fleet gateways
        "rest_from": ctx.rest_from,
        "candidate": candidate_of(ctx),  # a rollout in progress: does this rig run its candidate lock?
        "data_root_left": data_root_left_on(obs, ctx),  # an earlier Docker data-root, unused and left in place
    }
    if ctx.port is None:
        return row | {"api": {"url": None, "reachable": False, "detail": "no port: variant unknown"}}
    api = inventory.api_models(host, ctx)
    api["reachable"] = api["http_code"] == 200
    unmanaged = "" if ctx.manage else "; services not managed on this host"
    api["detail"] = "" if api["reachable"] else drift.answer(api["http_code"]) + unmanaged
    return row | {"api": api}


def place_of(ctx: hosts.RigContext) -> dict | None:
    """The rig's declared place at the gateways (`drift.gateway_place`) as JSON: {"backend", "port"} or None."""
    place = drift.gateway_place(ctx)
    return asdict(place) if place else None


def data_root_left_on(obs: hosts.Observed, ctx: hosts.RigContext) -> str | None:
    """The note on Docker's default data-root when the rig's daemon.json moved Docker elsewhere (hardware.py)."""
    daemon = obs.get_fact(JsonFile, path=ctx.layout.daemon_json)
    now = data_root_of([json.dumps(daemon)] if daemon else None)
    return data_root_left(now, now, lambda path: obs.get_fact(DataRootLeft, path=path, data_root=now))


def recipe_of(ctx: hosts.RigContext) -> str | None:
    """The slug (vllm/dual) the rig's plan or manifest names, for a variant served from the recipe repo."""
    extra = ctx.variant.manifest_extra if ctx.variant else {}
    return extra.get("recipe") or (ctx.manifest or {}).get("recipe")


def candidate_of(ctx: hosts.RigContext) -> dict | None:
    """{"lock": a rollout's candidate (rigforge/cli/rollout.py's marker), "runs": the manifest records its pins} or
    None."""
    marker = Path(f"{ctx.data['rigforge_lock'] or DEFAULT_LOCK}{ROLLOUT_MARKER}")
    try:
        path = json.loads(marker.read_text())["candidate"]
        cand = load_lock(path)
    except (OSError, ValueError, KeyError, LockError):
        return None
    pins = ctx.manifest_pins()
    images = {cand.pinned(p.ref) for p in (cand.image, *cand.images.values())}
    git = all(name in cand.git and cand.git[name].commit == commit for name, commit in pins["git"].items())
    return {"lock": path, "runs": pins["image"] in images and git}


def host_row(host: Host, fl: fleet.Fleet) -> dict:
    """A rig's row; a gateway's or monitor's host carries its view too."""
    if fl.is_rig(host.name):
        row = status_row(host, fl)
    else:
        row = {"host": host.name, "error": None, "rig": False, "rest": fleet.host_data(host.data)["serving_rest"]}
    if fl.has(host.name, fleet.GATEWAY):
        row["gateway"] = hosts.observe_gateway(host, fleet.host_data(host.data))
    if fl.has(host.name, fleet.MONITOR):
        row["monitor"] = hosts.observe_monitor(host)
    return row


def _read_rig(r: dict) -> bool:
    """A rig's row, read (not an error, not the row of a gateway or monitor host only)."""
    return not r.get("error") and r.get("rig") is not False


def monitor_views(rows: list[dict], monitors: tuple[str, ...]) -> dict[str, dict | None]:
    """{monitor host: what it read of the fleet, None when it could not be read}."""
    return {r["host"]: None if r.get("error") else r.get("monitor") for r in rows if r["host"] in monitors}


def with_fleet_checks(rows: list[dict], monitors: tuple[str, ...]) -> list[dict]:
    """Each rig's checks with the gateways' and monitors' (`drift.fleet_checks`, their rows read in the same pass)."""
    gateways, views = {r["host"]: r["gateway"] for r in rows if r.get("gateway")}, monitor_views(rows, monitors)
    for r in filter(_read_rig, rows):
        place = drift.GatewayPlace(**r["gateway_place"]) if r.get("gateway_place") else None
        checks = [drift.Check(**c) for c in r["checks"]]
        checks = drift.fleet_checks(checks, r["host"], place, r["rest"], gateways, views)
        r["checks"] = [asdict(c) for c in checks]
    return rows


add_arguments = inventory.add_arguments


def run(args: argparse.Namespace) -> int:
    if (read := inventory.read_fleet(args, "status", host_row)) is None:
        return 2
    results, fl = read
    rows = [{"host": n, "error": str(r)} if isinstance(r, Exception) else r for n, r in results.items()]
    rows = with_fleet_checks(rows, fl.monitors)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_table(rows) + "\n" + drift.monitor_line(monitor_views(rows, fl.monitors)))
    return 1 if any(r["error"] for r in rows) else 0


def _cells(r: dict) -> list[str]:
    if r["error"]:
        return [r["host"], f"ERROR: {r['error']}"]
    if r.get("rig") is False:
        roles = " and ".join(role for role in ("gateway", "monitor") if r.get(role))
        return [r["host"], f"the fleet {roles or 'host'} (no rig)"]
    variant, wanted = r["variant"] or "-", r["variant_in_inventory"]
    if wanted and r["variant"] and wanted not in (r["variant"], r.get("recipe")):  # a slug names its variant too
        variant += f" (inventory: {wanted})"
    pins = f"DRIFT ({len(r['pin_drift'])})" if r["pin_drift"] else "ok"
    pins = "no rig.json" if not r["manifest"] else "lock unreadable" if r["lock_error"] else pins
    gpus = r["gpus"]
    names = sorted({g["name"] or "?" for g in gpus})
    gpu = f"{len(gpus)}x {'/'.join(n.replace('NVIDIA GeForce ', '') for n in names)}" if gpus else "none"
    caps = [f"{g['index']}:{watts(g['power_limit_w'])}/{watts(g['target_w'])}" + "!" * (not g["cap_ok"]) for g in gpus]
    power = " ".join(caps) + ("  DRIFT" if any(not g["cap_ok"] for g in gpus) else "") or "-"
    vram = " ".join(f"{g['memory_used_mib']}/{g['memory_total_mib']}" for g in gpus) or "-"
    persist = ",".join({True: "on", False: "off"}.get(g["persistence_mode"], "?") for g in gpus) or "-"
    s = r["service"]
    service = "-" if not s["unit"] else f"{'enabled' if s['enabled'] else 'disabled'}/{s['active']}"
    if s.get("serving") in ("crashing", "starting"):
        service += f" ({s['serving']})"
    if s.get("rest"):
        service += f" (resting {s['rest']})"
    if not r["services_managed"]:
        service += " (not managed)"
    api = "yes" if r["api"]["reachable"] else f"no ({r['api']['detail']})"
    c = r["cuda"]
    cuda = f"{c['driver'] or '?'}/{c['image'] or '?'}"
    if c["driver"] and c["image"] and version_key(c["driver"]) < version_key(c["image"]):
        cuda += "  DRIVER TOO OLD"
    return [r["host"], variant, pins, gpu, power, vram, persist, cuda, service, api]


HEADER = [
    "HOST",
    "VARIANT",
    "PINS",
    "GPUS",
    "POWER W cap/target",
    "VRAM MiB used/total",
    "PERSIST",
    "CUDA driver/image",
    "SERVICE",
    "API",
]


def format_table(rows: list[dict]) -> str:
    table = [HEADER] + [_cells(r) for r in rows]  # an error's row, or a host's that is no rig: two cells
    widths = [max(map(len, column)) for column in zip(*(c for c in table if len(c) == len(HEADER)), strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip() for cells in table]
    return "\n".join(lines + [f"{r['host']}: {note}" for r in rows for note in notes(r)])


def notes(r: dict) -> list[str]:
    """The lines under the table for row `r` (each printed after "host: "): its gateway, power caps, image, drift."""
    out = []
    if g := r.get("gateway"):
        health = "healthy" if g["health"] == 200 else "NOT HEALTHY"
        rigs = ", ".join(f"{name} {state}" for name, state in sorted(g["rigs"].items())) or "no rig"
        models = ", ".join(g["models"]) if g["models"] is not None else f"no answer ({g['models_http']})"
        url = g.get("public") or g["url"]  # where clients reach it
        out.append(f"gateway {url} {health} (haproxy {g['unit']}, /health {g['health']}); models: {models}; {rigs}")
    if p := r.get("power"):  # 'power caps: 230 W, set last at this boot (...); recipe: ...'
        caps = "/".join(f"{w:g}" for w in sorted(set(p["caps"].values()))) or "?"
        out.append(f"power caps: {caps} W{', ' + p['order'] if p['order'] else ''}; {p['recipe']}")
        out += [f"WARNING: {w}" for w in p["warnings"]]
        out += [f"interconnect: {p['interconnect_summary']}"] if p["interconnect_summary"] else []
    if i := r.get("image"):
        held = "on the rig" if i["on_rig"] else "NOT on the rig"
        out.append(f"{'WARNING: ' if i['warning'] else ''}image {i['image']}: {held}; from {i['from']}")
    out += [f"pin drift: {d}" for d in r.get("pin_drift") or []]
    if c := r.get("candidate"):  # a rollout in progress
        out.append(f"rollout in progress: {'runs' if c['runs'] else 'does not run yet'} the candidate {c['lock']}")
    out += [f"note: {r['data_root_left']}"] if r.get("data_root_left") else []
    if r.get("rest") and _read_rig(r):
        where = r.get("rest_from") or "host data serving_rest"
        out.append(f"resting {r['rest']} on purpose ({where}): intended, not drift")
    for c in r.get("checks") or []:
        if c["name"] == "scraped":  # the monitor's view, not drift
            out.append(f"scraped: {'NO: ' if c['status'] == drift.FAIL else ''}{c['detail']}")
        elif c["status"] == drift.FAIL and c["name"] != "pins as locked":  # pin drift: listed above
            out.append(f"DRIFT {c['name']}: {c['detail']}")
    return out + list(r.get("problems") or [])
