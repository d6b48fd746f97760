"""Planted bugs in the whole-layer ops (references/layers.py)."""
from __future__ import annotations

import torch

from references.layers import kda_layer_steps, mla_layer_steps


def kda_layer_state_not_stored(x_steps, blocks, conv_state, recurrent_state, layer_idx: int, config: str,
                               **weights):
    """Keeps the KDA recurrent state in a scratch copy across the steps and never stores it back."""
    return kda_layer_steps(x_steps, blocks, conv_state, recurrent_state.clone(), layer_idx, config, **weights)


def mla_layer_seq_lens_not_advanced(x_steps, blocks, cache, block_table, seq_lens, layer_idx: int, config: str,
                                    **weights):
    """Advances a private copy of seq_lens: the caller's lengths never grow past the cached tokens."""
    return mla_layer_steps(x_steps, blocks, cache, block_table, seq_lens.clone(), layer_idx, config, **weights)


def kda_layer_state_reset_every_3_steps(x_steps, blocks, conv_state, recurrent_state, layer_idx: int,
                                        config: str, **weights):
    """Runs the steps in chunks of 3 and zeroes the recurrent state between chunks."""
    outs = []
    for i in range(0, x_steps.shape[0], 3):
        if i:
            recurrent_state.zero_()
        outs.append(kda_layer_steps(x_steps[i:i + 3], blocks, conv_state, recurrent_state, layer_idx, config,
                                    **weights))
    return torch.cat(outs)
