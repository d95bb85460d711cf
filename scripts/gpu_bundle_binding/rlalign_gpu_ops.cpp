// rlalign-verl's registration of vLLM's CUDA kernels for the GPU check (scripts/gpu_bundle_build.py builds it).
//
// Compiled together with the UNMODIFIED vLLM .cu files of the bundle (gpu_bundle/vllm-<version>/csrc/
// libtorch_stable/{layernorm,activation,pos_encoding}_kernels.cu and moe/topk_softmax_kernels.cu), which
// define the host functions declared below. vLLM registers them as torch.ops._C.* / torch.ops._moe_C.*;
// here they are registered under the private namespace torch.ops.rlalign_gpu.* so they can never clash
// with (or be mistaken for) an installed vLLM.
//
// The schemas must equal vLLM's own (csrc/libtorch_stable/torch_bindings.cpp and moe/torch_bindings.cpp
// of the bundled version), and the declarations its host signatures (ops.h, moe/moe_ops.h): TORCH_BOX
// unboxes by the C++ signature. scripts/gpu_bundle_build.py compares the schemas before building.
#include <cstdint>
#include <optional>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

using torch::stable::Tensor;

void rms_norm(Tensor& out, Tensor& input, std::optional<Tensor> weight, double epsilon);
void fused_add_rms_norm(Tensor& input, Tensor& residual, std::optional<Tensor> weight, double epsilon);
void rotary_embedding(Tensor& positions, Tensor& query, std::optional<Tensor> key, int64_t head_size,
                      Tensor& cos_sin_cache, bool is_neox, int64_t rope_dim_offset, bool inverse);
void silu_and_mul(Tensor& out, Tensor& input);
void topk_softmax(Tensor& topk_weights, Tensor& topk_indices, Tensor& token_expert_indices,
                  Tensor& gating_output, bool renormalize, std::optional<Tensor> bias,
                  std::optional<Tensor> is_padding);

STABLE_TORCH_LIBRARY(rlalign_gpu, ops) {
  ops.def("rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()");
  ops.def("fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()");
  ops.def(
      "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()");
  ops.def("silu_and_mul(Tensor! result, Tensor input) -> ()");
  ops.def(
      "topk_softmax(Tensor! topk_weights, Tensor! topk_indices, Tensor! token_expert_indices, "
      "Tensor gating_output, bool renormalize, Tensor? bias, Tensor? is_padding) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(rlalign_gpu, CUDA, ops) {
  ops.impl("rms_norm", TORCH_BOX(&rms_norm));
  ops.impl("fused_add_rms_norm", TORCH_BOX(&fused_add_rms_norm));
  ops.impl("rotary_embedding", TORCH_BOX(&rotary_embedding));
  ops.impl("silu_and_mul", TORCH_BOX(&silu_and_mul));
  ops.impl("topk_softmax", TORCH_BOX(&topk_softmax));
}
