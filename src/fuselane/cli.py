"""The `fuselane` command: run, chat, serve, tokenize, pull, models, info, explain, bench.

stdout carries only what the user asked for (the reply, the ids, the table); logs and progress go to stderr.
Every failure caused by input is one line on stderr and exit code 1, never a traceback: numbers are checked
against their ranges (`fuselane.ranges`) while the arguments are parsed, an OS error names its path, warnings
from the numerics stay off stderr, and a closed stdout (`| head`) ends the command quietly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from fuselane import __version__, ranges
from fuselane.errors import FuselaneError, Terminated

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EXIT_TERMINATED = 143  # 128 + SIGTERM
MAX_MESSAGE_CHARS = 1000  # an error line is cut here: a message quoting a huge argument stays readable


def _say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def _say_error(message: str) -> None:
    """The one `fuselane: error:` line: control characters (a newline in a path or an argument) escaped,
    the length bounded."""
    text = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in message)
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 3] + "..."
    _say(f"fuselane: error: {text}")


# torch.cuda.OutOfMemoryError (a RuntimeError), named rather than imported: the cpu lane never imports torch
GPU_OOM = "OutOfMemoryError"
OOM_SENTENCES = 2  # torch's message: what it tried to allocate and how much the GPU has free; then advice


def _first_sentences(text: str) -> str:
    """The first `OOM_SENTENCES` sentences of a message, on one line."""
    sentences = " ".join(text.split()).split(". ")
    return ". ".join(sentences[:OOM_SENTENCES]).rstrip(".") + "."


def _os_error(e: OSError) -> str:
    """An OS error as one line naming its path: "/root/.cache/fuselane/models: Permission denied"."""
    what = e.strerror or str(e) or type(e).__name__
    if e.filename is None:
        return what
    where = os.fsdecode(e.filename)
    if e.filename2 is not None:
        where += f" -> {os.fsdecode(e.filename2)}"
    return f"{where}: {what}"


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors follow the rule above (argparse prints the usage and exits 2)."""

    def error(self, message: str) -> NoReturn:
        _say_error(f"{message} (see '{self.prog} --help')")
        sys.exit(EXIT_ERROR)


def _sampling(args: argparse.Namespace):
    from fuselane.runtime.sampling import SamplingParams

    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def _load(model: str | None, args: argparse.Namespace):
    from fuselane.runtime.model import load

    started = time.perf_counter()
    lane, ctx, knobs = getattr(args, "lane", "auto"), getattr(args, "ctx", None), getattr(args, "knob", ())
    m = load(model, lane=lane, ctx=ctx, knobs=knobs, tp=getattr(args, "tp", 1))
    if getattr(args, "verbose", False):
        _say(
            f"loaded {m.path.name} ({m.cfg.arch}, {m.cfg.n_layers} layers) on the {m.lane.name} lane "
            f"in {time.perf_counter() - started:.2f} s"
        )
    return m


def _split(model: str | None, args: argparse.Namespace) -> None:
    """With --tp past 1, load the model split (which says why it cannot run so) before serving or benching."""
    if args.tp > 1:
        _load(model, args)


def _model_and_prompt(words: Sequence[str]) -> tuple[str | None, str]:
    """`run`'s words: a prompt, or a model then a prompt. A lone word that names a model (a file, a .gguf
    path, a known name) is a forgotten prompt, not a prompt for the default model."""
    if len(words) > 2:
        raise FuselaneError("run takes at most a model and a prompt (quote the prompt)")
    if len(words) == 2:
        return words[0], words[1]
    from fuselane.hub import KNOWN_MODELS

    word = words[0]
    if word != "-" and (word.endswith(".gguf") or word in KNOWN_MODELS or os.path.isfile(word)):
        raise FuselaneError(f"'{word}' names a model, but no prompt follows it: fuselane run {word} PROMPT")
    return None, word


def _stdin() -> Any:
    """stdin's bytes (decoded by `read_text`, which names a bad byte), or stdin itself where it has none."""
    return getattr(sys.stdin, "buffer", sys.stdin)


def cmd_run(args: argparse.Namespace) -> None:
    from fuselane.text.utf8 import read_text, require_utf8

    model, prompt = _model_and_prompt(args.words)
    if prompt != "-":
        require_utf8(prompt, "the prompt")
    m = _load(model, args)
    if prompt == "-":  # read no further than the context could use
        prompt = read_text(_stdin(), m.max_prompt_bytes, "the prompt on stdin", context=m.ctx)
    _reply(m, prompt, args)


def _say_where_cut(count: int, limit: int, session: Any) -> None:
    """One line on stderr where -n or the context's end cut a reply of `count` tokens (not where it ended)."""
    if limit and count == limit:
        _say(f"[stopped at -n {limit} tokens]")
    elif count and session.room() == 0:
        _say(f"[stopped at the end of the context of {session.ctx} tokens]")


def _reply(m: Any, prompt: str, args: argparse.Namespace) -> None:
    """Stream the reply to stdout (ended by a newline when it holds anything); on stderr, one line where -n or
    the context's end cut it, and with -v the prompt's and the generation's tokens/s, as llama.cpp's timings."""
    session = m.session()
    started = time.perf_counter()
    ids = m.prompt_ids(prompt, raw=args.raw)
    decoder = m.tokenizer.stream()
    count, wrote, first = 0, False, None
    for token in m.generate_ids(session, ids, max_tokens=args.n, sampling=_sampling(args)):
        count += 1
        first = first or time.perf_counter()
        if piece := decoder.push(token):
            wrote = _write(piece) or wrote
    if tail := decoder.flush():
        wrote = _write(tail) or wrote
    ended = time.perf_counter()
    if wrote:
        _write("\n")
    _say_where_cut(count, args.n, session)
    if args.verbose:
        prefill_end = first or ended  # the prompt's time runs to its first sampled token
        _say(_rate("prompt", len(ids), prefill_end - started))
        if count > 1:
            _say(_rate("generation", count - 1, ended - prefill_end))


def _write(text: str) -> bool:
    sys.stdout.write(text)
    sys.stdout.flush()
    return bool(text)


def _rate(what: str, tokens: int, seconds: float) -> str:
    per_s = tokens / seconds if seconds > 0 else float("inf")
    return f"{what}: {tokens} tokens in {seconds:.3f} s ({per_s:,.1f} tokens/s)"


def cmd_chat(args: argparse.Namespace) -> None:
    from fuselane.text.utf8 import read_text, require_utf8

    if args.system is not None:
        require_utf8(args.system, "the system message")
    m = _load(args.model, args)
    chat = m.chat(system=args.system)
    _say("chat with the model; /reset starts over, /exit (or end of input) quits")
    while True:
        _say_prompt = "> "
        sys.stderr.write(_say_prompt)
        sys.stderr.flush()
        line = read_text(_stdin(), m.max_prompt_bytes, "a chat line on stdin", line=True, context=m.ctx)
        if line is None or line.strip() == "/exit":
            return
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            chat = m.chat(system=args.system)
            continue
        if not text.strip():
            continue
        wrote = False
        try:
            for piece in chat.say(text, max_tokens=args.n, sampling=_sampling(args)):
                wrote = _write(piece) or wrote
        except FuselaneError as e:
            _say_error(str(e))
        if wrote:
            _write("\n")
        _say_where_cut(chat.generated, args.n, chat.session)


def cmd_serve(args: argparse.Namespace) -> None:
    from fuselane.serve.server import Options, serve

    if args.api_key is not None and not args.api_key.strip():
        raise FuselaneError("--api-key must not be empty")
    _split(args.model, args)
    serve(
        Options(
            model=args.model, host=args.host, port=args.port, lane=args.lane, ctx=args.ctx, max_seqs=args.max_seqs,
            max_queue=args.max_queue, api_key=args.api_key, kv_blocks=args.kv_blocks, gpu_memory=args.gpu_memory,
            overlap=not args.no_overlap,
        )
    )  # fmt: skip


def _serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="a .gguf path or known name (default qwen2.5-coder-0.5b)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=ranges.PORT, default=8000, help=_range(ranges.PORT, "TCP port (default 8000)"))
    p.add_argument(
        "--lane", choices=("cpu", "cuda", "auto"), default="auto", help="where to run (default auto: a lane that "
        "runs batches of sequences)",
    )  # fmt: skip
    p.add_argument(
        "--ctx", type=ranges.CTX, default=None, help=_range(ranges.CTX, "context of each sequence (default: the "
        "model's, at most 4096)"),
    )  # fmt: skip
    p.add_argument(
        "--max-seqs", type=ranges.MAX_SEQS, default=16, help=_range(ranges.MAX_SEQS, "sequences run together (16)")
    )
    p.add_argument(
        "--max-queue", type=ranges.MAX_QUEUE, default=256,
        help=_range(ranges.MAX_QUEUE, "requests that may wait beyond those; past them a request gets 429 (256)"),
    )  # fmt: skip
    p.add_argument("--api-key", default=None, metavar="K", help="require 'Authorization: Bearer K' on /v1")
    p.add_argument(
        "--kv-blocks", type=ranges.KV_BLOCKS, default=None,
        help=_range(ranges.KV_BLOCKS, "KV pool size in blocks of 16 tokens (default: a GPU lane's --gpu-memory; "
        "the cpu lane's: every sequence to the context's end)"),
    )  # fmt: skip
    p.add_argument(
        "--gpu-memory", type=ranges.GPU_MEMORY, default=None,
        help=_range(ranges.GPU_MEMORY, "share of the GPU's memory to hold, weights and KV pool (default 0.9)"),
    )  # fmt: skip
    p.add_argument(
        "--no-overlap", action="store_true", help="launch each decode step only after the last one's tokens are "
        "read (default: the cuda lane launches the next step first, so the host's work overlaps the GPU's)",
    )  # fmt: skip
    _tp_flag(p)
    p.set_defaults(func=cmd_serve)


def cmd_tokenize(args: argparse.Namespace) -> None:
    from fuselane.gguf.reader import open_gguf
    from fuselane.hub import resolve
    from fuselane.text.tokenizer import Tokenizer

    with open_gguf(resolve(args.model)) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    print(json.dumps(tok.encode(args.text, special=args.special)))


def cmd_pull(args: argparse.Namespace) -> None:
    from fuselane.hub import pull

    print(pull(args.name, quiet=args.quiet, force=args.force))


def cmd_models(args: argparse.Namespace) -> None:
    from fuselane.hub import KNOWN_MODELS, is_pulled, model_path

    for name, km in KNOWN_MODELS.items():
        state = str(model_path(name)) if is_pulled(name) else "not pulled"
        print(f"{name:24} {km.size / 1e6:8.1f} MB  {km.description}  [{state}]")


def cmd_info(args: argparse.Namespace) -> None:
    from fuselane.info import describe

    info = describe(args.model)
    if args.json:
        print(json.dumps(info, indent=2))
        return
    from fuselane.info import render

    print(render(info))


def cmd_explain(args: argparse.Namespace) -> None:
    if args.classes:
        from fuselane.class_table import class_table, render_table

        table = class_table(
            lane=args.lane, knobs=args.knob, held=args.hold, form=args.form, model=args.model, rows=args.rows
        )
        print(json.dumps(table, indent=2) if args.json else render_table(table))
        return
    if args.model is None:
        raise FuselaneError("explain needs a MODEL (or --classes, the table of fused classes)")
    from fuselane.explain import build_plan, prefill_workspace, render, to_json

    if args.tp > 1:
        from fuselane.parallel import explain as tp_explain

        ranks = tp_explain.rank_plans(
            args.model,
            args.tp,
            lane=args.lane,
            form=args.form,
            rows=args.rows,
            knobs=args.knob,
            held=args.hold,
            ctx=args.ctx,
        )
        print(json.dumps(ranks, indent=2) if args.json else tp_explain.render(ranks))
        return
    name, cfg, plan = build_plan(
        args.model, lane=args.lane, form=args.form, rows=args.rows, knobs=args.knob, held=args.hold, ctx=args.ctx
    )
    ws = None
    if args.lane == "cuda" and args.form == "prefill" and plan.cannot_run is None:
        ws = prefill_workspace(args.model, knobs=args.knob, held=args.hold, ctx=args.ctx)
    data = to_json(name, cfg, plan, args.form, ws)
    print(json.dumps(data, indent=2) if args.json else render(data))


def cmd_bench(args: argparse.Namespace) -> None:
    from fuselane.bench import as_json, bench_depths, render

    _split(args.model, args)
    results = bench_depths(
        args.model, lane=args.lane, prompt=args.p, generated=args.n, depths=args.depth, knobs=args.knob,
        repetitions=args.r,
    )  # fmt: skip
    print(json.dumps(as_json(results), indent=2) if args.json else render(results))


def _range(bound: ranges.Bound, text: str) -> str:
    return f"{text}; {bound.describe()}"


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-n", type=ranges.TOKENS, default=256, help=_range(ranges.TOKENS, "most tokens to generate (default 256)")
    )
    p.add_argument(
        "--temp", type=ranges.TEMPERATURE, default=0.8, help=_range(ranges.TEMPERATURE, "0 is greedy (default 0.8)")
    )
    p.add_argument(
        "--top-k", type=ranges.TOP_K, default=40, help=_range(ranges.TOP_K, "0 keeps every token (default 40)")
    )
    p.add_argument(
        "--top-p", type=ranges.TOP_P, default=0.95, help=_range(ranges.TOP_P, "nucleus mass; 1 keeps all (0.95)")
    )
    p.add_argument(
        "--seed", type=ranges.SEED, default=None, help=_range(ranges.SEED, "the same seed gives the same text")
    )
    p.add_argument("--lane", choices=("cpu", "cuda", "auto"), default="auto", help="where to run (default auto)")
    p.add_argument(
        "--ctx",
        type=ranges.CTX,
        default=None,
        help=_range(ranges.CTX, "context size in tokens, at most the model's (default: the model's, at most 4096)"),
    )
    _knob_flag(p)
    p.add_argument("-v", "--verbose", action="store_true", help="timings and load details on stderr")
    _tp_flag(p)


def _tp_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp", type=ranges.TP, default=1, help=_range(ranges.TP, "split the model over this many GPUs (default 1)")
    )


def _knob_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--knob", action="append", default=[], metavar="K=V", help="a cuda lane knob, e.g. prefill=in-place")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fuselane", description="Run quantized GGUF checkpoints with fused kernels.")
    p.add_argument("--version", action="version", version=f"fuselane {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run", help="generate a reply to a prompt (streams to stdout)", usage="%(prog)s [options] [MODEL] PROMPT"
    )
    run.add_argument(
        "words",
        nargs="+",
        metavar="[MODEL] PROMPT",
        help="a .gguf path or known name (default qwen2.5-coder-0.5b), then the prompt ('-' reads stdin)",
    )
    run.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    _sampling_flags(run)
    run.set_defaults(func=cmd_run)

    chat = sub.add_parser("chat", help="talk with a model, turn by turn")
    chat.add_argument("model", nargs="?", default=None)
    chat.add_argument("--system", default=None, help="a system message")
    _sampling_flags(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server, many sequences at once")
    _serve_flags(serve)

    tok = sub.add_parser("tokenize", help="print the token ids of a text as a JSON list")
    tok.add_argument("model")
    tok.add_argument("text")
    tok.add_argument("--special", action="store_true", help="parse special tokens written out in the text")
    tok.set_defaults(func=cmd_tokenize)

    pull = sub.add_parser("pull", help="download a known model into the cache and verify it")
    pull.add_argument("name")
    pull.add_argument("-q", "--quiet", action="store_true")
    pull.add_argument("--force", action="store_true", help="download again even when cached")
    pull.set_defaults(func=cmd_pull)

    models = sub.add_parser("models", help="list the known models and whether they are pulled")
    models.set_defaults(func=cmd_models)

    info = sub.add_parser("info", help="architecture, shapes, quant mix and tokenizer of a model")
    info.add_argument("model")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)
    explain = sub.add_parser("explain", help="the fused plan on a lane, and why each missed fusion missed")
    explain.add_argument(
        "model", nargs="?", default=None, help="a .gguf path, a known name, or synth:SHAPE[:MIX] (no file needed)"
    )
    explain.add_argument("--lane", choices=("cpu", "cuda"), default="cpu")
    explain.add_argument("--form", choices=("decode", "prefill", "batch"), default="decode")
    explain.add_argument(
        "--rows",
        type=ranges.ROWS,
        default=None,
        help="rows of a prefill chunk (default 512) or sequences of a batch (default 8)",
    )
    explain.add_argument(
        "--ctx",
        type=ranges.CTX,
        default=None,
        help=_range(ranges.CTX, "cache rows the plan and the cuda lane's workspace are sized at (default 4096)"),
    )
    explain.add_argument("--knob", action="append", default=[], metavar="K=V", help="a lane knob (repeatable)")
    explain.add_argument("--hold", action="append", default=[], metavar="RULE", help="hold a rule back (repeatable)")
    explain.add_argument("--json", action="store_true", help="the stable JSON form")
    _tp_flag(explain)
    explain.add_argument(
        "--classes", action="store_true", help="every fused class: the rules that build it, each lane's answer"
    )
    explain.set_defaults(func=cmd_explain)
    bench = sub.add_parser("bench", help="prefill and decode tokens/s, launches a token, %% of the bandwidth limit")
    bench.add_argument("model", nargs="?", default=None)
    bench.add_argument("--lane", choices=("cpu", "cuda", "auto"), default="auto")
    bench.add_argument(
        "-p", type=ranges.BENCH_PROMPT, default=512, help=_range(ranges.BENCH_PROMPT, "prompt tokens (default 512)")
    )
    bench.add_argument(
        "-n",
        type=ranges.BENCH_GENERATED,
        default=128,
        help=_range(ranges.BENCH_GENERATED, "generated tokens (default 128)"),
    )
    bench.add_argument(
        "--depth",
        type=ranges.BENCH_DEPTH,
        nargs="+",
        default=[0],
        help=_range(ranges.BENCH_DEPTH, "tokens already in the cache, one bench each (default 0)")
        + "; depth + prompt + generated + 1 must fit the model's context",
    )
    bench.add_argument(
        "-r",
        "--repetitions",
        dest="r",
        type=ranges.BENCH_REPETITIONS,
        default=ranges.DEFAULT_BENCH_REPETITIONS,
        help=_range(ranges.BENCH_REPETITIONS, "timed runs of the prompt, their tokens/s averaged (default 5)"),
    )
    bench.add_argument("--json", action="store_true")
    _tp_flag(bench)
    _knob_flag(bench)
    bench.set_defaults(func=cmd_bench)
    return p


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def _quiet_outputs(verbose: bool) -> None:
    """Keep stderr for fuselane's own lines: NumPy's floating-point warnings and library log records are not
    the user's business (a -v run still shows the log records); an explicit -W or PYTHONWARNINGS wins."""
    if not sys.warnoptions:
        warnings.simplefilter("ignore")
    if verbose:
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    else:
        logging.getLogger().addHandler(logging.NullHandler())


def _stdout_closed() -> None:
    """The reader of stdout is gone (`| head`): point stdout at /dev/null so the exit's flush stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # a usage error (already said in one line), --help or --version: a code, not an exit
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    if hasattr(sys.stdout, "reconfigure"):
        # a reply may hold characters the terminal's encoding lacks: show a stand-in, not a traceback mid-reply
        sys.stdout.reconfigure(errors="replace")
    _quiet_outputs(getattr(args, "verbose", False))
    # SIGTERM unwinds like Ctrl-C, so that `finally` blocks (a pull's temporary folder) run
    signal.signal(signal.SIGTERM, _terminate)
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        func(args)
    except FuselaneError as e:
        _say_error(str(e))
        return EXIT_ERROR
    except BrokenPipeError:
        _stdout_closed()
        return 0
    except OSError as e:
        _say_error(_os_error(e))
        return EXIT_ERROR
    except MemoryError as e:
        _say_error(f"out of memory{f': {e}' if str(e) else ''}")
        return EXIT_ERROR
    except RuntimeError as e:
        if type(e).__name__ != GPU_OOM:
            raise
        _say_error(f"out of GPU memory: {_first_sentences(str(e))}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        _say("")
        return EXIT_INTERRUPTED
    except Terminated:
        return EXIT_TERMINATED
    return 0


if __name__ == "__main__":
    sys.exit(main())
