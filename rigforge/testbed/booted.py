"""Booted rigs (`rigforge testbed up --booted`): the rig's own systemd and a real Docker engine.

A booted rig is the chroot rig's Debian 13 root file system booted with `systemd-nspawn -b` in its own network
namespace (see netns.py), with openssh-server, docker.io and docker-compose pre-installed (the Docker role then
finds them and only merges daemon.json). The differences from a real rig are testbed plumbing, named here:
  - rigforge-testbed-cgroups.service remounts the cgroup v1 controllers writable before docker.service (nspawn
    gives them read-only); daemon.json starts with {"storage-driver": "vfs"} (no overlayfs inside nspawn);
    dockerd may leave IPv6 on in containers (DOCKER_DROPIN: nspawn's /proc/sys is read-only);
    systemd-modules-load is masked (no kernel modules to load in a container).
  - /sys/bus/pci/devices lists the simulated GPUs (vendor 0x10de, class 0x0300). /sys/module is a directory of
    the rig on the controller: the stub driver "loads" its module there, and it stays loaded across reboots.
    /var/lib/rigforge-sim is a tmpfs, so the simulated GPUs forget power limits and persistence mode at every
    boot, as real ones do.
  - The rig reaches the controller's apt / git / HF stand-ins (same 127.0.0.1 ports), the Debian mirror
    (/etc/hosts) and pip's index (/etc/pip.conf proxy) only through the relay; pyinfra reaches the rig's sshd
    on the controller's 127.0.0.1:<ssh port>, relayed to the same port inside the rig.
  - The testbed's booted hosts (rigs and the gateway host) share a LAN: a bridge in a namespace of the testbed's
    own, a veth per host (join_lan); the rig's rigforge-testbed-link.service takes its end down at power-off.
  - The serving image is pulled, as on a real rig, from the upstream registry stand-in (upstream.py) that
    plays Docker Hub and ghcr.io: /etc/hosts maps both to upstream.RIG_ADDRESS, where the relay listens on
    port 443, and the testbed CA is in the system trust store. It holds a stand-in (imagebuild.py: bash,
    python3 and rigforge's OpenAI stub behind a `vllm serve` stand-in, image/vllm) under the pinned name:tag,
    plus a second tag whose server exits at start (BROKEN_IMAGE). Nothing is pre-loaded into a rig. The stub
    toolkit's nvidia-container-runtime-hook lets dockerd accept the compose file's NVIDIA GPU reservation.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import rigforge.testbed.upstream as upstream

from ._util import (
    TestbedError,
    chroot_env,
    free_port,
    in_chroot,
    log,
    pid_alive,
    ports_claimed,
    sh,
    spawn,
    stop_pidfile,
    wait_listener,
)
from .rig import USER, Rig, RigSpec, api_address, api_ports, make_keys
from .rootfs import PREFETCH_NO_RECOMMENDS, copy_host_network_config, extract, locked, pack, prepare_rig

BOOTED_PACKAGES = ["openssh-server", "docker.io", "docker-cli", "docker-compose", "iproute2"]
BOOTED_RECIPE = "2"
NETNS_SCRIPT = Path(__file__).with_name("netns.py")
BROKEN_IMAGE = "vllm/vllm-openai:rigforge-testbed-exits-at-start"
BROKEN_MESSAGE = "testbed image made to exit at start (no model loaded)"
MIRROR_HOST = "deb.debian.org"
RIG_SSH_PORT = 22  # the rig's sshd, inside its own namespace
PROXY_PORT = 3128  # the relay's HTTPS proxy inside the rig (pip reaches its index through it)
CGROUPS_UNIT = """[Unit]
Description=rigforge testbed: writable cgroup v1 controllers for dockerd inside systemd-nspawn
DefaultDependencies=no
Before=containerd.service docker.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -c 'for c in pids freezer blkio cpuset cpuacct devices memory cpu; do \
if mountpoint -q /sys/fs/cgroup/$c; then mount -t cgroup -o rw,nosuid,nodev,noexec,$c cgroup /sys/fs/cgroup/$c; fi; \
done'

[Install]
WantedBy=sysinit.target
"""


LINK_UNIT = """[Unit]
Description=rigforge testbed: this host's link to the testbed LAN (eth0), up while the host runs
Before=network.target
Wants=network.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=ip link set eth0 up
ExecStop=ip link set eth0 down

[Install]
WantedBy=multi-user.target
"""


DOCKER_DROPIN = """[Service]
# rigforge testbed: /proc/sys is read-only inside systemd-nspawn, so dockerd cannot turn IPv6 off on a
# container's eth0; let it go on (the rig's network namespace has no IPv6 route anyway)
Environment=DOCKER_ALLOW_IPV6_ON_IPV4_INTERFACE=1
"""


def _key(base: Path) -> str:
    recipe = ",".join([BOOTED_RECIPE, base.name, *BOOTED_PACKAGES, CGROUPS_UNIT, DOCKER_DROPIN])
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def booted_tarball(shared: Path, base: Path) -> Path:
    """The booted rigs' rootfs tarball (cached): the base tarball plus sshd and Docker, set up to boot."""
    tarball = base.with_name(f"rootfs-booted-{_key(base)}.tar")
    if tarball.exists():
        return tarball
    cache = base.parent
    with locked(cache, "booted"):
        if tarball.exists():
            return tarball
        t0 = time.monotonic()
        build = cache / f"booted.build.{os.getpid()}"
        extract(base, build)
        copy_host_network_config(build)
        in_chroot(
            build,
            "apt-get install -y -qq --no-install-recommends " + " ".join(BOOTED_PACKAGES) + " && apt-get clean && "
            # kept: what every rig's metrics role installs, so no converge downloads it again
            "apt-get install -y -qq --download-only --no-install-recommends " + " ".join(PREFETCH_NO_RECOMMENDS),
            capture=True,
        )
        (build / "usr/sbin/policy-rc.d").unlink()  # a booted rig has an init: packages may start services
        (build / "etc/resolv.conf").write_text("")
        units = build / "etc/systemd/system"
        (units / "rigforge-testbed-cgroups.service").write_text(CGROUPS_UNIT)
        (units / "sysinit.target.wants").mkdir(exist_ok=True)
        (units / "sysinit.target.wants/rigforge-testbed-cgroups.service").symlink_to(
            "/etc/systemd/system/rigforge-testbed-cgroups.service"
        )
        (units / "systemd-modules-load.service").symlink_to("/dev/null")
        (units / "docker.service.d").mkdir(exist_ok=True)
        (units / "docker.service.d/rigforge-testbed.conf").write_text(DOCKER_DROPIN)
        (build / "etc/docker").mkdir(exist_ok=True)
        (build / "etc/docker/daemon.json").write_text('{\n  "storage-driver": "vfs"\n}\n')
        pack(build, tarball, replaces="rootfs-booted-*.tar")
        log(f"booted rootfs tarball {tarball.name} built in {time.monotonic() - t0:.0f}s")
    return tarball


# --- boot, reach, stop -------------------------------------------------------------------------------------


def netns_name(rig_dir: Path) -> str:
    return "rigforge-" + hashlib.sha256(str(rig_dir.resolve()).encode()).hexdigest()[:10]


def netns_path(rig_dir: Path) -> str:
    return f"/run/netns/{netns_name(rig_dir)}"


def _ensure_netns(rig_dir: Path) -> None:
    name = netns_name(rig_dir)
    if not Path(netns_path(rig_dir)).exists():
        sh(["ip", "netns", "add", name], capture=True)
    sh(["ip", "-n", name, "link", "set", "lo", "up"], capture=True)
    # dockerd wants forwarding on and cannot set it itself (nspawn mounts /proc/sys read-only)
    sh(["ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv4.ip_forward=1"], capture=True)
    join_lan(rig_dir)


# --- the LAN between a testbed's booted hosts ----------------------------------------------------------------

LAN_PREFIX = "10.77.0"  # the LAN's /24 (docker's default address pools are 172.17-31.x and 192.168.x)
LAN_DEV = "eth0"  # each host's end of its veth pair


def lan_name(dir: Path) -> str:
    """The network namespace holding the LAN's bridge: one per testbed directory (a host's is rigs/<name>/../..)."""
    return "rigforge-lan-" + hashlib.sha256(str(dir.resolve()).encode()).hexdigest()[:10]


def lan_address(rig_dir: Path) -> str:
    """The host's address on the testbed's LAN: rigN at .N, the gateway host gw at .254."""
    name = rig_dir.name
    if name == "gw":
        return f"{LAN_PREFIX}.254"
    if not (name.startswith("rig") and name[3:].isdigit() and 0 < int(name[3:]) < 254):
        raise TestbedError(f"no LAN address for a host named {name!r} (rig1..rig253 or gw)")
    return f"{LAN_PREFIX}.{int(name[3:])}"


def join_lan(rig_dir: Path) -> None:
    """Plug the host into the testbed's LAN (idempotent): a bridge `br0` in the LAN's own namespace, a veth pair
    per host (its `eth0` in the host's namespace, the other end on the bridge), the host's address on eth0, link up.
    A closed port on a host refuses, and a host whose link is down does not answer, as on a real LAN."""
    lan, rig = lan_name(rig_dir.parent.parent), netns_name(rig_dir)
    # hosts boot in parallel: one makes the LAN while the others wait (`ip netns add` makes the name before the
    # namespace is mounted, so "exists" does not mean ready; CI saw "Cannot find device br0")
    Path("/run/lock").mkdir(parents=True, exist_ok=True)
    with open(f"/run/lock/{lan}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not Path(f"/run/netns/{lan}").exists():
            sh(["ip", "netns", "add", lan], capture=True)
        if sh(["ip", "-n", lan, "link", "show", "br0"], check=False, capture=True).returncode != 0:
            sh(["ip", "-n", lan, "link", "add", "br0", "type", "bridge"], capture=True)
        sh(["ip", "-n", lan, "link", "set", "br0", "up"], capture=True)
    port = "v" + rig.removeprefix("rigforge-")  # the bridge port of this host (15 characters at most)
    if sh(["ip", "-n", rig, "link", "show", LAN_DEV], check=False, capture=True).returncode != 0:
        sh(["ip", "-n", lan, "link", "add", port, "type", "veth", "peer", "name", LAN_DEV, "netns", rig], capture=True)
    plugged = not (rig_dir / CABLE_OUT).exists()  # a cable pulled (set_cable) stays out across boots
    sh(["ip", "-n", lan, "link", "set", port, "master", "br0", "up" if plugged else "down"], capture=True)
    sh(["ip", "-n", rig, "addr", "replace", f"{lan_address(rig_dir)}/24", "dev", LAN_DEV], capture=True)
    set_link(rig_dir, up=True)


CABLE_OUT = "cable-out"  # in a host's directory while its LAN cable is pulled


def set_cable(rig_dir: Path, plugged: bool) -> None:
    """Pull the host's LAN cable out or plug it back in: its port on the LAN's bridge (the other end of its veth)
    down or up. Pulled, the host's eth0 loses its carrier and nothing passes either way, whatever the host does
    with its own link; it stays pulled across the host's reboots until plugged again. The testbed's relay (ssh,
    the stand-ins) does not cross the LAN: the controller still reaches the host."""
    lan, port = lan_name(rig_dir.parent.parent), "v" + netns_name(rig_dir).removeprefix("rigforge-")
    if plugged:
        (rig_dir / CABLE_OUT).unlink(missing_ok=True)
    else:
        (rig_dir / CABLE_OUT).write_text("pulled\n")
    sh(["ip", "-n", lan, "link", "set", port, "up" if plugged else "down"], capture=True)


def set_link(rig_dir: Path, up: bool) -> None:
    """The host's LAN link up or down (down: the host answers nothing on the LAN, as one powered off)."""
    sh(["ip", "-n", netns_name(rig_dir), "link", "set", LAN_DEV, "up" if up else "down"], check=False, capture=True)


def remove_lan(dir: Path) -> None:
    """Remove the LAN namespace of testbed directory `dir` (its hosts' veth ends go with their namespaces)."""
    name = lan_name(dir)
    if Path(f"/run/netns/{name}").exists():
        sh(["ip", "netns", "delete", name], check=False, capture=True)


def init_pid(rig_dir: Path) -> int | None:
    """PID (on the controller) of the rig's systemd, or None when the rig is not running."""
    nspawn = pid_alive(rig_dir / "nspawn.pid")
    if not nspawn:
        return None
    try:
        children = Path(f"/proc/{nspawn}/task/{nspawn}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def enter(
    rig_dir: Path, cmd: str, *, check: bool = False, input: bytes | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run a shell command in the booted rig (all its namespaces, as root)."""
    pid = init_pid(rig_dir)
    if not pid:
        raise TestbedError(f"booted rig {rig_dir.name} is not running (see {rig_dir / 'nspawn.log'})")
    return subprocess.run(
        ["nsenter", "-t", str(pid), "-a", "/bin/sh", "-c", cmd],
        env=chroot_env(),
        capture_output=True,
        input=input,
        text=input is None,
        check=check,
        timeout=timeout,
    )


def boot(rig_dir: Path, timeout: float = 120) -> float:
    """Start the rig's systemd and wait until it reports running; return the seconds it took."""
    t0 = time.monotonic()
    _ensure_netns(rig_dir)
    sim_module = rig_dir / "sim-sys-module"
    sim_module.mkdir(exist_ok=True)
    cmd = [
        "systemd-nspawn",
        "--register=no",
        "--keep-unit",
        "--quiet",
        f"--machine={netns_name(rig_dir)}",
        "-D",
        str(rig_dir / "rootfs"),
        "-b",
        "--console=passive",
        "--capability=all",
        "--system-call-filter=@keyring @mount bpf",
        f"--network-namespace-path={netns_path(rig_dir)}",
        "--tmpfs=/var/lib/rigforge-sim",
        f"--bind={sim_module}:/sys/module",
        f"--bind-ro={rig_dir / 'sim-pci'}:/sys/bus/pci/devices",
    ]
    spawn([*_own_cgroup(rig_dir), *cmd], rig_dir / "nspawn.pid", rig_dir / "nspawn.log")
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        if not pid_alive(rig_dir / "nspawn.pid"):
            tail = (rig_dir / "nspawn.log").read_text()[-2000:]
            raise TestbedError(f"systemd-nspawn of {rig_dir.name} exited:\n{tail}")
        try:
            res = enter(rig_dir, "systemctl is-system-running", timeout=30)
        except TestbedError:
            # nspawn's outer child hands over to the container's init: for a moment the rig has no init to enter
            res = None
        state = res.stdout.strip() if res else ""
        if state in ("running", "degraded"):
            break
        time.sleep(0.5)
    failed = enter(rig_dir, "systemctl --failed --no-legend --plain", timeout=30).stdout if state else ""
    units = [line.split()[0] for line in failed.splitlines() if line.strip()]
    if state == "degraded" and units and all(_irrelevant(unit) for unit in units):
        # seen here now and then under load: the container's own housekeeping failed, nothing a rig needs
        log(f"{rig_dir.name}: booted degraded by {', '.join(units)} (container housekeeping): reset, carrying on")
        enter(rig_dir, "systemctl reset-failed", timeout=30)
        state = "running"
    if state != "running":
        raise TestbedError(f"booted rig {rig_dir.name}: systemd is {state or 'not up'} after {timeout:.0f}s\n{failed}")
    return time.monotonic() - t0


# where systemd tracks processes on a cgroup v1 or hybrid controller: the name=systemd hierarchy, and the unified
# one (a hybrid systemd, nspawn too, takes its own cgroup from there)
CGROUP_TRACKERS = (Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"))


def rig_cgroups(rig_dir: Path) -> list[Path]:
    return [top / "rigforge" / netns_name(rig_dir) for top in CGROUP_TRACKERS if (top / "cgroup.procs").exists()]


def _own_cgroup(rig_dir: Path) -> list[str]:
    """A prefix that starts systemd-nspawn in a cgroup of the rig's own. nspawn puts the container's systemd in
    `payload` under its own cgroup: started from one controller process, every rig had the same /payload, so one
    rig's systemd removed the cgroup of a unit another rig was starting under the same name ("Failed to spawn
    executor: No such file or directory", result 'resources'; seen once each rig ran a 15 s timer)."""
    dirs = rig_cgroups(rig_dir)
    if not dirs:
        return []
    move = " && ".join(f'mkdir -p "{d}" && echo $$ > "{d}/cgroup.procs"' for d in dirs)
    return ["/bin/sh", "-c", f'{move} && exec "$@"', "nspawn"]


def _remove_cgroup(rig_dir: Path) -> None:
    """Remove the rig's cgroup tree once its processes are gone (cgroup dirs go bottom-up, with rmdir)."""
    for top in rig_cgroups(rig_dir):
        if top.is_dir():
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()


def _irrelevant(unit: str) -> bool:
    """Units whose failure inside a container says nothing about the rig: /etc/.updated bookkeeping
    (systemd-update-done), remounting / from an /etc/fstab with no entries (systemd-remount-fs), moving the journal
    to /var/log (systemd-journal-flush) and static device nodes in /dev (systemd-tmpfiles-setup-dev*, nspawn makes
    /dev), which time out under load, and loading kernel modules, which a container cannot do (modprobe@*)."""
    return unit in HOUSEKEEPING or unit.startswith("modprobe@")


HOUSEKEEPING = (
    "systemd-update-done.service",
    "systemd-remount-fs.service",
    "systemd-journal-flush.service",
    "systemd-tmpfiles-setup-dev-early.service",
    "systemd-tmpfiles-setup-dev.service",
)


def shutdown(rig_dir: Path, timeout: float = 60) -> None:
    """Power the rig off cleanly (nspawn forwards SIGTERM to systemd as a poweroff request); its LAN link is
    down afterwards (the rig's rigforge-testbed-link.service takes it down as it powers off; here again, in case
    it did not)."""
    pid = pid_alive(rig_dir / "nspawn.pid")
    if not pid:
        set_link(rig_dir, up=False)
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(rig_dir / "nspawn.pid") and time.monotonic() < deadline:
        time.sleep(0.1)
    stop_pidfile(rig_dir / "nspawn.pid")
    set_link(rig_dir, up=False)
    _remove_cgroup(rig_dir)  # a boot after this one starts from a clean cgroup of its own


def start_relay(rig_dir: Path, services: dict, ssh_port: int) -> int:
    """Start the rig's relay; return the controller port of its sshd (the next free one if `ssh_port` was taken
    meanwhile: other testbeds start sshds on this machine too)."""
    stop_pidfile(rig_dir / "relay.pid")
    forwards = [f"{p}=127.0.0.1:{p}" for p in (services["apt_port"], services["hf_port"], services["git_port"])]
    forwards += [f"80={MIRROR_HOST}:80", f"{PROXY_PORT}=CONNECT:0"]
    if "upstream" in services:  # Docker Hub's stand-in, at registry-1.docker.io's address in the rig, throttled
        up = services["upstream"]
        forwards.append(f"{upstream.RIG_ADDRESS}:443=127.0.0.1:{up['port']},throttle={up['throttle_file']}")
    with ports_claimed():  # held until the relay listens: no other testbed picks its ports meanwhile
        for _ in range(20):
            log_file = rig_dir / "relay.log"
            log_file.unlink(missing_ok=True)
            argv = [sys.executable, str(NETNS_SCRIPT), "serve", netns_path(rig_dir), f"in:{ssh_port}={RIG_SSH_PORT}"]
            api = [f"in:{api_address(ssh_port)}:{p}={p}" for p in api_ports()]
            spawn([*argv, *api, *forwards], rig_dir / "relay.pid", log_file)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                text = log_file.read_text() if log_file.exists() else ""
                if "relay for" in text:
                    return ssh_port
                if not pid_alive(rig_dir / "relay.pid"):
                    if "Address already in use" not in text:
                        raise TestbedError(f"relay of {rig_dir.name} failed:\n{text[-2000:]}")
                    ssh_port = free_port(ssh_port + 1, ssh_port + 300)
                    break
                time.sleep(0.05)
    raise TestbedError(f"relay of {rig_dir.name} did not start (see {rig_dir / 'relay.log'})")


def refresh_relay(rig_dir: Path, services: dict, ssh_port: int) -> int:
    """Restart a running rig's relay if it is gone or points at an upstream stand-in port that changed (the
    stand-in moved to another port while the rig ran); return the controller port of its sshd."""
    info_file = rig_dir / "rig.json"
    info = json.loads(info_file.read_text())
    want = services.get("upstream", {}).get("port")
    if info.get("upstream_port") == want and pid_alive(rig_dir / "relay.pid"):
        return ssh_port
    ssh_port = start_relay(rig_dir, services, ssh_port)
    info.update(port=ssh_port, upstream_port=want)
    info_file.write_text(json.dumps(info))
    log(f"{rig_dir.name}: relay restarted (upstream stand-in on port {want})")
    return ssh_port


GATEWAY_PORT = 8088  # the gateway's HAProxy inside its host (gateway_port)
MONITOR_PORT = 9090  # the monitor's Prometheus inside its host (Debian's default --web.listen-address)


def start_gateway_relay(gw_dir: Path, port: int, to: int = GATEWAY_PORT, name: str = "gateway-relay") -> int:
    """Publish the gateway host's HAProxy (or its port `to`) on the controller's 127.0.0.1:`port` (returned; the
    next free one if taken). The gateway host reaches the rigs over the testbed's LAN (join_lan), at their
    lan_address."""
    pidfile, log_file = gw_dir / f"{name}.pid", gw_dir / f"{name}.log"
    stop_pidfile(pidfile)
    port = free_port(port, port + 300)
    spawn([sys.executable, str(NETNS_SCRIPT), "serve", netns_path(gw_dir), f"in:{port}={to}"], pidfile, log_file)
    wait_listener(port, lambda: pid_alive(pidfile), f"the {name}", log_file)
    return port


REGISTRY_PORT = 5000  # the fleet registry's port (registry_port's default)


def registry_address(ssh_port: int) -> str:
    """The fleet registry's address (`up --fleet-registry`), the same on the controller and in every booted host:
    a loopback address of its own, derived from the registry host's SSH port (unique on this machine, so
    concurrent testbeds never share one). In the registry host it is its own loopback, where the registry
    listens; elsewhere a relay carries it to the registry host's network namespace."""
    return f"127.2.{ssh_port >> 8}.{ssh_port & 255}"


def _relay(rig_dir: Path, name: str, netns: str, specs: list[str]) -> None:
    pidfile, log_file = rig_dir / f"{name}.pid", rig_dir / f"{name}.log"
    stop_pidfile(pidfile)
    log_file.unlink(missing_ok=True)
    spawn([sys.executable, str(NETNS_SCRIPT), "serve", netns, *specs], pidfile, log_file)
    deadline = time.monotonic() + 10
    while "relay for" not in (log_file.read_text() if log_file.exists() else ""):
        if not pid_alive(pidfile) or time.monotonic() > deadline:
            tail = log_file.read_text()[-2000:] if log_file.exists() else ""
            raise TestbedError(f"the {name} of {rig_dir.name} did not start (see {log_file}):\n{tail}")
        time.sleep(0.05)


def start_registry_relay(rig_dir: Path, registry_dir: Path, address: str) -> None:
    """The fleet registry at `address`:REGISTRY_PORT inside the rig, relayed to the registry host's namespace."""
    spec = f"at:{address}:{REGISTRY_PORT}={netns_path(registry_dir)}@{REGISTRY_PORT}"
    _relay(rig_dir, "registry-relay", netns_path(rig_dir), [spec])


def publish_registry(registry_dir: Path, address: str) -> None:
    """The fleet registry at `address`:REGISTRY_PORT on the controller too (rigforge's preflight asks it from
    there), relayed into the registry host's namespace."""
    _relay(
        registry_dir, "registry-publish", netns_path(registry_dir), [f"in:{address}:{REGISTRY_PORT}={REGISTRY_PORT}"]
    )


def stop(rig_dir: Path) -> None:
    """Stop a booted rig and its relays, remove its network namespace (no-op for a chroot rig)."""
    shutdown(rig_dir)
    stop_pidfile(rig_dir / "relay.pid")
    stop_pidfile(rig_dir / "gateway-relay.pid")
    stop_pidfile(rig_dir / "registry-relay.pid")
    stop_pidfile(rig_dir / "prometheus-relay.pid")
    stop_pidfile(rig_dir / "registry-publish.pid")
    if Path(netns_path(rig_dir)).exists():
        sh(["ip", "netns", "delete", netns_name(rig_dir)], check=False, capture=True)


def prepare_rootfs(root: Path, rig_dir: Path, user: str, upstream_ca: Path | None = None) -> None:
    """sshd of the booted rig on 127.0.0.1:22 of its own namespace, with the rig's keys; the unit of its LAN link;
    pip's proxy; the Debian mirror's and Docker Hub's names on the relay; the upstream stand-in's CA in the system
    trust store."""
    ssh = root / "etc/ssh"
    key = ssh / "rigforge_host_ed25519_key"
    key.write_bytes((rig_dir / "ssh_host_ed25519_key").read_bytes())
    key.chmod(0o600)
    (ssh / "rigforge_authorized_keys").write_text((rig_dir / "id_ed25519.pub").read_text())
    (ssh / "rigforge_authorized_keys").chmod(0o644)
    (ssh / "sshd_config.d/rigforge-testbed.conf").write_text(
        f"# rigforge testbed: this rig's sshd, reached through the relay\n"
        f"Port {RIG_SSH_PORT}\nListenAddress 127.0.0.1\n"
        f"HostKey /etc/ssh/rigforge_host_ed25519_key\nAuthorizedKeysFile /etc/ssh/rigforge_authorized_keys\n"
        f"PasswordAuthentication no\nPermitRootLogin prohibit-password\nAllowUsers root {user}\n"
    )
    units = root / "etc/systemd/system"
    (units / "rigforge-testbed-link.service").write_text(LINK_UNIT)
    (units / "multi-user.target.wants").mkdir(exist_ok=True)
    wants = units / "multi-user.target.wants/rigforge-testbed-link.service"
    if not wants.is_symlink():
        wants.symlink_to("/etc/systemd/system/rigforge-testbed-link.service")
    pip_conf = root / "etc/pip.conf"
    text = pip_conf.read_text() if pip_conf.exists() else "[global]\n"
    if "proxy" not in text:
        pip_conf.write_text(text + f"proxy = http://127.0.0.1:{PROXY_PORT}\n")
    hosts = root / "etc/hosts"
    if MIRROR_HOST not in hosts.read_text():
        hosts.write_text(hosts.read_text() + f"127.0.0.1\t{MIRROR_HOST}\n")
    if upstream_ca is None:
        return
    lines = [line for line in hosts.read_text().splitlines() if not set(upstream.HOSTNAMES) & set(line.split()[1:])]
    hosts.write_text("\n".join([*lines, f"{upstream.RIG_ADDRESS}\t{' '.join(upstream.HOSTNAMES)}"]) + "\n")
    trusted = root / "usr/local/share/ca-certificates" / f"{upstream.CA_NAME}.crt"
    if not trusted.exists() or trusted.read_bytes() != upstream_ca.read_bytes():
        trusted.parent.mkdir(parents=True, exist_ok=True)
        trusted.write_bytes(upstream_ca.read_bytes())
        in_chroot(root, "update-ca-certificates >/dev/null", capture=True)


# --- the rig -------------------------------------------------------------------------------------------------


@dataclass
class BootedRig(Rig):
    """A rig running its own systemd: `run` enters it, `reboot` powers it off and boots it again."""

    booted: bool = True

    @property
    def netns(self) -> str:
        return netns_path(self.dir)

    @property
    def api_address(self) -> str:
        """The controller's loopback address where this rig's API ports are published (same port numbers)."""
        return api_address(self.ssh_port)

    def run(self, cmd: str, check: bool = False) -> subprocess.CompletedProcess:
        return enter(self.dir, cmd, check=check)

    def reboot(self) -> float:
        """Power off and boot again (GPU runtime state is lost, files and Docker images stay); seconds taken."""
        t0 = time.monotonic()
        shutdown(self.dir)
        boot(self.dir)
        return time.monotonic() - t0

    def simulate_reboot(self) -> None:
        self.reboot()

    @contextlib.contextmanager
    def forward(self, rig_port: int) -> Iterator[int]:
        """The rig's 127.0.0.1:`rig_port` on a free controller port while the block runs: yields that port."""
        port = free_port(19000, 19500)
        pidfile = self.dir / f"forward-{rig_port}.pid"
        argv = [sys.executable, str(NETNS_SCRIPT), "serve", self.netns, f"in:{port}={rig_port}"]
        spawn(argv, pidfile, self.dir / f"forward-{rig_port}.log")
        try:
            wait_listener(
                port,
                lambda: pid_alive(pidfile),
                f"forward of rig port {rig_port}",
                self.dir / f"forward-{rig_port}.log",
            )
            yield port
        finally:
            stop_pidfile(pidfile)


def make_rig(rig_dir: Path, port: int, spec: RigSpec, tarball: Path, uid: int, fresh: bool, services: dict) -> Rig:
    """Create (or restart) one booted rig: rootfs, keys, sshd inside, network namespace + relay, boot (no image:
    the first deploy pulls it from the upstream stand-in)."""

    root = rig_dir / "rootfs"
    info_file = rig_dir / "rig.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    stop(rig_dir)
    make_keys(rig_dir)
    if fresh or not (root / ".rigforge-rig").exists() or info.get("tarball") != tarball.name:
        extract(tarball, root)
        prepare_rig(root, uid, USER)
        (root / ".rigforge-rig").write_text("ok\n")
        sh(["rm", "-rf", str(rig_dir / "sim-sys-module")])
    ca = Path(services["upstream"]["ca"]) if "upstream" in services else None
    prepare_rootfs(root, rig_dir, USER, ca)
    sim = root / "etc/rigforge-sim"
    sim.mkdir(parents=True, exist_ok=True)
    gpus = spec.gpus_json(str(rig_dir))
    (sim / "gpus.json").write_text(json.dumps(gpus, indent=1) + "\n")
    sh(["rm", "-rf", str(rig_dir / "sim-pci")])
    for gpu in gpus["gpus"]:  # the simulated GPUs on the PCI bus, as sysfs shows them before any driver
        dev = rig_dir / "sim-pci" / gpu["pci_bus_id"][4:].lower()
        dev.mkdir(parents=True)
        for name, value in (("vendor", "0x10de"), ("device", f"0x{spec.pci_device}"), ("class", "0x030000")):
            (dev / name).write_text(value + "\n")
    (rig_dir / "sim-pci").mkdir(exist_ok=True)
    took = boot(rig_dir)
    port = start_relay(rig_dir, services, port)
    log(f"{rig_dir.name}: booted in {took:.1f}s")
    info = {"port": port, "spec": asdict(spec), "tarball": tarball.name, "booted": True, "upstream": ca is not None}
    info["upstream_port"] = services.get("upstream", {}).get("port")
    info_file.write_text(json.dumps(info))
    return BootedRig(rig_dir.name, port, root, USER, rig_dir / "id_ed25519", rig_dir, spec)
