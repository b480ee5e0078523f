"""Every path and name rigforge uses on a rig (pure data); the roles get theirs through `Plan.layout`."""

from dataclasses import dataclass
from typing import NamedTuple

DEFAULT_ROOT = "/opt/rigforge"  # rigforge_root: models, src, serve, cache, venv live under it
ETC = "/etc/rigforge"  # the rig manifest rig.json
UNIT_DIR = "/etc/systemd/system"  # where rigforge installs its units
UNIT_SEARCH_PATH = (UNIT_DIR, "/lib/systemd/system", "/usr/lib/systemd/system")  # systemd's precedence (others' units)
RUN_LOCK = "/run/lock/rigforge.lock"  # held by the one rigforge run provisioning the rig (roles/rig_lock.py)
DAEMON_JSON = "/etc/docker/daemon.json"  # Docker's config: rigforge merges the nvidia runtime into it
NVIDIA_RUNTIME = {"runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}}}  # the key it owns there
# the files rigforge owns in the system's own config dirs (each named rigforge-*, removed by nothing else)
NOUVEAU_CONF = "/etc/modprobe.d/rigforge-blacklist-nouveau.conf"  # the driver needs nouveau unloaded
UNATTENDED_CONF = "/etc/apt/apt.conf.d/51rigforge-nvidia-unattended-upgrades"  # the driver is held from them
UBUNTU_PIN = "/etc/apt/preferences.d/rigforge-nvidia-ubuntu-archive"  # Ubuntu: the driver from the archive only
APT_KEYRING_DIR = "/etc/apt/keyrings"  # the repositories' signing keys (rigforge-*.asc)
APT_SOURCES_DIR = "/etc/apt/sources.list.d"  # the repositories rigforge adds (rigforge-*.sources)
APT_IGNORE_BACKUPS_CONF = "/etc/apt/apt.conf.d/50rigforge-ignore-backups"  # apt skips adopted sources' backups
UPLOAD_PREFIX = "/tmp/.rigforge-upload-"  # + the SSH user: the user's own 0700 dir that sudo uploads pass through
STAMP = ".rigforge-stamp.json"  # written by rigforge/remote/fetch_weights.py in every asset dir
SERVE_FILES = {  # what a serve dir holds, when the variant renders it, and each file's mode (.env: secrets)
    "docker-compose.yml": "644",
    "compose.override.yml": "644",  # a recipe slug: the recipe's own compose file runs with this host override
    ".env": "600",
}
STAGING = ".staging"  # staged_files' staging dir inside the destination dir
VLLM_PREFIX = "rigforge-vllm@"  # instances: rigforge-vllm@<variant>.service
VLLM_TEMPLATE = f"{VLLM_PREFIX}.service"
POWER_UNIT = "rigforge-gpu-power.service"
SETTLE_UNIT = "rigforge-gpu-settle.service"  # re-applies the caps once the boot has finished (rigforge/observe/boot.py)
SETTLE_SCRIPT = "rigforge-gpu-settle"  # in LIBEXEC: the settle stage's script
HOLD_SCRIPT = "rigforge-gpu-hold"  # in LIBEXEC: one pass of the cap hold (the settle stage runs it too)
HOLD_UNIT = "rigforge-gpu-hold.service"  # runs HOLD_SCRIPT once
HOLD_TIMER = "rigforge-gpu-hold.timer"  # starts HOLD_UNIT every HOLD_INTERVAL_S (host data gpu_power_hold)
HOLD_INTERVAL_S = 15
STATE_DIR = "/var/lib/rigforge"  # rig-side state rigforge's scripts keep across boots
CAP_SETBACKS = "gpu-cap-setbacks"  # in STATE_DIR: set-backs per GPU, written by HOLD_SCRIPT alone
CRON_FILES = ("/etc/crontab", "/etc/cron.d/*", "/var/spool/cron/crontabs/*")  # cron's tables (Debian's paths)
RC_LOCAL = "/etc/rc.local"
UDEV_RULES_DIRS = ("/etc/udev/rules.d", "/lib/udev/rules.d", "/usr/lib/udev/rules.d")
GPU_METRICS_SCRIPT = "rigforge-gpu-metrics"  # in LIBEXEC: the GPU textfile collector (docs/monitoring.md)
# Debian's prometheus-node-exporter reads *.prom from here (its README.textfile; the binary's built-in default)
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
GPU_METRICS_FILE = "rigforge-gpu.prom"  # in TEXTFILE_DIR: what the collector writes
GPU_METRICS_UNIT = "rigforge-gpu-metrics.service"  # runs the collector once
GPU_METRICS_TIMER = "rigforge-gpu-metrics.timer"  # starts GPU_METRICS_UNIT every GPU_METRICS_INTERVAL_S
GPU_METRICS_INTERVAL_S = 15
NODE_EXPORTER_PACKAGE = "prometheus-node-exporter"  # Debian's; its unit has the package's name
# the monitor host (roles/monitor.py): Debian's prometheus reads these
MONITOR_CONFIG = "/etc/prometheus/prometheus.yml"
MONITOR_RULES = "/etc/prometheus/rigforge-alerts.rules.yml"  # templates/monitor/rigforge-alerts.rules.yml
MONITOR_DEFAULTS = "/etc/default/prometheus"  # its ARGS: the retention flags
# its --web.console.templates and --web.console.libraries defaults: the fleet page and its library go here
MONITOR_CONSOLES = "/etc/prometheus/consoles"  # templates/monitor/consoles
MONITOR_CONSOLE_LIBRARIES = "/etc/prometheus/console_libraries"  # templates/monitor/console_libraries
# the fleet gateway (roles/gateway.py): HAProxy runs rigforge's config, via a drop-in for the distro's unit
GATEWAY_DIR = f"{ETC}/gateway"
GATEWAY_CFG = "haproxy.cfg"
GATEWAY_UNIT = "haproxy.service"
GATEWAY_DROPIN_DIR = f"{UNIT_DIR}/{GATEWAY_UNIT}.d"
GATEWAY_DROPIN = "rigforge.conf"
GATEWAY_ADMIN_SOCKET = "/run/haproxy/rigforge-admin.sock"  # HAProxy's runtime API (drain, state), root only
GATEWAY_STATE = "/var/lib/haproxy/rigforge-servers.state"  # runtime state kept across reloads (drains, ports)


def _under(base: str, name: str) -> property:
    """A property: the path `name` in the directory the attribute `base` holds."""
    return property(lambda self: f"{getattr(self, base)}/{name}")


class AssetDir(NamedTuple):
    """Where a variant's weights land on the rig, and how big they are until the lock knows."""

    asset: str  # the lock's hf entry
    dir: str  # under the model dir (`HostLayout.asset_dir`)
    approx_bytes: int  # the variant's estimate, for the disk check while the lock has no file sizes


@dataclass(frozen=True)
class HostLayout:
    root: str = DEFAULT_ROOT  # rigforge_root
    model_dir: str | None = None  # serving_model_dir; default <root>/models
    variant: str = ""  # the variant this rig serves (names serve/<variant> and the unit instance)
    etc: str = ETC
    unit_dir: str = UNIT_DIR

    daemon_json = DAEMON_JSON
    vllm_template = VLLM_TEMPLATE
    power_unit = POWER_UNIT
    settle_unit = SETTLE_UNIT
    hold_unit = HOLD_UNIT
    hold_timer = HOLD_TIMER
    state_dir = STATE_DIR
    libexec = "/usr/local/lib/rigforge"  # rig-side scripts the units run (not under the root: they run at every boot)
    textfile_dir = TEXTFILE_DIR
    gpu_metrics_timer = GPU_METRICS_TIMER
    enabled_at_boot = (POWER_UNIT, SETTLE_UNIT, GPU_METRICS_TIMER)  # besides the vLLM instance and the cap hold

    src_root = _under("root", "src")
    serve_root = _under("root", "serve")
    cache = _under("root", "cache")
    venv = _under("root", "venv")
    lib = _under("root", "lib")
    weights_work = _under("root", "run/weights")  # root-only: weight manifests and the transient token file
    images = _under("root", "images")  # saved images on their way into Docker (roles/images.py, `rigforge images load`)
    images_layout = _under("images", "oci")  # the OCI image layout the saved blobs are uploaded into
    images_upload = _under("images", ".upload")  # a sudo user's uploads (the user's, 0700) until root moves them
    images_work = _under("images", ".work")  # the temporary registry's storage and the load's state
    images_script = _under("images", "load_images.sh")  # runs the temporary registry
    rig_json = _under("etc", "rig.json")
    settle_script = _under("libexec", SETTLE_SCRIPT)
    hold_script = _under("libexec", HOLD_SCRIPT)
    cap_setbacks = _under("state_dir", CAP_SETBACKS)
    gpu_metrics_script = _under("libexec", GPU_METRICS_SCRIPT)

    @property
    def models(self) -> str:
        """The model dir: host data serving_model_dir, else <root>/models."""
        return self.model_dir or f"{self.root}/models"

    @property
    def serve_dir(self) -> str:
        """The variant's compose project directory."""
        return f"{self.serve_root}/{self.variant}"

    @property
    def vllm_unit(self) -> str:
        """The variant's vLLM instance, rigforge-vllm@VARIANT.service."""
        return self.instance(self.variant)

    def src(self, name: str) -> str:
        return f"{self.src_root}/{name}"

    def weights_staging(self, asset: str) -> str:
        return f"{self.models}/.rigforge-staging/{asset}"  # downloads land here until verified

    def asset_dir(self, dirname: str) -> str:
        return f"{self.models}/{dirname}"

    @staticmethod
    def instance(variant: str) -> str:
        return f"{VLLM_PREFIX}{variant}.service"

    def unit_path(self, unit: str) -> str:
        return f"{self.unit_dir}/{unit}"
