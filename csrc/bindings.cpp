// The one Python module of shardkit, `shardkit._C`. Glue only: no logic, no validation.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>

#include "comm/backend.h"
#include "comm/failure_notices.h"
#include "comm/tensor_memory.h"
#include "compress/hooks.h"
#include "core/collective_identity.h"
#include "core/crc32c.h"
#include "core/flat_layout.h"
#include "core/liveness.h"
#include "core/quantize.h"
#include "core/reduce.h"
#include "core/shm_segment.h"
#include "core/state_file.h"
#include "core/rename_exchange.h"
#include "ddp/reducer.h"
#include "fsdp/flat_param.h"
#ifdef SHARDKIT_WITH_CUDA
#include "comm/nccl/nccl_info.h"
#include "cuda/cuda_ops.h"
#endif

namespace py = pybind11;

namespace {

using shardkit::compress::FuturePtr;
using shardkit::compress::PowerSGDState;

// A C++ hook's Future as the torch.futures.Future a Python comm hook returns.
template <typename Hook>
py::object run_hook_for_python(Hook hook) {
  FuturePtr future;
  {
    py::gil_scoped_release no_gil;
    future = hook();
  }
  return torch::jit::toPyObject(c10::IValue(future));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "shardkit C++ extension";
  // Our backend derives from torch's c10d Backend; its Python type must be registered first.
  py::module_::import("torch.distributed");

  using shardkit::comm::ProcessGroupShardkit;
  py::class_<ProcessGroupShardkit::Config>(m, "BackendConfig")
      .def(py::init<>())
      .def_readwrite("shm_name", &ProcessGroupShardkit::Config::shm_name)
      .def_readwrite("slot_bytes", &ProcessGroupShardkit::Config::slot_bytes)
      .def_readwrite("processes_on_machine", &ProcessGroupShardkit::Config::processes_on_machine)
      .def_readwrite("timeout", &ProcessGroupShardkit::Config::timeout)
      .def_readwrite("local_rank", &ProcessGroupShardkit::Config::local_rank)
      .def_readwrite("local_size", &ProcessGroupShardkit::Config::local_size)
      .def_readwrite("num_hosts", &ProcessGroupShardkit::Config::num_hosts)
      .def_readwrite("host_index", &ProcessGroupShardkit::Config::host_index)
      .def_readwrite("host_of", &ProcessGroupShardkit::Config::host_of)
      .def_readwrite("local_of", &ProcessGroupShardkit::Config::local_of)
      .def_readwrite("global_ranks", &ProcessGroupShardkit::Config::global_ranks)
      .def_readwrite("pids", &ProcessGroupShardkit::Config::pids)
      .def_readwrite("rails", &ProcessGroupShardkit::Config::rails)
      .def_readwrite("isolated", &ProcessGroupShardkit::Config::isolated)
      .def_readwrite("p2p_direct_bytes", &ProcessGroupShardkit::Config::p2p_direct_bytes)
      .def_readwrite("p2p_direct_read", &ProcessGroupShardkit::Config::p2p_direct_read);
  m.attr("ABORT_KEY") = shardkit::comm::kAbortKey;
  m.def("describe_identity", &shardkit::core::describe_identity, py::arg("identity"),
        "What a collective identity stands for in this process ('FSDP unit ...', or that it is unknown).");
  m.def("identity_of", &shardkit::core::identity_of, py::arg("description"), py::arg("detail") = "",
        "The collective identity of the part of a model `description` names (hashed with `detail`).");
  m.def("exchange_current_identity", &shardkit::core::exchange_current_identity, py::arg("identity"),
        "Makes `identity` this thread's collective identity; returns the one it replaces.");
  using shardkit::core::InterHostQuantization;
  using shardkit::core::QuantBits;
  using shardkit::core::QuantFormat;
  py::class_<QuantFormat>(m, "QuantFormat")
      .def(py::init([](int bits, uint32_t block) { return QuantFormat{static_cast<QuantBits>(bits), block}; }),
           py::arg("bits") = 0, py::arg("block") = 0)
      .def_property_readonly("bits", [](const QuantFormat& f) { return static_cast<int>(f.bits); })
      .def_readonly("block", &QuantFormat::block)
      .def("__repr__", &QuantFormat::describe);
  py::class_<InterHostQuantization>(m, "InterHostQuantization")
      .def(py::init([](QuantFormat gather, QuantFormat reduce) { return InterHostQuantization{gather, reduce}; }),
           py::arg("gather") = QuantFormat{}, py::arg("reduce") = QuantFormat{})
      .def_readonly("gather", &InterHostQuantization::gather)
      .def_readonly("reduce", &InterHostQuantization::reduce);
  m.def("exchange_current_quantization", &shardkit::core::exchange_current_quantization, py::arg("quantization"),
        "Makes `quantization` the inter-host wire format of this thread's collectives; returns the one it replaces.");
  m.def("quantized_bytes", &shardkit::core::quantized_bytes, py::arg("count"), py::arg("format"),
        "Bytes of the record of `count` elements in `format` (core/quantize.h).");
  m.def("remove_segment_name", &shardkit::core::remove_segment_name, py::arg("name"),
        "Removes a shared-memory segment's name from /dev/shm if it is there (a failed start-up's cleanup).");
  m.def("process_exited", &shardkit::core::process_exited, py::arg("pid"),
        "Whether the process `pid` of this machine has exited (gone, or a zombie); False for pid <= 0.");
  m.def("dump_traces", &shardkit::comm::TraceRegistry::dump, py::arg("reason"),
        py::call_guard<py::gil_scoped_release>(),
        "Writes every shardkit group's flight recorder into this rank's trace file (comm/trace.h); returns its path.");
  m.def("dump_traces_to", &shardkit::comm::TraceRegistry::dump_to, py::arg("path"), py::arg("reason"),
        py::call_guard<py::gil_scoped_release>(), "As dump_traces, into `path`.");
  m.def("trace_cost_ns", &shardkit::comm::trace_cost_ns, py::arg("iterations"), py::arg("capacity"),
        "Nanoseconds per op that recording costs, measured alone on a private ring (benchmarks/trace.py).");
  m.def("trace_dir", &shardkit::comm::trace_dir,
        "Where trace files go: SHARDKIT_TRACE_DIR, else <temp dir>/shardkit_traces/<job> (comm/trace.h).");
  m.def("trace_signal_handler_installed", &shardkit::comm::TraceRegistry::install_signal_handler,
        "Installs shardkit's SIGUSR1 handler where the process has none (idempotent); whether shardkit's is the one.");
  py::class_<ProcessGroupShardkit, c10d::Backend, c10::intrusive_ptr<ProcessGroupShardkit>>(m, "ProcessGroupShardkit")
      .def(py::init([](int rank, int size, const ProcessGroupShardkit::Config& config,
                       c10::intrusive_ptr<c10d::Store> store, c10::intrusive_ptr<c10d::Backend> fallback,
                       c10::intrusive_ptr<c10d::Backend> inter_host, c10::intrusive_ptr<c10d::Store> job_store) {
             return c10::make_intrusive<ProcessGroupShardkit>(rank, size, config, std::move(store),
                                                              std::move(job_store), std::move(fallback),
                                                              std::move(inter_host));
           }),
           py::arg("rank"), py::arg("size"), py::arg("config"), py::arg("store"), py::arg("fallback"),
           py::arg("inter_host") = nullptr, py::arg("job_store") = nullptr,
           py::call_guard<py::gil_scoped_release>())
      // torch's ProcessGroup answers sequence numbers for its built-in backends only; this asks ours.
      .def("_get_sequence_number_for_group", &ProcessGroupShardkit::getSequenceNumberForGroup)
      .def("allreduce_now",
           [](ProcessGroupShardkit& self, at::Tensor tensor, const c10d::ReduceOp& op, double timeout_s) {
             self.allreduce_now(tensor, op, timeout_s > 0 ? std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1e3))
                                                         : c10d::kUnsetTimeout);
           },
           py::arg("tensor"), py::arg("op"), py::arg("timeout_s") = 0.0, py::call_guard<py::gil_scoped_release>(),
           "A synchronous allreduce on the calling thread, without a Work (shardkit.all_reduce_).")
      .def("shared_buffer",
           [](ProcessGroupShardkit& self, int64_t nbytes) -> std::pair<at::Tensor, std::string> {
             std::string refused;
             at::Tensor buffer = self.shared_buffer(nbytes, &refused);
             return {buffer, refused};
           },
           py::arg("nbytes"), py::call_guard<py::gil_scoped_release>(),
           "Collective: (nbytes of host memory as a uint8 tensor from which allreduce and reduce_scatter_tensor "
           "read their input zero-copy, ''), or (None, why) where /dev/shm has not the room, or (None, '') where "
           "the group spans hosts. shardkit.backend.shared_buffer() warns where there is none.")
      .def("compare_identities_across_hosts", &ProcessGroupShardkit::compare_identities_across_hosts,
           "From the next op on, host leaders compare every op's collective identity before its inter-host steps.")
      .def("job_store", &ProcessGroupShardkit::job_store, "The Store where this job's deaths are recorded.")
      .def("abort_with", &ProcessGroupShardkit::abort_with, py::arg("reason"), py::call_guard<py::gil_scoped_release>(),
           "Ends the group now, from any thread: the op in flight and every later one fail with `reason`; the "
           "process's other groups are untouched. shutdown_now() still ends its threads.")
      .def("first_failure", &ProcessGroupShardkit::first_failure,
           "The error message of the group's first failed op, or None while none failed.")
      .def("shutdown_now", &ProcessGroupShardkit::shutdown, py::call_guard<py::gil_scoped_release>(),
           "destroy_process_group()'s shutdown (idempotent), the GIL released while the worker finishes what is "
           "queued: what may still drop Python objects there can take it.")
      .def("inter_host_bytes", &ProcessGroupShardkit::inter_host_bytes,
           "Payload bytes this rank has sent to other hosts in point-to-point exchanges (every rails op, every "
           "reduce-scatter, every quantized op; not the leader scheme's exact gloo collectives).")
      .def("shared_ops", &ProcessGroupShardkit::shared_ops,
           "Collectives (allreduce, reduce_scatter) that read their input from a shared buffer.")
      .def("direct_p2p_bytes", &ProcessGroupShardkit::direct_p2p_bytes,
           "Payload bytes this rank has received by reading a peer's memory (point-to-point's direct route).")
      .def("cuda_route", &ProcessGroupShardkit::cuda_route,
           "What carries this group's CUDA collectives: 'nccl', 'host shared memory: <why>', or why none does.");

  using shardkit::ddp::Reducer;
  py::class_<Reducer, std::shared_ptr<Reducer>>(m, "Reducer")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       c10::intrusive_ptr<c10d::ProcessGroup> process_group, size_t bucket_bytes_cap,
                       size_t first_bucket_bytes, bool find_unused_parameters, bool gradient_as_bucket_view,
                       bool shard_gradients, py::object shared_buffer) {
             Reducer::Options options;
             if (!shared_buffer.is_none()) {
               // `shared_buffer(nbytes)` -> uint8 tensor or None, a Python function (shardkit.backend.shared_buffer:
               // it warns where there is none), called with the GIL taken here: the reducer calls it from Python
               // calls that released it. That function's collective releases the GIL again while it waits.
               auto provide = std::shared_ptr<py::object>(new py::object(std::move(shared_buffer)), [](py::object* f) {
                 py::gil_scoped_acquire gil;
                 delete f;
               });
               options.shared_buffer = [provide](int64_t bytes) {
                 py::gil_scoped_acquire gil;
                 py::object memory = (*provide)(bytes);
                 return memory.is_none() ? at::Tensor() : memory.cast<at::Tensor>();
               };
             }
             options.bucket_bytes_cap = bucket_bytes_cap;
             options.first_bucket_bytes = first_bucket_bytes;
             options.find_unused_parameters = find_unused_parameters;
             options.gradient_as_bucket_view = gradient_as_bucket_view;
             options.shard_gradients = shard_gradients;
             return std::make_shared<Reducer>(std::move(params), std::move(names), std::move(process_group), options);
           }),
           py::arg("params"), py::arg("names"), py::arg("process_group"), py::arg("bucket_bytes_cap"),
           py::arg("first_bucket_bytes"), py::arg("find_unused_parameters"), py::arg("gradient_as_bucket_view"),
           py::arg("shard_gradients") = false, py::arg("shared_buffer") = py::none())
      .def("prepare_for_backward", &Reducer::prepare_for_backward, py::call_guard<py::gil_scoped_release>())
      .def("set_divisor_for_this_backward", &Reducer::set_divisor_for_this_backward, py::arg("ranks"))
      // Released: a Python comm hook run on the zero buckets takes the GIL from the hook's thread.
      .def("shadow_backward", &Reducer::shadow_backward, py::call_guard<py::gil_scoped_release>())
      .def("register_comm_hook",
           [](Reducer& reducer, py::object state, py::object hook) {
             reducer.register_comm_hook(std::make_unique<c10d::PythonCommHook>(std::move(state), std::move(hook)));
           },
           py::arg("state"), py::arg("hook"))
      .def("register_native_comm_hook",
           [](Reducer& reducer, const std::string& kind, std::shared_ptr<PowerSGDState> state,
              c10::intrusive_ptr<c10d::ProcessGroup> group) {
             reducer.register_comm_hook(shardkit::compress::make_native_hook(kind, std::move(state), std::move(group)));
           },
           py::arg("kind"), py::arg("state"), py::arg("group"))
      .def("bucket_indices", &Reducer::bucket_indices)
      .def("bucket_buffers", &Reducer::bucket_buffers)
      .def("zero_copy", &Reducer::zero_copy)
      .def("set_engine_average", &Reducer::set_engine_average, py::arg("allowed"))
      .def("set_quantization", &Reducer::set_quantization, py::arg("quantization"))
      .def("load_bucket_indices", &Reducer::load_bucket_indices, py::arg("assignment"),
           py::call_guard<py::gil_scoped_release>())
      .def("set_gradient_shards", &Reducer::set_gradient_shards, py::arg("layouts"), py::arg("shards"),
           py::arg("space"), py::arg("slot"))
      .def("shard_gradient_defined", &Reducer::shard_gradient_defined)
      .def("clear_gradient_shards", &Reducer::clear_gradient_shards, py::arg("set_to_none"));

  using shardkit::compress::PowerSGDOptions;
  py::class_<PowerSGDOptions>(m, "PowerSGDOptions")
      .def(py::init<>())
      .def_readwrite("matrix_approximation_rank", &PowerSGDOptions::matrix_approximation_rank)
      .def_readwrite("start_powerSGD_iter", &PowerSGDOptions::start_powerSGD_iter)
      .def_readwrite("min_compression_rate", &PowerSGDOptions::min_compression_rate)
      .def_readwrite("use_error_feedback", &PowerSGDOptions::use_error_feedback)
      .def_readwrite("warm_start", &PowerSGDOptions::warm_start)
      .def_readwrite("orthogonalization_epsilon", &PowerSGDOptions::orthogonalization_epsilon)
      .def_readwrite("random_seed", &PowerSGDOptions::random_seed)
      .def_readwrite("batch_tensors_with_same_shape", &PowerSGDOptions::batch_tensors_with_same_shape);
  py::class_<PowerSGDState::Snapshot>(m, "PowerSGDSnapshot")
      .def(py::init<>())
      .def_readwrite("iter", &PowerSGDState::Snapshot::iter)
      .def_readwrite("numel_before", &PowerSGDState::Snapshot::numel_before)
      .def_readwrite("numel_after", &PowerSGDState::Snapshot::numel_after)
      .def_readwrite("error", &PowerSGDState::Snapshot::error)
      .def_readwrite("p", &PowerSGDState::Snapshot::p)
      .def_readwrite("q", &PowerSGDState::Snapshot::q)
      .def_readwrite("rng_key", &PowerSGDState::Snapshot::rng_key)
      .def_readwrite("rng_pos", &PowerSGDState::Snapshot::rng_pos);
  py::class_<PowerSGDState, std::shared_ptr<PowerSGDState>>(m, "PowerSGDState")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, const PowerSGDOptions&>(), py::arg("process_group"),
           py::arg("options"))
      .def("powersgd_hook",
           [](PowerSGDState& state, c10d::GradBucket& bucket) {
             return run_hook_for_python([&] { return state.powersgd_hook(bucket); });
           })
      .def("batched_powersgd_hook",
           [](PowerSGDState& state, c10d::GradBucket& bucket) {
             return run_hook_for_python([&] { return state.batched_powersgd_hook(bucket); });
           })
      .def("snapshot", &PowerSGDState::snapshot, py::call_guard<py::gil_scoped_release>())
      .def("counters", &PowerSGDState::counters)
      .def("restore", &PowerSGDState::restore, py::call_guard<py::gil_scoped_release>())
      .def("set_process_group", &PowerSGDState::set_process_group)
      .def_property_readonly("process_group", &PowerSGDState::process_group);
  m.def("cast_compress_hook",
        [](c10::intrusive_ptr<c10d::ProcessGroup> group, c10d::GradBucket& bucket, at::ScalarType dtype) {
          return run_hook_for_python([&] { return shardkit::compress::cast_compress_hook(group, bucket, dtype); });
        },
        py::arg("group"), py::arg("bucket"), py::arg("dtype"));
  m.def("register_native_comm_hook_on_torch_reducer",
        [](std::shared_ptr<c10d::Reducer> reducer, const std::string& kind, std::shared_ptr<PowerSGDState> state,
           c10::intrusive_ptr<c10d::ProcessGroup> group) {
          reducer->register_comm_hook(shardkit::compress::make_native_hook(kind, std::move(state), std::move(group)));
        },
        py::arg("reducer"), py::arg("kind"), py::arg("state"), py::arg("group"));

  using shardkit::fsdp::FlatParamHandle;
  using shardkit::fsdp::GatheredBytes;
  py::class_<GatheredBytes, std::shared_ptr<GatheredBytes>>(m, "GatheredBytes")
      .def(py::init<>())
      .def_property_readonly("current", [](const GatheredBytes& b) { return b.current; })
      .def_property_readonly("peak", [](const GatheredBytes& b) { return b.peak; });
  py::class_<FlatParamHandle, std::shared_ptr<FlatParamHandle>>(m, "FlatParamHandle")
      .def(py::init([](std::vector<at::Tensor> params, py::object shard_group, py::object replicate_group, std::string label,
                       std::optional<at::ScalarType> param_dtype, std::optional<at::ScalarType> reduce_dtype,
                       std::optional<at::Device> compute_device, std::shared_ptr<GatheredBytes> gathered_bytes) {
             FlatParamHandle::Options options;
             options.label = std::move(label);
             options.param_dtype = param_dtype;
             options.reduce_dtype = reduce_dtype;
             options.compute_device = compute_device;
             options.gathered_bytes = std::move(gathered_bytes);
             auto group = [](const py::object& g) {  // None: no group
               return g.is_none() ? c10::intrusive_ptr<c10d::ProcessGroup>()
                                  : g.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
             };
             return std::make_shared<FlatParamHandle>(params, group(shard_group), group(replicate_group),
                                                      std::move(options));
           }),
           py::arg("params"), py::arg("shard_group"), py::arg("replicate_group"), py::arg("label"),
           py::arg("param_dtype") = std::nullopt, py::arg("reduce_dtype") = std::nullopt,
           py::arg("compute_device") = std::nullopt, py::arg("gathered_bytes") = nullptr)
      .def_property_readonly("layout", &FlatParamHandle::layout, py::return_value_policy::reference_internal)
      .def_property_readonly("identity", &FlatParamHandle::identity)
      .def("set_quantization", &FlatParamHandle::set_quantization, py::arg("quantization"))
      .def_property_readonly("shard", &FlatParamHandle::shard)
      .def_property_readonly("compute_dtype", &FlatParamHandle::compute_dtype)
      .def_property_readonly("reduce_dtype", &FlatParamHandle::reduce_dtype)
      .def_property_readonly("flattens_into_memory", &FlatParamHandle::flattens_into_memory)
      .def_property_readonly("offloaded", &FlatParamHandle::offloaded)
      .def_property_readonly("full_bytes", &FlatParamHandle::full_bytes)
      .def_property_readonly("unsharded", &FlatParamHandle::unsharded)
      .def_property_readonly("in_flight", &FlatParamHandle::in_flight)
      .def_property_readonly("allocated", &FlatParamHandle::allocated)
      .def_property_readonly("full_is_shard", &FlatParamHandle::full_is_shard)
      .def_property_readonly("holds_full_buffer", &FlatParamHandle::holds_full_buffer)
      .def_property_readonly("reduce_pending", &FlatParamHandle::reduce_pending)
      .def("shard_views", &FlatParamHandle::shard_views)
      .def("unshard_start", &FlatParamHandle::unshard_start, py::call_guard<py::gil_scoped_release>())
      .def("unshard_wait", &FlatParamHandle::unshard_wait, py::call_guard<py::gil_scoped_release>())
      .def("reshard", &FlatParamHandle::reshard, py::call_guard<py::gil_scoped_release>())
      .def("full_alias", &FlatParamHandle::full_alias)
      .def("views", &FlatParamHandle::views, py::arg("base"))
      .def("reduce_start", &FlatParamHandle::reduce_start, py::arg("flat_grad"), py::arg("memory") = std::nullopt,
           py::call_guard<py::gil_scoped_release>())
      .def("flatten_gradients", &FlatParamHandle::flatten_gradients, py::arg("grads"), py::arg("memory") = std::nullopt,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("reduce_input_bytes", &FlatParamHandle::reduce_input_bytes)
      .def("reduce_finish", &FlatParamHandle::reduce_finish, py::arg("params"),
           py::call_guard<py::gil_scoped_release>())
      .def("accumulate_unsynced", &FlatParamHandle::accumulate_unsynced, py::arg("flat_grad"))
      .def("gather_full_precision", &FlatParamHandle::gather_full_precision, py::call_guard<py::gil_scoped_release>())
      .def("write_back", &FlatParamHandle::write_back, py::arg("full_values"));

  using shardkit::core::FlatLayout;
  using shardkit::core::FlatPiece;
  py::class_<FlatPiece>(m, "FlatPiece")
      .def_readonly("param", &FlatPiece::param)
      .def_readonly("rank", &FlatPiece::rank)
      .def_readonly("param_begin", &FlatPiece::param_begin)
      .def_readonly("flat_begin", &FlatPiece::flat_begin)
      .def_readonly("shard_begin", &FlatPiece::shard_begin)
      .def_readonly("numel", &FlatPiece::numel)
      .def("__repr__", [](const FlatPiece& p) {
        return "FlatPiece(param=" + std::to_string(p.param) + ", rank=" + std::to_string(p.rank) +
               ", param_begin=" + std::to_string(p.param_begin) + ", flat_begin=" + std::to_string(p.flat_begin) +
               ", shard_begin=" + std::to_string(p.shard_begin) + ", numel=" + std::to_string(p.numel) + ")";
      });
  py::class_<FlatLayout>(m, "FlatLayout")
      .def(py::init<std::vector<int64_t>, int, int64_t>(), py::arg("numels"), py::arg("world"),
           py::arg("alignment") = 1)
      .def_property_readonly("world", &FlatLayout::world)
      .def_property_readonly("alignment", &FlatLayout::alignment)
      .def_property_readonly("numels", &FlatLayout::numels)
      .def_property_readonly("offsets", &FlatLayout::offsets)
      .def_property_readonly("used_numel", &FlatLayout::used_numel)
      .def_property_readonly("param_numel", &FlatLayout::param_numel)
      .def_property_readonly("shard_numel", &FlatLayout::shard_numel)
      .def_property_readonly("padded_numel", &FlatLayout::padded_numel)
      .def("rank_begin", &FlatLayout::rank_begin, py::arg("rank"))
      .def("piece", &FlatLayout::piece, py::arg("param"), py::arg("rank"))
      .def("pieces_of_rank", &FlatLayout::pieces_of_rank, py::arg("rank"))
      .def("pieces_of_param", &FlatLayout::pieces_of_param, py::arg("param"))
      .def("owned_numel", &FlatLayout::owned_numel, py::arg("rank"));

  m.def("exact_storage_alias", &shardkit::comm::exact_storage_alias, py::arg("view"),
        "The same memory as a contiguous view, with a storage of exactly its bytes that keeps the view's alive.");
  m.def("reduce_isa", &shardkit::core::reduce_isa, "Vector ISA the reduction loops dispatched to at runtime.");
  m.def(
      "crc32c",
      [](py::buffer data, uint32_t crc) {
        py::buffer_info bytes = data.request();  // PyBUF_SIMPLE: Python refuses a non-contiguous buffer
        py::gil_scoped_release no_gil;
        return shardkit::core::crc32c_extend(crc, bytes.ptr, static_cast<size_t>(bytes.size * bytes.itemsize));
      },
      py::arg("data"), py::arg("crc") = 0,
      "CRC32C of the bytes that gave `crc` followed by `data` (any contiguous buffer); crc=0 starts afresh.");
  m.def("crc32c_isa", &shardkit::core::crc32c_isa, "What crc32c runs on: 'sse4.2' or 'portable'.");
  m.def(
      "rename_exchange",
      [](const std::string& a, const std::string& b) { return shardkit::core::rename_exchange(a.c_str(), b.c_str()); },
      py::arg("a"), py::arg("b"), py::call_guard<py::gil_scoped_release>(),
      "Swaps two existing paths atomically (Linux renameat2 RENAME_EXCHANGE): 0, or the errno, nothing changed.");
  using shardkit::core::IoEngine;
  using shardkit::core::StateFile;
  py::class_<StateFile>(m, "StateFile")
      .def(py::init<std::string, size_t, bool>(), py::arg("path"), py::arg("nbytes"), py::arg("direct") = true,
           "Creates `path` (it must not exist) with `nbytes` reserved (rounded up to 4096); direct I/O where the "
           "filesystem takes it. The name is removed when the object is collected (or close()).")
      .def_property_readonly("path", &StateFile::path)
      .def_property_readonly("nbytes", &StateFile::size)
      .def_property_readonly("direct", &StateFile::direct)
      .def_property_readonly("direct_refused", &StateFile::direct_refused)
      .def("check", &StateFile::check, "Raises, naming the path, where the file was removed or truncated.");
  py::class_<IoEngine>(m, "IoEngine")
      .def(py::init<int>(), py::arg("threads"))
      .def(
          "submit",
          [](IoEngine& engine, bool write, const StateFile& file, size_t offset, const at::Tensor& buffer,
             size_t nbytes) {
            TORCH_CHECK(buffer.device().is_cpu() && buffer.is_contiguous() && nbytes <= buffer.nbytes(),
                        "IoEngine.submit: the buffer must be a contiguous CPU tensor of at least ", nbytes, " bytes");
            return engine.submit(write ? IoEngine::Kind::kWrite : IoEngine::Kind::kRead, file, offset,
                                 buffer.data_ptr(), nbytes);
          },
          py::arg("write"), py::arg("file"), py::arg("offset"), py::arg("buffer"), py::arg("nbytes"),
          "Queues a read (write=False) or write of nbytes of `buffer` at `offset`; returns its ticket. The file and "
          "the buffer must stay alive until wait() has returned for it.")
      .def(
          "wait",
          [](IoEngine& engine, uint64_t ticket, double timeout_s) {
            engine.wait(ticket, std::chrono::steady_clock::now() +
                                    std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6)));
          },
          py::arg("ticket"), py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>(),
          "Waits for a request: returns, raises its error, or raises at the deadline naming it.");
  m.def(
      "aligned_bytes",
      [](size_t nbytes) {
        auto buffer = std::make_shared<shardkit::core::AlignedBuffer>(nbytes);
        uint8_t* data = buffer->data();
        return torch::from_blob(data, {static_cast<int64_t>(nbytes)}, [buffer](void*) mutable { buffer.reset(); },
                                torch::TensorOptions().dtype(torch::kUInt8));
      },
      py::arg("nbytes"), "A zeroed uint8 tensor whose memory is aligned for direct I/O (4096 bytes).");
  m.def("release_shared_pages", &shardkit::comm::release_memory_pages, py::arg("memory"), py::arg("offset"),
        py::arg("nbytes"),
        "Gives the whole pages inside the byte range of a shared buffer back to /dev/shm (they read as zeros after); "
        "False where the kernel cannot. No rank may read the range meanwhile.");
  m.def("reserve_shared_pages", &shardkit::comm::reserve_memory_pages, py::arg("memory"), py::arg("offset"),
        py::arg("nbytes"),
        "Allocates the byte range's pages of a shared buffer now: None, or why not (/dev/shm out of room, a kernel "
        "before 5.14) instead of SIGBUS at the first write.");
#ifdef SHARDKIT_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("nccl_version", &shardkit::comm::nccl_version, "Version of the NCCL library shardkit linked (e.g. 22805).");
  m.def("cuda_scale_", &shardkit::cuda::scale_, py::arg("tensor"), py::arg("factor"),
        "In-place tensor *= factor on the current CUDA stream (the AVG/PREMUL_SUM step of CUDA collectives).");
  m.def("cuda_pack_", &shardkit::cuda::pack_, py::arg("flat"), py::arg("tensors"), py::arg("offsets"),
        "flat[offsets[i]:offsets[i]+tensors[i].numel()] = tensors[i] for every i, in one launch per 64 tensors.");
  m.def("cuda_unpack_", &shardkit::cuda::unpack_, py::arg("flat"), py::arg("tensors"), py::arg("offsets"),
        py::arg("factor") = 1.0, "tensors[i] = flat[offsets[i]:...] * factor for every i, in one launch per 64 tensors.");
  m.def("cuda_cast_scale_", &shardkit::cuda::cast_scale_, py::arg("dst"), py::arg("src"), py::arg("factor") = 1.0,
        "dst = (src * factor) cast to dst's dtype, computed in f32 (f64 if either is f64), rounded once.");
  m.def("cuda_orthogonalize_", &shardkit::cuda::orthogonalize_, py::arg("matrices"), py::arg("epsilon") = 0.0,
        "Batched Gram-Schmidt in place on (batch, rows, cols) matrices, one block per matrix.");
#else
  m.attr("with_cuda") = false;
#endif
}
