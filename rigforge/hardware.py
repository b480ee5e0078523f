"""Does a rig's hardware fit a variant? Pure checks on GPUs as nvidia-smi reports them (dicts from
roles.facts.nvidia.parse_query_gpu), shared by the deploy's checks (roles/operations/checks.py) and `rigforge verify`.
"""

from __future__ import annotations

SMALL_CARD_MIB = 24000  # below this a card is a "20 GB card"
SMALL_CARD_OVERRIDE = {"serving_kv_cache_dtype": "fp8_e5m2", "serving_gpu_memory_utilization": 0.82}


def cards(gpus: list[dict]) -> str:
    names = sorted({str(gpu.get("name")) for gpu in gpus})
    return f"GPU {', '.join(str(gpu['index']) for gpu in gpus)} ({', '.join(names)})"


def small_override(kv_cache_dtype, gpu_memory_utilization) -> bool:
    """Whether the documented 20 GB-card override is set (fp8_e5m2 KV and at most 0.82 of the memory)."""
    try:
        fraction = float(gpu_memory_utilization)
    except (TypeError, ValueError):
        return False
    return kv_cache_dtype == SMALL_CARD_OVERRIDE["serving_kv_cache_dtype"] and fraction <= float(
        SMALL_CARD_OVERRIDE["serving_gpu_memory_utilization"]
    )


def vram_problems(gpus: list[dict], variant: str, card_mib: int, dflash: bool, override: bool) -> list[str]:
    """Cards with less VRAM than `variant` needs (empty when every card fits, or fits with the 20 GB override)."""
    short = [gpu for gpu in gpus if (gpu.get("memory_total") or 0) < card_mib]
    if not short:
        return []
    vram = min(gpu.get("memory_total") or 0 for gpu in short)
    seen = f"{cards(short)} {'has' if len(short) == 1 else 'have'} {vram} MiB"
    if vram < SMALL_CARD_MIB and dflash:
        return [
            f"{seen}; {variant} (DFlash) needs 24 GB cards and has no 20 GB override; "
            "choose dual or dual-turbo with the 20 GB override."
        ]
    if vram < SMALL_CARD_MIB and not override:
        return [
            f"{seen}, less than the {card_mib} MiB {variant} needs; for 20 GB cards set "
            "serving_kv_cache_dtype: fp8_e5m2 and serving_gpu_memory_utilization: 0.82 in host data."
        ]
    if vram >= SMALL_CARD_MIB:
        return [f"{seen}, less than the {card_mib} MiB {variant} needs."]
    return []
