"""Starting `fuselane serve`: the model and its engine, the listening socket, and uvicorn.

The socket is bound here, before uvicorn starts, so that a busy port or an unknown host is one line and exit
code 1 like every other bad input, and so that `--port 0` can say which port it got. uvicorn's own access log
is off: the application writes one line a request itself (`app`).
"""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from fuselane.engine.blocks import DEFAULT_BLOCK_SIZE, BlockPool
from fuselane.engine.engine import Engine
from fuselane.engine.lanes import paged_lanes, paged_type
from fuselane.engine.sizing import pool_blocks
from fuselane.errors import FuselaneError
from fuselane.serve.app import Service, create_app

GRACE_SECONDS = 5  # on Ctrl-C, open streams get this long to finish before they are cut
BACKLOG = 2048  # connections waiting to be accepted (uvicorn's default)


@dataclass(frozen=True, slots=True)
class Options:
    """`fuselane serve`'s options, checked already against their ranges."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    lane: str = "auto"
    ctx: int | None = None
    max_seqs: int = 16
    max_queue: int = 256
    api_key: str | None = None
    kv_blocks: int | None = None
    gpu_memory: float | None = None
    overlap: bool = True  # decode steps overlap the host's work where the lane can (`fuselane.engine.engine`)


def serving_lane(lane: str) -> str:
    """The lane to load: `auto` takes the cuda lane only once it runs batches of sequences, else the cpu lane."""
    return "auto" if lane == "auto" and "cuda" in paged_lanes() else "cpu" if lane == "auto" else lane


def build(opts: Options, model: Any | None = None, say: Any = None) -> Service:
    """The service `opts` describe: the model loaded (or `model` as given), its lane's paged form, the engine."""
    if model is None:
        from fuselane.runtime.model import load

        lane = serving_lane(opts.lane)
        if lane != "auto":
            paged_type(lane)  # a lane that cannot serve is refused before the model is loaded onto it
        model = load(opts.model, lane=lane, ctx=opts.ctx)
    kind = paged_type(model.lane.name)
    blocks = pool_blocks(
        kv_blocks=opts.kv_blocks, gpu_memory=opts.gpu_memory, ctx=model.ctx, max_seqs=opts.max_seqs,
        block_size=DEFAULT_BLOCK_SIZE, block_bytes=kind.block_bytes(model.lane, DEFAULT_BLOCK_SIZE),
        device=kind.device_memory(model.lane), lane=model.lane.name,
    )  # fmt: skip
    pool = BlockPool(blocks, DEFAULT_BLOCK_SIZE)
    engine = Engine(
        kind(model.lane, blocks, DEFAULT_BLOCK_SIZE, overlap=opts.overlap), model.tokenizer, pool,
        ctx=model.ctx, max_seqs=opts.max_seqs, max_queue=opts.max_queue,
    )  # fmt: skip
    say = say or _say
    began = time.perf_counter()
    ready = engine.warm()
    if ready:
        say(f"fuselane: {ready} steps compiled and captured in {time.perf_counter() - began:.1f} s")
    return Service(model, engine, model.path.stem, opts.api_key, int(time.time()), say)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, or a one-line error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise FuselaneError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)  # connections queue from here on, before uvicorn takes the socket
    except OSError as e:
        sock.close()
        raise FuselaneError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def server(service: Service) -> Any:
    """A uvicorn server of the service's application (run it with `.run(sockets=[listen(...)])`)."""
    import uvicorn

    config = uvicorn.Config(
        create_app(service), log_level="warning", access_log=False, lifespan="on",
        timeout_graceful_shutdown=GRACE_SECONDS, backlog=BACKLOG,
    )  # fmt: skip
    return uvicorn.Server(config)


def serve(opts: Options) -> None:
    """Load, listen and serve until interrupted."""
    sock = listen(opts.host, opts.port)  # first: a busy port fails before a model is loaded
    service = build(opts)
    host, port = sock.getsockname()[:2]
    e = service.engine
    service.say(
        f"serving {service.name} on http://{host}:{port}/v1 (lane {e.lane.name}, ctx {service.model.ctx}, "
        f"max-seqs {e.max_seqs}, KV pool {e.pool.total:,} blocks of {e.pool.block_size} tokens"
        f"{', decode overlapped' if e.overlap else ''}{', API key required' if opts.api_key else ''})"
    )
    server(service).run(sockets=[sock])
