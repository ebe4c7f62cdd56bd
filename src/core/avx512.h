// Included by *_avx512.cpp files instead of <immintrin.h>. GCC 12's AVX-512 headers read
// _mm512_undefined_* values (in _mm512_reduce_* and some conversions), which -Wuninitialized
// flags, and warnings are errors here. Diagnostic pragmas hold from this point to the end of the
// including file, so the warnings stay off for these files only.
#pragma once
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)  // clang has no such warning (and -Werror rejects unknown names)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
