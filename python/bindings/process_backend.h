// The backend the engine's native objects run on in this process, chosen by
// the environment: ZEROCORE_BACKEND unset, empty or "cpu" is the plain CPU
// backend; "checking" or "checking:<seed>" is a CheckingCpuBackend (a test
// switch: every comm queue's collectives, their waits and the schedules'
// slots are checked, and a violation raises StreamOrderError where it
// happens). One per process, made when first asked for: forked ranks each
// make their own (a backend made before the fork has no threads of its
// own, since comm queues only name their streams).
#pragma once
#include "zerocore/backend/checking_backend.h"

namespace zerocore::bindings {

Backend& process_backend();
// The process backend's checker, or null on the plain backend.
CheckingCpuBackend* process_checker();

}  // namespace zerocore::bindings
