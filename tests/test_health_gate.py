"""The serving role's health gate script, run for real (bash + curl) against a local OpenAI-compatible server.

No systemd runs here, so `systemctl` and `journalctl` are small recording stand-ins on PATH (`systemctl show`
answers FAKE_NRESTARTS, the unit's restart count): the test checks
what the gate asks systemd to do (nothing on success; disable the new instance and re-enable the previous
one on failure), and that it fails with the reason.
"""

import subprocess
import threading
import time

import pytest

from rigforge.testbed.openai_stub import Schedule, make_server
from roles.operations.serving import health_gate_script


def start(schedule):
    srv = make_server(schedule)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture
def server():
    srv, url = start(Schedule(ttft_ms=1, dt_ms=1, tokens=3))
    yield url
    srv.shutdown()


@pytest.fixture
def serve_dir(tmp_path):
    d = tmp_path / "serve" / "dual-turbo"
    d.mkdir(parents=True)
    (d / "docker-compose.yml").write_text("new compose\n")
    (d / ".env").write_text("HF_TOKEN=\nRIGFORGE_API_KEY=sk-gate-123\n")
    return d


@pytest.fixture
def fake_systemd(tmp_path):
    calls = tmp_path / "calls"
    for tool in ("systemctl", "journalctl"):
        exe = tmp_path / tool
        exe.write_text(
            f'#!/bin/sh\necho "{tool} $*" >> {calls}\n[ "$1" = is-failed ] && exit 1\n'
            '[ "$1" = show ] && echo "${FAKE_NRESTARTS:-0}"\nexit 0\n'
        )
        exe.chmod(0o755)
    return tmp_path, calls


def run_gate(fake_systemd, url, serve_dir, timeout=2, rollback="rigforge-vllm@dual.service", restarts=0):
    path, calls = fake_systemd
    unit = "rigforge-vllm@dual-turbo.service"
    script = health_gate_script(url, "qwen3.6-27b-autoround", timeout, unit, rollback, str(serve_dir))
    r = subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        env={"PATH": f"{path}:/usr/bin:/bin", "FAKE_NRESTARTS": str(restarts)},
        timeout=60,
    )
    return r, (calls.read_text().splitlines() if calls.exists() else [])


def test_gate_passes_when_models_and_chat_answer(server, fake_systemd, serve_dir):
    (serve_dir / ".env").write_text("HF_TOKEN=\n")
    r, calls = run_gate(fake_systemd, server, serve_dir)
    assert r.returncode == 0, r.stderr
    assert "serves qwen3.6-27b-autoround" in r.stdout
    assert not [c for c in calls if "disable" in c or "enable" in c]


def test_gate_sends_the_api_key_from_the_env_file_not_the_command_line(fake_systemd, serve_dir):
    srv, url = start(Schedule(ttft_ms=1, dt_ms=1, tokens=3, api_key="sk-gate-123"))
    try:
        r, _ = run_gate(fake_systemd, url, serve_dir)
        assert r.returncode == 0, r.stderr
        (serve_dir / ".env").write_text("RIGFORGE_API_KEY=wrong\n")  # the server refuses a wrong key
        r, _ = run_gate(fake_systemd, url, serve_dir, timeout=1)
        assert r.returncode == 1 and "no answer" in r.stderr
    finally:
        srv.shutdown()
    script = health_gate_script(url, "m", 1, "u.service", None, str(serve_dir))
    assert "sk-gate-123" not in script


def test_gate_rolls_back_when_nothing_answers(fake_systemd, serve_dir):
    r, calls = run_gate(fake_systemd, "http://127.0.0.1:9", serve_dir, timeout=1)  # port 9 (discard): refused
    assert r.returncode == 1
    assert "no answer from http://127.0.0.1:9/v1/models within 1 s" in r.stderr
    assert "systemctl disable --now rigforge-vllm@dual-turbo.service" in calls
    assert "systemctl enable --now rigforge-vllm@dual.service" in calls
    assert any(c.startswith("journalctl -a -u rigforge-vllm@dual-turbo.service") for c in calls)
    assert r.stderr.endswith(
        "rigforge health gate: rolled back to rigforge-vllm@dual.service, the unit that ran before\n"
    ), r.stderr


def test_gate_fails_at_once_when_the_server_exited_while_starting(fake_systemd, serve_dir):
    """Restart=on-failure keeps a crashing unit "activating", never "failed": the restart count gives it away."""
    t0 = time.monotonic()
    r, calls = run_gate(fake_systemd, "http://127.0.0.1:9", serve_dir, timeout=30, restarts=1)
    assert r.returncode == 1 and time.monotonic() - t0 < 10
    assert "the server exited while starting (rigforge-vllm@dual-turbo.service restarts it)" in r.stderr
    assert "systemctl enable --now rigforge-vllm@dual.service" in calls


def test_gate_restores_the_previous_files_of_the_same_variant(fake_systemd, serve_dir):
    (serve_dir / "docker-compose.yml.prev").write_text("working compose\n")
    (serve_dir / ".env.prev").write_text("HF_TOKEN=old\n")
    r, calls = run_gate(fake_systemd, "http://127.0.0.1:9", serve_dir, timeout=1, rollback=None)
    assert r.returncode == 1 and r.stderr.endswith(
        "rigforge health gate: rolled back to the compose file and .env rigforge-vllm@dual-turbo.service ran before, "
        "and restarted it\n"
    ), r.stderr
    assert (serve_dir / "docker-compose.yml").read_text() == "working compose\n"
    assert (serve_dir / ".env").read_text() == "HF_TOKEN=old\n"
    assert "systemctl restart rigforge-vllm@dual-turbo.service" in calls


def test_gate_with_nothing_to_go_back_to_stops_the_new_instance(fake_systemd, serve_dir):
    r, calls = run_gate(fake_systemd, "http://127.0.0.1:9", serve_dir, timeout=1, rollback=None)
    assert r.returncode == 1
    assert [c for c in calls if "able --now" in c] == ["systemctl disable --now rigforge-vllm@dual-turbo.service"]
    assert "rolled back" not in r.stderr and r.stderr.endswith(
        "rigforge health gate: nothing to roll back to (no earlier files of rigforge-vllm@dual-turbo.service): "
        "stopped and disabled it\n"
    ), r.stderr


def test_gate_restores_a_recipe_slugs_previous_override_too(fake_systemd, serve_dir):
    (serve_dir / "docker-compose.yml.prev").write_text("include wrapper\n")
    (serve_dir / ".env.prev").write_text("PORT=8010\n")
    (serve_dir / "compose.override.yml.prev").write_text("services: {old: {}}\n")
    (serve_dir / "compose.override.yml").write_text("services: {new: {}}\n")
    r, calls = run_gate(fake_systemd, "http://127.0.0.1:9", serve_dir, timeout=1, rollback=None)
    assert r.returncode == 1 and "rolled back" in r.stderr
    assert (serve_dir / "compose.override.yml").read_text() == "services: {old: {}}\n"
    assert not (serve_dir / "compose.override.yml.prev").exists()


def test_gate_waits_for_llama_servers_health_through_loading_model(fake_systemd, serve_dir, tmp_path):
    """A llama.cpp slug's gate asks llama-server's own /health: 503 "Loading model" for a while, then 200; the gate
    waits through the 503s (no rollback), then sends its chat completion to the alias."""
    import os
    import socket
    import sys

    from rigforge.testbed import imagebuild

    (tmp_path / "m.gguf").write_bytes(b"GGUF" + b"\0" * 28)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "RIGFORGE_STANDIN_LIB": str(imagebuild.OPENAI_STUB.parent),
        "RIGFORGE_STANDIN_LOAD_S": "5",
    }
    args = ["-m", str(tmp_path / "m.gguf"), "--alias", "tess-4-27b", "--port", str(port)]
    proc = subprocess.Popen([sys.executable, str(imagebuild.IMAGE_DIR / "llama-server"), *args], env=env)
    try:
        path, calls = fake_systemd
        (serve_dir / ".env").write_text("HF_TOKEN=\n")
        script = health_gate_script(
            f"http://127.0.0.1:{port}", "tess-4-27b", 30, "u.service", "v.service", str(serve_dir), True, "/health"
        )
        t0 = time.monotonic()
        r = subprocess.run(
            ["bash", "-c", script], capture_output=True, text=True, env={"PATH": f"{path}:/usr/bin:/bin"}
        )
        assert r.returncode == 0, r.stderr
        assert time.monotonic() - t0 >= 4  # it waited through the loading 503s
        assert "serves tess-4-27b" in r.stdout
        made = calls.read_text() if calls.exists() else ""
        assert "disable" not in made  # no rollback
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    failing = health_gate_script("http://127.0.0.1:9", "m", 1, "u.service", None, str(serve_dir), False, "/health")
    assert "no answer from http://127.0.0.1:9/health within 1 s" in failing
