"""PyTorch's optimizer-state sharding, for `bench_sharding.py --settings torch`.

The same model, batch, loss and optimizer as the Keras side of
`bench_sharding.py` (Dense 1024 -> 4096 -> 4096 -> 1024 with ReLU, MSE,
Adam(1e-4), the global batch split over 2 worker processes), trained by
PyTorch over gloo in three ways:

- `unsharded`: `DistributedDataParallel` and `torch.optim.Adam`: every rank
  keeps the whole optimizer state (what `ShardedOptimizer` is measured
  against on the Keras side);
- `sharded`: `DistributedDataParallel` and `ZeroRedundancyOptimizer(Adam)`:
  each rank keeps the state of whole parameters (balanced by size), steps
  them, and broadcasts them (ZeRO stage 1, PyTorch's form);
- `fsdp2`: `fully_shard(reshard_after_forward=False)` on each layer and the
  model, then `torch.optim.Adam`: each rank keeps a dim-0 shard of every
  parameter, its gradient and its state; the gradients are reduce-scattered
  as the backward pass reaches them, the parameters all-gathered before the
  forward pass and kept until the next step (ZeRO stage 2, PyTorch's
  form).

Each worker reports what the Keras workers report: the step times, the peak
RSS (`VmHWM`), and the optimizer state of this rank in bytes.
"""

from __future__ import annotations

import datetime
import itertools
import statistics
import time

TORCH_CONFIGS = ("unsharded", "sharded", "fsdp2")
TORCH_LABELS = {
    "unsharded": "DDP + Adam",
    "sharded": "DDP + ZeroRedundancyOptimizer(Adam)",
    "fsdp2": "FSDP2 fully_shard(reshard_after_forward=False) + Adam",
}


def _model(torch, widths):
    torch.manual_seed(0)
    layers = []
    for index, (inputs, outputs) in enumerate(itertools.pairwise(widths)):
        layers.append(torch.nn.Linear(inputs, outputs))
        if index < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def _local_bytes(value) -> int:
    """Bytes of this rank's part of a tensor (a DTensor's local shard)."""
    local = value.to_local() if hasattr(value, "to_local") else value
    return local.numel() * local.element_size()


def _state_bytes(optimizer) -> list[int]:
    """This rank's optimizer state, per parameter that has one."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's
    return [
        sum(_local_bytes(v) for v in state.values() if hasattr(v, "element_size"))
        for state in inner.state.values()
    ]


def _build(torch, dist, config, widths):
    model = _model(torch, widths)
    if config == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if config == "sharded":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(
            ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4
        )
    else:
        optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    return ddp, optimizer


def torch_worker(job, widths, rank, status_mib) -> dict:
    """One worker of the `torch` setting: trains `job["config"]` and returns
    the same record as a Keras worker of `bench_sharding.py`."""
    import numpy as np
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{job['torch_port']}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=600),
    )
    rss_start = status_mib("VmRSS")
    rng = np.random.default_rng(0)
    per_worker = job["batch_size"] // 2
    samples = job["batch_size"] * 4
    x = rng.normal(size=(samples, widths[0])).astype("float32")
    y = rng.normal(size=(samples, widths[-1])).astype("float32")
    model, optimizer = _build(torch, dist, job["config"], widths)
    rss_built = status_mib("VmRSS")
    loss_fn = torch.nn.MSELoss()

    def step(index):
        start = (index * job["batch_size"] + rank * per_worker) % samples
        bx = torch.from_numpy(x[start : start + per_worker])
        by = torch.from_numpy(y[start : start + per_worker])
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(bx), by)
        loss.backward()
        optimizer.step()
        return float(loss)

    start = time.perf_counter()
    for index in range(1 + job["warmup"]):
        step(index)
    first = time.perf_counter() - start
    durations = []
    for index in range(job["steps"]):
        start = time.perf_counter()
        step(index)
        durations.append(time.perf_counter() - start)
    memory = {
        "rss_start_mib": rss_start,
        "rss_built_mib": rss_built,
        "rss_end_mib": status_mib("VmRSS"),
        "peak_rss_mib": status_mib("VmHWM"),
    }
    per_parameter = _state_bytes(optimizer)
    # Global shapes (a DTensor's `shape` is the whole parameter's).
    parameters = sum(int(np.prod(p.shape)) for p in model.parameters())
    dist.barrier()
    dist.destroy_process_group()
    return {
        "parameters": parameters,
        "replicas": 2,
        "local_replicas": 1,
        "step_seconds": durations,
        "median_step_seconds": statistics.median(durations),
        "trace_and_warmup_seconds": first,
        "memory": memory,
        "optimizer_state": {
            # One entry: this rank's total (the Keras side lists per replica).
            "per_replica_bytes": [sum(per_parameter)],
            "per_parameter_bytes": per_parameter,
        },
        "torch": torch.__version__,
    }
