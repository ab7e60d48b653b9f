#include "hooks/events.h"

#include <atomic>

namespace ucp::hooks {
namespace {

std::atomic<SaveObserver*> g_save_observer{nullptr};
std::atomic<ServePolicy*> g_serve_policy{nullptr};
std::atomic<WriteRedirect*> g_write_redirect{nullptr};

}  // namespace

SaveObserver* GetSaveObserver() noexcept { return g_save_observer.load(std::memory_order_acquire); }
ServePolicy* GetServePolicy() noexcept { return g_serve_policy.load(std::memory_order_acquire); }
WriteRedirect* GetWriteRedirect() noexcept {
  return g_write_redirect.load(std::memory_order_acquire);
}
void SetSaveObserver(SaveObserver* observer) noexcept {
  g_save_observer.store(observer, std::memory_order_release);
}
void SetServePolicy(ServePolicy* policy) noexcept {
  g_serve_policy.store(policy, std::memory_order_release);
}
void SetWriteRedirect(WriteRedirect* redirect) noexcept {
  g_write_redirect.store(redirect, std::memory_order_release);
}

}  // namespace ucp::hooks
