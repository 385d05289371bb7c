// Build-time only: the torch headers most of the extension's sources include, compiled once per build as a GCC
// precompiled header and force-included ahead of every C++ source outside csrc/core/ (setup.py,
// `_PrecompiledTorchHeaders`; csrc/core/ includes no torch header). It changes what is compiled in no source (each
// still includes what it uses, and compiles without it: the GoogleTest build and non-GCC compilers never see it); it
// only spares every source parsing ~20 s of the same torch headers again.
// Add a header here only when most sources include it.
#pragma GCC system_header  // torch's headers, not ours: their warnings are torch's build's business
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
