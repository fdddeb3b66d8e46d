// Errors of the public C++ API. Each names what is wrong and how to fix it;
// the Python bindings map them to ValueError / TypeError / MemoryError.
#pragma once
#include <new>
#include <stdexcept>
#include <string>

namespace zerocore {

// A value is out of range or shapes/sizes disagree (Python: ValueError).
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A tensor has a dtype or device the operation does not take (Python: TypeError).
class TypeMismatch : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Two conflicting accesses to a buffer from different streams with no wait
// ordering them, found by the checking backend (backend/checking_backend.h).
// Here so that the runtime can catch it without depending on the checker.
class StreamOrderError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace zerocore
