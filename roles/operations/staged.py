"""Files installed as one validated unit: staged, checked on the host, then renamed into place."""

import hashlib
import io
import shlex

from pyinfra import host
from pyinfra.api import FileUploadCommand, QuoteString, StringCommand, operation
from pyinfra.api.command import PyinfraCommand
from pyinfra.facts.files import Directory, File, Sha256File

from rigforge.layout import STAGING, UPLOAD_PREFIX
from roles.operations.shown import Commands, repairing, unchanged


def private_upload_dir() -> str:
    """The 0700 dir of the user the connection logs in as (not a role setting) that sudo uploads pass through."""
    return f"{UPLOAD_PREFIX}{connection('ssh_user') or 'user'}"


def connection(key: str) -> str | int | None:
    """A setting of the host's connection (e.g. ``ssh_user``, ``ssh_hostname``), None where the connector has none."""
    return (getattr(host.connector, "data", None) or {}).get(key)


def upload_privately(text: str, dest: str) -> list[PyinfraCommand]:
    """Commands uploading `text` to `dest`, never via a world-readable file (with sudo, via the SSH user's 0700 dir)."""
    if not (host.current_op_global_arguments or {}).get("_sudo"):
        return [FileUploadCommand(io.BytesIO(text.encode()), dest)]
    private = private_upload_dir()
    temp = f"{private}/{hashlib.sha1(dest.encode()).hexdigest()[:12]}"
    return [
        StringCommand("install", "-d", "-m", "700", QuoteString(private), _sudo=False),
        FileUploadCommand(io.BytesIO(text.encode()), dest, remote_temp_filename=temp),
    ]


SWAPPING = ".swapping"  # in the staging dir while files are being moved into place


@operation()
def staged_files(
    dest: str, files: dict[str, tuple[str, str]], validate: str | None = None, keep_previous: bool = True
) -> Commands:
    """Install ``files`` into ``dest`` as one unit, validated on the host before anything is replaced.

    + dest: the directory the files go into
    + files: ``{name: (text, octal mode)}``
    + validate: shell command run in the staging dir; the files land only if it exits 0
    + keep_previous: keep the replaced files as ``<name>.prev`` (for rollback)

    Repairs a cut run: drops a leftover staging dir; finishes a cut move (`.swapping`), keeping the pre-run `.prev`.

    **Example:**

    .. code:: python

        from roles.operations.staged import staged_files
        staged_files(
            name="Install the gateway config (validated by haproxy -c)",
            dest="/etc/rigforge-gateway",
            files={"haproxy.cfg": (config_text, "600")},
            validate="haproxy -c -q -f haproxy.cfg",
        )
    """
    staging = f"{dest}/{STAGING}"
    current = {}
    for name, (text, mode) in files.items():
        info = host.get_fact(File, path=f"{dest}/{name}")
        same = (
            info
            and str(info["mode"]) == mode.lstrip("0")  # pyinfra reports mode as octal digits
            and host.get_fact(Sha256File, path=f"{dest}/{name}") == hashlib.sha256(text.encode()).hexdigest()
        )
        current[name] = (bool(info), bool(same))
    leftover = host.get_fact(Directory, path=staging)
    resumed = bool(leftover) and bool(host.get_fact(File, path=f"{staging}/{SWAPPING}"))
    if all(same for _, same in current.values()):
        if unchanged(not leftover, f"{dest}: {', '.join(files)} up to date"):
            return
        repairing(f"{dest}: removing the staging dir an interrupted run left behind")
        yield StringCommand("rm", "-rf", QuoteString(staging))
        return
    if resumed:
        repairing(f"{dest}: an interrupted run was moving files into place; finishing it (the .prev copies are kept)")

    yield StringCommand("mkdir", "-p", QuoteString(dest))
    yield StringCommand("rm", "-rf", QuoteString(staging), "&&", "mkdir", "-m", "700", QuoteString(staging))
    for name, (text, mode) in files.items():
        yield from upload_privately(text, f"{staging}/{name}")
        yield StringCommand("chmod", mode, QuoteString(f"{staging}/{name}"))
    if validate:
        yield StringCommand(
            f"cd {shlex.quote(staging)} && ( {validate} ) || {{ rc=$?; rm -rf {shlex.quote(staging)}; "
            f"echo 'rigforge: validation failed, {dest} left unchanged' >&2; exit $rc; }}"
        )
    yield StringCommand("touch", QuoteString(f"{staging}/{SWAPPING}"))
    for name, (exists, _) in current.items():
        if exists and keep_previous and not resumed:
            yield StringCommand("cp", "-p", QuoteString(f"{dest}/{name}"), QuoteString(f"{dest}/{name}.prev"))
        yield StringCommand("mv", "-f", QuoteString(f"{staging}/{name}"), QuoteString(f"{dest}/{name}"))
    yield StringCommand("rm", "-rf", QuoteString(staging))


def systemd_verify(unit_file: str, instance: str | None = None) -> str:
    """Validation for `staged_files`: `systemd-analyze verify` on the staged unit (or an instance of a template);
    any output counts as a failure (it exits 0 on an unknown key)."""
    name = instance or unit_file
    copy = f"cp {shlex.quote(unit_file)} {shlex.quote(name)} && " if instance else ""
    cleanup = f"rm -f {shlex.quote(name)}; " if instance else ""
    return (
        f"{copy}out=$(systemd-analyze verify ./{shlex.quote(name)} 2>&1); {cleanup}"
        '[ -z "$out" ] || { echo "$out" >&2; exit 1; }'
    )
