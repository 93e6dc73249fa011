"""The `fuselane` command: run, chat, tokenize, pull, models, info.

stdout carries only what the user asked for (the reply, the ids, the table); logs and progress go to stderr.
Every failure caused by input is one line on stderr and exit code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import NoReturn

from fuselane.errors import FuselaneError

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


def _say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors follow the rule above (argparse prints the usage and exits 2)."""

    def error(self, message: str) -> NoReturn:
        _say(f"fuselane: error: {message} (see '{self.prog} --help')")
        sys.exit(EXIT_ERROR)


def _sampling(args: argparse.Namespace):
    from fuselane.runtime.sampling import SamplingParams

    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def _load(model: str | None, args: argparse.Namespace):
    from fuselane.runtime.model import load

    started = time.perf_counter()
    m = load(model, lane=getattr(args, "lane", "auto"), ctx=getattr(args, "ctx", None), knobs=getattr(args, "knob", ()))
    if getattr(args, "verbose", False):
        _say(
            f"loaded {m.path.name} ({m.cfg.arch}, {m.cfg.n_layers} layers) on the {m.lane.name} lane "
            f"in {time.perf_counter() - started:.2f} s"
        )
    return m


def cmd_run(args: argparse.Namespace) -> None:
    if len(args.words) > 2:
        raise FuselaneError("run takes at most a model and a prompt (quote the prompt)")
    model, prompt = (None, args.words[0]) if len(args.words) == 1 else args.words
    if prompt == "-":
        prompt = sys.stdin.read()
    m = _load(model, args)
    started, count = time.perf_counter(), 0
    for piece in m.stream(prompt, max_tokens=args.n, sampling=_sampling(args), raw=args.raw):
        sys.stdout.write(piece)
        sys.stdout.flush()
        count += 1
    sys.stdout.write("\n")
    if args.verbose:
        _say(f"{time.perf_counter() - started:.2f} s")


def cmd_chat(args: argparse.Namespace) -> None:
    m = _load(args.model, args)
    chat = m.chat(system=args.system)
    _say("chat with the model; /reset starts over, /exit (or end of input) quits")
    while True:
        _say_prompt = "> "
        sys.stderr.write(_say_prompt)
        sys.stderr.flush()
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return
        text = line.rstrip("\n")
        if text.strip() == "/reset":
            chat = m.chat(system=args.system)
            continue
        if not text.strip():
            continue
        try:
            for piece in chat.say(text, max_tokens=args.n, sampling=_sampling(args)):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except FuselaneError as e:
            _say(f"fuselane: error: {e}")
        sys.stdout.write("\n")
        sys.stdout.flush()


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
    from fuselane.explain import build_plan, render, to_json

    name, cfg, plan = build_plan(
        args.model, lane=args.lane, form=args.form, rows=args.rows, knobs=args.knob, held=args.hold
    )
    data = to_json(name, cfg, plan, args.form)
    print(json.dumps(data, indent=2) if args.json else render(data))


def cmd_bench(args: argparse.Namespace) -> None:
    from fuselane.bench import as_json, bench, render

    results = [
        bench(args.model, lane=args.lane, prompt=args.p, generated=args.n, depth=depth, knobs=args.knob)
        for depth in args.depth
    ]
    print(json.dumps(as_json(results), indent=2) if args.json else render(results))


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample from the k likeliest tokens; 0 = all (default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (default 0.95)")
    p.add_argument("--seed", type=int, default=None, help="random seed: the same seed gives the same text")
    p.add_argument("--lane", choices=("cpu", "cuda", "auto"), default="auto", help="where to run (default auto)")
    p.add_argument("--ctx", type=int, default=None, help="context size in tokens (default: model's, at most 4096)")
    _knob_flag(p)
    p.add_argument("-v", "--verbose", action="store_true", help="timings and load details on stderr")


def _knob_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--knob", action="append", default=[], metavar="K=V", help="a cuda lane knob, e.g. prefill=in-place")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="fuselane", description="Run quantized GGUF checkpoints with fused kernels.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="generate a reply to a prompt (streams to stdout)")
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
        type=int,
        default=None,
        help="rows of a prefill chunk (default 512) or sequences of a batch (default 8)",
    )
    explain.add_argument("--knob", action="append", default=[], metavar="K=V", help="a lane knob (repeatable)")
    explain.add_argument("--hold", action="append", default=[], metavar="RULE", help="hold a rule back (repeatable)")
    explain.add_argument("--json", action="store_true", help="the stable JSON form")
    explain.add_argument(
        "--classes", action="store_true", help="every fused class: the rules that build it, each lane's answer"
    )
    explain.set_defaults(func=cmd_explain)
    bench = sub.add_parser("bench", help="prefill and decode tokens/s, launches a token, %% of the bandwidth limit")
    bench.add_argument("model", nargs="?", default=None)
    bench.add_argument("--lane", choices=("cpu", "cuda", "auto"), default="auto")
    bench.add_argument("-p", type=int, default=512, help="prompt tokens (default 512)")
    bench.add_argument("-n", type=int, default=128, help="generated tokens (default 128)")
    bench.add_argument("--depth", type=int, nargs="+", default=[0], help="tokens already in the cache (default 0)")
    bench.add_argument("--json", action="store_true")
    _knob_flag(bench)
    bench.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        # a reply may hold characters the terminal's encoding lacks: show a stand-in, not a traceback mid-reply
        sys.stdout.reconfigure(errors="replace")
    func: Callable[[argparse.Namespace], None] = args.func
    try:
        func(args)
    except FuselaneError as e:
        _say(f"fuselane: error: {e}")
        return EXIT_ERROR
    except (OSError, MemoryError) as e:
        _say(f"fuselane: error: {type(e).__name__}: {e}")
        return EXIT_ERROR
    except KeyboardInterrupt:
        _say("")
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
