#!/bin/bash
# The float8 decode's V widened four values at a time (benchmarks/experiments/fp8_v_in_fours.patch; NOTES.md,
# twentieth session), on one GPU: the patch applied to a copy of src, its float8 decode and serving tests (the PTX
# path runs on a GPU only), then features_round's fp8-decode case for this tree and the patched one, alternating,
# twice. Land the patch only if the tests pass.
export PYTHONUNBUFFERED=1
rm -rf /tmp/fp8_v && mkdir -p /tmp/fp8_v && cp -r src /tmp/fp8_v/
(cd /tmp/fp8_v && patch -p1 -s) < benchmarks/experiments/fp8_v_in_fours.patch || exit 1
PYTHONPATH=/tmp/fp8_v/src timeout 90 python3 -m pytest -q -n 8 tests/test_decode.py tests/test_serving.py \
  -k "fp8 or float8" 2>&1 | tail -1
for i in 1 2; do
  for pair in landed:src fours:/tmp/fp8_v/src; do
    echo "${pair%%:*}$i $(PYTHONPATH=${pair#*:} timeout 60 python3 benchmarks/features_round.py --cases fp8-decode 2>&1 \
      | grep -E "float8|bf16" | tr -s ' ' | tr '\n' ' ')"
  done
done
