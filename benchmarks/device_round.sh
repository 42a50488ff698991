#!/bin/bash
# The device calls that check and time the tree on a GPU machine (see /work/.library/device in this
# workplace), in two parts that each fit one 10-minute command:
#   bash benchmarks/device_round.sh tests     the CUDA tests of the kernels and the newest features (the whole
#                                             suite with FULL_SUITE=1, the named files first), then
#                                             compute-sanitizer's memcheck over the malformed-input suite and
#                                             the serving and 64-bit-offset cases
#   bash benchmarks/device_round.sh features  benchmarks/features_round.py (sinks, MLA, float8 and paged
#                                             caches, 2³¹+ elements, a million tokens)
#   bash benchmarks/device_round.sh timings   the descriptor-vs-pointer forward per seqlen, the host time per
#                                             call against SDPA's, the standard sweep with SDPA flash, cuDNN
#                                             and FlexAttention, and head dims 192/256 against SDPA flash
#   bash benchmarks/device_round.sh before-after DIR   a short sweep (flashtile and cuDNN, seqlen 2048 and 8192)
#                                             and the host time per call of DIR's tree (another checkout, e.g.
#                                             `git archive REV | tar -x -C DIR`) and of this one, interleaved
#                                             in one run, then `bench --compare` of the two
#   bash benchmarks/device_round.sh host DIR  the CUDA tests of the launch paths (plans replayed on compiled kernels),
#                                             then the host time per call (--layers) of DIR's tree and of this one,
#                                             interleaved, twice, and the short-sequence kernels (seqlen 512/1024,
#                                             flashtile and cuDNN) of both
#   bash benchmarks/device_round.sh verify DIR  what the eleventh session built without a GPU: the Gluon launches
#                                             through plans (test_hopper, test_plans first), the float8 decode in
#                                             float16 (its tests, then features_round's fp8-decode twice), then
#                                             the host time per call of DIR's tree and of this one
#   bash benchmarks/device_round.sh serving   issue 23's figures: the decode and serving tests, features_round's fp8-decode,
#                                             paged-prefill and mixed-batch cases twice, and the float8 decode's spread
#                                             over fresh caches (benchmarks/experiments/fp8_decode_variance.py)
#   bash benchmarks/device_round.sh tables    the tables issues 19, 20 and 23 ask for, in one call: the training
#                                             sweep and steps (benchmarks/bwd_round.sh timings), the short rows
#                                             (experiments/persistent_grids.py, seqlen 512-2048), the host time per
#                                             layer and under autograd engine settings, and features_round's
#                                             fp8-decode, paged-prefill and mixed-batch
#   bash benchmarks/device_round.sh profile   Nsight Compute's profile of every row of issue 19's sweep (forward and
#                                             backward, flashtile and cuDNN; benchmarks/profile_rows.py), and its table
#   bash benchmarks/device_round.sh source    Nsight Compute's warp-stall samples per SASS instruction of the fused
#                                             backward's main kernel (CASES, default d128-8192; profile_rows.py)
#   bash benchmarks/device_round.sh wide      the fused backward's wide schedule (head dims 192/256, written in the
#                                             twenty-sixth session without a GPU, not routed yet): its tests, memcheck
#                                             over two of them, then benchmarks/experiments/sm90_bwd_wide.py
# Each writes at most 8 files under $OUT (logs and JSON; the plots packed in one archive).
if [ "$1" != tests ] && [ "$1" != features ] && [ "$1" != timings ] && [ "$1" != before-after ] && [ "$1" != host ] \
   && [ "$1" != verify ] && [ "$1" != serving ] && [ "$1" != tables ] && [ "$1" != profile ] \
   && [ "$1" != source ] && [ "$1" != wide ]; then
  echo "usage: bash benchmarks/device_round.sh tests|features|timings|before-after DIR|host DIR|verify DIR|serving|tables|profile|source|wide" >&2
  exit 2
fi
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git log --oneline | head -1
if [ "$1" = tests ]; then  # -v: a run that the limit cuts still names its failures
  timeout 280 python3 -m pytest -v -n 15 tests/test_hopper.py tests/test_gluon_compile.py tests/test_sinks.py \
    tests/test_head_dim_v.py tests/test_serving.py tests/test_large_offsets.py tests/test_cuda_graphs.py \
    tests/test_compile.py tests/test_decode.py tests/test_malformed.py tests/test_varlen.py tests/test_flash_attn.py \
    ${FULL_SUITE:+tests} > $OUT/pytest.log 2>&1
  grep -E "FAILED|ERROR|passed|failed" $OUT/pytest.log | tail -25
  timeout 150 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 python3 -m pytest -q \
    tests/test_malformed.py tests/test_large_offsets.py tests/test_serving.py -k "malformed or kernels_stay or \
    past_2_31 or paged_varlen_prefill or many_key_blocks or leftpad or fp8_kv or outside" > $OUT/memcheck.log 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.log | sort | uniq -c | tail -8
  exit
fi
if [ "$1" = wide ]; then
  timeout 200 python3 -m pytest -v -n 15 tests/test_hopper.py tests/test_gluon_compile.py -k "wide or gqa or masked_rows \
    or only_where or compiles" > $OUT/pytest.log 2>&1
  grep -E "FAILED|ERROR|passed|failed" $OUT/pytest.log | tail -25
  timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
    "tests/test_hopper.py::test_gluon_backward_wide[bf16-d192-q17-k113-causal]" \
    "tests/test_hopper.py::test_gluon_backward_wide[fp16-d256-q1000-k128-full]" > $OUT/memcheck.log 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.log | sort | uniq -c | tail -4
  timeout 250 python3 benchmarks/experiments/sm90_bwd_wide.py 2>&1 | tee $OUT/sm90_bwd_wide.log
  exit
fi
if [ "$1" = features ]; then
  timeout ${FEATURES_LIMIT:-470} python3 benchmarks/features_round.py --out $OUT/features.json 2>&1 | tee $OUT/features.log
  exit
fi
if [ "$1" = tables ]; then
  T0=$(date +%s)
  bash benchmarks/bwd_round.sh timings 2>&1 | grep -vE "^(NVIDIA|torch)"  # bench.log, bench/, training_step.*
  echo "== short rows at $(( $(date +%s) - T0 )) s"
  timeout 130 python3 benchmarks/experiments/persistent_grids.py --seqlens 512,1024,2048 > $OUT/short.log 2>&1
  tail -16 $OUT/short.log
  echo "== host time at $(( $(date +%s) - T0 )) s"
  timeout 90 python3 benchmarks/host_overhead.py --layers --engine > $OUT/host.log 2>&1; tail -17 $OUT/host.log
  echo "== serving at $(( $(date +%s) - T0 )) s"
  timeout $(( 585 - ($(date +%s) - T0) )) python3 benchmarks/features_round.py \
    --cases fp8-decode paged-prefill mixed-batch > $OUT/features.log 2>&1
  grep -E "copy|paged|mixed" $OUT/features.log | tail -14
  echo "elapsed $(( $(date +%s) - T0 )) s"
  exit
fi
if [ "$1" = profile ]; then
  CASES=${CASES:-d64-2048,d64c-2048,d128-2048,d128c-2048,d64-8192,d64c-8192,d128-8192,d128c-8192,d64-16384,d64c-16384,d128-16384,d128c-16384}
  timeout ${PROFILE_LIMIT:-480} ncu --clock-control none --profile-from-start off --set detailed -o $OUT/rows \
    python3 benchmarks/profile_rows.py --cases $CASES > $OUT/ncu.log 2>&1
  echo "ncu exit $?"; grep -E "^profiled|ERROR" $OUT/ncu.log | tail -14
  ncu -i $OUT/rows.ncu-rep --csv --page raw > $OUT/rows_raw.csv
  python3 benchmarks/profile_rows.py --summarise $OUT/rows_raw.csv --cases $CASES | tee $OUT/rows.md
  exit
fi
if [ "$1" = source ]; then
  for case in ${CASES:-d128-8192}; do
    timeout 200 ncu --clock-control none --profile-from-start off -k regex:_attn_bwd_sm90 --import-source no \
      --section SourceCounters --section WarpStateStats -o $OUT/source_$case python3 benchmarks/profile_rows.py \
      --cases $case > $OUT/source_$case.log 2>&1
    echo "ncu $case exit $?"
    ncu -i $OUT/source_$case.ncu-rep --page source --csv --print-source sass > $OUT/source_$case.csv
    rm -f $OUT/source_$case.ncu-rep; head -c 400 $OUT/source_$case.csv; echo
    python3 benchmarks/profile_rows.py --summarise-source $OUT/source_$case.csv
  done
  exit
fi
if [ "$1" = serving ]; then
  timeout 150 python3 -m pytest -q -n 15 tests/test_decode.py tests/test_serving.py > $OUT/pytest.log 2>&1
  grep -E "FAILED|ERROR|passed|failed" $OUT/pytest.log | tail -8
  for i in 1 2; do
    timeout 90 python3 benchmarks/features_round.py --cases fp8-decode paged-prefill mixed-batch \
      --out $OUT/features$i.json > $OUT/features$i.log 2>&1
    grep -E "of copy|paged-prefill|mixed" $OUT/features$i.log | tail -12
  done
  timeout 60 python3 benchmarks/experiments/fp8_decode_variance.py > $OUT/fp8_variance.log 2>&1
  tail -8 $OUT/fp8_variance.log
  exit
fi
if [ "$1" = verify ]; then
  timeout 200 python3 -m pytest -q -n 15 tests/test_hopper.py tests/test_plans.py tests/test_serving.py \
    tests/test_decode.py tests/test_cuda_graphs.py tests/test_compile.py > $OUT/pytest.log 2>&1
  grep -E "FAILED|ERROR|passed|failed" $OUT/pytest.log | tail -15
  for i in 1 2; do
    timeout 60 python3 benchmarks/features_round.py --cases fp8-decode paged-prefill --out $OUT/features$i.json \
      > $OUT/features$i.log 2>&1
    grep -E "of copy|paged-prefill" $OUT/features$i.log
  done
  for tree in "$2" .; do
    name=$([ "$tree" = . ] && echo after || echo before)
    (cd "$tree" && PYTHONPATH=src timeout 60 python3 benchmarks/host_overhead.py --layers) > $OUT/host_$name.log 2>&1
  done
  grep -hE "per call|µs" $OUT/host_*.log | head -40
  exit
fi
if [ "$1" = host ]; then
  timeout 250 python3 -m pytest -q -n 15 tests/test_plans.py tests/test_flash_attn.py tests/test_variants.py \
    tests/test_varlen.py tests/test_decode.py tests/test_serving.py tests/test_cuda_graphs.py tests/test_compile.py \
    tests/test_hopper.py tests/test_sinks.py > $OUT/pytest.log 2>&1
  grep -E "FAILED|ERROR|passed|failed" $OUT/pytest.log | tail -15
  for round in 1 2; do
    for tree in "$2" .; do
      name=$([ "$tree" = . ] && echo after || echo before)
      (cd "$tree" && PYTHONPATH=src timeout 60 python3 benchmarks/host_overhead.py --layers) >> $OUT/host_$name.log 2>&1
    done
  done
  for tree in "$2" .; do
    name=$([ "$tree" = . ] && echo after || echo before)
    PYTHONPATH=$tree/src timeout 60 python3 -m flashtile bench --providers flashtile,sdpa_cudnn --seqlens 512,1024 \
      --modes fwd,bwd --rep 50 --out-dir $OUT/short_$name > $OUT/short_$name.log 2>&1
  done
  (cd $OUT && rm -f */*.png */bench.txt)
  grep -hE "per call|µs" $OUT/host_*.log | head -50
  grep -hE "^bf16|^flashtile/" $OUT/short_*.log
  exit
fi
if [ "$1" = before-after ]; then
  for round in 1 2; do
    for tree in "$2" .; do
      name=$([ "$tree" = . ] && echo after || echo before)
      (cd "$tree" && PYTHONPATH=src timeout 60 python3 benchmarks/host_overhead.py --layers) > $OUT/host_$name$round.log 2>&1
      PYTHONPATH=$tree/src timeout 150 python3 -m flashtile bench --providers flashtile,sdpa_cudnn --seqlens 2048,8192 \
        --rep 50 --out-dir $OUT/$name$round > $OUT/$name$round.log 2>&1
    done
  done
  for round in 1 2; do python3 -m flashtile bench --compare $OUT/before$round/bench.json $OUT/after$round/bench.json; done
  (cd $OUT && rm -f */*.png */bench.txt)
  grep -hE "per call|µs" $OUT/host_*.log | head -40
  exit
fi
timeout 80 python3 benchmarks/tma_threshold.py > $OUT/tma_threshold.log 2>&1; cat $OUT/tma_threshold.log
timeout 40 python3 benchmarks/host_overhead.py --out $OUT/host.json
timeout 300 python3 -m flashtile bench --providers flashtile,sdpa_flash,sdpa_cudnn,flex --seqlens 512,2048,4096,16384 \
  --out-dir $OUT/std > $OUT/std.log 2>&1
timeout 60 python3 -m flashtile bench --providers flashtile,sdpa_flash --seqlens 4096 --batch 4 --nheads 16 \
  --headdims 192,256 --causal --rep 30 --out-dir $OUT/cliffs > $OUT/cliffs.log 2>&1
(cd $OUT && tar czf plots.tgz std/*.png cliffs/*.png 2>/dev/null; rm -f std/*.png std/bench.txt cliffs/*.png cliffs/bench.txt)
grep -E "^bf16|^flashtile/" $OUT/std.log $OUT/cliffs.log
