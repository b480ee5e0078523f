"""The one writer of /etc/docker/daemon.json: merge keys into the existing JSON, keep everything else."""

import posixpath
from io import StringIO

from pyinfra import host
from pyinfra.api import FileUploadCommand, QuoteString, StringCommand, operation
from pyinfra.facts.files import FileContents

from rigforge.model.jsonmerge import merged_text
from roles.operations.checks import fail_command
from roles.operations.shown import Commands, unchanged


@operation()
def merge_json(path: str, patch: dict, extend: dict | None = None) -> Commands:
    """Merge ``patch`` into the JSON file ``path`` (mode 644, created if missing) atomically; bad JSON fails the host.

    + path: the JSON file, e.g. Docker's daemon.json
    + patch: keys to set (nested mappings are merged)
    + extend: ``{key: [items]}``: items added to the list at that key when missing, the list's others kept

    **Example:**

    .. code:: python

        from roles.operations import docker_daemon
        docker_daemon.merge_json(
            name="Ask the fleet registry before Docker Hub (daemon.json registry-mirrors)",
            path="/etc/docker/daemon.json",
            patch={},
            extend={"registry-mirrors": ["https://10.0.0.5:5000"]},
        )
    """
    lines = host.get_fact(FileContents, path=path)
    try:
        text = merged_text(None if lines is None else "\n".join(lines), patch, extend)
    except ValueError as error:
        yield fail_command(f"{path} on {host.name} is not valid JSON ({error}); fix or remove it, then re-run.")
        return
    if unchanged(text is None, f"{path} already has {sorted({*patch, *(extend or {})})}"):
        return
    temp = posixpath.join(posixpath.dirname(path), f".{posixpath.basename(path)}.rigforge-new")
    yield StringCommand("mkdir", "-p", QuoteString(posixpath.dirname(path)))
    yield FileUploadCommand(StringIO(text), temp, remote_temp_filename=host.get_temp_filename(temp))
    yield StringCommand("chmod", "644", QuoteString(temp))
    yield StringCommand("mv", "-f", QuoteString(temp), QuoteString(path))
