"""`rigforge bench URL`: the recipes' bench protocol against an OpenAI-compatible server (docs/operators.md says
what it measures: TTFT, wall and decode TPS per prompt, aggregate TPS with --streams N)."""

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import requests
import urllib3

PROMPTS = {
    "narr": ("Write a detailed 800-word essay explaining transformer attention.", 1000),
    "code": ("Write a Python implementation of quicksort with comments explaining each step.", 800),
}
SAMPLING = {"temperature": 0.6, "top_p": 0.95}
STREAM = {"stream": True, "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False}}


class BenchError(Exception):
    """The bench could not run (exit 2)."""


@dataclass
class Sample:
    ttft_s: float
    wall_s: float
    tokens: int
    tokens_from: str  # "usage" or "deltas"
    start: float  # perf_counter at send (for concurrent spans)
    end: float

    @property
    def wall_tps(self) -> float:
        return self.tokens / self.wall_s

    def as_dict(self, round_start: float) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("start", "end")}
        d["start_offset_ms"] = (self.start - round_start) * 1000  # > 0: sent after the round's first
        decode_tps = self.tokens / (self.wall_s - self.ttft_s)
        return d | {"ttft_ms": self.ttft_s * 1000, "wall_tps": self.wall_tps, "decode_tps": decode_tps}


# ---------------------------------------------------------------- measuring


def _sse_data(resp: requests.Response) -> Iterator[str]:
    """Yield the `data:` payloads of an SSE stream as soon as their bytes arrive."""
    read = getattr(resp.raw, "read1", None)
    chunks = iter(lambda: read(65536), b"") if read else resp.iter_content(chunk_size=None)
    buf = b""
    for chunk in chunks:
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip().decode()


def stream_once(
    session: requests.Session,
    base: str,
    model: str,
    prompt: str,
    max_tokens: int,
    timeout: float,
    headers: dict[str, str] | None = None,
) -> Sample:
    """One streamed chat completion: its time to the first content or reasoning delta, wall time and tokens."""
    messages = [{"role": "user", "content": prompt}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, **SAMPLING, **STREAM}
    ttft, deltas, usage_tokens = None, 0, None
    start = time.perf_counter()
    with session.post(f"{base}/v1/chat/completions", json=body, stream=True, timeout=timeout, headers=headers) as resp:
        if resp.status_code != 200:
            raise BenchError(f"{base}/v1/chat/completions answered HTTP {resp.status_code}: {resp.text[:300]}")
        for data in _sse_data(resp):
            if data == "[DONE]":
                break
            obj = json.loads(data)
            usage_tokens = (obj.get("usage") or {}).get("completion_tokens", usage_tokens)
            for choice in obj.get("choices") or []:
                if any((choice.get("delta") or {}).get(k) for k in ("content", "reasoning_content", "reasoning")):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    deltas += 1
    end = time.perf_counter()
    if ttft is None:
        raise BenchError(f"{base}: the stream ended without any content or reasoning delta")
    return Sample(ttft, end - start, usage_tokens or deltas, "usage" if usage_tokens else "deltas", start, end)


def stream_many(
    base: str,
    model: str,
    prompt: str,
    max_tokens: int,
    timeout: float,
    streams: int,
    headers: dict[str, str] | None = None,
) -> list[Sample]:
    """`streams` concurrent requests released together; returns their samples in stream order."""
    if streams == 1:  # in this thread: Ctrl-C stops it at once (the pool would wait for the stream to end)
        return [stream_once(_session(), base, model, prompt, max_tokens, timeout, headers)]
    barrier = threading.Barrier(streams)

    def worker() -> Sample:
        session = _session()
        barrier.wait()
        return stream_once(session, base, model, prompt, max_tokens, timeout, headers)

    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(worker) for _ in range(streams)]
        return [f.result() for f in futures]  # re-raises a stream's error here, in the caller's thread


def _session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False  # a bench targets one server directly; never through a proxy
    return s


# ---------------------------------------------------------------- statistics


def stats(values: list[float]) -> dict:
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    cv_pct = 100 * std / mean if mean else 0.0
    return {"mean": mean, "std": std, "cv_pct": cv_pct, "min": min(values), "max": max(values), "n": len(values)}


def summarize(rounds: list[list[Sample]]) -> dict:
    """rounds: one list of concurrent samples per measured run."""
    flat = [s.as_dict(0) for r in rounds for s in r]
    out = {k: stats([float(d[k]) for d in flat]) for k in ("ttft_ms", "wall_tps", "decode_tps", "tokens")}
    out["tokens_from"] = sorted({d["tokens_from"] for d in flat})
    if len(rounds[0]) > 1:
        out["aggregate_tps"] = stats([aggregate_tps(r) for r in rounds])
        out["per_stream_wall_tps"] = [statistics.fmean(r[i].wall_tps for r in rounds) for i in range(len(rounds[0]))]
    return out


def aggregate_tps(samples: list[Sample]) -> float:
    return sum(s.tokens for s in samples) / (max(s.end for s in samples) - min(s.start for s in samples))


# ---------------------------------------------------------------- variant and published figures


def variants_info() -> dict:
    """{variant: {"port": default port, "measured": design-document figures + served "model"}} from the catalog."""
    from rigforge.model.catalog import load_catalog

    return {
        v.name: {"port": v.port, "measured": {**v.figures, "model": v.arg("--served-model-name")}}
        for v in load_catalog().variants.values()
    }


def infer_variant(model: str, port: int, info: dict) -> str | None:
    """The one variant serving `model` (else the one on `port`) in `variants_info()`'s `info`; None: none or several."""
    by_model = [n for n, d in info.items() if d["measured"].get("model") == model]
    by_port = [n for n, d in info.items() if d["port"] == port]
    return next((found[0] for found in (by_model, by_port) if len(found) == 1), None)


def _num(value: object) -> float | None:
    """'~145' -> 145.0; 69 -> 69.0; anything else -> None."""
    try:
        return float(value.strip().lstrip("~") if isinstance(value, str) else value)
    except (TypeError, ValueError):
        return None


def published(m: dict, prompt: str, streams: int) -> dict:
    """The design document's figures of `prompt` at `streams` streams in `m` (a variant's measured), as numbers."""
    out = {"tps": _num(m.get(f"{prompt}_tps", m.get(f"{prompt}_tps_per_stream"))), "ttft_ms": _num(m.get("ttft_ms"))}
    if streams > 1:
        out["aggregate_tps"] = _num(m.get(f"aggregate_{prompt}_tps_{streams}_streams"))
        out["per_stream_tps"] = _num(m.get(f"per_stream_tps_{streams}_streams"))
    return {k: v for k, v in out.items() if v is not None}


# ---------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", metavar="URL", help="server base URL, e.g. http://rig1:8011")
    p.add_argument("--model", help="model name (default: the first one /v1/models lists)")
    p.add_argument("--variant", help="variant whose published figures to compare (default: inferred)")
    p.add_argument("--warmups", type=int, default=3, help="unmeasured runs per prompt (default 3)")
    p.add_argument("--runs", type=int, default=5, help="measured runs per prompt (default 5)")
    p.add_argument("--streams", type=int, default=1, help="concurrent requests per run (default 1)")
    p.add_argument("--only", choices=sorted(PROMPTS), help="bench one prompt only")
    p.add_argument("--timeout", type=float, default=600, help="seconds per request (default 600)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _progress(done: int, total: int, label: str) -> None:
    """The progress bar on stderr: redrawn in place on a terminal (a newline once done), else one line a step."""
    fill = 30 * done // total
    line = f"[{'#' * fill}{'-' * (30 - fill)}] {done}/{total} {label}"
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\x1b[2K{line}" + ("\n" if done == total else ""))
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _error_message(r: requests.Response) -> str | None:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), as llama-server sends "Loading
    model" while it loads; None for any other body (a gateway's HTML page, say)."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return None


def run(args: argparse.Namespace) -> int:
    """`rigforge bench`: the bench (`_run`), its exit code; a bench that cannot run or whose server fails it mid-run
    prints why on stderr and exits 2."""
    try:
        return _run(args)
    except BenchError as exc:
        message = str(exc)
    except (requests.RequestException, urllib3.exceptions.HTTPError) as exc:
        message = f"request to {args.url} failed mid-run ({type(exc).__name__}: {exc})"
    except ValueError as exc:
        message = f"{args.url} sent a stream that is not OpenAI chat chunks ({exc})"
    if sys.stderr.isatty():
        sys.stderr.write("\n")  # end a half-drawn progress bar before the message
    print(f"rigforge bench: {message}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    """The bench itself: the arguments checked, the served model and its variant found, each prompt's warm-ups and
    measured runs, the report printed (a table, or JSON with --json); 0 when it ran, BenchError when it cannot."""
    for name, least in (("warmups", 0), ("runs", 1), ("streams", 1)):
        if getattr(args, name) < least:
            raise BenchError(f"--{name} must be >= {least}")
    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"{args.url!r} is not an http(s) URL; give the server's base URL, e.g. http://rig1:8011")
    base = args.url.rstrip("/").removesuffix("/v1")
    key = os.environ.get("RIGFORGE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else None
    try:
        r = _session().get(f"{base}/v1/models", timeout=10, headers=headers)
        if r.status_code == 503 and _error_message(r) == "Loading model":  # llama-server, until its model is loaded
            raise BenchError(
                f"{base}/v1/models answers HTTP 503 (Loading model): the server is still loading its model; "
                f"run the bench again once {base}/health answers 200"
            )
        r.raise_for_status()
        served = [m["id"] for m in r.json().get("data", [])]
    except (requests.RequestException, urllib3.exceptions.HTTPError) as exc:
        raise BenchError(
            f"cannot reach {base}/v1/models ({type(exc).__name__}: {exc}); "
            "check the URL and that the server is up (`rigforge status INVENTORY`)"
        ) from None
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{base}/v1/models did not answer an OpenAI model list") from None
    model = args.model or next(iter(served), None)
    if not model:
        raise BenchError(f"{base}/v1/models lists no model; pass --model")

    info = variants_info()
    variant, variant_from = args.variant, "--variant"
    if variant and variant not in info:
        raise BenchError(f"unknown variant {variant!r}; known: {', '.join(sorted(info))}")
    if not variant:
        port = urlsplit(base).port or (443 if base.startswith("https") else 80)
        variant, variant_from = infer_variant(model, port, info), f"model {model} + port {port}"
    measured = info[variant]["measured"] if variant else {}

    prompts = [args.only] if args.only else list(PROMPTS)
    per_prompt = args.warmups + args.runs
    report = {"url": base, "model": model, "variant": variant, "variant_from": variant_from if variant else None}
    report |= {k: getattr(args, k) for k in ("warmups", "runs", "streams")}
    report |= {"sampling": {**SAMPLING, "enable_thinking": False}, "prompts": {}}
    for k, name in enumerate(prompts):
        text, max_tokens = PROMPTS[name]
        rounds = []  # the warm-ups', then the measured runs' samples
        for i in range(per_prompt):
            samples = stream_many(base, model, text, max_tokens, args.timeout, args.streams, headers)
            rounds.append(samples)
            warm = i < args.warmups
            n, of = (i + 1, args.warmups) if warm else (i + 1 - args.warmups, args.runs)
            tps = statistics.fmean(s.wall_tps for s in samples)
            label = f"{name} {'warm-up' if warm else 'run'} {n}/{of}  {tps:.1f} tok/s"
            _progress(k * per_prompt + i + 1, len(prompts) * per_prompt, label)
        report["prompts"][name] = {
            "max_tokens": max_tokens,
            "runs": [[s.as_dict(min(x.start for x in r)) for s in r] for r in rounds[args.warmups :]],
            "summary": summarize(rounds[args.warmups :]),
            "published": published(measured, name, args.streams),
        }
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _tps(s: dict) -> str:
    return f"{s['mean']:.1f} ± {s['std']:.1f} (CV {s['cv_pct']:.1f}%)"


def format_report(rep: dict) -> str:
    v = rep["variant"]
    lines = [
        f"bench {rep['url']}  model {rep['model']}  "
        + (f"variant {v} (from {rep['variant_from']})" if v else "variant unknown (pass --variant)"),
        f"{rep['warmups']} warm-up + {rep['runs']} measured runs per prompt, {rep['streams']} stream(s), "
        "temperature 0.6, top_p 0.95, thinking off",
        "",
        f"{'prompt':<7}{'tokens':>7}  {'TTFT ms':<11}{'wall TPS':<24}{'decode TPS':<24}published",
    ]
    for name, p in rep["prompts"].items():
        s, pub = p["summary"], p["published"]
        shown = [f"{pub['tps']:g} TPS"] if "tps" in pub else []
        shown += [f"TTFT ~{pub['ttft_ms']:g} ms"] if "ttft_ms" in pub else []
        tokens = f"{s['tokens']['mean']:.0f}" + ("*" if "deltas" in s["tokens_from"] else "")
        ttft = f"{s['ttft_ms']['mean']:.0f} ± {s['ttft_ms']['std']:.0f}"
        lines.append(
            f"{name:<7}{tokens:>7}  {ttft:<11}{_tps(s['wall_tps']):<24}"
            f"{_tps(s['decode_tps']):<24}{', '.join(shown) or '-'}"
        )
        if "aggregate_tps" in s:
            per = ", ".join(f"{x:.1f}" for x in s["per_stream_wall_tps"])
            agg = f"{pub['aggregate_tps']:g}" if "aggregate_tps" in pub else "-"
            each = f"{pub['per_stream_tps']:g}" if "per_stream_tps" in pub else "-"
            lines.append(
                f"{'':<7}aggregate {_tps(s['aggregate_tps'])} over {rep['streams']} streams "
                f"(published {agg}); per stream {per} (published {each})"
            )
    if any("deltas" in p["summary"]["tokens_from"] for p in rep["prompts"].values()):
        lines.append("* the server sent no usage chunk: tokens counted as streamed deltas")
    return "\n".join(lines)
