"""One rank of test_train.py's torchrun test: read the table through EmbeddingDataset (one read
shared by the ranks) and record the ids of every batch of two epochs.
    python -m torch.distributed.run --nproc-per-node 2 train_ranks.py DSN OUT_DIR"""

import json
import os
import sys

import torch.distributed as dist

from embedfleet.train import EmbeddingDataset

dsn, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
ds = EmbeddingDataset.from_table("reviews", label="rating", db=dsn, device="cpu", cache="ram")
vectors = ds.vectors()
row_of = {vectors[k].numpy().tobytes(): k for k in range(len(ds))}  # every review's text, so vector, differs
record = {"ids": list(ds.ids), "epochs": {}}
for epoch in (0, 1):
    # rank and world size come from torch.distributed
    record["epochs"][epoch] = [[ds.ids[row_of[v.numpy().tobytes()]] for v in x] for x, _ in ds.batches(7, epoch=epoch)]
with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
