"""Whether rigforge's caps are the last written at this boot (power and settle units: docs/operators.md "power
caps"), for status and verify. A unit of rigforge's that did not run at this boot fails on its own (an ordering cycle
can be lost from the journal). Pure: no host, no pyinfra.
"""

import contextlib
import re
from collections.abc import Mapping

from rigforge.layout import POWER_UNIT, SETTLE_UNIT
from rigforge.schema import power_caps

SHOW = (  # what `systemctl show` is asked for each unit
    "LoadState ActiveState SubState Result ExecMainStatus InactiveExitTimestampMonotonic "
    "ExecMainStartTimestampMonotonic ExecMainExitTimestampMonotonic"
).split()
CORRECTION = re.compile(r"^rigforge: GPU(\d+) power limit (\S+) W after boot \(another writer\); set back to (\d+) W")
FAILED = re.compile(r"^rigforge: GPU(\d+) power limit .* failed")


def parse_boot(lines: list[str]) -> dict:
    """Output of BootCaps -> {"boot_id", "system", "units": {unit: {SHOW key: value}}, "cycles", "settle", "cron":
    their lines, "caps": {GPU index: watts now}}; empty where the rig gave nothing (a chroot: no systemd)."""
    out: dict = {"units": {}, "cycles": [], "settle": [], "cron": [], "caps": {}}
    head: dict = {}  # the key=value lines before the first section (boot_id, system)
    section, keys = None, head  # where key=value lines go: the head, then each unit's dict; None in other sections
    for line in (raw.rstrip("\n") for raw in lines):
        if line.startswith("--- "):
            section, _, arg = line[4:].partition(" ")
            keys = out["units"].setdefault(arg.strip(), {}) if section == "unit" else None
        elif keys is not None and "=" in line:
            key, _, value = line.partition("=")
            keys[key] = value.strip()
        elif section in ("cycles", "settle", "cron") and line.strip():
            out[section].append(line.strip())
        elif section == "caps":
            cells = [c.strip() for c in line.split(",")]
            if len(cells) == 2 and cells[0].isdigit():
                with contextlib.suppress(ValueError):
                    out["caps"][int(cells[0])] = float(cells[1])
    return {"boot_id": head.get("boot_id") or None, "system": head.get("system", ""), **out}


def _stamp(unit: Mapping, key: str) -> int:
    with contextlib.suppress(ValueError):
        return int(unit.get(key) or 0)
    return 0


def started(unit: Mapping | None) -> int:
    """When a unit started at this boot (monotonic µs), 0 when it did not (or is not installed)."""
    if not unit or unit.get("LoadState") != "loaded":
        return 0
    return max(_stamp(unit, "InactiveExitTimestampMonotonic"), _stamp(unit, "ExecMainStartTimestampMonotonic"))


def watts(v) -> str:
    return "?" if v is None else f"{v:g}"


def _unit_problem(name: str, unit: Mapping | None) -> str | None:
    """Why a unit of rigforge's did not do its job at this boot, None when it did (or still does)."""
    if not unit or unit.get("LoadState") in (None, "", "not-found"):
        return f"{name} is not installed (run the deploy)"
    if not started(unit):
        state = f"ActiveState={unit.get('ActiveState', '?')}, Result={unit.get('Result', '?')}"
        return f"{name} did not run at this boot ({state}; an ordering cycle or a failed dependency? journalctl -b)"
    if unit.get("Result", "success") != "success" or unit.get("ActiveState") == "failed":
        status = unit.get("ExecMainStatus", "?")
        return f"{name} failed at this boot (Result={unit.get('Result')}, status {status}; journalctl -b -u {name})"
    return None


def judge(seen: Mapping, ctx) -> tuple[dict[int, int], list[str], str]:
    """What ran at this boot against the caps of rig context `ctx`: (those caps, problems, "set last" sentence)."""
    targets = dict(ctx.plan.caps) if ctx.plan else power_caps(len(seen.get("caps") or {}), ctx.settings)
    units = seen.get("units") or {}
    power, settle = units.get(POWER_UNIT), units.get(SETTLE_UNIT)
    problems = []
    if cycles := seen.get("cycles") or []:
        more = f" (+{len(cycles) - 1} more)" if len(cycles) > 1 else ""
        problems.append(f"journalctl -b logs an ordering cycle: {cycles[0]!r}{more}")
    problems += [p for p in (_unit_problem(POWER_UNIT, power), _unit_problem(SETTLE_UNIT, settle)) if p]
    lines = seen.get("settle") or []
    problems += [f"{SETTLE_UNIT}: {line.removeprefix('rigforge: ')}" for line in lines if FAILED.match(line)]
    settling = bool(settle) and settle.get("SubState") == "running"
    settle_end = _stamp(settle or {}, "ExecMainExitTimestampMonotonic") if not settling else 0
    ran, later = [], []
    for name, writer in ctx.cap_units.items():
        if writer.get("kind") == "cron":
            needle = writer.get("script") or writer.get("command")
            start = bool(needle) and any(needle in line for line in seen.get("cron") or [])
        elif (start := started(units.get(name))) and settle_end and start > settle_end:
            later.append(name)
        if start:
            set_w = "/".join(str(w) for w in writer.get("watts") or [])
            ran.append(f"{name} set {set_w} W" if set_w else f"{name} ran")
    caps = seen.get("caps") or {}
    off = {i: (caps.get(i), want) for i, want in sorted(targets.items()) if caps.get(i) != want}
    if not caps:
        problems.append("nvidia-smi reads no GPU's power limit")
    elif off:
        what = ", ".join(f"GPU{i} at {watts(have)} W, target {want} W" for i, (have, want) in off.items())
        if settling:
            what += " (the settle stage is still watching)"
        elif settle_end:
            by = ", ".join(later) if later else "a writer rigforge does not know (not a unit or @reboot job it found)"
            what += f": changed after the settle stage's window by {by}"
        problems.append(what)
    after = ", ".join(ran) if ran else "no other writer ran"
    n = sum(1 for line in lines if CORRECTION.match(line))
    watching = "; the settle stage is still watching" if settling else ""
    last = f"set last at this boot (after {after}; {n} correction{'' if n == 1 else 's'} by the settle stage{watching})"
    return targets, problems, last


def boot_caps(seen: Mapping, ctx) -> tuple[str, str]:
    """The check "caps set last at this boot": ("pass" | "fail", detail) for rig context `ctx` (RigContext)."""
    targets, problems, last = judge(seen, ctx)
    if problems:
        return "fail", "; ".join(problems)
    caps = "/".join(f"{w:g}" for w in sorted(set(targets.values()))) or "?"
    return "pass", f"{caps} W, {last}"


def summary(seen: Mapping, ctx) -> str:
    """status's sentence after "power caps: 230 W"; with services not managed (no systemd), the writers found."""
    if not ctx.manage:
        named = ", ".join(f"{name} ({'/'.join(map(str, w.get('watts') or [])) or '?'} W)"
                          for name, w in ctx.cap_units.items())  # fmt: skip
        return f"other cap writers at boot: {named}; what ran not read (services not managed)" if named else ""
    _, problems, last = judge(seen, ctx)
    return f"NOT set last at this boot: {'; '.join(problems)}" if problems else last
