// A C entry point to FlashMLA's Hopper (sm_90a) dense paged MLA decode, so that Python reaches it
// through ctypes, with no torch C++ ABI between the two: the library builds here with nvcc alone
// (build.sh) and loads beside any torch on the GPU machine.
//
// One call runs FlashMLA's own three kernels on the caller's stream, as its torch API does:
// the split scheduler (get_decoding_sched_meta, when `plan` is non-zero), the split-KV attention
// (run_flash_splitkv_mla_kernel) and the LSE combine (run_flash_mla_combine_kernel). One KV head
// (MLA's latent is shared by all query heads), so the query rows of a sequence are its s_q tokens x
// h_q heads in that order: q [b, s_q, h_q, d], out [b, s_q, h_q, d_v] and lse [b, s_q, h_q] are
// contiguous. Every buffer is the caller's, which makes the call capturable in a CUDA graph.
//
// Returns 0, or a CUDA error code; shape limits that FlashMLA asserts (exiting the process) are
// checked first and returned as -1.
#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include "params.h"
#include "sm90/decode/dense/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

extern "C" int fmla_sched_meta_ints() { return DecodingSchedMetaSize / int(sizeof(int)); }

extern "C" int fmla_dense_decode(int is_fp16, int b, int s_q, int h_q, int d, int d_v, int page_block_size,
                                 int num_blocks, long long k_block_stride, long long k_row_stride,
                                 float scale, int causal, void *q, void *kcache, void *out, float *lse,
                                 int *block_table, long long block_table_stride, int *seqlens,
                                 void *sched_meta, int *num_splits, int num_sm_parts, float *lse_accum,
                                 float *o_accum, int plan, cudaStream_t stream) {
    if (d != 576 || d_v != 512 || page_block_size != 64 || b < 1 || s_q < 1 || h_q < 1 || num_sm_parts < 1)
        return -1;
    const int rows = s_q * h_q;                        // query rows per sequence (one KV head)
    if (plan) {
        GetDecodeSchedMetaParams meta = {b, s_q, 64, 5, -1, -1, nullptr, nullptr, seqlens,
                                         (DecodingSchedMeta *)sched_meta, num_splits, num_sm_parts, stream};
        smxx::decode::run_get_decoding_sched_meta_kernel(meta);
    }
    DenseAttnDecodeParams p = {};
    p.b = b;
    p.s_q = s_q;
    p.q_seq_per_hk = rows;
    p.d = d;
    p.d_v = d_v;
    p.h_q = h_q;
    p.h_k = 1;
    p.num_blocks = num_blocks;
    p.q_head_per_hk = h_q;
    p.is_causal = causal != 0 && s_q > 1;
    p.scale_softmax = scale;
    p.scale_softmax_log2 = scale * 1.44269504088896340736f;
    p.q_ptr = q;
    p.k_ptr = kcache;
    p.o_ptr = out;
    p.softmax_lse_ptr = lse;
    p.q_batch_stride = (long long)rows * d;
    p.q_row_stride = d;
    p.q_head_stride = d;
    p.k_batch_stride = k_block_stride;
    p.k_row_stride = k_row_stride;
    p.k_head_stride = k_row_stride;
    p.o_batch_stride = (long long)rows * d_v;
    p.o_row_stride = d_v;
    p.o_head_stride = (long long)rows * d_v;
    p.block_table = block_table;
    p.block_table_batch_stride = block_table_stride;
    p.page_block_size = page_block_size;
    p.seqlens_k_ptr = seqlens;
    p.tile_scheduler_metadata_ptr = (DecodingSchedMeta *)sched_meta;
    p.num_sm_parts = num_sm_parts;
    p.num_splits_ptr = num_splits;
    p.total_num_splits = b + num_sm_parts;
    p.softmax_lseaccum_ptr = lse_accum;
    p.oaccum_ptr = o_accum;
    p.stream = stream;
    if (is_fp16)
        sm90::run_flash_splitkv_mla_kernel<cutlass::half_t>(p);
    else
        sm90::run_flash_splitkv_mla_kernel<cutlass::bfloat16_t>(p);

    // lse [b, s_q, h_q] and out [b, s_q, h_q, d_v]; the accumulators [splits, rows, ...] as the kernel
    // wrote them (split-major, then the sequence's rows).
    CombineParams c = {b, s_q, h_q, d_v,
                       lse, out, rows, h_q, rows * d_v, h_q * d_v, d_v,
                       lse_accum, o_accum, rows, h_q, rows * d_v, h_q * d_v, d_v,
                       (DecodingSchedMeta *)sched_meta, num_splits, num_sm_parts, nullptr, stream};
    if (is_fp16)
        smxx::decode::run_flash_mla_combine_kernel<cutlass::half_t>(c);
    else
        smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);
    return int(cudaGetLastError());
}
