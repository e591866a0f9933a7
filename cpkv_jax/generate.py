"""Reference generation: single-device prefill + decode through the paged KV cache.

This is the correctness oracle for every later path (CP prefill, transfer, serving):
they must reproduce its greedy tokens and log-probs.

    python -m cpkv_jax.generate --model-path DIR --prompt "hello" --max-new-tokens 8 \
        [--dtype float32|bfloat16] [--index-k-dtype fp8_e4m3|bfloat16|float32] \
        [--temperature T] [--seed S] [--page-size P] [--output-json PATH] \
        [--cp-size N [--enable-cp-shared-kv] [--chunked-prefill-size N]] [--enable-batch-invariant]

Prefill runs the absorbed MLA form over the whole prompt (length bucketed to a power of
two so recompiles stay bounded); decode runs it one token at a time, reading only the
selected top-k latent rows from the pool (`PagedKVIO`).
`--enable-batch-invariant` (see `cpkv_jax.model.numerics`) runs every step with batch-invariant
numerics, so a CP prefill and a single-device prefill give bitwise-equal KV, logits and
so `--output-json`.
`output_logprobs[i]` is the log-probability of `output_ids[i]` under the model's
(untempered, unpenalized) next-token distribution; with `top_logprobs=N`,
`output_top_logprobs[i]` is that distribution's N most likely (token, log-prob) pairs,
found on the host by a stable sort (ties to the lower id): the reference for the device
sampler's `top_k`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpkv_jax.buckets import pow2_at_least
from cpkv_jax.cli_logging import configure_logging
from cpkv_jax.config import CPConfig, ModelConfig
from cpkv_jax.cp_prefill import CPPrefillRunner, pages_per_rank_for
from cpkv_jax.errors import CpkvError, InputError, name_flags
from cpkv_jax.mesh import make_cp_mesh
from cpkv_jax.model.forward_batch import ForwardBatch, prefill_batch
from cpkv_jax.model.kv_cache import DTYPES, INDEX_K_DTYPES, IndexKDtype, KVPool, init_pool
from cpkv_jax.model.transformer import CausalLM, forward_step, log_probs
from cpkv_jax.model.weights import load_model
from cpkv_jax.paging import PageAllocator, padded_page_table, pages_for_tokens, slots_for_positions
from cpkv_jax.pallas.paged_gather import GatherImpl
from cpkv_jax.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "length" | "stop"
    prefill_seconds: float
    decode_seconds: float
    output_top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(
        default_factory=list
    )


@dataclasses.dataclass(frozen=True)
class CPPrefillOptions:
    """Run the prefill on the CP mesh (`--cp-size`, `--enable-cp-shared-kv`, ...)."""

    cp_size: int
    shared_kv: bool = False
    chunked_prefill_size: int | None = None
    gather_impl: GatherImpl = "xla"


@jax.jit
def _write_full_view(pool: KVPool, view: KVPool, pages: jax.Array) -> KVPool:
    """Copy a request's full view (leaves `[tokens, ...]`) into `pool` pages, in order."""

    def put(leaf, rows):
        page = leaf.shape[1]
        n = pages.shape[0]
        padded = jnp.zeros((n * page, *rows.shape[1:]), leaf.dtype).at[: rows.shape[0]].set(rows)
        return leaf.at[pages].set(padded.reshape((n, page, *rows.shape[1:])))

    return jax.tree_util.tree_map(put, pool, view)


class ReferenceGenerator:
    """Single-request, single-device generation with a paged KV pool."""

    def __init__(
        self,
        cfg: ModelConfig,
        model: CausalLM,
        *,
        page_size: int = 64,
        index_k_dtype: IndexKDtype = "fp8_e4m3",
        batch_invariant: bool = False,
    ):
        if index_k_dtype not in INDEX_K_DTYPES:
            raise InputError(
                f"index K dtype {index_k_dtype!r} is not one of {sorted(INDEX_K_DTYPES)}"
            )
        if page_size < 1:
            raise InputError(f"page size must be >= 1, got {page_size}")
        self.cfg = cfg
        self.page_size = page_size
        self.index_k_dtype = index_k_dtype
        self.batch_invariant = batch_invariant
        # Every serving path prefills in the absorbed form (the CP prefill's), so does the
        # oracle; the expanded form is checked against it in the model tests only.
        self.prefill_form = "absorbed"
        self.dtype = model.dtype
        self.graphdef, self.state = nnx.split(model)

    def validate_prompt(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        cfg = self.cfg
        if len(prompt_ids) == 0:
            raise InputError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise InputError(f"token id(s) {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        total = len(prompt_ids) + max_new_tokens
        if total > cfg.max_position_embeddings:
            raise InputError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                f"exceeds max_position_embeddings={cfg.max_position_embeddings}; "
                "shorten the prompt or ask for fewer tokens"
            )

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        seed: int = 0,
        ignore_eos: bool = False,
        cp_prefill: CPPrefillOptions | None = None,
        top_logprobs: int = 0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: dict[int, float] | None = None,
        allowed: Callable[[list[int]], np.ndarray | None] | None = None,
    ) -> GenerationResult:
        """Prefill then decode. With `cp_prefill`, the prompt is prefilled on the CP mesh
        (shared or replicated pools, optionally chunked) and decoding continues here,
        single-device, from the materialized full view. `allowed(output so far)` (a
        grammar's, for structured output) gives the tokens the next one may be (bool
        `[vocab]`: the others are never drawn), or None when the output is complete
        (finish "stop")."""
        self.validate_prompt(prompt_ids, max_new_tokens)
        if temperature < 0:
            raise InputError(f"temperature must be >= 0, got {temperature}")
        p = self.page_size
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        n_pages = pages_for_tokens(len(prompt) + max_new_tokens, p)
        width = pow2_at_least(n_pages)
        allocator = PageAllocator(width + 1)
        pages = allocator.alloc(n_pages)
        table = padded_page_table(pages, width)
        pool = init_pool(self.cfg, width + 1, p, self.dtype, self.index_k_dtype)

        t0 = time.perf_counter()
        if cp_prefill is None:
            logits, pool = self._prefill_single_device(prompt, table, pool)
        else:
            logits, pool = self._prefill_cp(prompt, pages, pool, cp_prefill)
        logprobs = np.asarray(log_probs(jnp.asarray(logits), self.batch_invariant))
        raw = np.asarray(logits, np.float64).reshape(-1)
        prefill_s = time.perf_counter() - t0
        logger.info("prefill: %d tokens in %.3fs", len(prompt), prefill_s)

        rng = np.random.default_rng(seed)
        out_ids: list[int] = []
        out_lp: list[float] = []
        out_top: list[tuple[tuple[int, float], ...]] = []
        counts = np.zeros(self.cfg.vocab_size, np.float64)  # output tokens so far
        in_prompt = np.zeros(self.cfg.vocab_size, bool)
        in_prompt[prompt] = True
        bias = np.zeros(self.cfg.vocab_size, np.float64)
        for token, value in (logit_bias or {}).items():
            bias[token] += value
        finish = "length"
        t1 = time.perf_counter()
        for i in range(max_new_tokens):
            keep = None if allowed is None else allowed(out_ids)
            if allowed is not None and keep is None:
                finish = "stop"
                break
            # Penalties in vLLM's order, in float64: the logit bias, the repetition
            # penalty on the logits of tokens in the prompt or the output, then OpenAI's
            # frequency and presence penalties, a shift. The reported log-probs stay
            # unpenalized.
            base = logprobs + bias
            if repetition_penalty != 1.0:
                z = raw + bias
                seen = in_prompt | (counts > 0)
                z = np.where(
                    seen, np.where(z > 0, z / repetition_penalty, z * repetition_penalty), z
                )
                base = z - z.max() - np.log(np.exp(z - z.max()).sum())
            shifted = base - frequency_penalty * counts - presence_penalty * (counts > 0)
            if keep is not None:
                shifted = np.where(keep, shifted, -np.inf)
            tok = self._sample(shifted, temperature, rng)
            counts[tok] += 1
            out_ids.append(tok)
            out_lp.append(float(logprobs[tok]))
            if top_logprobs:
                best = np.argsort(-logprobs, kind="stable")[:top_logprobs]
                out_top.append(tuple((int(t), float(logprobs[t])) for t in best))
            if not ignore_eos and tok in self.cfg.eos_token_ids:
                finish = "stop"
                break
            if i == max_new_tokens - 1:
                break
            pos = len(prompt) + i
            slot = slots_for_positions(table, np.asarray([pos]), p)
            logits, pool = self._step(
                np.asarray([[tok]], np.int32),
                np.asarray([[pos]], np.int32),
                np.ones((1, 1), bool),
                slot[None],
                table,
                pos + 1,
                pool,
                "absorbed",
            )
            logprobs = np.asarray(log_probs(logits[0], self.batch_invariant))
            raw = np.asarray(logits[0], np.float64)
        decode_s = time.perf_counter() - t1
        logger.info(
            "decode: %d tokens in %.3fs (%.1f tok/s)",
            len(out_ids),
            decode_s,
            len(out_ids) / max(decode_s, 1e-9),
        )
        return GenerationResult(out_ids, out_lp, finish, prefill_s, decode_s, out_top)

    def prompt_logprobs(
        self, prompt_ids: Sequence[int], top_n: int = 0
    ) -> tuple[list[float], list[tuple[tuple[int, float], ...]]]:
        """Teacher-forced log-probs of prompt tokens 1..n-1, each given the tokens before
        it: the single-device prefill's logits at every position, log-softmaxed in float64
        here; with `top_n`, each position's most likely tokens (ties: lower id first)."""
        self.validate_prompt(prompt_ids, 1)
        p = self.page_size
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        n_pages = pages_for_tokens(len(prompt), p)
        width = pow2_at_least(n_pages)
        table = padded_page_table(PageAllocator(width + 1).alloc(n_pages), width)
        pool = init_pool(self.cfg, width + 1, p, self.dtype, self.index_k_dtype)
        batch = prefill_batch(prompt, table, p)
        logits, _ = self._forward(batch, pool, self.prefill_form, all_logits=True)
        z = np.asarray(logits[0, : len(prompt) - 1], np.float64)
        z = z - z.max(axis=-1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        chosen = lp[np.arange(len(prompt) - 1), prompt[1:]]
        tops = []
        for row in lp if top_n else ():
            best = np.argsort(-row, kind="stable")[:top_n]
            tops.append(tuple((int(t), float(row[t])) for t in best))
        return chosen.tolist(), tops

    def _prefill_single_device(self, prompt: np.ndarray, table: np.ndarray, pool: KVPool):
        batch = prefill_batch(prompt, table, self.page_size)
        logits, pool = self._forward(batch, pool, self.prefill_form)
        return logits[0], pool

    def _prefill_cp(
        self, prompt: np.ndarray, pages: np.ndarray, pool: KVPool, opts: CPPrefillOptions
    ):
        """CP prefill, then copy the request's full view into this device's decode pool."""
        cp = CPConfig(
            cp_size=opts.cp_size,
            shared_kv=opts.shared_kv,
            page_size=self.page_size,
            chunked_prefill_size=opts.chunked_prefill_size,
        )
        mesh = make_cp_mesh(opts.cp_size)
        runner = CPPrefillRunner(
            self.cfg,
            nnx.merge(self.graphdef, self.state),
            mesh,
            cp,
            pages_per_rank=pages_per_rank_for(len(prompt), self.page_size, cp),
            index_k_dtype=self.index_k_dtype,
            gather_impl=opts.gather_impl,
            batch_invariant=self.batch_invariant,
        )
        result = runner.prefill([prompt], opts.chunked_prefill_size)
        view = runner.full_view(result.tables[0])
        logger.info(
            "CP prefill: cp=%d shared_kv=%s chunk=%s, %d pages per rank (%s)",
            opts.cp_size,
            opts.shared_kv,
            opts.chunked_prefill_size,
            runner.layout.pages_per_rank,
            "page-owned" if opts.shared_kv else "replicated",
        )
        n_prompt_pages = pages_for_tokens(len(prompt), self.page_size)
        target = jnp.asarray(pages[:n_prompt_pages])
        pool = _write_full_view(pool, view, target)
        return result.last_logits[0], pool

    def _step(self, ids, positions, valid, slots, table, kv_len, pool, form):
        batch = ForwardBatch(
            input_ids=jnp.asarray(ids),
            positions=jnp.asarray(positions),
            valid=jnp.asarray(valid),
            write_slots=jnp.asarray(slots, jnp.int32),
            page_table=jnp.asarray(table[None]),
            kv_lens=jnp.asarray([kv_len], jnp.int32),
        )
        return self._forward(batch, pool, form)

    def _forward(self, batch: ForwardBatch, pool: KVPool, form: str, *, all_logits: bool = False):
        return forward_step(
            self.graphdef,
            self.state,
            batch,
            pool,
            index_k_dtype=self.index_k_dtype,
            form=form,
            all_logits=all_logits,
            invariant=self.batch_invariant,
        )

    @staticmethod
    def _sample(logprobs: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
        if temperature == 0.0:
            return int(np.argmax(logprobs))
        z = logprobs.astype(np.float64) / temperature
        probs = np.exp(z - z.max())
        return int(rng.choice(len(probs), p=probs / probs.sum()))


def parse_prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise InputError(f"--prompt-ids must be comma-separated integers, got {text!r}") from e


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m cpkv_jax.generate",
        description="Single-device reference generation (prefill + paged decode).",
    )
    ap.add_argument("--model-path", required=True, help="HF model dir (config.json, safetensors)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model dir)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--index-k-dtype", choices=sorted(INDEX_K_DTYPES), default="fp8_e4m3")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--page-size", type=int, default=64)
    cp = ap.add_argument_group("context-parallel prefill")
    cp.add_argument("--cp-size", type=int, default=1, help="prefill on a cp mesh of N devices")
    cp.add_argument(
        "--enable-cp-shared-kv",
        action="store_true",
        help="store each KV page only on its owner rank (default: replicated pools)",
    )
    cp.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="prefill in chunks of N tokens (floored to whole pages)",
    )
    cp.add_argument(
        "--kernel-impl",
        choices=["xla", "pallas"],
        default="xla",
        help="materialization gather: XLA or the Pallas kernel",
    )
    ap.add_argument(
        "--enable-batch-invariant",
        action="store_true",
        help="batch-invariant numerics: CP and single-device prefill give the same bits "
        "(slower; see cpkv_jax/model/numerics.py)",
    )
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--json-model-override-args", default="", help="JSON merged into config.json")
    ap.add_argument("--output-json", type=Path, help="write {output_ids, output_logprobs} here")
    ap.add_argument("--log-level", default="INFO")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        cfg, model = load_model(
            args.model_path,
            dtype=DTYPES[args.dtype],
            json_model_override_args=args.json_model_override_args,
        )
        tokenizer = load_tokenizer(args.model_path)
        if args.prompt is not None:
            if tokenizer is None:
                raise InputError(
                    f"--prompt needs {args.model_path}/tokenizer.json; use --prompt-ids instead"
                )
            prompt_ids = tokenizer.encode(args.prompt)
        else:
            prompt_ids = parse_prompt_ids(args.prompt_ids)
        gen = ReferenceGenerator(
            cfg,
            model,
            page_size=args.page_size,
            index_k_dtype=args.index_k_dtype,
            batch_invariant=args.enable_batch_invariant,
        )
        cp_opts = None
        if args.cp_size > 1 or args.enable_cp_shared_kv or args.chunked_prefill_size:
            CPConfig(
                cp_size=args.cp_size,
                shared_kv=args.enable_cp_shared_kv,
                page_size=args.page_size,
                chunked_prefill_size=args.chunked_prefill_size,
            ).validate(cfg, device_count=jax.device_count())
            cp_opts = CPPrefillOptions(
                args.cp_size, args.enable_cp_shared_kv, args.chunked_prefill_size, args.kernel_impl
            )
        result = gen.generate(
            prompt_ids,
            args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            cp_prefill=cp_opts,
        )
    except CpkvError as e:
        flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
        flags |= {"shared_kv": "--enable-cp-shared-kv"}  # CPConfig's name for it
        print(f"error: {name_flags(str(e), flags)}", file=sys.stderr)
        return 2
    print(f"prompt ids ({len(prompt_ids)}): {prompt_ids}")
    print(
        f"output ids ({len(result.output_ids)}, finish={result.finish_reason}): {result.output_ids}"
    )
    if tokenizer is not None:
        print(f"output text: {tokenizer.decode(result.output_ids)!r}")
    print(
        f"prefill {result.prefill_seconds:.2f}s, decode {result.decode_seconds:.2f}s "
        f"({len(result.output_ids) / max(result.decode_seconds, 1e-9):.1f} tok/s); "
        "wall time, first-call XLA compiles included"
    )
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(
            json.dumps(
                {"output_ids": result.output_ids, "output_logprobs": result.output_logprobs},
                indent=1,
            )
        )
        print(f"wrote {args.output_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
