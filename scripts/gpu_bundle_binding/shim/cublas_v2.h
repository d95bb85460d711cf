// Stand-in for <cublas_v2.h>, searched LAST (nvcc -Xcompiler -idirafter): a toolkit that has cuBLAS's
// headers uses its own. vLLM's csrc/libtorch_stable/torch_utils.h includes it for one type only.
#pragma once
struct cublasContext;
typedef struct cublasContext* cublasHandle_t;
