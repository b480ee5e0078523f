"""Test deploy: this rig leaves the fleet gateways and rejoins them at another port, the operations the serving
role runs around a restart (roles/operations/gateway.py), without a restart (the chroot testbed runs none).

    pyinfra -y <inventory with a group gateway> tests/deploys/gateway_drain.py --limit rig1 --data test_port=PORT
"""

from pyinfra import host

from rigforge.gateway import backend_name
from roles.operations import gateway

gateways = {h.name: bool(h.data.get("_sudo")) for h in host.inventory.get_group("gateway")}
gateway.drained(name="Drain at the gateway", gateways=gateways, server=host.name, timeout=30)
gateway.rejoined(
    name="Rejoin the gateway",
    gateways=gateways,
    server=host.name,
    backend=backend_name("qwen3.6-27b-autoround"),
    address="127.0.0.1",
    port=int(host.data.get("test_port")),
    wait=30,
)
