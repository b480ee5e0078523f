"""Operations for the serving role: one enabled vLLM instance, the image, the rig manifest, the health gate."""

from __future__ import annotations

import json
import shlex

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation
from pyinfra.facts.server import Command

from roles.facts.nvidia import NvidiaGpus
from roles.operations.staged import upload_privately

MANIFEST_VOLATILE = ("provisioned_at",)


@operation()
def sole_instance(unit: str, stop_others: bool):
    """Enable `unit` and disable (and stop, when services are managed) every other vLLM instance."""
    others = [u for u in enabled_instances() if u != unit]
    for other in others:
        yield StringCommand("systemctl", "disable", *(["--now"] if stop_others else []), QuoteString(other))
    if unit not in enabled_instances():
        yield StringCommand("systemctl", "enable", QuoteString(unit))
    if not others and unit in enabled_instances():
        host.noop(f"{unit} is the only enabled vLLM instance")


@operation()
def image_present(image: str):
    """`docker pull` the pinned image unless it is already present (needs a running engine)."""
    present = host.get_fact(
        Command, command=f"docker image inspect {shlex.quote(image)} >/dev/null 2>&1 && echo yes || echo no"
    )
    if (present or "").strip() == "yes":
        host.noop(f"{image} already present")
        return
    yield StringCommand("docker", "pull", "--quiet", QuoteString(image))


def enabled_instances(template: str = "rigforge-vllm@") -> list[str]:
    """Instances of the vLLM template unit enabled at boot, e.g. ['rigforge-vllm@dual.service']."""
    out = host.get_fact(
        Command,
        command=f"ls /etc/systemd/system/multi-user.target.wants/ 2>/dev/null | grep '^{template}' || true",
    )
    return sorted(line.strip() for line in (out or "").splitlines() if line.strip())


def _stable(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in MANIFEST_VOLATILE}


@operation()
def manifest(path: str, content: dict, now: str):
    """Write /etc/rigforge/rig.json: `content` plus the rig's GPUs as seen when this runs, and the time.

    Rewritten only when something other than the time differs, so a converged rig stays unchanged.
    """
    gpus = [
        {k: gpu.get(k) for k in ("index", "uuid", "name", "memory_total", "power_limit", "driver_version")}
        for gpu in host.get_fact(NvidiaGpus) or []
    ]
    wanted = {**content, "gpus": gpus}
    raw = host.get_fact(Command, command=f"cat {shlex.quote(path)} 2>/dev/null || true")
    try:
        current = json.loads(raw) if raw else {}
    except ValueError:
        current = {}
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
