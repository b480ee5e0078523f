"""Operations for the serving role: one enabled vLLM instance, the image, the rig manifest, the health gate."""

from __future__ import annotations

import json
import shlex

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from rigforge.layout import VLLM_TEMPLATE, HostLayout
from rigforge.obtain import parse
from roles.facts.docker import DockerImagePresent
from roles.facts.files import JsonFile
from roles.facts.nvidia import NvidiaGpus, NvidiaTopology
from roles.facts.system import EnabledInstances
from roles.operations.shown import ShownCommand, say
from roles.operations.staged import upload_privately

MANIFEST_VOLATILE = ("provisioned_at",)
UNIT_DIR = HostLayout.unit_dir  # the layout's default; callers pass their plan's layout.unit_dir


@operation()
def sole_instance(unit: str, stop_others: bool, unit_dir: str = UNIT_DIR, template: str = VLLM_TEMPLATE):
    """
    Enable ``unit`` and disable every other enabled instance of the vLLM template unit.

    + unit: the instance to keep enabled, e.g. ``name@dual.service``
    + stop_others: also stop the others (``disable --now``), when services are managed
    + unit_dir: the systemd unit dir (the layout's ``unit_dir``)
    + template: the template unit the instances belong to (the layout's ``vllm_template``)
    """
    enabled = enabled_instances(unit_dir, template)
    others = [u for u in enabled if u != unit]
    for other in others:
        yield StringCommand("systemctl", "disable", *(["--now"] if stop_others else []), QuoteString(other))
    if unit not in enabled:
        yield StringCommand("systemctl", "enable", QuoteString(unit))
    if not others and unit in enabled:
        host.noop(f"{unit} is the only enabled vLLM instance")


@operation()
def image_present(image: str):
    """
    ``docker pull`` the image by its locked digest unless the engine already holds it (needs a running engine),
    its progress shown line by line. Docker asks the fleet registry first when the rig lists it in
    registry-mirrors (roles/registry.py); layers a cut pull left complete are not fetched again.

    + image: the pinned image reference, ``repo[:tag]@sha256:...`` (or ``repo:tag`` while the lock has no digest)
    """
    if host.get_fact(DockerImagePresent, image=image):
        host.noop(f"{image} already present")
        return
    ref = parse(image)
    yield say(f"pulling {ref.pinned}")
    yield ShownCommand("docker", "pull", QuoteString(ref.pinned))


def enabled_instances(unit_dir: str = UNIT_DIR, template: str = VLLM_TEMPLATE) -> list[str]:
    """Instances of the vLLM template unit enabled at boot, sorted, e.g. ['name@dual.service']."""
    return host.get_fact(EnabledInstances, unit_dir=unit_dir, template=template)


def _stable(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in MANIFEST_VOLATILE}


@operation()
def manifest(path: str, content: dict, now: str):
    """
    Write the rig manifest (rig.json): ``content`` plus the rig's GPUs and their interconnect (``nvidia-smi topo
    -m``, ``topo -p2p r``) as seen when this runs, and the time.
    Rewritten only when something other than the time differs, so a converged rig stays unchanged.

    + path: where the manifest goes (the layout's ``rig_json``)
    + content: what it records (variant, unit, port, pins...)
    + now: the time to record as ``provisioned_at`` (ISO 8601)
    """
    gpus = [
        {k: gpu.get(k) for k in ("index", "uuid", "name", "memory_total", "power_limit", "driver_version")}
        for gpu in host.get_fact(NvidiaGpus) or []
    ]
    wanted = {**content, "gpus": gpus, "interconnect": host.get_fact(NvidiaTopology)}
    current = host.get_fact(JsonFile, path=path) or {}
    if _stable(current) == wanted:
        host.noop(f"{path} up to date")
        return
    text = json.dumps({**wanted, "provisioned_at": now}, indent=2, sort_keys=True) + "\n"
    yield StringCommand("mkdir", "-p", QuoteString(path.rsplit("/", 1)[0]))
    yield from upload_privately(text, f"{path}.tmp")
    yield StringCommand("chmod", "644", QuoteString(f"{path}.tmp"))
    yield StringCommand("mv", "-f", QuoteString(f"{path}.tmp"), QuoteString(path))


def health_gate_script(url: str, model: str, timeout: int, unit: str, rollback_unit: str | None, serve_dir: str) -> str:
    """Shell: wait for /v1/models, send one chat completion; on failure roll back and print the log tail.

    A server that exits while starting fails the gate at once (the unit's Restart= would otherwise keep it
    "activating" until the timeout). The journal is read with -a and colour codes removed: compose's attached
    output carries escape codes, which journalctl otherwise shows as "[blob data]".

    Rollback: back to the previously enabled variant's instance when this run switched variants; otherwise
    back to this variant's previous compose file and .env (`*.prev`, kept by staged_files). The API key, if
    any, is read from the root-only .env and handed to curl on stdin, never on a command line.
    """
    q = shlex.quote
    if rollback_unit:
        rollback = f"systemctl disable --now {q(unit)}; systemctl enable --now {q(rollback_unit)}"
    else:
        rollback = (
            f"if [ -f {q(serve_dir)}/docker-compose.yml.prev ]; then "
            f"mv -f {q(serve_dir)}/docker-compose.yml.prev {q(serve_dir)}/docker-compose.yml; "
            f"mv -f {q(serve_dir)}/.env.prev {q(serve_dir)}/.env; "
            f"if [ -f {q(serve_dir)}/compose.override.yml.prev ]; then "  # a recipe slug's host override
            f"mv -f {q(serve_dir)}/compose.override.yml.prev {q(serve_dir)}/compose.override.yml; fi; "
            f"systemctl restart {q(unit)}; "
            f"else systemctl disable --now {q(unit)}; fi"
        )
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 8})
    return f"""
RIGFORGE_API_KEY=$(sed -n 's/^RIGFORGE_API_KEY=//p' {q(serve_dir)}/.env 2>/dev/null)
auth() {{ [ -z "$RIGFORGE_API_KEY" ] || printf 'Authorization: Bearer %s\n' "$RIGFORGE_API_KEY"; }}
deadline=$(( $(date +%s) + {int(timeout)} ))
fail() {{
  echo "rigforge health gate: $1" >&2
  journalctl -a -u {q(unit)} -n 40 --no-pager 2>/dev/null | sed 's/\\x1b\\[[0-9;]*[A-Za-z]//g' >&2 || true
  {rollback}
  echo "rigforge health gate: rolled back" >&2
  exit 1
}}
until auth | curl -sf --max-time 3 -H @- {q(url)}/v1/models >/dev/null; do
  [ "$(date +%s)" -lt "$deadline" ] || fail "no answer from {url}/v1/models within {int(timeout)} s"
  systemctl is-failed --quiet {q(unit)} && fail "{unit} failed while starting"
  restarts=$(systemctl show -P NRestarts {q(unit)} 2>/dev/null)
  [ "${{restarts:-0}}" = 0 ] || fail "the server exited while starting ({unit} restarts it)"
  sleep 4
done
auth | curl -sf --max-time 120 -H @- -H 'Content-Type: application/json' -d {q(body)} \
  {q(url)}/v1/chat/completions | grep -q '"choices"' || fail "chat completion did not answer"
echo "rigforge health gate: {url} serves {model}"
""".strip()
