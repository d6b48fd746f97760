"""Planted-bug catalogue: plausible kernel bugs, one per function, each with the op reference's exact
signature, and the harness stage that must reject it.

CATALOGUE rows: (op, candidate 'module:attr', expected, description). `expected` is
"<stage>" or "<stage>|<substring of the reason>" (a stage ending in ':' matches any stage it starts);
the op verdict's reason reads "<stage>: <detail>"
(split cases prefix the detail with "T=<n>: " or "rank r/T: "). Stages: candidate (raised),
guard:<name>, compare:<output or state>.
Known harness gaps are listed in GAPS: bug -> why the harness does not reject it as expected.
"""
from __future__ import annotations

P = "property_tests.planted"

CATALOGUE: list[tuple[str, str, str, str]] = [
    # ---- skinny_gemm
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_unwritten_tail", "guard:outputs_written|unwritten",
     "unwritten tail: y from torch.empty, last column tile never stored"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_drops_k_tail", "compare:y|exceed",
     "K loop over whole 64-wide tiles: the K % 64 tail dropped (off-tile shapes only)"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_partial_column_block_zero", "compare:y|exceed",
     "last partial 64-column block masked off: its columns zero (off-tile shapes only)"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_fp16_accum", "compare:y|exceed",
     "fp16 accumulation in the GEMM"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_pow2_batch_only", "compare:y|exceed",
     "shape special-casing: right only for power-of-two M (caught via the drawn batch sizes)"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_m32_tile_row_offset", "compare:y|exceed",
     "a 32-row M tile's last warp reads x 8 rows back: wrong only at M = 25..32 (the batch sweep)"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_m64_drops_k_chunk", "compare:y|exceed",
     "M = 64 fast path drops its last 32-wide K chunk (the batch sweep's largest batch)"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_negates_small_outputs", "compare:y|exceed",
     "elements below one unit roundoff of the row maximum with the wrong sign (the element rule)"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_fp32_out", "guard:output_type|dtype torch.float32",
     "wrong output dtype: fp32 accumulator returned"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_subclass", "guard:output_type|expected exactly torch.Tensor",
     "returns a torch.Tensor subclass"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_assumes_contiguous", "guard:strided_inputs|differ bitwise",
     "ignores input strides: wrong on strided/offset inputs"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_serving_path_drops_k_tail", "guard:inference_mode|differ bitwise",
     "under no_grad / inference_mode a fast path that drops the K tail (the path a serving engine takes)"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_misaligned_output", "guard:output_layout|16-byte boundary",
     "output returned as a contiguous slice one element into a workspace (base not 16-byte aligned)"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_zero_lead_is_zero_row", "compare:y|exceed",
     "a row whose first element is exactly 0 taken for a zero row (zero_rows' exact zeros inside rows)"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_rounds_x_base_down", "guard:misaligned_inputs|differ bitwise",
     "x read from its address rounded down to 16 bytes: rows shifted on a contiguous view like x[1:]"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_stale_weight_cache", "guard:refreshed_inputs|new values",
     "weights prepacked once per tensor: values written into the same weight tensor are never seen"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_static_output", "guard:outputs_kept|storage the first call returned",
     "one preallocated output per shape, returned by every call"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_calls_sys_exit", "candidate|sys.exit(5)",
     "calls sys.exit(5): judged, not the end of an in-process run"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_leaves_mkldnn_bf16_on", "guard:process_state|mkldnn.matmul.fp32_precision",
     "sets oneDNN's per-backend fp32 precision to bf16 and leaves it on"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_leaves_tf32_on", "guard:process_state|float32_matmul_precision",
     "turns TF32 matmuls on for the whole process and leaves them on"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_lagging_input_write", "guard:inputs_unchanged|after the later calls",
     "writes into its input after returning (a kernel on a stream nobody waits for)"),
    ("skinny_gemm", f"{P}.process:skinny_gemm_patches_torch_matmul",
     "guard:process_state|torch functions and Tensor methods (monkeypatched): replaced: torch.matmul",
     "installs its own torch.matmul and leaves it: the reference's later matmuls run on it"),
    ("skinny_gemm", f"{P}.process:skinny_gemm_leaves_function_mode", "guard:process_state|mode stacks",
     "enters a TorchFunctionMode and never exits it"),
    ("skinny_gemm", f"{P}.process:skinny_gemm_sets_default_device", "guard:process_state|set_default_device",
     "calls torch.set_default_device and leaves it set"),
    ("skinny_gemm", f"{P}.process:skinny_gemm_silences_warnings", "guard:process_state|warnings filters",
     "silences every warning of the process"),
    ("skinny_gemm", f"{P}.process:skinny_gemm_overrides_environ", "guard:process_state|os.environ",
     "rewrites a variable of the process's environment (PATH)"),
    ("skinny_gemm", f"{P}.process:skinny_gemm_disables_mkldnn", "guard:process_state|backends.mkldnn.enabled",
     "turns oneDNN off for the whole process"),
    ("skinny_gemm", f"{P}.process:skinny_gemm_transposed_out", "guard:output_layout|strides",
     "returns the right values column-major (a transposed view)"),
    ("skinny_gemm", f"{P}.process:skinny_gemm_requires_grad_out", "guard:output_type|requires_grad",
     "returns an output that requires grad"),
    ("skinny_gemm", f"{P}.process:skinny_gemm_graph_after_warmup", "guard:warmed_up|after 100 calls",
     "replays a graph captured after 40 calls of a shape, on the tensors of the capture"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_reseeds_rng", "guard:process_state|torch CPU RNG state",
     "calls torch.manual_seed(0): every later sample of the process repeats"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_draws_python_random", "guard:process_state|python random state",
     "draws from python's global random generator"),
    ("skinny_gemm", f"{P}.gemm:skinny_gemm_leaves_anomaly_mode_on", "guard:process_state|anomaly mode",
     "turns autograd anomaly detection on and leaves it on"),
    # ---- mxfp4_dequant
    ("mxfp4_dequant", f"{P}.mxfp4:mxfp4_dequant_memo_output", "guard:refreshed_inputs|new values",
     "dequantizes each packed tensor once and returns copies of that result afterwards"),
    ("mxfp4_dequant", f"{P}.mxfp4:mxfp4_dequant_drops_column_tail", "compare:w|differ from the reference bits",
     "64-column tiles, the grid rounded down: an odd last group zero (off-tile I only)"),
    ("mxfp4_dequant", f"{P}.mxfp4:mxfp4_dequant_fp16_flushes_subnormals", "compare:w|differ from the reference bits",
     "fp16 out with flush-to-zero: subnormal results come back zero (the exhaustive codes case)"),
    ("mxfp4_dequant", f"{P}.mxfp4:mxfp4_dequant_fp16_saturates", "compare:w|differ from the reference bits",
     "fp16 out saturating at 65504 instead of inf (the exhaustive codes case)"),
    ("mxfp4_dequant", f"{P}.mxfp4:mxfp4_dequant_nibble_swap", "compare:w|differ from the reference bits",
     "MXFP4 nibble order swapped"),
    ("mxfp4_dequant", f"{P}.mxfp4:mxfp4_dequant_bias_126", "compare:w|differ from the reference bits",
     "E8M0 scale bias 126"),
    # ---- mla
    ("mla_qkv_a", f"{P}.mla:mla_qkv_a_norm_without_eps", "guard:outputs_written|unwritten or NaN",
     "eps missing in RMSNorm (zero rows give NaN)"),
    ("mla_q_absorb", f"{P}.mla:mla_q_absorb_rot_first", "compare:q_abs|exceed",
     "q_abs stored as [q_rot, ql]"),
    ("mla_cache_write", f"{P}.mla:mla_cache_write_pair_store", "compare:cache|differ from the reference bits",
     "cache write touches the neighbouring slot of its pair (bitwise)"),
    ("mla_cache_write", f"{P}.mla:mla_cache_write_assumes_contiguous", "guard:canaries|writes outside the tensors",
     "cache write ignores strides: writes into row padding (canary)"),
    ("mla_cache_write", f"{P}.mla:mla_cache_write_slot_u16", "compare:cache|differ from the reference bits",
     "slots kept in 16 bits: a slot past 2^16 wraps onto a low one (the large-cache case)"),
    ("mla_cache_write", f"{P}.mla:mla_cache_write_loses_negative_zero", "compare:cache|differ from the reference bits",
     "copy through x * 1 + 0: -0.0 lands as +0.0 (zero_rows draws signed zeros)"),
    ("mla_cache_write", f"{P}.mla:mla_cache_write_skips_only_minus1", "compare:cache|differ from the reference bits",
     "only slot -1 skipped: another negative slot wraps into the cache"),
    ("mla_cache_write", f"{P}.mla:mla_cache_write_serving_path_wraps_pads", "guard:inference_mode",
     "under no_grad / inference_mode negative padding slots other than -1 wrap into the cache"),
    ("mla_cache_write", f"{P}.mla:mla_cache_write_flushes_denormals", "guard:process_state|flush denormals",
     "leaves flush-to-zero on for the thread"),
    ("mla_decode_attn", f"{P}.mla:mla_decode_attn_scale_from_shape", "compare:o_latent|exceed",
     "softmax scale recomputed from the cache width, the scale argument ignored (drawn per case)"),
    ("mla_decode_attn", f"{P}.mla:mla_decode_attn_scale_128", "compare:o_latent|exceed",
     "softmax scale 128^-0.5 instead of 192^-0.5"),
    ("mla_decode_attn", f"{P}.mla:mla_decode_attn_causal_off_by_one", "compare:o_latent|exceed",
     "causal mask off by one among the speculative query tokens"),
    ("mla_decode_attn", f"{P}.mla:mla_decode_attn_lse_drops_last_split", "compare:o_latent|exceed",
     "split-KV LSE combine missing the last split's term"),
    ("mla_decode_attn", f"{P}.mla:mla_decode_attn_fp32_tf32_scores", "compare:o_latent|exceed",
     "fp32 scores on TF32 operands (allow_tf32 on the score GEMM; fp32 working dtype only)"),
    ("mla_decode_attn", f"{P}.mla:mla_decode_attn_fp32_bf16_probs", "compare:o_latent|exceed",
     "P rounded to bf16 before P @ V in an fp32 kernel (a bf16 MMA; legitimate only for bf16)"),
    ("mla_decode_attn", f"{P}.mla:mla_decode_attn_flat_tokens", "guard:output_type|shape",
     "wrong output shape [B*Q,H,C]"),
    ("mla_decode_attn", f"{P}.mla:mla_decode_attn_last_bit_race", "guard:deterministic|differ bitwise",
     "nondeterministic last bit (atomic combine order)"),
    ("mla_out_gate", f"{P}.mla:mla_out_gate_row_parity_path", "guard:batch_position|differ bitwise",
     "batch-position dependence: odd rows take another epilogue"),
    ("mla_out_gate", f"{P}.mla:mla_out_gate_swapped_rows", "compare:o|exceed",
     "swapped batch rows (pairs reversed)"),
    # ---- kda
    ("kda_decode", f"{P}.kda:kda_decode_private_conv_state", "guard:refreshed_inputs|conv_state",
     "keeps a private copy of the conv window and never reads the caller's conv_state again"),
    ("kda_decode", f"{P}.kda:kda_decode_no_decay", "compare:y|exceed", "KDA state not decayed"),
    ("kda_decode", f"{P}.kda:kda_decode_no_beta", "compare:y|exceed", "beta not applied"),
    ("kda_decode", f"{P}.kda:kda_decode_fixed_params", "compare:",
     "gate lower bound, l2_eps and norm_eps baked in at the config's values (drawn per case)"),
    ("kda_decode", f"{P}.kda:kda_decode_conv_state_not_shifted", "compare:conv_state",
     "conv state not shifted"),
    ("kda_decode", f"{P}.kda:kda_decode_misaligned_state_not_written_back",
     "guard:misaligned_inputs|differ bitwise",
     "a misaligned state copied to aligned storage for the kernel, the update never copied back"),
    ("kda_decode", f"{P}.kda:kda_decode_gate_unbounded", "compare:y|exceed",
     "gate without the lower bound (softplus gate)"),
    ("kda_decode", f"{P}.kda:kda_decode_l2_eps_outside_sqrt", "compare:",
     "eps outside the sqrt in the q/k L2 norm"),
    ("kda_in_proj", f"{P}.kda:kda_in_proj_no_variant", "candidate|raised RuntimeError: kda_in_proj: no tuned kernel variant",
     "a candidate that raises (no variant for untuned M)"),
    ("kda_in_proj", f"{P}.kda:kda_in_proj_beta_before_fa", "compare:g_raw|exceed",
     "merged projection sliced in the wrong row order"),
    # ---- attn_res
    ("attn_res_rmsnorm", f"{P}.attn_res:attn_res_rmsnorm_swapped_eps", "compare:out|exceed",
     "key-norm eps and output RMSNorm eps swapped (equal in every config; drawn per case)"),
    ("attn_res_rmsnorm", f"{P}.attn_res:attn_res_rmsnorm_softmax_without_max", "guard:outputs_written|NaN",
     "softmax without its running max: NaN once scores pass exp's fp32 range (the score_scale case)"),
    ("attn_res_rmsnorm", f"{P}.attn_res:attn_res_rmsnorm_row_fixed_point_out", "compare:out|exceed",
     "out stored as per-row fixed point (the element rule)"),
    ("attn_res_rmsnorm", f"{P}.attn_res:attn_res_rmsnorm_keys_unnormalised", "compare:out|exceed",
     "AttnRes keys not RMS-normalised"),
    ("attn_res_rmsnorm", f"{P}.attn_res:attn_res_rmsnorm_prefix_not_reset", "compare:prefix",
     "block write does not reset the prefix"),
    ("attn_res_rmsnorm", f"{P}.attn_res:attn_res_rmsnorm_accumulates_into_delta",
     "guard:inputs_unchanged|delta", "input mutated in place (delta += prefix)"),
    ("attn_res_rmsnorm", f"{P}.attn_res:attn_res_rmsnorm_out_in_delta", "guard:no_aliasing|aliases input delta",
     "output aliases an input"),
    ("attn_res_rmsnorm", f"{P}.attn_res:attn_res_rmsnorm_output_ring", "guard:outputs_kept|changed during",
     "outputs from a ring of three buffers: a returned result is overwritten three calls later"),
    ("allreduce_attn_res_rmsnorm", f"{P}.attn_res:allreduce_attn_res_rmsnorm_reverse_fold", "compare:",
     "all-reduce summed in the wrong order (order-sensitive partials)"),
    # ---- moe
    ("router_topk", f"{P}.moe:router_topk_higher_id_wins", "compare:ids",
     "wrong tie-break in router top-k (higher id wins)"),
    ("router_topk", f"{P}.moe:router_topk_renorm_over_all", "compare:weights|exceed",
     "wrong top-k renormalisation (sum over all experts)"),
    ("router_topk", f"{P}.moe:router_topk_not_renormalised", "compare:weights|exceed",
     "expert weights not renormalised"),
    ("router_topk", f"{P}.moe:router_topk_ignores_routed_scale", "compare:weights|exceed",
     "routed_scale never applied (the config's is 1.0; drawn per case)"),
    ("router_topk", f"{P}.moe:router_topk_weights_in_wd", "guard:output_type|dtype",
     "wrong output dtype for the weights"),
    ("router_topk", f"{P}.moe:router_topk_bf16_logits", "compare:",
     "router logits rounded to bf16 (gate GEMM in the activation dtype)"),
    ("router_topk", f"{P}.moe:router_topk_weights_from_choice", "compare:weights|exceed",
     "weights from the biased choice scores"),
    ("moe_experts_mxfp4", f"{P}.moe:moe_experts_mxfp4_all_pad_rows_unwritten", "guard:outputs_written|unwritten",
     "a token whose every slot is padding (routed to other ranks only) is never written"),
    ("moe_experts_mxfp4", f"{P}.moe:moe_experts_mxfp4_minus1_is_last_expert", "compare:y|exceed",
     "padding id -1 indexes the last expert (the drawn ids hold padding slots)"),
    ("moe_experts_mxfp4", f"{P}.moe:moe_experts_mxfp4_renormalises_weights", "compare:y|exceed",
     "routing weights renormalised again (their rows sum to a drawn routed_scale)"),
    ("moe_experts_mxfp4", f"{P}.moe:moe_experts_mxfp4_nan_scale_as_one", "compare:y",
     "E8M0 scale 0xFF decoded as 1.0 (the scales='extreme' case; NaN oracle elements judged)"),
    ("moe_experts_mxfp4", f"{P}.moe:moe_experts_mxfp4_no_linear_beta", "compare:y|exceed",
     "SiTU linear_beta dropped"),
    ("shared_experts", f"{P}.moe:shared_experts_fixed_situ", "compare:y|exceed",
     "SiTU betas baked in at 4 / 25 (drawn per case)"),
    ("shared_experts", f"{P}.moe:shared_experts_halves_swapped", "compare:y|exceed",
     "gate/up halves of the fused weight swapped"),
    ("latent_norm_up", f"{P}.moe:latent_norm_up_batch_rms", "compare:out|exceed",
     "RMSNorm reduced over the batch, not per row"),
    ("l2_prefetch", f"{P}.moe:l2_prefetch_returns_handle", "guard:output_type|returns nothing",
     "op with no outputs returns a tensor"),
    ("l2_prefetch", f"{P}.moe:l2_prefetch_store_not_prefetch", "compare:w13_packed|differ from the reference bits",
     "prefetch writes the weights (declared as state, so judged bitwise)"),
    # ---- whole layers
    ("kda_layer", f"{P}.layers:kda_layer_state_reset_every_3_steps", "compare:",
     "recurrent state zeroed every 3 decode steps (the steps are drawn in 2..5)"),
    ("kda_layer", f"{P}.layers:kda_layer_state_not_stored", "compare:recurrent_state",
     "KDA recurrent state kept in scratch, never stored back"),
    ("mla_layer", f"{P}.layers:mla_layer_seq_lens_not_advanced", "compare:seq_lens",
     "seq_lens state not advanced after the cache writes"),
]


# hypothesis examples per candidate (default 6, the quick profile's count): bugs that only show on
# some drawn shapes or on unsplit cases get more draws
EXAMPLES: dict[str, int] = {
    "mla_out_gate_row_parity_path": 25,
    "skinny_gemm_fp16_accum": 12,
    "kda_decode_l2_eps_outside_sqrt": 25,
    "router_topk_higher_id_wins": 25,
}

# candidates drawn over every dtype of the op (quick draws only the working dtype, bf16): bugs
# that a bf16 output rounding hides (fp16 accumulation, an eps of 1e-6 in the wrong place)
ALL_DTYPES: set[str] = {"skinny_gemm_fp16_accum", "kda_decode_l2_eps_outside_sqrt",
                        "mxfp4_dequant_fp16_flushes_subnormals", "mxfp4_dequant_fp16_saturates"}

# candidates drawn in fp32 only: bugs that are legitimate at a 16-bit working dtype (TF32 operands are
# exact for bf16/fp16 inputs; P rounded to bf16 is FlashMLA's bf16 form) and that fp32's tolerance must catch
FP32_ONLY: set[str] = {"mla_decode_attn_fp32_tf32_scores", "mla_decode_attn_fp32_bf16_probs"}

# candidates run with the ci profile's batches (up to 64; the planted profile stops at 16): bugs in a
# variant for large M that only the batch sweep's M = 31 / 32 / 64 reach
FULL_BATCH: set[str] = {"skinny_gemm_m32_tile_row_offset", "skinny_gemm_m64_drops_k_chunk"}

# Harness gaps found by this catalogue: candidate -> (why the expected rejection does not happen,
# the stage that rejects it instead, or None if nothing rejects it). See the test for how they run.
GAPS: dict[str, tuple[str, str | None]] = {
    # Fixed gaps: session 18's third probe (elements far below their row's maximum zeroed, negated or
    # stored as fixed point: the element rule of compare_derived; a NaN-blind E8M0 decode in the
    # experts: the scales='extreme' case and NaN oracle elements judged, not vacuous); unwritten
    # outputs on the CPU (torch.empty hands out poison while a candidate runs),
    # the router's declared lower-id tie-break (exact float64 ties are judged against it), and kda's
    # eps outside the sqrt of the q/k L2 norm (x / (|x| + eps) vs x / sqrt(|x|^2 + eps) differ only
    # where |x|^2 ~ l2_eps = 1e-6: the small_rows distribution of verify/values.py draws such q/k rows).
}
