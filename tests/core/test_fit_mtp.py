"""`python -m cpkv_jax.tools.fit_mtp` (issue 39 item 4): the MTP layer fitted to the
trunk's own greedy continuations. A short run: the loss falls, only the MTP layer
changes, and the written checkpoint loads with the fitted layer. (The full run's
acceptance and speed figures are in docs/results.md.)"""

from __future__ import annotations

import json

import chex
import numpy as np
from flax import nnx

from cpkv_jax.model.weights import load_model
from cpkv_jax.tools import fit_mtp


def test_fit_mtp_fits_the_mtp_layer_alone_and_writes_a_loadable_checkpoint(
    tiny_checkpoints, tmp_path, capsys
):
    src = tiny_checkpoints()
    out = tmp_path / "fitted"
    args = ["--sequences", "4", "--prompt-len", "8", "--new-tokens", "8", "--steps", "30"]
    assert fit_mtp.main([str(src), str(out), *args, "--num-steps", "1"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["loss_last"] < 0.5 * report["loss_first"]
    assert report["fitting_prompts"]["acceptance_length_after"] >= 1.0
    _, before = load_model(src, mtp=True)
    _, after = load_model(out, mtp=True)
    # The trunk, embedding and LM head are the source's; the MTP layer is new.
    chex.assert_trees_all_equal(
        nnx.to_pure_dict(nnx.state(after.model.layers[0])),
        nnx.to_pure_dict(nnx.state(before.model.layers[0])),
    )
    chex.assert_trees_all_equal(after.lm_head.weight[...], before.lm_head.weight[...])
    moved = np.abs(np.asarray(after.mtp.eh_proj.weight[...]) - before.mtp.eh_proj.weight[...])
    assert moved.max() > 1e-3
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
