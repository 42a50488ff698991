#!/bin/bash
# The device rounds of the fused sm_90 backward (flashtile.gluon.sm90_bwd), each within one 10-minute command:
#   bash benchmarks/bwd_round.sh tests    the CUDA test suite, then compute-sanitizer's memcheck over the
#                                         malformed-input suite and a few fused-backward cases
#   bash benchmarks/bwd_round.sh timings  flashtile (fused backward), flashtile deterministic=True (the two-kernel
#                                         backward) and SDPA cuDNN in one sweep, then benchmarks/training_step.py
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$1" = tests ]; then
  # -v: each result line names its test, so a run that the limit cuts still names its failures
  timeout 420 python3 -m pytest -v -n 16 tests > $OUT/pytest.log 2>&1; grep -E "FAILED|ERROR|passed|failed" $OUT/pytest.log | tail -25
  timeout 150 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9 python3 -m pytest -q -x \
    tests/test_malformed.py "tests/test_hopper.py::test_gluon_backward[bf16-d128-q17-k113-causal]" \
    "tests/test_hopper.py::test_gluon_backward[bf16-d64-q1000-k128-full]" > $OUT/memcheck.log 2>&1
  echo "memcheck exit $?"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck.log | sort | uniq -c | tail -8
  exit
fi
timeout 150 python3 -m flashtile bench --providers flashtile,flashtile_det,sdpa_cudnn --seqlens 2048,8192,16384 \
  --modes fwd,bwd,fwd_bwd --rep 30 --out-dir $OUT/bench > $OUT/bench.log 2>&1
(cd $OUT && rm -f bench/*.png)
grep -E "^bf16|^flashtile" $OUT/bench.log
timeout 100 python3 benchmarks/training_step.py --rep 100 --out $OUT/training_step.json 2>&1 | tee $OUT/training_step.log
