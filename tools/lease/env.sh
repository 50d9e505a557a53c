# Sourced first by every lease script, from the repository root: offline settings, the carried
# files (.lease/, ignored by git: GGUF parts, wheels, questions) gathered in /tmp/lease while the
# machine stays warm, a zstandard stub, samctl importable from this checkout without installing it
# (the call then runs in a copy: write results under $OUT), and what the machine is.
# LEASE_DRY=1 rehearses a call on a CPU (tiny sizes, --device cpu).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SAMCTL_CACHE=/tmp/samctl-cache
export OUT=${OUT:-/tmp/gpu/out} DEV=cuda
[ -n "$LEASE_DRY" ] && DEV=cpu
mkdir -p /tmp/site /tmp/stub /tmp/gpu /tmp/lease "$OUT"
cp -n .lease/* /tmp/lease/ 2>/dev/null
# Carried wheels (gguf: transformers reads GGUF files with it) go to /tmp/site, before the image's own.
if ls /tmp/lease/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/lease/*.whl \
    && touch /tmp/site/.installed || return 1
fi
# index/store.py imports zstandard at the top; only store files need it, and the GPU image lacks it.
python3 -c 'import zstandard' 2>/dev/null || printf 'class ZstdError(Exception): pass\nclass ZstdCompressor:\n    def __init__(self, *a, **k): raise ZstdError("no zstandard here")\nZstdDecompressor = ZstdCompressor\n' > /tmp/stub/zstandard.py
# index/ and decode/ install as samctl.index and samctl.decode. Without an install, the calls run
# in a copy of the checkout (outside it: no links in the checkout) with them inside samctl/, so
# that the checkout's own samctl/ cannot shadow them (pytest puts the repo root first on sys.path).
if ! PYTHONPATH=/tmp/site:/tmp/stub python3 -c 'import samctl.decode.engine.target' 2>/dev/null; then
  rm -rf /tmp/tree && mkdir -p /tmp/tree && tar --exclude=./.git --exclude=./.lease -cf - . | tar -xf - -C /tmp/tree || return 1
  cp -r decode index /tmp/tree/samctl/ && cd /tmp/tree || return 1
fi
export PYTHONPATH=/tmp/site:/tmp/stub:$PWD
[ -z "$LEASE_DRY" ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers as t; print("torch", torch.__version__, "transformers", t.__version__, "cuda", torch.cuda.is_available())'
