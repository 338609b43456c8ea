/* A stand-in libcuda.so.1 for building TVM CUDA artifacts on a host without a GPU.
 *
 * TVM's CUDA runtime (tvm/lib/libtvm_runtime_cuda.so) links against the driver library.
 * Where that library is missing the runtime fails to load and a CUDA build silently keeps
 * CUDA *source* instead of compiled kernels. This stub exports the driver symbols that
 * the runtime imports (list: `nm -D --undefined-only libtvm_runtime_cuda.so | grep ' cu'`),
 * each returning CUDA_ERROR_NO_DEVICE (100), so the runtime loads and the build emits a
 * real fatbin through nvcc. Nothing here ever runs a kernel.
 *
 * Built by baselines/tvm_build.py into a temporary directory:
 *   gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 cuda_stub.c
 * Never install it where a real driver lives.
 */
#define CUDA_ERROR_NO_DEVICE 100

/* Empty parameter lists: C calling conventions let callers pass any arguments. */
int cuDeviceGetName() { return CUDA_ERROR_NO_DEVICE; }
int cuFuncSetAttribute() { return CUDA_ERROR_NO_DEVICE; }
int cuGetErrorName() { return CUDA_ERROR_NO_DEVICE; }
int cuGetErrorString() { return CUDA_ERROR_NO_DEVICE; }
int cuLaunchKernelEx() { return CUDA_ERROR_NO_DEVICE; }
int cuModuleGetFunction() { return CUDA_ERROR_NO_DEVICE; }
int cuModuleLoadData() { return CUDA_ERROR_NO_DEVICE; }
int cuModuleUnload() { return CUDA_ERROR_NO_DEVICE; }
int cuTensorMapEncodeTiled() { return CUDA_ERROR_NO_DEVICE; }
