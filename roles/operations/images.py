"""Operations that load saved images into a rig's Docker at their digests (roles/images.py, docs/images.md)."""

import json
import shlex
from pathlib import Path

from pyinfra import host
from pyinfra.api import FileUploadCommand, QuoteString, StringCommand, operation
from pyinfra.facts.files import Directory, FileContents, Sha256File

import rigforge
from rigforge.layout import DAEMON_JSON, HostLayout
from rigforge.model import saved_images
from rigforge.model.jsonmerge import merged_text
from rigforge.model.saved_images import human_bytes
from rigforge.observe.facts.docker import DockerImagePresent
from rigforge.observe.facts.images import ListeningPorts, OciBlobs
from rigforge.observe.facts.system import FreeDiskBytes
from roles.operations.checks import fail_command
from roles.operations.shown import Commands, ShownCommand, say, unchanged
from roles.operations.staged import connection, upload_privately

SCRIPT = Path(rigforge.__file__).resolve().parent / "remote" / "load_images.sh"  # the rig-side script
PORTS = range(5800, 5900)  # the temporary registry takes the first free one


def missing(saved: list[saved_images.Saved]) -> list[saved_images.Saved]:
    """The saved images the rig's Docker does not hold at their digest (read now)."""
    return [e for e in saved if not host.get_fact(DockerImagePresent, image=saved_images.pinned(e))]


@operation()
def repaired(layout: HostLayout) -> Commands:
    """Undo what a load killed outright left (``load_images.sh repair``): daemon.json, the registry, the work dir.

    + layout: the rig's paths (the load's work dir, load_images.sh)

    **Example:**

    .. code:: python

        from rigforge.layout import HostLayout
        from roles.operations import images
        images.repaired(
            name="Repair what an interrupted image load left (daemon.json, temporary registry)",
            layout=HostLayout(),
        )
    """
    work, script = layout.images_work, layout.images_script
    if not host.get_fact(Directory, path=work):
        host.noop(f"no interrupted load in {work}")
    elif not host.get_fact(Sha256File, path=script):  # the work dir was left before the script landed
        yield StringCommand("rm", "-rf", QuoteString(work))
    else:
        yield ShownCommand("sh", QuoteString(script), "repair", QuoteString(work), QuoteString(DAEMON_JSON))


@operation()
def blobs_uploaded(directory: str, saved: list, layout: HostLayout) -> Commands:
    """Upload the blobs of ``saved`` images that the rig's OCI layout lacks, each checked by sha256 on the rig.

    + directory: the saved layout on the controller (`rigforge images save DIR`)
    + saved: the images to load (rigforge.model.saved_images.Saved)
    + layout: the rig's paths (the OCI layout; the upload dir a sudo user's uploads land in first, 0700, theirs)

    **Example:**

    .. code:: python

        from pathlib import Path
        from rigforge.model import saved_images
        from rigforge.layout import HostLayout
        from roles.operations import images
        images.blobs_uploaded(
            name="Upload the saved images' blobs the rig lacks",
            directory="/srv/saved-images",
            saved=saved_images.check_loadable(Path("/srv/saved-images")),
            layout=HostLayout(),
        )
    """
    oci, upload_dir = layout.images_layout, layout.images_upload
    todo = missing(saved)
    if unchanged(not todo, f"docker holds {', '.join(saved_images.pinned(e) for e in saved)}"):
        return
    _, needed = saved_images.push_plan(directory, todo)
    have = host.get_fact(OciBlobs, path=oci)
    upload = {d: size for d, size in needed.items() if have.get(d) != size}
    if unchanged(not upload, f"{oci} holds the {len(needed)} blobs of {len(todo)} image(s)"):
        return
    # the blobs still to come, and the temporary registry's copy of all of them (its storage is beside the layout)
    need = int((sum(upload.values()) + sum(needed.values())) * 1.05)
    free = host.get_fact(FreeDiskBytes, path=oci)
    if free is not None and need > free:
        yield fail_command(
            f"{host.name}: not enough disk space to load {len(todo)} image(s) at {oci}: need {human_bytes(need)} (the "
            f"blobs to upload and the temporary registry's copy, + 5%), {human_bytes(free)} free; free space or set "
            "rigforge_root elsewhere"
        )
        return
    q = shlex.quote
    blobs = f"{oci}/{saved_images.BLOBS}"
    user = connection("ssh_user") if (host.current_op_global_arguments or {}).get("_sudo") else None
    yield StringCommand(f"mkdir -p {q(blobs)}")
    if user:
        yield StringCommand(f"install -d -m 700 -o {q(user)} {q(upload_dir)}")
    total, sent = sum(upload.values()), 0
    for i, (digest, size) in enumerate(sorted(upload.items()), 1):
        hexdigest = digest.split(":", 1)[1]
        part = f"{upload_dir if user else blobs}/.{hexdigest}.part"
        sent += size
        progress = f"{human_bytes(sent)} of {human_bytes(total)}"
        yield say(f"blob {i}/{len(upload)} {hexdigest[:12]}: {human_bytes(size)} ({progress})")
        if not user:
            yield StringCommand(f"mkdir -p {q(upload_dir)}")
        yield FileUploadCommand(
            str(saved_images.blob_path(directory, digest)), part, **({"_sudo": False} if user else {})
        )
        yield StringCommand(
            f"echo {q(f'{hexdigest}  {part}')} | sha256sum -c --status || {{ rm -f {q(part)}; "
            f"echo 'rigforge: blob {digest} did not arrive intact; re-run' >&2; exit 1; }}; "
            f"chown 0:0 {q(part)} && chmod 644 {q(part)} && mv -f {q(part)} {q(f'{blobs}/{hexdigest}')}"
        )
    for name in (saved_images.LAYOUT_FILE, saved_images.INDEX):
        yield FileUploadCommand(str(Path(directory) / name), f"{oci}/{name}")


@operation()
def loaded(directory: str, saved: list, layout: HostLayout, port: int | None = None) -> Commands:
    """Load the ``saved`` images Docker lacks at their digests (load_images.sh), then remove what blobs_uploaded sent.

    + directory: the saved layout on the controller
    + saved: the images to load (rigforge.model.saved_images.Saved)
    + layout: the rig's paths (load_images.sh, the OCI layout, the load's work dir, the upload dir)
    + port: the temporary registry's port on 127.0.0.1 (None: the first free one of 5800-5899)

    **Example:**

    .. code:: python

        from pathlib import Path
        from rigforge.model import saved_images
        from rigforge.layout import HostLayout
        from roles.operations import images
        images.loaded(
            name="Load the saved images into docker at their digests",
            directory="/srv/saved-images",
            saved=saved_images.check_loadable(Path("/srv/saved-images")),
            layout=HostLayout(),
            port=None,
        )
    """
    script, oci, work = layout.images_script, layout.images_layout, layout.images_work
    todo = missing(saved)
    if unchanged(not todo, f"docker holds {', '.join(saved_images.pinned(e) for e in saved)}"):
        return
    used = [] if port else host.get_fact(ListeningPorts)
    port = port or next((p for p in PORTS if p not in used), None)
    if port is None:
        yield fail_command(f"{host.name}: no free port in {PORTS.start}-{PORTS.stop - 1} for the temporary registry")
        return
    url = f"http://127.0.0.1:{port}"
    lines = host.get_fact(FileContents, path=DAEMON_JSON)
    current = None if lines is None else "\n".join(lines)
    try:
        existing = json.loads(merged_text(current, {}) or current)  # raises as merged_text does
        own = existing.get("registry-mirrors") if isinstance(existing.get("registry-mirrors"), list) else []
        # the temporary mirror first (Docker tries mirrors in order), the user's own after it, kept
        mirrored = merged_text(current, {"registry-mirrors": [url, *(m for m in own if m != url)]}) or current
        cleared = merged_text(current, {"registry-mirrors": own}) or current
    except ValueError as error:
        yield fail_command(f"{DAEMON_JSON} on {host.name} is not valid JSON ({error}); fix or remove it, then re-run.")
        return
    plan, _ = saved_images.push_plan(directory, todo)
    q = shlex.quote
    yield say(f"loading {', '.join(saved_images.pinned(e) for e in todo)} through a temporary registry on {url}")
    yield FileUploadCommand(str(SCRIPT), script)
    yield StringCommand(f"rm -rf {q(work)} && install -d -m 700 {q(work)}")
    for name, text in (("daemon.json.mirrored", mirrored), ("daemon.json.cleared", cleared), ("plan", "\n".join(plan))):
        yield from upload_privately(text + ("" if text.endswith("\n") else "\n"), f"{work}/{name}")
    yield ShownCommand(
        "sh",
        QuoteString(script),
        "load",
        QuoteString(work),
        QuoteString(oci),
        str(port),
        QuoteString(DAEMON_JSON),
        QuoteString(f"{work}/plan"),
    )
    # docker holds them now: the uploaded copy (as large as the images) goes; a cut upload stays, to resume
    yield StringCommand("rm", "-rf", QuoteString(oci), QuoteString(layout.images_upload))
