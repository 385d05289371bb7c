// The one Python module of shardkit, `shardkit._C`. Glue only: no logic, no validation.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/extension.h>

#include "comm/backend.h"
#include "core/reduce.h"
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
