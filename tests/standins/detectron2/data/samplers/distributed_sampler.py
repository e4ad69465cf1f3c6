"""Stand-in for ``detectron2.data.samplers.distributed_sampler``: a training sampler whose
shuffling seed is shared through ``comm.shared_random_seed()``."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from detectron2.utils import comm


class TrainingSampler:
    """This rank's share of an endless shuffled stream of ``size`` indices."""

    def __init__(self, size: int, seed: int | None = None) -> None:
        self._size = size
        self.seed = comm.shared_random_seed() if seed is None else int(seed)
        self._rank, self._world = comm.get_rank(), comm.get_world_size()

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng(self.seed)
        while True:
            yield from rng.permutation(self._size)[self._rank :: self._world].tolist()
