"""Rank 0's front-end process, seen from the rank: start it, stop it on a failure, wait for it."""
from __future__ import annotations

import logging
import subprocess

log = logging.getLogger("moe_serve.launcher")


def start_frontend(serve_argv: list[str], world_size: int, bind_host: str) -> tuple[subprocess.Popen, list[int], int]:
    """The front end (HTTP, tokenization, output processing) for a job of world_size cores, its
    sockets bound on bind_host; returns (its process, the ports each core sends to, the port it
    sends from)."""
    from moe_serve.entrypoints.openai.launch import spawn_frontend

    return spawn_frontend(serve_argv, world_size, bind_host)


def stop_frontend(proc, reason: str, out_addr: str, timeout_s: float = 3.0) -> None:
    """Stop rank 0's front end and reap it, before this process ends on a failure it cannot
    recover from: the front end hears why as a core failure (its streams end with the reason),
    and is killed if it has not exited within timeout_s. torchrun signals only the workers still
    running, so a front end left behind would outlive the job, its HTTP port held."""
    if proc.poll() is not None:
        return
    try:
        import zmq

        from moe_serve.protocol import CoreFatal, input_encoder

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 500)
        sock.connect(out_addr)
        sock.send(input_encoder.encode(CoreFatal(0, reason)), zmq.NOBLOCK)
        sock.close()
        ctx.term()
    except Exception as e:  # it is stopped below either way
        log.warning("could not tell the front end why the job stops: %s", e)
        proc.terminate()
    wait_process(proc, timeout_s)


def wait_process(proc, timeout_s: float = 30.0) -> int:
    """proc's exit code, killing it if it has not exited within timeout_s."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)
