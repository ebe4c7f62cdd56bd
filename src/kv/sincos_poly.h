// Coefficients of the vector sincos of the KVQuant kernels (kvquant_sincos_avx2 / _avx512), one
// table for every ISA: the angle x is reduced by n pi/2 (pi/2 split in three parts, so that each
// n * part is exact inside an FMA) to |r| <= pi/4, where the Taylor series below, evaluated by
// Horner in r^2 from the first entry, leave terms under 1e-17.
#pragma once

namespace kvq {

inline constexpr double kSincosTwoOverPi = 0.6366197723675814;
inline constexpr double kSincosHalfPi[3] = {1.5707963267948966, 6.123233995736766e-17, -1.4973849048591698e-33};
// sin r = r + r^3 P(r^2), P = the entries from 1/17! down to -1/3!
inline constexpr double kSinTaylor[8] = {1.0 / 355687428096000.0, -1.0 / 1307674368000.0, 1.0 / 6227020800.0,
                                         -1.0 / 39916800.0,       1.0 / 362880.0,          -1.0 / 5040.0,
                                         1.0 / 120.0,             -1.0 / 6.0};
// cos r = 1 + r^2 Q(r^2), Q = the entries from 1/16! down to -1/2
inline constexpr double kCosTaylor[8] = {1.0 / 20922789888000.0, -1.0 / 87178291200.0, 1.0 / 479001600.0,
                                         -1.0 / 3628800.0,       1.0 / 40320.0,        -1.0 / 720.0,
                                         1.0 / 24.0,             -0.5};

}  // namespace kvq
