"""The fleet registry's pure parts (rigforge/model/registry.py, roles/registry.py's knobs): which host serves it, its
config, the fleet CA and the server certificate's names (real openssl, on the controller), insecure-registries."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from pyinfra.api import Inventory

import rigforge.model.knobs.registry
from rigforge.model import fleet, registry
from rigforge.model.jsonmerge import merged_text
from roles import registry as registry_role


def plan(**data) -> registry.RegistryPlan:
    return registry.build("gw.lan", {**rigforge.model.knobs.registry.DEFAULTS, **data})


def test_the_registry_host_is_the_registry_groups_first_and_only_when_asked_for():
    two = Inventory((["rig1", "reg", "reg2", "gw"], {}), registry=(["reg", "reg2"], {}), gateway=(["gw"], {}))
    assert fleet.build(two).registry_host == "reg"
    gateways = Inventory((["rig1", "gw", "gw2"], {}), gateway=(["gw", "gw2"], {}))
    assert fleet.build(gateways).registry_host is None  # a gateway alone: none
    assert fleet.build(Inventory((["rig1"], {}))).registry_host is None


def test_site_finds_the_registry_and_registry_hosts_are_not_rigs():
    inv = Inventory(
        (["rig1", "gw", "reg"], {}),
        rigs=(["rig1"], {}),
        gateway=(["gw"], {}),
        registry=(["reg"], {"registry_port": 5443}),
    )
    fl = fleet.build(inv)
    reg, problems = fl.registry, fl.registry_problems
    assert problems == () and (reg.host, reg.endpoint, reg.url) == ("reg", "reg:5443", "https://reg:5443")
    assert [h.name for h in inv if fleet.is_rig(h)] == ["rig1"] == [n for n in fl.roles if fl.is_rig(n)]
    gw_only = Inventory((["rig1", "gw"], {}), gateway=(["gw"], {"registry_insecure": True, "registry_port": 0}))
    fl = fleet.build(gw_only)
    assert (fl.registry_host, fl.registry_problems) == (None, ())  # opt-in: a gateway is not a registry unless listed
    both = Inventory((["rig1", "gw"], {}), gateway=(["gw"], {"registry_port": 0}), registry=(["gw"], {}))
    fl = fleet.build(both)
    assert fl.registry is None and fl.registry_problems == ("registry_port must be a whole number in 1..65535, got 0",)
    assert fl.registry_host == "gw" and [h.name for h in both if fleet.is_rig(h)] == ["rig1"]
    assert fleet.build(Inventory((["rig1"], {}))).registry_host is None


def test_knobs_are_checked():
    good = dict(rigforge.model.knobs.registry.DEFAULTS)
    assert rigforge.model.knobs.registry.validate(good) == []
    bad = {**good, "registry_insecure": "yes", "registry_address": "a b", "registry_ca_dir": ""}
    assert len(rigforge.model.knobs.registry.validate(bad)) == 3


def test_the_config_is_a_plain_registry_with_tls_by_default():
    text = registry.render_config(plan())
    config = yaml.safe_load(text)
    assert config["http"]["tls"] == {
        "certificate": "/etc/docker/registry/tls/registry.crt",
        "key": "/etc/docker/registry/tls/registry.key",
    }
    assert config["storage"]["filesystem"]["rootdirectory"] == "/var/lib/docker-registry"
    assert config["http"]["addr"] == ":5000" and "proxy" not in config and "auth" not in config
    assert registry.check_config(text, tls=True) == []
    insecure = registry.render_config(plan(registry_insecure=True, registry_port=5001))
    assert "tls" not in yaml.safe_load(insecure)["http"] and registry.check_config(insecure, tls=False) == []
    assert plan(registry_insecure=True).url == "http://gw.lan:5000"


def test_check_config_names_what_is_missing():
    assert registry.check_config(registry.render_config(plan(registry_insecure=True)), tls=True) == [
        "the registry config has no http.tls.certificate",
        "the registry config has no http.tls.key",
    ]
    assert registry.check_config("version: [", tls=False)[0].startswith("the registry config is not YAML")
    assert registry.check_config("- a", tls=False) == ["the registry config is not a YAML mapping"]
    proxied = registry.render_config(plan()) + "proxy:\n  remoteurl: https://registry-1.docker.io\n"
    assert registry.check_config(proxied, tls=True) == [
        "the registry config has a proxy section: the fleet registry is a plain registry"
    ]


def test_names_in_the_certificate_and_for_docker():
    assert registry.subject_alt_name("10.0.0.5") == "IP:10.0.0.5"
    assert registry.subject_alt_name("fd00::5") == "IP:fd00::5"
    assert registry.subject_alt_name("gw.example.lan") == "DNS:gw.example.lan"
    assert plan(registry_address="fd00::5").endpoint == "[fd00::5]:5000"
    assert plan(registry_address="10.0.0.5").endpoint == "10.0.0.5:5000"
    assert plan().endpoint == "gw.lan:5000"  # the inventory name when registry_address is unset


def test_the_ca_dir_defaults_under_the_users_config(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert plan().ca_dir == tmp_path / "rigforge" / "registry-ca"
    assert plan(registry_ca_dir=str(tmp_path / "ca")).ca_dir == tmp_path / "ca"


def openssl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["openssl", *args], capture_output=True, text=True)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("address", "check"), [("127.0.2.1", "-verify_ip"), ("gw.example.lan", "-verify_hostname")])
def test_the_fleet_ca_signs_a_certificate_for_the_registry_address(tmp_path, address, check):
    ca_dir = tmp_path / "ca"
    ca = registry.ca_certificate(ca_dir)
    assert registry.ca_certificate(ca_dir) == ca  # made once
    assert mode(ca_dir) == 0o700 and mode(ca_dir / "ca.key") == 0o600
    crt, key = registry.server_certificate(ca_dir, address)
    assert registry.server_certificate(ca_dir, address) == (crt, key)  # reused: a second run changes nothing
    (tmp_path / "s.crt").write_text(crt)
    assert mode(ca_dir / "servers" / f"{address}.key") == 0o600 and "PRIVATE KEY" in key
    assert openssl("verify", "-CAfile", str(ca_dir / "ca.crt"), check, address, str(tmp_path / "s.crt")).returncode == 0
    assert openssl("verify", "-CAfile", str(ca_dir / "ca.crt"), check, "other.lan", str(tmp_path / "s.crt")).returncode
    assert registry.server_certificate(ca_dir, "10.9.9.9")[0] != crt  # another address, another certificate


def test_a_certificate_from_another_ca_is_replaced(tmp_path):
    crt, _ = registry.server_certificate(tmp_path / "a", "gw.lan")
    registry.ca_certificate(tmp_path / "b")
    (tmp_path / "b" / "servers").mkdir(mode=0o700)
    for suffix in ("crt", "key"):
        (tmp_path / "b" / "servers" / f"gw.lan.{suffix}").write_text(
            (tmp_path / "a" / "servers" / f"gw.lan.{suffix}").read_text()
        )
    assert registry.server_certificate(tmp_path / "b", "gw.lan")[0] != crt


def test_insecure_registries_keep_the_users_own_entries():
    current = json.dumps({"insecure-registries": ["mine:5000"], "storage-driver": "vfs"})
    text = merged_text(current, {}, {"insecure-registries": ["gw.lan:5000"]})
    assert json.loads(text)["insecure-registries"] == ["mine:5000", "gw.lan:5000"]
    assert merged_text(text, {}, {"insecure-registries": ["gw.lan:5000"]}) is None
    assert json.loads(merged_text(None, {}, {"insecure-registries": ["gw.lan:5000"]})) == {
        "insecure-registries": ["gw.lan:5000"]
    }


def test_a_rig_trusts_the_registry_by_its_ca_or_lists_a_plain_http_one():
    from test_roles_host_ops import converge, executed, rig, uploads

    tls = plan(registry_address="10.0.0.5")
    state = converge({"r": rig()}, registry_role.trust, tls, "CA PEM\n", "/etc/docker/daemon.json", True)
    up = uploads(state, "r")
    assert up["/etc/docker/certs.d/10.0.0.5:5000/.staging/ca.crt"] == b"CA PEM\n"
    assert "mv -f /etc/docker/certs.d/10.0.0.5:5000/.staging/ca.crt /etc/docker/certs.d/10.0.0.5:5000/ca.crt" in (
        executed(state, "r")
    )
    # asked before Docker Hub, over TLS: a mirror, not an insecure registry; reloaded, never restarted
    assert json.loads(up["/etc/docker/.daemon.json.rigforge-new"]) == {"registry-mirrors": ["https://10.0.0.5:5000"]}
    assert "systemctl try-reload-or-restart docker.service" in executed(state, "r")
    assert not any("systemctl restart" in c for c in executed(state, "r"))
    mirrored = json.dumps({"registry-mirrors": ["https://10.0.0.5:5000"]}).splitlines()
    state = converge(
        {"r": rig(extra={"daemon.json": mirrored})},
        registry_role.trust,
        tls,
        "CA PEM\n",
        "/etc/docker/daemon.json",
        True,
    )
    assert not any("reload" in c or "daemon.json" in c and "mv" in c for c in executed(state, "r"))

    daemon = json.dumps({"storage-driver": "vfs", "insecure-registries": ["mine:5000"]}).splitlines()
    plain = plan(registry_insecure=True)
    state = converge(
        {"r": rig(extra={"daemon.json": daemon})},
        registry_role.trust,
        plain,
        None,
        "/etc/docker/daemon.json",
        True,
        execute=False,
    )
    written = json.loads(uploads(state, "r")["/etc/docker/.daemon.json.rigforge-new"])
    assert written == {
        "storage-driver": "vfs",
        "insecure-registries": ["mine:5000", "gw.lan:5000"],
        "registry-mirrors": ["http://gw.lan:5000"],
    }
    listed = json.dumps({"insecure-registries": ["gw.lan:5000"], "registry-mirrors": ["http://gw.lan:5000"]})
    listed = listed.splitlines()
    state = converge(
        {"r": rig(extra={"daemon.json": listed})}, registry_role.trust, plain, None, "/etc/docker/daemon.json", True
    )
    assert not any("reload" in c or "daemon.json" in c and "mv" in c for c in executed(state, "r"))


def test_the_registry_host_gets_its_key_0600_for_the_registrys_user_then_the_config():
    from test_roles_host_ops import converge, executed, rig

    state = converge({"gw": rig()}, registry_role.serve, plan(), ("CERT\n", "KEY\n"), True)
    commands = executed(state, "gw")
    assert any("chmod 600 /etc/docker/registry/tls/.staging/registry.key" in c for c in commands), commands
    assert any("chown docker-registry:docker-registry registry.key" in c for c in commands)
    config = next(i for i, c in enumerate(commands) if "registry/.staging/config.yml" in c)
    assert config > next(i for i, c in enumerate(commands) if "tls/.staging/registry.key" in c)
    assert commands[-1] == "systemctl start docker-registry.service"  # (re)started last, on the new files


def test_hosts_prepared_as_greenlets_share_the_ca_without_deadlock(tmp_path):
    """pyinfra prepares hosts as gevent greenlets of one process (and patches subprocess and threading): one host
    waiting for the CA dir's lock must let the one holding it finish (it once hung in flock)."""
    code = (
        "from gevent import monkey; monkey.patch_all()\n"
        "import gevent, sys\nfrom pathlib import Path\nfrom rigforge.model import registry\n"
        "d = Path(sys.argv[1])\n"
        "jobs = [gevent.spawn(registry.server_certificate, d, f'h{i}.lan') for i in range(3)]\n"
        "jobs += [gevent.spawn(registry.ca_certificate, d) for _ in range(3)]\n"
        "gevent.joinall(jobs, timeout=60, raise_error=True)\n"
        "assert all(j.successful() for j in jobs)\n"
    )
    import sys

    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ca")], capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stderr
    assert len(list((tmp_path / "ca" / "servers").glob("*.crt"))) == 3
