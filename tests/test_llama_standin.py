"""The testbed's llama-server stand-in (rigforge/testbed/image/llama-server) answers as llama-server does: 503
"Loading model" on /health and the API while it loads, then 200 {"status":"ok"}; its metrics names only with
--metrics (501 without); the OpenAI chat and tool-call API under its --alias; a missing or non-GGUF model fails."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rigforge.testbed import imagebuild

SCRIPT = imagebuild.IMAGE_DIR / "llama-server"
LIB = Path(imagebuild.OPENAI_STUB).parent
LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start(tmp_path: Path, *extra: str, load_s: str = "2") -> tuple[subprocess.Popen, str]:
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    (models / "main.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    (models / "draft.gguf").write_bytes(b"GGUF" + b"\1" * 60)
    port = free_port()
    env = {**os.environ, "RIGFORGE_STANDIN_LIB": str(LIB), "RIGFORGE_STANDIN_LOAD_S": load_s}
    args = ["--host", "127.0.0.1", "--port", str(port), "-m", str(models / "main.gguf"), "--alias", "tess-4-27b"]
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args, *extra], env=env, stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # its start line: listening
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture
def server(tmp_path):
    proc, url = start(tmp_path, "--spec-draft-model", str(tmp_path / "models/draft.gguf"), "-ngl", "99")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_health_answers_503_loading_model_then_200_ok(server):
    t0 = time.monotonic()
    assert get(f"{server}/health") == (503, json.dumps(LOADING).encode())
    assert get(f"{server}/v1/models")[0] == 503  # the API too, while it loads
    while get(f"{server}/health")[0] == 503:
        assert time.monotonic() - t0 < 10
        time.sleep(0.2)
    assert time.monotonic() - t0 >= 1.5  # it did load for a while
    assert get(f"{server}/health") == (200, b'{"status": "ok"}')
    code, body = get(f"{server}/v1/models")
    assert code == 200 and json.loads(body)["data"][0]["id"] == "tess-4-27b"


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 10
    while get(f"{url}/health")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_chat_and_tool_calls_answer_under_the_alias(server):
    wait_ready(server)
    code, body = get(f"{server}/v1/chat/completions", {"model": "tess-4-27b", "messages": [{"role": "user"}]})
    assert code == 200 and "Paris" in json.loads(body)["choices"][0]["message"]["content"]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    req = {"model": "tess-4-27b", "messages": [{"role": "user", "content": "weather?"}], "tools": [tool]}
    code, body = get(f"{server}/v1/chat/completions", req)
    assert code == 200 and json.loads(body)["choices"][0]["message"]["tool_calls"]


def test_metrics_are_501_without_the_flag(server):
    wait_ready(server)
    code, body = get(f"{server}/metrics")
    assert code == 501 and "--metrics" in json.loads(body)["error"]["message"]


def test_metrics_are_llamacpps_names_with_the_flag(tmp_path):
    proc, url = start(tmp_path, "--metrics", load_s="0")
    try:
        wait_ready(url)
        get(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        code, body = get(f"{url}/metrics")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    text = body.decode()
    assert code == 200 and "vllm:" not in text
    values = dict(line.split(" ") for line in text.splitlines() if not line.startswith("#"))
    assert float(values["llamacpp:prompt_tokens_total"]) > 0 and float(values["llamacpp:tokens_predicted_total"]) >= 5
    assert {"llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:n_decode_total"} <= set(values)


@pytest.mark.parametrize("bad", ["missing.gguf", "notgguf.bin"])
def test_a_model_that_is_not_a_gguf_file_fails_at_start(tmp_path, bad):
    (tmp_path / "notgguf.bin").write_bytes(b"PK\3\4")
    env = {**os.environ, "RIGFORGE_STANDIN_LIB": str(LIB)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "-m", str(tmp_path / bad), "--port", "0"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 1 and "is not a GGUF file" in proc.stderr


def test_the_image_carries_the_stand_in_where_the_recipes_exec_it():
    files = imagebuild.stand_in_files()
    assert files["app/llama-server"] == (SCRIPT.read_bytes(), 0o755)
