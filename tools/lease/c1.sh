# Call 1 (carry .lease/p0 and the small files): the CUDA tests, then the probes (about 3 minutes).
set -o pipefail
source tools/lease/env.sh || exit 1
exec > >(tee -a "$OUT/c1.log") 2>&1
T=; python3 -c 'import pytest_timeout' 2>/dev/null && T="--timeout 60"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfEs $T -m gpu tests/test_gpu.py
if [ -z "$LEASE_DRY" ]; then  # a dry run stops here, with the tests' status
    timeout 45 python3 tools/lease/probe.py syncs widths | tee "$OUT/probe.jsonl"
fi
