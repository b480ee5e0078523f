"""A tiny OpenAI-compatible server with a known token schedule (tests and the testbed demo).

It is not a model: every streamed reply is `tokens` deltas (each worth `tokens_per_delta`
tokens) sent on a fixed clock -- the first `ttft_ms` after the request was read, then one every
`dt_ms` -- then a usage chunk and `[DONE]`, with HTTP/1.1 chunked encoding like vLLM's server.
Sends are scheduled against absolute deadlines (no drift) and the stub records, on
CLOCK_MONOTONIC, when it read each request and when it was about to send the first delta and
`[DONE]`: `GET /_stub/log` returns one record per streamed request.

Endpoints: `GET /health` (200, no body, as vLLM's), `GET /v1/models`, `POST /v1/chat/completions`
(streamed or not; a request with `tools` gets a tool call back, any other gets text that mentions Paris, as the
recipes' verify expects), `GET /_stub/log`.

Run: `python -m rigforge.testbed.openai_stub --port 0 --ttft-ms 100 --dt-ms 10 --tokens 40`
prints the base URL on the first stdout line, then serves until killed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Schedule:
    model: str = "qwen3.6-27b-autoround"
    ttft_ms: float = 100.0
    dt_ms: float = 10.0
    tokens: int = 40
    usage: bool = True  # send the final usage chunk when the client asks for it
    reasoning_tokens: int = 0  # the first N deltas are reasoning_content, not content
    tokens_per_delta: int = 1  # >1 mimics speculative decoding: several tokens per streamed delta
    api_key: str | None = None  # like vLLM's --api-key: /v1/* needs "Authorization: Bearer <key>"
    max_concurrent: int = 0  # >0: at most this many completions at once, the others wait (a real server's batch)
    log: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _sleep_until(deadline_ns: int) -> None:
    while True:
        left = deadline_ns - time.monotonic_ns()
        if left <= 0:
            return
        time.sleep(left / 1e9)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rigforge-openai-stub"
    schedule: Schedule  # set on the subclass made by make_server()

    def log_message(self, format, *args):  # noqa: A002 - quiet; tests read /_stub/log instead
        pass

    def setup(self):
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _json(self, code: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _unauthorized(self) -> bool:
        key = self.schedule.api_key
        if key and self.path.startswith("/v1/") and self.headers.get("Authorization") != f"Bearer {key}":
            self._json(401, {"error": "Unauthorized"})
            return True
        return False

    def do_GET(self):  # noqa: N802
        s = self.schedule
        if self._unauthorized():
            return
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": s.model, "object": "model"}]})
        elif self.path == "/_stub/log":
            with s.lock:
                self._json(200, list(s.log))
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self):  # noqa: N802
        t_recv = time.monotonic_ns()
        s = self.schedule
        if self._unauthorized():
            return
        if self.path != "/v1/chat/completions":
            self._json(404, {"error": {"message": f"no route {self.path}"}})
            return
        length = int(self.headers.get("Content-Length") or 0)
        try:
            req = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self._json(400, {"error": {"message": "body is not JSON"}})
            return
        if req.get("model") not in (None, s.model):
            self._json(404, {"error": {"message": f"The model `{req.get('model')}` does not exist."}})
            return
        n = min(s.tokens, int(req.get("max_tokens") or s.tokens) // s.tokens_per_delta)
        with self.server.slots:  # a request that waited for a slot is generated from then on
            self._answer(req, n, time.monotonic_ns() if s.max_concurrent else t_recv)

    def _answer(self, req, n: int, t_recv: int) -> None:
        s = self.schedule
        if req.get("tools"):
            self._tool_call(req)
        elif req.get("stream"):
            self._stream(req, n, t_recv)
        else:  # generated at the same rate as a stream, answered whole at the end
            _sleep_until(t_recv + int((s.ttft_ms + max(n - 1, 0) * s.dt_ms) * 1e6))
            text = "The capital of France is Paris."
            self._json(200, _completion(s.model, {"role": "assistant", "content": text}, len(text.split())))

    def _tool_call(self, req) -> None:
        name = req["tools"][0].get("function", {}).get("name", "tool")
        call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": '{"city": "Paris"}'}}
        msg = {"role": "assistant", "content": None, "tool_calls": [call]}
        self._json(200, _completion(self.schedule.model, msg, 12, finish="tool_calls"))

    def _chunk(self, obj) -> None:
        data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _stream(self, req, n: int, t_recv: int) -> None:
        s = self.schedule
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        sent = []  # monotonic time just before each delta is written: a client cannot see it earlier
        base = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": s.model}
        for i in range(n):
            _sleep_until(t_recv + int((s.ttft_ms + i * s.dt_ms) * 1e6))
            key = "reasoning_content" if i < s.reasoning_tokens else "content"
            sent.append(time.monotonic_ns())
            self._chunk({**base, "choices": [{"index": 0, "delta": {key: f"t{i} "}, "finish_reason": None}]})
        self._chunk({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if s.usage and (req.get("stream_options") or {}).get("include_usage"):
            k = n * s.tokens_per_delta
            usage = {"prompt_tokens": 20, "completion_tokens": k, "total_tokens": 20 + k}
            self._chunk({**base, "choices": [], "usage": usage})
        t_done = time.monotonic_ns()
        self._chunk(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        late = [(t - (t_recv + int((s.ttft_ms + i * s.dt_ms) * 1e6))) / 1e6 for i, t in enumerate(sent)]
        with s.lock:
            s.log.append(
                {
                    "deltas": n,
                    "tokens": n * s.tokens_per_delta,
                    "ttft_ms": (sent[0] - t_recv) / 1e6 if sent else None,
                    "wall_ms": (t_done - t_recv) / 1e6,  # request read -> [DONE] about to be sent
                    "max_late_ms": max(late, default=0.0),
                    # absolute CLOCK_MONOTONIC ns, the clock of time.perf_counter_ns on this host
                    "recv_ns": t_recv,
                    "first_sent_ns": sent[0] if sent else None,
                    "done_ns": t_done,
                }
            )


def _completion(model: str, message: dict, tokens: int, finish: str = "stop") -> dict:
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 20, "completion_tokens": tokens, "total_tokens": 20 + tokens},
    }


class _Server(ThreadingHTTPServer):
    """Tracks its open connections, so that `abort()` can end every request in flight at once: what a server
    killed mid-generation does to its clients (the testbed's stand-in does it on SIGTERM)."""

    daemon_threads = True

    def __init__(self, address, handler, max_concurrent: int = 0):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_concurrent) if max_concurrent else contextlib.nullcontext()
        self.open: set = set()

    def process_request(self, request, client_address):
        self.open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        self.open.discard(request)
        super().shutdown_request(request)

    def abort(self) -> None:
        for conn in list(self.open):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client hanging up is not an error
            super().handle_error(request, client_address)


def make_server(schedule: Schedule, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"schedule": schedule})
    return _Server((host, port), handler, schedule.max_concurrent)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rigforge.testbed.openai_stub", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = a free port")
    p.add_argument("--model", default=Schedule.model)
    p.add_argument("--ttft-ms", type=float, default=Schedule.ttft_ms)
    p.add_argument("--dt-ms", type=float, default=Schedule.dt_ms)
    p.add_argument("--tokens", type=int, default=Schedule.tokens)
    p.add_argument("--reasoning-tokens", type=int, default=0)
    p.add_argument("--tokens-per-delta", type=int, default=1)
    p.add_argument("--no-usage", action="store_true", help="never send the usage chunk")
    p.add_argument("--api-key", help="require this key on /v1/*, as vLLM's --api-key does")
    p.add_argument("--max-concurrent", type=int, default=0, help="at most N completions at once (0: no bound)")
    a = p.parse_args(argv)
    sched = Schedule(
        a.model, a.ttft_ms, a.dt_ms, a.tokens, not a.no_usage, a.reasoning_tokens, a.tokens_per_delta, a.api_key,
        a.max_concurrent,
    )  # fmt: skip
    server = make_server(sched, a.host, a.port)
    print(f"http://{a.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
