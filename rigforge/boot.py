"""Boot order: rigforge's caps are the last ones written at boot, and status and verify say what ran.

At boot, rigforge-gpu-power.service sets the caps early (before Docker and the vLLM unit), ordered after no other
cap writer, so it can never close an ordering cycle whatever the rig's other units do. rigforge-gpu-settle.service
(Type=exec: its start job does not hold up the boot) waits for the boot to finish (`systemctl is-system-running
--wait`), sets back every cap another writer changed, then watches for `gpu_power_settle_window_s` seconds doing the
same, one journal line per correction. The other writers still run: nothing is disabled.

What ran at this boot is read in one fact (rigforge/facts/nvidia.py BootCaps, parsed here by `parse_boot`): systemd's
results for both units and for the other writers' units, `journalctl -b`'s "ordering cycle" lines, the settle
stage's lines, cron's CMD lines and the caps now. `boot_caps` is the verdict (verify's and status's check "caps set
last at this boot"), `summary` status's sentence. systemd logs an ordering cycle while it builds the boot
transaction, before journald runs: on a rig, journald picks it up from the kernel log; in a container (the booted
testbed) it is lost, so a unit of rigforge's that did not run at this boot is a failure on its own.
Pure: no host, no pyinfra.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping

from rigforge.layout import POWER_UNIT, SETTLE_UNIT
from rigforge.schema import power_caps

SHOW = (  # what `systemctl show` is asked for each unit
    "LoadState",
    "ActiveState",
    "SubState",
    "Result",
    "ExecMainStatus",
    "InactiveExitTimestampMonotonic",
    "ExecMainStartTimestampMonotonic",
    "ExecMainExitTimestampMonotonic",
)
CORRECTION = re.compile(r"^rigforge: GPU(\d+) power limit (\S+) W after boot \(another writer\); set back to (\d+) W")
FAILED = re.compile(r"^rigforge: GPU(\d+) power limit .* failed")


def parse_boot(lines: list[str]) -> dict:
    """Output of BootCaps -> {"boot_id", "system": `is-system-running`, "units": {unit: {SHOW key: value}},
    "cycles": journal lines about ordering cycles, "settle": the settle stage's "rigforge: " lines, "cron": cron's
    CMD lines, "caps": {GPU index: watts now}}; empty where the rig gave nothing (a chroot: no systemd)."""
    out: dict = {"units": {}, "cycles": [], "settle": [], "cron": [], "caps": {}}
    head: dict = {}  # the key=value lines before the first section (boot_id, system)
    section, keys = None, head  # where key=value lines go: the head, then each unit's dict; None in other sections
    for raw in lines:
        line = raw.rstrip("\n")
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


def _w(watts) -> str:
    return "?" if watts is None else f"{watts:g}"


def _sets(writer: Mapping) -> str:
    watts = writer.get("watts") or []
    return f"set {'/'.join(str(w) for w in watts)} W" if watts else "ran"


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


def _cron_ran(writer: Mapping, cron: list[str]) -> bool:
    needle = writer.get("script") or writer.get("command") or ""
    return bool(needle) and any(needle in line for line in cron)


def judge(seen: Mapping, targets: Mapping[int, int], writers: Mapping[str, Mapping]) -> dict:
    """What ran at this boot against the caps: {"ok", "settling", "problems", "ran": the other writers that ran,
    "corrections": the settle stage's}."""
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
    for name, writer in writers.items():
        if writer.get("kind") == "cron":
            if _cron_ran(writer, seen.get("cron") or []):
                ran.append(f"{name} {_sets(writer)}")
            continue
        start = started(units.get(name))
        if start:
            ran.append(f"{name} {_sets(writer)}")
            if settle_end and start > settle_end:
                later.append(name)
    caps = seen.get("caps") or {}
    off = {i: (caps.get(i), want) for i, want in sorted(targets.items()) if caps.get(i) != want}
    if not caps:
        problems.append("nvidia-smi reads no GPU's power limit")
    elif off:
        what = ", ".join(f"GPU{i} at {_w(have)} W, target {want} W" for i, (have, want) in off.items())
        if settling:
            problems.append(f"{what} (the settle stage is still watching)")
        elif settle_end:
            by = ", ".join(later) if later else "a writer rigforge does not know (not a unit or @reboot job it found)"
            problems.append(f"{what}: changed after the settle stage's window by {by}")
        else:
            problems.append(what)
    corrections = [line for line in lines if CORRECTION.match(line)]
    return {"ok": not problems, "settling": settling, "problems": problems, "ran": ran, "corrections": corrections}


def _targets(seen: Mapping, ctx) -> dict[int, int]:
    return dict(ctx.plan.caps) if ctx.plan else power_caps(len(seen.get("caps") or {}), ctx.settings)


def _set_last(j: dict) -> str:
    after = ", ".join(j["ran"]) if j["ran"] else "no other writer ran"
    n = len(j["corrections"])
    watching = "; the settle stage is still watching" if j["settling"] else ""
    return f"set last at this boot (after {after}; {n} correction{'' if n == 1 else 's'} by the settle stage{watching})"


def boot_caps(seen: Mapping, ctx) -> tuple[str, str]:
    """The check "caps set last at this boot": ("pass" | "fail", detail), from what ran at this boot (`seen`:
    BootCaps) for rig context `ctx` (rigforge/drift.py RigContext: its plan's caps and the writers found)."""
    targets = _targets(seen, ctx)
    j = judge(seen, targets, ctx.cap_units)
    if not j["ok"]:
        return "fail", "; ".join(j["problems"])
    caps = "/".join(f"{w:g}" for w in sorted(set(targets.values()))) or "?"
    return "pass", f"{caps} W, {_set_last(j)}"


def summary(seen: Mapping, ctx) -> str:
    """status's sentence after "power caps: 230 W": "set last at this boot (after nvidia-power-cap.service set
    250 W; 1 correction by the settle stage)", or what went wrong, naming a writer seen after the settle window;
    on a host whose services rigforge does not manage (no systemd), the writers found."""
    writers = ctx.cap_units
    if not ctx.manage:
        named = ", ".join(f"{name} ({'/'.join(map(str, w.get('watts') or [])) or '?'} W)"
                          for name, w in writers.items())  # fmt: skip
        return f"other cap writers at boot: {named}; what ran not read (services not managed)" if named else ""
    j = judge(seen, _targets(seen, ctx), writers)
    return _set_last(j) if j["ok"] else f"NOT set last at this boot: {'; '.join(j['problems'])}"
