"""Write a tiny random HF-style checkpoint: config, safetensors, byte-level tokenizer.

    python -m cpkv_jax.tools.make_tiny_checkpoint OUT_DIR [--arch glm_moe_dsa|deepseek_v32]
        [--seed N] [--dtype float32|bfloat16]

Weights come from `CausalLM`'s own (fan-in scaled) init with the given seed; every norm
weight is then set to `1 + 0.1 * randn` and every bias to `0.1 * randn`, so a loader that
drops, swaps or re-initializes a norm or bias is caught by output comparisons. The
tokenizer maps `<|bos|>`, `<|eos|>`, `<|pad|>` to ids 0, 1, 2 (the tiny config's ids)
and byte `b` to id `3 + b`, so any UTF-8 text round-trips exactly. `tokenizer_config.json`
carries a small chat template (`CHAT_TEMPLATE`, HF's `chat_template` key) so the chat
API can be served from the tiny model. Same seed, same bytes.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import tokenizers
from flax import nnx
from jax.typing import DTypeLike
from tokenizers import decoders, models, pre_tokenizers

from cpkv_jax.cli_logging import configure_logging
from cpkv_jax.config import ModelConfig
from cpkv_jax.model.kv_cache import DTYPES
from cpkv_jax.model.mtp import MTPLayer
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.model.weights import save_hf_weights
from cpkv_jax.tokenizer import TOKENIZER_FILE
from cpkv_jax.tools.tiny_config import ARCHS, tiny_config_dict

logger = logging.getLogger(__name__)

# FP8 blocks of the tiny checkpoint: the tiny layers (64..320 wide) span several blocks,
# and kv_a_proj's 40 output rows end in a cropped one.
TINY_FP8_BLOCK = (16, 32)
TINY_FP8_SHARD_BYTES = 256 * 1024  # several files, so the index-json path is the one used
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")  # ids 0, 1, 2
BYTE_ID_OFFSET = len(SPECIAL_TOKENS)
# A ChatML-like template: bos once, each message as `<|role|>\ncontent` + eos, then the
# assistant header when a reply is asked for. Role markers are plain bytes here. With
# `tools`, a system turn lists them (JSON) and the call format first; an assistant turn's
# `tool_calls` are rendered in GLM-4.7 / GLM-5 markup (`--tool-call-parser glm47`), and
# `tool` results are turns like any other.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}Call a tool as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE"
    "</arg_value></tool_call>{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>{{ call.function.name }}"
    "{% if call.function.arguments is mapping %}{% for k, v in call.function.arguments.items() %}"
    "<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson }}</arg_value>"
    "{% endfor %}{% endif %}</tool_call>{% endfor %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_byte_tokenizer() -> tokenizers.Tokenizer:
    """Byte-level BPE without merges: specials at 0..2, byte `b` at id `3 + b` (259 ids)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: BYTE_ID_OFFSET + b for b, ch in _bytes_to_unicode().items()})
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    return tok


def write_tokenizer_files(out_dir: str | Path, *, model_max_length: int) -> Path:
    """Write the byte tokenizer (`tokenizer.json`) and `tokenizer_config.json` (special
    tokens and `CHAT_TEMPLATE`) into `out_dir`: the tokenizer half of a tiny checkpoint,
    on its own for tests that need no weights."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_byte_tokenizer().save(str(out / TOKENIZER_FILE))
    bos, eos, pad = SPECIAL_TOKENS
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return out


def random_tiny_model(
    cfg: ModelConfig, *, seed: int = 0, param_dtype: DTypeLike = jnp.float32, mtp: bool = False
) -> CausalLM:
    """`CausalLM(cfg)` with seeded weights and perturbed norms/biases (see module doc);
    `mtp`: with its MTP layer, drawn from its own seed after the trunk, so the trunk's
    weights are the same with or without it."""
    model = CausalLM(cfg, rngs=nnx.Rngs(seed), param_dtype=param_dtype)
    _perturb(model, np.random.default_rng(seed))
    if mtp:
        layer = MTPLayer(cfg, rngs=nnx.Rngs(seed + 1), dtype=jnp.float32, param_dtype=param_dtype)
        _perturb(layer, np.random.default_rng(seed + 1))
        model.model.layers.append(layer)  # `model.layers.{N}`, as checkpoints store it
    return model


def _perturb(module: nnx.Module, rng: np.random.Generator) -> None:
    """Norm weights to `1 + 0.1 * randn`, biases to `0.1 * randn`."""
    updates = []
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        leaf = str(path[-1])
        owner = str(path[-2]) if len(path) > 1 else ""
        if leaf == "weight" and "norm" in owner:
            new = 1.0 + 0.1 * rng.standard_normal(var.shape)
        elif leaf.endswith("bias"):
            new = 0.1 * rng.standard_normal(var.shape)
        else:
            continue
        updates.append((path, var.replace(jnp.asarray(new, dtype=var.dtype))))
    nnx.update(module, nnx.from_flat_state(updates))


def make_tiny_checkpoint(
    out_dir: str | Path,
    arch: str = "glm_moe_dsa",
    *,
    seed: int = 0,
    dtype: str = "float32",
    fp8: bool = False,
    n_routed_experts: int | None = None,
) -> Path:
    """Write config.json, the weights, tokenizer.json, tokenizer_config.json (with a chat
    template).

    `fp8`: the official FP8 format - block-quantized `float8_e4m3fn` weights with
    `weight_scale_inv` (`TINY_FP8_BLOCK`, small enough that the tiny layers span several
    blocks, some cropped), `quantization_config` in config.json, and the weights in
    several `model-0000k-of-0000n.safetensors` files with `model.safetensors.index.json`,
    as the released checkpoints are laid out. `n_routed_experts` overrides the tiny
    config's expert count (e.g. 16, to shard over 8 ranks with 2 experts each).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_config_dict(arch)
    raw["torch_dtype"] = dtype
    if n_routed_experts is not None:
        raw["n_routed_experts"] = n_routed_experts
    if fp8:
        raw["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(TINY_FP8_BLOCK),
        }
    cfg = ModelConfig.from_dict(raw)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")

    # The MTP layer the config declares, as GLM-5's and DeepSeek-V3.2's checkpoints ship it.
    mtp = cfg.num_nextn_predict_layers > 0
    model = random_tiny_model(cfg, seed=seed, param_dtype=DTYPES[dtype], mtp=mtp)
    if fp8:
        save_hf_weights(model, out, max_shard_bytes=TINY_FP8_SHARD_BYTES, fp8_block=TINY_FP8_BLOCK)
    else:
        save_hf_weights(model, out)

    write_tokenizer_files(out, model_max_length=raw["max_position_embeddings"])
    logger.info(
        "wrote tiny %s checkpoint (seed %d, %s%s) to %s", arch, seed, dtype, ", fp8" * fp8, out
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="cpkv-make-tiny-checkpoint", description=__doc__.split("\n", 1)[0]
    )
    parser.add_argument("out_dir", type=Path, help="directory to write the checkpoint into")
    parser.add_argument("--arch", choices=ARCHS, default="glm_moe_dsa", help="model_type")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weight dtype")
    parser.add_argument(
        "--fp8", action="store_true", help="FP8 block-quantized, sharded files + index"
    )
    parser.add_argument("--n-routed-experts", type=int, default=None, help="expert count")
    args = parser.parse_args(argv)
    configure_logging("INFO")
    out = make_tiny_checkpoint(
        args.out_dir,
        args.arch,
        seed=args.seed,
        dtype=args.dtype,
        fp8=args.fp8,
        n_routed_experts=args.n_routed_experts,
    )
    print(f"tiny {args.arch} checkpoint (seed {args.seed}, {args.dtype}) written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
