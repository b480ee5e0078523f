"""Weights: the lock's Hugging Face assets under <model dir>/<dest dir>, fetched and verified by the shipped
rigforge/remote/fetch_weights.py in a venv (roles/operations/hfweights.py).
"""

from pyinfra.api import deploy
from pyinfra.api.hiddenvalue import HiddenValue
from pyinfra.operations import apt, files, pip

from rigforge.model.fleet import Plan
from roles.operations import hfweights


@deploy("Verified model weights")
def apply(plan: Plan) -> None:
    layout, knobs = plan.layout, plan.knobs.weights
    venv, lib = layout.venv, layout.lib

    apt.packages(name="Install python3-venv", packages=["python3-venv", "ca-certificates"], no_recommends=True)
    pip.venv(name=f"Python venv {venv}", path=venv, python="python3")
    hfweights.hub_client(name="Install huggingface_hub into the venv", layout=layout, knobs=knobs)
    files.directory(name=f"Model directory {layout.models}", path=layout.models, mode="755")
    files.directory(name=f"rigforge lib {lib}", path=lib, mode="755")
    files.put(name="Ship fetch_weights.py", src=str(hfweights.SCRIPT), dest=f"{lib}/fetch_weights.py", mode="755")
    token = HiddenValue(plan.token) if plan.token else None
    for asset in plan.assets:
        hfweights.fetched(
            name=f"Weights {asset.name} ({asset.pin.repo}@{asset.pin.revision[:12]}) -> {asset.dir}",
            asset=asset,
            layout=layout,
            knobs=knobs,
            token=token,
        )
