import re
from collections.abc import Mapping
from dataclasses import dataclass

from rigforge.model import schema
from rigforge.model.knobs import Knobs, defaults_of, knob


@dataclass(frozen=True)
class Gateway(Knobs):
    """The fleet's gateway (roles/gateway.py, HAProxy): its endpoint on a gateway host, how a rig is reached and
    drained, what is done when a rig dies, which rig takes a request (docs/gateway.md)."""

    gateway_port: int = 8088  # on a gateway host: the fleet's one endpoint
    gateway_metrics_port: int = 8405  # on a gateway host: HAProxy's Prometheus exporter (/metrics), not the API's port
    gateway_bind_address: str | None = None  # on a gateway host: the address it listens on (None: every address)
    # on a gateway host: where clients reach it, as status shows it (None: http://HOST:PORT)
    gateway_url: str | None = None
    # on a gateway host: the fleet's key, checked there (the config keeps its sha256; secret: left out of a repr)
    gateway_api_key: str | None = knob(None, secret=True)
    gateway_address: str | None = None  # on a rig: the address the gateway reaches it on (None: its inventory name)
    gateway_drain_timeout: int = 300  # on a rig: seconds its requests in flight get to finish before a restart
    # when a rig dies (docs/gateway.md "When a rig dies"), on a gateway host:
    gateway_retries: int = 3  # retries of a request a dead rig refused or answered empty/502/503; each on another rig
    gateway_bufsize: int = 1048576  # bytes (HAProxy tune.bufsize): a bigger request body is not routed nor retried
    gateway_check_interval_ms: int = 1000  # /health checked this often on every rig (half of it once one fails)
    gateway_check_fall: int = 2  # failed checks in a row that mark a rig DOWN (1 s + 2 x 0.5 s: down within 2 s)
    gateway_check_rise: int = 2  # passed checks in a row that bring a rig back UP
    gateway_error_limit: int = 3  # errors in a row on live requests (refused, empty, 5xx) that mark a rig DOWN at once
    gateway_keepalive_s: int = 1  # idle seconds before TCP keepalive probes a rig whose host may be gone (1 s apart)
    gateway_tcp_user_timeout_s: int = 2  # seconds a rig may leave data or probes unanswered before its connection ends
    # which rig takes a request (docs/gateway.md "Prefix affinity"), on a gateway host:
    gateway_balance: str = "affinity"  # affinity: a conversation stays on one rig (its prefix cached); or leastconn
    gateway_hash_balance_factor: int = 200  # affinity: no rig takes more than this % of the average load in flight
    gateway_session_header: str = "X-Session-Id"  # affinity: a client's conversation id, the key when it is sent


DEFAULTS = defaults_of(Gateway)
BALANCES = ("affinity", "leastconn")
HEADER = re.compile(r"^[A-Za-z0-9-]{1,64}$")  # an HTTP header name the config can hold as it is


def validate(data: Mapping) -> list[str]:
    """Every problem of the gateway knobs in `data` (a host's data, defaults applied), one message each."""
    problems = schema.integer(data, "gateway_port", 1, 65535)
    problems += schema.integer(data, "gateway_metrics_port", 1, 65535)
    problems += schema.integer(data, "gateway_drain_timeout", 0, 86400, " of seconds")
    problems += schema.integer(data, "gateway_retries", 0, 10)
    problems += schema.integer(data, "gateway_bufsize", 16384, 16777216, " of bytes")
    problems += schema.integer(data, "gateway_check_interval_ms", 100, 60000, " of ms")
    problems += schema.integer(data, "gateway_check_fall", 1, 10)
    problems += schema.integer(data, "gateway_check_rise", 1, 10)
    problems += schema.integer(data, "gateway_error_limit", 1, 100)
    problems += schema.integer(data, "gateway_keepalive_s", 1, 3600, " of seconds")
    problems += schema.integer(data, "gateway_tcp_user_timeout_s", 1, 3600, " of seconds")
    problems += schema.choice(data, "gateway_balance", BALANCES)
    problems += schema.integer(data, "gateway_hash_balance_factor", 101, 1000, " of percent")
    problems += schema.matches(data, "gateway_session_header", HEADER, "an HTTP header name (letters, digits, -)")
    problems += schema.settings(data, {"bind_address": "gateway_bind_address", "api_key": "gateway_api_key"})
    problems += schema.http_url(data, "gateway_url", "clients reach the gateway at")
    return problems + schema.hostname(data, "gateway_address", optional=True)
