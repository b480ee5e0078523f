"""`rigforge testbed up|down`: simulated rigs for trying rigforge without a rig (and for CI)."""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from rigforge.model import recipes
from rigforge.model.pins import CUDA

from . import upstream
from ._util import TestbedError
from .booted import REGISTRY_PORT
from .core import DEFAULT_DIR, down, load, load_rig, up
from .rig import RigSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(
        dest="testbed_command", required=True, metavar="{up,down,reboot,upstream-throttle,upstream-delete}"
    )
    p_up = sub.add_parser("up", help="build or reuse simulated rigs; prints the pyinfra inventory path")
    p_up.add_argument("--rigs", type=int, default=1, help="number of rigs (rig1..rigN, default 1)")
    p_up.add_argument("--gpus", type=int, default=2, help="simulated GPUs per rig, chroot or booted (default 2)")
    p_up.add_argument(
        "--gpu-links",
        default="",
        help="the simulated `nvidia-smi topo -m` cells of GPU pairs, e.g. 0-1=NV4,2-3=NV4 (default: every pair PHB)",
    )
    p_up.add_argument("--gpu-name", default=RigSpec.gpu_name, help=f"GPU name (default {RigSpec.gpu_name!r})")
    p_up.add_argument("--vram-mib", type=int, default=24576, help="VRAM per GPU in MiB (default 24576)")
    p_up.add_argument(
        "--pci-device",
        default=RigSpec.pci_device,
        help=f"PCI device ID of the cards, as sysfs shows it before a driver (default {RigSpec.pci_device}: RTX 3090)",
    )
    p_up.add_argument("--power-min", type=int, default=100, help="minimum power limit in W (default 100)")
    p_up.add_argument("--power-default", type=int, default=None, help="default power limit in W (default: max)")
    p_up.add_argument("--power-max", type=int, default=350, help="maximum power limit in W (default 350)")
    p_up.add_argument(
        "--preset",
        choices=["handmade", "unowned"],
        default="",
        help="set the rigs up as by hand first: handmade (Docker's docker.list + docker.io, the toolkit's .list) "
        "or unowned (a running driver no package owns, as from NVIDIA's .run installer)",
    )
    p_up.add_argument(
        "--image-cuda",
        default=RigSpec.image_cuda,
        help=f"CUDA version the stand-in images carry, in the testbed lock (default {RigSpec.image_cuda})",
    )
    p_up.add_argument(
        "--docker-source",
        choices=["docker", "distro"],
        default="docker",
        help="the rigs' docker_source: docker (rigforge's default, Docker's repository: the testbed's stand-in of "
        "it) or distro (Debian's docker.io)",
    )
    p_up.add_argument(
        "--variant",
        metavar="VARIANT",
        help="every rig's rigforge_variant in the inventory, e.g. vllm/dual (what `rigforge rollout` moves); "
        "default: none, the deploy file's own",
    )
    p_up.add_argument("--fresh", action="store_true", help="recreate the rigs' root file systems")
    p_up.add_argument(
        "--booted",
        action="store_true",
        help="boot each rig's own systemd with a real Docker engine (systemd-nspawn; services are managed)",
    )
    p_up.add_argument(
        "--gateway",
        action="store_true",
        help="with --booted: one more booted host, gw, in the inventory group `gateway` (the fleet gateway)",
    )
    p_up.add_argument(
        "--fleet-registry",
        action="store_true",
        help="with --booted: the gateway host (or rig1 without --gateway) serves the fleet registry too (group "
        "`registry`, docs/registry.md), at one address on this machine and every host",
    )
    p_up.add_argument(
        "--monitor",
        action="store_true",
        help="with --gateway: the gateway host is the monitor too (group `monitor`, Prometheus, docs/monitoring.md), "
        "published on this machine",
    )
    p_up.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"testbed directory (default {DEFAULT_DIR})")
    p_down = sub.add_parser("down", help="stop the rigs' sshds and the local services, remove the rigs")
    p_down.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"testbed directory (default {DEFAULT_DIR})")
    p_down.add_argument(
        "--purge",
        action="store_true",
        help="also delete the cache (rootfs tarball, repos), the services' state, the upstream stand-in, the fleet CA",
    )
    p_reboot = sub.add_parser("reboot", help="reboot a rig: power off and boot (a chroot rig forgets its GPU state)")
    p_reboot.add_argument("rig", help="the rig's name, e.g. rig1")
    p_reboot.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"testbed directory (default {DEFAULT_DIR})")
    p_thr = sub.add_parser(
        "upstream-throttle",
        help="throttle what each booted host receives from the upstream registry stand-in (bytes/s, 0 = off)",
    )
    p_thr.add_argument("bytes_per_second", type=int, help="bytes per second per host; 0 turns the throttle off")
    p_thr.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"testbed directory (default {DEFAULT_DIR})")
    p_del = sub.add_parser("upstream-delete", help="delete an image (tag or digest) from the upstream stand-in")
    p_del.add_argument("ref", help="e.g. vllm/vllm-openai:TAG or vllm/vllm-openai@sha256:...")
    p_del.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"testbed directory (default {DEFAULT_DIR})")


def _check(args: argparse.Namespace) -> str | None:
    if args.rigs < 1 or args.rigs > 50:
        return f"--rigs must be between 1 and 50, got {args.rigs}"
    if args.gpus < 0 or args.gpus > 16:
        return f"--gpus must be between 0 and 16, got {args.gpus}"
    pair = r"(\d+)-(\d+)=(NV\d+|PIX|PXB|PHB|NODE|SYS)"
    if args.gpu_links and not re.fullmatch(rf"{pair}(,{pair})*", args.gpu_links):
        kinds = "NV#, PIX, PXB, PHB, NODE, SYS"
        return f"--gpu-links must be pairs such as 0-1=NV4,2-3=NODE ({kinds}), got {args.gpu_links!r}"
    for a, b in re.findall(r"(\d+)-(\d+)=", args.gpu_links):
        if not int(a) < int(b) < args.gpus:
            return f"--gpu-links names GPU pair {a}-{b}; pairs are i-j with i < j < --gpus ({args.gpus})"
    if not re.fullmatch(r"[0-9a-f]{4}", args.pci_device):
        return f"--pci-device must be 4 lower-case hex digits such as 2204, got {args.pci_device!r}"
    if not CUDA.match(args.image_cuda):
        return f"--image-cuda must be a CUDA version such as 13.0, got {args.image_cuda!r}"
    if args.vram_mib < 1024:
        return f"--vram-mib must be at least 1024, got {args.vram_mib}"
    default = args.power_default if args.power_default is not None else args.power_max
    if not 0 < args.power_min <= default <= args.power_max:
        return (
            f"power limits must satisfy 0 < min <= default <= max, got min {args.power_min} W, "
            f"default {default} W, max {args.power_max} W"
        )
    return None


def run(args: argparse.Namespace) -> int:
    try:
        if args.testbed_command == "down":
            down(args.dir, purge=args.purge)
            return 0
        if args.testbed_command == "reboot":
            return reboot(args.dir, args.rig)
        if args.testbed_command == "upstream-throttle":
            path = upstream.set_throttle(args.dir, args.bytes_per_second)
            rate = f"{args.bytes_per_second} bytes/s per host" if args.bytes_per_second else "off"
            print(f"upstream throttle: {rate} ({path})", file=sys.stderr)
            return 0
        if args.testbed_command == "upstream-delete":
            return upstream_delete(args.dir, args.ref)
        error = _check(args)
        if error:
            print(f"rigforge testbed up: {error}", file=sys.stderr)
            return 2
        spec = RigSpec(
            gpus=args.gpus,
            gpu_name=args.gpu_name,
            vram_mib=args.vram_mib,
            power_min=args.power_min,
            power_default=args.power_default if args.power_default is not None else args.power_max,
            power_max=args.power_max,
            preset=args.preset,
            pci_device=args.pci_device,
            image_cuda=args.image_cuda,
            links=args.gpu_links,
        )
        t0 = time.monotonic()
        tb = up(
            args.dir,
            [spec] * args.rigs,
            fresh=args.fresh,
            booted=args.booted,
            gateway=args.gateway,
            fleet_registry=args.fleet_registry,
            monitor=args.monitor,
            docker_source=args.docker_source,
            variant=args.variant,
        )
        print(f"testbed up: {len(tb.rigs)} rig(s) in {time.monotonic() - t0:.1f}s", file=sys.stderr)
        for rig in tb.rigs:
            print(f"  {rig.name}: ssh -F {tb.ssh_config} {rig.name}   (127.0.0.1:{rig.ssh_port})", file=sys.stderr)
            if getattr(rig, "booted", False):
                print(f"  {rig.name}: api http://{rig.api_address}:PORT (the rig's own serving port)", file=sys.stderr)
        tags = tb.services["git"].get("recipes", {}).get("tags")
        if tags:  # the recipe repo's commits, to rehearse a bump (rigforge lock --recipes B)
            print("recipe commits: " + " ".join(f"{tag}={sha}" for tag, sha in tags.items()), file=sys.stderr)
            cached = recipes.cache_dir(tags["A"])
            print(
                f"recipe commit A (the lock's) cached for this controller at {cached}: deploys read it there, "
                "RIGFORGE_RECIPES is no longer needed",
                file=sys.stderr,
            )
        print(f"stand-ins for `rigforge lock` (docs/rollout.md): . {tb.env_file}", file=sys.stderr)
        for name, (value, what) in tb.stand_in_env.items():
            print(f"  {name}={value}   ({what})", file=sys.stderr)
        if "upstream" in tb.services:
            print(f"upstream registry: {tb.upstream_url} (registry-1.docker.io in booted hosts)", file=sys.stderr)
            print(f"upstream registry log: {tb.upstream_log}", file=sys.stderr)
        if tb.registry_host:
            where = f"{tb.registry_address}:{REGISTRY_PORT}"
            print(
                f"fleet registry: https://{where} on {tb.registry_host.name} (same address here and on every host)",
                file=sys.stderr,
            )
        if tb.gateway:
            print(f"gateway: {tb.gateway_url}   (ssh -F {tb.ssh_config} {tb.gateway.name})", file=sys.stderr)
        if tb.prometheus_url:
            print(f"prometheus: {tb.prometheus_url}   (the monitor, on {tb.gateway.name})", file=sys.stderr)
        print(tb.inventory)
        return 0
    except TestbedError as exc:
        print(f"rigforge testbed {args.testbed_command}: {exc}", file=sys.stderr)
        return 1


def reboot(dir: Path, name: str) -> int:
    """Reboot one rig of the testbed in `dir`: a booted rig powers off and boots (its units run again); a chroot
    rig, where nothing runs at boot, forgets the GPUs' runtime state as a reboot would."""
    if not (dir / "rigs" / name / "rig.json").exists():
        print(
            f"rigforge testbed reboot: no rig {name!r} in {dir} (bring it up with: rigforge testbed up)",
            file=sys.stderr,
        )
        return 1
    rig = load_rig(dir / "rigs" / name)
    t0 = time.monotonic()
    rig.simulate_reboot()
    kind = "booted" if getattr(rig, "booted", False) else "chroot (GPU state reset; nothing runs at boot)"
    print(f"testbed reboot: {name} ({kind}) in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return 0


def upstream_delete(dir: Path, ref: str) -> int:
    """Delete `ref` from the upstream stand-in of the testbed in `dir` (tag -> digest -> DELETE manifest)."""
    try:
        tb = load(dir)
        digest = tb.upstream_delete(ref)
    except (OSError, KeyError) as exc:
        print(f"rigforge testbed upstream-delete: no booted testbed in {dir} ({exc})", file=sys.stderr)
        return 1
    if digest is None:
        print(f"rigforge testbed upstream-delete: {ref} is not in the upstream stand-in", file=sys.stderr)
        return 1
    print(f"upstream-delete: deleted {ref} ({digest}) from {tb.upstream_url}")
    return 0
