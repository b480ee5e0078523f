"""Operations for the serving role: one enabled vLLM instance, the image, the rig manifest, the health gate."""

import json
import shlex
from collections.abc import Callable

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation
from pyinfra.api.operation import OperationMeta

from rigforge.model.fleet import Plan
from rigforge.observe.facts.docker import DockerImagePresent
from rigforge.observe.facts.files import JsonFile
from rigforge.observe.facts.nvidia import NvidiaGpus, NvidiaTopology
from rigforge.observe.facts.serving import ApiAnswers, ComposeImages, ServiceState, runs_digest, serving
from rigforge.observe.facts.system import EnabledInstances
from rigforge.observe.obtain import parse
from roles.operations.shown import Commands, ShownCommand, say, unchanged
from roles.operations.staged import upload_privately


@operation()
def sole_instance(plan: Plan) -> Commands:
    """Enable the rig's vLLM unit (``serving_rest: stopped``: disable it), disable (and stop where managed) the rest.

    + plan: the rig's plan (its unit, unit dir and template unit, its serving knobs)

    **Example:**

    .. code:: python

        from roles.operations import serving
        switched = serving.sole_instance(
            name=f"Enable {plan.layout.vllm_unit} as the only vLLM instance",
            plan=plan,
        )
    """
    layout, knobs = plan.layout, plan.knobs.serving
    unit, enable, stop_others = layout.vllm_unit, knobs.serving_rest != "stopped", knobs.rigforge_manage_services
    enabled = host.get_fact(EnabledInstances, unit_dir=layout.unit_dir, template=layout.vllm_template)
    others = [u for u in enabled if u != unit or not enable]
    for other in others:
        yield StringCommand("systemctl", "disable", *(["--now"] if stop_others else []), QuoteString(other))
    if enable and unit not in enabled:
        yield StringCommand("systemctl", "enable", QuoteString(unit))
    if not others and (unit in enabled or not enable):
        host.noop(f"{unit} is the only enabled vLLM instance" if enable else "no vLLM instance is enabled")


def start_reason(plan: Plan, changed: bool, enabled: bool = False) -> str | None:
    """Why the vLLM unit must be (re)started now, or None (a unit still starting is the health gate's to wait for).
    `changed`: this run changed its compose file, .env or unit; `enabled`: this run enabled it as the only instance
    (a switch from another instance, or serving_rest: stopped lifted)."""
    if changed:
        return "its compose file, .env or unit changed"
    layout, image = plan.layout, plan.image
    state = serving(host.get_fact(ServiceState, unit=layout.vllm_unit))
    digest = image.rpartition("@")[2] if "@" in image else None  # None while the lock has none
    if state == "running" and runs_digest(host.get_fact(ComposeImages, serve_dir=layout.serve_dir), digest) is False:
        return "its container runs another image than the locked digest"
    said = {"stopped": "it is stopped", "failed": "it failed", "crashing": "it keeps exiting"}.get(state)
    return said or ("it was just enabled as the only vLLM instance" if enabled else None)


@operation()
def running(
    plan: Plan, changed: Callable[[], bool] | None = None, enabled: Callable[[], bool] | None = None
) -> Commands:
    """(Re)start the rig's vLLM unit when ``start_reason`` says so, its failures reset (the gate counts restarts).

    + plan: the rig's plan (the unit, its compose project directory, the locked image)
    + changed: a callable, true when this run changed its compose file, .env or unit
    + enabled: a callable, true when this run enabled the unit as the only instance (``sole_instance``)

    **Example:**

    .. code:: python

        from pyinfra.operations.util import any_changed
        from roles.operations import serving
        started = serving.running(
            name=f"Run {plan.layout.vllm_unit}",
            plan=plan,
            changed=any_changed(compose, unit_file),  # the staged_files operations of its files
            enabled=any_changed(switched),  # sole_instance's
        )
    """
    unit, executing = plan.layout.vllm_unit, host.state.is_executing
    reason = start_reason(plan, bool(changed and executing and changed()), bool(enabled and executing and enabled()))
    if unchanged(reason is None, f"{unit} runs as declared"):
        return
    running_now = serving(host.get_fact(ServiceState, unit=unit)) in ("running", "starting", "crashing")
    verb = "restart" if running_now else "start"  # a fresh rig's first start is a start, whatever the reason
    yield say(f"{unit}: {reason}: {verb}ing it")
    yield StringCommand("systemctl", "reset-failed", QuoteString(unit), "2>/dev/null || true")
    # a start that fails at once (an ExecStartPre) is the health gate's to report, with the journal's end
    yield StringCommand("systemctl", verb, QuoteString(unit), f"|| echo 'systemctl {verb} {unit} failed' >&2")


@operation()
def stopped(unit: str) -> Commands:
    """The vLLM unit stopped on purpose (host data ``serving_rest: stopped``).

    + unit: the instance, e.g. ``rigforge-vllm@dual.service``

    **Example:**

    .. code:: python

        from roles.operations import serving
        serving.stopped(
            name="Keep rigforge-vllm@dual.service stopped (serving_rest: stopped)",
            unit="rigforge-vllm@dual.service",
        )
    """
    if serving(host.get_fact(ServiceState, unit=unit)) in ("stopped", "failed", "unknown"):
        host.noop(f"{unit} rests stopped (serving_rest: stopped)")
        return
    yield StringCommand("systemctl", "stop", QuoteString(unit))


@operation()
def healthy(
    plan: Plan,
    rollback_unit: str | None,
    started: OperationMeta | None = None,
    changed: Callable[[], bool] | None = None,
) -> Commands:
    """The health gate (``health_gate_script``) after a (re)start or when the API is silent; undoes this run's changes.

    + plan: the rig's plan (its unit, serve dir and its .env's API key, model, port, ``serving_health_*`` knobs)
    + rollback_unit: the instance to go back to when the gate fails, None: the ``*.prev`` files
    + started: the operation that (re)starts the unit (``running``)
    + changed: as for ``running``

    **Example:**

    .. code:: python

        from pyinfra.operations.util import any_changed
        from roles.operations import serving
        serving.healthy(
            name=f"Health gate: /v1/models and one chat completion on port {plan.port}",
            plan=plan,
            rollback_unit=None,  # roll back to the *.prev files
            started=started,  # running's
            changed=any_changed(compose, unit_file, switched),
        )
    """
    knobs, layout, executing = plan.knobs.serving, plan.layout, host.state.is_executing
    url = f"http://{knobs.serving_health_host}:{plan.port}"
    if not (executing and started is not None and started.did_change()):
        if host.get_fact(ApiAnswers, url=url, env_file=f"{layout.serve_dir}/.env") == 200:
            host.noop(f"{url}/v1/models answers")
            return
    rollback = bool(executing and changed and changed())
    model, unit = plan.variant.served_model, layout.vllm_unit
    ready = getattr(plan.variant, "health_path", "/v1/models")  # a recipe slug's engine's own: llama-server's /health
    yield StringCommand(
        health_gate_script(
            url, model, knobs.serving_health_timeout, unit, rollback_unit, layout.serve_dir, rollback, ready
        )
    )


@operation()
def image_present(image: str) -> Commands:
    """``docker pull`` the image by its locked digest unless the engine already holds it (needs a running engine).

    + image: the pinned image reference, ``repo[:tag]@sha256:...`` (or ``repo:tag`` while the lock has no digest)

    **Example:**

    .. code:: python

        from roles.operations import serving
        serving.image_present(
            name=f"Pull {plan.image} ahead of the restart",
            image=plan.image,  # repo[:tag]@sha256:...
        )
    """
    if unchanged(host.get_fact(DockerImagePresent, image=image), f"{image} already present"):
        return
    ref = parse(image)
    yield say(f"pulling {ref.pinned}")
    yield ShownCommand("docker", "pull", QuoteString(ref.pinned))


@operation()
def manifest(plan: Plan, now: str, rest: str | None = None) -> Commands:
    """Write rig.json (manifest, GPUs, interconnect, serving_rest, time) if all but the time differs; the slow
    interconnect only then.

    + plan: the rig's plan (rig.json's path, its manifest: variant, unit, port, pins...)
    + now: the time to record as ``provisioned_at`` (ISO 8601)
    + rest: the ``serving_rest`` this run applied (host data's or ``--data``'s), recorded for status and verify

    **Example:**

    .. code:: python

        from datetime import UTC, datetime
        from roles.operations import serving
        serving.manifest(
            name=f"Record {plan.layout.rig_json}",
            plan=plan,
            now=datetime.now(UTC).isoformat(timespec="seconds"),
            rest="running",
        )
    """
    path = plan.layout.rig_json
    keys = ("index", "uuid", "name", "pci_bus_id", "memory_total", "power_limit", "driver_version")
    gpus = [{k: gpu.get(k) for k in keys} for gpu in host.get_fact(NvidiaGpus) or []]
    recorded = {k: v for k, v in (host.get_fact(JsonFile, path=path) or {}).items() if k != "provisioned_at"}
    wanted = {**plan.manifest, "gpus": gpus, "interconnect": recorded.get("interconnect")}
    if rest:
        wanted["serving_rest"] = rest
    if "interconnect" not in recorded or recorded != wanted:
        wanted["interconnect"] = host.get_fact(NvidiaTopology)
    if unchanged(recorded == wanted, f"{path} up to date"):
        return
    text = json.dumps({**wanted, "provisioned_at": now}, indent=2, sort_keys=True) + "\n"
    yield StringCommand("mkdir", "-p", QuoteString(path.rsplit("/", 1)[0]))
    yield from upload_privately(text, f"{path}.tmp")
    yield StringCommand("chmod", "644", QuoteString(f"{path}.tmp"))
    yield StringCommand("mv", "-f", QuoteString(f"{path}.tmp"), QuoteString(path))


def health_gate_script(
    url: str,
    model: str,
    timeout: int,
    unit: str,
    rollback_unit: str | None,
    serve_dir: str,
    rollback: bool = True,
    ready_path: str = "/v1/models",
) -> str:
    """Shell: wait until `ready_path` answers 200 (vLLM: /v1/models; llama-server: /health, which answers 503
    "Loading model" until the model is loaded), send one chat completion; on failure print the log tail, roll back (to
    `rollback_unit`, else the `*.prev` files) and say what it rolled back to, or that there was nothing to. A server
    exiting while starting fails at once (Restart= would keep it "activating"); journal colour codes are stripped
    (else "[blob data]"); the API key goes to curl on stdin, never on a command line.
    """
    q = shlex.quote
    said = "echo 'rigforge health gate: {}' >&2"  # what the undo did, named
    if not rollback:
        undo = said.format(f"{unit} left as it is (nothing of it changed in this run)")
    elif rollback_unit:
        back = said.format(f"rolled back to {rollback_unit}, the unit that ran before")
        undo = f"systemctl disable --now {q(unit)}; systemctl enable --now {q(rollback_unit)}; {back}"
    else:
        d = q(serve_dir)
        back = said.format(f"rolled back to the compose file and .env {unit} ran before, and restarted it")
        stop = said.format(f"nothing to roll back to (no earlier files of {unit}): stopped and disabled it")
        undo = (
            f"if [ -f {d}/docker-compose.yml.prev ]; then mv -f {d}/docker-compose.yml.prev {d}/docker-compose.yml; "
            f"mv -f {d}/.env.prev {d}/.env; if [ -f {d}/compose.override.yml.prev ]; then "  # a recipe slug's override
            f"mv -f {d}/compose.override.yml.prev {d}/compose.override.yml; fi; systemctl restart {q(unit)}; {back}; "
            f"else systemctl disable --now {q(unit)}; {stop}; fi"
        )
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 8})
    return f"""
RIGFORGE_API_KEY=$(sed -n 's/^RIGFORGE_API_KEY=//p' {q(serve_dir)}/.env 2>/dev/null)
auth() {{ [ -z "$RIGFORGE_API_KEY" ] || printf 'Authorization: Bearer %s\n' "$RIGFORGE_API_KEY"; }}
deadline=$(( $(date +%s) + {int(timeout)} ))
fail() {{
  echo "rigforge health gate: $1" >&2
  journalctl -a -u {q(unit)} -n 40 --no-pager 2>/dev/null | sed 's/\\x1b\\[[0-9;]*[A-Za-z]//g' >&2 || true
  {undo}
  exit 1
}}
until auth | curl -sf --max-time 3 -H @- {q(url + ready_path)} >/dev/null; do
  [ "$(date +%s)" -lt "$deadline" ] || fail "no answer from {url}{ready_path} within {int(timeout)} s"
  systemctl is-failed --quiet {q(unit)} && fail "{unit} failed while starting"
  restarts=$(systemctl show -P NRestarts {q(unit)} 2>/dev/null)
  [ "${{restarts:-0}}" = 0 ] || fail "the server exited while starting ({unit} restarts it)"
  sleep 4
done
auth | curl -sf --max-time 120 -H @- -H 'Content-Type: application/json' -d {q(body)} \
  {q(url)}/v1/chat/completions | grep -q '"choices"' || fail "chat completion did not answer"
echo "rigforge health gate: {url} serves {model}"
""".strip()
