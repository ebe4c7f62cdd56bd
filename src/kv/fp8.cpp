#include "kv/fp8.h"

#include <cmath>

namespace kvq {

namespace {

// Rounds |x| (finite, non-negative) to the nearest representable value of a minifloat with
// `mbits` mantissa bits and exponent bias `bias` (ties to even), and returns the code without
// the sign bit, saturating to `max_code`. Works in double so that |x| / quantum is exact.
uint8_t minifloat_encode_abs(double a, int mbits, int bias, double max_val, uint8_t max_code) {
  if (a == 0) return 0;
  int e;
  std::frexp(a, &e);              // a = f * 2^e, f in [0.5, 1): floor(log2 a) = e - 1
  const int emin = 1 - bias;      // exponent of the smallest normal
  const int E = e - 1 < emin ? emin : e - 1;
  const double quantum = std::ldexp(1.0, E - mbits);
  double r = std::nearbyint(a / quantum);  // default rounding mode: to nearest, ties to even
  if (r * quantum > max_val) return max_code;
  const double one = std::ldexp(1.0, mbits);
  int exp_field, mant;
  if (r < one) {  // only possible at E == emin: a subnormal (or zero)
    exp_field = 0;
    mant = int(r);
  } else if (r >= 2 * one) {  // rounded up into the next binade
    exp_field = E + 1 + bias;
    mant = 0;
  } else {
    exp_field = E + bias;
    mant = int(r - one);
  }
  return uint8_t((exp_field << mbits) | mant);
}

struct Tables {
  float e4m3[256];
  float e5m2[256];
  Tables() {
    for (int c = 0; c < 256; ++c) {
      const double sign = (c & 0x80) ? -1.0 : 1.0;
      {
        const int e = (c >> 3) & 0xf, m = c & 7;
        double v;
        if (e == 15 && m == 7) v = NAN;
        else if (e == 0) v = std::ldexp(m, -9);  // m/8 * 2^(1-7)
        else v = std::ldexp(8 + m, e - 7 - 3);
        e4m3[c] = float(sign * v);
      }
      {
        const int e = (c >> 2) & 0x1f, m = c & 3;
        double v;
        if (e == 31) v = m ? NAN : INFINITY;
        else if (e == 0) v = std::ldexp(m, -16);  // m/4 * 2^(1-15)
        else v = std::ldexp(4 + m, e - 15 - 2);
        e5m2[c] = float(sign * v);
      }
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

uint8_t fp8_e4m3_from_f32(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return uint8_t(sign | 0x7f);
  if (std::isinf(x)) return uint8_t(sign | 0x7e);
  return uint8_t(sign | minifloat_encode_abs(std::fabs(double(x)), 3, 7, 448.0, 0x7e));
}

uint8_t fp8_e5m2_from_f32(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  if (std::isnan(x)) return uint8_t(sign | 0x7f);
  if (std::isinf(x)) return uint8_t(sign | 0x7c);
  return uint8_t(sign | minifloat_encode_abs(std::fabs(double(x)), 2, 15, 57344.0, 0x7b));
}

float fp8_e4m3_to_f32(uint8_t c) { return tables().e4m3[c]; }
float fp8_e5m2_to_f32(uint8_t c) { return tables().e5m2[c]; }
const float* fp8_e4m3_table() { return tables().e4m3; }
const float* fp8_e5m2_table() { return tables().e5m2; }

}  // namespace kvq
