"""Helpers shared by the converge tests: run pyinfra for real (a subprocess, as a user would) and read its
--json results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))


# the head of a script run as `python -c SCRIPT INVENTORY` (a testbed's inventory): `host`, its first rig,
# connected over SSH as pyinfra's CLI connects it
FIRST_RIG_CONNECTED = """
import sys
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
scope = {}
exec(open(sys.argv[1]).read(), scope)
inventory = Inventory(([scope["rigs"][0]], {}))
connect_all(State(inventory, Config()))
host = next(iter(inventory))
"""


def render_variant(variant, s, gpu_count: int | None = None) -> dict[str, str]:
    """Every file a rig gets for any variant (seed or recipe slug) at the layout `s` names, with the power unit
    for `gpu_count` GPUs (default: the variant's), as fleet.build_plan renders them."""
    from rigforge.layout import HostLayout

    layout = HostLayout(root=s.root, model_dir=s.model_dir, variant=variant.name)
    return variant.files(s, layout, gpu_count or variant.gpus)


def pyinfra_run(inventory: Path | str, deploy: Path | str, *extra: str, env: dict | None = None) -> tuple[dict, str]:
    """`pyinfra -y --json INVENTORY DEPLOY [extra]` from the repo; returns (results, stderr)."""
    cmd = [PYINFRA, "-y", "--json", str(inventory), str(deploy), *extra]
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=1200, env={**os.environ, **(env or {})}
    )
    if not proc.stdout.strip() and "No hosts remaining" in proc.stderr:  # every host failed: pyinfra prints no JSON
        assert proc.returncode != 0
        return {"failed_hosts": "all", "operations": []}, proc.stderr
    try:
        payload = json.loads(proc.stdout)
    except json.JSONDecodeError as error:
        raise AssertionError(
            f"pyinfra rc={proc.returncode}\nstdout:{proc.stdout[-3000:]}\nstderr:{proc.stderr[-6000:]}"
        ) from error
    return payload["results"] or {}, proc.stderr


def why(results: dict, err: str) -> str:
    """A failed run's story for an assertion message: the failed hosts' error lines, then the tail of the log."""
    failed = results.get("failed_hosts") or []
    hosts = failed if isinstance(failed, list) else []
    lines = [line for line in err.splitlines() if any(f"[{h}]" in line for h in hosts) and "rror" in line]
    return "\n".join([f"failed: {failed}", *lines[-40:], "--- log tail:", err[-4000:]])


def changed(results: dict, host: str | None = None) -> list[str]:
    """Names of the operations that changed something (on `host`, or on any host)."""
    return [op["name"] for op in results.get("operations", []) if (host in op["success"] if host else op["success"])]


def errored(results: dict, host: str) -> list[str]:
    """Names of the operations that failed on `host`; a run where every host failed (pyinfra printed no JSON) or
    that lists `host` among its failed hosts errored too, before or without an operation."""
    failed = results.get("failed_hosts") or []
    ops = [op["name"] for op in results.get("operations", []) if host in op["error"]]
    return ops or (["(the run failed on this host)"] if failed == "all" or host in failed else [])


def inventory_with(tb, path: Path, per_host: dict[str, dict]) -> Path:
    """A copy of the testbed's inventory with extra host data per rig (e.g. rigforge_variant)."""
    path.write_text(
        f"exec(open({str(tb.inventory)!r}).read())\n"
        f"_extra = {per_host!r}\n"
        "rigs = [(name, {**data, **_extra.get(name, {})}) for name, data in rigs]\n"
    )
    return path
