#!/bin/bash
# The paged prefill's whole blocks without the select per score (benchmarks/NOTES.md, twentieth session), on one GPU:
# the serving tests that reach the forward kernel's paged path (and compute-sanitizer's memcheck over the ones with
# page ids outside the cache), then features_round's paged-prefill case for the tree before and this one,
# alternating, twice.
#   mkdir .baseline && git archive HEAD src benchmarks pyproject.toml | tar -x -C .baseline   (the tree before)
#   bash benchmarks/experiments/paged_round.sh
export PYTHONUNBUFFERED=1
T0=$(date +%s)
PYTHONPATH=src timeout 100 python3 -m pytest -q -n 8 tests/test_serving.py tests/test_plans.py \
  -k "paged or outside or many_key or mixed" > $OUT/paged_pytest.log 2>&1
tail -1 $OUT/paged_pytest.log; grep -E "^(FAILED|ERROR)" $OUT/paged_pytest.log | head -5
PYTHONPATH=src timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
  tests/test_serving.py -k "paged_varlen_prefill or many_key_blocks or outside" > $OUT/paged_memcheck.log 2>&1
echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" $OUT/paged_memcheck.log | sort | uniq -c | tail -3
for i in 1 2; do
  for pair in before:.baseline/src after:src; do
    tag=${pair%%:*}; tree=${pair#*:}
    PYTHONPATH=$tree timeout 100 python3 benchmarks/features_round.py --cases paged-prefill 2>&1 \
      | grep -E "contiguous|paged \(page [0-9]+\)[^,]" | sed "s/^/$tag$i /"
  done
done
echo "paged round: $(( $(date +%s) - T0 )) s"
