# Call 2 (carry .lease/p1): a random-weight Llama-3-8B-shaped model in bf16 (about 2 minutes).
set -o pipefail
source tools/lease/env.sh || exit 1
exec > >(tee -a "$OUT/c2.log") 2>&1
timeout 230 python3 tools/lease/big.py "$OUT/big.json" ${LEASE_DRY:+--dry-run}
