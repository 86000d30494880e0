"""The training loop of one rank: each step's gradients summed across ranks with one all-reduce of a
flat buffer (no DDP wrapper), and on CUDA the whole step — gather, forward, loss, backward,
all-reduce, AdamW — replayed as one CUDA graph.

Why a graph: a head's step is a few dozen small kernels. Launched one by one from Python it cost the
same launch time whatever the batch, and DDP's per-step work doubled that: an epoch on two GPUs
took as long as on one (docs/decisions/train-cuda-graph-step.md). Replayed, a step costs what its kernels cost.

    TrainLoop(model, ds, …).epoch(e)   one epoch's steps on this rank; returns its summed training loss
                                       (a device tensor, no sync)

How a replayed step finds its rows without the host: the epoch's order is made on the device
(order.py) into the graph's buffers, and one kernel (take.py) reads the step's rows at an offset it
computes from the device-side step counter, one step ahead on a side stream while the step before
computes (two graphs, one per input buffer). The next epoch's order is made on another side stream
while this epoch's steps run, so an epoch starts with a copy, not a sort. In the gpu tier the rows
come from device memory; in the ram tier on CUDA the kernel reads them from pinned host memory across
PCIe. The stream tier copies each batch into the graph's input buffer before the replay. The learning
rate comes from a device-side schedule at the same step counter. Each parameter's `.grad` is a view of
one flat buffer that backward accumulates into. An epoch's short last step, the first WARMUP_STEPS
steps, and every step on the CPU (or with EMBEDFLEET_TRAIN_GRAPH=0) run the same code eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from embedfleet.train import order as ordering
from embedfleet.train.take import kernel_available, take

__all__ = ["TrainLoop", "WARMUP_STEPS"]

WARMUP_STEPS = 3  # eager steps before the capture: AdamW's state, cuBLAS's workspace, NCCL's communicator


class TrainLoop:
    """One rank's training of `model` over `ds` (an EmbeddingDataset with labels), `per_rank` rows a
    step. `lrs[s]`: the learning rate of step s of the whole run. `target`: (mean, std) the
    regression target is scaled by. `graph`: capture and replay full steps (CUDA only). `gather`: take
    each step's rows from the storage by the epoch's order on the device, inside the graph — None:
    when capturing, in the gpu tier, and in the ram tier where the kernel runs; True: also eagerly
    (on the CPU: tests run that code there); False: batches copied in, as the stream tier. `ahead`
    (None: True): when replaying, take each step's rows during the step before, on a side stream;
    False: within the step (bench/train_loader.py --gpu-inline times the gpu tier so)."""

    def __init__(self, model: torch.nn.Module, ds, per_rank: int, rank: int, world: int, task: str,
                 target: tuple[float, float], lrs: list[float], weight_decay: float, graph: bool = True,
                 gather: bool | None = None, ahead: bool | None = None, triton: bool = True):
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
        self.kernel = kernel_available(dev, triton)
        self.src = self._source(ds, gather)
        # replayed: each step's rows are taken during the step before (a side stream, the other buffer),
        # off the step's critical path — in the ram tier they cross PCIe meanwhile
        self.ahead = int(self.src is not None and self.capture and ahead is not False)
        slots = 2 if self.ahead else 1
        # bf16 on CUDA: the dtype autocast casts a head's first Linear's input to, cast once in the take;
        # named features keep theirs (raw columns are standardized first, and bf16 would round them before)
        x_dtype = torch.bfloat16 if self.cuda and not getattr(ds.source, "features", ()) else ds.dtype
        self.x_bufs = [torch.empty((per_rank, ds.dim), dtype=x_dtype, device=dev) for _ in range(slots)]
        self.y_bufs = [torch.empty(per_rank, dtype=ds.labels.dtype, device=dev) for _ in range(slots)]
        if self.src is not None:
            self.order_rows = torch.empty(len(ds), dtype=torch.int64, device=dev)
            self.order_pos = torch.empty(len(ds), dtype=torch.int64, device=dev)
            self.base = torch.zeros(1, dtype=torch.int64, device=dev)  # step_no at the epoch's first step
        # (epoch, rows, positions, done): the next epoch's order, made meanwhile on `order_stream`
        self.next_order: tuple[int, torch.Tensor, torch.Tensor, torch.cuda.Event] | None = None
        self.order_stream = torch.cuda.Stream(dev) if self.src is not None and self.cuda else None
        self.side = torch.cuda.Stream(dev) if self.ahead else None
        self.graphs: list[torch.cuda.CUDAGraph | None] = [None] * slots
        self.eager_steps = 0

    def _source(self, ds, gather: bool | None) -> torch.Tensor | None:
        """The storage the steps take their rows from by the order, or None (batches copied in)."""
        x = ds.storage
        readable = x is not None and (x.device == self.dev or
                                      (self.kernel and x.device.type == "cpu" and x.is_pinned()))
        if gather and not readable:
            raise ValueError("gather=True: the dataset's storage is neither on its device nor readable there")
        return x if readable and (gather or (gather is None and self.capture)) else None

    @property
    def mode(self) -> str:
        """"cuda-graph" once full steps are replayed, else "eager"."""
        return "cuda-graph" if any(g is not None for g in self.graphs) else "eager"

    # ---- one step ---------------------------------------------------------------------------------

    def _step(self, x: torch.Tensor, y: torch.Tensor, rows: int) -> None:
        """Forward, backward, all-reduce and update; `rows`: the step's rows over all ranks (the loss
        is their mean). The caller advances step_no."""
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
        self.loss_sum += loss.detach().double()

    def _take(self, slot: int, ahead: int, first: int | None = None, count: int | None = None) -> None:
        """This rank's rows of the step `ahead` of step_no into buffer `slot`; with `first`, the `count`
        rows at that position of the order instead (an epoch's short last step)."""
        take(self.src, self.order_rows, self.order_pos, self.ds.labels, self.x_bufs[slot], self.y_bufs[slot],
             self.step_no, self.base, self.rank * self.per_rank if first is None else first,
             self.stride if first is None else 0, ahead, count, kernel=self.kernel)

    def _gathered_step(self, slot: int) -> None:
        if not self.ahead:
            self._take(slot, 0)
            self._step(self.x_bufs[slot], self.y_bufs[slot], self.stride)
        else:
            main = torch.cuda.current_stream(self.dev)
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                self._take(1 - slot, 1)
            self._step(self.x_bufs[slot], self.y_bufs[slot], self.stride)
            main.wait_stream(self.side)
        self.step_no += 1

    def _copied_step(self, slot: int) -> None:
        self._step(self.x_bufs[slot], self.y_bufs[slot], self.stride)
        self.step_no += 1

    def _full_step(self, body, slot: int = 0) -> None:
        """A full-size step on input buffer `slot`: replayed once captured; before that WARMUP_STEPS
        eager steps on a side stream (as torch's CUDA-graph notes ask), then the capture (one graph
        per buffer, sharing their memory pool) and its first replay."""
        if self.graphs[slot] is not None:
            self.graphs[slot].replay()
            return
        if not self.capture:
            body(slot)
            return
        if self.eager_steps < WARMUP_STEPS:
            side = torch.cuda.Stream(self.dev)
            side.wait_stream(torch.cuda.current_stream(self.dev))
            with torch.cuda.stream(side):
                body(slot)
            torch.cuda.current_stream(self.dev).wait_stream(side)
            self.eager_steps += 1
            return
        graph = torch.cuda.CUDAGraph()
        pool = next((g.pool() for g in self.graphs if g is not None), None)
        # thread_local: another thread (a ram tier's copies, the stream tier's reads) may use CUDA meanwhile
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            body(slot)
        self.graphs[slot] = graph
        graph.replay()

    # ---- one epoch --------------------------------------------------------------------------------

    def _spend(self, steps: int) -> None:
        if steps > self.steps_left:
            raise ValueError(f"{steps} more steps: the learning-rate schedule has {self.steps_left} left")
        self.steps_left -= steps

    def _load_order(self, epoch: int) -> None:
        """The epoch's order into the buffers the steps read: made during the last epoch if it was, else now
        (on CUDA on the order stream too, so that one stream's cache holds the sort's temporaries)."""
        if self.order_stream is None:  # the CPU
            rows, positions = self.ds.epoch_rows_on_device(epoch)
            self.order_rows.copy_(rows)
            self.order_pos.copy_(positions)
            return
        if self.next_order is None or self.next_order[0] != epoch:
            self._prepare_order(epoch)
        _, rows, positions, done = self.next_order
        self.next_order = None
        main = torch.cuda.current_stream(self.dev)
        main.wait_event(done)
        self.order_rows.copy_(rows)
        self.order_pos.copy_(positions)
        self.order_stream.wait_stream(main)  # the order's memory may be reused only after these copies

    def _prepare_order(self, epoch: int) -> None:
        """Make `epoch`'s order on the order stream while the steps queued before it run."""
        with torch.cuda.stream(self.order_stream):
            rows, positions = self.ds.epoch_rows_on_device(epoch)
            done = torch.cuda.Event()
            done.record()
        self.next_order = (epoch, rows, positions, done)

    def epoch(self, epoch: int) -> torch.Tensor:
        """This rank's steps of `epoch`; returns its summed training loss (a device tensor)."""
        self._spend(len(self.sizes))
        self.loss_sum.zero_()
        full = int((self.sizes == self.stride).sum())
        if self.src is not None:
            self._load_order(epoch)
            self.base.copy_(self.step_no)
            if self.ahead and full:
                self._take(0, 0)  # the first step's rows; each step takes the next one's
            for s in range(full):
                self._full_step(self._gathered_step, s % len(self.graphs))
            if self.order_stream is not None and self.steps_left:
                self._prepare_order(epoch + 1)
            starts, ends = ordering.step_bounds(len(self.ds), self.per_rank, self.rank, self.world)
            for s in range(full, len(self.sizes)):  # the short last step
                a, k = int(starts[s]), int(ends[s] - starts[s])
                self._take(0, 0, first=a, count=k)
                self._step(self.x_bufs[0][:k], self.y_bufs[0][:k], int(self.sizes[s]))
                self.step_no += 1
            return self.loss_sum
        for s, (x, y) in enumerate(self.ds.batches(self.per_rank, shuffle=True, epoch=epoch, rank=self.rank,
                                                   world_size=self.world)):
            if self.capture and s < full:
                self.x_bufs[0].copy_(x)
                self.y_bufs[0].copy_(y)
                self._full_step(self._copied_step)
            else:
                self._step(x, y, int(self.sizes[s]))
                self.step_no += 1
        return self.loss_sum

    def steps_on(self, x: torch.Tensor, y: torch.Tensor, count: int) -> None:
        """`count` full steps on one batch already on the device: the step without its input (what
        bench/train_loader.py sets the tiers against). Needs a loop built with gather=False."""
        self._spend(count)
        if not self.capture:
            for _ in range(count):
                self._step(x, y, self.stride)
                self.step_no += 1
            return
        self.x_bufs[0].copy_(x)
        self.y_bufs[0].copy_(y)
        for _ in range(count):
            self._full_step(self._copied_step)
