"""Structured-output overhead at load: output tokens/s with --concurrency requests in flight
through HTTP, every request unconstrained vs half of them under a JSON schema (target: the mixed
run at >= 0.9x the plain one).

Both runs send the same prompts with the same max_tokens. The plain half has ignore_eos (exact
lengths); the schema (default: an object with one free string) lets a random or real model write
up to max_tokens, so both runs produce about the same number of tokens and tokens/s compares the
engine's work per token. A warm-up request compiles the schema first (compiled once per server and
spec), so the measurement is the per-step cost: bitmask fill on the host, masking on the device,
matcher advance.

    python bench/structured.py --launch --model default --concurrency 32 --num-requests 128
    python bench/structured.py --base-url http://127.0.0.1:8000 --model my-model --output-len 256

Writes bench/results/structured_<model>_<time>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import httpx  # noqa: E402

from bench.serve import WORDS, Server, log  # noqa: E402

DEFAULT_SCHEMA = {"type": "object", "properties": {"summary": {"type": "string"}}, "required": ["summary"]}


async def one(client: httpx.AsyncClient, args, prompt: str, schema: dict | None) -> tuple[int, str]:
    body = {"model": args.served_model, "prompt": prompt, "max_tokens": args.output_len,
            "temperature": args.temperature, "seed": random.randrange(1 << 30)}
    if schema is None:
        body["ignore_eos"] = True
    else:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"the server answered {r.status_code}: {r.text[:500]}")
    out = r.json()
    return out["usage"]["completion_tokens"], out["choices"][0]["finish_reason"]


async def run(args, prompts: list[str], schema: dict | None, constrained_every: int) -> dict:
    sem = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=args.base_url, headers=args.headers, timeout=args.request_timeout) as c:
        await one(c, args, prompts[0], schema)  # warm-up (and the grammar's compile)

        async def job(i: int, p: str):
            async with sem:
                s = schema if schema is not None and constrained_every and i % constrained_every == 0 else None
                return (s is not None,) + await one(c, args, p, s)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(job(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
    tokens = sum(n for _, n, _ in results)
    return {"requests": len(results), "constrained": sum(c for c, _, _ in results), "output_tokens": tokens,
            "wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 2),
            "constrained_finish": sorted({f for c, _, f in results if c})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name; with --launch the checkpoint ('default', a path, "
                                                 "or a bench/synthetic_models.py name)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--input-len", type=int, default=64, help="prompt words")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--schema", default=None, help="JSON schema file (default: an object with a free string)")
    p.add_argument("--seed", type=int, default=0)
    srv = p.add_argument_group("--launch (our server)")
    srv.add_argument("--launch", action="store_true")
    srv.add_argument("--dtype", default=None)
    srv.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    srv.add_argument("--max-num-seqs", type=int, default=64)
    srv.add_argument("--server-threads", type=int, default=None)
    srv.add_argument("--server-args", default="")
    srv.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    schema = json.loads(Path(args.schema).read_text()) if args.schema else DEFAULT_SCHEMA
    rng = random.Random(args.seed)
    random.seed(args.seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(args.input_len)) for _ in range(args.num_requests)]
    server, info = None, {}
    if args.launch:
        from bench.synthetic_models import resolve_model

        path, name, desc = resolve_model(args.model or "default")
        args.served_model = name
        info = {"model_path": path, "description": desc}
        server = Server(args, path)
        args.base_url = server.base_url
    try:
        if server is not None:
            server.wait_ready(args.startup_timeout)
        elif args.model is None:
            args.served_model = httpx.get(args.base_url + "/v1/models", headers=args.headers).json()["data"][0]["id"]
        else:
            args.served_model = args.model
        plain = asyncio.run(run(args, prompts, None, 0))
        log(f"plain:      {plain}")
        mixed = asyncio.run(run(args, prompts, schema, 2))
        log(f"half JSON:  {mixed}")
    finally:
        if server is not None:
            server.stop()
    ratio = mixed["output_tok_s"] / plain["output_tok_s"]
    log(f"mixed / plain output tok/s = {ratio:.3f}  (target >= 0.9)")
    result = {"model": args.served_model, **info, "concurrency": args.concurrency, "num_requests": args.num_requests,
              "input_len": args.input_len, "output_len": args.output_len, "temperature": args.temperature,
              "schema": schema, "plain": plain, "half_json_schema": mixed, "ratio": round(ratio, 4)}
    out = Path(args.out) if args.out else HERE / "results" / (
        f"structured_{args.served_model.replace('/', '_')}_{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
