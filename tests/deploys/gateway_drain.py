"""Test deploy: this rig leaves the fleet gateways and rejoins them at another port, the operations the serving
role runs around a restart (roles/operations/gateway.py), without a restart (the chroot testbed runs none).

    pyinfra -y <inventory with a group gateway> tests/deploys/gateway_drain.py --limit rig1 --data test_port=PORT
"""

from types import SimpleNamespace

from pyinfra import host

from rigforge.layout import HostLayout
from rigforge.model.knobs.roles import RoleKnobs
from roles.operations import gateway

gateways = {h.name: bool(h.data.get("_sudo")) for h in host.inventory.get_group("gateway")}
plan = SimpleNamespace(  # what the operations read of the rig's plan
    knobs=RoleKnobs.of({"gateway_drain_timeout": 30, "gateway_address": "127.0.0.1", "serving_health_timeout": 30}),
    variant=SimpleNamespace(served_model="qwen3.6-27b-autoround"),
    port=int(host.data.get("test_port")),
    layout=HostLayout(),
)
gateway.drained(name="Drain at the gateway", plan=plan, gateways=gateways)
gateway.rejoined(name="Rejoin the gateway", plan=plan, gateways=gateways)
