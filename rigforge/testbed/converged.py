"""Converged rig images: one chroot rig's root file system packed right after a converge, so that the tests of what
follows a converge start from a copy of it, and only the converge-from-fresh tests converge from fresh.

An image is one rig as the converge left it: packages, checkouts, weights, units, its simulated GPUs and their
power state (a chroot rig keeps that state in its root file system). It is made on one testbed directory's
stand-ins and records their endpoints (the apt sources', git remotes' and HF's URLs, with their ports), so it is
kept in that directory (`images/`), one per worker under pytest-xdist, and named by a key of everything the
converge depends on: roles/, templates/, deploy/, rigforge/ (the testbed's own code included), the lock, the
base root file system and the stand-ins' endpoints and pins. A change to any of them makes a new image.

A rig brought up from an image (`up(..., image=...)`) is a copy with a machine-id and SSH keys of its own; its
first deploy is expected to change nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from ._util import TestbedError, ensure_safe_dir, hash_tree, log, sh, stop_pidfile
from .core import down, start_services, up
from .rig import RigImage, RigSpec
from .rootfs import locked, tarball_path

CHECKOUT = Path(__file__).resolve().parents[2]
KEYED = ("roles", "templates", "deploy", "rigforge", "rigforge.lock.yaml")  # what a converge runs and reads
DOCKER_SOURCE = "distro"  # the converge tests' host data (tests/conftest.py's testbed_factory)


def image_key(testbed_dir: Path, deploy: Path, services: dict) -> str:
    """A short hash of what a converge of `deploy` on this testbed dir depends on (see the module's docstring);
    `services`: the apt, git and HF stand-ins (core.start_services), their endpoints and pins."""
    stand_ins = json.dumps({k: v for k, v in services.items() if k != "upstream"}, sort_keys=True)
    recipes = os.environ.get("RIGFORGE_RECIPES", "")
    extra = "\n".join([deploy.name, tarball_path(testbed_dir).name, stand_ins, recipes])
    return hash_tree(*(CHECKOUT / name for name in KEYED), extra=extra)


def converged_image(testbed_dir: Path, deploy: Path = CHECKOUT / "deploy" / "dual_turbo.py") -> RigImage:
    """The image of one default rig converged by `deploy` on `testbed_dir`'s stand-ins (started if they are not).
    Made once per key and kept; making it brings up a fleet of one chroot rig, converges it twice (the second run
    must change nothing), stops its sshd and packs its root file system."""
    testbed_dir = Path(testbed_dir)
    with open(ensure_safe_dir(testbed_dir / "run") / "up.lock", "w") as up_lock:  # as `up` starts them
        fcntl.flock(up_lock, fcntl.LOCK_EX)
        services = start_services(testbed_dir)
    images = ensure_safe_dir(testbed_dir / "images")
    name = f"converged-{deploy.stem}-{image_key(testbed_dir, deploy, services)}"
    tarball, meta = images / f"{name}.tar", images / f"{name}.json"
    with locked(images, "converged"):
        if not meta.exists():
            _make(testbed_dir, deploy, tarball, meta)
    recorded = json.loads(meta.read_text())
    return RigImage(tarball, RigSpec(**recorded["spec"]), recorded["docker_source"], recorded["deploy"])


def _make(testbed_dir: Path, deploy: Path, tarball: Path, meta: Path) -> None:
    t0 = time.monotonic()
    spec = RigSpec()
    # one name, under the images' lock: a build cut short (a killed session) leaves a fleet the next build replaces
    fleet = ensure_safe_dir(testbed_dir / "fleets" / "converged-image-build")
    try:
        tb = up(fleet, [spec], fresh=True, shared=testbed_dir, docker_source=DOCKER_SOURCE)
        for run in ("first", "second"):
            changes = _converge(tb.inventory, deploy)
            if run == "second" and changes:
                raise TestbedError(f"converged image: a second run of {deploy.name} still changed {changes}")
        rig = tb.rigs[0]
        stop_pidfile(rig.dir / "sshd.pid")  # nothing runs in the rig while it is packed
        part = tarball.with_suffix(f".part.{os.getpid()}")
        sh(["tar", "-C", str(rig.rootfs), "--numeric-owner", "--xattrs", "-cf", str(part), "."])
        part.rename(tarball)
    finally:
        down(fleet)
        sh(["rm", "-rf", "--one-file-system", str(fleet)])
    for old in [*tarball.parent.glob(f"converged-{deploy.stem}-*")]:
        if old.stem != tarball.stem:
            old.unlink()
    recorded = {"spec": asdict(spec), "docker_source": DOCKER_SOURCE, "deploy": str(deploy.relative_to(CHECKOUT))}
    meta.write_text(json.dumps(recorded, indent=1) + "\n")
    size = tarball.stat().st_size >> 20
    log(f"converged image {tarball.name} ({size} MiB) made in {time.monotonic() - t0:.0f}s")


def _converge(inventory: Path, deploy: Path) -> list[str]:
    """Run `pyinfra -y --json INVENTORY DEPLOY` from the checkout; the names of the operations that changed
    something. A failed run is an error with the tail of its log."""
    pyinfra = str(Path(sys.executable).with_name("pyinfra"))
    proc = subprocess.run(
        [pyinfra, "-y", "--json", str(inventory), str(deploy)], cwd=CHECKOUT, capture_output=True, text=True
    )
    try:
        results = json.loads(proc.stdout)["results"]
    except (ValueError, KeyError, TypeError):
        results = None
    if proc.returncode != 0 or not results or results.get("failed_hosts"):
        raise TestbedError(f"converged image: {deploy.name} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return [op["name"] for op in results.get("operations", []) if op["success"]]
