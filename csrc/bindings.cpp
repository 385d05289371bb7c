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
  py::class_<ProcessGroupShardkit, c10d::Backend, c10::intrusive_ptr<ProcessGroupShardkit>>(m, "ProcessGroupShardkit")
      .def(py::init([](int rank, int size, const std::string& shm_name, size_t slot_bytes,
                       std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> fallback) {
             ProcessGroupShardkit::Config config;
             config.shm_name = shm_name;
             config.slot_bytes = slot_bytes;
             config.timeout = timeout;
             return c10::make_intrusive<ProcessGroupShardkit>(rank, size, config, std::move(fallback));
           }),
           py::arg("rank"), py::arg("size"), py::arg("shm_name"), py::arg("slot_bytes"), py::arg("timeout"),
           py::arg("fallback"), py::call_guard<py::gil_scoped_release>());

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
