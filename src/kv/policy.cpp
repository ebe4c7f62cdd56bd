#include "kv/policy.h"

#include "kvq/kv_format.h"

namespace kvq {

KvPolicy kv_policy_uniform(const std::string& format, int n_layer) {
  const KvFormatDesc& d = kv_format_find(format);
  KvPolicy p;
  p.name = d.name;
  p.layers.assign(size_t(n_layer), KvLayerFormat{d.k_codec, d.v_codec});
  return p;
}

}  // namespace kvq
