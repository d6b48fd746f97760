"""One process per rank for the tests that run a split over real torch.distributed ranks: gloo on CPUs,
NCCL on GPUs (rank r on cuda:r). `spawn_ranks(worker, T, *args)` starts T spawned processes running
`worker(rank, T, port, queue, *args)`, each sending its result with `put_result(queue, rank, payload)`,
and returns the payloads in rank order; `init_rank` is the worker's first line. Payloads travel as
torch.save bytes: a tensor sent through the queue itself is a shared-memory handle that fails once its
process has exited."""
from __future__ import annotations

import io
import os
import socket

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, T: int, port: int, backend: str, timeout_s: float = 300) -> str:
    """Joins the default process group as `rank` of T on one intra-op thread; returns the rank's device.
    A collective that waits past timeout_s raises (a rank that died or took another path) instead of hanging."""
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, rank=rank, world_size=T, timeout=timedelta(seconds=timeout_s))
    return device


def put_result(queue, rank: int, payload) -> None:
    buf = io.BytesIO()
    torch.save(payload, buf)
    queue.put((rank, buf.getvalue()))


def spawn_ranks(worker, T: int, *args, timeout: float = 600) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, T, port, queue, *args)) for r in range(T)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=timeout) for _ in range(T)), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.load(io.BytesIO(payload), weights_only=False) for _, payload in results]
