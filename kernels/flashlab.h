// The contract between a stage's .cu file and flashlab's generated Python binding.
//
// This header is plain C++ (no CUDA, no torch) so that the binding compiles in a couple of
// seconds. Every kernels/NN_slug.cu defines the three functions declared below; flashlab checks
// devices, dtypes and shapes in Python before it calls them, so they only have to judge what is
// specific to the stage (head dims, shared memory) and launch.
#pragma once
#include <cstddef>

enum FlashlabDtype { FLASHLAB_F32 = 0, FLASHLAB_F16 = 1, FLASHLAB_BF16 = 2 };

// How far apart, in elements, one tensor's consecutive batches, heads and rows are; the last dim
// is always contiguous. A contiguous (B, H, N, D) tensor has {H*N*D, N*D, D}; the (B, H, N, D)
// view of a (B, N, H, D) projection, which is what transformers hands to attention, has
// {N*H*D, D, H*D}: its rows are H*D apart. flashlab checks that every element of every tensor
// lies fewer than 2^31 elements past its pointer, so kernels index in 32-bit ints.
struct FlashlabStrides { int b, h, n; };
struct FlashlabLayout {
  FlashlabStrides q, k, v, o;
  int H;             // heads: block (batch, head) index bh is batch bh / H, head bh % H
};

struct FlashlabProblem {
  const void* q;     // (B, H, N, D), dtype as below, laid out as `layout` says
  const void* k;     // (B, H, N, D)
  const void* v;     // (B, H, N, D)
  void* o;           // (B, H, N, D), written by the stage
  void* workspace;   // flashlab_workspace_bytes() bytes of scratch, uninitialised (may be null)
  int B, H, N, D;
  int dtype;         // FlashlabDtype
  int causal;        // 1: query i attends to keys 0..i only
  float scale;       // softmax scale, usually 1/sqrt(D)
  FlashlabLayout layout;  // strides of q, k, v, o. Stages whose registry entry has row_strides
  //                       read them; the others are only ever given contiguous tensors.
  // The log-sum-exp, (B, H, N) fp32 contiguous: lse[bh * N + i] = log(sum_j exp(scale q_i . k_j))
  // over the keys row i attends to, natural log. Forward: written where not null (stages whose
  // registry entry has `lse`; null costs nothing). Backward: read, as the forward wrote it.
  float* lse;
  // Backward only: dL/dO ((B, H, N, D), like o), and the gradients dq, dk, dv to write ((B, H, N,
  // D), the inputs' dtype). o, the forward's output, is contiguous here.
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  // The strides of dq, dk, dv and dout. Stages whose registry entry has grad_strides read dout
  // and write the gradients so: a model whose q, k, v are (B, H, N, D) views of (B, N, H, D)
  // projections hands over dO in that order and takes its gradients back in it, with no copy
  // either way. The others are only ever given contiguous ones.
  FlashlabStrides dq_strides, dk_strides, dv_strides, dout_strides;
};

extern "C" {
// nullptr when the stage can run this problem on the current device, else a sentence saying why not.
const char* flashlab_unsupported(const FlashlabProblem* p);
// Bytes of scratch the stage needs in global memory (0 for none).
size_t flashlab_workspace_bytes(const FlashlabProblem* p);
// Launches on `stream` (a cudaStream_t). nullptr on success, else the CUDA error string.
const char* flashlab_launch(const FlashlabProblem* p, void* stream);

// Stages with a backward pass only. Bytes of scratch its backward needs (fp32 dQ and the like),
// and the backward's launch: reads q, k, v, o, lse and dout, writes dq, dk and dv.
size_t flashlab_backward_workspace_bytes(const FlashlabProblem* p);
const char* flashlab_backward_launch(const FlashlabProblem* p, void* stream);
}
