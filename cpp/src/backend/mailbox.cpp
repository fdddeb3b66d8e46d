#include "zerocore/backend/mailbox.h"

#include <string>

#include "zerocore/backend/backend.h"
#include "zerocore/error.h"

namespace zerocore {

Mailbox::Mailbox(Backend& backend, int slots, const std::string& name)
    : backend_(backend),
      slots_(slots),
      buffer_(backend.allocate(MemoryKind::kHostPinned, size_t(slots < 0 ? 0 : slots) * sizeof(double), name, true)) {}

double* Mailbox::slot(int i) const {
  if (i < 0 || i >= slots_) {
    throw InvalidArgument("mailbox '" + buffer_->name() + "' has " + std::to_string(slots_) + " slots, not slot " +
                          std::to_string(i));
  }
  return static_cast<double*>(buffer_->data()) + i;
}

Access Mailbox::write_access(int i) const { return Access{slot(i), sizeof(double), AccessMode::kWrite}; }

double Mailbox::read(int i) const {
  const double* p = slot(i);
  backend_.declare_host_access(Access{p, sizeof(double), AccessMode::kRead},
                               "host read of mailbox slot " + std::to_string(i));
  return *p;
}

void Mailbox::write(int i, double value) {
  double* p = slot(i);
  backend_.declare_host_access(write_access(i), "host write of mailbox slot " + std::to_string(i));
  *p = value;
}

}  // namespace zerocore
