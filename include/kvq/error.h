// kvq::Error: what kvq throws for a caller's mistake (an unknown format name, a bad parameter or
// calibration, a block size or token range outside a head block, a head index outside the codec's
// heads), with a message that says what is valid. Internal invariants abort instead.
#pragma once
#include <stdexcept>

namespace kvq {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace kvq
