"""Coverage-guided fuzz target for the GGUF reader and everything that reads a checked header.

Each input is a whole file's bytes, taken through `fuzz.stages.read_like_fuselane`: the reader's checks and,
if the file passes them, what `info`, `run` and `tokenize` do next (model config, `info` summary, tokenizer,
chat template). A `FuselaneError` is the expected way to refuse an input; any other exception escapes and
atheris reports it as a crash, with the input that caused it.

Run it (see docs/fuzzing.md):

    python -m fuzz.gguf_reader /tmp/new-inputs fuzz/corpus/gguf_reader -atheris_runs=1000000

libFuzzer writes the inputs it finds into the first directory, so name a scratch one first and the seeds after.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import atheris

from fuzz.libfuzzer import fuzz

# fuzz.stages is instrumented with the package so that coverage counts the stage wrapper's branches too.
with atheris.instrument_imports(include=["fuselane", "fuzz"]):
    from fuzz.stages import read_like_fuselane


def test_one_input(data: bytes) -> None:
    """One execution: read `data` as a GGUF file and take it as far as the loader would."""
    read_like_fuselane(data)


def main(argv: Sequence[str] | None = None) -> None:
    """Fuzz with libFuzzer's command line (`-atheris_runs=N`, `-max_total_time=S`, corpus directories)."""
    fuzz(sys.argv if argv is None else argv, test_one_input)


if __name__ == "__main__":
    main()
