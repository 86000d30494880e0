"""A process of test_table_dataset.py's rank and resume tests: reads `meas` through TableDataset and records
each batch's row ids (feature `rid_f` holds the id) and its x bit for bit.

    python table_steps.py DSN OUT MODE [K]
MODE: all     epochs 0-2 whole;
      stop    3 steps of epoch 0, then state_dict() to OUT/state.json;
      resume  load_state_dict(OUT/state.json), then the rest of its epoch and epochs to 2;
      ranks   (under torch.distributed.run) epochs 0-1 on this rank, the rank and world size from torch.distributed.
"""

import json
import os
import sys

from embedfleet.train import TableDataset

FEATURES = ["rid_f", "rssi", "snr", "rx", "emb", "raw"]
dsn, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
batch = 32
if mode == "ranks":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    name = f"rank{dist.get_rank()}.json"
    batch = 16
else:
    name = f"{mode}.json"
ds = TableDataset.from_table("meas", features=FEATURES, label="cls", db=dsn, device="cpu",
                             cache=os.environ.get("TIER", "ram"))
rid = ds.feature_slices["rid_f"]
record = []


def keep(epoch, x, y):
    record.append({"epoch": epoch, "ids": [int(v) for v in x[:, rid].flatten().tolist()], "x": x.numpy().tobytes().hex(),
                   "y": y.tolist()})


if mode == "resume":
    ds.load_state_dict(json.load(open(os.path.join(out, "state.json"))))
first = ds.state_dict()["epoch"] if mode == "resume" else 0
for epoch in range(first, 2 if mode == "ranks" else 3):
    for step, (x, y) in enumerate(ds.batches(batch, epoch=epoch)):
        keep(epoch, x, y)
        if mode == "stop" and step == 2:
            json.dump(ds.state_dict(), open(os.path.join(out, "state.json"), "w"))
            break
    if mode == "stop":
        break
json.dump(record, open(os.path.join(out, name), "w"))
if mode == "ranks":
    dist.destroy_process_group()
