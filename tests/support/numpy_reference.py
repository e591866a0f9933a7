"""Float64 NumPy oracle for the GLM-5 / DeepSeek-V3.2 model, used by `test_reference_*.py`.

Written from the model definitions, not from `cpkv_jax`: no oracle function calls a
library helper (only the frozen config dataclasses are read), so a shared misconception
between the model and its test cannot hide. Everything is one unbatched sequence,
`[T, ...]`. The harness section at the end holds the glue the tests share (module ->
float64 params, module -> pure function, random inputs).
The indexer's Hadamard rotation is deliberately left out: it is orthogonal, so matching
scores also checks that it changes none.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpkv_jax.config import ModelConfig, RopeConfig
from cpkv_jax.model.layers import LayerNorm, RMSNorm


def f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


# ---- elementwise / norms ------------------------------------------------------------
def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """HF layout: `w` is `[out, in]`."""
    return x @ w.T


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    return linear(silu(linear(x, w_gate)) * linear(x, w_up), w_down)


# ---- rope ---------------------------------------------------------------------------
def yarn_mscale(scale: float, m: float) -> float:
    return 0.1 * m * math.log(scale) + 1.0 if scale > 1.0 else 1.0


def rope_inv_freq(dim: int, rope: RopeConfig) -> tuple[np.ndarray, float]:
    """`inv_freq[i] = theta^(-2i/dim)`, YaRN-blended when on; and the cos/sin magnitude."""
    i = np.arange(dim // 2, dtype=np.float64)
    freq_extra = rope.theta ** (-2.0 * i / dim)
    if rope.rope_type != "yarn":
        return freq_extra, 1.0
    freq_inter = freq_extra / rope.factor
    orig = rope.original_max_position_embeddings

    def corr(beta: float) -> float:
        return dim * math.log(orig / (beta * 2.0 * math.pi)) / (2.0 * math.log(rope.theta))

    low = max(math.floor(corr(rope.beta_fast)), 0)
    high = min(math.ceil(corr(rope.beta_slow)), dim - 1)
    ramp = np.clip((i - low) / max(high - low, 1e-3), 0.0, 1.0)
    inv = freq_inter * ramp + freq_extra * (1.0 - ramp)
    return inv, yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(
        rope.factor, rope.mscale_all_dim
    )


def rope_cos_sin(
    positions: np.ndarray, dim: int, rope: RopeConfig
) -> tuple[np.ndarray, np.ndarray]:
    inv, mscale = rope_inv_freq(dim, rope)
    ang = f64(positions)[..., None] * inv
    return np.cos(ang) * mscale, np.sin(ang) * mscale


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, interleaved: bool) -> np.ndarray:
    """Rotate pair `i` of the last axis by frequency `i`; cos/sin broadcast over `x[..., :d/2]`."""
    d = x.shape[-1]
    out = np.array(x, dtype=np.float64)
    for i in range(d // 2):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
        c, s = cos[..., i], sin[..., i]
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def softmax_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope.rope_type == "yarn":
        scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
    return scale


# ---- MLA ----------------------------------------------------------------------------
def mla_project(p: dict, cfg: ModelConfig, x: np.ndarray, cos: np.ndarray, sin: np.ndarray):
    """`x [T, hidden]` (already input-normed) -> q_nope, q_pe `[T, H, .]`, latent, qr."""
    t, h = x.shape[0], cfg.num_attention_heads
    n, r, lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    qr = rms_norm(
        linear(x, p["q_a_proj"]["weight"]), p["q_a_layernorm"]["weight"], cfg.rms_norm_eps
    )
    q = linear(qr, p["q_b_proj"]["weight"]).reshape(t, h, n + r)
    q_nope = q[..., :n]
    q_pe = rotate(q[..., n:], cos[:, None], sin[:, None], interleaved=True)
    kva = linear(x, p["kv_a_proj_with_mqa"]["weight"])
    c = rms_norm(kva[:, :lora], p["kv_a_layernorm"]["weight"], cfg.rms_norm_eps)
    k_pe = rotate(kva[:, lora:], cos, sin, interleaved=True)
    return q_nope, q_pe, np.concatenate([c, k_pe], axis=-1), qr


def mla_attend(
    q_nope: np.ndarray,
    q_pe: np.ndarray,
    latent: np.ndarray,
    selected: np.ndarray,
    w_kv_b: np.ndarray,
    scale: float,
) -> np.ndarray:
    """Attention of each query over `selected [T, S]` (bool) keys -> `[T, H, v]`.

    `latent [S, lora + r]`, `w_kv_b [H * (n + v), lora]`. A query selecting nothing gives 0.
    """
    h, n = q_nope.shape[1:]
    lora = w_kv_b.shape[1]
    v = w_kv_b.shape[0] // h - n
    c, k_pe = latent[:, :lora], latent[:, lora:]
    kv = linear(c, w_kv_b).reshape(c.shape[0], h, n + v)
    k_nope, val = kv[..., :n], kv[..., n:]
    scores = np.einsum("thn,shn->hts", q_nope, k_nope) + np.einsum("thr,sr->hts", q_pe, k_pe)
    scores = np.where(selected[None], scores * scale, -np.inf)
    out = np.zeros((q_nope.shape[0], h, v))
    rows = selected.any(-1)
    probs = softmax(scores[:, rows], axis=-1)
    out[rows] = np.einsum("hts,shv->thv", probs, val)
    return out


def selection_mask(topk: np.ndarray, n_keys: int) -> np.ndarray:
    """`topk [T, k]` positions (-1 = none) -> `[T, n_keys]` bool."""
    mask = np.zeros((topk.shape[0], n_keys), bool)
    for t, row in enumerate(topk):
        mask[t, row[row >= 0]] = True
    return mask


def causal_mask(positions: np.ndarray, n_keys: int) -> np.ndarray:
    return np.arange(n_keys)[None, :] <= np.asarray(positions)[:, None]


# ---- lightning indexer --------------------------------------------------------------
def indexer_qkw(p: dict, cfg: ModelConfig, x, qr, cos, sin):
    """Indexer queries `[T, Hi, Di]`, keys `[T, Di]` and head weights `[T, Hi]` (no Hadamard)."""
    t = x.shape[0]
    hi, di, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    inter = cfg.model_type == "glm_moe_dsa"  # DeepSeek-V3.2 pairs the two halves instead
    q = linear(qr, p["wq_b"]["weight"]).reshape(t, hi, di)
    q[..., :r] = rotate(q[..., :r], cos[:, None], sin[:, None], interleaved=inter)
    k = layer_norm(linear(x, p["wk"]["weight"]), p["k_norm"]["weight"], p["k_norm"]["bias"])
    k[..., :r] = rotate(k[..., :r], cos, sin, interleaved=inter)
    w = linear(x, p["weights_proj"]["weight"]) * hi**-0.5 * di**-0.5
    return q, k, w


def indexer_scores(q, w, k, positions, kv_len: int | None = None):
    """`score[t, s] = sum_h w[t,h] relu(q[t,h].k[s])`, -inf where `s > pos[t]` or `s >= kv_len`.

    Also returns the per-head logits `[T, Hi, S]` (for near-tie checks).
    """
    logits = np.einsum("thd,sd->ths", q, k)
    scores = np.einsum("ths,th->ts", np.maximum(logits, 0.0), w)
    s = np.arange(k.shape[0])
    allowed = s[None, :] <= np.asarray(positions)[:, None]
    if kv_len is not None:
        allowed &= s[None, :] < kv_len
    return np.where(allowed, scores, -np.inf), logits


def topk(scores: np.ndarray, positions, index_topk: int, width: int) -> np.ndarray:
    """Best `min(index_topk, pos+1)` positions per row, high score first, ties to the lowest
    position (stable sort), `-1` padded to `width`."""
    out = np.full((scores.shape[0], width), -1, np.int64)
    for t, row in enumerate(scores):
        n = min(index_topk, int(positions[t]) + 1)
        out[t, :n] = np.argsort(-row, kind="stable")[:n]
    return out


def topk_margin(scores, logits, positions, index_topk: int, tol: float) -> list[str]:
    """Rows whose top-k set could change under perturbations of size `tol` (empty = robust).

    The boundary between the k-th and (k+1)-th score must be wider than `tol`, unless it is
    an exact ReLU tie at 0 whose members all have every head logit below `-tol` (exact in
    any precision, and broken by position in both implementations).
    """
    fragile = []
    for t, row in enumerate(scores):
        n = min(index_topk, int(positions[t]) + 1)
        finite = np.sort(row[np.isfinite(row)])[::-1]
        if n >= finite.size:
            continue
        kth, nxt = finite[n - 1], finite[n]
        if kth - nxt > tol:
            continue
        near = np.abs(row - kth) <= tol
        exact_zero = (row == 0.0) & np.all(logits[t] < -tol, axis=0)
        if kth == 0.0 and nxt == 0.0 and np.all(exact_zero[near]):
            continue
        fragile.append(f"token {t}: k-th {kth:.3g} vs next {nxt:.3g}")
    return fragile


# ---- MoE ----------------------------------------------------------------------------
def route(
    logits: np.ndarray,
    bias: np.ndarray,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[np.ndarray, np.ndarray]:
    scores = sigmoid(logits)
    n, e = scores.shape
    experts = np.zeros((n, top_k), np.int64)
    weights = np.zeros((n, top_k))
    for i in range(n):
        choice = scores[i] + bias
        if n_group > 1:
            groups = choice.reshape(n_group, e // n_group)
            group_score = np.sort(groups, axis=1)[:, ::-1][:, :2].sum(axis=1)
            keep = np.argsort(-group_score, kind="stable")[:topk_group]
            dropped = np.setdiff1d(np.arange(n_group), keep)
            groups = groups.copy()
            groups[dropped] = -np.inf
            choice = groups.reshape(e)
        experts[i] = np.argsort(-choice, kind="stable")[:top_k]
        w = scores[i, experts[i]]
        if norm_topk_prob:
            w = w / w.sum()
        weights[i] = w * routed_scaling_factor
    return experts, weights


def routed_experts(p: dict, x: np.ndarray, experts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    for i in range(x.shape[0]):
        for e, w in zip(experts[i], weights[i], strict=True):
            out[i] += w * swiglu(x[i], p["gate_proj"][e], p["up_proj"][e], p["down_proj"][e])
    return out


def moe(p: dict, cfg: ModelConfig, x: np.ndarray) -> np.ndarray:
    experts, weights = route(
        linear(x, p["gate"]["weight"]),
        p["gate"]["e_score_correction_bias"],
        top_k=cfg.num_experts_per_tok,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    out = routed_experts(p["experts"], x, experts, weights)
    if "shared_experts" in p:
        s = p["shared_experts"]
        out = out + swiglu(
            x, s["gate_proj"]["weight"], s["up_proj"]["weight"], s["down_proj"]["weight"]
        )
    return out


def mlp(p: dict, x: np.ndarray) -> np.ndarray:
    return swiglu(x, p["gate_proj"]["weight"], p["up_proj"]["weight"], p["down_proj"]["weight"])


# ---- whole model --------------------------------------------------------------------
def causal_lm(
    params: dict,
    cfg: ModelConfig,
    ids: np.ndarray,
    *,
    dense: bool,
    topk_source: dict[int, int] | None = None,
) -> dict:
    """Prefill of one prompt.

    `dense=True` attends causally to everything (the indexer still runs, for inspection).
    A shared layer reuses the top-k of the nearest preceding full layer, or of
    `topk_source[layer]` when given (to check that the choice matters). Returns logits
    `[T, V]`, the final normed hidden states `hidden` `[T, H]` (what the LM head reads),
    per-layer latents `[T, c+r]`, and per full layer its indexer keys, scores, per-head
    logits and top-k.
    """
    t = ids.shape[0]
    pos = np.arange(t)
    cos, sin = rope_cos_sin(pos, cfg.qk_rope_head_dim, cfg.rope)
    m = params["model"]
    x = m["embed_tokens"]["weight"][ids]
    out: dict[str, Any] = {"latent": [], "index": {}}
    for i in range(cfg.num_hidden_layers):
        x = decoder_layer(
            m["layers"][i], cfg, i, x, pos, cos, sin, out, dense=dense, topk_source=topk_source
        )
    x = rms_norm(x, m["norm"]["weight"], cfg.rms_norm_eps)
    out["hidden"] = x
    out["logits"] = linear(x, lm_head(params, cfg))
    return out


def lm_head(params: dict, cfg: ModelConfig) -> np.ndarray:
    m = params["model"]
    return m["embed_tokens"]["weight"] if cfg.tie_word_embeddings else params["lm_head"]["weight"]


def decoder_layer(
    lp: dict,
    cfg: ModelConfig,
    i: int,
    x: np.ndarray,
    pos: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    out: dict,
    *,
    dense: bool,
    topk_source: dict[int, int] | None = None,
) -> np.ndarray:
    """Layer `i` (params `lp`) on `x` `[T, H]` at positions `pos`; appends its latent to
    `out["latent"]` and, for a full indexer layer, its indexer state to `out["index"]`."""
    t = x.shape[0]
    a = lp["self_attn"]
    h = rms_norm(x, lp["input_layernorm"]["weight"], cfg.rms_norm_eps)
    q_nope, q_pe, latent, qr = mla_project(a, cfg, h, cos, sin)
    out["latent"].append(latent)
    if cfg.indexer_types[i] == "full":
        q, k, w = indexer_qkw(a["indexer"], cfg, h, qr, cos, sin)
        scores, logits = indexer_scores(q, w, k, pos)
        sel = topk(scores, pos, cfg.index_topk, min(cfg.index_topk, t))
        out["index"][i] = {"k": k, "scores": scores, "logits": logits, "topk": sel}
        src = i
    else:
        src = max(j for j in out["index"] if j < i)
        src = (topk_source or {}).get(i, src)
    selected = causal_mask(pos, t) if dense else selection_mask(out["index"][src]["topk"], t)
    w_kv_b = a["kv_b_proj"]["weight"]
    o = mla_attend(q_nope, q_pe, latent, selected, w_kv_b, softmax_scale(cfg))
    x = x + linear(o.reshape(t, -1), a["o_proj"]["weight"])
    h = rms_norm(x, lp["post_attention_layernorm"]["weight"], cfg.rms_norm_eps)
    return x + (mlp(lp["mlp"], h) if cfg.mlp_layer_types[i] == "dense" else moe(lp["mlp"], cfg, h))


# ---- harness ------------------------------------------------------------------------
def params_f64(module: nnx.Module) -> dict:
    """The module's state as nested dicts (list indices as int keys) of float64 arrays."""
    return jax.tree.map(f64, nnx.to_pure_dict(nnx.state(module)))


def pure(module: nnx.Module):
    """`(fn(state, *args), state)`: the module as a pure function, for jit/no-jit variants."""
    graphdef, state = nnx.split(module)

    def fn(state, *args):
        return nnx.merge(graphdef, state)(*args)

    return fn, state


def randomize_norms(module: nnx.Module, rng: np.random.Generator) -> None:
    """Norm weights/biases start at 1/0, which would hide a missing or misplaced scale."""
    for _, m in nnx.iter_modules(module):
        if isinstance(m, (RMSNorm, LayerNorm)):
            m.weight[...] = jnp.asarray(
                1.0 + 0.3 * rng.standard_normal(m.weight.shape), jnp.float32
            )
        if isinstance(m, LayerNorm):
            m.bias[...] = jnp.asarray(0.3 * rng.standard_normal(m.bias.shape), jnp.float32)


def normal(rng: np.random.Generator, shape, scale: float = 1.0) -> jax.Array:
    """Fresh float32 N(0, scale^2) input as a jax array (the jaxtyping hook wants jax arrays)."""
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)
