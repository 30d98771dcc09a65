"""Training in several processes (torchrun): where this process trains (:class:`Dist`), the process group with
its timeouts (:func:`init_distributed`), and the check that the processes still train one model
(:func:`check_agreement`)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aiayn.device import resolve_device
from aiayn.errors import DesyncError, DeviceError, PeerError, UserError, collective_timed_out
from aiayn.files import LockHolder
from aiayn.launched import record_members


@dataclass
class Dist:
    """Where this process trains: its rank among ``world`` processes, and its device (resolved once)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    setup_group: Any = None  # the gloo group of the setup barriers (their own, long timeout)
    setup_timeout_s: float = 86400.0  # train.setup_timeout_s: that group's timeout
    processes: list[tuple[int, str]] = field(default_factory=list)  # (pid, host) of every rank, in rank order

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def setup_barrier(self) -> None:
        """The barrier where the other processes wait while rank 0 prepares the data (tokenizer, store, caches):
        on its own gloo group, whose timeout is ``train.setup_timeout_s`` rather than the training collectives'.
        Past it, one line (:class:`~aiayn.errors.PeerError`) naming the process(es) waited for and the setting."""
        if self.world == 1:
            return
        try:
            dist.barrier(group=self.setup_group)
        except RuntimeError as e:
            if not collective_timed_out(e):
                raise
            raise PeerError(self.setup_timeout_message()) from None

    def from_main(self, decide: Callable[[], Any]) -> Any:
        """Rank 0's ``decide()`` (small, picklable), on every process: only rank 0 runs it (a probe of the machine,
        say, that two processes running side by side might answer differently); the others wait for its answer on
        the setup group (``train.setup_timeout_s``). A :class:`~aiayn.errors.UserError` it raises is raised on every
        process with the same words, said once per machine (``every_rank``)."""
        if self.world == 1:
            return decide()
        if self.main:  # a bug in decide() broadcasts nothing: the others see rank 0 stop
            try:
                value = decide()
            except UserError as e:
                self._broadcast_from_main([(False, (type(e), str(e)))])
                raise
            self._broadcast_from_main([(True, value)])
            return value
        answer: list[Any] = [None]
        self._broadcast_from_main(answer)
        ok, value = answer[0]
        if not ok:
            kind, message = value
            raise kind(message, every_rank=True)
        return value

    def _broadcast_from_main(self, answer: list[Any]) -> None:
        try:
            dist.broadcast_object_list(answer, src=0, group=self.setup_group)
        except RuntimeError as e:
            if not collective_timed_out(e):
                raise
            raise PeerError(self.setup_timeout_message()) from None

    def setup_timeout_message(self) -> str:
        """What a process that waited ``train.setup_timeout_s`` at a setup barrier says: rank 0, which prepares the
        data, or (on rank 0) the others, each by pid and host, and whether it is stopped."""
        def who(rank: int) -> str:
            pid, host = self.processes[rank] if rank < len(self.processes) else ("?", None)
            return LockHolder(str(pid), host).describe()

        if self.main:
            waited = "the other processes: " + "; ".join(f"rank {r}: {who(r)}" for r in range(1, self.world))
        else:
            waited = ("rank 0, which prepares the data (run directory, tokenizer, token store) for every process: "
                      f"{who(0)}")
        return (f"waited train.setup_timeout_s={self.setup_timeout_s:g} s at a setup barrier for {waited}; or raise "
                "train.setup_timeout_s, or prepare the data first (aiayn prepare CONFIG --out DIR, then --set "
                "data.prepared=DIR)")

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every process's ``obj`` (picklable, small), in rank order, on every process."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def sum(self, values: Sequence[float], device: torch.device) -> list[float]:
        """All-reduce (sum) a few scalars across processes."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over processes (in place; no host synchronization)."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def max_of(self, value: int) -> int:
        """The largest of the processes' ``value``, on every process."""
        if self.world == 1:
            return value
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def broadcast_flag(self, flag: bool, device: torch.device) -> bool:
        """Rank 0's decision, for all (so every process stops at the same update)."""
        if self.world == 1:
            return flag
        t = torch.tensor([1 if flag else 0], device=device)
        dist.broadcast(t, 0)
        return bool(t.item())


def init_distributed(device: str | torch.device = "auto", timeout_s: float = 1800.0,
                     setup_timeout_s: float = 86400.0) -> Dist:
    """This process's place: the process group torchrun set up (WORLD_SIZE > 1), else a single process, and
    its device, resolved once from ``train.device`` (a torchrun process gets its own GPU, cuda:LOCAL_RANK).

    NCCL when this process trains on CUDA (its GPU is made current first, so NCCL's communicators and buffers
    live there rather than all on GPU 0), gloo otherwise. ``timeout_s`` (``train.dist_timeout_s``) bounds every
    collective of the training; the wait while rank 0 prepares the data is on a gloo group of its own, bounded by
    ``setup_timeout_s`` (``train.setup_timeout_s``): a first start on a big corpus outlasts a collective's
    timeout without being killed by it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if world > 1 else 0
    dev = resolve_device(device, local_rank)
    if world <= 1:
        return Dist(device=dev)
    check_rank_device(dev, local_rank, world)
    if not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        timeout = timedelta(seconds=timeout_s)
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.PrefixStore(
            store_prefix(), store), rank=rank, world_size=world, timeout=timeout)
    setup = dist.new_group(backend="gloo", timeout=timedelta(seconds=setup_timeout_s))
    members: list[Any] = [None] * dist.get_world_size()  # (pid, host, agent pid): named by a timeout, a lost node
    dist.all_gather_object(members, (os.getpid(), socket.gethostname(), os.getppid()), group=setup)
    record_members(members, local_rank)  # for aiayn launch's last line (nothing outside it)
    processes = [tuple(m[:2]) for m in members]
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, dev, setup, setup_timeout_s, processes)


def store_prefix() -> str:
    """The keys of this attempt's process group in torchrun's store.

    The agent's own store (``TORCHELASTIC_USE_AGENT_STORE``: static rendezvous, or c10d sharing its store) outlives a
    restart (``--max-restarts``) and still holds the dead processes' addresses under the keys a new group reads:
    each attempt gets keys of its own, or a restarted group may connect to a dead port (refused, or a hang). A fresh
    store per rendezvous round (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, the setup that takes a replacement node,
    docs/distributed.md) holds no old keys, and there the restart count is not the same on every node (a
    replacement's agent counts from 0), so its keys carry none."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"aiayn/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return "aiayn/"


def check_rank_device(device: torch.device, local_rank: int, world: int) -> None:
    """Each of several processes on a machine trains on its own GPU, cuda:LOCAL_RANK (what ``auto`` and a
    bare ``cuda`` give); ``cuda:N`` would put them all on one GPU."""
    if world > 1 and device.type == "cuda" and device.index != local_rank:
        raise DeviceError(f"train.device={device}: with {world} processes each needs its own GPU (process "
                          f"{local_rank} would use {device}); use auto or cuda")


# Relative difference beyond which two processes' norms are not the same model's: after DDP's all-reduce every
# process holds the same gradient (bit for bit on one backend) and applies the same update, so only a desync
# (a process at another update, other weights, a lost all-reduce) gives more than rounding.
AGREEMENT_RTOL = 1e-5


def check_agreement(values: torch.Tensor, d: Dist, step: int) -> None:
    """Stop with one line when the processes' ``values`` (a few norms, (N,), on the device) differ: every
    process gathers all of them (one collective, a host synchronization; call it only every few updates).
    Non-finite values count as agreeing when every process has them (an fp16 overflow skips the update on all)."""
    if d.world == 1:
        return
    gathered = [torch.empty_like(values) for _ in range(d.world)]
    dist.all_gather(gathered, values)
    rows = torch.stack(gathered).double().cpu()  # (world, N)
    first = rows[0]
    finite = torch.isfinite(rows)
    same_nonfinite = bool((finite == finite[0]).all())
    diff = (rows - first).abs().where(finite, torch.zeros_like(rows)).amax(0)
    scale = first.abs().where(torch.isfinite(first), torch.ones_like(first)).clamp_min(1e-12)
    if not same_nonfinite or bool((diff > AGREEMENT_RTOL * scale).any()):
        shown = ", ".join(f"process {r}: {'/'.join(f'{v:.6g}' for v in row.tolist())}" for r, row in enumerate(rows))
        raise DesyncError(f"update {step}: the processes no longer train one model (gradient/weight norms {shown});"
                          " resume from the last checkpoint, and report it if it happens again")
