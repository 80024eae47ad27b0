"""The torch.distributed process group DataParallel trains over, as the training strategies use
it: its size, this process's rank, and the two calls that depend on the device (a barrier that
NCCL needs told the GPU of) or on the group (a group rank to the global rank torch's
point-to-point calls take)."""

from __future__ import annotations


class Collective:
    def __init__(self, torch, dist, group, world_size: int, rank: int, device: str, device_id: int):
        self.torch, self.dist, self.group = torch, dist, group
        self.world_size, self.rank = world_size, rank
        self.device, self.device_id = device, device_id

    def barrier(self) -> None:
        if self.world_size > 1:
            if self.device == "cpu":
                self.dist.barrier(group=self.group)
            else:
                self.dist.barrier(group=self.group, device_ids=[self.device_id])

    def global_rank(self, r: int) -> int:
        return r if self.group is None else self.dist.get_global_rank(self.group, r)
