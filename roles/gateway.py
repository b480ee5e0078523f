"""The fleet gateway: Debian's HAProxy in front of the rigs (docs/gateway.md). Its config is root's only (it holds
the rigs' key); a drop-in points the distro's haproxy.service at it and leaves /etc/haproxy/haproxy.cfg alone.
"""

from pyinfra.api import deploy
from pyinfra.operations import apt, systemd

from rigforge import layout
from rigforge.model import gateway
from rigforge.model.gateway import GatewayPlan
from roles.operations import systemd_units
from roles.operations.staged import staged_files

SAVE_STATE = (
    f"echo 'show servers state' | socat stdio UNIX-CONNECT:{layout.GATEWAY_ADMIN_SOCKET} > {layout.GATEWAY_STATE}"
)
DROPIN = f"""# rigforge: haproxy.service runs the fleet gateway's config (roles/gateway.py); a reload keeps the
# servers' runtime state (drained rigs, the ports they moved to)
[Service]
Environment="CONFIG={layout.GATEWAY_DIR}/{layout.GATEWAY_CFG}"
RuntimeDirectory=haproxy
RuntimeDirectoryPreserve=yes
ExecReload=
ExecReload=-/bin/sh -c "{SAVE_STATE}"
ExecReload=/usr/sbin/haproxy -Ws -f $CONFIG -c -q $EXTRAOPTS
ExecReload=/bin/kill -USR2 $MAINPID
"""


@deploy("Fleet gateway (HAProxy)")
def apply(gw: GatewayPlan, manage_services: bool) -> None:
    """HAProxy with rigforge's config for the fleet's backends (validated by haproxy -c) and a drop-in pointing its
    unit at it; when services are managed, restarted on a new drop-in, else reloaded on a new config."""
    apt.packages(name="Install HAProxy and socat (Debian's), its runtime API's client", packages=["haproxy", "socat"])
    config = staged_files(
        name=f"Install the gateway config for {len(gw.backends)} model(s) (validated by haproxy -c)",
        dest=layout.GATEWAY_DIR,
        files={layout.GATEWAY_CFG: (gateway.render(gw), "600")},
        validate=f"haproxy -c -q -f {layout.GATEWAY_CFG}",
    )
    dropin = staged_files(
        name=f"Point {layout.GATEWAY_UNIT} at the gateway config",
        dest=layout.GATEWAY_DROPIN_DIR,
        files={layout.GATEWAY_DROPIN: (DROPIN, "644")},
        keep_previous=False,
    )
    systemd.daemon_reload(name="Reload systemd units", _if=dropin.did_change)
    if manage_services:
        # a reload re-reads the config the running master was started with: a new CONFIG path needs a restart
        systemd_units.running(
            layout.GATEWAY_UNIT,
            at_boot=True,
            restarted=(f"Restart {layout.GATEWAY_UNIT} on rigforge's config", dropin.did_change),
            reloaded=(
                f"Reload {layout.GATEWAY_UNIT} on the new config (connections kept)",
                lambda: config.did_change() and not dropin.did_change(),
            ),
        )
