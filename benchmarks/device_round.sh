#!/bin/bash
# One device call that checks and times the tree on a GPU machine (see /work/.library/device in this
# workplace): the CUDA test suite, the descriptor-vs-pointer forward per seqlen, the standard sweep
# with SDPA flash and cuDNN, FlexAttention, and the head-dim 192/256 shapes against SDPA flash;
# the host time per call (benchmarks/host_overhead.py) against SDPA's.
# Writes at most 8 files under $OUT (logs and bench.json files; the plots packed in one archive).
#   bash benchmarks/device_round.sh
# The steps' timeouts add up to more than a device command's 10 minutes: a slow round loses its last
# step (the logs show which).
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git log --oneline | head -1
timeout 300 python3 -m pytest -q -n 14 tests > $OUT/pytest.log 2>&1; tail -3 $OUT/pytest.log
timeout 80 python3 benchmarks/tma_threshold.py > $OUT/tma_threshold.log 2>&1; cat $OUT/tma_threshold.log
timeout 40 python3 benchmarks/host_overhead.py --out $OUT/host.json
timeout 200 python3 -m flashtile bench --providers flashtile,sdpa_flash,sdpa_cudnn,flex --seqlens 512,2048,4096,16384 \
  --out-dir $OUT/std > $OUT/std.log 2>&1
timeout 60 python3 -m flashtile bench --providers flashtile,sdpa_flash --seqlens 4096 --batch 4 --nheads 16 \
  --headdims 192,256 --causal --rep 30 --out-dir $OUT/cliffs > $OUT/cliffs.log 2>&1
(cd $OUT && tar czf plots.tgz std/*.png cliffs/*.png 2>/dev/null; rm -f std/*.png std/bench.txt cliffs/*.png cliffs/bench.txt)
grep -E "^bf16|^flashtile/" $OUT/std.log $OUT/cliffs.log
