import re
from collections.abc import Mapping
from dataclasses import dataclass

from rigforge.layout import DEFAULT_ROOT
from rigforge.model import schema
from rigforge.model.knobs import Knobs, defaults_of


@dataclass(frozen=True)
class Serving(Knobs):
    """How the vLLM unit is run and gated (roles/serving.py); the rendering settings are rigforge/model/schema.py's."""

    rigforge_root: str = DEFAULT_ROOT  # root of the host layout (models, src, serve, cache)
    rigforge_manage_services: bool = True  # start/restart units, pull the image, health gate (False on the testbed)
    serving_health_timeout: int = 600  # seconds to wait for /v1/models after a (re)start, as the recipes do
    serving_health_host: str = "127.0.0.1"  # where the health gate reaches the API on the rig
    # a rig resting on purpose (maintenance): None serves; "drained": serves, but drained at every gateway;
    # "stopped": the vLLM unit stopped and disabled (through reboots), drained at every gateway. The deploy keeps
    # it so; status shows it as intended. Remove the key and re-run to serve again.
    serving_rest: str | None = None
    serving_allow_privileged_port: bool = False  # let serving_port be below 1024 (a port root services usually own)
    # on the controller, asked before a rig that lacks its image pulls it (rigforge/observe/obtain.py):
    serving_image_upstream: str | None = None  # base URL standing for Docker Hub (None: https://registry-1.docker.io)
    serving_image_upstream_ca: str | None = None  # CA bundle (PEM path) for it (None: the system's CAs)


DEFAULTS = defaults_of(Serving)


REST = (None, "drained", "stopped")  # serving_rest's values


def validate(data: Mapping) -> list[str]:
    # the rendering settings this role's host data sets
    served = {n: k for n, k in schema.HOST_KEYS.items() if k.startswith("serving_") or k == "rigforge_root"}
    problems = schema.settings(data, served)
    problems += schema.boolean(data, "rigforge_manage_services") + schema.boolean(data, "serving_allow_privileged_port")
    problems += schema.integer(data, "serving_health_timeout", 10, 86400, " of seconds")
    problems += schema.hostname(data, "serving_health_host")
    if data.get("serving_rest") not in REST:
        problems.append(f"serving_rest must be one of {', '.join(map(str, REST))}, got {data.get('serving_rest')!r}")
    problems += schema.matches(
        data,
        "serving_image_upstream",
        re.compile("https?://.*", re.S),
        what="a registry base URL (https://HOST[:PORT])",
        optional=True,
    )
    problems += schema.matches(
        data,
        "serving_image_upstream_ca",
        schema.NOT_BLANK,
        what="the path of a PEM file on the controller",
        optional=True,
    )
    return problems
