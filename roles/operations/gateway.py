"""A rig leaves the fleet gateways before its unit restarts and comes back after (docs/gateway.md): run on the
controller when the rig's turn comes, over each gateway host's own connection (rigforge/model/gateway.py's scripts).
"""

import json
import shlex

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import ConnectError
from pyinfra.api.host import Host
from pyinfra.api.operation import OperationMeta
from pyinfra.api.state import State

from rigforge.model.fleet import Plan
from rigforge.model.gateway import backend_name, drain_script, read_servers_script, rejoin_script
from rigforge.observe import verdict
from rigforge.observe.hosts import gateway_servers
from roles.operations.shown import Commands, unchanged, warn


def _run_at(state: State, host: Host, gateway: str, sudo: bool, script: str, what: str) -> tuple[bool, list[str]]:
    """(ran, the lines it printed, or why not) of `script` on the gateway host `gateway`, over its own connection."""
    gw = state.inventory.get_host(gateway)
    try:
        if not gw.connected:
            gw.connect(reason=f"{what} {host.name}", raise_exceptions=True)
        ok, output = gw.run_shell_command(StringCommand(script), _sudo=sudo)
    except ConnectError as error:
        return False, [f"unreachable ({error})"]
    if not ok:
        return False, output.stderr_lines or [""]
    return True, output.stdout_lines or output.stderr_lines or [""]


def _on_gateways(
    state: State, host: Host, gateways: dict[str, bool], script: str, what: str, quiet: bool = False
) -> dict[str, str]:
    """{gateway: the last line `script` printed there}; an unreachable one is a warning; `quiet`: log failures only."""
    said = {}
    for name, sudo in gateways.items():
        ok, lines = _run_at(state, host, name, sudo, script, what)
        said[name] = lines[-1]
        if not (quiet and ok):
            colour = "yellow" if not ok or "others up 0" in said[name] else "cyan"
            host.log_styled(f"{host.name}: {what} at gateway {name}: {said[name]}", fg=colour, log_func=logger.warning)
    return said


def _drain(state: State, host: Host, gateways: dict[str, bool], plan: Plan) -> bool:
    script = drain_script(host.name, plan.knobs.gateway.gateway_drain_timeout)
    for name, said in _on_gateways(state, host, gateways, script, "drain").items():
        if said.startswith("others up 0"):
            warn(
                f"warning: no other rig serving its model is up at gateway {name}: its requests "
                "fail until this rig is back (a parallel run takes rigs out together; --serial does not)"
            )
    return True


def servers_at(state: State, host: Host, gateways: dict[str, bool]) -> dict[str, dict[str, dict]]:
    """{gateway: this rig's servers there, `{backend: record}` (`observe.gateway_servers`)}; a gateway that cannot be
    read, or has no server of this rig, is left out (a warning when it cannot be read)."""
    found = {}
    for name, sudo in gateways.items():
        ok, lines = _run_at(state, host, name, sudo, read_servers_script(), "read")
        if not ok:
            host.log_styled(f"{host.name}: read at gateway {name}: {lines[-1]}", fg="yellow", log_func=logger.warning)
            continue
        servers = gateway_servers("\n".join(lines)).get(host.name)
        if servers:
            found[name] = servers
    return found


def not_as_declared(found: dict[str, dict[str, dict]], plan: Plan, rest: str | None) -> dict[str, list[str]]:
    """{gateway: what differs} for the gateways where this rig is not as `plan` (and `rest`) declare:
    `verdict.gateway_server`, the list `rigforge status` shows in "serving at the gateways"."""
    backend = backend_name(plan.variant.served_model)
    out = {}
    for name, servers in found.items():
        problems = verdict.gateway_server(servers, backend, plan.port, rest)
        if problems:
            out[name] = problems
    return out


def _rejoin(
    state: State, host: Host, plan: Plan, gateways: dict[str, bool], gate: OperationMeta | None, sudo: bool
) -> bool:
    address = plan.knobs.gateway.gateway_address or host.name
    wait = plan.knobs.serving.serving_health_timeout
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
def drained(plan: Plan, gateways: dict[str, bool], held: bool = False) -> Commands:
    """Take this rig out of every fleet gateway and wait until its requests in flight are done (up to
    ``gateway_drain_timeout`` s, then it restarts, or rests, anyway); a warning where no other rig of its model is up
    at a gateway.

    + plan: the rig's plan (its model, port and gateway knobs)
    + gateways: ``{inventory name: use sudo}`` of the gateway hosts
    + held: drained on purpose (host data ``serving_rest: drained``): only at the gateways where it is not yet out

    **Example:**

    .. code:: python

        from roles.operations import gateway
        gateway.drained(
            name="Drain rig-a.example.lan at the fleet gateway before the restart",
            plan=plan,
            gateways={"gw.example.lan": True},  # {inventory name: use sudo}
        )
        gateway.drained(
            name="Keep rig-a.example.lan drained at the fleet gateway (serving_rest: drained)",
            plan=plan,
            gateways={"gw.example.lan": True},
            held=True,
        )
    """
    if held:
        if not state.is_executing:
            return
        differs = not_as_declared(servers_at(state, host, gateways), plan, rest="drained")
        gateways = {g: sudo for g, sudo in gateways.items() if g in differs}
        if unchanged(not gateways, f"{host.name} rests drained at every gateway (serving_rest: drained)"):
            return
    yield FunctionCommand(_drain, (gateways, plan), {})


@operation(is_idempotent=False)
def rejoined(plan: Plan, gateways: dict[str, bool], gate: OperationMeta | None = None, sudo: bool = False) -> Commands:
    """Put this rig back in every gateway after its health gate, or where it is out, and out of the backends of models
    it no longer serves; then wait up to ``serving_health_timeout`` s for each gateway's health check to see it up.

    + plan: the rig's plan (its model, port, rig.json, and ``gateway_address``: where the gateway reaches it)
    + gateways: ``{inventory name: use sudo}`` of the gateway hosts
    + gate: the health gate; when it failed, the rig rejoins where it rolled back to and the host fails
    + sudo: whether this rig's own commands run with sudo

    **Example:**

    .. code:: python

        from roles.operations import gateway
        gateway.rejoined(
            name=f"Rejoin the fleet gateway on port {plan.port}",
            plan=plan,
            gateways={"gw.example.lan": True},  # {inventory name: use sudo}
            gate=gate,  # serving.healthy's
            sudo=True,
        )
    """
    if not state.is_executing:
        return  # its state at the gateways is read when the rig's turn comes
    if gate is None or not (gate.did_change() or gate.did_error()):
        differs = not_as_declared(servers_at(state, host, gateways), plan, rest=None)
        if unchanged(not differs, f"{host.name} serves at every gateway"):
            return
        said = "; ".join(f"{'; '.join(problems)} at {g}" for g, problems in differs.items())
        host.log(f"{host.name} is not serving as declared: {said}: rejoining")
    yield FunctionCommand(_rejoin, (plan, gateways, gate, sudo), {})
