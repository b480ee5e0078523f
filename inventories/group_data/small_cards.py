"""2x 20 GB cards (e.g. modded RTX 3080 20 GB): the documented override. dual-dflash* do not fit."""

serving_kv_cache_dtype = "fp8_e5m2"  # instead of turboquant_3bit_nc on dual-turbo
serving_gpu_memory_utilization = 0.82
