// Fake CUDA for a CPU-only PyTorch build, for tests only (tests/fake_cuda/__init__.py).
//
// Two registrations make ATen believe one CUDA device exists, without any CUDA library:
//   * c10::impl::FakeGuardImpl<CUDA> as the CUDA device guard (device and stream bookkeeping
//     only; it is the guard PyTorch's own c10 tests use);
//   * CUDA hooks that report CUDA as built and available with one device, so that the
//     autograd engine and autocast accept CUDA tensors.
// No CUDA tensor ever holds data: the tests create them under FakeTensorMode, where every
// op runs on meta shape functions. Anything that needs a real device (a kernel, a
// generator, pinned memory, NCCL) still raises.
//
// ATen creates its CUDA hooks object once, on first use, as the stub CUDAHooksInterface
// (which says "no CUDA") when no CUDA library is loaded; that has happened long before a
// test can load this library. install() therefore turns that object into FakeCUDAHooks in
// place (the two classes have the same size: a vtable pointer), and uninstall() turns it back.

#include <new>

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {

struct FakeCUDAHooks final : at::CUDAHooksInterface {
  void init() const override {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasCUDART() const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  c10::DeviceIndex current_device() const override { return 0; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  bool isPinnedPtr(const void*) const override { return false; }
};

static_assert(sizeof(FakeCUDAHooks) == sizeof(at::CUDAHooksInterface),
              "FakeCUDAHooks must fit in place of the stub hooks object");

const c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_guard;

at::CUDAHooksInterface* hooks() {
  return const_cast<at::CUDAHooksInterface*>(&at::detail::getCUDAHooks());
}

}  // namespace

// 1 when fake CUDA is installed, 0 when a real CUDA library is present (nothing done).
extern "C" int flarepp_fake_cuda_install() {
  auto* h = hooks();
  if (h->hasCUDA() && dynamic_cast<FakeCUDAHooks*>(h) == nullptr) {
    return 0;
  }
  new (h) FakeCUDAHooks();
  c10::impl::DeviceGuardImplRegistrar(c10::DeviceType::CUDA, &fake_guard);
  return 1;
}

extern "C" void flarepp_fake_cuda_uninstall() {
  auto* h = hooks();
  if (dynamic_cast<FakeCUDAHooks*>(h) != nullptr) {
    new (h) at::CUDAHooksInterface();
    c10::impl::DeviceGuardImplRegistrar(c10::DeviceType::CUDA, nullptr);
  }
}
