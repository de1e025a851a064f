"""What the PyTorch examples share: tensor-parallel ranks as spawned processes.

    resolve_tp(parser, args)              # --tp default and checks (--device, --vocab)
    results = run_ranks(run_rank, args)   # run_rank(rank, world, device, args) on each rank;
                                          # every rank's return value, in rank order
"""

from __future__ import annotations

import datetime
import importlib.util
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def resolve_tp(parser, args) -> None:
    """Default --tp (2 on CPU; on CUDA 2 with two or more GPUs, else 1) and its checks."""
    if args.tp is None:
        args.tp = (2 if torch.cuda.device_count() >= 2 else 1) if args.device == "cuda" else 2
    if args.device == "cuda" and args.tp > torch.cuda.device_count():
        parser.error(f"--tp {args.tp} needs {args.tp} GPUs, found {torch.cuda.device_count()}")
    if args.vocab % args.tp:
        parser.error(f"--vocab {args.vocab} is not divisible by --tp {args.tp}")


def megatron_missing() -> bool:
    """True (with a hint printed) when megatron-core, the examples' reference, is absent."""
    if importlib.util.find_spec("megatron") is not None:
        return False
    print("this example compares against Megatron-core: pip install megatron-core "
          "(0.16.x for Python 3.11; its only hard dependencies are torch, numpy, packaging)")
    return True


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, run_rank, args, queue):
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # ranks share the host's cores
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        result = run_rank(rank, world, device, args)
        gathered = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            queue.put(gathered)
    finally:
        dist.destroy_process_group()


def run_ranks(run_rank, args) -> list:
    """`run_rank(rank, world, device, args)` on `args.tp` spawned ranks (gloo on CPU, NCCL
    on CUDA, one GPU per rank); returns their results in rank order."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(args.tp, _free_port(), run_rank, args, queue),
                       nprocs=args.tp, join=True, start_method="spawn")
    return queue.get()
