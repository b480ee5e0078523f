"""The fleet's front door (docs/gateway.md): one HAProxy before the rigs, a backend per served model name, its config
built from the rigs' plans and the gateway host's knobs; and the shell that drains and rejoins a rig through it."""

import hashlib
import itertools
import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from rigforge.layout import GATEWAY_ADMIN_SOCKET, GATEWAY_STATE
from rigforge.model.knobs.gateway import Gateway
from rigforge.model.render import template

MAX_MODELS = 6  # /v1/models is one answer per set of healthy models: 2**6 rules at most
NAME = re.compile(r"^[A-Za-z0-9._:/-]+$")  # a served model name the config can hold as it is
# Each rig's weight under prefix affinity: HAProxy puts 16 points per unit of weight on its consistent-hash ring.
# Weight 1 (16 points a rig) sent 600 distinct conversations to 3 rigs as 191/194/215, weight 16 (256 points) as
# 196/201/203: the finer ring keeps each rig's share of conversations near the average before the load bound acts.
RING_WEIGHT = 16


@dataclass(frozen=True)
class Server:
    name: str  # the rig's inventory name
    address: str
    port: int


@dataclass(frozen=True)
class Backend:
    name: str  # HAProxy's backend name
    model: str  # the served model name requests ask for
    api_key: str | None  # the rigs' own key, sent on to them
    servers: tuple[Server, ...]


@dataclass(frozen=True)
class GatewayPlan:
    host: str
    bind: str  # address:port the fleet's clients use
    key_hash: str | None  # sha256 of "Bearer <fleet key>", upper-case hex as HAProxy's `hex` prints it
    backends: tuple[Backend, ...]
    admin_socket: str = GATEWAY_ADMIN_SOCKET
    state_file: str = GATEWAY_STATE
    hold: Gateway = Gateway()  # the host's knobs: how it holds when a rig dies (docs/gateway.md "When a rig dies")
    metrics_bind: str | None = None  # address:port of HAProxy's Prometheus exporter (not the API's; None: none)
    ring_weight: int = RING_WEIGHT  # each rig's weight on the consistent-hash ring (prefix affinity only)

    @property
    def affinity(self) -> bool:
        """True: a conversation's requests go to one rig (docs/gateway.md "Prefix affinity"); False: leastconn."""
        return self.hold.gateway_balance == "affinity"

    @property
    def session_header(self) -> str:
        """The header a client names its conversation by, the affinity key when it is sent."""
        return self.hold.gateway_session_header

    @property
    def fastinter_ms(self) -> int:
        """The check period once a check fails: half the usual one, at least 100 ms."""
        return max(100, self.hold.gateway_check_interval_ms // 2)

    @property
    def model_lists(self) -> list[tuple[list[str], list[str], str]]:
        """(backends that must have a healthy rig, backends that must have none, the /v1/models answer)."""
        out = []
        for up in itertools.product((True, False), repeat=len(self.backends)):
            serving = [b for b, ok in zip(self.backends, up, strict=True) if ok]
            models = [{"id": b.model, "object": "model", "owned_by": "rigforge"} for b in serving]
            body = json.dumps({"object": "list", "data": models}, separators=(",", ":"))
            out.append(([b.name for b in serving], [b.name for b in self.backends if b not in serving], body))
        return out


def backend_name(model: str) -> str:
    """HAProxy's backend for a served model name: what a rig's drain and rejoin find it by."""
    return "m_" + re.sub(r"[^A-Za-z0-9]+", "_", model)


def build(host: str, knobs: Gateway, rigs: Sequence) -> tuple[GatewayPlan | None, list[str]]:
    """The gateway of `host` (its knobs, checked) in front of `rigs` (their plans), and every problem."""
    fleet_key = knobs.gateway_api_key
    by_model: dict[str, list] = {}  # served model name -> the plans of the rigs serving it, in the rigs' order
    for plan in rigs:
        by_model.setdefault(plan.variant.served_model, []).append(plan)
    problems = []
    if not rigs:
        problems.append("no rig in the inventory to put behind the gateway (hosts outside the group `gateway`)")
    if len(by_model) > MAX_MODELS:
        problems.append(f"the rigs serve {len(by_model)} model names; one gateway fronts at most {MAX_MODELS}")
    backends = []
    for model, plans in sorted(by_model.items()):
        keys = {p.settings.api_key for p in plans}
        if not NAME.fullmatch(model):
            problems.append(f"served model name {model!r} has characters the gateway config cannot hold")
        if len(keys) > 1:
            problems.append(f"the rigs serving {model} have different serving_api_key values; give them one key")
        if None not in keys and not fleet_key:
            problems.append(
                f"the rigs serving {model} require an API key: set gateway_api_key, or the gateway would open them"
            )
        plans.sort(key=lambda p: p.host)
        servers = tuple(Server(p.host, p.knobs.gateway.gateway_address or p.host, p.port) for p in plans)
        backends.append(Backend(backend_name(model), model, keys.pop(), servers))
    if len({b.name for b in backends}) < len(backends):
        problems.append(f"served model names {sorted(by_model)} differ only in punctuation; rename one")
    if problems:
        return None, problems
    if knobs.gateway_metrics_port == knobs.gateway_port:
        return None, [f"gateway_metrics_port must differ from gateway_port ({knobs.gateway_port})"]
    bind = f"{knobs.gateway_bind_address or ''}:{knobs.gateway_port}"
    metrics_bind = f"{knobs.gateway_bind_address or ''}:{knobs.gateway_metrics_port}"
    key_sha = hashlib.sha256(f"Bearer {fleet_key}".encode()).hexdigest().upper() if fleet_key else None
    return GatewayPlan(host, bind, key_sha, tuple(backends), hold=knobs, metrics_bind=metrics_bind), []


def render(plan: GatewayPlan) -> str:
    """HAProxy's config for `plan` (templates/rigforge-gateway.cfg.j2)."""
    return template("rigforge-gateway.cfg.j2").render(gw=plan)


# ---- the runtime API, around a rig's restart (roles/operations/gateway.py runs these on every gateway host)


def _runtime(server: str) -> str:
    """Shell helpers: `cli CMD` (HAProxy's runtime API), `stat AWK` on `show stat` (CSV: 1 backend, 2 server, 3 queued,
    5 sessions, 18 status; `s`: the server), `save` (the runtime state, ports and drains, for the next reload)."""
    state, socket = shlex.quote(GATEWAY_STATE), shlex.quote(GATEWAY_ADMIN_SOCKET)
    return f"""
cli() {{ echo "$1" | socat stdio UNIX-CONNECT:{socket}; }}
stat() {{ cli "show stat" | awk -F, -v s={shlex.quote(server)} "$1"; }}
save() {{ cli "show servers state" > {state}.tmp && mv {state}.tmp {state}; }}
[ -S {socket} ] || {{ echo "gateway: not running here"; exit 0; }}
backends=$(stat '$2 == s {{ print $1 }}')
[ -n "$backends" ] || {{ echo "gateway: {server} is not behind it"; exit 0; }}
"""


def drain_script(server: str, timeout: int) -> str:
    """Shell, on a gateway host: no new requests for `server`, then wait (at most `timeout` s) until its requests
    in flight and queued are done. Prints `others up N`: how many other rigs of its models are up."""
    return f"""{_runtime(server)}
for b in $backends; do cli "set server $b/{server} state drain" >/dev/null; done
save
echo "others up $(cli "show stat" | awk -F, -v s={shlex.quote(server)} -v bs=" $(echo $backends) " \
  'index(bs, " " $1 " ") && $2 != s && $2 != "BACKEND" && $18 ~ /^UP/ {{ n++ }} END {{ print n + 0 }}')"
waited=0
while busy=$(stat '$2 == s {{ n += $3 + $5 }} END {{ print n + 0 }}') && [ "$busy" != 0 ]; do
  [ $waited -lt {int(timeout)} ] || {{ echo "gateway: $busy request(s) in flight after {int(timeout)} s"; exit 0; }}
  sleep 1; waited=$((waited + 1))
done
echo "gateway: drained after $waited s"
"""


STAT_MARK = "# show stat"  # between the two answers of `read_servers_script`


def read_servers_script() -> str:
    """Shell, on a gateway host: HAProxy's `show servers state` (admin and operational state, port), then a line
    STAT_MARK, then `show stat` (status since, last check); nothing without a gateway there. Parsed by
    `observe.gateway_servers`."""
    socket = shlex.quote(GATEWAY_ADMIN_SOCKET)
    return f"""[ -S {socket} ] || exit 0
echo "show servers state" | socat stdio UNIX-CONNECT:{socket}
echo {shlex.quote(STAT_MARK)}
echo "show stat" | socat stdio UNIX-CONNECT:{socket}
"""


def rejoin_script(server: str, backend: str | None, address: str, port: int, wait: int = 60) -> str:
    """Shell, on a gateway host: `server` back in `backend` (None: wherever it is) at `address`:`port` (a name is
    resolved there), out of the backends of models it no longer serves; then wait (at most `wait` s) until the
    gateway's own health check sees it up."""
    return f"""{_runtime(server)}
ip=$(getent ahosts {shlex.quote(address)} | awk '{{ print $1; exit }}')
[ -n "$ip" ] || {{ echo "gateway: cannot resolve {address}" >&2; exit 1; }}
for b in $backends; do
  if [ -z {shlex.quote(backend or "")} ] || [ "$b" = {shlex.quote(backend or "")} ]; then
    cli "set server $b/{server} addr $ip port {int(port)}" >/dev/null
    cli "set server $b/{server} state ready" >/dev/null
  else
    cli "set server $b/{server} state maint" >/dev/null
  fi
done
save
waited=0
until stat '$2 == s && $18 ~ /^UP/ {{ up = 1 }} END {{ exit !up }}'; do
  [ $waited -lt {int(wait)} ] || {{ echo "gateway: {server} not healthy yet after {int(wait)} s"; exit 0; }}
  sleep 1; waited=$((waited + 1))
done
echo "gateway: {server} serving at $ip:{int(port)} after $waited s"
"""
