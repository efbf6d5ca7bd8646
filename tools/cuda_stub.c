/* A stand-in for the CUDA driver (libcuda.so.1) for tools/mgpu_build.py only: it answers as one compute-capability
 * 9.0 device with the H200's multiprocessor count and shared memory, and accepts module loads without running
 * anything. Mosaic GPU's compiler (the CUDA PJRT plugin's MosaicGpuCompile) asks the driver for the device before it
 * compiles and loads the cubin after, so with this stub it runs MLIR -> LLVM -> PTX -> ptxas on a machine without a
 * GPU. Never loaded by dijax itself. Built by tools/mgpu_build.py with the host's C compiler:
 *     cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 tools/cuda_stub.c
 */
#include <stddef.h>
#include <string.h>

typedef int CUresult;
static int handle;  /* every context, module and function is this address */

static const char *const kError = "the CUDA driver stub of tools/mgpu_build.py (no GPU here)";
CUresult cuGetErrorString(CUresult e, const char **s) { (void)e; *s = kError; return 0; }
CUresult cuGetErrorName(CUresult e, const char **s) { (void)e; *s = "CUDA_STUB"; return 0; }
CUresult cuInit(unsigned flags) { (void)flags; return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuDeviceGet(int *d, int ordinal) { (void)ordinal; *d = 0; return 0; }
CUresult cuDeviceGetCount(int *c) { *c = 1; return 0; }
CUresult cuDeviceGetName(char *name, int len, int d) { (void)d; strncpy(name, "H200 (driver stub)", len); return 0; }
CUresult cuDeviceGetAttribute(int *v, int attribute, int d) {
  (void)d;
  switch (attribute) {
    case 75: *v = 9; break;          /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR */
    case 76: *v = 0; break;          /* ..._MINOR */
    case 16: *v = 132; break;        /* multiprocessors */
    case 97: *v = 232448; break;     /* shared memory per block, opt-in */
    case 8: *v = 49152; break;       /* shared memory per block */
    default: *v = 1;
  }
  return 0;
}
CUresult cuCtxGetCurrent(void **c) { *c = &handle; return 0; }
CUresult cuCtxGetDevice(int *d) { *d = 0; return 0; }
CUresult cuCtxSetCurrent(void *c) { (void)c; return 0; }
CUresult cuCtxPushCurrent_v2(void *c) { (void)c; return 0; }
CUresult cuCtxPopCurrent_v2(void **c) { if (c) *c = &handle; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { (void)d; *c = &handle; return 0; }
CUresult cuModuleLoadData(void **m, const void *image) { (void)image; *m = &handle; return 0; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) { (void)m; (void)name; *f = &handle; return 0; }
CUresult cuModuleGetGlobal_v2(void **p, size_t *bytes, void *m, const char *name) {
  (void)m; (void)name; *p = &handle; if (bytes) *bytes = sizeof(handle); return 0;
}
CUresult cuModuleUnload(void *m) { (void)m; return 0; }
CUresult cuFuncSetAttribute(void *f, int attribute, int value) { (void)f; (void)attribute; (void)value; return 0; }
CUresult cuFuncGetAttribute(int *v, int attribute, void *f) { (void)attribute; (void)f; *v = 0; return 0; }
