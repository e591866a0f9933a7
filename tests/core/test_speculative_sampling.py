"""The speculative sampling accept / reject rule (issue 39 item 2,
`cpkv_jax.speculative.accept_drafts`) on synthetic distributions.

Statistical checks use fixed seeds (so they cannot flake) and enough samples that the
bound has a wide margin: with N samples over V outcomes the total-variation distance of
an exact sampler's histogram is about sqrt(V / (2 pi N)) (0.004 for V = 6, N = 60,000);
the bound is 0.015, and a wrong rule (accepting every draft, or drawing the next token
from p instead of the residual) is off by 0.1 or more, checked below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpkv_jax.speculative import accept_drafts

V = 6
N = 60_000
TV_BOUND = 0.015


def _dist(rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` random distributions over V tokens, some mass near zero."""
    x = rng.gamma(0.7, size=(n, V))
    return x / x.sum(-1, keepdims=True)


def _emitted(p: np.ndarray, q: np.ndarray, k: int, seed: int, rule=accept_drafts) -> np.ndarray:
    """Run the rule N times with drafts drawn from q; all emitted tokens, concatenated."""
    key_d, key_u = jax.random.split(jax.random.key(seed))
    drafts = jax.random.categorical(key_d, jnp.log(jnp.asarray(q)), shape=(N, k)).astype(jnp.int32)
    uniforms = jax.random.uniform(key_u, (N, k + 1))
    target = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (k + 1, V))
    draft = jnp.broadcast_to(jnp.asarray(q, jnp.float32), (k, V))
    accepted, token = jax.vmap(rule, in_axes=(None, None, 0, 0))(target, draft, drafts, uniforms)
    accepted, token, drafts = map(np.asarray, (accepted, token, drafts))
    out = [drafts[i, : accepted[i]] for i in range(N)]
    return np.concatenate([*out, token]), accepted


def _tv(samples: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.bincount(samples, minlength=V) / samples.size - p).sum())


@pytest.mark.parametrize("k", [1, 3])
def test_every_emitted_token_is_distributed_as_the_target(k):
    """With the same p and q at every position, each emitted token (accepted draft,
    residual draw or bonus) is a draw from p."""
    p, q = _dist(np.random.default_rng(k), 2)
    samples, accepted = _emitted(p, q, k, seed=k)
    assert _tv(samples, p) < TV_BOUND
    # The acceptance rate is sum_x min(p, q) per draft, as the rule promises.
    rate = np.minimum(p, q).sum()
    first = (accepted >= 1).mean()
    assert abs(first - rate) < 0.01
    # A drafter far from the target is still corrected: q's histogram is far from p.
    assert 0.5 * np.abs(p - q).sum() > 0.1


def test_a_wrong_rule_is_caught():
    """Accepting every draft emits q's tokens, not p's: the bound above rejects it."""
    p, q = _dist(np.random.default_rng(7), 2)

    def accept_all(target, draft, drafts, uniforms):
        _, token = accept_drafts(target, draft, drafts, uniforms)
        return jnp.int32(drafts.shape[0]), token

    samples, _ = _emitted(p, q, 3, seed=7, rule=accept_all)
    assert _tv(samples, p) > 5 * TV_BOUND


def test_identical_drafter_accepts_everything():
    p = _dist(np.random.default_rng(3), 1)[0]
    _, accepted = _emitted(p, p, 3, seed=3)
    assert (accepted == 3).all()


def test_one_hot_distributions_are_the_greedy_rule():
    """Temperature 0: accept the longest prefix equal to the target's argmaxes; the next
    token is the target's argmax after it (the rule `MTPSpeculator` applies)."""
    rng = np.random.default_rng(5)
    k = 3
    for _ in range(50):
        greedy = rng.integers(0, V, k + 1)
        drafts = np.where(rng.random(k) < 0.6, greedy[:k], rng.integers(0, V, k))
        target = jax.nn.one_hot(greedy, V)
        draft = jax.nn.one_hot(drafts, V)
        accepted, token = accept_drafts(
            target, draft, jnp.asarray(drafts, jnp.int32), jnp.asarray(rng.random(k + 1))
        )
        a = 0
        while a < k and drafts[a] == greedy[a]:
            a += 1
        assert (int(accepted), int(token)) == (a, int(greedy[a]))
