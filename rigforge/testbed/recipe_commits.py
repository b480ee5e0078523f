"""The testbed's recipe repo moving on: commits B and B-slow after A, to rehearse a recipe bump.

A is the subset RIGFORGE_RECIPES names, as it is (club-3090 at 4a29ab57). B is what a later upstream commit does:
- the `vllm-stable` engine moves to B_IMAGE and gains upstream's `image_env: VLLM_IMAGE` (the 2-card composes
  read `${VLLM_IMAGE:-...}` already; their default follows the engine);
- vllm/dual's compose changes one flag's default (--max-num-batched-tokens 8192 -> 16384);
- a new slug, NEW_SLUG, serves new weights (NEW_WEIGHTS, a repo the HF stand-in serves but the testbed lock at A
  does not list), on vllm/dual's compose and port.
B-slow is B whose engine image (SLOW_IMAGE) answers at half the speed (SLOW_ENV in the stand-in image).
Each is a commit of the `recipes` remote, tagged A, B and B-slow (`rigforge lock --recipes B`).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

A_IMAGE = "vllm/vllm-openai:v0.27.1"
B_IMAGE = "vllm/vllm-openai:v0.31.0"
SLOW_IMAGE = "vllm/vllm-openai:v0.31.0-halfspeed"
SLOW_ENV = {"RIGFORGE_STANDIN_SPEED": "0.5"}  # the stand-in's token rate, against its default
NEW_SLUG = "vllm/qwen-27b-dual-v2"
NEW_WEIGHTS = "autoround-int4-v2"  # the model profile's key; its local_subdir is the testbed's HF key
NEW_REPO = "Lorbus/Qwen3.6-27B-int4-AutoRound-v2"
NEW_DIR = "qwen3.6-27b-autoround-int4-v2"

ENGINE = "scripts/lib/profiles/engines/vllm-stable.yml"
REGISTRY = "scripts/lib/profiles/registry.yaml"
MODEL = "scripts/lib/profiles/models/qwen3.6-27b.yml"
DUAL = "models/qwen3.6-27b/vllm/compose/dual/autoround-int4/fp8-mtp.yml"
NEW_COMPOSE = "models/qwen3.6-27b/vllm/compose/dual/autoround-int4-v2/fp8-mtp.yml"
TAGS = ("A", "B", "B-slow")


def _edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    if old not in text:
        raise ValueError(f"{path}: {old!r} not found (is RIGFORGE_RECIPES club-3090 at 4a29ab57?)")
    path.write_text(text.replace(old, new, count))


def _move_engine(tree: Path, old: str, new: str) -> None:
    """The engine's image `old` -> `new`, in its profile and in every compose file's default."""
    _edit(tree / ENGINE, f"spec: {old}", f"spec: {new}")
    for compose in (tree / "models").rglob("*.yml"):
        text = compose.read_text()
        if f"${{VLLM_IMAGE:-{old}}}" in text:
            compose.write_text(text.replace(f"${{VLLM_IMAGE:-{old}}}", f"${{VLLM_IMAGE:-{new}}}"))


def to_b(tree: Path) -> None:
    """Turn a checkout of A into B, in place."""
    _move_engine(tree, A_IMAGE, B_IMAGE)
    _edit(tree / ENGINE, "\nmin_sm:", "\nimage_env: VLLM_IMAGE  # upstream's launchers set the image here\nmin_sm:")
    _edit(tree / DUAL, "${MAX_NUM_BATCHED_TOKENS:-8192}", "${MAX_NUM_BATCHED_TOKENS:-16384}")
    compose = tree / NEW_COMPOSE
    compose.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tree / DUAL, compose)
    _edit(compose, "/root/.cache/huggingface/qwen3.6-27b-autoround-int4\n", f"/root/.cache/huggingface/{NEW_DIR}\n")
    weights = (
        f"\n  {NEW_WEIGHTS}:\n    path: {NEW_DIR}\n    local_subdir: {NEW_DIR}\n    size_gb: 17.5\n"
        f"    format: autoround\n    status: production\n    hf_repo: {NEW_REPO}\n"
    )
    _edit(tree / MODEL, "\nweights:\n", "\nweights:" + weights)
    registry = (tree / REGISTRY).read_text()
    block = re.search(r"^  vllm/dual:\n(?:(?:    .*)?\n)+", registry, re.M)
    if block is None:
        raise ValueError(f"{tree / REGISTRY}: no vllm/dual entry")
    new = (
        block.group(0)
        .replace("  vllm/dual:\n", f"  {NEW_SLUG}:\n")
        .replace("weights_variant: autoround-int4\n", f"weights_variant: {NEW_WEIGHTS}\n")
        .replace(f"compose_path: {DUAL}\n", f"compose_path: {NEW_COMPOSE}\n")
    )
    (tree / REGISTRY).write_text(registry[: block.end()] + new + registry[block.end() :])


def to_slow(tree: Path) -> None:
    """Turn a checkout of B into B-slow, in place."""
    _move_engine(tree, B_IMAGE, SLOW_IMAGE)


STEPS = (
    ("B", to_b, "bump: vllm-stable to v0.31.0 (image_env), a flag, a new slug"),
    ("B-slow", to_slow, "bump: vllm-stable to a half-speed image"),
)
