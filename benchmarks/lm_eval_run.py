"""lm-evaluation-harness against a unified server, as its users run it (issue 37).

    python -m benchmarks.lm_eval_run --lm-eval /path/to/venv/bin/lm_eval
        [--model-dir .demo/tiny-glm5] [--json benchmarks/results/lm_eval_cpu.json]

lm-eval needs torch and transformers, which this project does not depend on: install it
in a venv of its own (`pip install lm-eval transformers`, torch's CPU wheel) and pass its
`lm_eval`. The run starts `cpkv-serve` (unified, the radix cache on) on the tiny
checkpoint on 127.0.0.1 and points lm-eval's `local-completions` model at its
`/v1/completions`, with the checkpoint's own tokenizer (`tokenizer_backend=huggingface`:
the prompts go as token-id lists, which SGLang's gateway would refuse), over two tasks
written here on local data (no dataset download):

- `cpkv_choice` (`output_type: multiple_choice`): log-likelihood requests, each
  `echo: true, logprobs: 1, max_tokens: 0` or `1` with the context and a continuation:
  the prompt log-probs this server computes;
- `cpkv_until` (`output_type: generate_until`): greedy generation until a newline.

The checkpoint's weights are random, so the scores mean nothing; what is checked is that
both tasks run to the end with every request answered. It prints (and with `--json`
writes) lm-eval's results and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import emit
from serving.demo import Proc, free_port, wait_healthy

CHOICES = [
    {"question": "The page lives on the rank that", "choices": [" owns it", " reads it"]},
    {"question": "Prefill runs on", "choices": [" eight ranks", " one rank", " no rank"]},
    {"question": "A radix cache reuses", "choices": [" prefixes", " suffixes"]},
    {"question": "Decode reads the top", "choices": [" k rows", " of the hill"]},
    {"question": "KV pages move to the decode server by", "choices": [" position", " luck"]},
    {"question": "The indexer scores", "choices": [" every token", " no token"]},
]
for _doc in CHOICES:
    _doc["answer"] = 0
UNTIL = [
    {"question": "Q: what does CP stand for?\nA:", "answer": " context parallel"},
    {"question": "Q: what does KV stand for?\nA:", "answer": " key value"},
    {"question": "Q: what does MoE stand for?\nA:", "answer": " mixture of experts"},
    {"question": "Q: what does PD stand for?\nA:", "answer": " prefill decode"},
]

TASKS = {
    "cpkv_choice": """task: cpkv_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""",
    "cpkv_until": """task: cpkv_until
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def write_tasks(root: Path) -> Path:
    """The two tasks and their data under `root`; returns the include path."""
    tasks = root / "tasks"
    tasks.mkdir(parents=True)
    for name, docs in (("cpkv_choice", CHOICES), ("cpkv_until", UNTIL)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tasks / f"{name}.yaml").write_text(TASKS[name].format(data=data))
    return tasks


def check_loglikelihoods(model_dir: Path, samples: Path) -> dict:
    """Each log-likelihood lm-eval got from the server against the single-device
    reference's teacher-forced float64 log-probs (`ReferenceGenerator.prompt_logprobs`)
    of the same tokens: the context's ids, then the rest of the context + continuation's
    (lm-eval's `_encode_pair`), and whether every continuation token is the argmax."""
    import numpy as np

    from cpkv_jax.generate import ReferenceGenerator
    from cpkv_jax.model.weights import load_model
    from cpkv_jax.tokenizer import load_tokenizer

    cfg, model = load_model(model_dir, progress=False)
    ref = ReferenceGenerator(cfg, model)
    tok = load_tokenizer(model_dir)
    assert tok is not None
    diffs, greedy_agree, n = [], 0, 0
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for args, (ll, greedy) in zip(
            sample["arguments"].values(), sample["filtered_resps"], strict=True
        ):
            ctx, cont = args["arg_0"], args["arg_1"]
            ctx_ids, whole = tok.encode(ctx), tok.encode(ctx + cont)
            lps, tops = ref.prompt_logprobs(whole, top_n=1)
            tail = slice(len(ctx_ids) - 1, None)
            want = float(np.sum(lps[tail]))
            rest = whole[len(ctx_ids) :]
            want_greedy = all(t[0][0] == w for t, w in zip(tops[tail], rest, strict=True))
            diffs.append(abs(float(ll) - want))
            greedy_agree += (greedy == "True") == want_greedy
            n += 1
    return {
        "requests": n,
        "max_abs_loglikelihood_diff": max(diffs),
        "is_greedy_agrees": greedy_agree,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lm_eval_run", description=__doc__)
    ap.add_argument("--lm-eval", required=True, help="the lm_eval executable of its own venv")
    ap.add_argument("--model-dir", type=Path, default=Path(".demo/tiny-glm5"))
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from cpkv_jax.tools.make_tiny_checkpoint import make_tiny_checkpoint

    if not (args.model_dir / "config.json").is_file():
        make_tiny_checkpoint(args.model_dir, "glm_moe_dsa")
    model_dir = args.model_dir.resolve()
    with tempfile.TemporaryDirectory(prefix="cpkv-lm-eval-") as tmp:
        root = Path(tmp)
        include = write_tasks(root)
        port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        server = Proc(
            "lm-eval-server",
            [
                sys.executable, "-m", "serving.launch", "--model-path", str(model_dir),
                "--served-model-name", "tiny", "--port", str(port), "--dtype", "float32",
            ],
            root,
            env,
        )  # fmt: skip
        try:
            wait_healthy(f"http://127.0.0.1:{port}", [server], 600.0)
            model_args = ",".join(
                [
                    "model=tiny",
                    f"base_url=http://127.0.0.1:{port}/v1/completions",
                    "tokenizer_backend=huggingface",
                    f"tokenizer={model_dir}",
                    f"num_concurrent={args.concurrency}",
                    "max_retries=1",
                ]
            )
            out = root / "out"
            cmd = [
                args.lm_eval, "--model", "local-completions", "--model_args", model_args,
                "--tasks", "cpkv_choice,cpkv_until", "--include_path", str(include),
                "--output_path", str(out), "--log_samples",
            ]  # fmt: skip
            t0 = time.monotonic()
            run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
            wall = time.monotonic() - t0
            sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
            results = sorted(out.rglob("results_*.json"))
            report: dict = {
                "lm_eval_exit_code": run.returncode,
                "wall_s": round(wall, 1),
                "model_dir": str(model_dir),
            }
            if results:
                data = json.loads(results[-1].read_text())
                report["results"] = data.get("results")
                report["n_samples"] = data.get("n-samples")
                report["lm_eval_version"] = data.get("lm_eval_version")
            samples = sorted(out.rglob("samples_*.jsonl"))
            choice = [p for p in samples if "cpkv_choice" in p.name]
            if choice:
                report["vs_reference"] = check_loglikelihoods(model_dir, choice[0])
            report["samples"] = {p.name.split("_20")[0]: sum(1 for _ in p.open()) for p in samples}
        finally:
            code = server.stop()
        report["server_exit_code"] = code
        emit(report, args.json)
        ok = run.returncode == 0 and bool(results) and code == 0
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
