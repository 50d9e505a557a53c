#!/usr/bin/env bash
# End to end, as a user runs it: `samctl build` over old + new files versus
# `samctl build --append-to old.sam new/` (tokenize + build + write each), alternated.
#   tools/bench/bench_append_cli.sh TOKENIZER OLD_DIR NEW_DIR WORK_DIR [ROUNDS]
set -euo pipefail
tok=$1 old=$2 new=$3 work=$4 rounds=${5:-2}
export TOKENIZERS_PARALLELISM=false
mkdir -p "$work"
python -m samctl build "$old" --tokenizer "$tok" -o "$work/old.sam" --no-compress
for r in $(seq 1 "$rounds"); do
  for side in append rebuild; do
    start=$(date +%s.%N)
    if [ "$side" = append ]; then
      python -m samctl build --append-to "$work/old.sam" "$new" -o "$work/grown.sam"
    else
      python -m samctl build "$old" "$new" --tokenizer "$tok" -o "$work/full.sam" --no-compress
    fi
    echo "round $r $side wall $(echo "$(date +%s.%N) - $start" | bc) s"
  done
done
python - "$work" <<'PY'
import sys, numpy as np
from samctl.index.load import load_datastore
a, b = (load_datastore(f"{sys.argv[1]}/{n}.sam").structure.to_arrays() for n in ("grown", "full"))
print("equal to rebuild:", all(np.array_equal(a[k], b[k]) for k in ("states", "edges", "tokens")))
PY
