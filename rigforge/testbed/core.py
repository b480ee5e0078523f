"""Testbed rigs and services: `up` builds (or reuses) simulated rigs reachable over real SSH, `down` removes them.

Layout of a testbed directory (default /var/lib/rigforge-testbed; must be root-owned all the way up):
    cache/                 rootfs tarball, tools rootfs, apt repos, git remotes, HF repos (kept by `down`)
    run/                   services.json + pidfiles/logs of the shared apt / git / HF services
    rigs/<name>/           rootfs/, sshd_config, host + client keys, sshd.pid, rig.json
    inventory.py, testbed.lock.yaml, ssh_config, known_hosts
    env.sh                 the stand-ins' endpoints for `rigforge lock` (`. DIR/env.sh`)
    fleets/<name>/         further independent sets of rigs sharing the services (pytest factory)
"""

from __future__ import annotations

import fcntl
import json
import pwd
import shlex
import shutil
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

import rigforge.testbed.upstream as upstream

from ._util import (
    PORTS_LOCK,
    TestbedError,
    ensure_safe_dir,
    free_port,
    hash_tree,
    log,
    machine_locked,
    owns_port,
    pid_alive,
    port_free,
    ports_claimed,
    sh,
    spawn,
    stop_pidfile,
    wait_listener,
)
from .aptrepo import DOCKER_KEY, DOCKER_REPO, DRIVER_KEY, DRIVER_REPO, TOOLKIT_KEY, TOOLKIT_REPO
from .aptrepo import build as build_apt_repo
from .aptrepo import fingerprint as apt_fingerprint
from .booted import (
    BROKEN_IMAGE,
    BROKEN_MESSAGE,
    GATEWAY_PORT,
    MONITOR_PORT,
    REGISTRY_PORT,
    BootedRig,
    booted_tarball,
    join_lan,
    lan_address,
    publish_registry,
    refresh_relay,
    registry_address,
    remove_lan,
    start_gateway_relay,
    start_registry_relay,
)
from .booted import make_rig as make_booted_rig
from .booted import stop as stop_booted_rig
from .content import HF_TOKEN, UNLOCKED, build_git, build_hf, build_recipes, content_key, recipes_dir, shard_size
from .hostpkgs import ensure as ensure_host_packages
from .presets import apply as apply_preset
from .recipe_commits import B_IMAGE, SLOW_ENV, SLOW_IMAGE
from .rig import IMAGE_REF, USER, Rig, RigImage, RigSpec, make_keys, recipe_images
from .rootfs import build_tarball, extract, locked, new_machine_id, prepare_rig

if TYPE_CHECKING:  # testinfra is imported where used (the tests' helper)
    import testinfra.host

DEFAULT_DIR = Path("/var/lib/rigforge-testbed")
SSHD = "/usr/sbin/sshd"
PORTS = {"apt": 18721, "hf": 18722, "git": 18723, "upstream": 18724, "ssh": 2201, "gateway": 18088, "prometheus": 19090}


@dataclass
class Testbed:
    dir: Path
    shared: Path
    rigs: list[Rig]
    services: dict
    gateway: Rig | None = None  # the booted gateway host (`up --gateway`): inventory group `gateway`, not a rig
    gateway_port: int | None = None  # its HAProxy on the controller's 127.0.0.1
    fleet_registry: bool = False  # `up --fleet-registry`: gw (or rig1 without a gateway) is in the group `registry`
    monitor_port: int | None = None  # `up --monitor`: gw is in the group `monitor`; its Prometheus on 127.0.0.1
    docker_source: str = "docker"  # the rigs' docker_source: rigforge's default (Docker's repository's stand-in)
    variant: str | None = None  # `up --variant`: every rig's rigforge_variant (None: the deploy file's)

    @property
    def registry_host(self) -> Rig | None:
        """The fleet registry's host (`up --fleet-registry`): the gateway host, or rig1 when there is none."""
        if not self.fleet_registry:
            return None
        return self.gateway or self.rigs[0]

    @property
    def registry_address(self) -> str | None:
        """The fleet registry's address, the same on the controller and in every host (port REGISTRY_PORT)."""
        host = self.registry_host
        return registry_address(host.ssh_port) if host else None

    @property
    def gateway_url(self) -> str | None:
        return f"http://127.0.0.1:{self.gateway_port}" if self.gateway_port else None

    @property
    def prometheus_url(self) -> str | None:
        """The monitor's Prometheus (`up --monitor`), published on the controller's loopback."""
        return f"http://127.0.0.1:{self.monitor_port}" if self.monitor_port else None

    @property
    def inventory(self) -> Path:
        return self.dir / "inventory.py"

    @property
    def lock(self) -> Path:
        return self.dir / "testbed.lock.yaml"

    @property
    def env_file(self) -> Path:
        """`export` lines of `stand_in_env`, for a shell: `. DIR/env.sh` before `rigforge lock` (docs/rollout.md)."""
        return self.dir / "env.sh"

    @property
    def stand_in_env(self) -> dict[str, tuple[str, str]]:
        """{variable: (value, what it is)} that point `rigforge lock` at this testbed's stand-ins instead of the
        Hugging Face Hub, Docker Hub and NVIDIA's repository (rigforge/cli/lock.py reads each)."""
        env = {
            "HF_ENDPOINT": (self.hf_endpoint, "the Hugging Face Hub's stand-in: weights revisions and file hashes"),
            "RIGFORGE_HF_TOKEN": (self.hf_token, "the token it takes for its gated repos (a fixed test value)"),
            "RIGFORGE_TOOLKIT_REPO": (self.toolkit_repo_url, "NVIDIA's toolkit repository's stand-in (its news)"),
        }
        if "upstream" in self.services:  # booted testbeds: Docker Hub's stand-in, behind the testbed CA
            env["RIGFORGE_REGISTRY"] = (self.upstream_url, "Docker Hub's stand-in: image digests and CUDA versions")
            env["REQUESTS_CA_BUNDLE"] = (str(self.upstream_ca), "the testbed CA that signed its certificate")
        return env

    @property
    def ssh_config(self) -> Path:
        return self.dir / "ssh_config"

    @property
    def known_hosts(self) -> Path:
        return self.dir / "known_hosts"

    @property
    def apt_url(self) -> str:
        return f"http://127.0.0.1:{self.services['apt_port']}"

    @property
    def driver_repo_url(self) -> str:
        return f"{self.apt_url}/{DRIVER_REPO}/"

    @property
    def driver_repo_key_url(self) -> str:
        return f"{self.apt_url}/{DRIVER_KEY}"

    @property
    def docker_repo_url(self) -> str:
        return f"{self.apt_url}/{DOCKER_REPO}"

    @property
    def docker_repo_key_url(self) -> str:
        return f"{self.apt_url}/{DOCKER_KEY}"

    @property
    def repo_key_fingerprint(self) -> str:
        """Fingerprint of the throwaway key signing every local repository."""
        return self.services["apt_fingerprint"]

    @property
    def toolkit_repo_url(self) -> str:
        return f"{self.apt_url}/{TOOLKIT_REPO}/"

    @property
    def toolkit_repo_key_url(self) -> str:
        return f"{self.apt_url}/{TOOLKIT_KEY}"

    @property
    def hf_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.services['hf_port']}"

    @property
    def hf_token(self) -> str:
        """Token the HF stand-in accepts for its gated repos (a fixed test value, not a secret)."""
        return HF_TOKEN

    @property
    def hf_repos(self) -> dict:
        """{lock key: {repo, revision, gated, files: [{path, size, sha256, lfs, ...}]}}"""
        return self.services["hf"]

    @property
    def git_commits(self) -> dict[str, list[str]]:
        """{remote name: [commit SHAs, oldest first]}; the lock pins the last one."""
        return {name: m["commits"] for name, m in self.services["git"].items()}

    def git_url(self, name: str) -> str:
        if name not in self.services["git"]:
            raise KeyError(f"no local git remote {name!r}; have {sorted(self.services['git'])}")
        return f"git://127.0.0.1:{self.services['git_port']}/{name}.git"

    def rig(self, name: str) -> Rig:
        for rig in self.rigs:
            if rig.name == name:
                return rig
        raise KeyError(f"no rig {name!r} in {self.dir}; have {[r.name for r in self.rigs]}")

    def testinfra_host(self, name: str, sudo: bool = True) -> testinfra.host.Host:
        """A testinfra host for a rig, over SSH (paramiko backend) as the sudo user."""
        import paramiko
        import testinfra

        rig = self.rig(name)
        host = testinfra.get_host(f"paramiko://{name}", ssh_config=str(self.ssh_config), sudo=sudo)
        client = paramiko.SSHClient()  # testinfra ignores UserKnownHostsFile: verify the host key ourselves
        client.load_host_keys(str(self.known_hosts))
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        client.connect(
            "127.0.0.1", rig.ssh_port, rig.user, key_filename=str(rig.key), look_for_keys=False, allow_agent=False
        )
        host.backend.__dict__["client"] = client  # the backend's cached_property
        return host

    # --- the upstream registry stand-in (booted testbeds; upstream.py) ---

    @property
    def upstream(self) -> dict:
        if "upstream" not in self.services:
            raise TestbedError(f"testbed {self.dir} has no upstream registry stand-in (only `up --booted` runs one)")
        return self.services["upstream"]

    @property
    def upstream_url(self) -> str:
        """The stand-in on the controller: https://127.0.0.1:PORT (its certificate also names
        registry-1.docker.io, which booted hosts reach at upstream.RIG_ADDRESS:443)."""
        return self.upstream["url"]

    @property
    def upstream_ca(self) -> Path:
        """The throwaway testbed CA that signed the stand-in's certificate (in every booted host's trust store)."""
        return Path(self.upstream["ca"])

    @property
    def upstream_log(self) -> Path:
        """The stand-in's access log: one Apache combined-format line per request."""
        return Path(self.upstream["log"])

    @property
    def upstream_digests(self) -> dict[str, str]:
        """{ref: manifest digest} of the images pushed to the stand-in (the testbed lock pins these)."""
        return dict(self.upstream["digests"])

    def upstream_log_size(self) -> int:
        """The access log's size in bytes now: an offset for upstream_blob_gets."""
        return self.upstream_log.stat().st_size if self.upstream_log.exists() else 0

    def upstream_blob_gets(self, since: int = 0, name: str | None = None) -> int:
        """How many successful blob GETs (`GET /v2/<name>/blobs/sha256:...`) the stand-in served after byte
        `since` of its access log (of repository `name` only, if given)."""
        return len(upstream.blob_gets(self.upstream_log, since, name))

    def upstream_throttle(self, bytes_per_second: int) -> None:
        """Throttle what each booted host receives from the stand-in (per host's relay; 0 = full speed)."""
        upstream.set_throttle(self.shared, bytes_per_second)

    def upstream_push(self, ref: str, env: dict[str, str] | None = None) -> str:
        """Push the stand-in image (its cached layers; `env` in its config) to the stand-in as `ref` (a tag), unless
        it holds that manifest; its manifest digest."""
        from .imagebuild import load_layers

        blobs = Path(self.upstream["blob_dir"])
        layers = load_layers(blobs)
        if not layers:
            raise TestbedError(f"the stand-in image's layers are gone from {blobs}: run `rigforge testbed up` again")
        client = upstream.Client(self.upstream_url, self.upstream_ca)
        digest = upstream.push_images(client, layers, blobs, {ref: env or {}})[ref]
        upstream.mark_deleted(self.shared, ref, digest, undo=True)  # pushed again on purpose: `up` keeps it
        return digest

    def upstream_delete(self, ref: str) -> str | None:
        """Delete image `ref` (tag or digest) from the stand-in; the manifest digest deleted, None if absent. Later
        `up` runs do not push it back."""
        digest = upstream.Client(self.upstream_url, self.upstream_ca).delete(ref)
        if digest:
            upstream.mark_deleted(self.shared, ref, digest)
        return digest

    def hf_control(self, throttle_bps: int | None = None, drop_after_bytes: int | None = None) -> dict:
        """Throttle the HF stand-in (bytes/s, None = full speed) and/or cut the next file GET after N bytes."""
        body = json.dumps({"throttle_bps": throttle_bps, "drop_after_bytes": drop_after_bytes}).encode()
        req = urllib.request.Request(f"{self.hf_endpoint}/_testbed/control", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.load(resp)

    def hf_log(self, since: int = 0) -> list[dict]:
        """The HF stand-in's recent requests after request number `since` (see hf_mark):
        [{seq, method, path, range, status, auth}]. It keeps the last 500."""
        with urllib.request.urlopen(f"{self.hf_endpoint}/_testbed/log", timeout=5) as resp:
            return [e for e in json.load(resp) if e["seq"] > since]

    def hf_mark(self) -> int:
        """The number of the HF stand-in's latest request: hf_log(since=mark) is what came after."""
        log = self.hf_log()
        return log[-1]["seq"] if log else 0


# --- shared services -------------------------------------------------------------------------------------


def _service(run: Path, name: str, root: str, want_port: int, cmd_for_port: Callable[[int], list[str]]) -> int:
    """Reuse the running service `name` if it serves `root`, else (re)start it; return its port."""
    pidfile, statefile = run / f"{name}.pid", run / f"{name}.json"
    state = json.loads(statefile.read_text()) if statefile.exists() else {}
    pid = pid_alive(pidfile)
    if pid and state.get("root") == root and owns_port(pid, state["port"]):
        return state["port"]
    stop_pidfile(pidfile)
    port = state.get("port") or want_port
    with ports_claimed():  # machine-wide: no other testbed picks this port until our listener is up
        for _ in range(30):  # a just-stopped service may hold its port a moment longer
            if port_free(port):
                break
            time.sleep(0.1)
        port = free_port(port, port + 200)
        spawn(cmd_for_port(port), pidfile, run / f"{name}.log")
        wait_listener(
            port, lambda: pid_alive(pidfile), f"the {name} service of testbed {run.parent}", run / f"{name}.log"
        )
    statefile.write_text(json.dumps({"root": root, "port": port}))
    return port


def start_services(shared: Path) -> dict:
    """Build (cached) and start the apt / git / HF stand-ins of a testbed dir; return their description."""
    cache = ensure_safe_dir(shared / "cache")
    run = ensure_safe_dir(shared / "run")
    with locked(cache, "content"):  # the cache may be shared by testbed dirs (parallel test workers)
        apt_root = build_apt_repo(shared)
        key = content_key()
        git_root, hf_root = cache / f"git-{key}", cache / f"hf-{key}"
        for old in [*cache.glob("git-*"), *cache.glob("hf-*")]:
            if old not in (git_root, hf_root):
                shutil.rmtree(old)
        git_meta = build_git(git_root)
        recipes = build_recipes(git_root)  # from RIGFORGE_RECIPES: the recipe repo the rigs check out
        if recipes:
            git_meta = {**git_meta, "recipes": recipes}
        hf_meta = build_hf(hf_root, shard_size())
    py = sys.executable
    apt_port = _service(
        run,
        "apt",
        str(apt_root),
        PORTS["apt"],
        lambda p: [py, "-m", "http.server", str(p), "--bind", "127.0.0.1", "--directory", str(apt_root)],
    )
    hf_script = Path(__file__).with_name("hfserver.py")
    hf_port = _service(
        run,
        "hf",
        f"{hf_root}#{hash_tree(hf_script)}",
        PORTS["hf"],
        lambda p: [py, str(hf_script), "--root", str(hf_root), "--port", str(p)],
    )
    git_port = _service(
        run,
        "git",
        str(git_root),
        PORTS["git"],
        lambda p: [
            "git",
            "daemon",
            "--reuseaddr",
            "--export-all",
            f"--base-path={git_root}",
            "--listen=127.0.0.1",
            f"--port={p}",
            str(git_root),
        ],
    )
    services = {"apt_port": apt_port, "hf_port": hf_port, "git_port": git_port, "git": git_meta, "hf": hf_meta}
    services["apt_root"], services["apt_fingerprint"] = str(apt_root), apt_fingerprint(apt_root)
    try:  # the upstream stand-in (started by booted testbeds only) stays described while it runs
        old = json.loads((run / "services.json").read_text()).get("upstream")
    except (OSError, ValueError):
        old = None
    if old and pid_alive(run / "upstream.pid"):
        services["upstream"] = old
    (run / "services.json").write_text(json.dumps(services, indent=1))
    return services


def start_upstream(shared: Path, tarball: Path, cuda: str) -> dict:
    """Start (or reuse) the upstream registry stand-in of `shared` (upstream.py), push the stand-in images to it
    unless it holds them (CUDA_VERSION=<cuda>.0 in their env), and return its description for services.json."""
    import hashlib

    upstream.ensure_tls(shared)
    f = upstream.files(shared)
    identity = hashlib.sha256((upstream.config(shared, 0) + f["cert"].read_text()).encode()).hexdigest()[:12]
    port = _service(
        shared / "run",
        "upstream",
        f"{f['storage']}#{identity}",
        PORTS["upstream"],
        lambda p: upstream.command(shared, p),
    )
    layers, blobs = upstream.ensure_layers(shared, tarball)
    env = {"CUDA_VERSION": f"{cuda}.0"}
    images = {IMAGE_REF: env, **{ref: env for ref in sorted(set(recipe_images().values()))}}
    if recipe_images():  # the engine images of the recipe repo's later commits B and B-slow (recipe_commits.py)
        images |= {B_IMAGE: env, SLOW_IMAGE: env | SLOW_ENV}
    images[BROKEN_IMAGE] = {"RIGFORGE_STANDIN_EXIT": BROKEN_MESSAGE}
    state = upstream.describe(shared, port, {})
    client = upstream.Client(state["url"], Path(state["ca"]))
    state["digests"] = upstream.push_images(client, layers, blobs, images, upstream.deleted(shared))
    state["layers"] = [{k: layer[k] for k in ("name", "digest", "size")} for layer in layers]
    state["blob_dir"] = str(blobs)
    return state


def stop_services(shared: Path) -> None:
    run = shared / "run"
    for name in ("apt", "hf", "git", "upstream"):
        stop_pidfile(run / f"{name}.pid")
        (run / f"{name}.json").unlink(missing_ok=True)
    (run / "upstream-throttle").unlink(missing_ok=True)  # the next `up` starts at full speed
    (run / "services.json").unlink(missing_ok=True)


# --- rigs --------------------------------------------------------------------------------------------------


def ensure_host_user() -> int:
    """The sudo user exists on the controller too (sshd authenticates before it chroots); return its uid. Testbeds
    in other dirs (parallel test workers) may be adding it at the same moment: one adds it, the others see it."""
    with machine_locked(PORTS_LOCK.with_name("rigforge-testbed-user.lock")):
        return _ensure_host_user()


def _ensure_host_user() -> int:
    try:
        uid = pwd.getpwnam(USER).pw_uid
    except KeyError:
        uid = next(u for u in range(2901, 3900) if not _uid_used(u))
        sh(
            [
                "useradd",
                "--uid",
                str(uid),
                "--user-group",
                "--no-create-home",
                "--home-dir",
                f"/home/{USER}",
                "--shell",
                "/bin/bash",
                "--comment",
                "rigforge testbed rig user",
                USER,
            ],
            capture=True,
        )
    sh(["usermod", "-p", "*", USER], capture=True)  # not locked: sshd refuses locked accounts
    return uid


def _uid_used(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def _simulate_pci(root: Path, gpus: int, device: str) -> None:
    """A sysfs-shaped PCI bus in the chroot (it has no real /sys) for the PCI GPU count preflight reads before any
    driver: a host bridge, and per GPU its VGA function (class 0x0300) and HDMI audio function (0x0403)."""
    devices = root / "sys/bus/pci/devices"
    shutil.rmtree(devices, ignore_errors=True)
    functions = [("0000:00:00.0", "0x8086", "0x1237", "0x060000")]
    for i in range(gpus):
        slot = f"0000:{i + 1:02x}:00"
        functions += [(f"{slot}.0", "0x10de", f"0x{device}", "0x030000"), (f"{slot}.1", "0x10de", "0x1aef", "0x040300")]
    for address, *values in functions:
        (devices / address).mkdir(parents=True)
        for name, value in zip(("vendor", "device", "class"), values, strict=True):
            (devices / address / name).write_text(value + "\n")


def _sshd_config(rig_dir: Path, port: int) -> str:
    return f"""# rigforge testbed rig {rig_dir.name}
Port {port}
ListenAddress 127.0.0.1
HostKey {rig_dir}/ssh_host_ed25519_key
PidFile {rig_dir}/sshd.pid
AuthorizedKeysFile {rig_dir}/authorized_keys
ChrootDirectory {rig_dir}/rootfs
PermitRootLogin yes
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AllowUsers root {USER}
StrictModes yes
MaxStartups 100:30:200
MaxSessions 100
PrintMotd no
X11Forwarding no
AllowTcpForwarding no
Subsystem sftp internal-sftp
"""


def _make_rig(
    rig_dir: Path,
    port: int | None,
    spec: RigSpec,
    tarball: Path,
    uid: int,
    fresh: bool,
    taken: set[int],
    image: RigImage | None = None,
) -> Rig:
    """(Re)build a rig, from the base root file system `tarball` or from a converged rig's `image`, and start its
    sshd on `port` (its earlier one, or None) if still free, else on the next free port."""
    root = rig_dir / "rootfs"
    info_file = rig_dir / "rig.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    stop_pidfile(rig_dir / "sshd.pid")
    if image and (fresh or info.get("tarball") != image.tarball.name):
        extract(image.tarball, root)
        new_machine_id(root)  # a copy is a machine of its own (the deploy refuses two rigs with one machine-id)
        info = {"spec": asdict(image.spec)}  # its simulated GPUs and their power state are the image's
        tarball = image.tarball
    elif fresh or not (root / ".rigforge-rig").exists() or info.get("tarball") != tarball.name:
        extract(tarball, root)
        prepare_rig(root, uid, USER)
        (root / ".rigforge-rig").write_text("ok\n")
        info = {}
    if info.get("spec") != asdict(spec):
        sim = root / "etc/rigforge-sim"
        sim.mkdir(parents=True, exist_ok=True)
        (sim / "gpus.json").write_text(json.dumps(spec.gpus_json(str(rig_dir)), indent=1) + "\n")
        _simulate_pci(root, spec.gpus, spec.pci_device)
        (root / "var/lib/rigforge-sim/state.json").unlink(missing_ok=True)
    make_keys(rig_dir)
    (rig_dir / "authorized_keys").write_text((rig_dir / "id_ed25519.pub").read_text())
    (rig_dir / "authorized_keys").chmod(0o644)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    port = _start_sshd(rig_dir, port, taken)
    info_file.write_text(json.dumps({"port": port, "spec": asdict(spec), "tarball": tarball.name}))
    return Rig(rig_dir.name, port, root, USER, rig_dir / "id_ed25519", rig_dir, spec)


def _start_sshd(rig_dir: Path, own: int | None, taken: set[int]) -> int:
    """Claim a port machine-wide, start the rig's sshd on it and check the listener is that sshd; return the
    port. A failed start is an error naming the rig."""
    what = f"sshd of testbed rig {rig_dir.name} ({rig_dir})"
    log_file = rig_dir / "sshd.log"
    with ports_claimed():  # held until our sshd listens: no other testbed can pick the same free port
        want = own or PORTS["ssh"]
        port = free_port(want, want + 800, taken - {own})
        taken.add(port)
        (rig_dir / "sshd_config").write_text(_sshd_config(rig_dir, port))
        start = log_file.stat().st_size if log_file.exists() else 0
        proc = sh([SSHD, "-f", str(rig_dir / "sshd_config"), "-E", str(log_file)], capture=True, check=False)
        if proc.returncode != 0:
            try:
                with open(log_file, errors="replace") as fh:
                    fh.seek(start)
                    tail = " | ".join(fh.read().strip().splitlines()[-3:])
            except OSError:
                tail = (proc.stderr or "").strip()
            raise TestbedError(f"{what} did not start on 127.0.0.1:{port}: sshd exited rc={proc.returncode}: {tail}")
        wait_listener(port, lambda: pid_alive(rig_dir / "sshd.pid"), what, log_file)
    return port


def _remove_rig(rig_dir: Path) -> None:
    stop_pidfile(rig_dir / "sshd.pid")
    stop_booted_rig(rig_dir)
    sh(["rm", "-rf", "--one-file-system", str(rig_dir)])


def _all_rig_ports(shared: Path) -> set[int]:
    ports = set()
    for info in [*shared.glob("rigs/*/rig.json"), *shared.glob("fleets/*/rigs/*/rig.json")]:
        try:
            ports.add(json.loads(info.read_text())["port"])
        except (ValueError, KeyError):
            pass
    return ports


# --- generated files ---------------------------------------------------------------------------------------


def _write_lock(tb: Testbed) -> None:
    from rigforge.model.pins import default_lock_path, load_lock
    from rigforge.model.recipes import content_digest

    git = {}
    for name, m in tb.services["git"].items():
        pin = m["pin"]
        ref = m["branch"] if name == "vllm-src" else pin[:8] if name in ("club-3090", "recipes") else pin[:7]
        git[name] = {"url": tb.git_url(name), "ref": ref, "commit": pin, "sparse": m["sparse"], "files": m["files"]}
        if name == "recipes" and recipes_dir():  # commit A is RIGFORGE_RECIPES' tree: its digest names that tree
            git[name]["content"] = content_digest(recipes_dir())
    hf = {}
    for key, m in tb.services["hf"].items():
        if key in UNLOCKED:
            continue
        include = m.get("include") or []  # a GGUF repo: the lock pins only the recipe's files of it
        listed = [f for f in m["files"] if not include or f["path"] in include]
        hf[key] = {"repo": m["repo"], "revision": m["revision"], "gated": m["gated"]}
        if include:
            hf[key]["include"] = include
        hf[key]["files"] = [{"path": f["path"], "size": f["size"], "sha256": f["sha256"]} for f in listed]
    cuda = tb.rigs[0].spec.image_cuda if tb.rigs else RigSpec.image_cuda  # `up --image-cuda`: one per testbed
    booted = any(getattr(rig, "booted", False) for rig in tb.rigs)
    # booted rigs pull from the upstream stand-in: the digests it holds; chroot rigs pull nothing (tags only)
    digests = tb.services.get("upstream", {}).get("digests", {}) if booted else {}
    image = {"ref": IMAGE_REF, "digest": digests.get(IMAGE_REF), "cuda": cuda}
    lock = {"version": 1, "image": image, "git": git, "hf": hf}
    toolkit = load_lock(default_lock_path()).toolkit  # the real pin: the stand-in repo also has a newer release
    if toolkit:
        lock["toolkit"] = {"version": toolkit.version, "note": toolkit.note}
    if recipes_dir() and "recipes" in git:  # the images the recipe slugs run, by tag (no registry here)
        images = sorted(recipe_images().items())
        lock["images"] = {engine: {"ref": ref, "digest": digests.get(ref), "cuda": cuda} for engine, ref in images}
    header = "# rigforge testbed lock: local stand-ins on 127.0.0.1 (generated by `rigforge testbed up`)\n"
    if digests:
        header += f"# images: pushed to the upstream registry stand-in {tb.services['upstream']['url']}\n"
    tb.lock.write_text(header + yaml.safe_dump(lock, sort_keys=False, width=200))


def host_data(tb: Testbed, rig: Rig) -> dict:
    return {
        "ssh_hostname": "127.0.0.1",
        "ssh_port": rig.ssh_port,
        "ssh_user": rig.user,
        "ssh_key": str(rig.key),
        "ssh_known_hosts_file": str(tb.known_hosts),
        "ssh_strict_host_key_checking": "yes",
        "ssh_look_for_keys": False,
        "ssh_allow_agent": False,
        "_sudo": True,
        "rigforge_testbed": True,
        "rigforge_lock": str(tb.lock),
        "rigforge_manage_services": getattr(rig, "booted", False),  # booted rigs run systemd and Docker
        "registry_ca_dir": str(tb.dir / "registry-ca"),  # the fleet registry's CA: the testbed's, not ~/.config
        **_docker_data(tb),
        **({"rigforge_variant": tb.variant} if tb.variant else {}),
        # testbed rigs boot in seconds and every competing cap writer there runs within 10 s of boot: half the default
        # window, so the booted tests that wait for the settle stage to end wait half as long
        "gpu_power_settle_window_s": 30,
        "nvidia_driver_repo_url": tb.driver_repo_url,
        "nvidia_driver_repo_key_url": tb.driver_repo_key_url,
        "nvidia_driver_repo_key_fingerprint": tb.repo_key_fingerprint,
        "nvidia_toolkit_repo_key_fingerprint": tb.repo_key_fingerprint,
        "nvidia_toolkit_repo_url": tb.toolkit_repo_url,
        "nvidia_toolkit_repo_key_url": tb.toolkit_repo_key_url,
        "hf_endpoint": tb.hf_endpoint,
    } | _upstream_data(tb)


def _docker_data(tb: Testbed) -> dict:
    """The rigs' Docker source: rigforge's default, Docker's repository (the testbed's stand-in of it, signed by the
    testbed's key), unless `up(docker_source="distro")` asked for Debian's docker.io."""
    if tb.docker_source == "distro":
        return {"docker_source": "distro"}
    return {
        "docker_repo_url": tb.docker_repo_url,
        "docker_repo_key_url": tb.docker_repo_key_url,
        "docker_repo_key_fingerprint": tb.repo_key_fingerprint,
    }


def _write_env(tb: Testbed) -> None:
    lines = [
        "# rigforge testbed stand-ins (generated by `rigforge testbed up`): `. THIS_FILE` in the shell that runs",
        "# `rigforge lock` against the testbed's lock (a bump rehearsal: docs/rollout.md).",
    ]
    if "upstream" not in tb.services:
        lines.append("# No Docker Hub stand-in here (only `up --booted` runs one): image digests cannot be resolved.")
    for name, (value, what) in tb.stand_in_env.items():
        lines += [f"# {what}", f"export {name}={shlex.quote(value)}"]
    tb.env_file.write_text("\n".join(lines) + "\n")


def _cache_recipes(tb: Testbed) -> Path | None:
    """The controller's cache of the recipe commit the testbed's lock pins (A), as `rigforge lock` fills it: a
    deploy and `rigforge rollout` read it there, so RIGFORGE_RECIPES is needed only by `up`. None without one."""
    from rigforge.cli.lock import cache_recipes
    from rigforge.model import recipes
    from rigforge.model.pins import LockError, load_lock

    pin = load_lock(tb.lock).git.get(recipes.GIT_NAME)
    if pin is None or pin.commit is None:
        return None
    try:
        cache_recipes(pin)
    except LockError as exc:
        raise TestbedError(f"cannot cache the recipe commit A for the controller: {exc}") from None
    except OSError:  # another testbed cached it at the same moment
        if not (recipes.cache_dir(pin.commit) / recipes.REGISTRY).is_file():
            raise
    return recipes.cache_dir(pin.commit)


def _upstream_data(tb: Testbed) -> dict:
    """Where the controller asks for Docker Hub images before a rig pulls one: the upstream stand-in (booted)."""
    if "upstream" not in tb.services:
        return {}
    return {"serving_image_upstream": tb.upstream_url, "serving_image_upstream_ca": str(tb.upstream_ca)}


def _write_files(tb: Testbed) -> None:
    _write_lock(tb)
    _write_env(tb)
    booted = any(getattr(rig, "booted", False) for rig in tb.rigs)
    known, config = [], []
    for rig in [*tb.rigs, *([tb.gateway] if tb.gateway else [])]:
        pub = (rig.dir / "ssh_host_ed25519_key.pub").read_text().split()
        known.append(f"[127.0.0.1]:{rig.ssh_port} {pub[0]} {pub[1]}\n")
        config.append(
            f"Host {rig.name}\n  HostName 127.0.0.1\n  Port {rig.ssh_port}\n  User {rig.user}\n"
            f"  IdentityFile {rig.key}\n  IdentitiesOnly yes\n  UserKnownHostsFile {tb.known_hosts}\n"
            f"  StrictHostKeyChecking yes\n\n"
        )
    tb.known_hosts.write_text("".join(known))
    tb.ssh_config.write_text("".join(config))
    lines = [
        '"""pyinfra inventory of rigforge testbed rigs (generated by `rigforge testbed up`).',
        "",
        "Simulated rigs: Debian 13 chroots behind their own sshd on 127.0.0.1; GPUs are simulated by stub",
        "packages from a local signed apt repo; no systemd runs, so services are installed but not started.",
        *(["Booted rigs (--booted) run their own systemd and Docker engine: services are started."] * booted),
        '"""',
        "",
        "rigs = [",
    ]
    registry = tb.registry_host
    reg_data = {"registry_address": tb.registry_address} if registry else {}
    for rig in tb.rigs:
        data = host_data(tb, rig) | ({"gateway_address": lan_address(rig.dir)} if tb.gateway else {})
        data |= reg_data if registry is rig else {}
        lines.append(f"    ({rig.name!r}, {data!r}),")
    lines.append("]")
    if tb.gateway:
        data = host_data(tb, tb.gateway) | {"gateway_port": GATEWAY_PORT} | (reg_data if registry is tb.gateway else {})
        data |= {"gateway_url": tb.gateway_url} if tb.gateway_url else {}  # published on the controller
        # likewise; a 5 s scrape (15 s by default) so that a test sees an alert's `for:` begin sooner
        data |= {"monitor_url": tb.prometheus_url, "monitor_scrape_interval_s": 5} if tb.prometheus_url else {}
        lines += [
            "",
            f"# the fleet gateway: {tb.gateway_url} on this machine",
            "gateway = [",
            f"    ({tb.gateway.name!r}, {data!r}),",
            "]",
        ]
    if tb.monitor_port:
        lines += [
            "",
            f"# the monitor (docs/monitoring.md): Prometheus on gw, {tb.prometheus_url} on this machine",
            f"monitor = [{tb.gateway.name!r}]",
        ]
    if registry:
        which = "the gateway host serves it too" if registry is tb.gateway else "rig1 serves it too (no gateway host)"
        lines += [
            "",
            f"# the fleet registry (docs/registry.md): {which}, at {tb.registry_address}:{REGISTRY_PORT} here and on",
            "# every host",
            f"registry = [{registry.name!r}]",
        ]
    tb.inventory.write_text("\n".join(lines) + "\n")


# --- public API --------------------------------------------------------------------------------------------


def up(
    dir: Path = DEFAULT_DIR,
    specs: list[RigSpec] | None = None,
    fresh: bool = False,
    shared: Path | None = None,
    booted: bool = False,
    gateway: bool = False,
    fleet_registry: bool = False,
    monitor: bool = False,
    docker_source: str = "docker",
    variant: str | None = None,
    image: RigImage | None = None,
) -> Testbed:
    """Build or reuse rigs rig1..rigN (one per spec) in `dir`; start the shared services of `shared` (default:
    `dir`). Idempotent: running rigs with the same spec are kept unless `fresh`. `booted`: rigs run their own
    systemd and Docker engine (booted.py). `gateway` (booted only): one more booted host, `gw`, for the fleet
    gateway, reaching each rig at its address on the testbed's LAN (booted.join_lan), published on the
    controller's loopback.
    `fleet_registry` (booted only): the gateway host, or rig1 without one, is the fleet registry's host too (group
    `registry`); every host and the controller reach it at the testbed's registry_address.
    `monitor` (with `gateway`): the gateway host is the monitor too (group `monitor`, roles/monitor.py), its
    Prometheus published on the controller's loopback (Testbed.prometheus_url); it scrapes over the LAN.
    `docker_source`: the rigs' host data docker_source, "docker" (rigforge's default: the testbed's stand-in of
    Docker's repository) or "distro" (Debian's docker.io). `variant`: every rig's rigforge_variant, if given.
    `image` (chroot rigs only): every rig is a copy of that converged rig (converged.py) instead of a fresh one; each
    spec must be the image's, and `docker_source` the one it was converged with.
    Writes DIR/env.sh (Testbed.stand_in_env) and caches the lock's recipe commit for the controller."""
    t0 = time.monotonic()
    ensure_host_packages(booted)  # root, and the host packages (installed when missing, on Debian/Ubuntu)
    specs = list(specs) if specs else [RigSpec()]
    dir = ensure_safe_dir(Path(dir))
    shared = ensure_safe_dir(Path(shared) if shared else dir)
    run = ensure_safe_dir(shared / "run")
    if gateway and not booted:
        raise TestbedError("--gateway needs --booted: the gateway host runs HAProxy under its own systemd")
    if monitor and not gateway:
        raise TestbedError("--monitor needs --gateway: the gateway host carries the monitor (Prometheus)")
    if fleet_registry and not booted:
        raise TestbedError("--fleet-registry needs --booted: the registry host runs the registry under its systemd")
    if docker_source not in ("docker", "distro"):
        raise TestbedError(f"docker_source must be docker or distro, got {docker_source!r}")
    if len({spec.image_cuda for spec in specs}) > 1:
        raise TestbedError("the rigs of one testbed share its lock: give them one image CUDA version")
    if image and (booted or any(spec != image.spec for spec in specs) or docker_source != image.docker_source):
        raise TestbedError(
            f"a converged image makes chroot rigs like the one it was made from ({image.spec}, docker_source "
            f"{image.docker_source}); asked for booted={booted}, {specs}, docker_source {docker_source}"
        )
    if booted and any(spec.preset for spec in specs):
        raise TestbedError("rig presets are for chroot rigs; booted rigs start from the plain root file system")
    for tool in ("systemd-nspawn", "nsenter", "ip") if booted else ():
        if not shutil.which(tool):
            raise TestbedError(f"{tool} not found; booted rigs need: apt-get install systemd-container iproute2")
    booted_lock = PORTS_LOCK.with_name("rigforge-testbed-booted-up.lock")  # machine-wide, see below
    with open(run / "up.lock", "w") as lock_f, machine_locked(booted_lock) if booted else nullcontext():
        # booted testbeds in other dirs (parallel test workers) come up one at a time: their relays, LANs and
        # boots do not race for the machine's ports and namespaces
        fcntl.flock(lock_f, fcntl.LOCK_EX)
        tarball = build_tarball(shared)
        if booted:
            tarball = booted_tarball(shared, tarball)
        services = start_services(shared)
        if booted:  # Docker Hub's stand-in: the rigs pull the serving images from it
            services["upstream"] = start_upstream(shared, tarball, specs[0].image_cuda)
            (run / "services.json").write_text(json.dumps(services, indent=1))
        uid = ensure_host_user()
        rigs_dir = ensure_safe_dir(dir / "rigs")
        names = [f"rig{i + 1}" for i in range(len(specs))]
        if gateway:
            names, specs = [*names, "gw"], [*specs, RigSpec()]
        for extra in sorted(p for p in rigs_dir.iterdir() if p.is_dir() and p.name not in names):
            _remove_rig(extra)
        taken = _all_rig_ports(shared)
        plan = []
        for name, spec in zip(names, specs, strict=True):
            rig_dir = ensure_safe_dir(rigs_dir / name)
            info = json.loads((rig_dir / "rig.json").read_text()) if (rig_dir / "rig.json").exists() else {}
            pid = pid_alive(rig_dir / "sshd.pid")
            reuse = (
                not fresh
                and info.get("spec") == asdict(spec)
                and info.get("tarball") == tarball.name
                and info.get("booted", False) == booted
                and info.get("upstream", False) == booted  # a booted rig from before the upstream stand-in: rebuilt
                and (
                    pid_alive(rig_dir / "nspawn.pid")
                    if booted
                    else bool(pid and owns_port(pid, info["port"]))  # our own sshd still holds its port
                )
            )
            if reuse:
                plan.append((rig_dir, info["port"], spec, None))
                continue
            stop_pidfile(rig_dir / "sshd.pid")
            stop_booted_rig(rig_dir)  # an old booted rig stops first, whatever it is rebuilt as (no-op if chroot)
            plan.append((rig_dir, info.get("port"), spec, True))

        def build(item: tuple[Path, int | None, RigSpec, bool | None]) -> Rig:
            rig_dir, port, spec, todo = item
            cls = BootedRig if booted else Rig
            if todo is None:
                if booted:  # kept running; on the LAN; its relay follows the upstream stand-in if that moved
                    join_lan(rig_dir)
                    port = refresh_relay(rig_dir, services, port)
                return cls(rig_dir.name, port, rig_dir / "rootfs", USER, rig_dir / "id_ed25519", rig_dir, spec)
            if booted:  # the relay takes the next free port itself if this one is taken meanwhile
                with ports_claimed():
                    port = free_port(port or PORTS["ssh"], (port or PORTS["ssh"]) + 800, taken - {port})
                    taken.add(port)
                return make_booted_rig(rig_dir, port, spec, tarball, uid, fresh, services)
            rig = _make_rig(rig_dir, port, spec, tarball, uid, fresh, taken, image)
            apply_preset(
                spec.preset, rig.rootfs, Path(services["apt_root"]), f"http://127.0.0.1:{services['apt_port']}"
            )
            return rig

        with ThreadPoolExecutor(max_workers=4) as pool:
            rigs = list(pool.map(build, plan))
        tb = Testbed(dir=dir, shared=shared, rigs=rigs, services=services, docker_source=docker_source, variant=variant)
        if gateway:
            tb.gateway, tb.rigs = rigs[-1], rigs[:-1]
            # a testbed brought up again (fresh=False) keeps its gateway's ports: its clients hold its URLs
            info = json.loads((tb.gateway.dir / "rig.json").read_text())
            tb.gateway_port = start_gateway_relay(tb.gateway.dir, info.get("gateway_port") or PORTS["gateway"])
            info |= {"gateway_port": tb.gateway_port}
            kept_monitor_port = info.get("monitor_port")
            info.pop("monitor_port", None)
            stop_pidfile(tb.gateway.dir / "prometheus-relay.pid")
            if monitor:
                tb.monitor_port = start_gateway_relay(
                    tb.gateway.dir, kept_monitor_port or PORTS["prometheus"], MONITOR_PORT, name="prometheus-relay"
                )
                info["monitor_port"] = tb.monitor_port
            (tb.gateway.dir / "rig.json").write_text(json.dumps(info))
        if not booted:  # no booted host left on the testbed's LAN
            remove_lan(dir)
        tb.fleet_registry = fleet_registry
        for rig in [*tb.rigs, *([tb.gateway] if tb.gateway else [])]:
            info = json.loads((rig.dir / "rig.json").read_text())
            info["fleet_registry"] = fleet_registry and rig is tb.registry_host
            (rig.dir / "rig.json").write_text(json.dumps(info))
            if not fleet_registry:
                stop_pidfile(rig.dir / "registry-relay.pid")
                stop_pidfile(rig.dir / "registry-publish.pid")
        if fleet_registry:  # the other hosts and the controller reach it at registry_address
            host = tb.registry_host
            for rig in tb.rigs:
                if rig is not host:
                    start_registry_relay(rig.dir, host.dir, tb.registry_address)
            publish_registry(host.dir, tb.registry_address)
        _write_files(tb)
        _cache_recipes(tb)
    gw = " and the gateway host" if gateway else ""
    log(f"testbed up: {len(tb.rigs)} rig(s){gw} in {dir} ready in {time.monotonic() - t0:.1f}s")
    return tb


def load_rig(rig_dir: Path) -> Rig:
    """One rig (or the gateway host) of a testbed brought up earlier, from its rig.json."""
    info = json.loads((rig_dir / "rig.json").read_text())
    cls = BootedRig if info.get("booted") else Rig
    return cls(
        rig_dir.name, info["port"], rig_dir / "rootfs", USER, rig_dir / "id_ed25519", rig_dir, RigSpec(**info["spec"])
    )


def load(dir: Path = DEFAULT_DIR, shared: Path | None = None) -> Testbed:
    """The Testbed of a directory brought up earlier (no changes made)."""
    dir = Path(dir)
    shared = Path(shared) if shared else dir
    services = json.loads((shared / "run/services.json").read_text())
    rigs, gateway, fleet_registry = [], {}, False
    for info_file in sorted((dir / "rigs").glob("*/rig.json")):
        info = json.loads(info_file.read_text())
        if "gateway_port" in info:
            gateway = {"gateway_port": info["gateway_port"], "monitor_port": info.get("monitor_port")}
        fleet_registry |= bool(info.get("fleet_registry"))
        rigs.append(load_rig(info_file.parent))
    if gateway:  # rig.json files sort rig1.., then gw
        gateway["gateway"] = next(r for r in rigs if r.name == "gw")
        rigs = [r for r in rigs if r.name != "gw"]
    return Testbed(dir=dir, shared=shared, rigs=rigs, services=services, fleet_registry=fleet_registry, **gateway)


PURGED = ("cache", "run", "upstream", "registry-ca", "fleets", "images")  # what `down --purge` removes besides the rigs


def down(dir: Path = DEFAULT_DIR, purge: bool = False) -> None:
    """Stop the rigs' sshds and remove the rigs (and fleets) of `dir`, stop its services; keep the cache, the
    upstream stand-in's storage and the fleet CA unless `purge`, which removes them and `dir` itself when nothing
    else is left in it."""
    dir = Path(dir)
    if not dir.exists():
        return
    for fleet in sorted((dir / "fleets").glob("*")) if (dir / "fleets").exists() else []:
        down(fleet)
        sh(["rm", "-rf", "--one-file-system", str(fleet)])
    if (dir / "rigs").exists():
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(_remove_rig, [p for p in (dir / "rigs").iterdir() if p.is_dir()]))
        (dir / "rigs").rmdir()
    remove_lan(dir)
    stop_services(dir)
    for name in ("inventory.py", "testbed.lock.yaml", "env.sh", "ssh_config", "known_hosts"):
        (dir / name).unlink(missing_ok=True)
    if purge:  # everything `up` made: the cache, the services' state, the upstream stand-in and the fleet CA
        for name in PURGED:
            sh(["rm", "-rf", "--one-file-system", str(dir / name)])
        if not any(dir.iterdir()):
            dir.rmdir()
    log(f"testbed down{' --purge' if purge else ''}: {dir}")
