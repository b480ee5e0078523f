"""Operations for the serving role: files installed as a validated unit, offline-safe unit enablement,
the rig manifest, and the health gate.
"""

from __future__ import annotations

import hashlib
import io
import json
import shlex

from pyinfra import host
from pyinfra.api import FileUploadCommand, QuoteString, StringCommand, operation
from pyinfra.facts.files import File, Sha256File
from pyinfra.facts.server import Command

from roles.facts.nvidia import NvidiaGpus

MANIFEST_VOLATILE = ("provisioned_at",)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _private_upload_dir() -> str | None:
    """With sudo, pyinfra uploads through a temp file first: keep it in a 0700 dir of the SSH user."""
    args = host.current_op_global_arguments or {}
    if not args.get("_sudo"):
        return None
    user = host.data.get("ssh_user") or "user"
    return f"/tmp/.rigforge-upload-{user}"


def _upload(text: str, dest: str, private_dir: str | None, name: str) -> FileUploadCommand:
    temp = f"{private_dir}/{name}" if private_dir else None
    return FileUploadCommand(io.BytesIO(text.encode()), dest, remote_temp_filename=temp)


@operation()
def staged_files(dest: str, files: dict[str, tuple[str, str]], validate: str | None = None, keep_previous: bool = True):
    """Install `files` ({name: (text, octal mode)}) into `dest` as one unit.

    No-op when every file already has that content and mode. Otherwise the files are uploaded to
    `dest/.staging` (0700), `validate` runs there (e.g. `docker compose config -q`), and only if it passes
    are the current files kept as `<name>.prev` (with keep_previous, for rollback) and the new ones renamed
    into place. On a failed validation the staging dir is removed and the current files stay untouched.
    """
    current = {}
    for name, (text, mode) in files.items():
        info = host.get_fact(File, path=f"{dest}/{name}")
        same = (
            info
            and str(info["mode"]) == mode.lstrip("0")  # pyinfra reports mode as octal digits
            and (host.get_fact(Sha256File, path=f"{dest}/{name}") == _sha256(text))
        )
        current[name] = (bool(info), bool(same))
    if all(same for _, same in current.values()):
        host.noop(f"{dest}: {', '.join(files)} up to date")
        return

    staging = f"{dest}/.staging"
    private = _private_upload_dir()
    yield StringCommand("mkdir", "-p", QuoteString(dest))
    yield StringCommand("rm", "-rf", QuoteString(staging), "&&", "mkdir", "-m", "700", QuoteString(staging))
    if private:
        yield StringCommand("install", "-d", "-m", "700", QuoteString(private), _sudo=False)
    for name, (text, mode) in files.items():
        yield _upload(text, f"{staging}/{name}", private, name)
        yield StringCommand("chmod", mode, QuoteString(f"{staging}/{name}"))
    if validate:
        yield StringCommand(
            f"cd {shlex.quote(staging)} && ( {validate} ) || {{ rc=$?; rm -rf {shlex.quote(staging)}; "
            f"echo 'rigforge: validation failed, {dest} left unchanged' >&2; exit $rc; }}"
        )
    for name, (exists, _) in current.items():
        if exists and keep_previous:
            yield StringCommand("cp", "-p", QuoteString(f"{dest}/{name}"), QuoteString(f"{dest}/{name}.prev"))
        yield StringCommand("mv", "-f", QuoteString(f"{staging}/{name}"), QuoteString(f"{dest}/{name}"))
    yield StringCommand("rmdir", QuoteString(staging))


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
    private = _private_upload_dir()
    if private:
        yield StringCommand("install", "-d", "-m", "700", QuoteString(private), _sudo=False)
    yield StringCommand("mkdir", "-p", QuoteString(path.rsplit("/", 1)[0]))
    yield _upload(text, f"{path}.tmp", private, "rig.json")
    yield StringCommand("chmod", "644", QuoteString(f"{path}.tmp"))
    yield StringCommand("mv", "-f", QuoteString(f"{path}.tmp"), QuoteString(path))


def health_gate_script(url: str, model: str, timeout: int, unit: str, rollback_unit: str | None) -> str:
    """Shell: wait for /v1/models, send one chat completion; on failure roll back and print the log tail."""
    rollback = f"systemctl disable --now {shlex.quote(unit)}; " + (
        f"systemctl enable --now {shlex.quote(rollback_unit)}; " if rollback_unit else ""
    )
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 8})
    return f"""
deadline=$(( $(date +%s) + {int(timeout)} ))
fail() {{
  echo "rigforge health gate: $1" >&2
  journalctl -u {shlex.quote(unit)} -n 40 --no-pager >&2 2>/dev/null || true
  {rollback}exit 1
}}
until curl -sf --max-time 3 {shlex.quote(url)}/v1/models >/dev/null; do
  [ "$(date +%s)" -lt "$deadline" ] || fail "no answer from {url}/v1/models within {int(timeout)} s"
  systemctl is-failed --quiet {shlex.quote(unit)} && fail "{unit} failed while starting"
  sleep 4
done
curl -sf --max-time 120 -H 'Content-Type: application/json' -d {shlex.quote(body)} \\
  {shlex.quote(url)}/v1/chat/completions | grep -q '"choices"' || fail "chat completion did not answer"
echo "rigforge health gate: {url} serves {model}"
""".strip()
