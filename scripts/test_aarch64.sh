#!/usr/bin/env bash
# The C++ suite on a second instruction set: cross-compiled for AArch64 (Debian's
# g++-aarch64-linux-gnu, cmake/aarch64-linux-gnu.cmake) and run under qemu-user. There the
# portable kernels are the only target, so this checks "correct everywhere" where the x86 runs
# cannot: no x86 intrinsics or types leak into them, and GCC's fused multiply-add contraction
# (AArch64 has FMA everywhere) does not break their bitwise contracts. The longest tests (T = 1000
# to 8192 and K = 256 shapes, the streamed-store, large-decode and a few other equalities: about
# 10 minutes under emulation) are left to the native runs, which run them on the same portable
# kernels (ctest's kda_tests_generic_target); the rest, about 580 tests, take 2.5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(uname -m)" != "x86_64" ]; then
  echo "== C++ on AArch64: skipped (this host is $(uname -m); the cross build is set up for x86-64 hosts)"
  exit 0
fi
echo "== C++: AArch64 cross build (portable kernels) and the suite under qemu-aarch64"
cmake -S . -B build/aarch64 -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -DCMAKE_BUILD_TYPE=Release -DKDA_CUDA=OFF -DKDA_BUILD_BENCH=OFF -DKDA_GTEST_SOURCE_DIR=/usr/src/googletest >/dev/null
cmake --build build/aarch64 --target kda_tests
filter='-Cuda*:*StreamedStores*:*Long*:*T1000_*:*K256*:*five_mixed*:VNewStagedBackward.*:BackwardExact.ParameterGradientsIndependentOfThreads:DecodeExact.LargeCalls*:Bf16Products.Arange*'
qemu-aarch64 -L /usr/aarch64-linux-gnu build/aarch64/tests/cpp/kda_tests --gtest_filter="$filter" --gtest_brief=1
