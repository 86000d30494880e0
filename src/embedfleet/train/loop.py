"""The training loop of one rank: each step's gradients summed across ranks with one all-reduce of a
flat buffer (no DDP wrapper), and on CUDA the whole step — gather, forward, loss, backward,
all-reduce, AdamW — replayed as one CUDA graph.

Why a graph: a head's step is a few dozen small kernels. Launched one by one from Python it took
~0.8 ms on an H100 whatever the batch, and DDP's per-step work doubled that: an epoch on two GPUs
took as long as on one (bench/NOTES.md, run 58). Replayed, a step costs what its kernels cost.

    TrainLoop(model, ds, …).epoch(e)   one epoch's steps on this rank; returns its summed training loss
                                       (a device tensor, no sync)

How a replayed step finds its rows without the host: in the gpu tier the epoch's order is made on
the device (order.py) into the graph's buffers, and the graph reads the step's rows at a device-side
offset it advances itself. Other tiers copy each batch into the graph's input buffers before the replay. The learning
rate comes from a device-side schedule at a device-side step counter. Each parameter's `.grad` is a
view of one flat buffer that backward accumulates into. An epoch's short last step, the first
WARMUP_STEPS steps, and every step on the CPU (or with EMBEDFLEET_TRAIN_GRAPH=0) run the same code
eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embedfleet.train import order as ordering

__all__ = ["TrainLoop", "WARMUP_STEPS"]

WARMUP_STEPS = 3  # eager steps before the capture: AdamW's state, cuBLAS's workspace, NCCL's communicator


class TrainLoop:
    """One rank's training of `model` over `ds` (an EmbeddingDataset with labels), `per_rank` rows a
    step. `lrs[s]`: the learning rate of step s of the whole run. `target`: (mean, std) the
    regression target is scaled by. `graph`: capture and replay full steps (CUDA only). `gather`: take
    each step's rows from the storage by the epoch's order on the device, inside the graph — None: in
    the gpu tier when capturing; True: wherever the storage is on the device (the CPU's ram tier too:
    tests run that code there); False: batches copied in, as other tiers."""

    def __init__(self, model: torch.nn.Module, ds, per_rank: int, rank: int, world: int, task: str,
                 target: tuple[float, float], lrs: list[float], weight_decay: float, graph: bool = True,
                 gather: bool | None = None):
        dev = ds.device
        self.model, self.ds, self.dev = model, ds, dev
        self.per_rank, self.rank, self.world, self.task = per_rank, rank, world, task
        self.mean, self.std = target
        self.cuda = dev.type == "cuda"
        self.capture = graph and self.cuda
        params = list(model.parameters())
        if world > 1:  # every rank starts from rank 0's weights, as DDP's constructor would make it
            for p in params:
                torch.distributed.broadcast(p.data, 0)
        self.grads = torch.zeros(sum(p.numel() for p in params), device=dev)
        at = 0
        for p in params:  # backward accumulates into these views in place
            p.grad = self.grads[at:at + p.numel()].view_as(p)
            at += p.numel()
        if not lrs:
            raise ValueError("lrs: a learning rate for every step of the run")
        self.steps_left = len(lrs)  # the device-side schedule has no bounds check: the host keeps count
        self.lrs = torch.tensor(lrs, dtype=torch.float32, device=dev)
        self.lr = self.lrs[0].clone()
        self.step_no = torch.zeros(1, dtype=torch.int64, device=dev)
        self.optimizer = torch.optim.AdamW(params, lr=self.lr, weight_decay=weight_decay, fused=self.cuda,
                                           capturable=self.cuda)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        self.sizes = ordering.step_sizes(len(ds), per_rank, world)
        self.stride = per_rank * world
        # the gpu tier: the step's rows gathered inside the graph from the epoch's order on the device
        self.resident = ds.resident if gather or (gather is None and self.capture) else None
        if self.resident is not None:
            self.order_rows = torch.empty(len(ds), dtype=torch.int64, device=dev)
            self.order_pos = torch.empty(len(ds), dtype=torch.int64, device=dev)
            self.offset = torch.zeros(1, dtype=torch.int64, device=dev)
            self.arange = torch.arange(per_rank, device=dev)
        elif self.capture:
            self.x_in = torch.empty((per_rank, ds.dim), dtype=ds.dtype, device=dev)
            self.y_in = torch.empty(per_rank, dtype=ds.labels.dtype, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager_steps = 0

    @property
    def mode(self) -> str:
        """"cuda-graph" once full steps are replayed, else "eager"."""
        return "cuda-graph" if self.graph is not None else "eager"

    # ---- one step ---------------------------------------------------------------------------------

    def _step(self, x: torch.Tensor, y: torch.Tensor, rows: int) -> None:
        """The whole step; `rows`: the step's rows over all ranks (the loss is their mean)."""
        self.grads.zero_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda, cache_enabled=False):
            out = self.model(x if self.cuda else x.float())
        out = out.float()
        if self.task == "classify":
            loss = F.cross_entropy(out, y, reduction="sum")
        else:
            loss = F.mse_loss(out.squeeze(1), (y - self.mean) / self.std, reduction="sum")
        (loss * (1.0 / rows)).backward()
        if self.world > 1:
            torch.distributed.all_reduce(self.grads)  # the sum over ranks of each rank's sum / global rows
        self.lr.copy_(self.lrs.index_select(0, self.step_no)[0])
        self.optimizer.step()
        self.step_no += 1
        self.loss_sum += loss.detach().double()

    def _gathered_step(self) -> None:
        i = self.offset + self.arange
        self.offset += self.stride
        x = self.resident.index_select(0, self.order_rows.index_select(0, i))
        y = self.ds.labels.index_select(0, self.order_pos.index_select(0, i))
        self._step(x, y, self.stride)

    def _copied_step(self) -> None:
        self._step(self.x_in, self.y_in, self.stride)

    def _full_step(self, body) -> None:
        """A full-size step: replayed once captured; before that WARMUP_STEPS eager steps on a side
        stream (as torch's CUDA-graph notes ask), then the capture and its first replay."""
        if self.graph is not None:
            self.graph.replay()
            return
        if not self.capture:
            body()
            return
        if self.eager_steps < WARMUP_STEPS:
            side = torch.cuda.Stream(self.dev)
            side.wait_stream(torch.cuda.current_stream(self.dev))
            with torch.cuda.stream(side):
                body()
            torch.cuda.current_stream(self.dev).wait_stream(side)
            self.eager_steps += 1
            return
        graph = torch.cuda.CUDAGraph()
        # thread_local: the ram tier's gather thread goes on copying on its own stream meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            body()
        self.graph = graph
        graph.replay()

    # ---- one epoch --------------------------------------------------------------------------------

    def _spend(self, steps: int) -> None:
        if steps > self.steps_left:
            raise ValueError(f"{steps} more steps: the learning-rate schedule has {self.steps_left} left")
        self.steps_left -= steps

    def epoch(self, epoch: int) -> torch.Tensor:
        """This rank's steps of `epoch`; returns its summed training loss (a device tensor)."""
        self._spend(len(self.sizes))
        self.loss_sum.zero_()
        full = int((self.sizes == self.stride).sum())
        if self.resident is not None:
            rows, positions = self.ds.epoch_rows_on_device(epoch)
            self.order_rows.copy_(rows)
            self.order_pos.copy_(positions)
            self.offset.fill_(self.rank * self.per_rank)
            for _ in range(full):
                self._full_step(self._gathered_step)
            starts, ends = ordering.step_bounds(len(self.ds), self.per_rank, self.rank, self.world)
            for s in range(full, len(self.sizes)):  # the short last step
                a, b = int(starts[s]), int(ends[s])
                x = self.resident.index_select(0, self.order_rows[a:b])
                y = self.ds.labels.index_select(0, self.order_pos[a:b])
                self._step(x, y, int(self.sizes[s]))
            return self.loss_sum
        for s, (x, y) in enumerate(self.ds.batches(self.per_rank, shuffle=True, epoch=epoch, rank=self.rank,
                                                   world_size=self.world)):
            if self.capture and s < full:
                self.x_in.copy_(x)
                self.y_in.copy_(y)
                self._full_step(self._copied_step)
            else:
                self._step(x, y, int(self.sizes[s]))
        return self.loss_sum

    def steps_on(self, x: torch.Tensor, y: torch.Tensor, count: int) -> None:
        """`count` full steps on one batch already on the device: the step without its input (what
        bench/train_loader.py sets the tiers against). Needs a loop built with gather=False."""
        self._spend(count)
        if not self.capture:
            for _ in range(count):
                self._step(x, y, self.stride)
            return
        self.x_in.copy_(x)
        self.y_in.copy_(y)
        for _ in range(count):
            self._full_step(self._copied_step)
