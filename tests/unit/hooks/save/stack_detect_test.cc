#include "hooks/save/stack_detect.h"

#include <dlfcn.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ucp::hooks {
namespace {

// Distinctive frames for the walker to find. noinline, and a call through a volatile function
// pointer, keep them real frames under -O2.
__attribute__((noinline)) bool UcpTestOuterWriterFrame(StackDetector& detector) {
  bool (*volatile check)(StackDetector&) = [](StackDetector& d) { return d.IsCheckpointWriter(); };
  const bool result = check(detector);
  asm volatile("" ::: "memory");
  return result;
}

__attribute__((noinline)) std::vector<std::string> UcpTestSymbolsFrame() {
  std::vector<std::string> symbols = CurrentStackSymbols(64);
  asm volatile("" ::: "memory");
  return symbols;
}

TEST(StackDetectTest, SeesTheCallersFramesDemangled) {
  const std::vector<std::string> symbols = UcpTestSymbolsFrame();
  ASSERT_FALSE(symbols.empty()) << "libunwind.so.8 did not load";
  bool seen_frame = false;
  bool seen_test_body = false;
  for (const std::string& symbol : symbols) {
    if (symbol.find("UcpTestSymbolsFrame") != std::string::npos) seen_frame = true;
    // Demangled C++ names, namespaces spelt out.
    if (symbol.find("ucp::hooks::") != std::string::npos &&
        symbol.find("TestBody") != std::string::npos) {
      seen_test_body = true;
    }
  }
  EXPECT_TRUE(seen_frame);
  EXPECT_TRUE(seen_test_body);
}

TEST(StackDetectTest, MatchesOnlyWhenAFrameMatchesAPattern) {
  auto matching = StackDetector::Create({"NoSuchFrame", "UcpTestOuterWriterFrame"});
  ASSERT_TRUE(matching.ok());
  EXPECT_TRUE(UcpTestOuterWriterFrame(**matching));
  // Twice: the second walk answers from the per-address cache.
  EXPECT_TRUE(UcpTestOuterWriterFrame(**matching));
  EXPECT_FALSE((*matching)->IsCheckpointWriter()) << "matched outside the writer frame";

  auto other = StackDetector::Create({"PyTorchStreamWriter"});
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(UcpTestOuterWriterFrame(**other));

  // A demangled pattern matches too.
  auto demangled = StackDetector::Create({"ucp::hooks::(anonymous namespace)::UcpTestOuter"});
  ASSERT_TRUE(demangled.ok());
  EXPECT_TRUE(UcpTestOuterWriterFrame(**demangled));
}

TEST(StackDetectTest, LibunwindStaysOutOfTheGlobalScope) {
  ASSERT_FALSE(CurrentStackSymbols(4).empty());
  // The process's _Unwind_RaiseException (what every C++ throw calls) is still libgcc_s's.
  void* raise = ::dlsym(RTLD_DEFAULT, "_Unwind_RaiseException");
  ASSERT_NE(raise, nullptr);
  Dl_info info{};
  ASSERT_NE(::dladdr(raise, &info), 0);
  EXPECT_NE(std::string(info.dli_fname).find("libgcc_s"), std::string::npos) << info.dli_fname;
  // libunwind is loaded, just not global.
  EXPECT_NE(::dlopen("libunwind.so.8", RTLD_NOW | RTLD_NOLOAD), nullptr);
}

TEST(StackDetectTest, RejectsEmptyPatterns) {
  EXPECT_FALSE(StackDetector::Create({}).ok());
  EXPECT_FALSE(StackDetector::Create({"a", ""}).ok());
}

}  // namespace
}  // namespace ucp::hooks
