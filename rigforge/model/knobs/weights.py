import re
from collections.abc import Mapping
from dataclasses import dataclass

from rigforge.layout import DEFAULT_ROOT
from rigforge.model import schema
from rigforge.model.knobs import Knobs, defaults_of, knob


@dataclass(frozen=True)
class Weights(Knobs):
    """The weights download (roles/weights.py)."""

    rigforge_root: str = DEFAULT_ROOT  # root of the host layout (venv, lib, models)
    serving_model_dir: str | None = None  # model dir on the rig; default <rigforge_root>/models
    # HF token (secret: left out of a repr); default: the controller's env RIGFORGE_HF_TOKEN or HF_TOKEN
    hf_token: str | None = knob(None, secret=True)
    hf_endpoint: str = "https://huggingface.co"  # HF hub endpoint (testbed: its local stand-in)
    weights_source: str = "hub"  # hub: each rig downloads; controller: fetch once on the controller, push
    weights_deep_verify: bool = False  # re-hash every file on each run instead of trusting the stamp
    weights_hf_hub_version: str = "2.4.0"  # huggingface_hub pinned into the rig's venv
    weights_cache_dir: str = "~/.cache/rigforge/weights"  # controller cache for weights_source: controller


DEFAULTS = defaults_of(Weights)
RELEASE = re.compile(r"\d+(\.\d+){1,3}")


def validate(data: Mapping) -> list[str]:
    problems = schema.choice(data, "weights_source", ("hub", "controller"))
    problems += schema.boolean(data, "weights_deep_verify")
    problems += schema.matches(data, "hf_endpoint", schema.URL, "an http(s) URL without spaces or quotes")
    if data.get("hf_token") not in (None, ""):
        problems += schema.settings(data, {"hf_token": "hf_token"})
    problems += schema.matches(data, "weights_hf_hub_version", RELEASE, "a release such as 2.4.0")
    problems += schema.matches(data, "weights_cache_dir", re.compile(r"\S+"), "a directory path on the controller")
    return problems
