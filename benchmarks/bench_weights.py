#!/usr/bin/env python3
"""Benchmark (not a test) of the weights role on a testbed rig (root; see rigforge/testbed):

1. no-op re-run time of the weights role (pyinfra over SSH, stamp + stat only) with a 64 MiB asset vs a
   1 GiB asset: it must not grow with size; the deep-verify run (re-hash) is shown for contrast;
2. download throughput from a local HF stand-in: fetch_weights.py (huggingface_hub metadata + Range GET +
   sha256 + move) vs plain `curl -o` of the same file.

    /work/venv/bin/python benchmarks/bench_weights.py [--dir /var/lib/rigforge-testbed] [--runs 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rigforge.observe.facts.hfweights import WeightsState  # noqa: E402
from rigforge.testbed import DEFAULT_DIR, RigSpec, up  # noqa: E402
from rigforge.testbed.core import down  # noqa: E402

MiB = 2**20
ASSETS = {"bench-64m": ("rigforge/bench-64m", [64 * MiB]), "bench-1g": ("rigforge/bench-1g", [256 * MiB] * 4)}
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
DEPLOY = REPO / "tests" / "deploys" / "sources_weights.py"


def write_repo(root: Path, repo: str, sizes: list[int]) -> dict:
    """An HF stand-in repo (rigforge/testbed/hfserver.py layout) of pseudo-random shards."""
    files, block = [], os.urandom(MiB)
    for i, size in enumerate(sizes):
        path = f"model-{i + 1:05d}-of-{len(sizes):05d}.safetensors"
        target = root / repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        with open(target, "wb") as f:
            for n in range(size // MiB):
                chunk = n.to_bytes(8, "little") + block[8:]  # distinct blocks
                f.write(chunk)
                h.update(chunk)
        files.append({"path": path, "size": size, "sha256": h.hexdigest(), "git_oid": "0" * 40, "lfs": True})
    revision = hashlib.sha1(json.dumps(files).encode()).hexdigest()
    meta = {"repo": repo, "revision": revision, "gated": False, "token": "", "files": files}
    (root / repo / ".rigforge-meta.json").write_text(json.dumps(meta))
    return meta


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pyinfra(inventory: Path, assets: str) -> float:
    env = {**os.environ, "RIGFORGE_TEST_SOURCES": "", "RIGFORGE_TEST_ASSETS": assets}
    t0 = time.monotonic()
    proc = subprocess.run(
        [PYINFRA, "-y", "--json", str(inventory), str(DEPLOY)], cwd=REPO, env=env, capture_output=True, text=True
    )
    elapsed = time.monotonic() - t0
    if proc.returncode:
        raise SystemExit(f"pyinfra failed:\n{proc.stderr[-3000:]}")
    return elapsed


def changed_ops(inventory: Path, assets: str) -> list[str]:
    env = {**os.environ, "RIGFORGE_TEST_SOURCES": "", "RIGFORGE_TEST_ASSETS": assets}
    proc = subprocess.run(
        [PYINFRA, "-y", "--json", str(inventory), str(DEPLOY)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    ops = json.loads(proc.stdout)["results"]["operations"]
    return [op["name"] for op in ops if op["success"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="shared testbed dir (root-owned)")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rigforge-bench-"))
    fleet = args.dir / "fleets" / "bench-weights"
    server = None
    try:
        print("preparing 64 MiB and 1 GiB stand-in repos ...", flush=True)
        metas = {key: write_repo(work / "hf", repo, sizes) for key, (repo, sizes) in ASSETS.items()}
        port = free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "rigforge/testbed/hfserver.py"),
                "--root",
                str(work / "hf"),
                "--port",
                str(port),
            ]
        )
        endpoint = f"http://127.0.0.1:{port}"
        time.sleep(0.5)

        tb = up(fleet, [RigSpec()], shared=args.dir)
        lock = {
            "version": 1,
            "image": {"ref": "bench", "digest": None},
            "git": {},
            "hf": {
                key: {
                    "repo": m["repo"],
                    "revision": m["revision"],
                    "gated": False,
                    "files": [{k: f[k] for k in ("path", "size", "sha256")} for f in m["files"]],
                }
                for key, m in metas.items()
            },
        }
        lock_path = work / "bench.lock.yaml"
        lock_path.write_text(yaml.safe_dump(lock))
        inv = work / "inventory.py"
        inv.write_text(
            f"exec(open({str(tb.inventory)!r}).read())\n"
            f"_extra = {{'rigforge_lock': {str(lock_path)!r}, 'hf_endpoint': {endpoint!r}}}\n"
            "rigs = [(n, {**d, **_extra}) for n, d in rigs]\n"
        )
        deep_inv = work / "inventory-deep.py"
        deep_inv.write_text(
            f"exec(open({str(inv)!r}).read())\nrigs = [(n, {{**d, 'weights_deep_verify': True}}) for n, d in rigs]\n"
        )

        print(f"\n== 1. weights role on a testbed rig (pyinfra over SSH, sudo user); load {os.getloadavg()[0]:.1f} ==")
        for key in ASSETS:
            first = pyinfra(inv, key)
            assert changed_ops(inv, key) == [], "second run changed something"
            print(f"{key}: first run (download{', venv + pip' if key == 'bench-64m' else ''}) {first:.2f} s")
        noop = {key: [] for key in ASSETS}
        for _ in range(args.runs):  # interleaved, so machine load hits both alike
            for key in ASSETS:
                noop[key].append(pyinfra(inv, key))
        deep = {key: pyinfra(deep_inv, key) for key in ASSETS}
        fact = WeightsState()
        for key in ASSETS:
            size = sum(f["size"] for f in metas[key]["files"])
            cmd = fact.command(f"/opt/rigforge/models/{key}", f"/opt/rigforge/models/.rigforge-staging/{key}")
            t0 = time.monotonic()
            for _ in range(20):
                tb.rig("rig1").run(cmd, check=True)
            t_fact = (time.monotonic() - t0) / 20
            print(
                f"{key:10s} {size / MiB:5.0f} MiB: no-op re-run median {statistics.median(noop[key]):5.2f} s "
                f"(runs: {', '.join(f'{t:.2f}' for t in noop[key])}) | state fact on the rig {t_fact * 1000:5.1f} ms "
                f"| deep verify run {deep[key]:5.2f} s"
            )

        print("\n== 2. download throughput from the local endpoint (1 GiB, 4 files) ==")
        m = metas["bench-1g"]
        dest = work / "dl"
        manifest = {
            "name": "bench-1g",
            "repo": m["repo"],
            "revision": m["revision"],
            "endpoint": endpoint,
            "dest": str(dest / "fw"),
            "staging": str(dest / "staging"),
            "files": [{k: f[k] for k in ("path", "size", "sha256")} for f in m["files"]],
        }
        total = sum(f["size"] for f in m["files"])
        t0 = time.monotonic()
        subprocess.run(
            [sys.executable, str(REPO / "rigforge/remote/fetch_weights.py")],
            input=json.dumps(manifest),
            text=True,
            check=True,
            capture_output=True,
        )
        t_fw = time.monotonic() - t0
        (dest / "curl").mkdir(parents=True)
        t0 = time.monotonic()
        for f in m["files"]:
            url = f"{endpoint}/{m['repo']}/resolve/{m['revision']}/{f['path']}"
            subprocess.run(["curl", "-sSfo", str(dest / "curl" / f["path"]), url], check=True)
        t_curl = time.monotonic() - t0
        t0 = time.monotonic()
        for f in m["files"]:
            subprocess.run(["sha256sum", str(dest / "curl" / f["path"])], check=True, capture_output=True)
        t_sum = time.monotonic() - t0
        print(f"fetch_weights.py (download + sha256 + move): {t_fw:6.2f} s = {total / MiB / t_fw:7.1f} MiB/s")
        print(f"curl -o (download only):                     {t_curl:6.2f} s = {total / MiB / t_curl:7.1f} MiB/s")
        print(
            f"curl -o + sha256sum:                         {t_curl + t_sum:6.2f} s = "
            f"{total / MiB / (t_curl + t_sum):7.1f} MiB/s"
        )
    finally:
        if server:
            server.terminate()
            server.wait(timeout=10)
        down(fleet)
        shutil.rmtree(fleet, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
