// Small API contracts: the accounting allocator, tensor views, version and target reporting.
#include <cstdlib>
#include <cstring>

#include "test_util.hpp"

#if defined(__unix__)
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace kda::test {
namespace {

TEST(Memory, PeakTracksLiveBytesAndResets) {
  reset_peak_memory();
  const MemoryStats before = memory_stats();
  void* a = allocate(1000);
  void* b = allocate(3000);
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(reinterpret_cast<std::uintptr_t>(b) % 64, 0u);
  EXPECT_EQ(memory_stats().current_bytes - before.current_bytes, 4000);
  deallocate(b);
  EXPECT_EQ(memory_stats().peak_bytes - before.current_bytes, 4000);
  reset_peak_memory();
  EXPECT_EQ(memory_stats().peak_bytes - before.current_bytes, 1000);
  deallocate(a);
  EXPECT_EQ(memory_stats().current_bytes, before.current_bytes);
}

TEST(Memory, ForwardReleasesEverythingItAllocates) {
  Case c;
  c.T = 100;
  for (Path path : {Path::kFused, Path::kStaged}) {
    c.path = path;
    const Inputs in = make_inputs(c);
    const std::int64_t before = memory_stats().current_bytes;
    reset_peak_memory();
    run_forward(c, in, false);
    EXPECT_EQ(memory_stats().current_bytes, before) << path_name(path);
    EXPECT_GT(memory_stats().peak_bytes, before) << "the path allocated nothing through the accounting allocator";
  }
}

#if defined(__unix__)
// GNU OpenMP's thread pool does not survive fork(): a child forked after a multi-threaded call
// computes on one thread (src/core/validate.cpp, resolve_threads) instead of waiting forever for
// the parent's workers, and gets the parent's results bitwise. The child exits through an alarm if
// it hangs, so the test fails instead of hanging.
TEST(Threads, ForkedChildComputesTheParentsResults) {
  Case c;
  c.T = 100, c.H = 4, c.HV = 4, c.K = 32, c.V = 32;
  c.threads = 2;
  const Inputs in = make_inputs(c);
  const Outputs parent = run_forward(c, in, false);  // a team of two threads has run
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(60);
    const Outputs child = run_forward(c, in, false);
    _exit(child.o == parent.o && child.ht == parent.ht ? 0 : 3);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child did not exit (signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0)
                                 << ": SIGALRM = " << SIGALRM << " means it hung)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's results differ from the parent's";
}
#endif

TEST(TensorView, ContiguousAndPermutedStrides) {
  float data[24];
  TensorView t = TensorView::contiguous(data, DType::kF32, {2, 3, 4});
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[2], 1);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.shape_str(), "[2, 3, 4]");
  TensorView p = t.permuted({2, 0, 1});
  EXPECT_EQ(p.shape_str(), "[4, 2, 3]");
  EXPECT_EQ(p.strides[0], 1);
  EXPECT_EQ(p.strides[1], 12);
}

TEST(Library, ReportsVersionAndTarget) {
  EXPECT_STREQ(version(), "0.1.0");
  const std::string target = cpu_target();
  EXPECT_TRUE(target == "avx512" || target == "avx2" || target == "generic") << target;
  // ctest runs the suite once per target this CPU has, forcing all but the best one.
  const char* forced = std::getenv("KDA_CPU_TARGET");
  if (forced != nullptr && *forced != '\0') EXPECT_EQ(target, forced);
}

// bf16 dot products only on the avx512 target, and as KDA_BF16_DOT_PRODUCTS says where it is set
// (ctest's kda_tests_bf16_dot_products_* run); the vendor rule itself: tests/python/test_misc.py.
TEST(Library, ReportsBf16DotProducts) {
  if (std::string(cpu_target()) != "avx512") EXPECT_FALSE(cpu_bf16_dot_products());
  const char* forced = std::getenv("KDA_BF16_DOT_PRODUCTS");
  if (forced != nullptr && std::string(forced) == "on") EXPECT_TRUE(cpu_bf16_dot_products());
  if (forced != nullptr && std::string(forced) == "off") EXPECT_FALSE(cpu_bf16_dot_products());
}

}  // namespace
}  // namespace kda::test
