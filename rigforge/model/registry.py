"""The fleet registry (docs/registry.md): a plain CNCF Distribution registry on one host of the inventory, over TLS
with a CA rigforge makes on the controller: its plan and config.yml, and the CA files (openssl, on the controller)."""

import contextlib
import fcntl
import ipaddress
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

STORAGE = "/var/lib/docker-registry"  # Debian's docker-registry keeps its blobs here (its package owns the dir)
CONFIG_DIR = "/etc/docker/registry"  # the unit runs `docker-registry serve /etc/docker/registry/config.yml`
CONFIG = "config.yml"
TLS_DIR = f"{CONFIG_DIR}/tls"
TLS_CERT, TLS_KEY = "registry.crt", "registry.key"
CERTS_D = "/etc/docker/certs.d"  # Docker's per-registry CA: certs.d/<host>:<port>/ca.crt
CA_DAYS, SERVER_DAYS, RENEW_DAYS = 3650, 825, 30


class RegistryError(Exception):
    """The controller could not make or read the fleet's CA (one line, for the operator)."""


@dataclass(frozen=True)
class RegistryPlan:
    host: str  # its inventory name
    address: str  # what rigs reach it at, and the certificate's subject alternative name
    port: int
    insecure: bool  # plain HTTP (the operator opted in): rigs list it in daemon.json's insecure-registries
    ca_dir: Path  # on the controller: the fleet's CA (key 0600) and the registry hosts' certificates

    @property
    def endpoint(self) -> str:
        """host:port as Docker names the registry (certs.d's directory, insecure-registries, image references)."""
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'http' if self.insecure else 'https'}://{self.endpoint}"


def default_ca_dir() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "rigforge" / "registry-ca"


def build(name: str, data: Mapping) -> RegistryPlan:
    """The registry host's plan from its host data (the role's defaults applied, already validated)."""
    ca_dir = Path(data["registry_ca_dir"]).expanduser() if data.get("registry_ca_dir") else default_ca_dir()
    return RegistryPlan(
        host=name,
        address=data.get("registry_address") or name,
        port=int(data["registry_port"]),
        insecure=bool(data["registry_insecure"]),
        ca_dir=ca_dir,
    )


def render_config(plan: RegistryPlan) -> str:
    """config.yml for Debian's docker-registry (Distribution 2.8): plain (no proxy, no auth), TLS unless insecure."""
    config = {
        "version": 0.1,
        "log": {"fields": {"service": "registry"}},
        "storage": {"cache": {"blobdescriptor": "inmemory"}, "filesystem": {"rootdirectory": STORAGE}},
        "http": {"addr": f":{plan.port}", "headers": {"X-Content-Type-Options": ["nosniff"]}},
        "health": {"storagedriver": {"enabled": True, "interval": "10s", "threshold": 3}},
    }
    if not plan.insecure:
        config["http"]["tls"] = {"certificate": f"{TLS_DIR}/{TLS_CERT}", "key": f"{TLS_DIR}/{TLS_KEY}"}
    header = "# rigforge: the fleet registry (roles/registry.py); rewritten by every run\n"
    return header + yaml.safe_dump(config, sort_keys=False)


def check_config(text: str, tls: bool) -> list[str]:
    """Problems with a config.yml: YAML holding the keys the registry needs (docker-registry cannot check a config)."""
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        return [f"the registry config is not YAML: {error}"]
    if not isinstance(config, dict):
        return ["the registry config is not a YAML mapping"]
    paths = [("version",), ("storage", "filesystem", "rootdirectory"), ("http", "addr")]
    paths += [("http", "tls", "certificate"), ("http", "tls", "key")] if tls else []
    problems = []
    for path in paths:
        node = config
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if not node:
            problems.append(f"the registry config has no {'.'.join(path)}")
    if "proxy" in config:
        problems.append("the registry config has a proxy section: the fleet registry is a plain registry")
    return problems


def subject_alt_name(address: str) -> str:
    try:
        return f"IP:{ipaddress.ip_address(address)}"
    except ValueError:
        return f"DNS:{address}"


# --- the CA, on the controller ---------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path, what: str | None = None) -> subprocess.CompletedProcess:
    if not shutil.which("openssl"):
        raise RegistryError("the fleet registry's CA needs the openssl command on the controller (apt install openssl)")
    res = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if what and res.returncode != 0:
        raise RegistryError(f"openssl could not {what}: {(res.stderr or res.stdout).strip()[-400:]}")
    return res


_IN_PROCESS = threading.Lock()  # gevent's, in a pyinfra run (it patches threading): one host at a time


@contextlib.contextmanager
def _locked(ca_dir: Path) -> Iterator[Path]:
    """The CA dir (0700), locked: runs on one controller may share it. The flock alone would deadlock a pyinfra
    run: its hosts are greenlets of one process, and one waiting in flock blocks the one that holds it."""
    with _IN_PROCESS:
        ca_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        ca_dir.chmod(0o700)
        with open(ca_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield ca_dir


# openssl req's arguments for a new key: EC on the P-256 curve, written unencrypted (the file's mode guards it)
NEW_EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def ca_certificate(ca_dir: Path) -> str:
    """The fleet CA's certificate (PEM), made first when `ca_dir` has none. Its key stays in `ca_dir`, 0600."""
    with _locked(ca_dir):
        if not (ca_dir / "ca.crt").exists():
            with tempfile.TemporaryDirectory(dir=ca_dir) as tmp:
                _openssl(
                    "req",
                    "-x509",
                    *NEW_EC_KEY,
                    "-keyout",
                    "ca.key",
                    "-out",
                    "ca.crt",
                    "-days",
                    str(CA_DAYS),
                    "-subj",
                    "/CN=rigforge fleet registry CA",
                    "-addext",
                    "basicConstraints=critical,CA:TRUE",
                    "-addext",
                    "keyUsage=critical,keyCertSign,cRLSign",
                    cwd=Path(tmp),
                    what="make the fleet registry's CA",
                )
                (Path(tmp) / "ca.key").chmod(0o600)
                os.replace(Path(tmp) / "ca.key", ca_dir / "ca.key")  # the key first: ca.crt present means both are
                os.replace(Path(tmp) / "ca.crt", ca_dir / "ca.crt")
        return (ca_dir / "ca.crt").read_text()


def _server_ok(ca_dir: Path, crt: Path, address: str) -> bool:
    """`crt` is signed by this CA, names `address`, and is good for RENEW_DAYS more days."""
    kind = "-verify_ip" if subject_alt_name(address).startswith("IP:") else "-verify_hostname"
    verify = _openssl("verify", "-CAfile", "ca.crt", kind, address, str(crt), cwd=ca_dir)
    fresh = _openssl("x509", "-noout", "-checkend", str(RENEW_DAYS * 86400), "-in", str(crt), cwd=ca_dir)
    return verify.returncode == 0 and fresh.returncode == 0


def server_certificate(ca_dir: Path, address: str) -> tuple[str, str]:
    """(certificate, key) PEM for the registry at `address`, signed by the fleet CA; reused while valid (idempotent)."""
    ca_certificate(ca_dir)
    with _locked(ca_dir):
        servers = ca_dir / "servers"
        servers.mkdir(exist_ok=True, mode=0o700)
        crt, key = servers / f"{address}.crt", servers / f"{address}.key"
        if not (crt.exists() and key.exists() and _server_ok(ca_dir, crt, address)):
            with tempfile.TemporaryDirectory(dir=ca_dir) as tmp:
                t = Path(tmp)
                (t / "ext").write_text(
                    f"subjectAltName={subject_alt_name(address)}\nbasicConstraints=CA:FALSE\n"
                    "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                )
                _openssl(
                    "req",
                    "-new",
                    *NEW_EC_KEY,
                    "-keyout",
                    "s.key",
                    "-subj",
                    f"/CN={address}",
                    "-out",
                    "s.csr",
                    cwd=t,
                    what=f"make a key for the registry at {address}",
                )
                _openssl(
                    "x509",
                    "-req",
                    "-in",
                    "s.csr",
                    "-CA",
                    str(ca_dir / "ca.crt"),
                    "-CAkey",
                    str(ca_dir / "ca.key"),
                    "-set_serial",
                    f"0x{secrets.token_hex(16)}",
                    "-days",
                    str(SERVER_DAYS),
                    "-extfile",
                    "ext",
                    "-out",
                    "s.crt",
                    cwd=t,
                    what=f"sign the certificate of the registry at {address}",
                )
                (t / "s.key").chmod(0o600)
                os.replace(t / "s.key", key)
                os.replace(t / "s.crt", crt)
        return crt.read_text(), key.read_text()


def certificates(reg: RegistryPlan, server: bool = True) -> tuple[tuple[str, str] | None, str | None, list[str]]:
    """(the registry host's (certificate, key) when `server`, the fleet CA's certificate, problems) for `reg`, made on
    the controller when missing (`server_certificate`, `ca_certificate`); an insecure registry (plain HTTP) has none.
    A CA that cannot be made is the one problem, naming why."""
    if reg.insecure:
        return None, None, []
    try:
        tls = server_certificate(reg.ca_dir, reg.address) if server else None
        return tls, ca_certificate(reg.ca_dir), []
    except RegistryError as error:
        return None, None, [str(error)]
