"""The guards a launch of a candidate must pass after its first call was judged, in the order they
run. Each is a function of the case context (verify.judge.context.CaseContext) returning its checks
([] where it does not apply); the pipeline stops at the first guard that fails. The first call's own
checks (output types, aliasing, canaries, inputs unchanged, process state, poison left in outputs)
are verify.judge.placement's, made by every guarded call."""
from __future__ import annotations

from verify.judge.guards import (batch_position, determinism, gpu, inference_mode, outputs, refresh, serving,
                                 serving_calls, views)

LATER_GUARDS = (
    determinism.second_run,            # guard:deterministic (and a second call handing back the same storage)
    batch_position.check,              # guard:batch_position
    refresh.refreshed_inputs,          # guard:refreshed_inputs
    serving.partial_refresh,           # guard:partial_refresh
    serving.state_chain,               # guard:state_chain
    refresh.warmed_up,                 # guard:warmed_up (cases the plan marks)
    serving_calls.grown_inputs,        # guard:grown_inputs (ops whose entry says how they grow)
    gpu.check,                         # guard:side_stream, cuda_graph, stream_order, concurrent (CUDA)
    outputs.outputs_kept_so_far,       # guard:outputs_kept, before the runs that could hide it
    views.strided_inputs,              # guard:strided_inputs                        } not in the
    views.misaligned_inputs,           # guard:misaligned_inputs                     } quick profile
    serving.call_forms,                # guard:out_omitted, owned_inputs, merged_inputs, thread_count
    inference_mode.check,              # guard:inference_mode
    serving_calls.host_threads,        # guard:host_threads (cases the plan marks): last, as its plain
)                                      # calls also trip over what the guards above name more exactly
