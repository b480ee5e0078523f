"""The fleet gateway: Debian's HAProxy in front of the rigs, on the hosts of the inventory group `gateway`.

The config (rigforge/gateway.py renders it from the rigs' plans) lands in /etc/rigforge/gateway, root only (it
holds the rigs' key), once `haproxy -c` accepts it; a drop-in points the distro's haproxy.service at it and
leaves /etc/haproxy/haproxy.cfg alone. HAProxy reloads, without dropping connections, when the config changed;
it restarts once, when the drop-in lands (a reload keeps the config path it started with).
"""

from __future__ import annotations

from collections.abc import Mapping

from pyinfra.api import deploy
from pyinfra.operations import apt, systemd

from rigforge import gateway, schema
from rigforge.gateway import GatewayPlan
from rigforge.layout import (
    GATEWAY_ADMIN_SOCKET,
    GATEWAY_CFG,
    GATEWAY_DIR,
    GATEWAY_DROPIN,
    GATEWAY_DROPIN_DIR,
    GATEWAY_STATE,
    GATEWAY_UNIT,
)
from roles.operations.staged import staged_files

DEFAULTS = {
    "gateway_port": 8088,  # on a gateway host: the fleet's one endpoint
    "gateway_bind_address": None,  # on a gateway host: the address it listens on (None: every address)
    "gateway_api_key": None,  # on a gateway host: the fleet's key, checked there (the config keeps its sha256)
    "gateway_address": None,  # on a rig: the address the gateway reaches it on (None: its inventory name)
    "gateway_drain_timeout": 300,  # on a rig: seconds its requests in flight get to finish before a restart
    # when a rig dies (docs/gateway.md "When a rig dies"), on a gateway host:
    "gateway_retries": 3,  # retries of a request a dead rig refused or answered empty/502/503; each on another rig
    "gateway_bufsize": 1048576,  # bytes (HAProxy tune.bufsize): a bigger request body is not routed nor retried
    "gateway_check_interval_ms": 1000,  # /health checked this often on every rig (half of it once one fails)
    "gateway_check_fall": 2,  # failed checks in a row that mark a rig DOWN (1 s + 2 x 0.5 s: down within 2 s)
    "gateway_check_rise": 2,  # passed checks in a row that bring a rig back UP
    "gateway_error_limit": 3,  # errors in a row on live requests (refused, empty, 5xx) that mark a rig DOWN at once
    "gateway_keepalive_s": 10,  # idle seconds before TCP keepalive probes a rig whose host may be gone (3 x 1 s)
}
SAVE_STATE = f"echo 'show servers state' | socat stdio UNIX-CONNECT:{GATEWAY_ADMIN_SOCKET} > {GATEWAY_STATE}"
DROPIN = f"""# rigforge: haproxy.service runs the fleet gateway's config (roles/gateway.py); a reload keeps the
# servers' runtime state (drained rigs, the ports they moved to)
[Service]
Environment="CONFIG={GATEWAY_DIR}/{GATEWAY_CFG}"
RuntimeDirectory=haproxy
RuntimeDirectoryPreserve=yes
ExecReload=
ExecReload=-/bin/sh -c "{SAVE_STATE}"
ExecReload=/usr/sbin/haproxy -Ws -f $CONFIG -c -q $EXTRAOPTS
ExecReload=/bin/kill -USR2 $MAINPID
"""


def validate(data: Mapping) -> list[str]:
    problems = schema.integer(data, "gateway_port", 1, 65535)
    problems += schema.integer(data, "gateway_drain_timeout", 0, 86400, " of seconds")
    problems += schema.integer(data, "gateway_retries", 0, 10)
    problems += schema.integer(data, "gateway_bufsize", 16384, 16777216, " of bytes")
    problems += schema.integer(data, "gateway_check_interval_ms", 100, 60000, " of ms")
    problems += schema.integer(data, "gateway_check_fall", 1, 10)
    problems += schema.integer(data, "gateway_check_rise", 1, 10)
    problems += schema.integer(data, "gateway_error_limit", 1, 100)
    problems += schema.integer(data, "gateway_keepalive_s", 1, 3600, " of seconds")
    problems += schema.setting(data, "gateway_bind_address", "bind_address")
    problems += schema.setting(data, "gateway_api_key", "api_key")
    if data.get("gateway_address") is not None:
        problems += schema.hostname(data, "gateway_address")
    return problems


@deploy("Fleet gateway (HAProxy)", data_defaults=DEFAULTS)
def apply(gw: GatewayPlan, manage_services: bool):
    apt.packages(name="Install HAProxy and socat (Debian's), its runtime API's client", packages=["haproxy", "socat"])
    config = staged_files(
        name=f"Install the gateway config for {len(gw.backends)} model(s) (validated by haproxy -c)",
        dest=GATEWAY_DIR,
        files={GATEWAY_CFG: (gateway.render(gw), "600")},
        validate=f"haproxy -c -q -f {GATEWAY_CFG}",
    )
    dropin = staged_files(
        name=f"Point {GATEWAY_UNIT} at the gateway config",
        dest=GATEWAY_DROPIN_DIR,
        files={GATEWAY_DROPIN: (DROPIN, "644")},
        keep_previous=False,
    )
    systemd.daemon_reload(name="Reload systemd units", _if=dropin.did_change)
    if manage_services:
        systemd.service(name=f"Run {GATEWAY_UNIT}", service=GATEWAY_UNIT, running=True, enabled=True)
        # a reload re-reads the config the running master was started with: a new CONFIG path needs a restart
        systemd.service(
            name=f"Restart {GATEWAY_UNIT} on rigforge's config",
            service=GATEWAY_UNIT,
            restarted=True,
            _if=dropin.did_change,
        )
        systemd.service(
            name=f"Reload {GATEWAY_UNIT} on the new config (connections kept)",
            service=GATEWAY_UNIT,
            reloaded=True,
            _if=lambda: config.did_change() and not dropin.did_change(),
        )
