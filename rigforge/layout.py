"""The host layout: every path and name rigforge uses on a rig, in one place (docs: DESIGN.md "Host layout").

Pure data. `rigforge.render` takes its host paths from here; the roles get one through the plan
(`rigforge.plan.Plan.layout`), so no role spells a path of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

STAMP = ".rigforge-stamp.json"  # written by rigforge/remote/fetch_weights.py in every asset dir
STAGING = ".staging"  # staged_files' staging dir inside the destination dir
VLLM_TEMPLATE = "rigforge-vllm@.service"
POWER_UNIT = "rigforge-gpu-power.service"


@dataclass(frozen=True)
class HostLayout:
    root: str = "/opt/rigforge"  # rigforge_root
    model_dir: str | None = None  # serving_model_dir; default <root>/models
    variant: str = ""  # the variant this rig serves (names serve/<variant> and the unit instance)
    etc: str = "/etc/rigforge"
    unit_dir: str = "/etc/systemd/system"

    @property
    def models(self) -> str:
        return self.model_dir or f"{self.root}/models"

    @property
    def src_root(self) -> str:
        return f"{self.root}/src"

    def src(self, name: str) -> str:
        return f"{self.src_root}/{name}"

    @property
    def serve_root(self) -> str:
        return f"{self.root}/serve"

    @property
    def serve_dir(self) -> str:
        return f"{self.serve_root}/{self.variant}"

    @property
    def cache(self) -> str:
        return f"{self.root}/cache"

    @property
    def venv(self) -> str:
        return f"{self.root}/venv"

    @property
    def lib(self) -> str:
        return f"{self.root}/lib"

    @property
    def weights_work(self) -> str:
        """Root-only dir for weight manifests and the transient token file."""
        return f"{self.root}/run/weights"

    @property
    def weights_staging_root(self) -> str:
        return f"{self.models}/.rigforge-staging"

    def weights_staging(self, asset: str) -> str:
        return f"{self.weights_staging_root}/{asset}"

    def asset_dir(self, dirname: str) -> str:
        return f"{self.models}/{dirname}"

    def stamp(self, dirname: str) -> str:
        return f"{self.asset_dir(dirname)}/{STAMP}"

    def staging_of(self, dest: str) -> str:
        """Where staged_files stages files for `dest` (serve dir, unit dir)."""
        return f"{dest}/{STAGING}"

    @property
    def rig_json(self) -> str:
        return f"{self.etc}/rig.json"

    @property
    def vllm_unit(self) -> str:
        return f"rigforge-vllm@{self.variant}.service"

    vllm_template = VLLM_TEMPLATE
    power_unit = POWER_UNIT
