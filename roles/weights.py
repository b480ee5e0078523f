"""Weights: the lock's Hugging Face assets, downloaded on the rig and verified, under <model dir>/<dest dir>.

A venv at <rigforge_root>/venv (python3-venv from apt, a pinned huggingface_hub from PyPI) runs the shipped
rigforge/remote/fetch_weights.py: resumable downloads into <model dir>/.rigforge-staging/<asset>, sha256 of
every file against the lock, atomic move into place, a stamp (size, mtime_ns, sha256 per file). Re-runs
compare the stamp with a stat of the files and do not read them; `weights_deep_verify: True` re-hashes.
`weights_source: controller` downloads once into the controller's cache and pushes to each rig instead.
Before anything changes: unresolved lock entries and gated repos without a token stop the host.
"""

from __future__ import annotations

import os

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.operations import apt, files, pip

from rigforge.pins import Lock, LockError
from roles.operations import hfweights
from roles.operations.checks import refuse

DEFAULTS = {
    "rigforge_root": "/opt/rigforge",  # root of the host layout (venv, lib, models)
    "serving_model_dir": None,  # model dir on the rig; default <rigforge_root>/models
    "hf_token": None,  # HF token (secret); default: controller env RIGFORGE_HF_TOKEN or HF_TOKEN
    "hf_endpoint": "https://huggingface.co",  # HF hub endpoint (testbed: its local stand-in)
    "weights_source": "hub",  # hub: each rig downloads; controller: fetch once on the controller, push
    "weights_deep_verify": False,  # re-hash every file on each run instead of trusting the stamp
    "weights_hf_hub_version": "2.4.0",  # huggingface_hub pinned into the rig's venv
    "weights_cache_dir": "~/.cache/rigforge/weights",  # controller cache for weights_source: controller
}
SOURCES = ("hub", "controller")


def _token() -> str | None:
    return host.data.get("hf_token") or os.environ.get("RIGFORGE_HF_TOKEN") or os.environ.get("HF_TOKEN")


def _problem(lock: Lock, assets: dict[str, str]) -> str | None:
    """Why this host cannot get these assets, checked on the controller; None when fine."""
    try:
        lock.require(hf=list(assets))
    except LockError as exc:
        return str(exc)
    source = host.data.get("weights_source")
    if source not in SOURCES:
        return f"weights_source is {source!r}; allowed: {', '.join(SOURCES)}"
    gated = [lock.hf[name].repo for name in assets if lock.hf[name].gated]
    if gated and not _token():
        return (
            f"{', '.join(gated)} {'is' if len(gated) == 1 else 'are'} gated and no HF token is set: "
            "set host data hf_token or RIGFORGE_HF_TOKEN / HF_TOKEN on the controller"
        )
    return None


@deploy("Verified model weights", data_defaults=DEFAULTS)
def apply(lock: Lock, assets: dict[str, str]):
    problem = _problem(lock, assets)
    if problem:
        refuse(name=f"Refuse {host.name}: weights", message=f"{host.name}: {problem}")
        return
    root = host.data.get("rigforge_root")
    models = host.data.get("serving_model_dir") or f"{root}/models"
    venv, lib = f"{root}/venv", f"{root}/lib"
    token = _token()

    apt.packages(name="Install python3-venv", packages=["python3-venv", "ca-certificates"], no_recommends=True)
    pip.venv(name=f"Python venv {venv}", path=venv, python="python3")
    pip.packages(
        name="Install huggingface_hub into the venv",
        packages=[f"huggingface_hub=={host.data.get('weights_hf_hub_version')}"],
        virtualenv=venv,
    )
    files.directory(name=f"Model directory {models}", path=models, mode="755")
    files.directory(name=f"rigforge lib {lib}", path=lib, mode="755")
    files.put(
        name="Ship fetch_weights.py",
        src=str(hfweights.SCRIPT),
        dest=f"{lib}/fetch_weights.py",
        mode="755",
    )
    for name, dest_dir in assets.items():
        pin = lock.hf[name]
        hfweights.fetched(
            name=f"Weights {name} ({pin.repo}@{pin.revision[:12]}) -> {dest_dir}",
            pin=pin,
            dest=f"{models}/{dest_dir}",
            staging=f"{models}/.rigforge-staging/{name}",
            python=f"{venv}/bin/python",
            script=f"{lib}/fetch_weights.py",
            work_dir=f"{root}/run/weights",
            endpoint=host.data.get("hf_endpoint"),
            token=HiddenValue(token) if token else None,
            deep=bool(host.data.get("weights_deep_verify")),
            source=host.data.get("weights_source"),
            cache_dir=host.data.get("weights_cache_dir"),
        )
