// vLLM stand-in (sparkspec tests): the one CUDA kernel of the stand-in's _C extension. Its SASS is what the
// vllm_build role's check reads (cuobjdump --list-elf): sm_121a only when the arch patch kept 12.1a.
#include <cuda_runtime.h>

__global__ void standin_scaled_add(float* out, const float* a, const float* b, float scale, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + scale * b[i];
}

extern "C" {

// The archs CMake selected (12.0, or 12.1a with the arch patch), for `vllm.standin_archs()`.
const char* vllm_standin_archs() { return VLLM_STANDIN_ARCHS; }

// Launches the kernel on device pointers; returns the cudaError_t (no GPU here: never called by the tests).
int vllm_standin_scaled_add(float* out, const float* a, const float* b, float scale, int n) {
  standin_scaled_add<<<(n + 255) / 256, 256>>>(out, a, b, scale, n);
  return static_cast<int>(cudaGetLastError());
}

}
