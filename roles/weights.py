"""Weights: the lock's Hugging Face assets, downloaded on the rig and verified, under <model dir>/<dest dir>.

A venv at <rigforge_root>/venv (python3-venv from apt, a pinned huggingface_hub from PyPI) runs the shipped
rigforge/remote/fetch_weights.py: resumable downloads into <model dir>/.rigforge-staging/<asset>, sha256 of
every file against the lock, atomic move into place, a stamp (size, mtime_ns, sha256 per file). Re-runs
compare the stamp with a stat of the files and do not read them; `weights_deep_verify: True` re-hashes.
`weights_source: controller` downloads once into the controller's cache and pushes to each rig instead.
Checked on the controller before anything changes (roles/site.py): the knobs below, unresolved lock entries,
and a token for gated repos, needed only while one of them is not yet fetched and stamped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pyinfra.api import deploy
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.operations import apt, files, pip

from rigforge import schema
from rigforge.layout import DEFAULT_ROOT
from rigforge.plan import Plan
from roles.operations import hfweights

DEFAULTS = {
    "rigforge_root": DEFAULT_ROOT,  # root of the host layout (venv, lib, models)
    "serving_model_dir": None,  # model dir on the rig; default <rigforge_root>/models
    "hf_token": None,  # HF token (secret); default: controller env RIGFORGE_HF_TOKEN or HF_TOKEN
    "hf_endpoint": "https://huggingface.co",  # HF hub endpoint (testbed: its local stand-in)
    "weights_source": "hub",  # hub: each rig downloads; controller: fetch once on the controller, push
    "weights_deep_verify": False,  # re-hash every file on each run instead of trusting the stamp
    "weights_hf_hub_version": "2.4.0",  # huggingface_hub pinned into the rig's venv
    "weights_cache_dir": "~/.cache/rigforge/weights",  # controller cache for weights_source: controller
}
SOURCES = ("hub", "controller")


def validate(data: Mapping) -> list[str]:
    problems = schema.choice(data, "weights_source", SOURCES) + schema.boolean(data, "weights_deep_verify")
    problems += schema.url(data, "hf_endpoint")
    if data.get("hf_token") not in (None, ""):
        problems += schema.settings(data, {"hf_token": "hf_token"})
    version = data.get("weights_hf_hub_version")
    if not (isinstance(version, str) and re.fullmatch(r"\d+(\.\d+){1,3}", version)):
        problems.append(f"weights_hf_hub_version must be a release such as 2.4.0, got {version!r}")
    cache = data.get("weights_cache_dir")
    if not (isinstance(cache, str) and cache and not re.search(r"\s", cache)):
        problems.append(f"weights_cache_dir must be a directory path on the controller, got {cache!r}")
    return problems


@deploy("Verified model weights", data_defaults=DEFAULTS)
def apply(plan: Plan):
    layout, data = plan.layout, plan.data
    venv, lib = layout.venv, layout.lib

    apt.packages(name="Install python3-venv", packages=["python3-venv", "ca-certificates"], no_recommends=True)
    pip.venv(name=f"Python venv {venv}", path=venv, python="python3")
    hfweights.venv_package(
        name="Install huggingface_hub into the venv",
        venv=venv,
        dist="huggingface_hub",
        version=data["weights_hf_hub_version"],
    )
    files.directory(name=f"Model directory {layout.models}", path=layout.models, mode="755")
    files.directory(name=f"rigforge lib {lib}", path=lib, mode="755")
    files.put(
        name="Ship fetch_weights.py",
        src=str(hfweights.SCRIPT),
        dest=f"{lib}/fetch_weights.py",
        mode="755",
    )
    for asset in plan.assets:
        pin = asset.pin
        hfweights.fetched(
            name=f"Weights {asset.name} ({pin.repo}@{pin.revision[:12]}) -> {asset.dir}",
            pin=pin,
            dest=layout.asset_dir(asset.dir),
            staging=layout.weights_staging(asset.name),
            python=f"{venv}/bin/python",
            script=f"{lib}/fetch_weights.py",
            work_dir=layout.weights_work,
            endpoint=data["hf_endpoint"],
            token=HiddenValue(plan.token) if plan.token else None,
            deep=bool(data["weights_deep_verify"]),
            source=data["weights_source"],
            cache_dir=data["weights_cache_dir"],
        )
