"""Operation: one locked Hugging Face asset present and verified in a model dir, by the shipped fetch_weights.py;
a no-op decided from the stamp and a stat (no hashing). The HF token never goes on a command line.
"""

import io
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from pyinfra import host
from pyinfra.api import FileUploadCommand, OperationError, StringCommand, operation
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.facts.files import File

import rigforge
from rigforge.layout import STAMP, HostLayout
from rigforge.model.fleet import PlannedAsset
from rigforge.model.knobs.weights import Weights
from rigforge.model.pins import HfFile, HfPin
from rigforge.observe import verdict
from rigforge.observe.facts.hfweights import FileDigests, VenvDistVersion, WeightsState
from rigforge.observe.facts.system import FreeDiskBytes
from roles.operations.checks import fail_command
from roles.operations.shown import Commands, ShownCommand, repairing, say, unchanged
from roles.operations.staged import upload_privately

HEADROOM = 1.05
SCRIPT = Path(rigforge.__file__).resolve().parent / "remote" / "fetch_weights.py"  # the rig-side script
_CACHE_LOCK = threading.Lock()


def missing_bytes(files: Sequence[HfFile], state: dict) -> int:
    """Bytes still to be written for `files`: each file's size less what its staged part holds; none for a file of
    the right size in place (it may only need hashing)."""
    missing = 0
    for f in files:
        in_place = state["files"].get(f.path)
        if in_place and in_place[0] == f.size:
            continue
        staged = state["staging"].get(f"{f.path}.{f.sha256[:16]}.part", 0)
        missing += f.size - min(staged, f.size)
    return missing


def human(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def manifest(pin: HfPin, dest: str, staging: str, endpoint: str | None) -> dict:
    return {
        **{key: getattr(pin, key) for key in ("name", "repo", "revision", "gated")},
        "endpoint": endpoint,
        "dest": dest,
        "staging": staging,
        "stamp": f"{dest}/{STAMP}",  # the layout's stamp file name: the script spells no rig path of its own
        "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in pin.files],
    }


def controller_cache(pin: HfPin, cache_dir: str, endpoint: str | None, token: str | None) -> Path:
    """Fetch the asset once into the controller's cache (same script); return its dir."""
    dest = Path(cache_dir).expanduser() / pin.repo / pin.revision
    m = manifest(pin, str(dest), str(Path(cache_dir).expanduser() / ".staging" / pin.name), endpoint)
    with _CACHE_LOCK, tempfile.TemporaryDirectory(prefix="rigforge-") as tmp:
        args = [sys.executable, str(SCRIPT)]
        if token:
            token_file = Path(tmp) / "token"
            token_file.touch(mode=0o600)
            token_file.write_text(token)
            args += ["--token-file", str(token_file)]
        proc = subprocess.run(args, input=json.dumps(m), text=True, capture_output=True)
    if proc.returncode != 0:
        raise OperationError(f"controller cache for {pin.name}: {proc.stderr.strip() or proc.stdout.strip()}")
    return dest


@operation()
def fetched(
    asset: PlannedAsset, layout: HostLayout, knobs: Weights, token: HiddenValue | str | None = None
) -> Commands:
    """Make the asset's dir hold exactly its pin's files, verified against the lock's sha256.

    + asset: the locked asset and its dir under the model dir
    + layout: the rig's paths (the asset and staging dirs, the venv, fetch_weights.py, the root-only work dir)
    + knobs: the weights role's settings (``hf_endpoint``, ``weights_deep_verify``, ``weights_source``, its cache dir)
    + token: HF token (pyinfra HiddenValue or str)

    **Example:**

    .. code:: python

        from pyinfra.api.hiddenvalue import HiddenValue
        from roles.operations import hfweights
        for asset in plan.assets:
            hfweights.fetched(
                name=f"Weights {asset.name} ({asset.pin.repo}@{asset.pin.revision[:12]}) -> {asset.dir}",
                asset=asset,  # a PlannedAsset: the locked pin and its dir under the model dir
                layout=plan.layout,
                knobs=plan.knobs.weights,
                token=HiddenValue(plan.token) if plan.token else None,  # kept out of pyinfra's output
            )
    """
    pin, dest, staging = asset.pin, layout.asset_dir(asset.dir), layout.weights_staging(asset.name)
    work_dir, endpoint, deep = layout.weights_work, knobs.hf_endpoint, knobs.weights_deep_verify
    state = host.get_fact(WeightsState, dest=dest, staging=staging)
    stale = [f for f in pin.files if f.path in verdict.stale_weights(pin, state)]
    if deep and not stale:  # the stamp matches: re-hash what is on disk, run the script only to repair
        digests = host.get_fact(FileDigests, dest=dest, paths=[f.path for f in pin.files])
        stale = [f for f in pin.files if digests.get(f.path) != f.sha256]
    q = shlex.quote
    token_file = f"{work_dir}/{pin.name}.token"
    if not stale:
        left = [staging] if state.get("staging_dir") else []
        left += [token_file] if host.get_fact(File, path=token_file) else []
        how = "re-hashed (weights_deep_verify)" if deep else "verified by stamp"
        if unchanged(not left, f"{pin.name}: {len(pin.files)} files {how} ({human(pin.total_size)})"):
            return
        repairing(f"{pin.name}: removing {', '.join(left)} left by an interrupted run")  # parts, a token file
        yield StringCommand(f"rm -rf {' '.join(q(p) for p in left)}")
        return
    need = int(missing_bytes(stale, state) * HEADROOM)
    free = host.get_fact(FreeDiskBytes, path=dest)
    if free is not None and need > free:  # unknown (statfs failed): preflight has checked the disk
        yield fail_command(
            f"{host.name}: not enough disk space for {pin.name} at {dest}: need {human(need)} "
            f"(missing bytes + 5%), {human(free)} free; free space or set serving_model_dir elsewhere"
        )
        return
    man = f"{work_dir}/{pin.name}.json"
    yield StringCommand(f"mkdir -p {q(staging)} {q(dest)} && install -d -m 0700 {q(work_dir)}")
    yield FileUploadCommand(io.StringIO(json.dumps(manifest(pin, dest, staging, endpoint), indent=1)), man)
    args = [q(f"{layout.venv}/bin/python"), q(f"{layout.lib}/fetch_weights.py"), "--manifest", q(man)]
    args += ["--deep"] if deep else []
    raw_token = token.unmask() if hasattr(token, "unmask") else token
    if knobs.weights_source == "controller":
        try:
            local = controller_cache(pin, knobs.weights_cache_dir, endpoint, raw_token)
        except OperationError as exc:
            yield fail_command(f"{host.name}: {exc}")
            return
        for f in stale:
            yield StringCommand(f"mkdir -p {q(os.path.dirname(f'{staging}/{f.path}'))}")
            yield FileUploadCommand(str(local / f.path), f"{staging}/{f.path}")
        yield ShownCommand(" ".join(args + ["--staged-only"]))
        return
    if not raw_token:
        yield ShownCommand(" ".join(args))
        return
    yield StringCommand(f"install -m 0600 /dev/null {q(token_file)}")
    yield from upload_privately(raw_token, token_file)
    yield ShownCommand(f"{' '.join(args)} --token-file {q(token_file)}; rc=$?; rm -f {q(token_file)}; exit $rc")


@operation()
def hub_client(layout: HostLayout, knobs: Weights) -> Commands:
    """huggingface_hub, which fetch_weights.py uses, installed in the rig's venv (pip) at the pinned version.

    + layout: the rig's paths (the venv)
    + knobs: the weights role's settings (``weights_hf_hub_version``)

    **Example:**

    .. code:: python

        from roles.operations import hfweights
        hfweights.hub_client(
            name="Install huggingface_hub into the venv",
            layout=plan.layout,  # its venv: <rigforge_root>/venv
            knobs=plan.knobs.weights,  # weights_hf_hub_version: 2.4.0 unless host data pins another
        )
    """
    venv, dist, version = layout.venv, "huggingface_hub", knobs.weights_hf_hub_version
    if host.get_fact(VenvDistVersion, venv=venv, dist=dist) == version:
        host.noop(f"{dist} {version} is installed in {venv}")
        return
    yield say(f"installing {dist}=={version} into {venv} (pip)")
    yield StringCommand(f"{venv}/bin/pip", "install", "--disable-pip-version-check", "-q", f"{dist}=={version}")
