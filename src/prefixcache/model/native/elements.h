// What the kernels here share about their elements: a float32, bfloat16 or float16 element read as float32
// (exact for all three).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace prefixcache_native {

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

}  // namespace prefixcache_native
