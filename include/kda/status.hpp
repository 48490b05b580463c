// Status: the result of every public operation. A failed status carries a message that names
// the offending argument, the expected value and the actual value. No output is written when
// an operation fails validation.
#pragma once

#include <string>
#include <utility>

namespace kda {

class Status {
 public:
  Status() = default;
  static Status ok_status() { return Status(); }
  static Status error(std::string message) {
    Status s;
    s.ok_ = false;
    s.message_ = std::move(message);
    return s;
  }
  bool ok() const { return ok_; }
  const std::string& message() const { return message_; }

 private:
  bool ok_ = true;
  std::string message_;
};

}  // namespace kda

#define KDA_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::kda::Status kda_status_ = (expr);        \
    if (!kda_status_.ok()) return kda_status_; \
  } while (0)
