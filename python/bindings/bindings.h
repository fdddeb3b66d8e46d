// One function per bound concern; module.cpp calls them all.
#pragma once
#include <nanobind/nanobind.h>

#include <string>

#include "zerocore/dtype.h"

namespace zerocore::bindings {
void bind_tensor(nanobind::module_& m);
void bind_backend(nanobind::module_& m);
void bind_layout(nanobind::module_& m);
void bind_cpu(nanobind::module_& m);
void bind_optim(nanobind::module_& m);
void bind_comm(nanobind::module_& m);
void bind_schedule(nanobind::module_& m);
void bind_store(nanobind::module_& m);
void bind_step(nanobind::module_& m);
void bind_engine(nanobind::module_& m);
// Only in a build with CUDA (ZEROCORE_WITH_CUDA).
void bind_cuda_backend(nanobind::module_& m);
// Only in a build with the native NCCL transport (ZEROCORE_WITH_NCCL).
void bind_nccl(nanobind::module_& m);

// "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16".
DType parse_dtype(const std::string& name);
}  // namespace zerocore::bindings
