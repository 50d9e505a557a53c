# Sourced first by every lease script, from the repository root: offline settings, optional carried
# wheels, a zstandard stub, samctl importable from this checkout without installing it (the call
# then runs in a copy: write results under $OUT), and what the machine is.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SAMCTL_CACHE=/tmp/samctl-cache
mkdir -p /tmp/site /tmp/stub /tmp/gpu "${OUT:-/tmp/gpu/out}"
export OUT=${OUT:-/tmp/gpu/out}
# GGUF parts carried one per call (.smol/p0..p2) gather in /tmp/smol while the machine stays warm.
mkdir -p /tmp/smol; cp -n .smol/p? /tmp/smol/ 2>/dev/null
# Carried wheels (README: .whl/ at the repo root, ignored by git) replace the image's versions.
if [ ! -d /tmp/site/transformers ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
fi
# index/store.py imports zstandard at the top; only store files need it, and the GPU image lacks it.
python3 -c 'import zstandard' 2>/dev/null || printf 'class ZstdError(Exception): pass\nclass ZstdCompressor:\n    def __init__(self, *a, **k): raise ZstdError("no zstandard here")\nZstdDecompressor = ZstdCompressor\n' > /tmp/stub/zstandard.py
# index/ and decode/ install as samctl.index and samctl.decode. Without an install, the calls run
# in a copy of the checkout (outside it: no links in the checkout) with them inside samctl/, so
# that the checkout's own samctl/ cannot shadow them (pytest puts the repo root first on sys.path).
if ! PYTHONPATH=/tmp/site:/tmp/stub python3 -c 'import samctl.decode.engine.target' 2>/dev/null; then
  rm -rf /tmp/tree && mkdir -p /tmp/tree && tar --exclude=./.git -cf - . | tar -xf - -C /tmp/tree || return 1
  cp -r decode index /tmp/tree/samctl/ && cd /tmp/tree || return 1
fi
export PYTHONPATH=/tmp/site:/tmp/stub:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers as t; print("torch", torch.__version__, "transformers", t.__version__, "cuda", torch.cuda.is_available())'
