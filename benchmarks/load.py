"""Load test of `fuselane serve`: N concurrent streaming clients for T seconds, a share of them dropping their
stream at a random point, against a server that is already running.

Usage: python benchmarks/load.py [--url http://127.0.0.1:8000] [--clients 1 8 32 64] [--seconds 120]
                                 [--drop 0.2] [--max-tokens 256] [--prompt-tokens 16 512] [--api-key K] [--json]

Each client sends streamed `/v1/completions` requests one after another until the time is up (a request that
starts before the end runs to its end). Per level of concurrency it prints: requests completed and dropped,
errors (a status other than 200, a connection failure, a stream that ends without `data: [DONE]` or without a
finish reason), aggregate generated tokens/s over the level's wall time (a completed stream counts its `usage`,
a dropped one the chunks it read), time to first token and time between tokens (p50, p99, from the arrival of
each streamed chunk), and the server's KV blocks in use once it has settled (from `/health`; 0 means every
sequence, dropped ones included, gave its blocks back) and its lane's device memory then (`device_bytes`, against
the idle level read before the first request: it exits 1 if a level leaves more). The server's lane is read
from `/health` and printed;
`--lane cuda` refuses to measure a server that runs another (a GPU run that fell back to the cpu lane). Needs
only the standard library.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

SETTLE_SECONDS = 30.0  # how long the server may take to finish and free everything after the last client
PROMPT_IDS = range(1, 256)  # prompts are token ids drawn from here: a byte-level vocabulary's byte tokens


@dataclass(slots=True)
class Tally:
    """What the clients of one level saw, merged."""

    completed: int = 0
    dropped: int = 0
    errors: list[str] = field(default_factory=list)
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Target:
    host: str
    port: int
    headers: dict[str, str]


def target(url: str, api_key: str | None) -> Target:
    parts = urllib.parse.urlsplit(url)
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {api_key}"} if api_key else {})
    return Target(parts.hostname or "127.0.0.1", parts.port or 80, headers)


def get_json(t: Target, path: str) -> dict:
    conn = http.client.HTTPConnection(t.host, t.port, timeout=30)
    try:
        conn.request("GET", path, headers=t.headers)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


@dataclass(slots=True)
class Stream:
    """One streamed request as the client saw it."""

    chunks: int = 0
    usage: int | None = None
    finish: str | None = None
    done: bool = False  # `data: [DONE]` arrived
    dropped: bool = False  # the client hung up on purpose
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    error: str | None = None


def one_request(t: Target, body: dict, drop_after: int | None) -> Stream:
    """Stream one completion, hanging up after `drop_after` chunks when set."""
    s = Stream()
    conn = http.client.HTTPConnection(t.host, t.port, timeout=600)
    started = last = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers=t.headers)
        response = conn.getresponse()
        if response.status != 200:
            s.error = f"HTTP {response.status}: {response.read()[:200]!r}"
            return s
        while line := response.readline():
            data = line.decode().strip()
            if data == "data: [DONE]":
                s.done = True
                break
            if data.startswith("data: "):
                last = _read(s, json.loads(data[len("data: ") :]), started, last)
            if s.error or (drop_after is not None and s.chunks >= drop_after):
                s.dropped = s.error is None
                break
    except (OSError, http.client.HTTPException, ValueError) as e:
        s.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    if s.error is None and not s.dropped and not (s.done and s.finish):
        s.error = "a stream ended without [DONE] and a finish reason"
    return s


def _read(s: Stream, event: dict, started: float, last: float) -> float:
    """Take one event of the stream; the time of the latest text chunk."""
    if "error" in event:
        s.error = f"stream error: {event['error'].get('message')}"
    if event.get("usage"):
        s.usage = event["usage"]["completion_tokens"]
    for choice in event.get("choices", []):
        s.finish = choice.get("finish_reason") or s.finish
        if choice.get("text"):
            now = time.perf_counter()
            if s.chunks == 0:
                s.ttft = now - started
            else:
                s.gaps.append(now - last)
            last, s.chunks = now, s.chunks + 1
    return last


def add(tally: Tally, s: Stream) -> None:
    if s.error is not None:
        tally.errors.append(s.error)
        return
    tally.dropped += s.dropped
    tally.completed += not s.dropped
    tally.tokens += s.usage if s.usage is not None and not s.dropped else s.chunks
    if s.ttft is not None:
        tally.ttft.append(s.ttft)
    tally.gaps += s.gaps


def client(t: Target, args: argparse.Namespace, seed: int, ends: float, tally: Tally, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    while time.perf_counter() < ends:
        body = {
            "prompt": [rng.choice(PROMPT_IDS) for _ in range(rng.randint(*args.prompt_tokens))],
            "max_tokens": args.max_tokens,
            "temperature": 0.8,
            "seed": rng.randrange(1 << 31),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        drop_after = rng.randint(1, max(1, args.max_tokens // 2)) if rng.random() < args.drop else None
        stream = one_request(t, body, drop_after)
        with lock:
            add(tally, stream)


def settle(t: Target) -> dict:
    """/health once nothing runs or waits (or after SETTLE_SECONDS)."""
    ends = time.perf_counter() + SETTLE_SECONDS
    while True:
        health = get_json(t, "/health")
        if (health["running"] == 0 and health["waiting"] == 0) or time.perf_counter() > ends:
            return health
        time.sleep(0.1)


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile, or None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def level(t: Target, args: argparse.Namespace, clients: int) -> dict:
    tally, lock = Tally(), threading.Lock()
    started = time.perf_counter()
    ends = started + args.seconds
    threads = [
        threading.Thread(target=client, args=(t, args, args.seed * 1000 + i, ends, tally, lock), daemon=True)
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    health = settle(t)
    return {
        "clients": clients,
        "seconds": round(wall, 2),
        "completed": tally.completed,
        "dropped": tally.dropped,
        "errors": len(tally.errors),
        "first_errors": tally.errors[:5],
        "tokens": tally.tokens,
        "tokens_per_s": round(tally.tokens / wall, 1),
        "ttft_p50_ms": _ms(percentile(tally.ttft, 50)),
        "ttft_p99_ms": _ms(percentile(tally.ttft, 99)),
        "itl_p50_ms": _ms(percentile(tally.gaps, 50)),
        "itl_p99_ms": _ms(percentile(tally.gaps, 99)),
        "kv_blocks_in_use_after": health["kv_blocks_used"],
        "kv_blocks_total": health["kv_blocks_total"],
        "device_mb_after": _mb(health.get("device_bytes")),
        "preemptions": health.get("preemptions"),
    }


def _mb(n: int | None) -> float | None:
    return None if n is None else round(n / 2**20, 1)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


HEAD = ("clients", "completed", "dropped", "errors", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
        "itl_p99_ms", "kv_blocks_in_use_after", "device_mb_after")  # fmt: skip


def render(rows: list[dict]) -> str:
    lines = [" | ".join(HEAD), " | ".join("---" for _ in HEAD)]
    lines += [" | ".join("-" if r[k] is None else f"{r[k]:,}" for k in HEAD) for r in rows]
    for r in rows:
        lines += [f"clients {r['clients']}: {e}" for e in r["first_errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64], help="concurrent streams, a level each")
    ap.add_argument("--seconds", type=float, default=120.0, help="time each level sends requests (default 120)")
    ap.add_argument("--drop", type=float, default=0.2, help="share of requests dropped mid-stream (default 0.2)")
    ap.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each request (default 256)")
    ap.add_argument(
        "--prompt-tokens", type=int, nargs=2, default=[16, 512], metavar=("MIN", "MAX"),
        help="prompt length in tokens, drawn evenly (default 16 512; cut to fit the server's context)",
    )  # fmt: skip
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--lane", default=None, help="the lane the server must run (cpu, cuda); exit 1 if another")
    ap.add_argument("--seed", type=int, default=0, help="the clients' random choices (prompts, drops, seeds)")
    ap.add_argument("--json", action="store_true", help="the results as JSON")
    args = ap.parse_args(argv)
    t = target(args.url, args.api_key)
    try:
        card = get_json(t, "/v1/models")["data"][0]
    except (OSError, KeyError, ValueError) as e:
        print(f"load: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    lane = get_json(t, "/health").get("lane")
    if args.lane is not None and lane != args.lane:
        print(f"load: the server runs the {lane} lane, not {args.lane}", file=sys.stderr)
        return 1
    model, room = card["id"], card.get("max_model_len", 1 << 30) - args.max_tokens - 1
    if room < 1:
        print(f"load: --max-tokens {args.max_tokens} leaves no room in the context of {card['max_model_len']}")
        return 1
    args.prompt_tokens = [min(n, room) for n in args.prompt_tokens]
    idle = _mb(settle(t).get("device_bytes"))  # the lane's device memory before any request of this run
    rows = []
    for clients in args.clients:
        rows.append(level(t, args, clients))
        print(f"load: {clients} clients done", file=sys.stderr, flush=True)
    result = {"url": args.url, "model": model, "lane": lane, "device_mb_idle": idle,
              "args": {k: v for k, v in vars(args).items() if k != "api_key"}, "levels": rows}  # fmt: skip
    head = f"{model} at {args.url} (lane {lane}; device memory at idle {idle} MB)"
    print(json.dumps(result, indent=2) if args.json else f"{head}\n{render(rows)}")
    grown = idle is not None and any((r["device_mb_after"] or 0) > idle for r in rows)
    return 1 if grown or any(r["errors"] or r["kv_blocks_in_use_after"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
