"""Reference generation: input validation, determinism, and the CLI end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from cpkv_jax.buckets import prefill_bucket
from cpkv_jax.config import ModelConfig
from cpkv_jax.errors import InputError
from cpkv_jax.generate import ReferenceGenerator, main
from cpkv_jax.model.transformer import CausalLM
from cpkv_jax.tools.tiny_config import tiny_config_dict

# Among the longest files of the suite: scheduled first (tests/conftest.py).
pytestmark = pytest.mark.slow(seconds=33)  # on 2 workers, 2026-12-05


@pytest.fixture(scope="module")
def generator():
    cfg = ModelConfig.from_dict(tiny_config_dict("glm_moe_dsa"))
    return ReferenceGenerator(cfg, CausalLM(cfg, rngs=nnx.Rngs(3)), page_size=16)


def test_bucket_is_power_of_two_with_floor():
    assert [prefill_bucket(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]


@pytest.mark.parametrize(
    ("prompt", "max_new", "match"),
    [
        ([], 4, "prompt is empty"),
        ([5, 320, 7], 4, r"token id\(s\) \[320\] outside the vocabulary \[0, 320\)"),
        ([-1], 4, "outside the vocabulary"),
        ([5] * 4090, 10, "exceeds max_position_embeddings=4096"),
        ([5, 6], 0, "max_new_tokens must be >= 1"),
    ],
)
def test_bad_prompts_raise_input_error(generator, prompt, max_new, match):
    with pytest.raises(InputError, match=match):
        generator.generate(prompt, max_new)


def test_greedy_is_deterministic_and_logprobs_are_log_probabilities(generator):
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 300, 21)]
    a = generator.generate(prompt, 6, ignore_eos=True)
    b = generator.generate(prompt, 6, ignore_eos=True)
    assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
    assert len(a.output_ids) == 6 and a.finish_reason == "length"
    assert all(lp <= 0.0 for lp in a.output_logprobs)


def test_sampling_is_seeded(generator):
    prompt = [10, 11, 12, 13]
    a = generator.generate(prompt, 5, temperature=1.0, seed=4, ignore_eos=True)
    b = generator.generate(prompt, 5, temperature=1.0, seed=4, ignore_eos=True)
    assert a.output_ids == b.output_ids


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoints):
    return tiny_checkpoints("glm_moe_dsa")


def test_cli_writes_output_json_and_matches_library(tiny_dir, tmp_path, capsys):
    def run(prompt: list[str], out: Path) -> int:
        common = ["--max-new-tokens", "5", "--page-size", "16", "--ignore-eos"]
        return main(["--model-path", str(tiny_dir), *prompt, *common, "--output-json", str(out)])

    out = tmp_path / "out.json"
    assert run(["--prompt", "hello, paged world"], out) == 0
    data = json.loads(out.read_text())
    assert len(data["output_ids"]) == 5 and len(data["output_logprobs"]) == 5
    assert "output text:" in capsys.readouterr().out
    # Same tokens from ids (the byte tokenizer encodes without specials).
    from cpkv_jax.tokenizer import load_tokenizer

    ids = load_tokenizer(tiny_dir).encode("hello, paged world")
    assert run(["--prompt-ids", ",".join(map(str, ids))], tmp_path / "ids.json") == 0
    assert json.loads((tmp_path / "ids.json").read_text()) == data


def test_cli_bad_input_exits_2_with_message(tiny_dir, capsys):
    rc = main(["--model-path", str(tiny_dir), "--prompt-ids", "1,x", "--max-new-tokens", "2"])
    assert rc == 2
    assert "must be comma-separated integers" in capsys.readouterr().err
    long_prompt = ",".join(["5"] * 4097)
    rc = main(["--model-path", str(tiny_dir), "--prompt-ids", long_prompt])
    assert rc == 2
    assert "exceeds max_position_embeddings" in capsys.readouterr().err


@pytest.mark.parametrize(
    "cp_flags",
    [
        ["--cp-size", "8", "--enable-cp-shared-kv"],
        ["--cp-size", "8", "--enable-cp-shared-kv", "--chunked-prefill-size", "40"],
        ["--cp-size", "8"],
    ],
)
def test_cli_cp_prefill_matches_single_device(tiny_dir, tmp_path, cp_flags):
    """CP prefill (shared or replicated pools, chunked) then single-device decode gives the
    reference's greedy tokens; log-probs within 1e-5 (CP ranks run other matmul shapes)."""
    common = [
        "--model-path",
        str(tiny_dir),
        "--prompt-ids",
        ",".join(str(3 + i % 250) for i in range(77)),
    ]
    common += ["--max-new-tokens", "6", "--page-size", "16", "--ignore-eos"]
    assert main([*common, "--output-json", str(tmp_path / "ref.json")]) == 0
    assert main([*common, *cp_flags, "--output-json", str(tmp_path / "cp.json")]) == 0
    ref = json.loads((tmp_path / "ref.json").read_text())
    got = json.loads((tmp_path / "cp.json").read_text())
    assert got["output_ids"] == ref["output_ids"]
    np.testing.assert_allclose(got["output_logprobs"], ref["output_logprobs"], atol=1e-5)


def test_cli_batch_invariant_cp_prefill_gives_the_same_json(tiny_dir, tmp_path):
    """`--enable-batch-invariant` (SPEC S1.5): the CP run writes byte-identical `--output-json`
    to the single-device run - same tokens and the same float32 log-probs, not close ones
    (each CP rank computes 8 rows of a 40-token chunk, one device 256 rows at once)."""
    common = [
        "--model-path",
        str(tiny_dir),
        "--prompt-ids",
        ",".join(str(3 + i * 7 % 290) for i in range(133)),
    ]
    common += [
        "--max-new-tokens",
        "4",
        "--page-size",
        "16",
        "--ignore-eos",
        "--enable-batch-invariant",
    ]
    assert main([*common, "--output-json", str(tmp_path / "ref.json")]) == 0
    cp = ["--cp-size", "8", "--enable-cp-shared-kv", "--chunked-prefill-size", "40"]
    assert main([*common, *cp, "--output-json", str(tmp_path / "cp.json")]) == 0
    assert (tmp_path / "cp.json").read_bytes() == (tmp_path / "ref.json").read_bytes()


def test_cli_rejects_shared_kv_without_cp(tiny_dir, capsys):
    rc = main(["--model-path", str(tiny_dir), "--prompt-ids", "5,6", "--enable-cp-shared-kv"])
    assert rc == 2
    assert "--enable-cp-shared-kv needs --cp-size > 1" in capsys.readouterr().err
