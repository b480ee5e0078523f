"""Boot-order cycles through rigforge's units, for status and verify (not the deploy's probe).

systemd breaks an ordering cycle at boot by dropping one start job of the cycle, and which one changes from boot to
boot: a unit of rigforge's, or Docker, does not start. The message can be lost from the journal (logged before
journald runs), so the cycle is also looked for with `systemd-analyze verify default.target` plus rigforge's units,
which loads the rig's unit files and builds the boot's transaction without starting anything (in a chroot too).

systemd's lines, read by `parse_cycles` (systemd 257, captured: tests/fixtures/cycles/):
    docker.service: Found ordering cycle on rigforge-gpu-power.service/start
    docker.service: Found dependency on user-thing.service/start
    docker.service: Found dependency on docker.service/start
    docker.service: Job rigforge-gpu-power.service/start deleted to break ordering cycle starting with docker.s...
Each job listed runs after the next one, and the last after the first. systemd 258 logs the cycle on one line,
"Found ordering cycle: A/start after B/start after C/start - after A", and before 232 "Breaking ordering cycle by
deleting job X/start"; "Unable to break cycle starting with X/start" when no job could be dropped.
"""

import re
from dataclasses import dataclass
from typing import TypedDict

from pyinfra.api import QuoteString, StringCommand

from rigforge.layout import (
    GPU_METRICS_TIMER,
    GPU_METRICS_UNIT,
    POWER_UNIT,
    SETTLE_UNIT,
    UNIT_DIR,
    VLLM_PREFIX,
    VLLM_TEMPLATE,
)
from rigforge.observe.facts import Fact, sections

JOURNAL = "journalctl -b"  # where a cycle was found: this boot's journal (what systemd did)
VERIFY = "systemd-analyze verify"  # or the unit files, as the next boot will read them
LINES = "ordering cycle|Found dependency on|Unable to break cycle"  # systemd's lines about a cycle (grep -E)
FOUND = re.compile(r"Found ordering cycle on (\S+)")
FOUND_258 = re.compile(r"Found ordering cycle: (.+)")
DEPENDENCY = re.compile(r"Found dependency on (\S+)")
DELETED = re.compile(r"Job (\S+) deleted to break ordering cycle")
BREAKING = re.compile(r"Breaking ordering cycle by deleting job (\S+)")
UNABLE = re.compile(r"Unable to break cycle starting with (\S+)")


@dataclass(frozen=True)
class Cycle:
    jobs: tuple[str, ...]  # "unit/start" jobs in start order: each runs before the next, the last before the first
    dropped: str | None = None  # the job systemd deleted to break it
    unbroken: bool = False  # systemd could not break it (the whole transaction failed)

    @property
    def units(self) -> list[str]:
        return [job.partition("/")[0] for job in self.jobs]

    def key(self) -> tuple[str, ...]:
        """The same cycle whichever job systemd started from: its jobs rotated to begin with the smallest."""
        at = self.jobs.index(min(self.jobs))
        return self.jobs[at:] + self.jobs[:at]


def is_rigforge_unit(unit: str) -> bool:
    """A unit rigforge installs: a vLLM instance, the power, settle or GPU metrics unit, the metrics timer."""
    return unit.startswith(VLLM_PREFIX) or unit in (POWER_UNIT, SETTLE_UNIT, GPU_METRICS_UNIT, GPU_METRICS_TIMER)


def _cycle(logged: list[str], dropped: str | None = None, unbroken: bool = False) -> Cycle:
    """A cycle from its jobs as systemd logs them (each runs after the next): start order is the reverse."""
    return Cycle(tuple(reversed(logged)), dropped, unbroken)


def parse_cycles(lines: list[str]) -> list[Cycle]:
    """systemd's lines about ordering cycles (any prefix: "unit: ", "systemd[1]: ", a timestamp) -> the cycles."""
    out: list[Cycle] = []
    logged: list[str] = []
    dropped = None
    for line in lines:
        if found := FOUND.search(line) or FOUND_258.search(line):
            if logged:
                out.append(_cycle(logged, dropped))
            dropped = None
            if found.re is FOUND:
                logged = [found.group(1)]
            else:  # 258: "A/start after B/start after C/start - after A"
                logged = found.group(1).split(" - after ")[0].split(" after ")
        elif (dependency := DEPENDENCY.search(line)) and logged:
            logged.append(dependency.group(1))
        elif breaking := BREAKING.search(line):
            dropped = breaking.group(1)
        elif (deleted := DELETED.search(line)) and logged:
            out.append(_cycle(logged, deleted.group(1)))
            logged = []
        elif UNABLE.search(line) and logged:
            out.append(_cycle(logged, unbroken=True))
            logged = []
    if logged:
        out.append(_cycle(logged, dropped))
    return out


def rigforge_cycles(cycles: list[Cycle]) -> list[Cycle]:
    """The cycles holding a unit of rigforge's, once each (the same cycle found twice: the one naming a drop)."""
    kept: dict[tuple[str, ...], Cycle] = {}
    for cycle in cycles:
        if not any(is_rigforge_unit(unit) for unit in cycle.units):
            continue
        key = cycle.key()
        if key not in kept or (cycle.dropped and not kept[key].dropped):
            kept[key] = cycle
    return list(kept.values())


def ordering_lines(lines: list[str]) -> list[tuple[str, str, list[str]]]:
    """`grep -r` lines "PATH:After=a.service b.target" -> [(path, "After" | "Before", the units named)]."""
    out = []
    for line in lines:
        path, _, setting = line.partition(":")
        key, _, value = setting.strip().partition("=")
        if key in ("After", "Before") and path:
            out.append((path, key, value.split()))
    return out


class CyclesFound(TypedDict):
    """OrderingCycles' answer (`parse`)."""

    analyzed: bool  # systemd-analyze ran
    verify: list[Cycle]  # its cycles through a unit of rigforge's
    journal: list[Cycle] | None  # this boot's journal's (None: no journal for this boot, a chroot)
    order: list[tuple[str, str, list[str]]]  # /etc/systemd/system's After=/Before= lines (`ordering_lines`)


def parse(lines: list[str]) -> CyclesFound:
    """OrderingCycles' output -> {"analyzed": systemd-analyze ran, "verify": its cycles, "journal": None (no journal
    for this boot: a chroot) or its cycles, "order": /etc/systemd/system's After=/Before= lines (`ordering_lines`)};
    cycles: those holding a unit of rigforge's only."""
    found = sections(lines, "--- ")
    journal = found.get("journal")
    return {
        "analyzed": "verify" in found,
        "verify": rigforge_cycles(parse_cycles(found.get("verify", []))),
        "journal": None if journal is None else rigforge_cycles(parse_cycles(journal)),
        "order": ordering_lines(found.get("order", [])),
    }


class OrderingCycles(Fact[CyclesFound]):
    """Ordering cycles holding a unit of rigforge's (`parse`): `systemd-analyze verify` of the boot (default.target)
    and of `units`, and this boot's journal where systemd runs; also the After=/Before= lines in /etc/systemd/system
    (the admin's units and drop-ins: where a cycle is closed)."""

    def command(self, units: str = "") -> StringCommand:
        grep = f"grep -E '{LINES}' | head -n 200"
        return StringCommand(
            "if command -v systemd-analyze >/dev/null 2>&1; then echo '--- verify'; "
            "man=$(systemd-analyze --help 2>/dev/null | grep -q -e '--man' && echo --man=no); "
            "timeout 60 systemd-analyze verify $man default.target",
            *(QuoteString(unit) for unit in units.split()),
            f"2>&1 | {grep}; fi; if journalctl -b -q -n 0 >/dev/null 2>&1; then echo '--- journal'; "
            "{ journalctl -b _PID=1 --no-pager -q -o cat; journalctl -b -k --no-pager -q -o cat; } 2>/dev/null | "
            f"{grep}; fi; echo '--- order'; grep -rHE '^[[:space:]]*(After|Before)=' {UNIT_DIR} 2>/dev/null | "
            "head -n 1000; true",
        )

    process = staticmethod(parse)


def arguments(unit: str | None) -> dict[str, str]:
    """OrderingCycles' arguments for a rig whose vLLM unit is `unit` (None: not known): rigforge's boot units."""
    return {"units": " ".join(u for u in (POWER_UNIT, SETTLE_UNIT, unit) if u)}


def _unit_of(path: str) -> str:
    """The unit a file in /etc/systemd/system configures: its name, or its drop-in dir's ("x.service.d/y.conf")."""
    parent, _, name = path.rpartition("/")
    return parent.rpartition("/")[2].removesuffix(".d") if parent.endswith(".d") else name


def _rigforge_file(path: str) -> bool:
    """A unit file rigforge renders (rigforge-gpu-power.service, rigforge-vllm@.service...), not a drop-in on one."""
    parent, _, name = path.rpartition("/")
    return parent == UNIT_DIR and (name == VLLM_TEMPLATE or is_rigforge_unit(name))


def _configures(path: str, unit: str) -> bool:
    """`path` configures `unit`: its file or drop-in, or its template's ("foo@.service" for "foo@x.service")."""
    prefix, at, rest = unit.partition("@")
    template = f"{prefix}@.{rest.rpartition('.')[2]}" if at else unit
    return _unit_of(path) in (unit, template)


def closing(ring: list[str], order: list[tuple[str, str, list[str]]]) -> dict[str, list[str]]:
    """{path: ["After=b", ...]}: the admin's After=/Before= lines that make one unit of `ring` (start order) start
    before the next; rigforge's own unit files aside (their order is rigforge's: "files as rendered" checks them)."""
    out: dict[str, list[str]] = {}
    for first, then in zip(ring, ring[1:] + ring[:1], strict=True):
        for path, key, units in order:
            if _rigforge_file(path):
                continue
            if (key == "Before" and then in units and _configures(path, first)) or (
                key == "After" and first in units and _configures(path, then)
            ):
                out.setdefault(path, []).append(f"{key}={then if key == 'Before' else first}")
    return out


def describe(cycle: Cycle, order: list[tuple[str, str, list[str]]], where: str) -> str:
    """One cycle: its units from a unit of rigforge's in start order, what systemd drops, where to break it."""
    units = cycle.units
    at = units.index(min(u for u in units if is_rigforge_unit(u)))
    ring = units[at:] + units[:at]
    text = f"ordering cycle: {' -> '.join([*ring, ring[0]])} (each ordered before the next; {where})"
    if where == JOURNAL and cycle.dropped:
        text += f", systemd broke it at this boot by dropping {cycle.dropped}"
    elif where == JOURNAL and cycle.unbroken:
        text += ", systemd could not break it at this boot: a start of one of them failed"
    else:
        text += ", at boot systemd breaks it by dropping one of these start jobs (which one can change each boot)"
    if lines := closing(ring, order):
        said = ", ".join(f"{path} ({', '.join(settings)})" for path, settings in lines.items())
        return text + f"; remove the After=/Before= that closes it: {said}"
    others = " or ".join(u for u in ring if not is_rigforge_unit(u))
    return text + f"; remove the After=/Before= that closes it in {others} (systemctl cat UNIT)"


def judge(found: CyclesFound | None) -> tuple[str, str]:
    """The check "boot order has no cycle": ("pass" | "fail" | "skip", detail) from OrderingCycles' answer (None or
    {}: not read, as a rig without systemd-analyze)."""
    found = {**parse([]), **(found or {})}
    journal = found["journal"]
    said = {c.key(): describe(c, found["order"], JOURNAL) for c in journal or []}
    for cycle in found["verify"]:
        said.setdefault(cycle.key(), describe(cycle, found["order"], VERIFY))
    if said:
        return "fail", "; ".join(said.values())
    if not found["analyzed"]:
        return "skip", "systemd-analyze is not on the rig: the boot order was not read"
    read = "systemd-analyze verify default.target" + ("" if journal is None else " and this boot's journal")
    return "pass", f"no ordering cycle through rigforge's units ({read})"
