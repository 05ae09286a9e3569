"""``bench_e2e.py --tp N``: the end-to-end benchmark at tensor-parallel degree N.

``launch`` spawns N ranks (``torch.multiprocessing``, one per GPU, NCCL; gloo on a machine
without CUDA, the plumbing's CPU smoke test) that each run ``bench_e2e.main`` with the same
arguments; under ``torchrun`` (``WORLD_SIZE`` set) the ranks are torchrun's. Every rank runs the
whole benchmark in lockstep: the pair (rank 0 trains or loads the cache first, the others then
load it), the fp32 reference (whole, on each rank), the target sharded
(``treeops.decoder.tp.shard_target``; the draft replicated), CAST's cost table calibrated on the
sharded target and stamped with the TP degree (``meta["tp"]``; a table cache of its own per
degree), every decoder built with ``tp_group``. Rank 0 writes the results (``--out``); the other
ranks write into a scratch directory. Decisions taken from the wall clock (the ``--budget-s``
stops) are rank 0's, broadcast, so the ranks run the same rows and so the same collectives.
"""

from __future__ import annotations

import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_STATE: dict = {}


def active() -> bool:
    """Whether this process is a rank of a TP run (``init`` ran)."""
    return bool(_STATE)


def group():
    """The TP group (None outside a TP run)."""
    return _STATE.get("group")


def rank() -> int:
    return _STATE.get("rank", 0)


def size() -> int:
    return _STATE.get("size", 1)


def device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK``, or the CPU."""
    return _STATE["device"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(r: int, argv: list[str], n: int, port: int) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    import bench_e2e  # the spawned process's own import of the script, as a module

    rc = bench_e2e.main(argv)
    if rc:
        raise SystemExit(rc)


def launch(argv: list[str], n: int) -> int:
    """Run ``bench_e2e.main(argv)`` on ``n`` spawned ranks; returns 0 when every rank did."""
    if torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise SystemExit(f"--tp {n} needs {n} GPUs, found {torch.cuda.device_count()}")
    mp.start_processes(_rank_main, args=(argv, n, _free_port()), nprocs=n, start_method="spawn")
    return 0


def init(out: str) -> str:
    """Join the process group from the environment (``launch``'s or torchrun's); returns the
    directory this rank writes to (``out`` on rank 0, a scratch directory elsewhere)."""
    r, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", r))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=r, world_size=n,
                            **({"device_id": dev} if cuda else {}))  # fmt: skip
    _STATE.update(group=dist.group.WORLD, rank=r, size=n, device=dev)
    return out if r == 0 else tempfile.mkdtemp(prefix=f"e2e-tp-rank{r}-")


def agree(flag: bool) -> bool:
    """Rank 0's ``flag`` on every rank (a wall-clock decision); ``flag`` outside a TP run."""
    if not active():
        return flag
    box = [bool(flag)]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def rank0_first(fn):
    """``fn()`` on rank 0, then on the others (rank 0 fills a cache they read)."""
    if not active():
        return fn()
    out = fn() if rank() == 0 else None
    dist.barrier()
    return out if rank() == 0 else fn()
