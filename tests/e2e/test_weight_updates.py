"""Weights replaced while serving, from a trainer's broadcast and from disk, and sleep / wake, on a
live single-process server; the oracle is transformers run on the same weights. Every streamed
chunk names the weights that made its tokens, exactly where an update lands mid-stream."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import threading

import httpx
import pytest
import torch

from tests.e2e.server import ServerProcess, free_port

PROMPTS = [[5, 77, 301, 42] * 3, [9, 8, 7, 6, 5, 4, 3, 200, 100], [450, 12, 13]]
KV_BYTES = 32 << 20
N = 8


@pytest.fixture(scope="module")
def base(checkpoints):
    return checkpoints["qwen3_moe"]


@pytest.fixture(scope="module")
def server(base):
    s = ServerProcess(["--model", base, "--dtype", "float32", "--kv-cache-memory", str(KV_BYTES)])
    yield s
    assert s.stop() == 0


def _tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def _write(base: str, dest: str, tensors: dict) -> str:
    from safetensors.torch import save_file

    shutil.copytree(base, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dest, "model.safetensors"))
    return dest


def _perturbed(base: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 0.5 * v.std() * torch.randn(v.shape, generator=g)).to(v.dtype) if v.dim() >= 2 else v
            for k, v in _tensors(base).items()}


def _hf(path: str, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for q in prompts:  # greedy, past an end-of-text token as the server's ignore_eos
        ids = list(q)
        with torch.no_grad():
            for _ in range(N):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(q):])
    return out


def _texts(path: str, ids: list[list[int]]) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return [tok.decode(i, skip_special_tokens=True) for i in ids]


def _served(s: ServerProcess) -> list[str]:
    out = []
    for q in PROMPTS:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": q, "max_tokens": N, "temperature": 0,
                                                       "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def _post(s: ServerProcess, path: str, body: dict | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(s.url + path, json=body or {}, timeout=timeout)


class Stream(threading.Thread):
    """One streamed completion; `tokens` grows with each chunk's tokens (their text, from logprobs),
    `versions` with each token's chunk's weight_version."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.tokens, self.versions, self.finish, self.error, self.id = [], [], None, None, None
        self.first = threading.Event()

    def run(self):
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "logprobs": 0}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    self.id, choice = chunk["id"], chunk["choices"][0]
                    self.tokens += choice["logprobs"]["tokens"]
                    self.versions += [chunk["weight_version"]] * len(choice["logprobs"]["tokens"])
                    self.finish = choice["finish_reason"] or self.finish
                    if len(self.tokens) >= 2:
                        self.first.set()
        except Exception as e:  # noqa: BLE001 - the test reports it
            self.error = e
        finally:
            self.first.set()


def greedy(model, cache, last: int, n: int) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            o = model(torch.tensor([[last]]), past_key_values=cache, use_cache=True)
            cache, last = o.past_key_values, int(o.logits[0, -1].argmax())
            out.append(last)
    return out


def switched(old, new, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `ids` by `new` over the KV cache `old` wrote for all of
    `ids` but the last token (what the engine holds when the update lands between two steps)."""
    with torch.no_grad():
        cache = old(torch.tensor([ids[:-1]]), use_cache=True).past_key_values
    return greedy(new, cache, ids[-1], n)


def check_switched(base: str, pushed: str, s: Stream, old_version: str, new_version: str, at_least: int) -> list[int]:
    """The stream `s`'s token ids, once checked against transformers: while its chunks say
    old_version, the old weights' greedy tokens; from the first chunk that says new_version (at
    least `at_least` tokens in), the new weights' over the KV cache the old ones wrote."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = s.versions.index(new_version) if new_version in s.versions else len(s.versions)
    assert s.versions == [old_version] * p + [new_version] * (len(s.versions) - p), s.versions
    assert at_least <= p < len(s.tokens), (at_least, p, "the update did not land mid-stream")
    tok = AutoTokenizer.from_pretrained(base)
    old = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(pushed, dtype=torch.float32).eval()
    ids = switched(old, old, s.prompt, p)
    ids += switched(old, new, s.prompt + ids, s.max_tokens - p)
    assert [tok.decode([i], skip_special_tokens=False) for i in ids] == s.tokens
    return ids


def test_trainer_broadcast_between_pause_and_continue(server, base, tmp_path):
    from moe_serve.weight_sync import broadcast_tensors, trainer_group

    assert _served(server) == _texts(base, _hf(base))
    new = _perturbed(base, 1)
    names = sorted(new)
    spec = {"names": names, "dtypes": [str(new[n].dtype) for n in names], "shapes": [list(new[n].shape) for n in names]}
    assert _post(server, "/pause_generation").status_code == 200
    port = free_port()
    with cf.ThreadPoolExecutor(2) as pool:
        join = pool.submit(_post, server, "/init_weights_update_group",
                           {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                            "group_name": "rl", "backend": "gloo"})
        group = trainer_group("127.0.0.1", port, 2, "rl", "gloo", timeout_s=60)
        assert join.result(timeout=90).status_code == 200
        # Refused before anything is broadcast, naming the tensor; the trainer then sends nothing.
        for field, bad, word in [("names", "model.no_such.weight", "no_such"), ("dtypes", "torch.float16", "float16"),
                                 ("shapes", [1, 2], "[1, 2]")]:
            body = {k: list(v) for k, v in spec.items()}
            body[field][3] = bad
            r = _post(server, "/update_weights_from_distributed", body)
            assert r.status_code == 400 and names[3] in r.json()["message"] or "no_such" in r.json()["message"], r.text
            assert word in r.json()["message"] and r.json()["error"]["param"] == field
        push = pool.submit(_post, server, "/update_weights_from_distributed", {**spec, "weight_version": "step-1"})
        broadcast_tensors(group, [new[n] for n in names])
        r = push.result(timeout=120)
        assert r.status_code == 200 and r.json()["weight_version"] == "step-1", r.text
    assert _post(server, "/continue_generation").status_code == 200
    want = _texts(base, _hf(_write(base, str(tmp_path / "pushed"), new)))
    assert _served(server) == want
    r = _post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0})
    assert r.json()["weight_version"] == "step-1"
    assert httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["weight_version"] == "step-1"


def test_update_from_disk_and_refusals_keep_the_old_weights(server, base, tmp_path):
    new = _perturbed(base, 2)
    good = _write(base, str(tmp_path / "good"), new)
    name = sorted(new)[5]
    bad_shape = _write(base, str(tmp_path / "bad_shape"), {**new, name: new[name].reshape(-1)})
    bad_dtype = _write(base, str(tmp_path / "bad_dtype"), {**new, name: new[name].half()})
    extra = _write(base, str(tmp_path / "extra"), {**new, "model.extra.weight": torch.zeros(2, 2)})
    before = _served(server)
    for path, word in [(str(tmp_path / "nowhere"), "nowhere"), (bad_shape, name), (bad_dtype, name),
                       (extra, "model.extra.weight")]:
        r = _post(server, "/update_weights_from_disk", {"model_path": path})
        assert r.status_code == 400 and word in r.json()["message"], r.text
    assert _served(server) == before
    r = _post(server, "/update_weights_from_disk", {"model_path": good, "flush_cache": True})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] not in ("0", None)
    assert _served(server) == _texts(base, _hf(good))
    r = _post(server, "/update_weights_from_disk", {"model_path": good, "bogus": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"
    assert _post(server, "/update_weights_from_disk", {"model_path": base}).status_code == 200
    assert _post(server, "/flush_cache").status_code == 200


def _chunks(s: ServerProcess, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", s.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_every_streamed_chunk_carries_the_weight_version(server, base, tmp_path):
    version = httpx.get(server.url + "/get_weight_version", timeout=10).json()["weight_version"]
    usage = {"max_tokens": 4, "stream_options": {"include_usage": True}}
    for path, body in [("/v1/completions", {"prompt": PROMPTS[0], "echo": True, **usage}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **usage})]:
        chunks = _chunks(server, path, body)
        assert len(chunks) >= 3 and chunks[-1]["usage"] is not None  # role/echo, tokens, usage
        assert [c["weight_version"] for c in chunks] == [version] * len(chunks)
    # An update between two of a stream's steps: the chunks say which weights made their tokens.
    pushed = _write(base, str(tmp_path / "mid"), _perturbed(base, 3))
    stream = Stream(server.url, PROMPTS[1], 400)  # long enough to be running when the pause lands
    stream.start()
    try:
        assert stream.first.wait(120) and stream.error is None, stream.error
        seen = len(stream.tokens)
        assert _post(server, "/pause_generation").status_code == 200
        r = _post(server, "/update_weights_from_disk", {"model_path": pushed, "weight_version": "mid-3"})
        assert r.status_code == 200, r.text
        assert stream.is_alive() and stream.finish is None
    finally:
        assert _post(server, "/continue_generation").status_code == 200
        stream.join(120)
    assert not stream.is_alive() and stream.error is None and stream.finish == "length", stream.error
    check_switched(base, pushed, stream, version, "mid-3", seen)
    assert _post(server, "/update_weights_from_disk", {"model_path": base}).status_code == 200


def _rss(s: ServerProcess) -> int:
    import psutil

    pid = httpx.get(s.url + "/ranks", timeout=10).json()["ranks"][0]["pid"]
    return psutil.Process(pid).memory_info().rss


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_memory_back_and_wake_serves_the_same(server, base, level):
    weight_bytes = sum(t.numel() * t.element_size() for t in _tensors(base).values())
    before_text = _served(server)
    before = _rss(server)
    r = httpx.post(server.url + f"/sleep?level={level}", timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/is_sleeping", timeout=10).json() == {"is_sleeping": True}
    drop = before - _rss(server)
    want = KV_BYTES * 0.97 + (weight_bytes * 0.8 if level == 2 else 0)
    assert drop >= want, (drop, want, r.json())
    r = _post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 503 and "asleep" in r.json()["message"]
    assert _post(server, "/wake_up").status_code == 200
    assert httpx.get(server.url + "/is_sleeping", timeout=10).json() == {"is_sleeping": False}
    assert _served(server) == before_text
