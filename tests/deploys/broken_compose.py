"""Test deploy: try to install a compose file that `docker compose config` rejects over a working one."""

from roles.operations.staged import staged_files

staged_files(
    name="Install a broken compose file over dual's",
    dest="/opt/rigforge/serve/dual",
    files={
        "docker-compose.yml": ("services:\n  vllm:\n    image: x\n    shm_sise: 16gb\n", "644"),
        ".env": ("HF_TOKEN=\n", "600"),
    },
    validate="docker compose config -q",
)
