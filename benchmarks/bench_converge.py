"""Benchmark (not a test): converge times on the testbed, against pyinfra's own floor.

Prints, on 4 fresh testbed rigs (a fleet of the testbed dir):
- fresh converge of rig1 and of rig2..rig4 in parallel (wall time);
- the floor: `pyinfra -y INV exec -- true` on rig1 (start-up, connect, one command), median of --repeat runs;
- the no-op re-converge (all roles, 0 changes) of rig1, its ratio to the floor (goal <= 2x), and of all 4 rigs,
  with the 4-rig / 1-rig ratio (goal <= 1.2x), medians of --repeat runs taken in one run, interleaved;
- a per-role breakdown of the 1-rig no-op: fact reads (round trips) and their time, and execute time;
- the probe's own time on rig1 (its recorded facts' one command, timed on the rig: wall and CPU), interleaved too.

The runs get their own probe cache (RIGFORGE_PROBE_CACHE in a temporary dir) and, as a user's would, write
rigforge's bytecode (PYTHONDONTWRITEBYTECODE is dropped from their environment: rigforge/speedups.py).

    sudo .venv/bin/python benchmarks/bench_converge.py [--dir /var/lib/rigforge-testbed] [--variant dual-turbo]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))


CHANGED: list[str] = []  # operations the last converge changed ("host: op")
CPU: dict[str, float] = {}  # CPU seconds of the last run: the controller (pyinfra's process) and the whole machine


def _machine_cpu() -> float:
    """CPU seconds all processes on this machine have used (user + nice + system), from /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:4]
    return sum(int(x) for x in fields) / os.sysconf("SC_CLK_TCK")


ENV: dict[str, str] = {}  # every run's environment, on top of this one's (main() sets the probe cache)


def _run(cmd: list[str], env: dict | None = None) -> float:
    t0, before, machine = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN), _machine_cpu()
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**environ, **ENV, **(env or {})})
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU["controller"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    CPU["machine"] = _machine_cpu() - machine
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    if "--json" in cmd:
        ops = (json.loads(proc.stdout)["results"] or {}).get("operations", [])
        CHANGED[:] = [f"{h}: {op['name']}" for op in ops for h in op["success"]]
    return wall


def _limits(names: list[str]) -> list[str]:
    return [arg for name in names for arg in ("--limit", name)]


def converge(inventory: Path, limits: list[str], timings: Path) -> float:
    cmd = [PYINFRA, "-y", "--json", str(inventory), str(REPO / "benchmarks" / "timed_site.py"), *_limits(limits)]
    return _run(cmd, {"RIGFORGE_TIMINGS": str(timings)})


def floor(inventory: Path, limits: list[str]) -> float:
    return _run([PYINFRA, "-y", str(inventory), *_limits(limits), "exec", "--", "true"])


def probe_time(ssh_config: Path, rig: str, recorded: Path) -> tuple[float, float]:
    """(wall ms, CPU ms) of the batched probe on `rig`: the one command its recorded facts make (the probe's
    `script`), sent as a run sends it (sudo, sh), timed on the rig from start to its last line (`date +%s%N`,
    the shell's `times` for the CPU of every process it started)."""
    import secrets
    import shlex

    sys.path.insert(0, str(REPO))
    from rigforge.observe.facts import probe

    requests = []
    for item in json.loads(recorded.read_text()):
        module, _, name = item["fact"].partition(":")
        requests.append((getattr(__import__(module, fromlist=[name]), name), item["kwargs"]))
    command, _ = probe.script(requests, f"@@bench-{secrets.token_hex(4)}")
    timed = (
        f"s=$(date +%s%N); {{ {command.get_raw_value()}; }} >/dev/null; e=$(date +%s%N); "
        'echo "$(( (e - s) / 1000 ))"; times'
    )
    out = subprocess.run(
        ["ssh", "-F", str(ssh_config), rig, f"sudo -n sh -c {shlex.quote(timed)}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()

    def seconds(text: str) -> float:  # "0m0.120000s"
        minutes, _, rest = text.rstrip("s").partition("m")
        return int(minutes) * 60 + float(rest)

    children = out[2].split()  # `times`: the shell's own line, then its children's (user, system)
    return int(out[0]) / 1000, (seconds(children[0]) + seconds(children[1])) * 1000


def _rows(timings: Path) -> list[dict]:
    return [json.loads(line) for line in timings.read_text().splitlines()] if timings.exists() else []


def breakdown(timings: Path, host: str, title: str) -> None:
    rows = [r for r in _rows(timings) if r["host"] == host]
    facts: dict[str, list[float]] = defaultdict(list)
    trips: dict[str, int] = defaultdict(int)  # fact reads that went to the rig (live reads and the probe)
    execute: dict[str, float] = defaultdict(float)
    ops: dict[str, int] = defaultdict(int)
    for r in rows:
        if r.get("kind") == "fact":
            facts[r["role"]].append(r["s"])
            trips[r["role"]] += r.get("how", "live") != "served"
        else:
            parts = r["op"].split(" | ")
            role = parts[1] if len(parts) > 2 else parts[0]
            execute[role] += r["s"]
            ops[role] += 1
    n_facts = sum(len(v) for v in facts.values())
    print(f"  {title}: {sum(trips.values())} round trips for facts")
    print(
        f"  {title}: {n_facts} fact reads ({sum(map(sum, facts.values())):.2f} s), "
        f"{sum(ops.values())} operations ({sum(execute.values()):.2f} s executing)"
    )
    print(f"    {'role':<44} {'facts':>5} {'trips':>5} {'fact s':>7} {'ops':>4} {'exec s':>7}")
    for role in sorted(set(facts) | set(execute), key=lambda k: -(sum(facts.get(k, [])) + execute.get(k, 0))):
        print(
            f"    {role:<44} {len(facts.get(role, [])):>5} {trips.get(role, 0):>5} {sum(facts.get(role, [])):>7.2f} "
            f"{ops.get(role, 0):>4} {execute.get(role, 0):>7.2f}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dir", type=Path, default=Path(os.environ.get("RIGFORGE_TESTBED_DIR", "/var/lib/rigforge-testbed"))
    )
    p.add_argument("--variant", default="dual-turbo")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement (median reported; default 3)")
    p.add_argument("--keep", action="store_true", help="keep the 4 rigs (and reuse converged ones next time)")
    args = p.parse_args()

    from rigforge.testbed import RigSpec, down, up

    fleet = args.dir / "fleets" / "bench-converge"
    t0 = time.monotonic()
    reuse = args.keep and (fleet / "converged").exists()
    tb = up(fleet, [RigSpec()] * 4, fresh=not reuse, shared=args.dir)
    print(
        f"testbed: 4 {'reused' if reuse else 'fresh'} rigs up in {time.monotonic() - t0:.1f} s; "
        f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores"
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ENV["RIGFORGE_PROBE_CACHE"] = str(Path(tmp) / "probes")
            inv = Path(tmp) / "inventory.py"
            inv.write_text(
                f"exec(open({str(tb.inventory)!r}).read())\n"
                f"rigs = [(n, {{**d, 'rigforge_variant': {args.variant!r}}}) for n, d in rigs]\n"
            )
            timings = Path(tmp) / "timings.jsonl"
            if not reuse:
                fresh = converge(inv, ["rig1"], timings)
                print(f"fresh converge, 1 rig ({args.variant}): {fresh:.1f} s wall")
                fresh3 = converge(inv, ["rig2", "rig3", "rig4"], timings)
                print(f"fresh converge, 3 rigs in parallel: {fresh3:.1f} s wall ({fresh3 / fresh:.2f}x one rig)")
                if args.keep:
                    (fleet / "converged").write_text("ok\n")
            for names in (["rig1"], [r.name for r in tb.rigs]):  # warm-up: records each rig's facts to probe
                converge(inv, names, timings)
                if names == ["rig1"]:  # rig1's recorded facts: the file this run wrote last
                    recorded = max((Path(tmp) / "probes").glob("*.json"), key=lambda f: f.stat().st_mtime_ns)
            floors, noop1, noop4, probe_wall, probe_cpu = [], [], [], [], []
            cpu: dict[str, list[float]] = defaultdict(list)
            all_rigs = [r.name for r in tb.rigs]
            for i in range(args.repeat):  # interleaved, so load changes hit every measurement alike
                floors.append(floor(inv, ["rig1"]))
                cpu["controller floor"].append(CPU["controller"])
                timings.unlink(missing_ok=True)
                noop1.append(converge(inv, ["rig1"], timings))
                cpu["controller 1"].append(CPU["controller"])
                cpu["machine 1"].append(CPU["machine"])
                if i == 0:
                    breakdown(timings, "rig1", "1-rig no-op, per role")
                if CHANGED:
                    sys.exit(f"the re-converge changed something: {CHANGED}")
                timings.unlink(missing_ok=True)
                noop4.append(converge(inv, all_rigs, timings))
                cpu["controller 4"].append(CPU["controller"])
                cpu["machine 4"].append(CPU["machine"])
                if CHANGED:
                    sys.exit(f"the 4-rig re-converge changed something: {CHANGED}")
                wall, cpu_ms = probe_time(tb.ssh_config, "rig1", recorded)
                probe_wall.append(wall)
                probe_cpu.append(cpu_ms)
            f, n1, n4 = (statistics.median(x) for x in (floors, noop1, noop4))
            c = {k: statistics.median(v) for k, v in cpu.items()}
            print(f"floor (pyinfra exec -- true, 1 rig): {f:.2f} s   runs {' '.join(f'{x:.2f}' for x in floors)}")
            print(
                f"no-op re-converge, 1 rig: {n1:.2f} s = {n1 / f:.2f}x the floor (goal <= 1.4x)   "
                f"runs {' '.join(f'{x:.2f}' for x in noop1)}"
            )
            print(
                f"no-op re-converge, 4 rigs: {n4:.2f} s = {n4 / n1:.2f}x one rig (goal <= 1.2x)   "
                f"runs {' '.join(f'{x:.2f}' for x in noop4)}"
            )
            print(
                f"CPU seconds, 1 rig / 4 rigs: controller (pyinfra) {c['controller 1']:.2f} / {c['controller 4']:.2f} "
                f"({c['controller 4'] / c['controller 1']:.2f}x, goal <= 1.3x; "
                f"{(c['controller 4'] - c['controller 1']) / 3:.2f} per extra rig; the floor "
                f"{c['controller floor']:.2f}, 1 rig {c['controller 1'] / c['controller floor']:.2f}x it); "
                f"whole machine (controller, "
                f"sshd and the rigs' probes, all on these {os.cpu_count()} cores) {c['machine 1']:.2f} / "
                f"{c['machine 4']:.2f} ({(c['machine 4'] - c['machine 1']) / 3:.2f} per extra rig)"
            )
            print(
                f"the probe on rig1 ({len(json.loads(recorded.read_text()))} facts): "
                f"{statistics.median(probe_wall):.0f} ms wall (goal <= 200 ms), "
                f"{statistics.median(probe_cpu):.0f} ms CPU on the rig   "
                f"runs {' '.join(f'{x:.0f}' for x in probe_wall)}"
            )
            print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        if not args.keep:
            down(fleet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
