#include "dlpack_tensor.h"

#include <memory>
#include <string>
#include <vector>

#include "zerocore/error.h"

namespace nb = nanobind;

namespace zerocore::bindings {

namespace {

DType dtype_from_dlpack(const nb::dlpack::dtype& dt, const char* name) {
  if (dt.lanes == 1) {
    if (dt.code == uint8_t(nb::dlpack::dtype_code::Float) && dt.bits == 32) return DType::kFloat32;
    if (dt.code == uint8_t(nb::dlpack::dtype_code::Float) && dt.bits == 16) return DType::kFloat16;
    if (dt.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16) return DType::kBFloat16;
    // int64: Config(deterministic=True)'s exact grad sums, for integer adds
    // and collectives only (every float kernel refuses it), so not offered
    // in the message below.
    if (dt.code == uint8_t(nb::dlpack::dtype_code::Int) && dt.bits == 64) return DType::kInt64;
    // Bytes: int40 sums, n x 5 of them (tensor_to_ndarray), checked by the caller.
    if (dt.code == uint8_t(nb::dlpack::dtype_code::UInt) && dt.bits == 8) return DType::kInt40;
  }
  throw TypeMismatch(std::string(name) + " must be float32, bfloat16 or float16 (DLPack type code " +
                     std::to_string(dt.code) + ", " + std::to_string(dt.bits) + " bits)");
}

nb::dlpack::dtype dtype_to_dlpack(DType t) {
  switch (t) {
    case DType::kFloat32: return nb::dtype<float>();
    case DType::kFloat16: return {uint8_t(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::kBFloat16: return {uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case DType::kInt64: return nb::dtype<int64_t>();
    case DType::kInt40: return nb::dtype<uint8_t>();  // its bytes: torch has no 40-bit integer
  }
  return nb::dtype<float>();
}

bool is_c_contiguous(const nb::ndarray<>& a) {
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= int64_t(a.shape(i));
  }
  return true;
}

// Releases a borrowed DLPack view; the GIL is needed because that may drop
// the last reference to a Python object. After interpreter shutdown the view
// is left to the OS.
void release_ndarray(void* p) {
  if (!Py_IsInitialized()) return;
  nb::gil_scoped_acquire gil;
  delete static_cast<nb::ndarray<>*>(p);
}

}  // namespace

Tensor tensor_from_dlpack(nb::handle obj, const char* name) {
  nb::ndarray<> arr;
  if (!nb::try_cast(obj, arr)) {
    // Repeat the conversion for its own error (e.g. torch refusing to export
    // a tensor that requires grad) when the object speaks DLPack at all.
    std::string why;
    if (nb::hasattr(obj, "__dlpack__")) {
      try {
        obj.attr("__dlpack__")();
      } catch (const nb::python_error& e) {
        why = std::string(": ") + e.what();
      }
    }
    throw TypeMismatch(std::string(name) + " must be a tensor or array supporting DLPack, got " +
                       nb::type_name(obj.type()).c_str() + why);
  }
  const DType dtype = dtype_from_dlpack(arr.dtype(), name);
  if (!is_c_contiguous(arr)) {
    throw InvalidArgument(std::string(name) + " must be contiguous (call .contiguous() first)");
  }
  Device device;
  if (arr.device_type() == nb::device::cuda::value) {
    device = Device{DeviceType::kCUDA, int(arr.device_id())};
  } else if (arr.device_type() != nb::device::cpu::value) {
    throw TypeMismatch(std::string(name) + " must be on the CPU or a CUDA device (DLPack device type " +
                       std::to_string(arr.device_type()) + ")");
  }
  std::vector<int64_t> shape(arr.ndim());
  for (size_t i = 0; i < arr.ndim(); ++i) shape[i] = int64_t(arr.shape(i));
  if (dtype == DType::kInt40) {  // n int40 sums cross as n x 5 bytes
    if (shape.size() != 2 || shape[1] != 5) {
      throw TypeMismatch(std::string(name) + ": uint8 elements are int40 sums, an n x 5 array of bytes");
    }
    shape.pop_back();
  }
  void* data = arr.data();
  std::shared_ptr<void> owner(new nb::ndarray<>(std::move(arr)), release_ndarray);
  return Tensor(data, dtype, device, std::move(shape), std::move(owner));
}

Tensor optional_tensor_from_dlpack(nb::handle obj, const char* name) {
  return obj.is_none() ? Tensor() : tensor_from_dlpack(obj, name);
}

nb::ndarray<nb::array_api> tensor_to_ndarray(const Tensor& t) {
  auto* keep = new std::shared_ptr<void>(t.owner());
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<std::shared_ptr<void>*>(p); });
  std::vector<size_t> shape(t.shape().begin(), t.shape().end());
  if (t.dtype() == DType::kInt40) shape.push_back(5);  // its bytes, an element's 5 a row
  const bool cuda = t.device().type == DeviceType::kCUDA;
  return nb::ndarray<nb::array_api>(t.data(), shape.size(), shape.data(), owner, nullptr, dtype_to_dlpack(t.dtype()),
                       cuda ? nb::device::cuda::value : nb::device::cpu::value, cuda ? t.device().index : 0);
}

void register_error_translators() {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const TypeMismatch& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    }
  });
}

}  // namespace zerocore::bindings
