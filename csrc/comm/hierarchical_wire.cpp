// The quantized wire of HierarchicalEngine (OpContext::quantization, core/quantize.h): which ops' inter-host bytes
// travel as block-quantized records (floating all-gathers with the op's `gather` format, floating sums with its
// `reduce` format; nothing else), and Wire, which codes one op's runs of values at each exchange.
//
// Promise: an exact format changes nothing (the values are what goes on the link and where it lands); a record is
// decoded into the values' place only once it has arrived, and a sender that asks for it holds what the receivers
// decode, so every rank ends with the same bits.
#include "comm/hierarchical_internal.h"

namespace shardkit::comm::hierarchical {

core::QuantFormat gather_wire(const OpContext& op, const at::Tensor& data) {
  return core::quantizable(core_dtype(data)) ? op.quantization.gather : core::QuantFormat{};
}

core::QuantFormat reduce_wire(const OpContext& op, const at::Tensor& data, core::ReduceOp reduce) {
  return core::quantizable(core_dtype(data)) && reduce == core::ReduceOp::Sum ? op.quantization.reduce
                                                                             : core::QuantFormat{};
}

at::Tensor Wire::outgoing(const at::Tensor& values, bool hold_what_is_sent) const {
  if (exact()) return values;
  at::Tensor record = landing(values);
  core::quantize(values.data_ptr(), numel_of(values), dtype_, format_, record.data_ptr());
  if (hold_what_is_sent) core::dequantize(record.data_ptr(), numel_of(values), dtype_, format_, values.data_ptr());
  return record;
}

at::Tensor Wire::landing(const at::Tensor& values) const {
  if (exact()) return values;
  return at::empty({static_cast<int64_t>(core::quantized_bytes(numel_of(values), format_))}, at::kByte);
}

void Wire::arrived(const at::Tensor& landing, const at::Tensor& values) const {
  if (!exact()) core::dequantize(landing.data_ptr(), numel_of(values), dtype_, format_, values.data_ptr());
}

}  // namespace shardkit::comm::hierarchical
