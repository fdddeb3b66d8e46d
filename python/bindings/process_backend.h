// The process's default backend, chosen by the environment: ZEROCORE_BACKEND
// unset, empty or "cpu" is the plain CPU backend (default_cpu_backend());
// "checking" or "checking:<seed>" is a CheckingCpuBackend (a test switch:
// every engine on the CPU that is given no backend of its own runs on it, so
// its collectives, their waits, the schedules' slots and the stores' buffers
// are checked, and a violation raises StreamOrderError where it happens).
// Python reaches it as zerocore._native.process_backend(); the engine picks
// it for a module on the CPU (zerocore/runtime/devices.py). One per process, made
// when first asked for and never destroyed (queues may outlive module
// teardown): forked ranks each make their own, or inherit one made before
// the fork, which has no threads of its own yet (a stream's thread starts
// with its first work).
#pragma once
#include "bound_backend.h"

namespace zerocore::bindings {

BoundBackend& process_backend();

}  // namespace zerocore::bindings
