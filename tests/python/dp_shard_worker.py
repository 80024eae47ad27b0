"""One rank of tests/python/test_sharding.py, started by `torchrun --nproc-per-node R`.

    torchrun --standalone --nproc-per-node R dp_shard_worker.py GRAD AMP_GRAD BATCHES.npz OUT [CKPT]

For each shard mode (none, optimizer, gradients), with gloo on CPU, on this rank's shards of
BATCHES.npz (dp_worker.py's layout):
  <mode>/...        `steps` steps of the fp32 graphs GRAD (AdamW + --max-grad-norm), the state
                    saved after half of them (OUT/<mode><R>.safetensors), and this rank's
                    state_dict then (OUT/state<R>_<mode>_<rank>.npz);
  <mode>/resume/... a new DataParallel loading that checkpoint, the remaining steps;
  <mode>/accum/...  accumulation_steps=2 for `accum_steps` steps;
  <mode>/amp/...    6 steps of the fp16 graphs AMP_GRAD; at step 2 the last rank puts an inf
                    into the first parameter's gradient (a float16 overflow in rank 0's shard);
  zero/...          torch DDP + ZeroRedundancyOptimizer(AdamW) + clip_grad_norm_ (dp_worker.py);
  zero_accum/...    the same with 2 micro-batches (no_sync on the first) for `accum_steps` steps.
Checked here, on every rank: the final parameters are bit-identical on all ranks; a sharded rank
never reads, holds or binds the moments of another shard; the state is updated in place (the
addresses never change); a checkpoint of another mode is refused and changes nothing. With CKPT
(a checkpoint of shard="optimizer" written by another number of ranks) this rank's loaded state
goes to OUT/reshard<R>_<rank>.npz. Rank 0 writes OUT/result<R>.npz.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dp_worker import run_ddp, session_options, shard

from ntl_patch import DataParallel, _onnx_decode  # noqa: E402  (dp_worker put python/ on the path)

MODES = ("none", "optimizer", "gradients")
AMP_STEPS, INF_STEP = 6, 2

read_initial: list[str] = []  # every initial state tensor read from a graph file
_each = _onnx_decode.each_initializer


def _recording(path, names):
    read_initial.extend(names)
    return _each(path, names)


_onnx_decode.each_initializer = _recording


def make(grad, mode, k=1) -> DataParallel:
    read_initial.clear()
    dp = DataParallel(grad, accumulation_steps=k, providers=["CPUExecutionProvider"],
                      session_options=session_options(), shard=mode)
    check_own_moments(dp)
    return dp


def check_own_moments(dp: DataParallel) -> None:
    """A sharded rank reads, holds and binds only its own shard's moments."""
    if dp.shard == "none":
        return
    sh = dp._strategy
    own = set(sh.shards[dp.rank])
    moments = {i for i, _ in dp.state_names if sh.owner[i] not in (None, i)}
    foreign = {m for m in moments if sh.owner[m] not in own}
    update_inputs = {i.name for i in dp.update_session.get_inputs()}
    for where, names in (("read", set(read_initial)), ("held", set(dp._training.values)),
                         ("bound", update_inputs)):
        assert not names & foreign, (dp.rank, where, sorted(names & foreign)[:3])
    assert moments - foreign <= set(dp._training.values), dp.rank
    assert sum(len(s) for s in sh.shards) == len(dp.parameter_names)


def same_on_all_ranks(params: dict) -> bool:
    mine = torch.from_numpy(np.concatenate([v.ravel() for v in params.values()]).astype(np.float64))
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], e) for e in every)


def train(dp, z, rank, steps, start=0, save=None) -> np.ndarray:
    addr = {n: v.data_ptr() for n, v in dp._training.values.items()}
    losses = []
    for s in range(start, steps):
        k = dp.accumulation_steps
        micro = [shard(z, s, rank, m) for m in range(k)]
        losses.append(dp.step(micro[0] if k == 1 else micro))
        if save is not None and s + 1 == save[0]:
            dp.save_state(save[1])
            np.savez(save[2], **dp.state_dict())
    assert {n: v.data_ptr() for n, v in dp._training.values.items()} == addr, "the state moved"
    return np.array(losses)


def train_amp(grad, mode, rank) -> tuple[np.ndarray, dict]:
    dp = make(grad, mode)
    accumulate, at = dp._gradient_run.accumulate, {"step": 0}

    def poisoned(batch, grads, losses):
        accumulate(batch, grads, losses)
        if rank == dp.world_size - 1 and at["step"] == INF_STEP:
            grads[0].view(-1)[0] = float("inf")
    dp._gradient_run.accumulate = poisoned
    rng = np.random.default_rng(rank)
    rows = []
    for s in range(AMP_STEPS):
        at["step"] = s
        x, y = rng.integers(4, 40, size=(2, 7)), rng.integers(4, 40, size=(2, 7))
        total = dp.step({"input_ids": x, "labels": y})[0]
        rows.append([total, float(dp.last_step_skipped), dp.loss_scale, dp.steps_taken])
    return np.array(rows), dp.parameters()


def check_mode_refused(grad, ckpt_of: dict) -> None:
    """A checkpoint of another mode is refused in one line, and the state stays as it was."""
    for mode, other in (("none", "optimizer"), ("optimizer", "none"), ("gradients", "optimizer")):
        dp = make(grad, mode)
        before = dp.state_dict()
        try:
            dp.load_state(ckpt_of[other])
        except ValueError as e:
            assert f"shard={other!r}" in str(e) and "\n" not in str(e), e
        else:
            raise AssertionError(f"shard={mode!r} loaded a shard={other!r} checkpoint")
        after = dp.state_dict()
        assert all(np.array_equal(before[n], after[n]) for n in before)


def main() -> None:
    grad, amp_grad, batches, out = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    reshard_from = Path(sys.argv[5]) if len(sys.argv) > 5 else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, R = dist.get_rank(), dist.get_world_size()
    z = dict(np.load(batches))
    steps, accum_steps = int(z["steps"]), int(z["accum_steps"])
    res, ckpts = {}, {}

    for mode in MODES:
        ckpt = ckpts[mode] = out / f"{mode}{R}.safetensors"
        dp = make(grad, mode)
        res[f"{mode}/losses"] = train(dp, z, rank, steps,
                                      save=(steps // 2, ckpt, out / f"state{R}_{mode}_{rank}.npz"))
        params = dp.parameters()
        res[f"{mode}/same"] = np.array(same_on_all_ranks(params))
        res.update({f"{mode}/param/{n}": v for n, v in params.items()})
        if mode == "optimizer":
            res["optimizer/partition"] = np.array([len(s) for s in dp._strategy.shards])

        dp = make(grad, mode)
        dp.load_state(ckpt)
        assert dp.steps_taken == steps // 2
        res[f"{mode}/resume/losses"] = train(dp, z, rank, steps, start=steps // 2)
        res.update({f"{mode}/resume/param/{n}": v for n, v in dp.parameters().items()})

        dp = make(grad, mode, k=2)
        res[f"{mode}/accum/losses"] = train(dp, z, rank, accum_steps)
        params = dp.parameters()
        res[f"{mode}/accum/same"] = np.array(same_on_all_ranks(params))
        res.update({f"{mode}/accum/param/{n}": v for n, v in params.items()})

        rows, params = train_amp(amp_grad, mode, rank)
        every = [torch.zeros(rows.shape, dtype=torch.float64) for _ in range(R)]
        dist.all_gather(every, torch.from_numpy(rows.astype(np.float64)))
        res[f"{mode}/amp/rows"] = np.stack([e.numpy() for e in every])
        res[f"{mode}/amp/same"] = np.array(same_on_all_ranks(params))
        res.update({f"{mode}/amp/param/{n}": v for n, v in params.items()})

    check_mode_refused(grad, ckpts)
    if reshard_from is not None:
        dp = make(grad, "optimizer")
        dp.load_state(reshard_from)
        np.savez(out / f"reshard{R}_{rank}.npz", **dp.state_dict())
        train(dp, z, rank, steps, start=steps // 2)  # and it trains on
        assert same_on_all_ranks(dp.parameters())

    for name, n_steps, k in (("zero", steps, 1), ("zero_accum", accum_steps, 2)):
        losses, params, clipped = run_ddp(z, rank, n_steps, k, dp.metadata["optimizer"], zero=True)
        res[f"{name}/losses"], res[f"{name}/clipped"] = losses, np.array(clipped)
        res.update({f"{name}/param/{n}": v for n, v in params.items()})

    if rank == 0:
        np.savez(out / f"result{R}.npz", **res)
    dist.barrier()
    # not dist.destroy_process_group() (as dp_worker.py): leave without destructors
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
