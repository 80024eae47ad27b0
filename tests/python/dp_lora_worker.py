"""One rank of tests/python/test_lora.py's two-rank check, started by `torchrun --nproc-per-node 2`.

    torchrun --standalone --nproc-per-node 2 dp_lora_worker.py GRAD_GRAPH BATCHES.npz OUT_DIR [SHARD]

Every rank trains the LoRA `--split` graphs with ntl_patch.DataParallel (gloo, CPU) on its own
shards x/<step>/<rank>, y/<step>/<rank> for `steps` steps, then calls save_adapter(OUT_DIR/adapter)
(rank 0 writes). Rank 0 writes OUT_DIR/result.npz: the losses, the final parameters, and the
size of the all-reduced gradient buffer.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "python")]
sys.dont_write_bytecode = True

import onnxruntime as ort  # noqa: E402

from ntl_patch import DataParallel  # noqa: E402


def main() -> None:
    grad, batches, out = (Path(a) for a in sys.argv[1:4])
    shard = sys.argv[4] if len(sys.argv) > 4 else "none"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    dp = DataParallel(grad, providers=["CPUExecutionProvider"], session_options=so, shard=shard)
    assert dp.world_size == 2 and dp.rank == rank
    z = np.load(batches)
    losses = [dp.step({"input_ids": z[f"x/{s}/{rank}"], "labels": z[f"y/{s}/{rank}"]})
              for s in range(int(z["steps"]))]
    dp.save_adapter(out / "adapter", task_type=None)
    if rank == 0:
        params = dp.parameters()
        np.savez(out / "result.npz", losses=np.array(losses), numel=np.array(dp._layout.numel),
                 **{f"param/{k.replace('/', '|')}": v for k, v in params.items()})
    dist.barrier()
    # not dist.destroy_process_group(): with torch 2.7.1's gloo it hangs now and then (as in
    # dp_worker.py); leave without destructors once every rank is past the barrier
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
