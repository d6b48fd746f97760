"""Registry entry for mla_cache_append (references/mla_cache_append.py): one latent per sequence at its
next paged-cache slot, the length advanced.

Lengths sit around page boundaries (mla_decode_attn's draw: the next token at a page's last slot, at a
new page's first, past it), block tables are a random permutation of the pages padded with -1, two
spare pages belong to no sequence, and the cache starts full of drawn values, so a write to a wrong
slot, page or row shows. Knobs: cache='large' puts every sequence's pages past slot 2^16 (a 16-bit
slot or row offset writes a low slot); index='int64' draws the block table and lengths as int64.
"""
from __future__ import annotations

import torch

from references.config import get_config
from verify.model.case import Case
from verify.model.opdef import OpDef, OpInputs
from verify.model.values import draw, generator
from verify.ops.common_splits import activation, replicated_split, working_dtype
from verify.ops.mla import LARGE_CACHE_SLOTS, draw_seq_lens, paged_layout


def make_mla_cache_append_inputs(case: Case) -> OpInputs:
    cfg = get_config(case.config)
    page, wd = cfg.page_size, working_dtype(case)
    after = draw_seq_lens(case, case.batch, 1, page)          # tokens once the new one is cached (>= 1)
    first_page = -(-LARGE_CACHE_SLOTS // page) if case.knob("cache") == "large" else 0
    table, lengths, n_pages = paged_layout(case, after, page, first_page)
    index = case.knob("index", "int32")
    if index not in ("int32", "int64"):
        raise ValueError(f"knob index: {index!r}; choose 'int32' or 'int64'")
    idx = getattr(torch, index)
    return OpInputs({
        "kv_c": activation(case, "kv_c", (case.batch, cfg.kv_lora_rank), wd),
        "k_rot": activation(case, "k_rot", (case.batch, cfg.qk_rope_dim), wd),
        # full of other values: a stray or misplaced write shows
        "cache": draw(generator(case.seed, 22), (n_pages, page, cfg.cache_dim), "normal", dtype=wd),
        "block_table": table.to(idx), "seq_lens": (lengths - 1).to(idx)})


def regrow_pages(inputs: OpInputs) -> dict[str, torch.Tensor] | None:
    """The block table rewritten in place as an engine re-pages sequences between steps: the page holding
    each of the first sequences' next slot swapped for a spare page (one in no table), as many sequences
    as there are spare pages; None when there is none (guard:grown_inputs)."""
    t = inputs.tensors
    page, table, lens = t["cache"].shape[1], t["block_table"].clone(), t["seq_lens"]
    used = set(int(p) for p in table.flatten().tolist() if p >= 0)
    spare = [p for p in range(t["cache"].shape[0]) if p not in used]
    if not spare or lens.numel() == 0:
        return None
    for b in range(min(len(spare), lens.shape[0])):
        table[b, int(lens[b]) // page] = spare[b]
    return {"block_table": table}


def mla_cache_append_bytes(inputs: OpInputs) -> int:
    """kv_c and k_rot read, each sequence's length and block-table entry read and its length written,
    one cache row written per sequence."""
    t = inputs.tensors
    B, C = t["kv_c"].shape[0], t["cache"].shape[2]
    e, i, j = t["kv_c"].element_size(), t["seq_lens"].element_size(), t["block_table"].element_size()
    return 2 * B * C * e + B * (2 * i + j)


OPS = [
    OpDef(
        name="mla_cache_append", family="mla_cache_append", reference="references.mla_cache_append:mla_cache_append",
        make_inputs=make_mla_cache_append_inputs, outputs=(), state=("cache", "seq_lens"),
        signature=("kv_c[B,kv_lora] wd, k_rot[B,rope] wd, cache[P,page,kv_lora+rope] wd (state), "
                   "block_table[B,pages] int32|int64 (-1 = unassigned), seq_lens[B] int32|int64 (state: +1), "
                   "validate: bool = True -> None"),
        batch_dims={"kv_c": 0, "k_rot": 0, "block_table": 0, "seq_lens": 0},
        split=replicated_split(), fused="fused.mla_cache_append:mla_cache_append",
        knob_sweep=({"cache": "large"}, {"index": "int64"}), grow_inputs=regrow_pages,
        moved_bytes=mla_cache_append_bytes,
        notes="Replicated over TP: every rank appends the same latent to its own cache replica. The lengths "
              "put the next token at a page's last slot, a new page's first and past them; knob cache='large' "
              "(every run): the sequences' pages past slot 2^16; knob index='int64': int64 block table and "
              "lengths. guard:grown_inputs re-pages sequences in place between two calls."),
]
