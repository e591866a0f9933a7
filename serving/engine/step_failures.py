"""What a failed engine step leaves behind: may the engine go on serving?

A step donates the KV pool to its executable and keeps the pool the step returns. A
step that raised before the donation (a compile, a bad argument) or after the pool was
replaced (a SPEC S1.7 debug check, reading the logits) leaves a pool that still holds
every other request's KV: the engine fails the step's requests and serves on. A step
that raised after the donation but before the new pool was kept leaves deleted arrays
(and an asynchronous failure leaves arrays holding the error): nothing can be read or
written any more, and only a restart helps (`EngineStateLostError`).
"""

from __future__ import annotations

import logging
from typing import Any

import jax

from serving.engine.api import EngineStateLostError

logger = logging.getLogger(__name__)


def step_failure(what: str, exc: BaseException) -> str:
    """The sentence a failed request's client gets: `what` failed, and why."""
    return f"{what} failed: {type(exc).__name__}: {exc}"


def pool_damage(pool: Any) -> str | None:
    """Why `pool` (a pytree of `jax.Array`s, or None) can no longer be used, else None.

    Deleted leaves (donated to a step that did not hand the pool back, e.g. a host
    cache load-back's `DevicePoolLostError`) are lost; leaves whose computation failed
    raise when waited for. Called only after a step failed: the wait costs what the
    device still had queued."""
    leaves = [x for x in jax.tree.leaves(pool) if isinstance(x, jax.Array)]
    # Every shard is asked: `is_deleted` can miss a donated shard of a sharded array
    # (JAX 0.10; `cpkv_jax.host_cache.copy.deleted_leaves` does the same).
    deleted = sum(
        x.is_deleted() or any(s.data.is_deleted() for s in x.addressable_shards) for x in leaves
    )
    if deleted:
        return (
            f"{deleted} of the {len(leaves)} KV pool arrays were donated to the failed step "
            "and are gone"
        )
    try:
        jax.block_until_ready(leaves)
    except Exception as e:  # the step that produced them failed on the device
        return f"the KV pool holds the failed step's result: {type(e).__name__}: {e}"
    return None


def check_pool_after(exc: BaseException, message: str, pool: Any, failed: list[str]) -> None:
    """After a step raised: `EngineStateLostError` (from `exc`) when `pool` is lost,
    else log the failure once, with its traceback, naming the requests it fails."""
    damage = pool_damage(pool)
    if damage is not None:
        raise EngineStateLostError(f"{message}; {damage}") from exc
    logger.error(
        "%s; failing the %d request(s) it served: %s",
        message,
        len(failed),
        ", ".join(failed),
        exc_info=exc,
    )
