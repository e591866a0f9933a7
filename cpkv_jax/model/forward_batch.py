"""What one jitted model step needs to know about its tokens (a pytree of arrays).

Layout is padded `[B, T]`: row `b` holds the new tokens of one request; padding tokens
have `valid == False`, write into the trash page and their outputs are ignored.
"""

from __future__ import annotations

import dataclasses

import jax
from jaxtyping import Array, Bool, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardBatch:
    input_ids: Int[Array, "b t"]
    positions: Int[Array, "b t"]  # logical token position within its request
    valid: Bool[Array, "b t"]
    write_slots: Int[Array, "b t"]  # flat pool slot (page * page_size + offset)
    page_table: Int[Array, "b pages"]  # logical page -> physical page (trash-padded)
    kv_lens: Int[Array, " b"]  # tokens of KV each request has after this step
