# Sourced first by every lease script: offline settings, optional carried wheels, a zstandard stub,
# samctl importable from this checkout without installing it, and what the machine is.
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
export PYTHONPATH=/tmp/site:/tmp/stub:$PWD
# index/ and decode/ install as samctl.index and samctl.decode; without an install, links make
# the checkout itself importable (also for pytest, which puts the repo root first on sys.path).
if ! python3 -c 'import samctl.decode.engine.target' 2>/dev/null; then
  ln -sfn ../decode samctl/decode; ln -sfn ../index samctl/index
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers as t; print("torch", torch.__version__, "transformers", t.__version__, "cuda", torch.cuda.is_available())'
