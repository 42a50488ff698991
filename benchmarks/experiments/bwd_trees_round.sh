# The fused backward in several trees, timed alternating on one GPU (benchmarks/NOTES.md, eighteenth session):
#   mkdir .baseline && git archive HEAD src | tar -x -C .baseline     (the tree before; carried to the device)
#   TREES="before:.baseline/src after:src"                            (label:PYTHONPATH pairs; this is the default)
#   HEADDIMS=128 SEQLENS=2048,8192 BUDGET=500                         (the defaults)
#   bash benchmarks/experiments/bwd_trees_round.sh                    (the backward tests of src, then the trees)
export PYTHONUNBUFFERED=1
T0=$(date +%s); left() { echo $(( $1 - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/env.txt
PYTHONPATH=src timeout 80 python3 -m pytest -q -n 14 tests/test_hopper.py -k "backward or bwd" > $OUT/pytest.log 2>&1
tail -1 $OUT/pytest.log; grep -E "^(FAILED|ERROR)" $OUT/pytest.log | head -5
for i in 1 2; do
  for pair in ${TREES:-before:.baseline/src after:src}; do
    tag=${pair%%:*}; tree=${pair#*:}
    [ $(left ${BUDGET:-500}) -gt 30 ] || break
    PYTHONPATH=$tree timeout $(left ${BUDGET:-500}) python3 benchmarks/experiments/bwd_trees_round.py \
      --label $tag$i --headdims ${HEADDIMS:-128} --seqlens ${SEQLENS:-2048,8192} --rep 20 --out $OUT/$tag$i.json \
      > $OUT/$tag$i.log 2>&1
    cat $OUT/$tag$i.log
  done
done
echo "elapsed $(( $(date +%s) - T0 )) s"
