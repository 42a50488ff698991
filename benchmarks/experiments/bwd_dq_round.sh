#!/bin/bash
# The landed fused backward against the two dQ-store candidates of benchmarks/NOTES.md (nineteenth session), on one
# GPU in one call: each patch applied to a copy of src, its head-dim-128 backward tests, then the three trees timed
# alternating (experiments/bwd_trees_round.sh: fwd+bwd − fwd in CUDA graphs, cuDNN beside each figure).
#   bwd_dq_rows_permuted.patch  rows staged in a permuted order through a 5-D descriptor (no 2-way conflict)
#   bwd_dq_atomics_d128.patch   the atomics writers at head dim 128 too, with the 32-byte swizzle
export PYTHONUNBUFFERED=1
for name in rows_permuted atomics_d128; do
  rm -rf /tmp/$name && mkdir -p /tmp/$name && cp -r src /tmp/$name/
  (cd /tmp/$name && patch -p1 -s) < benchmarks/experiments/bwd_dq_$name.patch || exit 1
  echo "$name: $(PYTHONPATH=/tmp/$name/src timeout 70 python3 -m pytest -q -x -n 14 tests/test_hopper.py \
    -k "backward and d128" 2>&1 | tail -1)"
done
TREES="landed:src permuted:/tmp/rows_permuted/src atomics:/tmp/atomics_d128/src" HEADDIMS=${HEADDIMS:-128} \
  SEQLENS=${SEQLENS:-2048,8192} BUDGET=${BUDGET:-330} bash benchmarks/experiments/bwd_trees_round.sh
