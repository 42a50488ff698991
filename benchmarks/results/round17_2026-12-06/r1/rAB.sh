# One call: direct C-launcher replays (tests, host time before/after), issue 19's table, the short rows
export PYTHONUNBUFFERED=1
T0=$(date +%s); left() { echo $(( $1 - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/env.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/env.txt
PYTHONPATH=src timeout 170 python3 -m pytest -q -n 14 tests/test_plans.py tests/test_hopper.py tests/test_cuda_graphs.py > $OUT/pytest.log 2>&1
tail -1 $OUT/pytest.log; grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head
for tree in .baseline/src src .baseline/src src; do
  tag=$( [ $tree = src ] && echo after || echo before ); n=$(ls $OUT | grep -c "host_$tag")
  [ $(left 300) -gt 40 ] || break
  PYTHONPATH=$tree timeout 45 python3 benchmarks/host_overhead.py --layers --calls 300 --repeats 7 --out $OUT/host_${tag}$n.json > $OUT/host_${tag}$n.log 2>&1
  echo "== $tag$n rc=$?"; grep -vE "^\s*$" $OUT/host_${tag}$n.log | head -14
done
export PYTHONPATH=src
if [ $(left 585) -gt 150 ]; then
  timeout $(left 585) bash benchmarks/bwd_round.sh timings > $OUT/timings.log 2>&1; grep -vE "^\s*$" $OUT/timings.log | tail -40
fi
if [ $(left 590) -gt 50 ]; then
  timeout $(left 590) python3 benchmarks/experiments/persistent_grids.py --seqlens 512,1024 --rep 25 --out $OUT/short.json > $OUT/short.log 2>&1
  tail -12 $OUT/short.log
fi
echo "elapsed $(( $(date +%s) - T0 )) s"
