# Round C: ncu of the rows still short (issue 19's profile of each short row), this tree
export PYTHONUNBUFFERED=1 PYTHONPATH=src
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/env.txt
CASES=${CASES:-d128-2048,d128c-2048,d64-2048,d64c-2048,d128-16384,d128c-16384,d64-16384,d64c-16384}
timeout 500 ncu --clock-control none --profile-from-start off --set detailed -o $OUT/rows \
  python3 benchmarks/profile_rows.py --cases $CASES > $OUT/ncu.log 2>&1; echo "ncu rc=$?"; tail -3 $OUT/ncu.log
ncu -i $OUT/rows.ncu-rep --csv --page raw > $OUT/rows_raw.csv 2>/dev/null
python3 benchmarks/profile_rows.py --summarise $OUT/rows_raw.csv --cases $CASES | tee $OUT/rows.md
rm -f $OUT/rows.ncu-rep
