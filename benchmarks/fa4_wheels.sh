#!/bin/bash
# FA4 (flash-attn-4, CuTe DSL) on the device machine, which has no FA4 and cannot fetch packages. Its
# wheels come to ~110 MB, over one device call's 64 MiB carry limit, so they travel in two calls while
# the machine stays warm (it is released 30 s after a call):
#
#   bash benchmarks/fa4_wheels.sh download          here: .fa4a/ and .fa4b/ (both in .git/info/exclude)
#   bash benchmarks/fa4_wheels.sh stage             device call 1, carry [".fa4a"]
#   source benchmarks/fa4_wheels.sh install; python3 -m flashtile bench --providers flashtile,fa4 ...
#                                                   device call 2, carry [".fa4b"], right after call 1
#
# The versions are those of ../shared/anchors_h200.md's FA4 runs.
FA4_WHEELS="flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu12==4.8.1 apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5 einops==0.8.2 cuda-bindings==13.5.0"
LIBRARY=nvidia_cutlass_dsl_libs_cu12-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl  # 92 MB: split in two

case "$1" in
download)
  grep -qx "/.fa4a/" .git/info/exclude 2>/dev/null || printf '/.fa4a/\n/.fa4b/\n' >> .git/info/exclude
  rm -rf .fa4a .fa4b && mkdir -p .fa4a .fa4b
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    -d .fa4b $FA4_WHEELS || exit
  split -b 55000000 ".fa4b/$LIBRARY" .fa4b/library.part. && rm ".fa4b/$LIBRARY" && mv .fa4b/library.part.aa .fa4a/
  du -sh .fa4a .fa4b
  ;;
stage)
  mkdir -p /tmp/fa4 && cp .fa4a/library.part.aa /tmp/fa4/
  ;;
install)
  cat /tmp/fa4/library.part.aa .fa4b/library.part.ab > "/tmp/fa4/$LIBRARY" && cp .fa4b/*.whl /tmp/fa4/ &&
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      /tmp/fa4/*.whl || return 1
  # --target skips the wheel's .pth file, which puts the `cutlass` package on the path
  export PYTHONPATH="src:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
  ;;
*)
  echo "usage: bash benchmarks/fa4_wheels.sh download|stage, or source it with install" >&2
  exit 2
  ;;
esac
