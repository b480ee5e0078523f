"""Benchmark (not a test): converge times on the testbed.

Prints: fresh-rig converge wall time with where the time goes (per role, slowest operations), fresh converge of
three more rigs in parallel, and the no-op re-converge wall time for 1 rig and for 4 rigs (ratio; target <= 1.5x).

    sudo .venv/bin/python benchmarks/bench_converge.py [--dir /var/lib/rigforge-testbed] [--variant dual-turbo]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))


def converge(inventory: Path, limits: list[str], timings: Path) -> float:
    cmd = [PYINFRA, "-y", str(inventory), str(REPO / "benchmarks" / "timed_site.py")]
    for name in limits:
        cmd += ["--limit", name]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "RIGFORGE_TIMINGS": str(timings)}
    )
    wall = time.monotonic() - t0
    if proc.returncode:
        sys.exit(f"converge failed:\n{proc.stderr[-4000:]}")
    return wall


def where_time_goes(timings: Path, host: str) -> None:
    rows = [json.loads(line) for line in timings.read_text().splitlines()]
    rows = [r for r in rows if r["host"] == host]
    per_role: dict[str, float] = defaultdict(float)
    for r in rows:
        parts = r["op"].split(" | ")
        per_role[parts[1] if len(parts) > 2 else parts[0]] += r["s"]
    print(f"  per role ({len(rows)} operations, {sum(r['s'] for r in rows):.1f} s in operations):")
    for role, s in sorted(per_role.items(), key=lambda kv: -kv[1]):
        print(f"    {s:6.1f} s  {role}")
    print("  slowest operations:")
    for r in sorted(rows, key=lambda r: -r["s"])[:6]:
        print(f"    {r['s']:6.1f} s  {r['op'].split(' | ')[-1]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dir", type=Path, default=Path(os.environ.get("RIGFORGE_TESTBED_DIR", "/var/lib/rigforge-testbed"))
    )
    p.add_argument("--variant", default="dual-turbo")
    args = p.parse_args()

    from rigforge.testbed import RigSpec, down, up

    fleet = args.dir / "fleets" / "bench-converge"
    t0 = time.monotonic()
    tb = up(fleet, [RigSpec()] * 4, fresh=True, shared=args.dir)
    print(f"testbed: 4 fresh rigs up in {time.monotonic() - t0:.1f} s")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            inv = Path(tmp) / "inventory.py"
            inv.write_text(
                f"exec(open({str(tb.inventory)!r}).read())\n"
                f"rigs = [(n, {{**d, 'rigforge_variant': {args.variant!r}}}) for n, d in rigs]\n"
            )
            timings = Path(tmp) / "timings.jsonl"
            fresh = converge(inv, ["rig1"], timings)
            print(f"fresh converge, 1 rig ({args.variant}): {fresh:.1f} s wall")
            where_time_goes(timings, "rig1")
            fresh3 = converge(inv, ["rig2", "rig3", "rig4"], timings)
            print(f"fresh converge, 3 rigs in parallel: {fresh3:.1f} s wall ({fresh3 / fresh:.2f}x one rig)")
            noop1 = min(converge(inv, ["rig1"], timings) for _ in range(2))
            noop4 = min(converge(inv, [], timings) for _ in range(2))
            print(f"no-op re-converge: 1 rig {noop1:.1f} s, 4 rigs {noop4:.1f} s, ratio {noop4 / noop1:.2f}x")
    finally:
        down(fleet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
