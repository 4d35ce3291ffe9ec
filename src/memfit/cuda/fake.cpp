// memfit's fake-CUDA shim for a CPU build of torch (see _fake_cuda.py).
//
// A CPU build has no CUDA hooks and no CUDA device guard, so fake tensors on "cuda" can be
// made but autograd aborts the process on them (AccumulateGrad asks for the guard) and
// at::hasCUDA() is false. This registers what a CUDA build registers on a host without a
// GPU: hooks reporting one device with a no-op init, and c10's own FakeGuardImpl as the
// CUDA device guard. It must be loaded (RTLD_GLOBAL) before torch: getCUDAHooks() keeps
// the first hooks it finds in a function-local static.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace at {
namespace {
struct MemfitFakeCUDAHooks final : CUDAHooksInterface {
  explicit MemfitFakeCUDAHooks(CUDAHooksArgs /*unused*/) {}
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasPrimaryContext(DeviceIndex /*device_index*/) const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(DeviceIndex /*device*/) const override {}
  DeviceIndex exchangeDevice(DeviceIndex /*device*/) const override { return 0; }
  DeviceIndex maybeExchangeDevice(DeviceIndex /*device*/) const override { return 0; }
  void deviceSynchronize(DeviceIndex /*device_index*/) const override {}
};
}  // namespace
// The registry key must be "CUDAHooks": the name getCUDAHooks() looks up.
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, MemfitFakeCUDAHooks)
}  // namespace at

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>)

// Lets Python check that this library, and not some other, is what it loaded.
extern "C" int memfit_fake_cuda_version() { return 1; }
