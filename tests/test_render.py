"""Tier 3: every variant renders, and the rendered compose matches the reference facts flag for flag.

The reference is shared/reference/variants.yaml (copied to tests/fixtures/reference-variants.yaml), extracted
from the recipe repo's compose files. We compare parsed YAML, not text.
"""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import render_variant

from rigforge.model.catalog import env_file_text, load_catalog
from rigforge.model.schema import Settings, SettingsError, apply_overrides, parse_set

FIXTURES = Path(__file__).parent / "fixtures"
REF = yaml.safe_load((FIXTURES / "reference-variants.yaml").read_text())
VARIANTS = list(load_catalog().variants)
SITE = "/usr/local/lib/python3.12/dist-packages"
MARLIN = "vllm/model_executor/kernels/linear/mixed_precision"
PATCHES = "/opt/rigforge/src/club-3090/models/qwen3.6-27b/vllm/patches"
# The recipe repo's relative host paths -> rigforge's host layout (DESIGN.md "Host layout").
HOST_PATHS = {
    "${MODEL_DIR:-../../../../models-cache}": "/opt/rigforge/models",
    "../cache/torch_compile": "/opt/rigforge/cache/torch_compile",
    "../cache/triton": "/opt/rigforge/cache/triton",
    "../patches/vllm-marlin-pad/marlin.py": f"/opt/rigforge/src/vllm-src/{MARLIN}/marlin.py",
    "../patches/vllm-marlin-pad/MPLinearKernel.py": f"/opt/rigforge/src/vllm-src/{MARLIN}/MPLinearKernel.py",
    "../patches/genesis/vllm/_genesis": "/opt/rigforge/src/genesis/vllm/_genesis",
    "../patches/patch_tolist_cudagraph.py": f"{PATCHES}/patch_tolist_cudagraph.py",
    "../patches/patch_workspace_lock_disable.py": f"{PATCHES}/patch_workspace_lock_disable.py",
    "../patches/carnice-chat-template.jinja": f"{PATCHES}/carnice-chat-template.jinja",
}


def rendered_service(name, settings=None):
    files = render_variant(load_catalog().variants[name], settings or Settings())
    compose = yaml.safe_load(files["docker-compose.yml"])
    ((key, service),) = compose["services"].items()
    return key, service, files


@pytest.mark.parametrize("name", VARIANTS)
def test_compose_matches_reference_flag_for_flag(name):
    ref = REF["variants"][name]
    key, svc, _ = rendered_service(name)
    expected_args = []
    for a in ref["vllm_serve_args"]:
        expected_args += [a["flag"]] + ([a["value"]] if a["value"] is not None else [])
    assert svc["command"] == expected_args
    assert key == ref["service_key"]
    assert svc["container_name"] == ref["container_name"]
    assert svc["image"] == ref["image"]
    assert svc["restart"] == ref["restart"]
    assert svc["shm_size"] == ref["shm_size"] and svc["ipc"] == ref["ipc"]
    assert svc["ports"] == [f"{ref['port']['host_default']}:{ref['port']['container']}"]
    ref_env = {k: (v["value"] if isinstance(v, dict) else v) for k, v in ref["environment"].items()}
    assert svc["environment"] == ref_env
    ref_volumes = [f"{HOST_PATHS[v['host']]}:{v['container']}{':ro' if v['read_only'] else ''}" for v in ref["volumes"]]
    assert svc["volumes"] == ref_volumes
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device == ref["gpu_reservation"]


@pytest.mark.parametrize("name", VARIANTS)
def test_entrypoint_only_where_the_reference_overrides_it(name):
    ref = REF["variants"][name]
    _, svc, _ = rendered_service(name)
    assert ("entrypoint" in svc) == ref["entrypoint_override"]


def test_dual_turbo_entrypoint_runs_the_recipe_steps_in_order():
    _, svc, _ = rendered_service("dual-turbo")
    shell, flag, script, dashdash = svc["entrypoint"]
    assert (shell, flag, dashdash) == ("/bin/bash", "-c", "--")
    lines = script.splitlines()
    assert lines[0] == "set -e"
    assert lines[1] == "pip install xxhash pandas scipy -q"
    assert f"{SITE}/vllm/_genesis/patches/apply_all.py" in lines[2] and "exit 1" in lines[2]
    assert lines[3:] == [
        "python3 -m vllm._genesis.patches.apply_all",
        "python3 /patches/patch_workspace_lock_disable.py",
        "python3 /patches/patch_tolist_cudagraph.py",
        'exec vllm serve "$$@"',  # $$ is compose's escape for a literal $
    ]


def test_the_hf_token_is_in_no_rendered_file_and_the_api_key_only_in_env():
    s = Settings(hf_token="hf_" + "x" * 34, api_key="sk-secret-123")
    _, svc, files = rendered_service("dual", s)
    assert not any("hf_xxxx" in text for text in files.values())  # the weights are fetched before vLLM starts
    assert "sk-secret-123" not in files["docker-compose.yml"]
    assert "RIGFORGE_API_KEY=sk-secret-123" in files[".env"].splitlines()
    assert svc["command"][-2:] == ["--api-key", "${RIGFORGE_API_KEY}"]
    assert svc["environment"]["HUGGING_FACE_HUB_TOKEN"] == "${HF_TOKEN:-}"


def test_the_env_file_holds_only_the_api_key():
    header = "# rigforge: secrets for this variant's compose file (mode 0600). Do not commit.\n"
    assert env_file_text(Settings(hf_token="hf_" + "x" * 34)) == header  # no key: the header alone
    assert env_file_text(Settings(hf_token="hf_" + "x" * 34, api_key="k")) == header + "RIGFORGE_API_KEY=k\n"


def test_20gb_override_replaces_values_in_place():
    s = apply_overrides(Settings(), {"kv_cache_dtype": "fp8_e5m2", "gpu_memory_utilization": "0.82"})
    _, svc, _ = rendered_service("dual-turbo", s)
    cmd = svc["command"]
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8_e5m2"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.82"
    _, default, _ = rendered_service("dual-turbo")
    assert cmd.count("--kv-cache-dtype") == 1 and len(cmd) == len(default["command"])


def test_port_bind_model_dir_and_extra_args():
    s = apply_overrides(
        Settings(),
        {
            "port": "9001",
            "bind_address": "127.0.0.1",
            "model_dir": "/data/models/",
            "extra_args": "--x-a --x-b",
        },
    )
    _, svc, _ = rendered_service("dual", s)
    assert svc["ports"] == ["127.0.0.1:9001:8000"]
    assert svc["volumes"][0] == "/data/models:/root/.cache/huggingface"
    assert svc["command"][-2:] == ["--x-a", "--x-b"]


def test_power_unit_has_one_cap_per_gpu_with_overrides():
    s = apply_overrides(Settings(), {"power_limit_w": "230", "power_limits": "{1: 250}"})
    files = render_variant(load_catalog().variants["dual"], s)
    execs = [ln for ln in files["rigforge-gpu-power.service"].splitlines() if ln.startswith("ExecStart=")]
    assert execs == [
        "ExecStart=/usr/bin/nvidia-smi -pm 1",
        "ExecStart=/usr/bin/nvidia-smi -i 0 -pl 230",
        "ExecStart=/usr/bin/nvidia-smi -i 1 -pl 250",
    ]


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"port": "0"}, "'port' must be a port number"),
        ({"gpu_memory_utilization": "1.5"}, "must be a number in \\(0, 1\\]"),
        ({"kv_cache_dtype": "int3"}, "must be one of: auto, fp8, fp8_e5m2"),
        ({"bind_address": "localhost"}, "must be an IP address"),
        ({"model_dir": "models"}, "must be an absolute path"),
        ({"max_num_seqs": "four"}, "must be an integer"),
        ({"colour": "red"}, "unknown setting 'colour'; allowed: port, "),
    ],
)
def test_bad_settings_name_the_key_and_allowed_values(overrides, message):
    with pytest.raises(SettingsError, match=message):
        apply_overrides(Settings(), overrides)


def test_secret_values_are_not_echoed_in_errors():
    with pytest.raises(SettingsError) as err:
        apply_overrides(Settings(), {"api_key": "two\nlines-secret"})
    assert "secret" not in str(err.value)


def test_parse_set_requires_key_value():
    assert parse_set(["port=1", "extra_args=--a=b", "x=true", 'y=["--a"]']) == {
        "port": 1,
        "extra_args": "--a=b",
        "x": True,
        "y": ["--a"],
    }
    with pytest.raises(SettingsError, match="expected KEY=VALUE"):
        parse_set(["port"])


def rigforge(*args, env=None):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "RIGFORGE_HF_TOKEN")} | (env or {})
    return subprocess.run([sys.executable, "-m", "rigforge.cli", *args], capture_output=True, text=True, env=env)


def test_cli_render_writes_the_controllers_token_nowhere(tmp_path):
    token = "hf_" + "e" * 34
    r = rigforge("render", "dual", "--out", str(tmp_path), env={"RIGFORGE_HF_TOKEN": token})
    assert r.returncode == 0 and token not in r.stdout + r.stderr
    assert not any(token in p.read_text() for p in tmp_path.iterdir())


def test_cli_render_writes_what_a_rig_gets(tmp_path):
    out = tmp_path / "rendered"
    r = rigforge("render", "dual-turbo", "--out", str(out), "--set", "port=8111")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".env", "docker-compose.yml", "rigforge-gpu-power.service", "rigforge-vllm@.service"]
        + ["rigforge-gpu-settle.service", "rigforge-gpu-settle"]
        + ["rigforge-gpu-hold.service", "rigforge-gpu-hold.timer", "rigforge-gpu-hold"]
    )
    assert stat.S_IMODE(os.stat(out / "rigforge-gpu-settle").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(out / "rigforge-gpu-hold").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(out / ".env").st_mode) == 0o600
    assert yaml.safe_load((out / "docker-compose.yml").read_text())["services"]["vllm-qwen36-27b-dual-turbo"][
        "ports"
    ] == ["8111:8000"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["render", "dual-tubro"], "unknown variant 'dual-tubro'; choose one of"),
        (["render", "dual", "--set", "colour=red"], "unknown setting 'colour'; allowed:"),
        (["render", "dual", "--set", "port=eighty"], "serving_port must be a port number in 1..65535, got 'eighty'"),
        (["render", "dual-dflash", "--set", "kv_cache_dtype=fp8_e5m2"], "cannot be used with dual-dflash"),
    ],
)
def test_cli_render_bad_input_exits_2_and_writes_nothing(tmp_path, args, message):
    out = tmp_path / "rendered"
    r = rigforge(*args, "--out", str(out))
    assert r.returncode == 2
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_render_takes_host_data_keys_and_lists_as_host_data_has_them(tmp_path):
    out = tmp_path / "rendered"
    r = rigforge(
        "render",
        "dual-turbo",
        "--out",
        str(out),
        "--set",
        "serving_port=8111",
        "--set",
        'serving_extra_args=["--enable-log-requests", "--x y"]',
        "--set",
        "gpu_power_limit_w=250",
    )
    assert r.returncode == 0, r.stderr
    service = yaml.safe_load((out / "docker-compose.yml").read_text())["services"]["vllm-qwen36-27b-dual-turbo"]
    assert service["ports"] == ["8111:8000"] and service["command"][-2:] == ["--enable-log-requests", "--x y"]
    assert "-pl 250" in (out / "rigforge-gpu-power.service").read_text()
    r = rigforge("render", "dual-turbo", "--out", str(tmp_path / "yaml"), "--set", "extra_args=[--a, --b]")
    assert r.returncode == 0, r.stderr
    command = yaml.safe_load((tmp_path / "yaml" / "docker-compose.yml").read_text())["services"]
    assert command["vllm-qwen36-27b-dual-turbo"]["command"][-2:] == ["--a", "--b"]
