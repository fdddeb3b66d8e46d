// A few doubles the device writes and the host reads: the gradient norm,
// the overflow flag. The host (or a host collective: the step's exchange,
// whose row is a mailbox) reads a slot only after an event recorded after
// the write was waited for; the step's one blocking synchronisation is
// that exchange's. Lives in pinned host memory, so on CUDA a kernel (or an
// async copy) writes it without a synchronous copy.
#pragma once
#include <memory>
#include <string>

#include "zerocore/backend/memory.h"
#include "zerocore/backend/stream.h"

namespace zerocore {

class Backend;

class Mailbox {
 public:
  // `backend` must outlive the mailbox.
  Mailbox(Backend& backend, int slots, const std::string& name);

  int slots() const { return slots_; }
  // Work that writes a slot holds this, so the memory outlives the work.
  const std::shared_ptr<Buffer>& buffer() const { return buffer_; }
  // Where a kernel writes slot `i` (its Access, for the checker).
  double* slot(int i) const;
  Access write_access(int i) const;
  // The host reads slot `i` (a declared host access): the checking backend
  // raises if the host did not wait for the write.
  double read(int i) const;
  // The host writes slot `i` (a declared host access): the checking
  // backend raises if the host did not wait for a reader of it.
  void write(int i, double value);

 private:
  Backend& backend_;
  int slots_;
  std::shared_ptr<Buffer> buffer_;
};

}  // namespace zerocore
