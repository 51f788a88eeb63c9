"""Multi-process launch: `torchrun ... -m launcher serve ...` on every node, one process per device."""
