"""NVIDIA facts (parsers tested on real output, tests/fixtures/nvidia-smi/). Each answers "nothing there" rather
than failing without a working driver, so it reads on a fresh rig and during a mismatch.
"""

import re
from collections.abc import Iterable, Sequence

from pyinfra.api import QuoteString, StringCommand

from rigforge.layout import (
    CRON_FILES,
    HOLD_TIMER,
    HOLD_UNIT,
    POWER_UNIT,
    RC_LOCAL,
    SETTLE_UNIT,
    UDEV_RULES_DIRS,
    UNIT_SEARCH_PATH,
)
from rigforge.observe.boot import SHOW, BootSeen, parse_boot
from rigforge.observe.facts import Fact, sections

# Fields read by NvidiaGpus, in order; keys of each GPU dict are these with "." replaced by "_".
QUERY_FIELDS = tuple(
    "index,uuid,name,pci.bus_id,memory.total,memory.used,power.limit,power.default_limit,power.min_limit,"
    "power.max_limit,persistence_mode,driver_version,compute_cap".split(",")
)

# each typed field's parser (the others stay text)
_TYPED = {
    **dict.fromkeys(("index", "memory.total", "memory.used"), lambda raw: int(float(raw))),
    **dict.fromkeys(("power.limit", "power.default_limit", "power.min_limit", "power.max_limit"), float),
    "persistence_mode": lambda raw: {"enabled": True, "disabled": False}.get(raw.lower()),
}
# nvidia-smi's GPU query: NvidiaGpus, NvidiaSmiStatus and BootCaps run it verbatim (`shared`: the batched probe runs
# it once for all three, rigforge/observe/facts/probe.py `script`)
SMI_QUERY = f"timeout 60 nvidia-smi --query-gpu={','.join(QUERY_FIELDS)} --format=csv,noheader,nounits"
_NA = {"[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]", ""}
_UNIT = re.compile(r"\s*(MiB|W|MHz|%|C)$")


def _value(field: str, raw: str) -> int | float | bool | str | None:
    raw = _UNIT.sub("", raw)
    return None if raw in _NA else _TYPED.get(field, str)(raw)


def upstream_version(package_version: str | None) -> str | None:
    """'1:580.95.05-0ubuntu1' -> '580.95.05' (drop epoch and Debian revision), None stays None."""
    return package_version.split(":", 1)[-1].rsplit("-", 1)[0] if package_version else None


class NvidiaGpus(Fact[list[dict[str, int | float | bool | str | None]]]):
    """GPUs visible to nvidia-smi ([] without a working driver): one dict each (keys: QUERY_FIELDS with "." -> "_";
    ints for index/MiB, floats for watts, bool for persistence mode, None for "[N/A]"), error texts ignored."""

    shared = (SMI_QUERY,)

    # No nvidia-smi (a rig before its driver) is a normal answer, "no GPUs": not pyinfra's requires_command,
    # which warns when the command is missing. nvidia-smi exits non-zero without a loaded driver or on a
    # version mismatch; that means "no GPUs" too. `timeout`: a GPU that fell off the bus can hang nvidia-smi.
    command = f"if command -v nvidia-smi >/dev/null 2>&1; then {SMI_QUERY} 2>&1 || true; fi"

    def process(self, lines: list[str]) -> list[dict[str, int | float | bool | str | None]]:
        rows = ([cell.strip() for cell in line.split(",")] for line in lines)
        return [
            {field.replace(".", "_"): _value(field, cell) for field, cell in zip(QUERY_FIELDS, cells, strict=True)}
            for cells in rows
            if len(cells) == len(QUERY_FIELDS) and cells[0].isdigit()  # a blank line or an error text: no GPU row
        ]


class NvidiaSmiStatus(Fact[dict[str, bool | str]]):
    """Whether nvidia-smi talks to the driver: {"installed": bool, "ok": bool, "message": str}. Asked with the GPU
    query (SMI_QUERY, shared in the probe), which fails with the same NVML message exactly when `nvidia-smi -L` does."""

    shared = (SMI_QUERY,)

    command = (
        "if ! command -v nvidia-smi >/dev/null 2>&1; then echo 'rc=missing'; "
        f'else out=$({SMI_QUERY} 2>&1); rc=$?; echo "rc=$rc"; printf \'%s\\n\' "$out" | head -n 3; fi'
    )

    def process(self, output: list[str]) -> dict[str, bool | str]:
        rc = output[0].partition("=")[2] if output else "missing"
        message = " ".join(line.strip() for line in output[1:] if line.strip())
        return {"installed": rc != "missing", "ok": rc == "0", "message": message if rc != "0" else ""}


class NvidiaModuleVersion(Fact[str | None]):
    """Version of the loaded nvidia kernel module (/sys/module/nvidia/version), None when not loaded."""

    command = "cat /sys/module/nvidia/version 2>/dev/null || true"

    def process(self, output: list[str]) -> str | None:
        return "\n".join(output).strip() or None


class NvidiaPciGpus(Fact[list[tuple[str, str]] | None]):
    """NVIDIA display/3D controllers on the PCI bus from sysfs (no driver needed): [(PCI address, device ID)], e.g.
    [("0000:01:00.0", "2204")] (hardware.py PCI_CARDS); None without a PCI bus (a container), so unknown is not
    mistaken for "no GPU"."""

    command = (
        # `read`, a shell builtin, not `cat`: no process per PCI function (a server has dozens to hundreds)
        "if [ -d /sys/bus/pci/devices ]; then for d in /sys/bus/pci/devices/*; do "
        'v=; read -r v 2>/dev/null <"$d/vendor"; [ "$v" = 0x10de ] || continue; '
        'c=; read -r c 2>/dev/null <"$d/class"; case "$c" in 0x0300*|0x0302*) '
        'i=; read -r i 2>/dev/null <"$d/device"; echo "pci ${d##*/} $i";; esac; done; echo end; '
        "else echo none; fi"
    )

    def process(self, output: list[str]) -> list[tuple[str, str]] | None:
        if "end" not in [line.strip() for line in output]:
            return None
        rows = [line.split() for line in output if line.startswith("pci ")]
        return [(row[1], row[2].removeprefix("0x").lower() if len(row) > 2 else "") for row in rows]


_CUDA_VERSION = re.compile(r"CUDA Version\s*:\s*(\d+\.\d+)")


def parse_cuda_version(text: str) -> str | None:
    """The driver's CUDA version in nvidia-smi's header ("CUDA Version: 13.0"; `-q`: "CUDA Version : 13.0") or None."""
    match = _CUDA_VERSION.search(text or "")
    return match.group(1) if match else None


_PROC_VERSION = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)")


class NvidiaRunningDriver(Fact[dict[str, str | bool | None]]):
    """The running driver: {"version" (/proc, else the module's), "smi" (its path), "smi_ok" (it answers), "cuda"
    (the driver's CUDA version, from nvidia-smi's header), "owner" (the package; None: e.g. NVIDIA's .run
    installer)}."""

    command = (
        'echo "proc=$(head -n 1 /proc/driver/nvidia/version 2>/dev/null)"; '
        'echo "module=$(cat /sys/module/nvidia/version 2>/dev/null)"; '
        'smi=$(command -v nvidia-smi 2>/dev/null); echo "smi=$smi"; '
        'if [ -n "$smi" ]; then out=$(timeout 60 "$smi" 2>/dev/null) && echo smi_ok=1; '
        'echo "cuda=$(printf \'%s\\n\' "$out" | grep -m 1 "CUDA Version")"; '
        'echo "owner=$(dpkg -S "$(readlink -f "$smi")" 2>/dev/null | head -n 1)"; fi'
    )

    def process(self, lines: list[str]) -> dict[str, str | bool | None]:
        items = dict(line.partition("=")[::2] for line in lines if "=" in line)
        match = _PROC_VERSION.search(items.get("proc", ""))
        return {
            "version": match.group(1) if match else (items.get("module", "").strip() or None),
            "smi": items.get("smi", "").strip() or None,
            "smi_ok": items.get("smi_ok", "").strip() == "1",
            "owner": items.get("owner", "").split(":")[0].strip() or None,
            "cuda": parse_cuda_version(items.get("cuda", "")),
        }


# Units that set power caps at boot besides rigforge's own: the recipe repo's (club-3090
# scripts/systemd/nvidia-power-cap.service) and the tuning unit it orders itself after (gpu-tune.service).
CAP_UNITS = ("nvidia-power-cap.service", "gpu-tune.service")
_PL = re.compile(r"(?:^|\s)(?:-pl|--power-limit)(?:=|\s+)(\d+(?:\.\d+)?)")
_SETS_CAP = re.compile(r"nvidia-smi\b[^#]*\s(?:-pl|--power-limit)(?:[\s=]|$)")
_SHELL_SETS_CAP = r"nvidia-smi[^#]*[[:space:]](-pl|--power-limit)([[:space:]=]|$)"  # _SETS_CAP for grep -E
_TIMER_UNIT = re.compile(r"^\s*Unit\s*=\s*(\S+)")


def _watts(lines: Iterable[str]) -> list[int]:
    return sorted({round(float(w)) for line in lines if _SETS_CAP.search(line) for w in _PL.findall(line)})


def cron_entry(path: str, text: str) -> tuple[str, str] | None:
    """A cron table's line -> (schedule, command): "@reboot" or five fields, the user field skipped outside a user's
    crontab (/var/spool/cron/crontabs/USER); None for a variable assignment or a line too short to be a job."""
    fields = text.split()
    if not fields or "=" in fields[0] and not fields[0].startswith(("@", "*")) and not fields[0][0].isdigit():
        return None
    when = 1 if fields[0].startswith("@") else 5
    user = 0 if "/crontabs/" in path else 1
    if len(fields) <= when + user:
        return None
    n = when + user
    parts = text.split(None, n)
    command = parts[n] if len(parts) > n else ""
    return " ".join(fields[:when]), command


class PowerCapUnits(Fact[dict[str, dict]]):
    """Other GPU power-cap writers, {name: writer}: units (first file of the name in `unit_dirs`) in CAP_UNITS or
    whose ExecStart runs `nvidia-smi -pl` or a script that does, and the timer that starts such a unit; cron jobs of
    any schedule ("SCHEDULE in FILE"), rc.local and udev rules ("udev rule in FILE") likewise.
    Writer: {"kind": "unit"|"cron"|"rc.local"|"udev", "path", "watts" (caps set, else []), "script" (or None);
    a unit: "timer" (or None); cron: "command"}."""

    def command(
        self,
        unit_dirs: Sequence[str] = UNIT_SEARCH_PATH,
        cron_files: Sequence[str] = CRON_FILES,
        rc_local: str = RC_LOCAL,
        udev_dirs: Sequence[str] = UDEV_RULES_DIRS,
    ) -> str:
        """`line=FILE:LINE` per ExecStart/cron/rc.local/udev RUN line naming nvidia-smi, a cap unit or a capping
        `script=PATH`; `timer=FILE:LINE` per timer's Unit= line, `timerfile=FILE` per timer."""
        units = " ".join(f"{d}/*.service" for d in unit_dirs)
        timers = " ".join(f"{d}/*.timer" for d in unit_dirs)
        crons = " ".join(cron_files)
        rules = " ".join(f"{d}/*.rules" for d in udev_dirs)
        known = "".join(f"printf '%s\\n' '/{name}:'; " for name in CAP_UNITS)
        return (
            "t=$(mktemp) || exit 0; "
            f"{{ grep -HE '^[[:space:]]*ExecStart[^=]*=' {units}; grep -HE '^[[:space:]]*[^#[:space:]]' {crons} "
            f"{rc_local}; grep -HE 'RUN' {rules}; }} 2>/dev/null > \"$t\"; "
            # the files those lines name, but unit files, cron files, rules and nvidia-smi itself
            "hits=$(grep -oE '/[^[:space:]\"'\\'';|&:=()]+' \"$t\" | sort -u | while read -r p; do "
            'case "$p" in *.service|*.rules|*/rc.local|*/cron.d/*|*/crontabs/*|*/crontab|*/nvidia-smi) continue;; '
            "esac; "
            '[ -f "$p" ] && printf \'%s\\n\' "$p"; done | '
            f"xargs -r grep -lIE '{_SHELL_SETS_CAP}' 2>/dev/null); "
            f"{{ printf '%s\\n' nvidia-smi; {known}"
            "printf '%s\\n' \"$hits\" | grep -v '^$'; } > \"$t.pat\"; "
            'grep -F -f "$t.pat" "$t" | sed \'s/^/line=/\'; '
            'for s in $hits; do echo "script=$s"; '
            f"grep -hE '{_SHELL_SETS_CAP}' \"$s\" | head -n 20 | sed 's/^/pl=/'; done; "
            f'for f in {timers}; do [ -f "$f" ] && echo "timerfile=$f"; done; '
            f"grep -HE '^[[:space:]]*Unit[[:space:]]*=' {timers} 2>/dev/null | sed 's/^/timer=/'; "
            'rm -f "$t" "$t.pat"; true'
        )

    def process(self, lines: list[str], unit_dirs: Sequence[str] = UNIT_SEARCH_PATH) -> dict[str, dict]:
        scripts = {
            name: [line[3:] for line in pls if line.startswith("pl=")]
            for name, pls in sections(lines, "script=").items()
        }
        rank = {d.rstrip("/"): i for i, d in enumerate(unit_dirs)}
        units: dict[str, dict[int, tuple[str, list[str]]]] = {}  # name -> {rank of its dir: (path, ExecStart lines)}
        out: dict[str, dict] = {}
        for path, _, text in (line[5:].partition(":") for line in lines if line.startswith("line=")):
            text = text.strip()
            folder, _, name = path.rpartition("/")
            via = next((s for s in scripts if s in text), None)
            sets_cap = bool(_SETS_CAP.search(text) or via)
            watts = _watts([text, *scripts.get(via, [])])
            if name.endswith(".service") and folder in rank:
                if name not in (POWER_UNIT, SETTLE_UNIT, HOLD_UNIT):  # rigforge's own
                    units.setdefault(name, {}).setdefault(rank[folder], (path, []))[1].append(text)
            elif not sets_cap:
                continue
            elif name == "rc.local":
                out[path] = dict(kind="rc.local", path=path, watts=watts, script=via)
            elif name.endswith(".rules"):
                out[f"udev rule in {path}"] = dict(kind="udev", path=path, watts=watts, script=via)
            elif entry := cron_entry(path, text):
                when, command = entry
                out[f"{when} in {path}"] = dict(kind="cron", path=path, watts=watts, script=via, command=command)
        started_by = self.timers(lines)
        for name, by_rank in units.items():
            path, texts = by_rank[min(by_rank)]  # the first dir in systemd's precedence wins
            via = next((s for s in scripts for t in texts if s in t), None)
            if name in CAP_UNITS or via or any(_SETS_CAP.search(t) for t in texts):
                watts = _watts([*texts, *scripts.get(via, [])])
                out[name] = dict(kind="unit", path=path, watts=watts, script=via, timer=started_by.get(name))
        return dict(sorted(out.items()))

    @staticmethod
    def timers(lines: list[str]) -> dict[str, str]:
        """{unit: the timer that starts it}: a timer's Unit=, else the unit of its own name (systemd's default)."""
        out = {}
        for path in (line[10:] for line in lines if line.startswith("timerfile=")):
            name = path.rpartition("/")[2]
            out.setdefault(name.removesuffix(".timer") + ".service", name)
        for path, _, text in (line[6:].partition(":") for line in lines if line.startswith("timer=")):
            if match := _TIMER_UNIT.match(text):
                out = {unit: timer for unit, timer in out.items() if timer != path.rpartition("/")[2]}
                out[match.group(1)] = path.rpartition("/")[2]
        return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the real tool underlines the matrix header
_DEVICE = re.compile(r"(GPU|NIC)\d+$")


def parse_topo_matrix(lines: list[str]) -> dict[str, str]:
    """`nvidia-smi topo -m` or `topo -p2p r` -> {"0-1": "PHB", ...}: the cell of each GPU pair i < j (link
    type: X, PIX, PXB, PHB, NODE, SYS, NV#; P2P status: OK, CNS, GNS, TNS, NS, U). {} for one GPU."""
    columns: list[str] = []
    pairs: dict[str, str] = {}
    for raw in lines:
        cells = [c.strip() for c in _ANSI.sub("", raw).strip().split("\t")]
        if cells[0].startswith("Legend"):
            break
        if not columns and _DEVICE.match(cells[0]):
            columns = [c for c in cells if _DEVICE.match(c)]
        elif columns and cells[0].startswith("GPU") and _DEVICE.match(cells[0]):
            row = int(cells[0][3:])
            for name, cell in zip(columns, cells[1:], strict=False):
                if name.startswith("GPU") and int(name[3:]) > row:
                    pairs[f"{row}-{name[3:]}"] = cell
    return pairs


def parse_topology(lines: list[str]) -> dict[str, dict[str, str]]:
    found = sections(lines, "--- ")
    return {
        "links": parse_topo_matrix(found.get("topo -m", [])),
        "p2p_read": parse_topo_matrix(found.get("topo -p2p r", [])),
    }


class NvidiaTopology(Fact[dict[str, dict[str, str]]]):
    """How the GPUs are connected (`topo -m`) and whether peer reads work (`topo -p2p r`): {"links": {pair: link
    type}, "p2p_read": {pair: status}} (`parse_topo_matrix`), both empty without nvidia-smi."""

    command = (
        "if command -v nvidia-smi >/dev/null 2>&1; then echo '--- topo -m'; timeout 60 nvidia-smi topo -m "
        "2>/dev/null; echo '--- topo -p2p r'; timeout 60 nvidia-smi topo -p2p r 2>/dev/null; fi; true"
    )

    process = staticmethod(parse_topology)


class BootCaps(Fact[BootSeen]):
    """What ran at this boot about GPU power caps (boot.py `parse_boot`): systemd's results for rigforge's power and
    settle units, the hold's timer and `units`, the journal's ordering cycles, settle, hold and cron lines (the units'
    results and the journal's lines empty without systemd, e.g. a chroot), each GPU's power limit now."""

    shared = (SMI_QUERY,)

    def command(self, units: str = "") -> StringCommand:
        # each GPU's "index, power.limit": those two columns of the shared GPU query (SMI_QUERY)
        caps = f"-f{QUERY_FIELDS.index('index') + 1},{QUERY_FIELDS.index('power.limit') + 1}"
        return StringCommand(
            'echo "boot_id=$(cat /proc/sys/kernel/random/boot_id 2>/dev/null)"; '
            'echo "system=$(systemctl is-system-running 2>/dev/null)"; for u in',
            *(QuoteString(name) for name in (POWER_UNIT, SETTLE_UNIT, HOLD_TIMER, *units.split())),
            f'; do echo "--- unit $u"; systemctl show -p {",".join(SHOW)} -- "$u" 2>/dev/null; done; '
            "echo '--- cycles'; journalctl -b _PID=1 --no-pager -o cat 2>/dev/null | grep -i 'ordering cycle' | "
            f"tail -n 20; echo '--- settle'; journalctl -b -u {SETTLE_UNIT} --no-pager -o cat 2>/dev/null | "
            f"grep '^rigforge: ' | tail -n 100; echo '--- hold'; journalctl -b -u {HOLD_UNIT} --no-pager -o cat "
            "2>/dev/null | grep '^rigforge: ' | tail -n 100; echo '--- cron'; journalctl -b -t CRON --no-pager -o cat "
            "2>/dev/null | grep ' CMD ' | tail -n 100; echo '--- caps'; if command -v nvidia-smi >/dev/null 2>&1; then "
            f"{SMI_QUERY} 2>/dev/null | cut -d, {caps}; fi; true",
        )

    process = staticmethod(parse_boot)
