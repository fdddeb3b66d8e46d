// A backend as Python holds it. zerocore._native.Backend is the base of every
// bound backend class (CpuBackend, CheckingBackend and, in a build with CUDA,
// CudaBackend), so the runtime objects built from Python (comm queues,
// partition stores, the offload optimizer) take any of them, and each holds
// a reference to the one it was made on: a backend outlives what runs on it.
#pragma once
#include <nanobind/nanobind.h>

#include <memory>
#include <string>

#include "zerocore/backend/backend.h"

namespace zerocore::bindings {

// "host_pageable", "host_pinned", "device"; "read", "write".
MemoryKind parse_kind(const std::string& s);
AccessMode parse_mode(const std::string& s);

class BoundBackend {
 public:
  virtual ~BoundBackend() = default;
  virtual Backend& get() const = 0;
};

// A backend of type B: one Python made, closed (its streams drained) when
// dropped, with the GIL released (work on its streams may drop the last
// reference to a torch tensor, which takes the GIL); or the process's
// (process_backend.h), which is never closed.
template <class B>
class HeldBackend final : public BoundBackend {
 public:
  explicit HeldBackend(std::unique_ptr<B> backend) : owned_(std::move(backend)), backend_(owned_.get()) {}
  explicit HeldBackend(B& process) : backend_(&process) {}
  ~HeldBackend() override {
    if (!owned_) return;
    nanobind::gil_scoped_release released;
    owned_.reset();
  }
  HeldBackend(const HeldBackend&) = delete;
  HeldBackend& operator=(const HeldBackend&) = delete;
  B& get() const override { return *backend_; }

 private:
  std::unique_ptr<B> owned_;
  B* backend_;
};

}  // namespace zerocore::bindings
