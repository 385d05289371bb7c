// Batched Gram-Schmidt for PowerSGD: b matrices of n x r (row-major, r small), one thread block per matrix
// (blocks stride over the batch), in torch's order: for each column i, divide it by its norm (+ epsilon when
// epsilon != 0), then subtract from each later column j its projection (sum_k col_i[k] * col_j[k]) * col_i.
// Sums run in f32 (f64 for f64 matrices) through block_sum, whose order is fixed: the result does not depend
// on timing. Columns are read and written in the matrix's dtype, each write rounded once.
#include "cuda/device_math.cuh"

namespace shardkit::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void orthogonalize_kernel(T* data, int64_t batch, int64_t rows, int64_t cols,
                                     typename Arith<T>::type epsilon) {
  using A = typename Arith<T>::type;
  __shared__ A scratch[32];
  for (int64_t b = blockIdx.x; b < batch; b += gridDim.x) {
    T* m = data + b * rows * cols;
    for (int64_t i = 0; i < cols; ++i) {
      A squares = 0;
      for (int64_t k = threadIdx.x; k < rows; k += blockDim.x) {
        const A v = to_arith(m[k * cols + i]);
        squares += v * v;
      }
      const A norm = sqrt(block_sum(squares, scratch));
      const A divisor = epsilon == A(0) ? norm : norm + epsilon;
      for (int64_t k = threadIdx.x; k < rows; k += blockDim.x) {
        m[k * cols + i] = Store<T>::from(to_arith(m[k * cols + i]) / divisor);
      }
      __syncthreads();  // the normalised column, as stored, is what the projections below read
      for (int64_t j = i + 1; j < cols; ++j) {
        A dot = 0;
        for (int64_t k = threadIdx.x; k < rows; k += blockDim.x) dot += to_arith(m[k * cols + i]) * to_arith(m[k * cols + j]);
        const A projection = block_sum(dot, scratch);
        for (int64_t k = threadIdx.x; k < rows; k += blockDim.x) {
          m[k * cols + j] = Store<T>::from(to_arith(m[k * cols + j]) - projection * to_arith(m[k * cols + i]));
        }
      }
      __syncthreads();  // column i+1 is complete before its norm is taken
    }
  }
}

}  // namespace

cudaError_t launch_orthogonalize(const OrthogonalizeParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.rows == 0 || p.cols == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const unsigned grid = static_cast<unsigned>(p.batch < 65535 ? p.batch : 65535);
    orthogonalize_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<T*>(p.data), p.batch, p.rows, p.cols,
                                                            static_cast<typename Arith<T>::type>(p.epsilon));
    return cudaGetLastError();
  });
}

}  // namespace shardkit::cuda
