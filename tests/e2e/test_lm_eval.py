"""lm-evaluation-harness, unchanged, scoring a multiple-choice task through our server: its
`local-completions` model sends each context + continuation as token ids with echo, logprobs 1 and
max_tokens 1, and sums `token_logprobs[ctxlen:-1]`. Against the built-in default model, every
choice's loglikelihood, and so the accuracy, equals lm-eval's own `hf` model (transformers,
float32, on the CPU) on the same checkpoint and task. No network: the task is a YAML file over a
jsonl file written here."""
from __future__ import annotations

import json

import pytest

from tests.e2e.server import ServerProcess

TASK = "moe_serve_tiny_mc"
# (question, choices: the answer first): easy enough that a 135M model gets some right.
DOCS = [
    ("What is the capital of France?", ["Paris", "London", "Rome", "Berlin"]),
    ("How many legs does a dog have?", ["four", "two", "six", "eight"]),
    ("What color is the sky on a clear day?", ["blue", "green", "red", "black"]),
    ("Which animal says moo?", ["a cow", "a cat", "a dog", "a bird"]),
    ("Who wrote Romeo and Juliet?", ["William Shakespeare", "Charles Dickens", "Mark Twain", "Jane Austen"]),
    ("Which planet do we live on?", ["Earth", "Mars", "Jupiter", "Venus"]),
    ("What is the largest ocean on Earth?", ["the Pacific Ocean", "the Atlantic Ocean", "the Indian Ocean",
                                             "the Arctic Ocean"]),
    ("How many days are in a week?", ["seven", "five", "ten", "twelve"]),
]


def write_task(folder) -> None:
    rows = []
    for i, (q, choices) in enumerate(DOCS):  # the right answer first in DOCS, moved to place i % 4
        k = i % 4
        rows.append({"question": q, "choices": choices[1:k + 1] + choices[:1] + choices[k + 1:], "answer": k})
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")


def evaluate(model: str, model_args: dict, folder):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=TaskManager(
        include_path=str(folder)), log_samples=True, bootstrap_iters=0, random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0)
    samples = sorted(res["samples"][TASK], key=lambda s: s["doc_id"])
    return res["results"][TASK]["acc,none"], [[r[0] for r in s["resps"]] for s in samples]


@pytest.mark.slow
def test_local_completions_scores_equal_lm_evals_hf_model(default_build, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    path = default_build["path"]
    write_task(tmp_path)
    s = ServerProcess(["--model", path, "--dtype", "float32", "--served-model-name", "default", "--kv-cache-memory",
                       str(64 << 20)])
    try:
        ours_acc, ours = evaluate("local-completions", {
            "base_url": s.url + "/v1/completions", "model": "default", "tokenizer_backend": "huggingface",
            "tokenizer": path, "num_concurrent": 1, "batch_size": 16, "max_retries": 1, "tokenized_requests": True},
            tmp_path)
    finally:
        assert s.stop() == 0
    hf_acc, hf = evaluate("hf", {"pretrained": path, "dtype": "float32", "device": "cpu", "batch_size": 16},
                          tmp_path)

    assert len(ours) == len(hf) == len(DOCS)
    for d, (a, b) in enumerate(zip(ours, hf)):
        assert len(a) == len(b) == 4
        for (ll, greedy), (ll_hf, greedy_hf) in zip(a, b):
            assert ll < 0, f"doc {d}: a loglikelihood of {ll} (the prompt's logprobs were not scored)"
            assert abs(ll - ll_hf) < 1e-3, (d, a, b)
            assert greedy == greedy_hf, (d, a, b)
    assert ours_acc == hf_acc
    assert 0 < hf_acc  # the task separates the choices: a model that knows something scores
