// The one Python module of shardkit, `shardkit._C`. Glue only: no logic, no validation.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/python_comm_hook.h>

#include "comm/backend.h"
#include "core/reduce.h"
#include "ddp/reducer.h"
#ifdef SHARDKIT_WITH_CUDA
#include "cuda/cuda_ops.h"
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "shardkit C++ extension";
  // Our backend derives from torch's c10d Backend; its Python type must be registered first.
  py::module_::import("torch.distributed");

  using shardkit::comm::ProcessGroupShardkit;
  py::class_<ProcessGroupShardkit::Config>(m, "BackendConfig")
      .def(py::init<>())
      .def_readwrite("shm_name", &ProcessGroupShardkit::Config::shm_name)
      .def_readwrite("slot_bytes", &ProcessGroupShardkit::Config::slot_bytes)
      .def_readwrite("timeout", &ProcessGroupShardkit::Config::timeout)
      .def_readwrite("local_rank", &ProcessGroupShardkit::Config::local_rank)
      .def_readwrite("local_size", &ProcessGroupShardkit::Config::local_size)
      .def_readwrite("num_hosts", &ProcessGroupShardkit::Config::num_hosts)
      .def_readwrite("host_index", &ProcessGroupShardkit::Config::host_index)
      .def_readwrite("host_of", &ProcessGroupShardkit::Config::host_of)
      .def_readwrite("local_of", &ProcessGroupShardkit::Config::local_of);
  py::class_<ProcessGroupShardkit, c10d::Backend, c10::intrusive_ptr<ProcessGroupShardkit>>(m, "ProcessGroupShardkit")
      .def(py::init([](int rank, int size, const ProcessGroupShardkit::Config& config,
                       c10::intrusive_ptr<c10d::Backend> fallback, c10::intrusive_ptr<c10d::Backend> inter_host) {
             return c10::make_intrusive<ProcessGroupShardkit>(rank, size, config, std::move(fallback),
                                                              std::move(inter_host));
           }),
           py::arg("rank"), py::arg("size"), py::arg("config"), py::arg("fallback"), py::arg("inter_host") = nullptr,
           py::call_guard<py::gil_scoped_release>());

  using shardkit::ddp::Reducer;
  py::class_<Reducer, std::shared_ptr<Reducer>>(m, "Reducer")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       c10::intrusive_ptr<c10d::ProcessGroup> process_group, size_t bucket_bytes_cap,
                       size_t first_bucket_bytes, bool find_unused_parameters, bool gradient_as_bucket_view,
                       bool shard_gradients) {
             Reducer::Options options;
             options.bucket_bytes_cap = bucket_bytes_cap;
             options.first_bucket_bytes = first_bucket_bytes;
             options.find_unused_parameters = find_unused_parameters;
             options.gradient_as_bucket_view = gradient_as_bucket_view;
             options.shard_gradients = shard_gradients;
             return std::make_shared<Reducer>(std::move(params), std::move(names), std::move(process_group), options);
           }),
           py::arg("params"), py::arg("names"), py::arg("process_group"), py::arg("bucket_bytes_cap"),
           py::arg("first_bucket_bytes"), py::arg("find_unused_parameters"), py::arg("gradient_as_bucket_view"),
           py::arg("shard_gradients") = false)
      .def("prepare_for_backward", &Reducer::prepare_for_backward, py::call_guard<py::gil_scoped_release>())
      .def("register_comm_hook",
           [](Reducer& reducer, py::object state, py::object hook) {
             reducer.register_comm_hook(std::make_unique<c10d::PythonCommHook>(std::move(state), std::move(hook)));
           },
           py::arg("state"), py::arg("hook"))
      .def("bucket_indices", &Reducer::bucket_indices)
      .def("bucket_buffers", &Reducer::bucket_buffers)
      .def("set_gradient_shards", &Reducer::set_gradient_shards, py::arg("shards"), py::arg("space"),
           py::arg("flat_offset"))
      .def("shard_gradient_defined", &Reducer::shard_gradient_defined)
      .def("clear_gradient_shards", &Reducer::clear_gradient_shards, py::arg("set_to_none"));

  m.def("reduce_isa", &shardkit::core::reduce_isa, "Vector ISA the reduction loops dispatched to at runtime.");
#ifdef SHARDKIT_WITH_CUDA
  m.attr("with_cuda") = true;
  m.def("nccl_version", &shardkit::cuda::nccl_version, "Version of the NCCL library shardkit linked (e.g. 22805).");
  m.def("cuda_scale_", &shardkit::cuda::scale_, py::arg("tensor"), py::arg("factor"),
        "In-place tensor *= factor on the current CUDA stream (the AVG/PREMUL_SUM step of CUDA collectives).");
#else
  m.attr("with_cuda") = false;
#endif
}
