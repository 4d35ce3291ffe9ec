"""torch's FSDPMemTracker on the FSDP2 Llama step memfit measures, for comparison.

    python benchmarks/distributed_memtracker.py WORLD_SIZE [KEY=VALUE ...]   # zoo llama sizes, e.g. preset=8b

Rank 0 on the fake process group and fake tensors, as torchtitan's memory estimation does: two
iterations under the tracker, its stats reset after the first; prints its peak snapshot. The
step is transformers' as it runs on fake tensors without memfit's adapter (measure/_hf_fake.py):
it builds the attention masks a real step skips.
"""

from __future__ import annotations

import copy
import sys
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from memfit import zoo
from memfit.cli import parse_sizes


def main() -> int:
    world = int(sys.argv[1])
    sizes = parse_sizes(sys.argv[2:])
    foreach = sizes.pop("foreach", False)  # AdamW's; the comparison used False
    work = zoo.build("llama", **sizes)
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = init_device_mesh("cpu", (world,))
    start = time.perf_counter()
    model = copy.deepcopy(work.model).to("meta")
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = work.parallel.parallelize(model, mesh)
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach)
        ids = mode.from_tensor(work.inputs["input_ids"])
        tracker = FSDPMemTracker(model, opt)
        tracker.track_inputs((ids,))
        with tracker:
            for i in range(2):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                if i == 0:
                    tracker.reset_mod_stats()
    for dev, snap in tracker.get_tracker_snapshot("peak").items():
        print(dev, {str(k): v for k, v in snap.items() if v})
    print(f"{time.perf_counter() - start:.1f} s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
