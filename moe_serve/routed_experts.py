"""Router replay as clients get it: one sequence's routed experts assembled from the engine core's
chunks (`protocol.RoutedExpertRows`, made by moe_serve/engine/features/routed_experts.py), and the
two forms a response carries them in. Pure Python, no torch: the front end imports it.

Contract of the result, per sequence: positions = prompt tokens + generated tokens - 1 (the last
generated token was never fed through the model, as in vLLM's `--enable-return-routed-experts` and
SGLang's `return_routed_experts`); per position, per MoE layer (in layer order, dense layers not
counted), the router's top-k LOGICAL expert ids in ascending order (before replicas or an EPLB
placement map them to physical slots).

- "list": a list over positions of a list over MoE layers of k ints;
- "base64": the little-endian int16 array [positions, MoE layers, k], base64-encoded
  (`numpy.frombuffer(base64.b64decode(s), "<i2").reshape(-1, layers, k)`).
"""
from __future__ import annotations

import base64
import sys
from array import array

FORMATS = ("list", "base64")


def refusal(has_moe_layers: bool) -> str | None:
    """Why `return_routed_experts` cannot be honoured here (None: it can). A disaggregated request
    is honoured: the prefill instance sends its prompt's rows with the KV's answer
    (moe_serve/disagg/messages.py)."""
    if not has_moe_layers:
        return "return_routed_experts: the served model has no MoE layers, so no experts are routed"
    return None


class RoutedExperts:
    """One sequence's rows, in position order, from chunks that may overlap (a chunk starting below
    the end replaces those rows: positions recomputed after a preemption)."""

    def __init__(self):
        self.num_layers = 0
        self.top_k = 0
        self._buf = bytearray()

    @property
    def row_bytes(self) -> int:
        return 2 * self.num_layers * self.top_k

    @property
    def num_positions(self) -> int:
        return len(self._buf) // self.row_bytes if self.row_bytes else 0

    def add(self, chunk) -> None:
        """chunk: a protocol.RoutedExpertRows."""
        self.num_layers, self.top_k = chunk.num_layers, chunk.top_k
        off = chunk.start * self.row_bytes
        if off > len(self._buf):  # the core sends every position in order: a gap is a bug
            raise ValueError(f"routed experts from position {chunk.start}, but only {self.num_positions} are known")
        self._buf[off:off + len(chunk.data)] = chunk.data

    def data(self, positions: int) -> bytes:
        """The first `positions` rows (fewer when fewer are known) as little-endian int16 bytes."""
        return bytes(self._buf[:max(0, positions) * self.row_bytes])

    def as_lists(self, positions: int) -> list[list[list[int]]]:
        ids = array("h")
        ids.frombytes(self.data(positions))
        if sys.byteorder == "big":
            ids.byteswap()
        L, K = self.num_layers, self.top_k
        return [[ids[p * L * K + l * K:p * L * K + (l + 1) * K].tolist() for l in range(L)]
                for p in range(len(ids) // (L * K) if L * K else 0)]

    def as_array(self):
        """Every known position as a numpy int16 array [positions, MoE layers, k] (offline `LLM`)."""
        import numpy as np

        return np.frombuffer(self.data(self.num_positions), dtype="<i2").astype(np.int16).reshape(
            -1, self.num_layers, self.top_k)

    def encoded(self, positions: int, fmt: str = "list"):
        """The response field: nested lists ("list") or a base64 string ("base64")."""
        if fmt == "base64":
            return base64.b64encode(self.data(positions)).decode("ascii")
        return self.as_lists(positions)


def positions_of(num_prompt_tokens: int, num_output_tokens: int) -> int:
    """Positions a finished sequence reports: every token fed through the model."""
    return max(0, num_prompt_tokens + num_output_tokens - 1)
