"""`moe-serve bench serve | throughput | latency`: the real CLI, as a subprocess, against a real server
of ours on a tiny checkpoint (one server for the module) and on the offline engine.

The server runs with --speed-of-light-window 0 so that every decode step closes a speed-of-light
window and the gauge is set while the short loads run."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import httpx
import jsonschema
import pytest

from moe_serve.benchmarks import result_schema
from moe_serve.benchmarks.datasets import random_samples
from moe_serve.benchmarks.serve import FIRST_TOKEN_ID
from tests.e2e.server import ServerProcess

NAME = "tiny-bench"
VOCAB = 512  # tests/checkpoints.py
PNG = b"\x89PNG\r\n\x1a\n"
METRICS = ("ttft", "tpot", "itl", "e2el")


@pytest.fixture(scope="module")
def server(checkpoints):
    s = ServerProcess(["--model", checkpoints["qwen3_moe"], "--dtype", "float32", "--served-model-name", NAME,
                       "--kv-cache-memory", str(8 << 20), "--speed-of-light-window", "0", "--log-interval", "60"])
    yield s
    assert s.stop() == 0


def cli(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moe_serve.entrypoints.cli", "bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def bench_serve(server, tmp_path, name: str, *args: str) -> tuple[dict, str]:
    """Run `bench serve` with a saved result; the result (checked against the shipped schema) and stdout."""
    r = cli("serve", "--base-url", server.url, "--random-vocab-size", str(VOCAB), "--disable-tqdm",
            "--metrics-interval", "0.01", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", f"{name}.json", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads((tmp_path / f"{name}.json").read_text())
    jsonschema.Draft202012Validator(result_schema()).validate(result)
    return result, r.stdout


def check_stats(lv: dict, percentiles=(50, 95, 99)) -> None:
    for m in METRICS:
        if lv.get(f"mean_{m}_ms") is None:
            continue
        ps = [lv[f"p{q}_{m}_ms"] for q in percentiles]
        assert ps == sorted(ps), (m, ps)
        assert lv[f"min_{m}_ms"] <= lv[f"mean_{m}_ms"] <= lv[f"max_{m}_ms"], m
        assert lv[f"min_{m}_ms"] <= ps[0] and ps[-1] <= lv[f"max_{m}_ms"], m
        assert lv[f"median_{m}_ms"] == pytest.approx(lv[f"p50_{m}_ms"]), m
        assert lv[f"std_{m}_ms"] >= 0
    assert lv["request_throughput"] * lv["duration"] == pytest.approx(lv["completed"])
    assert lv["output_throughput"] * lv["duration"] == pytest.approx(lv["total_output_tokens"])
    assert lv["total_token_throughput"] * lv["duration"] == pytest.approx(
        lv["total_input_tokens"] + lv["total_output_tokens"])


def check_ours(lv: dict) -> None:
    """What a level reads off our server's /metrics. The KV usage gauge is sampled (every 10 ms here):
    the loads below keep requests running for tens of ms so that some poll sees them."""
    assert lv["server_kind"] == "moe-serve" and lv["metrics_polls"] >= 2
    assert 0 < lv["peak_kv_cache_usage"] <= 1
    assert lv["decode_speed_of_light_fraction"] > 0
    assert set(lv["decode_speed_of_light_fraction_per_rank"]) == {"0"}
    assert lv["memory_bandwidth_bytes_per_second"] > 0
    assert lv["server_generation_tokens"] == lv["total_output_tokens"]  # nothing else ran meanwhile


def test_random_level_model_from_v1_models(server, tmp_path):
    plot = tmp_path / "level.png"
    result, out = bench_serve(server, tmp_path, "random", "--num-prompts", "12", "--random-input-len", "16",
                              "--random-output-len", "32", "--ignore-eos", "--max-concurrency", "4",
                              "--save-detailed", "--plot", str(plot))
    assert f"model: {NAME} (the first of {server.url}/v1/models)" in out
    assert result["config"]["model"] == NAME and result["server"]["model"] == NAME
    assert result["server"]["kind"] == "moe-serve" and result["server"]["max_model_len"] > 0
    assert result["server"]["memory_bandwidth_bytes_per_second"] > 0
    [lv] = result["levels"]
    assert (lv["completed"], lv["failed"], lv["num_requests"]) == (12, 0, 12)
    assert lv["total_output_tokens"] == 12 * 32 and lv["total_input_tokens"] == 12 * 16
    assert lv["usage_reported"] and lv["max_concurrency"] == 4 and 1 <= lv["max_concurrent_requests"] <= 4
    assert [(q["input_len"], q["output_len"]) for q in lv["requests"]] == [(16, 32)] * 12
    check_stats(lv)
    check_ours(lv)
    assert lv["server_prompt_tokens_computed"] <= lv["total_input_tokens"]
    # the printed summary is the JSON's
    assert re.search(r"Successful requests:\s+12\n", out) and re.search(r"Total generated tokens:\s+384\n", out)
    sol = float(re.search(r"Decode: % of speed of light:\s+([0-9.]+)", out).group(1))
    assert sol == pytest.approx(100 * lv["decode_speed_of_light_fraction"], abs=0.006)
    assert plot.read_bytes()[:8] == PNG and result["plot"] == str(plot)


def test_concurrency_sweep_and_plot(server, tmp_path):
    plot = tmp_path / "sweep.png"
    result, _ = bench_serve(server, tmp_path, "sweep", "--num-prompts", "12", "--random-input-len", "16",
                            "--random-output-len", "16", "--random-range-ratio", "0.5", "--ignore-eos",
                            "--concurrency-sweep", "1,4", "--plot", str(plot), "--seed", "7",
                            "--metric-percentiles", "50,90,99.5")
    assert [lv["max_concurrency"] for lv in result["levels"]] == [1, 4]
    assert result["config"]["concurrency_sweep"] == [1, 4] and result["config"]["max_concurrency"] is None
    assert result["levels"][0]["max_concurrent_requests"] == 1
    for i, lv in enumerate(result["levels"]):
        # each level draws its workload from --seed + level: the same draw here gives the requested lengths
        want = random_samples(12, 16, 16, 0.5, 0, range(FIRST_TOKEN_ID, VOCAB), False, 7 + i)
        assert (lv["completed"], lv["failed"]) == (12, 0)
        assert lv["total_output_tokens"] == sum(s.output_len for s in want)
        assert lv["total_input_tokens"] == sum(s.prompt_len for s in want)
        check_stats(lv, (50, 90, 99.5))
        check_ours(lv)
    assert plot.read_bytes()[:8] == PNG and result["plot"] == str(plot)


def test_sharegpt_file(server, tmp_path):
    human = ["tell me about the river that runs past the old town", "what does the farmer grow on the hill",
             "describe a quiet morning in a small city by the sea", "why do birds sing at the start of the day"]
    gpt = ["the river is long and cold", "corn and wheat, and some apples near the house in the north field",
           "the streets are empty, the sea is calm, and a few boats leave the port before the sun is up",
           "to mark where they live"]
    data = [{"id": str(i), "conversations": [{"from": "human", "value": h}, {"from": "gpt", "value": g}]}
            for i, (h, g) in enumerate(zip(human, gpt))]
    data[1]["conversations"].insert(0, {"from": "system", "value": "be brief"})
    data.append({"id": "no-answer", "conversations": [{"from": "human", "value": "a question left without answer"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    result, _ = bench_serve(server, tmp_path, "sharegpt", "--dataset-name", "sharegpt", "--dataset-path", str(path),
                            "--num-prompts", "4", "--ignore-eos", "--model", NAME, "--max-concurrency", "2")

    def count(text: str) -> int:
        return httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=10).json()["count"]

    [lv] = result["levels"]
    assert (lv["completed"], lv["failed"]) == (4, 0)
    assert lv["total_output_tokens"] == sum(map(count, gpt))  # the gpt turns' lengths, exactly (ignore_eos)
    assert lv["total_input_tokens"] == sum(map(count, human))
    check_stats(lv)


def test_prefix_repetition(server, tmp_path):
    result, _ = bench_serve(server, tmp_path, "prefix", "--dataset-name", "prefix_repetition", "--num-prompts", "8",
                            "--prefix-repetition-prefix-len", "48", "--prefix-repetition-suffix-len", "8",
                            "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "4",
                            "--ignore-eos", "--max-concurrency", "2")
    [lv] = result["levels"]
    assert (lv["completed"], lv["failed"]) == (8, 0)
    assert (lv["total_input_tokens"], lv["total_output_tokens"]) == (8 * 56, 8 * 4)
    # at most the first request of each prefix (and one racing it) computes it: >= 4 x 3 blocks come from the cache
    assert lv["server_prompt_tokens_computed"] <= lv["total_input_tokens"] - 4 * 48
    check_stats(lv)


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions"])
def test_multi_turn(server, tmp_path, endpoint):
    result, _ = bench_serve(server, tmp_path, "multi", "--dataset-name", "multi_turn", "--endpoint", endpoint,
                            "--num-prompts", "3", "--multi-turn-num-turns", "3", "--random-input-len", "12",
                            "--random-output-len", "16", "--ignore-eos", "--max-concurrency", "3", "--save-detailed")
    [lv] = result["levels"]
    assert (lv["completed"], lv["failed"], lv["num_requests"]) == (9, 0, 9)
    assert lv["total_output_tokens"] == 9 * 16
    turns: dict[int, list[dict]] = {}
    for q in lv["requests"]:
        turns.setdefault(q["conversation"], []).append(q)
    assert sorted(turns) == [0, 1, 2]
    for conv in turns.values():
        conv.sort(key=lambda q: q["turn"])
        assert [q["turn"] for q in conv] == [0, 1, 2]
        for a, b in zip(conv, conv[1:]):
            # the next turn resends this one's prompt and answer, plus a new message: longer than both
            assert b["input_len"] > a["input_len"] + a["output_len"], (a, b)
            assert b["start_s"] >= a["start_s"] + a["e2el_ms"] / 1e3 - 1e-3  # sent after this one finished
    # the shared prefixes came from the server's prefix cache
    assert lv["server_prompt_tokens_computed"] < lv["total_input_tokens"]
    assert lv["prefix_cache_hit_rate"] > 0
    check_stats(lv)
    check_ours(lv)


def test_bad_flags_and_unreachable_server(server, tmp_path, monkeypatch, capsys):
    r = cli("serve", "--base-url", server.url, "--dataset-name", "sharegpt")
    assert r.returncode != 0 and "--dataset-path" in r.stderr, r.stderr
    # the same entry point in this process (no second interpreter start-up) for the other two:
    from moe_serve.entrypoints.cli import main

    # without matplotlib, --plot is refused while the flags are parsed, naming the extra to install
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--base-url", server.url, "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--plot" in err and "pip install 'moe-serve[bench]'" in err, err
    assert not (tmp_path / "x.png").exists()
    # no --model and nothing listening: a clear error, not a traceback
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach http://127.0.0.1:9/v1/models" in err and "--model" in err, err


def test_offline_throughput(checkpoints, tmp_path):
    out = tmp_path / "throughput.json"
    r = cli("throughput", "--model", checkpoints["qwen3_moe"], "--dtype", "float32", "--kv-cache-memory",
            str(8 << 20), "--max-num-seqs", "4", "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
            "--disable-tqdm", "--output-json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert (res["num_requests"], res["total_prompt_tokens"], res["total_output_tokens"]) == (6, 6 * 16, 6 * 8)
    t = res["elapsed_time"]
    assert res["output_tokens_per_second"] * t == pytest.approx(6 * 8)
    assert res["requests_per_second"] * t == pytest.approx(6)
    assert res["tokens_per_second"] * t == pytest.approx(6 * 24)
    m = re.search(r"Throughput: ([0-9.]+) requests/s, ([0-9.]+) total tokens/s, ([0-9.]+) output tokens/s", r.stdout)
    assert m, r.stdout
    assert float(m.group(3)) == pytest.approx(res["output_tokens_per_second"], abs=0.006)
    assert res["decode_speed_of_light_fraction"] > 0 and res["decode_steps"] > 0
    assert res["memory_bandwidth_bytes_per_second"] > 0
    assert "Decode speed of light: " in r.stdout


def test_offline_latency(checkpoints, tmp_path):
    out = tmp_path / "latency.json"
    r = cli("latency", "--model", checkpoints["qwen3_moe"], "--dtype", "float32", "--kv-cache-memory", str(8 << 20),
            "--batch-size", "2", "--input-len", "8", "--output-len", "6", "--num-iters-warmup", "1",
            "--num-iters", "4", "--disable-tqdm", "--output-json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    lat = res["latencies"]
    assert len(lat) == 4 and all(x > 0 for x in lat)
    assert min(lat) <= res["avg_latency"] <= max(lat)
    pct = [res["percentiles"][q] for q in ("10", "25", "50", "75", "90", "99")]
    assert pct == sorted(pct) and min(lat) <= pct[0] and pct[-1] <= max(lat)
    avg = float(re.search(r"Avg latency: ([0-9.]+) seconds", r.stdout).group(1))
    assert avg == pytest.approx(res["avg_latency"], abs=1e-6)
    assert res["decode_speed_of_light_fraction"] > 0 and res["decode_steps"] > 0


def test_kv_usage_of_other_servers():
    """vLLM's and SGLang's /metrics: their KV usage gauges are read (no server needed)."""
    from moe_serve.benchmarks.server_metrics import KV_USAGE, first_of, parse_prometheus, server_kind

    for text, kind, kv in [('# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} '
                            '0.25\nvllm:num_requests_running{model_name="m"} 3.0\n', "vllm", 0.25),
                           ('vllm:gpu_cache_usage_perc{model_name="m"} 5e-1\n', "vllm", 0.5),
                           ('sglang:token_usage{model_name="m",tp_rank="0"} 0.125\n', "sglang", 0.125),
                           ('moe_serve:kv_cache_usage_perc{model_name="a b,c=\\"d\\""} 0.75\n', "moe-serve", 0.75)]:
        s = parse_prometheus(text)
        assert server_kind(s) == kind and first_of(s, KV_USAGE[kind]) == kv
    assert server_kind(parse_prometheus("process_cpu_seconds_total 1.5\n")) is None
