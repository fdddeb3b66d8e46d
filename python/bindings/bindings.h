// One function per bound concern; module.cpp calls them all.
#pragma once
#include <nanobind/nanobind.h>

namespace zerocore::bindings {
void bind_tensor(nanobind::module_& m);
void bind_layout(nanobind::module_& m);
void bind_cpu(nanobind::module_& m);
void bind_optim(nanobind::module_& m);
void bind_comm(nanobind::module_& m);
}  // namespace zerocore::bindings
