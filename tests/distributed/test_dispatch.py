"""Every dispatch backend over real processes (gloo), against the single-process expert computation.

Each world size starts its ranks once (subprocesses on a free port, each in its own session so a
failure can kill the whole tree) and runs every case inside; ranks write their findings to a JSON file
that the test reads. A case builds the same global inputs on every rank from one seed, then checks:
  routing   the rows a backend delivers to this rank are exactly the tokens (of every rank) with at
            least one slot held here, with local ids (-1 elsewhere) and their weights;
  pipeline  dispatch -> fused_experts_reference on this rank's experts -> combine equals (a)
            fused_experts_reference on this rank's tokens with all experts and global ids, and (b) the
            same pipeline through the reference dispatcher.
Run directly as `python tests/distributed/test_dispatch.py --worker OUT` it is one rank (env from the parent).
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
WORKER_TIMEOUT_S = 150  # whole world, start to finish; the cases take ~10-30 s on 2 cores
COLLECTIVE_TIMEOUT_S = 60
HAS_DEEP_EP = importlib.util.find_spec("deep_ep") is not None


# ----------------------------------------------------------------------------- cases (run in ranks)

@dataclass(frozen=True)
class Case:
    name: str
    num_slots: int
    top_k: int
    tokens_per_rank: tuple[int, ...]
    allowed_slots: tuple[int, ...] | None = None  # route only to these (others get zero tokens)
    hidden: int = 16
    ffn: int = 8
    dtype: torch.dtype = torch.float32
    seed: int = 0


def make_cases(W: int) -> list[Case]:
    g = torch.Generator().manual_seed(1234 + W)

    def ragged(lo=0, hi=20):
        return tuple(int(v) for v in torch.randint(lo, hi + 1, (W,), generator=g))

    cases = [Case(f"ragged_k{k}", 16, k, ragged(), seed=k) for k in range(1, 9)]
    zero_one = list(ragged(3, 12))
    zero_one[W - 1] = 0
    cases += [
        Case("rank_without_tokens", 16, 4, tuple(zero_one), seed=20),
        Case("no_tokens_anywhere", 16, 2, (0,) * W, seed=21),
        # Only rank 0's slots are routed to: every other rank receives R = 0 rows and all experts
        # but rank 0's have zero tokens.
        Case("only_rank0_experts", 16, 2, ragged(1, 9), tuple(range(16 // W)), seed=22),
        Case("two_slots_only", 16, 2, ragged(1, 9), (0, 15), seed=23),
        Case("one_slot_per_rank_all_ranks", W, W, ragged(1, 9), seed=24),
        Case("many_slots", 64, 8, ragged(20, 40), seed=25),
        Case("wide_hidden", 16, 3, ragged(10, 30), hidden=64, ffn=32, seed=26),
        Case("bf16", 16, 4, ragged(5, 15), dtype=torch.bfloat16, seed=27),
    ]
    return cases


def make_deepep_cases(W: int) -> list[Case]:
    """DeepEP's low-latency kernels support only some hidden sizes (2048 is one), and T above its
    max_low_latency_tokens (128) switches "auto" to the normal kernels, so both are covered."""
    g = torch.Generator().manual_seed(99 + W)
    T = lambda lo, hi: tuple(int(v) for v in torch.randint(lo, hi + 1, (W,), generator=g))
    return [
        Case("deepep_low_latency", 16, 8, T(0, 64), hidden=2048, ffn=64, seed=40),
        Case("deepep_low_latency_only_rank0", 16, 2, T(1, 32), tuple(range(16 // W)), hidden=2048, ffn=64, seed=41),
        Case("deepep_normal", 16, 8, T(130, 300), hidden=2048, ffn=64, seed=42),
        Case("deepep_normal_rank_without_tokens", 16, 4, T(130, 200)[:-1] + (0,), hidden=2048, ffn=64, seed=43),
    ]


def make_inputs(case: Case, W: int):
    """The whole world's inputs, identical on every rank: weights and per-rank (x, ids, weights)."""
    g = torch.Generator().manual_seed(case.seed)
    E, D, F, K = case.num_slots, case.hidden, case.ffn, case.top_k
    # Scaled so every output is O(1) at any D and F, which keeps one tolerance meaningful.
    w13_EFD = (torch.randn(E, 2 * F, D, generator=g) / D ** 0.5).to(case.dtype)
    w2_EDF = (torch.randn(E, D, F, generator=g) / F ** 0.5).to(case.dtype)
    allowed = torch.tensor(case.allowed_slots if case.allowed_slots is not None else range(E))
    per_rank = []
    for T in case.tokens_per_rank:
        x_TD = torch.randn(T, D, generator=g).to(case.dtype)
        # top-k distinct slots per token: the first K of a random permutation of the allowed slots
        order = torch.rand(T, len(allowed), generator=g).argsort(dim=1)[:, :K]
        ids_TK = allowed[order]
        w_TK = torch.softmax(torch.randn(T, K, generator=g), dim=1)
        per_rank.append((x_TD, ids_TK, w_TK))
    return w13_EFD, w2_EDF, per_rank


def expected_rows(disp, per_rank):
    """What this rank must receive: tokens of every rank with a slot held here, local ids, weights."""
    xs, ids, ws = [], [], []
    for x_TD, ids_TK, w_TK in per_rank:
        local = disp.to_local_ids(ids_TK)
        keep = (local >= 0).any(dim=1)
        xs.append(x_TD[keep]), ids.append(local[keep]), ws.append(w_TK[keep])
    return torch.cat(xs), torch.cat(ids), torch.cat(ws)


def canonical(x_RD, ids_RK, w_RK):
    """Rows sorted by their token values: the contract fixes which rows arrive, not their order."""
    order = torch.argsort(x_RD[:, 0].float() * 1e6 + x_RD[:, 1].float(), stable=True)
    w = torch.where(ids_RK >= 0, w_RK.float(), torch.zeros_like(w_RK, dtype=torch.float32))
    return x_RD[order], ids_RK[order].to(torch.int64), w[order]


def run_pipeline(disp, case, w13_EFD, w2_EDF, x_TD, ids_TK, w_TK):
    from moe_serve.kernels.grouped_gemm.reference import fused_experts_reference
    lo, hi = disp.rank * disp.slots_per_rank, (disp.rank + 1) * disp.slots_per_rank
    out = disp.dispatch(x_TD, ids_TK, w_TK)
    y_RD = fused_experts_reference(out.x_RD, w13_EFD[lo:hi], w2_EDF[lo:hi], out.topk_weights_RK,
                                   out.topk_ids_RK)
    return out, disp.combine(y_RD, out.handle)


def run_cases(rank: int, W: int, group, device, backends: list[str]) -> tuple[int, list[str]]:
    from expert_parallel.runtime.dispatch import make_dispatcher
    from moe_serve.kernels.grouped_gemm.reference import fused_experts_reference
    checks, failures = 0, []

    def check(ok: bool, what: str):
        nonlocal checks
        checks += 1
        if not ok:
            failures.append(f"rank {rank}: {what}")

    cases = make_deepep_cases(W) if "deepep" in backends else make_cases(W)
    dispatchers = {}
    for case in cases:
        w13, w2, per_rank = make_inputs(case, W)
        w13, w2 = w13.to(device), w2.to(device)
        per_rank = [tuple(t.to(device) for t in inputs) for inputs in per_rank]
        x_TD, ids_TK, w_TK = per_rank[rank]
        want_TD = fused_experts_reference(x_TD, w13, w2, w_TK, ids_TK)  # (a): one process, global ids
        results = {}
        for name in ["reference"] + [b for b in backends if b != "reference"]:
            key = (name, case.num_slots)
            if key not in dispatchers:  # reuse across cases: state must not leak between calls
                dispatchers[key] = make_dispatcher(name, case.num_slots, rank, W, group)
            disp = dispatchers[key]
            out, y_TD = run_pipeline(disp, case, w13, w2, x_TD, ids_TK, w_TK)
            tag = f"{case.name} [{name}]"
            # DeepEP moves tokens as bf16, so it gets bf16 tolerances even for float32 inputs.
            bf16 = case.dtype == torch.bfloat16 or name == "deepep"
            tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-5, atol=1e-5)
            check(y_TD.shape == x_TD.shape and y_TD.dtype == x_TD.dtype,
                  f"{tag}: combine gave {tuple(y_TD.shape)} {y_TD.dtype}, want {tuple(x_TD.shape)} {x_TD.dtype}")
            if name != "deepep":  # DeepEP's low-latency layout repeats tokens per expert by design
                got = canonical(out.x_RD, out.topk_ids_RK, out.topk_weights_RK)
                want = canonical(*expected_rows(disp, per_rank))
                same = (got[0].shape == want[0].shape and torch.equal(got[0], want[0])
                        and torch.equal(got[1], want[1]) and torch.allclose(got[2], want[2], atol=1e-7))
                check(same, f"{tag}: received rows differ (got {tuple(got[0].shape)}, want {tuple(want[0].shape)})")
                check(out.topk_weights_RK.dtype == torch.float32, f"{tag}: weights are {out.topk_weights_RK.dtype}")
            if y_TD.shape == want_TD.shape:
                err = (y_TD.float() - want_TD.float()).abs().max().item() if y_TD.numel() else 0.0
                check(torch.allclose(y_TD.float(), want_TD.float(), **tol),
                      f"{tag}: combine vs single-process experts, max abs err {err:.3g}")
                if name != "reference":
                    check(torch.allclose(y_TD.float(), results["reference"].float(), **tol),
                          f"{tag}: combine vs reference dispatcher pipeline")
            results[name] = y_TD
    return checks, failures


def worker_main(out_path: str) -> int:
    """One rank. MOE_TEST_DIST_BACKEND (gloo|nccl) and MOE_TEST_DISPATCHERS (comma list) from the parent."""
    sys.path.insert(0, str(REPO))
    torch.set_num_threads(1)
    result = {"rank": int(os.environ.get("RANK", -1)), "checks": 0, "failures": [], "error": None}
    try:
        import torch.distributed as dist
        from expert_parallel.runtime.groups import destroy_process_groups, init_process_groups
        backend = os.environ["MOE_TEST_DIST_BACKEND"]
        groups = init_process_groups(backend, timeout_s=COLLECTIVE_TIMEOUT_S)
        W = groups.world_size
        # The control group is a separate working gloo group over the same ranks.
        probe = torch.ones(1)
        dist.all_reduce(probe, group=groups.cpu_group)
        assert probe.item() == W, probe
        assert groups.device.type == ("cuda" if backend == "nccl" else "cpu"), groups
        dispatchers = os.environ["MOE_TEST_DISPATCHERS"].split(",")
        result["checks"], result["failures"] = run_cases(groups.rank, W, groups.ep_group, groups.device,
                                                         dispatchers)
        dist.barrier(group=groups.cpu_group)
        destroy_process_groups(groups)
    except BaseException:
        result["error"] = traceback.format_exc()
    Path(out_path).write_text(json.dumps(result))
    return 0 if result["error"] is None else 1


# ----------------------------------------------------------------------------- launcher (in pytest)

from tests.e2e.server import free_port  # noqa: E402,F401 (the distributed tests import it from here too)


def kill_tree(proc: subprocess.Popen) -> None:
    # Each rank leads its own session, so its process group holds everything it started.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def launch_world(world_size: int, tmp: Path, backend: str, dispatchers: list[str],
                 timeout_s: float = WORKER_TIMEOUT_S) -> list[dict]:
    """Start `world_size` ranks, wait (bounded), kill leftovers, return each rank's result dict."""
    port = free_port()
    procs, outs, logs = [], [], []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   MOE_TEST_DIST_BACKEND=backend, MOE_TEST_DISPATCHERS=",".join(dispatchers),
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        out = tmp / f"rank{rank}.json"
        log = open(tmp / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(out)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        outs.append(out)
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise AssertionError(f"world {world_size} did not finish in {timeout_s} s; logs in {tmp}")
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(1.0)  # let the failing rank's peers report too, then stop them
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
            p.wait(timeout=10)
        for log in logs:
            log.close()
    results = []
    for rank, out in enumerate(outs):
        if not out.exists():
            tail = (tmp / f"rank{rank}.log").read_text()[-3000:]
            raise AssertionError(f"rank {rank} wrote no result (exit {procs[rank].returncode}):\n{tail}")
        results.append(json.loads(out.read_text()))
    return results


def assert_world_passed(results: list[dict]) -> None:
    errors = [f"rank {r['rank']}:\n{r['error']}" for r in results if r["error"]]
    assert not errors, "\n".join(errors)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} failed checks:\n" + "\n".join(failures[:40])
    assert all(r["checks"] > 20 for r in results), [r["checks"] for r in results]


@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_backends_match_single_process(world_size, tmp_path):
    assert_world_passed(launch_world(world_size, tmp_path, "gloo", ["all_to_all", "allgather", "reference"]))


def _need_gpus(n: int) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        pytest.skip(f"needs {n} CUDA devices for an NCCL world of {n}, found {have}")


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatch_backends_over_nccl(world_size, tmp_path):
    _need_gpus(world_size)
    assert_world_passed(launch_world(world_size, tmp_path, "nccl", ["all_to_all", "allgather", "reference"]))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_DEEP_EP, reason="deep_ep is not importable; install "
                                            "DeepEP (README.md: Installing DeepEP) on a multi-GPU CUDA machine to test it")
@pytest.mark.parametrize("world_size", [2, 4])
def test_deepep_matches_reference(world_size, tmp_path):
    _need_gpus(world_size)
    assert_world_passed(launch_world(world_size, tmp_path, "nccl", ["deepep", "reference"]))


def test_reference_dispatcher_at_ep1_needs_no_process_group():
    from expert_parallel.runtime.dispatch import make_dispatcher
    from moe_serve.kernels.grouped_gemm.reference import fused_experts_reference
    case = Case("ep1", 8, 3, (9,))
    w13, w2, [(x_TD, ids_TK, w_TK)] = make_inputs(case, 1)
    disp = make_dispatcher("reference", 8, 0, 1, None)
    _, y_TD = run_pipeline(disp, case, w13, w2, x_TD, ids_TK, w_TK)
    torch.testing.assert_close(y_TD, fused_experts_reference(x_TD, w13, w2, w_TK, ids_TK))


def test_init_process_groups_single_process_and_bad_backend(monkeypatch):
    from expert_parallel.runtime.groups import init_process_groups
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    groups = init_process_groups("gloo")
    assert (groups.rank, groups.world_size, groups.ep_group, groups.device.type) == (0, 1, None, "cpu")
    with pytest.raises(ValueError, match=r"backend='mpi' is not one of 'nccl', 'gloo' or None"):
        init_process_groups("mpi")


@pytest.mark.skipif(HAS_DEEP_EP, reason="deep_ep is installed; the error path cannot be reached")
def test_deepep_without_package_names_the_fix():
    from expert_parallel.runtime.dispatch.deepep import DeepEPDispatcher
    with pytest.raises(RuntimeError, match=r"all2all_backend='deepep' needs the deep_ep package and a "
                                           r"CUDA device; it builds from source against NVSHMEM \(README.md: Installing DeepEP\)"):
        DeepEPDispatcher(8, 0, 2, None)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2]))
    sys.exit(f"usage: {sys.argv[0]} --worker OUT_JSON (normally started by pytest)")
