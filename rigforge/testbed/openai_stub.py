"""A tiny OpenAI-compatible server with a known token schedule (tests and the testbed demo).

It is not a model: every streamed reply is `tokens` deltas (each worth `tokens_per_delta`
tokens) sent on a fixed clock -- the first `ttft_ms` after the request was read, then one every
`dt_ms` -- then a usage chunk and `[DONE]`, with HTTP/1.1 chunked encoding like vLLM's server.
Sends are scheduled against absolute deadlines (no drift) and the stub records, on
CLOCK_MONOTONIC, when it read each request and when it was about to send the first delta and
`[DONE]`: `GET /_stub/log` returns one record per streamed request.

Endpoints: `GET /health` (200, no body, as vLLM's), `GET /v1/models`, `POST /v1/chat/completions`
(streamed or not; a request with `tools` gets a tool call back, any other gets text that mentions Paris, as the
recipes' verify expects), `GET /metrics` (the vLLM metrics of VLLM_METRICS, from what the stub really does; no
API key, as vLLM's --api-key guards /v1 only), `GET /_stub/log`.

Each completion's prompt goes through a prefix cache kept as vLLM's automatic prefix caching keeps it (`PrefixCache`):
the rendered chat in blocks of 16 tokens, each block's hash chained to its parent's, least recently used blocks
evicted beyond a KV budget (`--kv-blocks`), hits and queries counted in tokens on /metrics as vLLM counts them.

Run: `python -m rigforge.testbed.openai_stub --port 0 --ttft-ms 100 --dt-ms 10 --tokens 40`
prints the base URL on the first stdout line, then serves until killed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROMPT_TOKENS = 20  # every request's prompt, as the usage the stub reports counts it

# The vLLM metrics the stand-in serves at /metrics: {name as exported: (type, HELP)}, with vLLM's labels
# (model_name = the served model name, engine = the engine core's index, "0" with one engine). Names, types, help
# texts, labels and the TTFT buckets are vLLM V1's PrometheusStatLogger (vllm/v1/metrics/loggers.py), as listed on
# the "Production Metrics" page of vLLM's documentation (https://docs.vllm.ai/en/v0.32.0/usage/metrics/). The
# lock's images are V1 versions: the nightly the variants use reports 0.20.1rc1.dev16+g7a1eb8ac2
# (tests/fixtures/reference-variants.yaml), the recipe engine is v0.27.1; no page for either version was at hand,
# and these six are the same in loggers.py from 0.10 on and on the v0.32.0 page. vLLM declares its counters
# without `_total` (vllm:prompt_tokens); the Prometheus client exports them with it. The KV gauge was
# vllm:gpu_cache_usage_perc before V1. The alerting rules (templates/monitor/rigforge-alerts.rules.yml) read these
# names and watch each with absent(); tests/test_openai_stub_metrics.py keeps the two in step.
VLLM_METRICS = {
    "vllm:num_requests_running": ("gauge", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:prompt_tokens_total": ("counter", "Number of prefill tokens processed."),
    "vllm:generation_tokens_total": ("counter", "Number of generation tokens processed."),
    "vllm:time_to_first_token_seconds": ("histogram", "Histogram of time to first token in seconds."),
    # vLLM V1's prefix cache counters, in tokens: queries += the prompt's tokens, hits += the tokens found cached
    # (KVCacheManager.get_computed_blocks, vllm/v1/core/kv_cache_manager.py). Declared in loggers.py as
    # Counter(name="vllm:prefix_cache_queries", documentation="Prefix cache queries, in terms of number of queried
    # tokens.") and "vllm:prefix_cache_hits" ("Prefix cache hits, in terms of number of cached tokens."), labels
    # model_name and engine as above; listed as Counters in vLLM's docs/design/metrics.md ("v1 Metrics") and on the
    # Production Metrics page. Exported with `_total`. The prefix cache hit rate is hits / queries.
    "vllm:prefix_cache_queries_total": ("counter", "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits_total": ("counter", "Prefix cache hits, in terms of number of cached tokens."),
}
NOT_ALERTED = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")  # a cold cache is not a fault
# vLLM's buckets of vllm:time_to_first_token_seconds (loggers.py)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)


BLOCK_SIZE = 16  # tokens per KV block: vLLM's default block_size on CUDA
KV_BLOCKS = 8192  # the stand-in's KV budget by default, in blocks (131,072 tokens)
BYTES_PER_TOKEN = 4  # the stand-in's tokenizer: every 4 bytes of the rendered prompt are one token


def render_prompt(req: dict) -> bytes:
    """The prompt a chat request makes, as a chat template renders it (ChatML, Qwen's): the tools first, then
    every message as `<|im_start|>ROLE\nCONTENT<|im_end|>\n`, then the assistant's turn opened. A later turn of
    the same conversation re-sends the earlier messages, so its prompt starts with the earlier prompt."""
    parts = []
    if req.get("tools"):
        parts.append(f"<|im_start|>system\n{json.dumps(req['tools'], sort_keys=True)}<|im_end|>\n")
    for message in req.get("messages") or []:
        content = message.get("content")
        if isinstance(content, list):  # content parts: their text
            content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        parts.append(f"<|im_start|>{message.get('role', 'user')}\n{content or ''}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts).encode()


def tokenize(prompt: bytes) -> list[bytes]:
    """The stand-in's tokens: `prompt` cut every BYTES_PER_TOKEN bytes (a prefix of the text is a prefix of them)."""
    return [prompt[i : i + BYTES_PER_TOKEN] for i in range(0, len(prompt), BYTES_PER_TOKEN)]


class PrefixCache:
    """vLLM's automatic prefix caching (vllm/v1/core/kv_cache_manager.py, block_pool.py), modelled on tokens:
    - a prompt is cut into blocks of `block_size` tokens; only full blocks are cached;
    - a block's hash covers its parent's hash and its own tokens (a chain): a block hits only after the same prefix;
    - a lookup walks the prompt's blocks from the first and stops at the first miss; at most (tokens - 1) // block
      size blocks hit, as vLLM recomputes the last token to get logits even when everything is cached;
    - then every full block of the prompt is cached; the cache holds at most `blocks` blocks and evicts the least
      recently used first. A prompt's blocks are released last block first, as vLLM frees them, so its tail goes
      before its head.
    Not modelled: a running request's blocks are not pinned (the stand-in's requests are short), and generated
    tokens are not cached. Counts, as vLLM's counters do: queries += the prompt's tokens, hits += the tokens hit."""

    def __init__(self, blocks: int = KV_BLOCKS, block_size: int = BLOCK_SIZE) -> None:
        """Empty, holding at most `blocks` blocks of `block_size` tokens."""
        self.capacity = blocks
        self.block_size = block_size
        self.lru: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # first: evicted next
        self.lock = threading.Lock()
        self.queries = self.hits = 0

    def block_hashes(self, tokens: list[bytes]) -> list[bytes]:
        """One hash per full block of `tokens`, each over its parent's hash and the block's tokens."""
        hashes, parent = [], b""
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            digest = hashlib.sha256(parent)
            for token in tokens[start : start + self.block_size]:
                digest.update(len(token).to_bytes(1, "big") + token)
            parent = digest.digest()
            hashes.append(parent)
        return hashes

    def query(self, tokens: list[bytes]) -> int:
        """Look `tokens` up (counted), then cache their full blocks: the number of tokens found cached."""
        hashes = self.block_hashes(tokens)
        with self.lock:
            hit = 0
            for block in hashes[: max(len(tokens) - 1, 0) // self.block_size]:
                if block not in self.lru:
                    break
                hit += 1
            for block in reversed(hashes):  # released tail first: the head is the most recently used
                self.lru[block] = None
                self.lru.move_to_end(block)
            while len(self.lru) > self.capacity:
                self.lru.popitem(last=False)
            self.queries += len(tokens)
            self.hits += hit * self.block_size
        return hit * self.block_size

    def __contains__(self, tokens: list[bytes]) -> bool:
        """Whether every full block of `tokens` is cached now (a test's view; it touches nothing)."""
        with self.lock:
            return all(block in self.lru for block in self.block_hashes(tokens))


class Metrics:
    """What the stub does, counted as vLLM counts it. running: requests being generated (holding a slot); waiting:
    requests waiting for a slot (max_concurrent); TTFT: from the request read to its first token (a waiting
    request's wait included, as vLLM measures from arrival). KV cache usage is a model of vLLM's, not a measure:
    every running request holds its prompt and the tokens generated so far, and the cache holds `slots` requests
    of full length (prompt + `tokens` x `tokens_per_delta`), slots = max_concurrent (1 when unbounded); capped at 1.
    So it is 0 when idle and nears 1 when every slot generates the end of a reply."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = self.waiting = self.kv_tokens = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.ttft = [0] * len(TTFT_BUCKETS)  # observations per bucket (not cumulative)
        self.ttft_count, self.ttft_sum = 0, 0.0

    def add(self, **deltas: int) -> None:
        with self.lock:
            for name, d in deltas.items():
                setattr(self, name, getattr(self, name) + d)

    def observe_ttft(self, seconds: float) -> None:
        with self.lock:
            self.ttft_count += 1
            self.ttft_sum += seconds
            i = next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), None)
            if i is not None:
                self.ttft[i] += 1

    def text(self, s: Schedule) -> str:
        """The Prometheus text format (0.0.4), every family of VLLM_METRICS in its order; the prefix cache's
        counters from `s.prefix_cache`."""
        model = s.model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        labels = f'model_name="{model}",engine="0"'
        capacity = max(s.max_concurrent, 1) * (PROMPT_TOKENS + s.tokens * s.tokens_per_delta)
        with self.lock:
            values = {
                "vllm:num_requests_running": self.running,
                "vllm:num_requests_waiting": self.waiting,
                "vllm:kv_cache_usage_perc": min(1.0, self.kv_tokens / capacity),
                "vllm:prompt_tokens_total": self.prompt_tokens,
                "vllm:generation_tokens_total": self.generation_tokens,
                "vllm:prefix_cache_queries_total": s.prefix_cache.queries,
                "vllm:prefix_cache_hits_total": s.prefix_cache.hits,
            }
            ttft, count, total = list(self.ttft), self.ttft_count, self.ttft_sum
        lines = []
        for name, (kind, help_text) in VLLM_METRICS.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            if kind != "histogram":
                lines.append(f"{name}{{{labels}}} {float(values[name])!r}")
                continue
            seen = 0
            for bound, n in zip(TTFT_BUCKETS, ttft, strict=True):
                seen += n
                lines.append(f'{name}_bucket{{{labels},le="{bound!r}"}} {float(seen)!r}')
            lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(count)!r}')
            lines += [f"{name}_count{{{labels}}} {float(count)!r}", f"{name}_sum{{{labels}}} {total!r}"]
        return "\n".join(lines) + "\n"


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
    metrics: Metrics = field(default_factory=Metrics)  # what GET /metrics serves
    kv_blocks: int = KV_BLOCKS  # the prefix cache's budget, in blocks of BLOCK_SIZE tokens
    name: str | None = None  # sent back as X-Stub-Name on every answer (None: not sent)
    prefix_cache: PrefixCache | None = None  # None: a new one of kv_blocks blocks

    def __post_init__(self) -> None:
        """The prefix cache of `kv_blocks` blocks, unless one was given."""
        if self.prefix_cache is None:
            self.prefix_cache = PrefixCache(self.kv_blocks)


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

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet; tests read /_stub/log instead
        pass

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def end_headers(self) -> None:
        """Every answer names the stand-in that gave it (`X-Stub-Name`) when it has a name: which rig took a request
        behind a gateway (tests, benchmarks/bench_affinity.py). vLLM sends no such header."""
        if self.schedule.name:
            self.send_header("X-Stub-Name", self.schedule.name)
        super().end_headers()

    def _json(self, code: int, obj: dict | list) -> None:
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

    def do_GET(self) -> None:  # noqa: N802
        s = self.schedule
        if self._unauthorized():
            return
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": s.model, "object": "model"}]})
        elif self.path == "/metrics":
            body = s.metrics.text(s).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/_stub/log":
            with s.lock:
                self._json(200, list(s.log))
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:  # noqa: N802
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
        m = s.metrics
        m.add(waiting=1)
        with self.server.slots:  # a request that waited for a slot is generated from then on
            s.prefix_cache.query(tokenize(render_prompt(req)))  # scheduled: its prefix looked up, then cached
            m.add(waiting=-1, running=1, prompt_tokens=PROMPT_TOKENS, kv_tokens=PROMPT_TOKENS)
            self.held = PROMPT_TOKENS  # what this request holds of the KV cache model
            self.finished = False
            try:
                self._answer(req, n, time.monotonic_ns() if s.max_concurrent else t_recv, t_recv)
            finally:
                self._finish()

    def _finish(self) -> None:
        """The request leaves the running batch and frees its cache: before its last output is sent, as in vLLM
        (a client that has the whole reply then scrapes it gone), or when it fails or is cut. Once."""
        if not self.finished:
            self.finished = True
            self.schedule.metrics.add(running=-1, kv_tokens=-self.held)

    def _generated(self, tokens: int) -> None:
        self.held += tokens
        self.schedule.metrics.add(generation_tokens=tokens, kv_tokens=tokens)

    def _answer(self, req: dict, n: int, t_recv: int, t_arrived: int) -> None:
        s = self.schedule
        if req.get("tools"):
            s.metrics.observe_ttft((time.monotonic_ns() - t_arrived) / 1e9)
            self._tool_call(req)
        elif req.get("stream"):
            self._stream(req, n, t_recv, t_arrived)
        else:  # generated at the same rate as a stream, answered whole at the end
            _sleep_until(t_recv + int(s.ttft_ms * 1e6))
            s.metrics.observe_ttft((time.monotonic_ns() - t_arrived) / 1e9)
            _sleep_until(t_recv + int((s.ttft_ms + max(n - 1, 0) * s.dt_ms) * 1e6))
            text = "The capital of France is Paris."
            self._generated(len(text.split()))
            self._finish()
            self._json(200, _completion(s.model, {"role": "assistant", "content": text}, len(text.split())))

    def _tool_call(self, req: dict) -> None:
        name = req["tools"][0].get("function", {}).get("name", "tool")
        call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": '{"city": "Paris"}'}}
        msg = {"role": "assistant", "content": None, "tool_calls": [call]}
        self._generated(12)
        self._finish()
        self._json(200, _completion(self.schedule.model, msg, 12, finish="tool_calls"))

    def _chunk(self, obj: dict | bytes) -> None:
        data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _stream(self, req: dict, n: int, t_recv: int, t_arrived: int) -> None:
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
            if i == 0:
                s.metrics.observe_ttft((sent[0] - t_arrived) / 1e9)
            self._chunk({**base, "choices": [{"index": 0, "delta": {key: f"t{i} "}, "finish_reason": None}]})
            self._generated(s.tokens_per_delta)  # counted once written, as a client sees it
        self._finish()
        self._chunk({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if s.usage and (req.get("stream_options") or {}).get("include_usage"):
            k = n * s.tokens_per_delta
            usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": k, "total_tokens": PROMPT_TOKENS + k}
            self._chunk({**base, "choices": [], "usage": usage})
        t_done = time.monotonic_ns()
        late = [(t - (t_recv + int((s.ttft_ms + i * s.dt_ms) * 1e6))) / 1e6 for i, t in enumerate(sent)]
        # logged before [DONE] is written: a client that has read the whole answer finds its record
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
        self._chunk(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def _completion(model: str, message: dict, tokens: int, finish: str = "stop") -> dict:
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": tokens, "total_tokens": PROMPT_TOKENS + tokens},
    }


class _Server(ThreadingHTTPServer):
    """Tracks its open connections, so that `abort()` can end every request in flight at once: what a server
    killed mid-generation does to its clients (the testbed's stand-in does it on SIGTERM)."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_concurrent: int = 0
    ) -> None:
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_concurrent) if max_concurrent else contextlib.nullcontext()
        self.open: set = set()

    def process_request(self, request: socket.socket, client_address: tuple[str, int]) -> None:
        self.open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: socket.socket) -> None:
        self.open.discard(request)
        super().shutdown_request(request)

    def abort(self) -> None:
        for conn in list(self.open):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: socket.socket, client_address: tuple[str, int]) -> None:
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
    p.add_argument("--kv-blocks", type=int, default=KV_BLOCKS, help=f"prefix cache budget, blocks of {BLOCK_SIZE}")
    p.add_argument("--name", help="send it back as X-Stub-Name on every answer")
    a = p.parse_args(argv)
    sched = Schedule(
        a.model,
        a.ttft_ms,
        a.dt_ms,
        a.tokens,
        not a.no_usage,
        a.reasoning_tokens,
        a.tokens_per_delta,
        a.api_key,
        a.max_concurrent,
        kv_blocks=a.kv_blocks,
        name=a.name,
    )
    server = make_server(sched, a.host, a.port)
    print(f"http://{a.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
