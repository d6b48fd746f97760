"""One process per rank for the tests that run a split over real torch.distributed ranks: gloo on CPUs,
NCCL on GPUs (rank r on cuda:r). `spawn_ranks(worker, T, backend, *args)` starts T spawned processes;
each joins the default process group on one intra-op thread, runs `worker(rank, T, device, *args)`,
sends what it returns and leaves the group; the results come back in rank order. They travel as
torch.save bytes: a tensor sent through the queue itself is a shared-memory handle that fails once its
process has exited. A collective that waits past `timeout_s` raises (a rank that died or took another
path) instead of hanging."""
from __future__ import annotations

import io
import os
import socket

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, T: int, port: int, queue, backend: str, timeout_s: float, worker, args: tuple) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, rank=rank, world_size=T, timeout=timedelta(seconds=timeout_s))
    try:
        buf = io.BytesIO()
        torch.save(worker(rank, T, device, *args), buf)
        queue.put((rank, buf.getvalue()))
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker, T: int, backend: str, *args, timeout: float = 600, timeout_s: float = 300) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, T, port, queue, backend, timeout_s, worker, args))
             for r in range(T)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=timeout) for _ in range(T)), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.load(io.BytesIO(payload), weights_only=False) for _, payload in results]
