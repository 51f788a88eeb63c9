import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{architecture: path} of the tiny checkpoints, built once per test run."""
    from tests.checkpoints import BUILDERS

    root = tmp_path_factory.mktemp("ckpt")
    return {name: build(str(root / name)) for name, build in BUILDERS.items()}
