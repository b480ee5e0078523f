"""A rig leaves the fleet gateways before its unit restarts and comes back after (docs/gateway.md): run on the
controller when the rig's turn comes, over each gateway host's own connection (rigforge/gateway.py's scripts).
"""

import json
import shlex

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import ConnectError

from rigforge.fleet import Plan
from rigforge.gateway import backend_name, drain_script, rejoin_script, state_script
from rigforge.knobs.gateway import Gateway
from rigforge.knobs.serving import Serving
from roles.operations.shown import unchanged, warn


def _on_gateways(state, host, gateways: dict[str, bool], script: str, what: str, quiet=False) -> dict[str, str]:
    """{gateway: the last line `script` printed there}; an unreachable one is a warning; `quiet`: log failures only."""
    said = {}
    for name, sudo in gateways.items():
        gw = state.inventory.get_host(name)
        try:
            if not gw.connected:
                gw.connect(reason=f"{what} {host.name}", raise_exceptions=True)
            ok, output = gw.run_shell_command(StringCommand(script), _sudo=sudo)
            said[name] = (output.stdout_lines or output.stderr_lines or [""])[-1] if ok else output.stderr
        except ConnectError as error:
            ok, said[name] = False, f"unreachable ({error})"
        if not (quiet and ok):
            colour = "yellow" if not ok or "others up 0" in said[name] else "cyan"
            host.log_styled(f"{host.name}: {what} at gateway {name}: {said[name]}", fg=colour, log_func=logger.warning)
    return said


def _drain(state, host, gateways, plan: Plan):
    script = drain_script(host.name, Gateway.of(plan.data).gateway_drain_timeout)
    for name, said in _on_gateways(state, host, gateways, script, "drain").items():
        if said.startswith("others up 0"):
            warn(
                f"warning: no other rig serving its model is up at gateway {name}: its requests "
                "fail until this rig is back (a parallel run takes rigs out together; --serial does not)"
            )
    return True


def states(state, host, gateways: dict[str, bool], plan: Plan) -> dict[str, str]:
    """{gateway: this rig's state there (`state_script`)}; a gateway that cannot be read is left out."""
    script = state_script(host.name, backend_name(plan.variant.served_model), plan.port)
    said = _on_gateways(state, host, gateways, script, "state", quiet=True)
    return {name: word for name, word in said.items() if word in ("ready", "drain", "maint", "moved", "absent")}


def _rejoin(state, host, plan: Plan, gateways, gate, sudo):
    address = Gateway.of(plan.data).gateway_address or host.name
    wait = Serving.of(plan.data).serving_health_timeout
    if gate is None or not gate.did_error():
        script = rejoin_script(host.name, backend_name(plan.variant.served_model), address, plan.port, wait)
        _on_gateways(state, host, gateways, script, "rejoin")
        return True
    # rig.json is world-readable
    ok, output = host.run_shell_command(StringCommand(f"cat {shlex.quote(plan.layout.rig_json)} 2>/dev/null"))
    previous = json.loads(output.stdout) if ok and output.stdout.strip() else {}
    if previous.get("unit"):  # rolled back to a unit that runs, or left failing (a unit found failed): out
        active = StringCommand(f"systemctl is-active --quiet {shlex.quote(previous['unit'])}")
        # as the deploy: a login user may have no system bus
        ok, _ = host.run_shell_command(active, _sudo=sudo)
        previous = previous if ok else {**previous, "port": None}
    if previous.get("port"):
        script = rejoin_script(host.name, None, address, previous["port"], wait)
        _on_gateways(state, host, gateways, script, f"rejoin after the rollback to {previous.get('variant')}")
        said = f"the rig rolled back to {previous['variant']}, which rejoined the gateway"
    else:
        said = f"{previous.get('unit') or 'no vLLM unit'} does not serve: the rig stays drained at the gateway"
    host.log_styled(f"{host.name}: the health gate failed and {said}", fg="red", log_func=logger.error)
    return False


@operation(is_idempotent=False)
def drained(plan: Plan, gateways: dict[str, bool], held: bool = False):
    """Take this rig out of every fleet gateway, waiting up to ``gateway_drain_timeout`` s for its requests in flight.

    + plan: the rig's plan (its model, port and gateway knobs)
    + gateways: ``{inventory name: use sudo}`` of the gateway hosts
    + held: drained on purpose (host data ``serving_rest: drained``): only at the gateways where it is not yet out
    """
    if held:
        if not state.is_executing:
            return
        found = states(state, host, gateways, plan)
        gateways = {g: sudo for g, sudo in gateways.items() if found.get(g) not in (None, "drain", "maint", "absent")}
        if unchanged(not gateways, f"{host.name} rests drained at every gateway (serving_rest: drained)"):
            return
    yield FunctionCommand(_drain, (gateways, plan), {})


@operation(is_idempotent=False)
def rejoined(plan: Plan, gateways: dict[str, bool], gate=None, sudo: bool = False):
    """Put this rig back in every gateway after its health gate, or where it is out (waits ``serving_health_timeout`` s)

    + plan: the rig's plan (its model, port, rig.json, and ``gateway_address``: where the gateway reaches it)
    + gateways: ``{inventory name: use sudo}`` of the gateway hosts
    + gate: the health gate; when it failed, the rig rejoins where it rolled back to and the host fails
    + sudo: whether this rig's own commands run with sudo
    """
    if not state.is_executing:
        return  # its state at the gateways is read when the rig's turn comes
    if gate is None or not (gate.did_change() or gate.did_error()):
        out = {g: w for g, w in states(state, host, gateways, plan).items() if w != "ready"}
        if unchanged(not out, f"{host.name} serves at every gateway"):
            return
        host.log(f"{host.name} is not serving at {', '.join(f'{g} ({w})' for g, w in out.items())}: rejoining")
    yield FunctionCommand(_rejoin, (plan, gateways, gate, sudo), {})
