"""A testbed rig as tests and the testbed's modules see it: its simulated hardware (`RigSpec`), where it lives and
how to reach it (`Rig`), the SSH user every rig has, and the images its rigs serve (`IMAGE_REF`, the testbed
lock's pin, and the recipe slugs' images)."""

from __future__ import annotations

import hashlib
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ._util import chroot_env, sh
from .content import recipes_dir

USER = "rigadmin"
IMAGE_REF = "vllm/vllm-openai:nightly-7a1eb8ac2ec4ea69338c51dc7afd4b15010abfa8"


@dataclass(frozen=True)
class RigSpec:
    """Simulated hardware of one rig (what the stub nvidia-smi reports)."""

    gpus: int = 2
    gpu_name: str = "NVIDIA GeForce RTX 3090"
    vram_mib: int = 24576
    power_min: int = 100
    power_default: int = 350
    power_max: int = 350
    pci_device: str = "2204"  # PCI device ID of every card (10de:2204 = RTX 3090), what sysfs shows before a driver
    preset: str = ""  # "", "handmade" or "unowned": how the rig was set up before rigforge (testbed/presets.py)
    image_cuda: str = "13.0"  # the CUDA version the stand-in images carry (the testbed lock's `cuda`, their env)
    # the `nvidia-smi topo -m` cell of GPU pairs, "0-1=NV4,2-3=NV4" (text: rig.json keeps the spec as JSON); a pair
    # not named is PHB (one host bridge)
    links: str = ""

    def gpus_json(self, seed: str) -> dict:
        gpus = []
        for i in range(self.gpus):
            h = hashlib.sha256(f"{seed}/{i}".encode()).hexdigest()
            uuid = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
            gpus.append(
                {
                    "name": self.gpu_name,
                    "uuid": uuid,
                    "pci_bus_id": f"00000000:{i + 1:02X}:00.0",
                    "memory_total_mib": self.vram_mib,
                    "power_min_w": self.power_min,
                    "power_default_w": self.power_default,
                    "power_max_w": self.power_max,
                    "compute_cap": "8.6",
                }
            )
        links = dict(pair.split("=", 1) for pair in self.links.split(",") if pair)
        return {"gpus": gpus, **({"links": links} if links else {})}


@dataclass(frozen=True)
class RigImage:
    """A converged rig's packed root file system and what it was made as."""

    tarball: Path
    spec: RigSpec  # the rig it was made from: a rig brought up from the image has this spec
    docker_source: str  # the host data it was converged with
    deploy: str  # the deploy file that converged it, relative to the checkout


@dataclass
class Rig:
    name: str
    ssh_port: int
    rootfs: Path
    user: str
    key: Path
    dir: Path
    spec: RigSpec = field(default_factory=RigSpec)

    def simulate_reboot(self) -> None:
        """Forget the GPUs' runtime state, as a reboot does: power limits back to default, persistence off.
        (Nothing runs at boot in a chroot: a test runs the boot unit's command itself afterwards.)"""
        (self.rootfs / "var/lib/rigforge-sim/state.json").unlink(missing_ok=True)

    def run(self, cmd: str, check: bool = False) -> subprocess.CompletedProcess:
        """Run a shell command inside the rig's root file system (chroot on the controller, as root)."""
        return subprocess.run(
            ["chroot", str(self.rootfs), "/bin/sh", "-c", cmd],
            env=chroot_env(),
            capture_output=True,
            text=True,
            check=check,
        )


def make_keys(rig_dir: Path) -> None:
    """The rig's SSH host key and the key the controller logs in with, in `rig_dir`, made once (kept across rebuilds
    of its root file system, so known_hosts and the inventory stay valid)."""
    for key in ("ssh_host_ed25519_key", "id_ed25519"):
        if not (rig_dir / key).exists():
            comment = f"rigforge-testbed-{rig_dir.name}"
            sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(rig_dir / key)])


def api_address(ssh_port: int) -> str:
    """Where a booted rig's API ports are published on the controller: a loopback address of its own (all of
    127/8 is local on Linux), derived from its SSH port, which is unique on this machine. The ports keep their
    numbers: rig1's vLLM on port 8011 is http://<api_address>:8011."""
    return f"127.1.{ssh_port >> 8}.{ssh_port & 255}"


def api_ports() -> list[int]:
    """The serving ports a rig may use: every catalog variant's, and every recipe slug's RIGFORGE_RECIPES serves."""
    from rigforge.model.catalog import load_catalog

    ports = {v.port for v in load_catalog().variants.values()}
    if recipes_dir():
        from rigforge.model.recipes import parse_repo

        ports |= {r.port for r in parse_repo(recipes_dir()).recipes.values() if not r.refused}
    return sorted(ports)


def recipe_images() -> dict[str, str]:
    """{engine: image ref} the recipe slugs of RIGFORGE_RECIPES run, by tag ({} when it is unset)."""
    if not recipes_dir():
        return {}
    from rigforge.model.recipes import parse_repo

    repo = parse_repo(recipes_dir())
    return {r.engine: r.image for r in repo.recipes.values() if not r.refused and "@" not in r.image}
