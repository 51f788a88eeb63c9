import functools
import os
import time

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{architecture: path} of the tiny checkpoints, built once per test run."""
    from tests.checkpoints import BUILDERS

    root = tmp_path_factory.mktemp("ckpt")
    return {name: build(str(root / name)) for name, build in BUILDERS.items()}


@pytest.fixture(scope="session")
def extra_checkpoints(tmp_path_factory):
    """{architecture: path} of tests/checkpoints.py's EXTRA_BUILDERS, each built on first use."""
    from tests.checkpoints import EXTRA_BUILDERS, LazyCheckpoints

    return LazyCheckpoints(tmp_path_factory.mktemp("ckpt_extra"), EXTRA_BUILDERS)


# --- the built-in SmolLM2 MoE (moe_serve/default_model/smollm2.py), built once per session ---------
@pytest.fixture(scope="session")
def smollm2():
    from moe_serve.default_model import smollm2 as module

    return module


@pytest.fixture(scope="session")
def gguf_once(smollm2):
    """Read the GGUF once for the whole session: every builder below would otherwise re-read it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(smollm2, "read_smollm2_gguf", functools.cache(smollm2.read_smollm2_gguf))
        yield smollm2.read_smollm2_gguf()


@pytest.fixture(scope="session")
def dense_dir(smollm2, gguf_once, tmp_path_factory):
    return smollm2.build_dense_reference(str(tmp_path_factory.mktemp("dense") / "smollm2-dense"))


@pytest.fixture(scope="session")
def moe_noise0_dir(smollm2, gguf_once, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("moe0") / "moe-noise0")
    return smollm2.build_smollm2_moe(out, noise=0.0, dtype="float32", self_check=False)


@pytest.fixture(scope="session")
def default_build(smollm2, gguf_once, tmp_path_factory):
    """ensure_default_model() into an empty cache: the real default recipe, self-check included."""
    cache = str(tmp_path_factory.mktemp("cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOE_SERVE_CACHE", cache)
        t0 = time.perf_counter()
        path, description = smollm2.ensure_default_model()
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = smollm2.ensure_default_model()
        reuse_s = time.perf_counter() - t0
    return dict(path=path, description=description, cache=cache, build_s=build_s, again=again, reuse_s=reuse_s)


@pytest.fixture(scope="session")
def default_tool_server(default_build):
    """`moe-serve serve` with no --model (the built-in default model, float32) and auto tool choice
    with the hermes parser, as agent frameworks are served; one per session, shared by the tests
    of agent frameworks and of streams' first chunks."""
    from tests.e2e.server import ServerProcess

    s = ServerProcess(["--dtype", "float32", "--kv-cache-memory", str(64 << 20), "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes"], env={"MOE_SERVE_CACHE": default_build["cache"]})
    yield s
    assert s.stop() == 0
