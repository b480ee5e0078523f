"""The testbed's vLLM stand-in keeps a prefix cache as vLLM does (rigforge/testbed/openai_stub.py `PrefixCache`):
blocks of 16 tokens hashed as a chain, the longest cached run of leading blocks hit (never the last token), the
least recently used blocks evicted beyond the budget, and vLLM's counters in tokens on /metrics."""

from __future__ import annotations

import json
import re
import threading
import urllib.request

from rigforge.testbed.openai_stub import BLOCK_SIZE, PrefixCache, Schedule, make_server, render_prompt, tokenize


def toks(*names: str, per_block: int = BLOCK_SIZE) -> list[bytes]:
    """Whole blocks of tokens: block "a" is 16 tokens b"a0".."a15" (distinct blocks for distinct names)."""
    return [f"{n}{i}".encode() for n in names for i in range(per_block)]


def test_block_hashes_are_chained_to_their_parents():
    cache = PrefixCache(blocks=100)
    ab, ac, xb = (
        cache.block_hashes(toks("a", "b")),
        cache.block_hashes(toks("a", "c")),
        cache.block_hashes(toks("x", "b")),
    )
    assert len(ab) == 2 and ab[0] == ac[0] and ab[1] != ac[1]
    assert xb[1] != ab[1]  # the same tokens after another parent: another block
    assert cache.block_hashes(toks("a", "b") + [b"z"] * (BLOCK_SIZE - 1)) == ab  # a partial block is not hashed
    assert cache.block_hashes([b"ab", b"c"] + toks("q")[2:]) != cache.block_hashes([b"a", b"bc"] + toks("q")[2:])


def test_hits_are_the_cached_leading_blocks_in_tokens_never_the_last_token():
    cache = PrefixCache(blocks=100)
    turn1 = toks("sys", "u1") + [b"t"] * 5  # 2 full blocks and 5 tokens
    assert cache.query(turn1) == 0 and (cache.queries, cache.hits) == (37, 0)
    assert cache.query(turn1) == 32  # the same prompt again: both full blocks
    turn2 = turn1[:32] + toks("a1", "u2")  # the conversation grew: its first two blocks are cached
    assert cache.query(turn2) == 32 and (cache.queries, cache.hits) == (37 + 37 + 64, 64)
    assert cache.query(turn2) == 48  # all 4 blocks cached, but the last token is computed again: 3 blocks
    assert cache.query(toks("sys", "v1")) == 16  # another conversation of the agent: its system prompt's block
    assert cache.query(toks("sys", "v1", "v2")) == 32
    assert cache.query(toks("zz", "u1", "q")) == 0  # u1's tokens after another first block are another block
    assert cache.hits == 32 + 32 + 48 + 16 + 32


def test_least_recently_used_blocks_are_evicted_beyond_the_budget():
    cache = PrefixCache(blocks=4)
    a, b, c = toks("a1", "a2"), toks("b1", "b2"), toks("c1", "c2")
    cache.query(a)
    cache.query(b)
    assert a in cache and b in cache
    cache.query(a)  # a used again: b is now the least recently used
    cache.query(c)
    assert a in cache and c in cache and b not in cache and len(cache.lru) == 4
    assert cache.query(b + [b"x"]) == 0  # evicted: no hit
    # a prompt's tail goes before its head (released last block first, as vLLM frees them)
    cache = PrefixCache(blocks=3)
    cache.query(toks("h", "m", "t"))
    cache.query(toks("new"))
    assert toks("h", "m") in cache and toks("h", "m", "t") not in cache
    assert cache.query(toks("h", "m", "t") + [b"x"]) == 32


def chat(base: str, messages: list[dict]) -> None:
    """One chat completion of `messages` from the stand-in at `base`; it must answer 200."""
    body = {"model": "qwen3.6-27b-autoround", "messages": messages, "max_tokens": 2}
    req = urllib.request.Request(
        f"{base}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def counters(base: str) -> dict[str, float]:
    """The prefix cache's counters on the stand-in's /metrics, declared as counters: {name: value}."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.findall(r'^(vllm:prefix_cache_\w+)\{model_name="qwen3.6-27b-autoround",engine="0"\} (\S+)$', text, re.M)
    assert (
        "# TYPE vllm:prefix_cache_queries_total counter" in text
        and "# TYPE vllm:prefix_cache_hits_total counter" in text
    )
    return {name: float(value) for name, value in found}


def test_a_growing_conversation_hits_its_earlier_turns_on_metrics():
    """Two turns of one conversation and another conversation through HTTP: the counters are the prompts' tokens
    and the cached blocks' tokens, and the chat rendering of turn 2 starts with turn 1's."""
    server = make_server(Schedule(ttft_ms=1, dt_ms=1, tokens=2, kv_blocks=1000))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    system = {"role": "system", "content": "You are a careful coding agent. " * 40}
    turn1 = [system, {"role": "user", "content": "Fix the failing test in parser.py."}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "Done: the off-by-one."},
        {"role": "user", "content": "Now lint."},
    ]
    assert counters(base) == {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    chat(base, turn1)
    chat(base, turn2)
    first, second = tokenize(render_prompt({"messages": turn1})), tokenize(render_prompt({"messages": turn2}))
    assert render_prompt({"messages": turn2}).startswith(render_prompt({"messages": turn1}))
    # turn 1's full blocks hit, but its last one when it ends in a token cut short (turn 2 continues its bytes)
    expected_hits = len(first) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE
    seen = counters(base)
    assert seen["vllm:prefix_cache_queries_total"] == len(first) + len(second)
    assert expected_hits <= seen["vllm:prefix_cache_hits_total"] <= len(first) // BLOCK_SIZE * BLOCK_SIZE
    assert seen["vllm:prefix_cache_hits_total"] >= 0.8 * len(first)  # the long system prompt was not prefilled twice
    server.shutdown()
    server.server_close()
