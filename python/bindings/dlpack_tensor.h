// Conversions between zerocore::Tensor and DLPack objects (torch tensors,
// numpy arrays, ...) through nanobind's ndarray, zero-copy both ways. Shared
// by the CPU (_native) and CUDA (_cuda) extension modules.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "zerocore/tensor.h"

namespace zerocore::bindings {

// Wraps the memory of any DLPack-capable object. The object stays alive as
// long as the returned tensor (or any view of it) does. Raises TypeError for
// an unsupported dtype and ValueError for a non-contiguous array; `name`
// is used in those messages.
Tensor tensor_from_dlpack(nanobind::handle obj, const char* name);

// Like tensor_from_dlpack, but None gives an undefined Tensor.
Tensor optional_tensor_from_dlpack(nanobind::handle obj, const char* name);

// A nanobind ndarray (which implements __dlpack__) over the tensor's memory;
// it keeps the tensor's owner alive.
nanobind::ndarray<nanobind::array_api> tensor_to_ndarray(const Tensor& t);

// Registers the translation of zerocore errors into Python exceptions.
void register_error_translators();

}  // namespace zerocore::bindings
