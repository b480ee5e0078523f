"""Whether rigforge's caps are the last written at this boot and held since, for status and verify (docs/operators.md
"power caps"). At boot rigforge-gpu-power.service sets the caps early, ordered after no other cap writer (so never in
an ordering cycle); rigforge-gpu-settle.service, once the boot has finished, sets back every cap another writer
changed and watches for `gpu_power_settle_window_s` seconds; with host data gpu_power_hold (the default) the cap
hold's timer sets back a changed cap every HOLD_INTERVAL_S seconds from boot on. A unit of rigforge's that did not
run at this boot fails on its own (an ordering cycle can be lost from the journal). Pure: no host, no pyinfra.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypedDict

from rigforge.layout import HOLD_INTERVAL_S, HOLD_TIMER, POWER_UNIT, SETTLE_UNIT
from rigforge.model.knobs.gpu_power import GpuPower
from rigforge.model.schema import Settings, power_caps

if TYPE_CHECKING:
    from rigforge.model.fleet import Plan

SHOW = (  # what `systemctl show` is asked for each unit
    "LoadState ActiveState SubState Result ExecMainStatus InactiveExitTimestampMonotonic "
    "ExecMainStartTimestampMonotonic ExecMainExitTimestampMonotonic"
).split()
# the cap hold's lines (templates/rigforge-gpu-hold.j2), logged by the settle stage and by the hold's own unit
CORRECTION = re.compile(r"^rigforge: GPU(\d+) power limit (\S+) W \((changed .*)\); set back to (\d+) W$")
FAILED = re.compile(r"^rigforge: GPU(\d+) power limit .*; setting \d+ W failed$")
UNFOUND = "a writer rigforge did not find"


class CapsContext(Protocol):
    """What the caps verdict reads of a rig's context: rigforge/observe/hosts.py's RigContext (not imported: observe.py
    reads the rig through facts/nvidia.py, which imports this module)."""

    @property
    def plan(self) -> Plan | None: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def cap_units(self) -> dict: ...

    @property
    def manage(self) -> bool: ...


class BootSeen(TypedDict):
    """What BootCaps read of this boot (`parse_boot`)."""

    boot_id: str | None  # /proc/sys/kernel/random/boot_id
    system: str  # `systemctl is-system-running`
    units: dict[str, dict[str, str]]  # {unit: {SHOW key: value}}
    cycles: list[str]  # the journal's ordering cycle lines
    settle: list[str]  # the settle stage's "rigforge: " lines
    hold: list[str]  # the cap hold's "rigforge: " lines
    cron: list[str]  # cron's CMD lines
    caps: dict[int, float]  # {GPU index: watts now}


def parse_boot(lines: list[str]) -> BootSeen:
    """Output of BootCaps -> {"boot_id", "system", "units": {unit: {SHOW key: value}}, "cycles", "settle", "hold",
    "cron": their lines, "caps": {GPU index: watts now}}; empty where the rig gave nothing (a chroot: no systemd)."""
    out: dict = {"units": {}, "cycles": [], "settle": [], "hold": [], "cron": [], "caps": {}}
    head: dict = {}  # the key=value lines before the first section (boot_id, system)
    section, keys = None, head  # where key=value lines go: the head, then each unit's dict; None in other sections
    for line in (raw.rstrip("\n") for raw in lines):
        if line.startswith("--- "):
            section, _, arg = line[4:].partition(" ")
            keys = out["units"].setdefault(arg.strip(), {}) if section == "unit" else None
        elif keys is not None and "=" in line:
            key, _, value = line.partition("=")
            keys[key] = value.strip()
        elif section in ("cycles", "settle", "hold", "cron") and line.strip():
            out[section].append(line.strip())
        elif section == "caps":
            cells = [c.strip() for c in line.split(",")]
            if len(cells) == 2 and cells[0].isdigit():
                with contextlib.suppress(ValueError):
                    out["caps"][int(cells[0])] = float(cells[1])
    return {"boot_id": head.get("boot_id") or None, "system": head.get("system", ""), **out}


def _stamp(unit: Mapping, key: str) -> int:
    """A unit's timestamp `key` as an int, 0 when missing or not a number."""
    with contextlib.suppress(ValueError):
        return int(unit.get(key) or 0)
    return 0


def started(unit: Mapping | None) -> int:
    """When a unit started at this boot (monotonic µs), 0 when it did not (or is not installed)."""
    if not unit or unit.get("LoadState") != "loaded":
        return 0
    return max(_stamp(unit, "InactiveExitTimestampMonotonic"), _stamp(unit, "ExecMainStartTimestampMonotonic"))


def watts(v: float | None) -> str:
    """Watts as status writes them (230, 232.5), \"?\" when not read."""
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


def held(ctx: CapsContext) -> bool:
    """Whether host data gpu_power_hold keeps the cap hold's timer on (its default: true)."""
    knobs = ctx.plan.knobs.gpu_power if ctx.plan else GpuPower.of(getattr(ctx, "data", {}))  # without one: host data
    return knobs.gpu_power_hold is not False


def _hold_problem(timer: Mapping | None) -> str | None:
    """Why the cap hold's timer is not holding the caps; None when it is, or when the rig did not say."""
    if not timer:
        return None  # read by an older BootCaps (or a capture): nothing to judge
    if timer.get("LoadState") in (None, "", "not-found"):
        return f"{HOLD_TIMER} is not installed (run the deploy)"
    if timer.get("ActiveState") != "active":
        return f"{HOLD_TIMER} is {timer.get('ActiveState', '?')}: caps are not held (re-run the deploy)"
    return None


def label(name: str, writer: Mapping) -> str:
    """A cap writer named by what it is: a unit with the timer that starts it, a cron job, rc.local, a udev rule."""
    return f"{name} (started by {writer['timer']})" if writer.get("timer") else name


def set_backs(lines: list[str]) -> list[str]:
    """The set-back lines of the settle stage or the hold, each "GPU0 250 W, changed ... by WRITER"."""
    return [f"GPU{m[1]} {m[2]} W, {m[3]}" for line in lines if (m := CORRECTION.match(line))]


@dataclass(frozen=True)
class CapsVerdict:
    """What `judge` found at this boot against a rig's caps."""

    targets: dict[int, int]  # {GPU index: the cap in W}: the plan's, else the settings' for the GPUs read
    problems: tuple[str, ...]  # why the caps are not set last (empty when they are)
    settling: bool  # the settle stage is still watching
    ran: tuple[str, ...]  # the other cap writers that ran at this boot, each "NAME set 230 W" or "NAME ran"
    corrections: tuple[str, ...]  # the settle stage's set-backs, each "GPU0 250 W, changed ... by WRITER"
    hold_set_backs: tuple[str, ...]  # the cap hold's set-backs, in the same form
    holding: bool  # gpu_power_hold is on and the hold's timer is installed and active

    @property
    def ok(self) -> bool:
        """Whether the caps are set last at this boot and held since."""
        return not self.problems


def _targets(seen: Mapping, ctx: CapsContext) -> dict[int, int]:
    """The caps rig context `ctx` wants, {GPU index: W}: its plan's, else its settings' for the GPUs the rig read."""
    if ctx.plan:
        return dict(ctx.plan.caps)
    return power_caps(len(seen.get("caps") or {}), ctx.settings)


def _sets(writer: Mapping) -> str:
    """What a cap writer did when it ran: "set 230/250 W" with the watts it writes, else "ran"."""
    set_w = "/".join(str(w) for w in writer.get("watts") or [])
    return f"set {set_w} W" if set_w else "ran"


def judge(seen: Mapping, ctx: CapsContext) -> CapsVerdict:
    """What ran at this boot against the caps of rig context `ctx` (RigContext)."""
    targets = _targets(seen, ctx)
    units = seen.get("units") or {}
    power, settle = units.get(POWER_UNIT), units.get(SETTLE_UNIT)
    problems = []
    cycles = seen.get("cycles") or []
    if cycles:
        more = f" (+{len(cycles) - 1} more)" if len(cycles) > 1 else ""
        problems.append(f"journalctl -b logs an ordering cycle: {cycles[0]!r}{more}")
    problems += [p for p in (_unit_problem(POWER_UNIT, power), _unit_problem(SETTLE_UNIT, settle)) if p]
    hold = held(ctx)
    timer = units.get(HOLD_TIMER)
    hold_problem = _hold_problem(timer)
    if hold and hold_problem:
        problems.append(hold_problem)
    lines, hold_lines = seen.get("settle") or [], seen.get("hold") or []
    problems += [f"{SETTLE_UNIT}: {line.removeprefix('rigforge: ')}" for line in lines if FAILED.match(line)]
    problems += [f"{HOLD_TIMER}: {line.removeprefix('rigforge: ')}" for line in hold_lines if FAILED.match(line)]
    settling = bool(settle) and settle.get("SubState") == "running"
    settle_end = _stamp(settle or {}, "ExecMainExitTimestampMonotonic") if not settling else 0
    ran, later = [], []  # the writers that ran at this boot; those of them that started after the settle stage
    for name, writer in ctx.cap_units.items():
        if writer.get("kind") == "cron":
            needle = writer.get("script") or writer.get("command")
            if needle and any(needle in line for line in seen.get("cron") or []):
                ran.append(f"{label(name, writer)} {_sets(writer)}")
            continue
        start = started(units.get(name))
        if start:
            ran.append(f"{label(name, writer)} {_sets(writer)}")
            if settle_end and start > settle_end:
                later.append(label(name, writer))
    caps = seen.get("caps") or {}
    off = {i: (caps.get(i), want) for i, want in sorted(targets.items()) if caps.get(i) != want}
    if not caps:
        problems.append("nvidia-smi reads no GPU's power limit")
    elif off:
        what = ", ".join(f"GPU{i} at {watts(have)} W, target {want} W" for i, (have, want) in off.items())
        if settling:
            what += " (the settle stage is still watching)"
        elif settle_end:
            by = ", ".join(later) if later else UNFOUND
            what += f": changed after the settle stage's window by {by}"
            what += (
                f" (the hold sets it back within {HOLD_INTERVAL_S} s and names the writer in the journal)"
                if hold
                else " (gpu_power_hold is false: nothing sets it back until the next deploy or boot)"
            )
        problems.append(what)
    return CapsVerdict(
        targets=targets,
        problems=tuple(problems),
        settling=settling,
        ran=tuple(ran),
        corrections=tuple(set_backs(lines)),
        hold_set_backs=tuple(set_backs(hold_lines)),
        holding=hold and bool(timer) and hold_problem is None,
    )


def _set_last(j: CapsVerdict) -> str:
    """The sentence saying the caps were set last at this boot: after which writers, how many set-backs by the settle
    stage (the last one named), and whether the hold has held them since."""
    after = ", ".join(j.ran) if j.ran else "no other writer ran"
    n = len(j.corrections)
    watching = "; the settle stage is still watching" if j.settling else ""
    which = f", the last {j.corrections[-1]}" if j.corrections else ""
    corrections = f"{n} correction{'' if n == 1 else 's'} by the settle stage{which}{watching}"
    last = f"set last at this boot (after {after}; {corrections})"
    if j.hold_set_backs:
        m = len(j.hold_set_backs)
        last += f"; held since: {m} set-back{'' if m == 1 else 's'} by the hold, the last {j.hold_set_backs[-1]}"
    elif j.holding:
        last += f"; held since by {HOLD_TIMER} (every {HOLD_INTERVAL_S} s), nothing set back"
    return last


def boot_caps(seen: Mapping, ctx: CapsContext) -> tuple[str, str]:
    """The check "caps set last at this boot": ("pass" | "fail", detail) for rig context `ctx` (RigContext)."""
    j = judge(seen, ctx)
    if not j.ok:
        return "fail", "; ".join(j.problems)
    caps = "/".join(f"{w:g}" for w in sorted(set(j.targets.values()))) or "?"
    return "pass", f"{caps} W, {_set_last(j)}"


def summary(seen: Mapping, ctx: CapsContext) -> str:
    """status's sentence after "power caps: 230 W"; with services not managed (no systemd), the writers found."""
    if not ctx.manage:
        named = ", ".join(
            f"{label(name, w)} ({'/'.join(map(str, w.get('watts') or [])) or '?'} W)"
            for name, w in ctx.cap_units.items()
        )
        return f"other cap writers: {named}; what ran not read (services not managed)" if named else ""
    j = judge(seen, ctx)
    return _set_last(j) if j.ok else f"NOT set last at this boot: {'; '.join(j.problems)}"
