"""The fuzz targets run briefly in CI: each must import, take its seed corpus and survive a few thousand inputs.

Each target runs in a subprocess (libFuzzer owns the process: it exits on the first crash and prints the
input), under the address-space bound of `tests.bounded`, with a fixed seed so that a failure reproduces.
New inputs go to a scratch directory named first, so the committed seed corpus is never written to. The
long run and its figures are in docs/fuzzing.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bounded import MEMORY_LIMIT, ONE_THREAD, _limit_memory

pytest.importorskip("atheris")

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "fuzz" / "corpus"
SEED = 1234  # libFuzzer's random seed: the same mutations every run
RUNS = {"gguf_reader": 10_000, "chat_template": 3000}
TIMEOUT = 300  # seconds for the whole run; a few thousand inputs take well under a minute
PER_INPUT_SECONDS = 20  # libFuzzer's own limit for one input: a hang is reported as a crash, not waited on
DONE = re.compile(r"Done (\d+) in")  # atheris' summary line: "Done 3000 in 4 second(s)"
# libFuzzer's own memory check reads the process's peak RSS, which Linux carries across exec from the parent: a
# pytest worker that peaked past 2 GB (the interpreted kernels' tests) made a target of 50 MB an "out-of-memory"
# crash. The check is off; the address-space bound of `tests.bounded` (or, below, the test's own) holds memory.
NO_RSS_CHECK = "-rss_limit_mb=0"


@pytest.mark.parametrize("target", sorted(RUNS))
def test_target_survives_a_short_run(target, tmp_path):
    seeds = CORPUS / target
    assert len(list(seeds.iterdir())) >= 4, "the seed corpus is missing"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            f"fuzz.{target}",
            str(tmp_path),
            str(seeds),
            f"-atheris_runs={RUNS[target]}",
            f"-seed={SEED}",
            f"-timeout={PER_INPUT_SECONDS}",
            f"-artifact_prefix={tmp_path}/",
            NO_RSS_CHECK,
        ],
        cwd=ROOT,
        capture_output=True,
        timeout=TIMEOUT,
        preexec_fn=lambda: _limit_memory(MEMORY_LIMIT),
        env=os.environ | ONE_THREAD,
    )
    log = done.stderr.decode("utf-8", "replace") + done.stdout.decode("utf-8", "replace")
    assert done.returncode == 0, log[-4000:]
    assert "Uncaught Python exception" not in log and not list(tmp_path.glob("crash-*")), log[-4000:]
    match = DONE.search(log)
    assert match and int(match.group(1)) >= RUNS[target], log[-2000:]


@pytest.mark.parametrize("target", sorted(RUNS))
def test_every_seed_is_accepted_by_its_target(target):
    # Seeds that the target refuses at the first check would start the fuzzer outside the format.
    if target == "gguf_reader":
        from fuzz.stages import read_like_fuselane

        outcomes = {p.name: read_like_fuselane(p.read_bytes()) for p in (CORPUS / target).iterdir()}
        assert all(o["read"] == "ok" for o in outcomes.values()), outcomes
        models = [o for name, o in outcomes.items() if name.startswith("micro-")]
        assert models and all(set(o.values()) == {"ok"} for o in models), outcomes
    else:
        from fuselane.text.chat import ChatTemplate

        for path in (CORPUS / target).iterdir():
            assert ChatTemplate(path.read_text()).source


SLOW_EXIT = """
import sys
from fuzz.libfuzzer import fuzz

heap = [{"row": [i]} for i in range(3_000_000)]  # freeing this at exit outlasts a one-second timer tick
fuzz(sys.argv, lambda data: None)
"""


def test_a_finished_run_is_not_killed_by_the_timeout_timer_at_exit(tmp_path):
    # -timeout=1 ticks SIGALRM every second; a run whose exit takes longer must still exit 0.
    done = subprocess.run(
        [sys.executable, "-c", SLOW_EXIT, "-atheris_runs=10", "-timeout=1", f"-artifact_prefix={tmp_path}/"]
        + [NO_RSS_CHECK],
        cwd=ROOT,
        capture_output=True,
        timeout=TIMEOUT,
        env=os.environ | ONE_THREAD,
    )
    assert done.returncode == 0, done.stderr.decode("utf-8", "replace")[-2000:]
