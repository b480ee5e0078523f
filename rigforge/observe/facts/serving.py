"""What runs on a rig: the vLLM unit's state as systemd keeps it, whether its API answers, its containers' images."""

import json
import shlex
from functools import partial
from typing import TypedDict

from pyinfra.api import FactBase

SHOWN = ("ActiveState", "SubState", "Result", "NRestarts", "UnitFileState")


class UnitState(TypedDict):
    """A systemd unit's state as ServiceState reads it (`systemctl show`)."""

    active: str  # ActiveState ("unknown" when systemd gave none)
    sub: str  # SubState
    result: str  # Result
    restarts: int  # NRestarts
    enabled: str  # UnitFileState


def parse_service_state(lines: list[str]) -> UnitState:
    """`systemctl show` lines -> {"active", "sub", "result", "restarts", "enabled"}; missing: "" (restarts 0)."""
    items = {key: value.strip() for key, sep, value in (line.strip().partition("=") for line in lines) if sep}
    restarts = items.get("NRestarts", "")
    return {
        "active": items.get("ActiveState", "") or "unknown",
        "sub": items.get("SubState", ""),
        "result": items.get("Result", ""),
        "restarts": int(restarts) if restarts.isdigit() else 0,
        "enabled": items.get("UnitFileState", ""),
    }


def serving(state: UnitState | None) -> str:
    """What a unit's state means for serving: "running", "starting" (a start job in progress: wait for it),
    "crashing" (systemd restarts it after it exited), "failed", "stopped" or "unknown" (no systemd)."""
    active = (state or {}).get("active")
    if active == "activating":
        return "crashing" if state.get("sub") == "auto-restart" else "starting"
    if active in ("active", "reloading"):
        return "running"
    return "failed" if active == "failed" else "stopped" if active in ("inactive", "deactivating") else "unknown"


class ServiceState(FactBase[UnitState]):
    """A systemd unit's state (`parse_service_state`); ``{"active": "unknown", ...}`` without systemd (a chroot)."""

    def command(self, unit: str) -> str:
        return f"systemctl show -p {','.join(SHOWN)} {shlex.quote(unit)} 2>/dev/null || true"

    default = staticmethod(partial(parse_service_state, []))

    process = staticmethod(parse_service_state)


class ApiAnswers(FactBase[int]):
    """The HTTP code of ``GET url/v1/models`` asked on the rig (0: no answer), with the API key read from the
    root-only ``env_file`` and handed to curl on stdin, never on a command line."""

    def command(self, url: str, env_file: str) -> str:
        q = shlex.quote
        return (
            f"k=$(sed -n 's/^RIGFORGE_API_KEY=//p' {q(env_file)} 2>/dev/null); "
            '{ [ -z "$k" ] || printf \'Authorization: Bearer %s\\n\' "$k"; } | '
            f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 3 -H @- {q(url + '/v1/models')} || true; echo"
        )

    default = int

    def process(self, output: list[str]) -> int:
        text = "".join(output).strip()[-3:]
        return int(text) if text.isdigit() else 0


class ComposeImages(FactBase[list[list[str]]]):
    """The RepoDigests of each running container's image of the compose project in ``serve_dir``; [] when none runs."""

    def command(self, serve_dir: str) -> str:
        return (
            f"cd {shlex.quote(serve_dir)} 2>/dev/null && for c in $(docker compose ps -q 2>/dev/null); do "
            "docker image inspect --format '{{json .RepoDigests}}' "
            '"$(docker inspect --format \'{{.Image}}\' "$c")" 2>/dev/null; done; true'
        )

    default = list

    def process(self, output: list[str]) -> list[list[str]]:
        return [json.loads(line) or [] for line in output if line.strip().startswith("[")]


def runs_digest(images: list[list[str]], digest: str | None) -> bool | None:
    """Whether some running container's image is `digest` (None: no container runs, or no digest to compare)."""
    if not images or not digest:
        return None
    return any(d.endswith(f"@{digest}") for digests in images for d in digests)
