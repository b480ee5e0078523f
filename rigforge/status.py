"""`rigforge status INVENTORY`: what each rig of a pyinfra inventory runs, one row per rig.

Reads every rig in parallel over SSH with pyinfra (the inventory's own connection data and `_sudo`):
the manifest /etc/rigforge/rig.json written by the serving role (variant, pins, time), the lock the
inventory points at (`rigforge_lock`), nvidia-smi (GPUs, power cap, VRAM used, persistence mode), the
vLLM unit's state and whether the API answers on the rig. Power targets come from host data
(`gpu_power_limit_w`, default 230, and `gpu_power_limits`), exactly as the deploy computes them.
A rig that cannot be reached is a row with the error. Nothing on a rig is changed.

Exit: 0 every rig read, 1 some rig could not be read, 2 the inventory could not be loaded.
This module also holds the inventory/SSH plumbing `rigforge verify` uses.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rigforge import drift
from rigforge.layout import HostLayout
from rigforge.pins import LockError, default_lock_path, load_lock
from rigforge.schema import Settings, power_caps
from roles.facts.managed import JsonFile

DEFAULT_LOCK = default_lock_path()
SKIPPED = "skipped (services not managed on this host)"


class InventoryError(Exception):
    """The inventory could not be loaded (exit 2)."""


# ---------------------------------------------------------------- inventory and SSH plumbing


def open_inventory(path: str):
    """A pyinfra State over the inventory file (group_data/ beside it is applied, as pyinfra does)."""
    if not Path(path).is_file():
        raise InventoryError(f"{path}: no such inventory file (give a pyinfra inventory, e.g. inventories/home.py)")
    # pyinfra_cli patches sockets for gevent on import (that is what makes the SSH sessions parallel): import
    # it here, only in commands that use SSH. Under `rigforge`, ssl was already imported (requests, for bench);
    # gevent then warns that ssl is not patched: nothing here uses ssl (SSH is paramiko over patched sockets).
    import warnings

    from gevent.monkey import MonkeyPatchWarning

    warnings.filterwarnings("ignore", category=MonkeyPatchWarning)
    from pyinfra.api import Config, State
    from pyinfra.context import ctx_config, ctx_inventory, ctx_state
    from pyinfra_cli.inventory import make_inventory

    logging.getLogger("pyinfra").setLevel(logging.CRITICAL)  # errors are reported in our own output
    state = State(check_for_changes=False)  # set up as the pyinfra CLI does, so group_data files load
    state.cwd = os.getcwd()
    ctx_state.set(state)
    config = Config()
    ctx_config.set(config)
    try:
        inventory = make_inventory(path, cwd=state.cwd)
    except Exception as exc:
        raise InventoryError(f"{path}: cannot load the inventory: {exc}") from None
    if not len(inventory):
        raise InventoryError(f"{path}: the inventory lists no hosts")
    ctx_inventory.set(inventory)
    state.init(inventory, config)
    return state


def for_each_host(state, fn) -> dict[str, Any]:
    """Connect to every host and run fn(host) on each in parallel: {host name: result or Exception}."""
    import gevent

    def task(host):
        try:
            host.connect(show_errors=False, raise_exceptions=True)
        except Exception as exc:
            return Unreachable(f"cannot connect: {_one_line(exc)}")
        state.activate_host(host)
        problem = _command_problem(host)
        if problem:
            return Unreachable(problem)
        try:
            return fn(host)
        except Exception as exc:
            return Unreachable(f"{type(exc).__name__}: {_one_line(exc)}")
        finally:
            try:
                host.disconnect()
            except Exception:
                pass

    hosts = list(state.inventory)
    jobs = [state.pool.spawn(task, host) for host in hosts]
    gevent.joinall(jobs)
    return {host.name: job.value for host, job in zip(hosts, jobs, strict=True)}


class Unreachable(Exception):
    pass


def _command_problem(host) -> str | None:
    """Why commands cannot run on a connected host (e.g. sudo wants a password); None when they can."""
    from pyinfra.api import StringCommand

    kwargs = {"_sudo": bool(host.data.get("_sudo"))}
    if host.data.get("_sudo_user"):
        kwargs["_sudo_user"] = host.data.get("_sudo_user")
    ok, output = host.run_shell_command(StringCommand("true"), **kwargs)
    if ok:
        return None
    how = "with sudo " if kwargs["_sudo"] else ""
    why = " ".join(line.strip() for line in output.stderr_lines[:2]) or "no error output"
    return (
        f"connected, but cannot run commands {how}({why}); "
        "the SSH user needs passwordless sudo (check _sudo / _sudo_user in host data)"
    )


def _one_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if exc.args else str(exc)
    return " ".join(text.split()) or type(exc).__name__


def sh(host, command) -> str:
    """Output of a read-only command on the host (the host's `_sudo` applies). Never fails: `|| true`."""
    from pyinfra.api import StringCommand
    from pyinfra.facts.server import Command

    cmd = command if isinstance(command, StringCommand) else StringCommand(command)
    out = host.get_fact(Command, command=StringCommand("(", cmd, ") 2>/dev/null || true"))
    return out or ""


# ---------------------------------------------------------------- what a rig should be


@dataclass
class RigContext:
    """What the controller knows about a rig: its plan (rigforge/plan.py, from host data and the lock, for the
    variant its manifest records, else host data's), the manifest, and the problems building the plan."""

    name: str
    data: dict  # host data, the roles' defaults applied (roles/site.py host_data)
    plan: Any = None  # rigforge.plan.Plan, or None when host data or the lock cannot give one
    layout: HostLayout = field(default_factory=HostLayout)
    variant_name: str | None = None
    variant_from: str = ""
    lock: Any = None  # rigforge.pins.Lock or None
    lock_error: str | None = None
    manifest: dict | None = None
    problems: list[str] = field(default_factory=list)

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


def rig_context(host) -> RigContext:
    from roles import site
    from roles.facts.nvidia import NvidiaGpus

    data = site.host_data(host.data)
    ctx = RigContext(name=host.name, data=data)
    layout = HostLayout(root=data["rigforge_root"] or HostLayout.root)
    ctx.manifest = host.get_fact(JsonFile, path=layout.rig_json)
    wanted = data["rigforge_variant"]
    recorded = (ctx.manifest or {}).get("recipe") or (ctx.manifest or {}).get("variant")
    ctx.variant_name = (ctx.manifest or {}).get("variant") or wanted
    ctx.variant_from = layout.rig_json if recorded else ("host data rigforge_variant" if wanted else "")
    try:
        ctx.lock = load_lock(data["rigforge_lock"])
    except (LockError, OSError) as exc:
        ctx.lock_error = str(exc)
    if not (recorded or wanted) or ctx.lock is None:
        return ctx
    gpus = len(host.get_fact(NvidiaGpus) or []) or None
    serve = {**data, "rigforge_variant": recorded or wanted, "rigforge_recipe_opt_in": True}
    ctx.plan, problems = site.plan_for(host.name, serve, gpus=gpus, deployable=False)
    ctx.problems += problems
    if ctx.plan:
        ctx.layout, ctx.variant_name = ctx.plan.layout, ctx.plan.variant.name
    return ctx


def pin_drift(ctx: RigContext) -> dict:
    """Pins recorded in the manifest vs the lock: {"drift": [...], "pins": {...}}; None without both."""
    if ctx.manifest is None or ctx.lock is None:
        return {"drift": None, "pins": None}
    pins = ctx.manifest_pins()
    drift = []
    for name, sha in sorted(pins["git"].items()):
        want = ctx.lock.git[name].commit if name in ctx.lock.git else None
        if sha != want:
            drift.append(f"git {name}: rig {str(sha)[:12]}, lock {str(want)[:12]}")
    for name, rev in sorted(pins["hf"].items()):
        want = ctx.lock.hf[name].revision if name in ctx.lock.hf else None
        if rev != want:
            drift.append(f"hf {name}: rig {str(rev)[:12]}, lock {str(want)[:12]}")
    if pins["image"] and pins["image"] != ctx.lock.image.ref:
        drift.append(f"image: rig {pins['image']}, lock {ctx.lock.image.ref}")
    return {"drift": drift, "pins": pins}


def rig_drift(host, ctx: RigContext) -> list[str]:
    """The rig against what was provisioned: checkouts at the manifest's commits without local changes, weight
    files as stamped, and every file rigforge renders as the plan renders it."""
    if ctx.plan is None:
        return []
    recorded = ctx.manifest_pins()["git"]
    want = {pin.name: recorded.get(pin.name) or pin.commit for pin in ctx.plan.sources}
    weights = [line for line in drift.weights(host, ctx.plan)[0] if "stamp revision" not in line]
    return drift.sources(host, ctx.plan, want, "provisioned")[0] + weights + drift.files(host, ctx.plan)[0]


def gpus_with_targets(host, ctx: RigContext) -> list[dict]:
    from roles.facts.nvidia import NvidiaGpus

    gpus = host.get_fact(NvidiaGpus) or []
    targets = power_caps(len(gpus), ctx.settings)
    return [{**gpu, "target_w": targets.get(gpu["index"])} for gpu in gpus]


def api_models(host, ctx: RigContext, timeout: int = 5) -> dict:
    """GET /v1/models from the rig itself (curl), as the recipes' health check does."""
    url = f"http://{ctx_host(ctx)}:{ctx.port}/v1/models"
    code, body = http_on_rig(host, ctx, url, timeout=timeout)
    try:
        models = [m.get("id") for m in json.loads(body).get("data", [])]
    except (ValueError, AttributeError):
        models = None
    return {"url": url, "http_code": code, "models": models}


def http_on_rig(host, ctx: RigContext, url: str, timeout: int, body: dict | None = None) -> tuple[int, str]:
    """(HTTP code, 0 when nothing answered; response body) of a request made by curl on the rig."""
    out = sh(host, curl_command(url, ctx, timeout=timeout, body=body))
    text, _, code = out.rpartition("\n")
    return (int(code) if code.strip().isdigit() else 0), text


def ctx_host(ctx: RigContext) -> str:
    return ctx.data["serving_health_host"] or "127.0.0.1"


def curl_command(url: str, ctx: RigContext, timeout: int, body: dict | None = None):
    """curl printing the body, then the HTTP code on the last line. The API key (if any) is masked."""
    from pyinfra.api import MaskString, QuoteString, StringCommand

    parts = ["curl", "-s", "-m", str(timeout), "-w", QuoteString("\\n%{http_code}")]
    if ctx.settings is not None and ctx.settings.api_key:
        parts += ["-H", MaskString(shlex.quote(f"Authorization: Bearer {ctx.settings.api_key}"))]
    if body is not None:
        parts += ["-H", QuoteString("Content-Type: application/json"), "--data-binary", QuoteString(json.dumps(body))]
    return StringCommand(*parts, QuoteString(url))


def unit_state(host, ctx: RigContext) -> dict:
    from roles.facts.system import SystemdUnitEnabled

    unit = ctx.unit
    if not unit:
        return {"unit": None, "enabled": None, "active": None}
    enabled = host.get_fact(SystemdUnitEnabled, unit=unit)
    active = sh(host, f"systemctl is-active {shlex.quote(unit)}").strip() or "unknown"
    return {"unit": unit, "enabled": bool(enabled), "active": active}


# ---------------------------------------------------------------- status


def status_row(host) -> dict:
    ctx = rig_context(host)
    gpus = gpus_with_targets(host, ctx)
    pins = pin_drift(ctx)
    if pins["drift"] is not None:  # what the rig holds now, beside what its manifest records
        pins["drift"] += rig_drift(host, ctx)
    unit = unit_state(host, ctx)
    row = {
        "host": host.name,
        "error": None,
        "variant": ctx.variant_name,
        "variant_from": ctx.variant_from,
        "variant_in_inventory": ctx.data["rigforge_variant"],
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
            for g in gpus
        ],
        "services_managed": ctx.manage,
        "service": unit,
        "problems": ctx.problems,
    }
    if ctx.port is None:
        row["api"] = {"url": None, "reachable": False, "detail": "no port: variant unknown"}
    else:
        api = api_models(host, ctx)
        api["reachable"] = api["http_code"] == 200
        api["detail"] = "" if api["reachable"] else (f"HTTP {api['http_code']}" if api["http_code"] else "no answer")
        if not api["reachable"] and not ctx.manage:
            api["detail"] += "; services not managed on this host"
        row["api"] = api
    return row


def error_row(name: str, error: Exception) -> dict:
    return {"host": name, "error": str(error)}


def add_arguments(p: argparse.ArgumentParser, shown: str = "a table") -> None:
    p.add_argument("inventory", metavar="INVENTORY", help="pyinfra inventory file, e.g. inventories/fleet.py")
    p.add_argument("--json", action="store_true", help=f"print JSON instead of {shown}")


def read_rigs(args, command: str, fn) -> dict[str, Any] | None:
    """fn(host) on every rig of the inventory `args.inventory`, in parallel; None (said on stderr) when the
    inventory cannot be loaded."""
    try:
        state = open_inventory(args.inventory)
    except InventoryError as exc:
        print(f"rigforge {command}: {exc}", file=sys.stderr)
        return None
    return for_each_host(state, fn)


def run(args) -> int:
    results = read_rigs(args, "status", status_row)
    if results is None:
        return 2
    rows = [error_row(n, r) if isinstance(r, Exception) else r for n, r in results.items()]
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 1 if any(r["error"] for r in rows) else 0


def _cells(r: dict) -> list[str]:
    if r["error"]:
        return [r["host"], f"ERROR: {r['error']}"]
    variant = r["variant"] or "-"
    if r["variant_in_inventory"] and r["variant"] and r["variant_in_inventory"] != r["variant"]:
        variant += f" (inventory: {r['variant_in_inventory']})"
    if not r["manifest"]:
        pins = "no rig.json"
    elif r["lock_error"]:
        pins = "lock unreadable"
    else:
        pins = "ok" if not r["pin_drift"] else f"DRIFT ({len(r['pin_drift'])})"
    gpus = r["gpus"]
    names = sorted({g["name"] or "?" for g in gpus})
    gpu = f"{len(gpus)}x {'/'.join(n.replace('NVIDIA GeForce ', '') for n in names)}" if gpus else "none"
    power = " ".join(
        f"{g['index']}:{_w(g['power_limit_w'])}/{_w(g['target_w'])}{'' if g['cap_ok'] else '!'}" for g in gpus
    )
    power = (power + ("  DRIFT" if any(not g["cap_ok"] for g in gpus) else "")) or "-"
    vram = " ".join(f"{g['memory_used_mib']}/{g['memory_total_mib']}" for g in gpus) or "-"
    persist = ",".join({True: "on", False: "off"}.get(g["persistence_mode"], "?") for g in gpus) or "-"
    s = r["service"]
    service = "-" if not s["unit"] else f"{'enabled' if s['enabled'] else 'disabled'}/{s['active']}"
    if not r["services_managed"]:
        service += " (not managed)"
    api = r["api"]
    api_cell = "yes" if api["reachable"] else f"no ({api['detail']})"
    return [r["host"], variant, pins, gpu, power, vram, persist, service, api_cell]


def _w(v) -> str:
    return "?" if v is None else f"{v:g}"


HEADER = ["HOST", "VARIANT", "PINS", "GPUS", "POWER W cap/target", "VRAM MiB used/total", "PERSIST", "SERVICE", "API"]


def format_table(rows: list[dict]) -> str:
    table = [HEADER] + [_cells(r) for r in rows]
    full = [c for c in table if len(c) == len(HEADER)]
    widths = [max(len(c[i]) for c in full) for i in range(len(HEADER))]
    lines = []
    for cells in table:
        if len(cells) == len(HEADER):
            lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        else:
            lines.append(f"{cells[0].ljust(widths[0])}  {cells[1]}")
    for r in rows:
        for d in r.get("pin_drift") or []:
            lines.append(f"{r['host']}: pin drift: {d}")
        for p in r.get("problems") or []:
            lines.append(f"{r['host']}: {p}")
    return "\n".join(lines)
