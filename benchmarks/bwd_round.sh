#!/bin/bash
# One device round for the fused sm_90 backward (flashtile.gluon.sm90_bwd): its tests on the GPU, then
# flashtile (fused backward), flashtile with deterministic=True (the two-kernel backward) and SDPA cuDNN
# timed in one run. Usage: bash benchmarks/bwd_round.sh [seqlens] [extra bench providers]
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git log --oneline | head -1
timeout 240 python3 -m pytest -q -x -n 14 tests/test_hopper.py tests/test_flash_attn.py > $OUT/pytest.log 2>&1
tail -15 $OUT/pytest.log
timeout 300 python3 -m flashtile bench --providers flashtile,flashtile_det,sdpa_cudnn${2:+,$2} --seqlens ${1:-1024,2048,8192,16384} \
  --modes fwd,bwd,fwd_bwd --rep 40 --out-dir $OUT/bench > $OUT/bench.log 2>&1
(cd $OUT && rm -f bench/*.png)
grep -E "^bf16|^flashtile|bwd|error|Error" $OUT/bench.log | head -60
