"""One rank of tests/python/test_precision.py's DataParallel check, started by
`torchrun --standalone --nproc-per-node 2 dp_amp_worker.py GRAD_GRAPH OUT.npz`.

fp16 split graphs on gloo, 6 steps on per-rank random shards; at step INF_STEP rank 1 alone puts
an inf into its gradient before the all_reduce (what a float16 overflow on one rank gives). As
with DDP + GradScaler, the inf/NaN check must be global: every rank skips that step and halves
its scale. Rank 0 writes each rank's per-step (loss, skipped, scale, steps taken) and whether
the final parameters are bit-identical on both ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "python")]
sys.dont_write_bytecode = True

import onnxruntime as ort  # noqa: E402

from ntl_patch import DataParallel  # noqa: E402

STEPS, INF_STEP = 6, 2


def main() -> None:
    grad, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    dp = DataParallel(grad, providers=["CPUExecutionProvider"], session_options=so)
    accumulate, at = dp._gradient_run.accumulate, {"step": 0}

    def poisoned(batch, grads, losses):
        accumulate(batch, grads, losses)
        if rank == 1 and at["step"] == INF_STEP:
            grads[0].view(-1)[0] = float("inf")
    dp._gradient_run.accumulate = poisoned
    rng = np.random.default_rng(rank)
    rows = []
    for s in range(STEPS):
        at["step"] = s
        x, y = rng.integers(4, 40, size=(2, 7)), rng.integers(4, 40, size=(2, 7))
        total = dp.step({"input_ids": x, "labels": y})[0]
        rows.append([total, float(dp.last_step_skipped), dp.loss_scale, dp.steps_taken])
    mine = torch.tensor(rows, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(2)]
    dist.all_gather(every, mine)
    params = np.concatenate([v.ravel() for v in dp.parameters().values()]).astype(np.float64)
    flat = [torch.zeros(len(params), dtype=torch.float64) for _ in range(2)]
    dist.all_gather(flat, torch.from_numpy(params))
    if rank == 0:
        np.savez(out, rank0=every[0].numpy(), rank1=every[1].numpy(),
                 same_params=np.array(bool(torch.equal(flat[0], flat[1]))))
    dist.barrier()
    # not dist.destroy_process_group(): with torch 2.7.1's gloo it hangs now and then (as in
    # dp_worker.py); leave without destructors
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
