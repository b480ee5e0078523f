"""Snapshot what rigforge produces, to diff a refactor's before and after (issue 48: no message, exit code,
rendered file or rig command may change).

    python benchmarks/snapshot.py OUT [--inventory INV]

Writes into OUT:
  - render/<variant>/...: `rigforge render` of every variant `rigforge render --list` serves (the design's five
    and the recipe repo's slugs from tests/fixtures/club-3090-4a29ab57), and of each with `--gpus 4`;
  - fake/<deploy>.txt: `pyinfra -y --dry -vvv` of each deploy/*.py on a @fake host with a resolved lock: the
    fact commands the deploy sends and what it says (a @fake host answers every command with nothing, so the run
    stops in preflight, naming it), with its exit code;
  - inventory/<deploy>.txt (with --inventory, e.g. a testbed's): the same on real rigs, where the operation
    table shows every operation the deploy would run.

Lines that change from run to run (timings, temporary paths) are masked. Compare two snapshots with
`diff -r BEFORE AFTER`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "tests" / "fixtures" / "club-3090-4a29ab57"
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
RIGFORGE = [sys.executable, "-m", "rigforge.cli"]
GIT_NAMES = ("vllm-src", "genesis", "club-3090")
SHA = "a" * 40
WEIGHTS_FILE = {"path": "model.safetensors", "size": 10, "sha256": "d" * 64}
# what differs between two runs of the same code: seconds, temporary directories
MASKS = [
    (re.compile(r"\d+(\.\d+)?\s?s\b"), "<seconds>"),
    (re.compile(r"/tmp/[^\s'\")]+"), "<tmp>"),
    (re.compile(r"\x1b\[[0-9;]*m"), ""),
]


def masked(text: str) -> str:
    """`text` with what differs between runs of the same code masked."""
    for pattern, replacement in MASKS:
        text = pattern.sub(replacement, text)
    return text


def served_variants(env: dict[str, str]) -> list[str]:
    """The variants `rigforge render --list` marks as served (RIGFORGE column "yes")."""
    listing = subprocess.run([*RIGFORGE, "render", "--list"], capture_output=True, text=True, env=env, check=True)
    names = []
    for line in listing.stdout.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == "yes":
            names.append(fields[0])
    return names


def render_all(out: Path, env: dict[str, str]) -> None:
    """Every served variant rendered, with its own GPU count and with 4."""
    for variant in served_variants(env):
        for suffix, extra in (("", []), ("@4gpus", ["--gpus", "4"])):
            dest = out / "render" / f"{variant.replace('/', '__')}{suffix}"
            proc = subprocess.run(
                [*RIGFORGE, "render", variant, "--out", str(dest), *extra], capture_output=True, text=True, env=env
            )
            dest.mkdir(parents=True, exist_ok=True)
            (dest / "_said.txt").write_text(f"exit {proc.returncode}\n{masked(proc.stdout + proc.stderr)}")


def fake_lock(path: Path) -> Path:
    """A resolved lock of stand-in pins: every git repo at one commit, every weights asset at one revision."""
    data = {
        "version": 1,
        "image": {"ref": "vllm/vllm-openai:nightly", "digest": None},
        "git": {name: {"url": f"git://h/{name}.git", "ref": "b", "commit": "b" * 40} for name in GIT_NAMES},
        "hf": {
            "autoround-int4": {"repo": "Lorbus/q", "revision": SHA, "gated": False, "files": [WEIGHTS_FILE]},
            "dflash-draft": {"repo": "z-lab/d", "revision": SHA, "gated": True, "files": [WEIGHTS_FILE]},
            "carnice": {"repo": "w/Carnice", "revision": SHA, "gated": False, "files": [WEIGHTS_FILE]},
        },
    }
    path.write_text(yaml.safe_dump(data))
    return path


def fake_inventory(path: Path, lock: Path) -> Path:
    """One @fake rig (no delay), the stand-in lock, a hub on a closed port. One: two hosts' lines interleave in an
    order that changes from run to run."""
    data = {"fake_delay": 0, "fake_delay_jitter": 0, "hf_endpoint": "http://127.0.0.1:9", "rigforge_lock": str(lock)}
    path.write_text(f"data = {data!r}\nrigs = [('@fake/rig1', data)]\n")
    return path


def dry_runs(out: Path, inventory: Path, env: dict[str, str]) -> None:
    """`pyinfra -y --dry -vvv INVENTORY deploy/X.py` for every deploy file, its exit code and output."""
    out.mkdir(parents=True, exist_ok=True)
    for deploy in sorted((REPO / "deploy").glob("*.py")):
        proc = subprocess.run(
            [PYINFRA, "-y", "--dry", "-vvv", str(inventory), str(deploy)],
            cwd=REPO,
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
        )
        (out / f"{deploy.stem}.txt").write_text(f"exit {proc.returncode}\n{masked(proc.stdout + proc.stderr)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write the snapshot into (must not exist)")
    parser.add_argument("--inventory", type=Path, help="also `--dry` every deploy on this inventory's real rigs")
    parser.add_argument("--no-render", action="store_true", help="leave the rendered files out")
    args = parser.parse_args()
    args.out.mkdir(parents=True)
    env = {**os.environ, "RIGFORGE_RECIPES": str(RECIPES), "HF_TOKEN": "", "RIGFORGE_HF_TOKEN": ""}
    if not args.no_render:
        render_all(args.out, env)
    with tempfile.TemporaryDirectory() as tmp:
        inventory = fake_inventory(Path(tmp) / "fake.py", fake_lock(Path(tmp) / "lock.yaml"))
        dry_runs(args.out / "fake", inventory, env)
    if args.inventory:
        dry_runs(args.out / "inventory", args.inventory.resolve(), env)
    print(f"snapshot in {args.out}: {sum(1 for p in args.out.rglob('*') if p.is_file())} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
