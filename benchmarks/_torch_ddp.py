"""The PyTorch side of `bench_ddp.py`: the same MLPs in DDP, its hooks, its steps.

`DistributedDataParallel` over gloo with no hook, `fp16_compress_hook` and
`powerSGD_hook` (rank 4, warm start and error feedback as keras_dist's
`PowerSGD`), SGD, with `bucket_cap_mb=4` (keras_dist's bucket size) and
DDP's default 25 MiB; PowerSGD also in one bucket with the stock hook
unwrapped (`OrderedHook` says why it is wrapped otherwise).
"""

from __future__ import annotations

import time

# The DDP configurations timed against each keras_dist hook: DDP with
# keras_dist's bucket size first (the ratio), then DDP's default.
DDP_CONFIGS = {
    "none": ("ddp_4m", "ddp_25m"),
    "fp16": ("ddp_4m",),
    "powersgd": ("ddp_4m", "ddp_1bucket"),
}
# MiB; 1024 puts these models in one bucket, where the stock powerSGD_hook
# runs without `OrderedHook` (the check that the wrapper costs DDP nothing).
DDP_BUCKET_MB = {"ddp_4m": 4, "ddp_25m": 25, "ddp_1bucket": 1024}
DDP_LABELS = {
    "ddp_4m": "DDP, 4 MiB buckets",
    "ddp_25m": "DDP, 25 MiB buckets (its default)",
    "ddp_1bucket": "DDP, one bucket, stock hook unwrapped",
}
# Both frameworks' PowerSGD rank.
POWERSGD_RANK = 4
# DDP's PowerSGD refuses start_powerSGD_iter < 2 with error feedback or warm
# start; the warm-up steps run past it, so the timed steps compress in both.
DDP_POWERSGD_START = 2


class OrderedHook:
    """Runs a DDP comm hook for one bucket at a time, in bucket order.

    PyTorch's `powerSGD_hook` issues its second and third all-reduce (the P
    and Q factors) from completion callbacks; with several buckets on gloo,
    ranks can issue them in different orders and deadlock. Here the hook of
    each bucket runs on one worker thread and is waited for before the next
    bucket's starts, so every rank issues the same collectives in the same
    order, and DDP's autograd thread is not blocked (backward goes on while
    the buckets are reduced).
    """

    def __init__(self, torch, hook):
        import queue
        import threading

        self._torch = torch
        self._hook = hook
        self._queue = queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            state, bucket, result = self._queue.get()
            try:
                result.set_result(self._hook(state, bucket).wait())
            except Exception as error:  # handed to DDP through the future
                result.set_exception(error)

    def hook(self):
        """The function to pass to `register_comm_hook` (DDP reads its
        parameter names: `state`, `bucket`)."""

        def ordered(state, bucket):
            result = self._torch.futures.Future()
            self._queue.put((state, bucket, result))
            return result

        return ordered


def torch_mlp(torch, width, hidden):
    """The MLP of `build_mlp` in PyTorch (seeded)."""
    torch.manual_seed(0)
    layers, previous = [], width
    for units in hidden:
        layers += [torch.nn.Linear(previous, units), torch.nn.ReLU()]
        previous = units
    layers.append(torch.nn.Linear(previous, 10))
    return torch.nn.Sequential(*layers)


def build_ddp(torch, width, hidden, hook, config, learning_rate):
    """The MLP of `build_mlp` in PyTorch, wrapped in DDP with `hook` and the
    buckets of `config` (a key of `DDP_BUCKET_MB`)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    model = torch.nn.parallel.DistributedDataParallel(
        torch_mlp(torch, width, hidden), bucket_cap_mb=DDP_BUCKET_MB[config]
    )
    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = psgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=DDP_POWERSGD_START,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
        )
        hook = psgd.powerSGD_hook
        if config != "ddp_1bucket":
            hook = OrderedHook(torch, hook).hook()
        model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    return model, optimizer


def torch_steps(torch, model, optimizer, x, y, steps):
    """Runs `steps` DDP steps; returns the wall time of each."""
    durations = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        # On CPU backward returns after DDP has waited for every bucket.
        loss.backward()
        optimizer.step()
        float(loss.item())
        durations.append(time.perf_counter() - start)
    return durations
