"""What the site decides about a rig before anything on it changes: pure functions of the rig's plan and the facts
read on it (roles/site.py reads the facts, asks the network where it must, and orders the roles).

- the weights the run fetches, and whether the HF token they need is set;
- what the variant needs of the rig: its GPUs and VRAM, and the bytes still to land on the model disk;
- whether the rig lacks its image, and the refusal when no source has it.
"""

from collections.abc import Mapping, Sequence

from rigforge.model.fleet import Plan, PlannedAsset
from rigforge.model.hardware import Needs
from rigforge.model.pins import HfPin
from rigforge.observe import obtain, verdict

IMAGE_GB = 9  # the vLLM nightly image on disk (HARDWARE.md)

TOKEN_WHERE = "host data hf_token or RIGFORGE_HF_TOKEN / HF_TOKEN on the controller"


def to_fetch(plan: Plan, weights: Mapping[str, dict]) -> list[PlannedAsset]:
    """The plan's weights assets this run downloads: those not on the rig as their stamp verified them
    (`weights`: {asset name: WeightsState}; `verdict.stale_weights` decides, as the weights role does)."""
    return [asset for asset in plan.assets if verdict.stale_weights(asset.pin, weights[asset.name])]


def gated(assets: Sequence[PlannedAsset]) -> list[HfPin]:
    """The pins among `assets` that the hub serves only with a token."""
    return [asset.pin for asset in assets if asset.pin.gated]


def token_missing(plan: Plan, gated_pins: Sequence[HfPin]) -> list[str]:
    """The refusal when gated weights are still to fetch and no HF token is set (the token itself is never shown)."""
    if not gated_pins or plan.token:
        return []
    repos = ", ".join(pin.repo for pin in gated_pins)
    verb = "is" if len(gated_pins) == 1 else "are"
    return [f"{repos} {verb} gated, not yet fetched, and no HF token is set: set {TOKEN_WHERE}"]


def lacks_image(plan: Plan, image_present: bool) -> bool:
    """Whether this run pulls the rig's image (services managed, and the image not on the rig)."""
    return bool(plan.knobs.serving.rigforge_manage_services) and not image_present


def image_refusal(plan: Plan, found: list[obtain.Source]) -> tuple[list[str], list[str]]:
    """(problems, warnings) once the sources were asked for the image (`obtain.sources`): refused when none has it;
    a warning when none is known to have it but some could not be asked."""
    warning = obtain.unasked(plan.locked_image, found)
    problem = obtain.problem(plan.locked_image, found, plan.variant.successor)
    return ([problem] if problem else []), ([warning] if warning else [])


def needs(plan: Plan, fetched: Sequence[PlannedAsset], image_present: bool) -> Needs:
    """What the variant needs of the rig; its disk: the bytes still to land on the model disk (`fetched`: the weights
    this run downloads; the image when the rig lacks it)."""
    variant = plan.variant
    cuda = plan.lock.image_cuda(plan.locked_image) if plan.lock else None
    disk = sum(asset.bytes for asset in fetched)
    if lacks_image(plan, image_present):
        disk += int(IMAGE_GB * 1e9)
    extra = getattr(getattr(variant, "recipe", None), "extra", None) or {}  # a slug's registry keys (seeds: none)
    return Needs(
        variant.name,
        variant.gpus,
        variant.min_card_mib,
        variant.uses_dflash,
        plan.layout.models,
        disk,
        plan.locked_image,
        cuda,
        nvlink=extra.get("requires_nvlink") is True,
        homogeneous=extra.get("requires_homogeneous_arch") is True,
    )
