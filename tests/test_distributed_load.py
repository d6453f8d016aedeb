"""Loading under torchrun without a full model on every rank: rank 0 reads the weights, the
other ranks build the architecture on the meta device, and `shard_from_rank0` gives each rank
its shards of rank 0's values (and the buffers, and the generation copy its full weights).

One 2-rank launch of a small script (`PROBE`) on the built-in model checks, on each rank: the
model it built held no storage before sharding (rank 1), every gathered parameter and every
buffer equals the loaded model's bit for bit, the tied LM head is still the embedding (in the
sharded model and in the generation copy), and the generation copy equals the loaded model;
and that a refusal on rank 0 alone stops every rank with its line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow

PROBE = """
import json, sys
import torch, torch.distributed as dist
from mileage.distributed import env
from mileage.distributed.parallelize import ParallelConfig, full_value, is_meta, shard_run_models
from mileage.models.hf import empty_causal_lm, load_causal_lm

dist.init_process_group("gloo")
path, out = sys.argv[1], sys.argv[2]
loaded = load_causal_lm(path)  # what every rank compares with (the test's own copy)
expected = {k: v.clone() for k, v in loaded.state_dict().items()}
buffers = {k: v.clone() for k, v in loaded.named_buffers()}
from mileage.distributed.setup import load_on_rank0
model = load_on_rank0(lambda: load_causal_lm(path), path)
built_on_meta = is_meta(model)
reference = load_causal_lm(path) if env.is_main() else empty_causal_lm(path, device="meta")
model, reference, copy = shard_run_models(model, reference, ParallelConfig(device="cpu"))
report = {
    "built_on_meta": built_on_meta,
    "params_differ": [k for k, v in model.state_dict().items()
                      if not torch.equal(full_value(v), expected[k])],
    "reference_differs": [k for k, v in reference.state_dict().items()
                          if not torch.equal(full_value(v), expected[k])],
    "buffers_differ": [k for k, v in model.named_buffers() if not torch.equal(v, buffers[k])],
    "copy_differs": [k for k, v in copy.state_dict().items() if not torch.equal(v, expected[k])]
                    + [k for k, v in copy.named_buffers() if not torch.equal(v, buffers[k])],
    "tied": [model.lm_head.weight is model.model.embed_tokens.weight,
             copy.lm_head.weight is copy.model.embed_tokens.weight],
}
# a refusal while rank 0 alone reads (a damaged critic/, say) stops every rank with its line
from mileage.distributed.coordination import on_rank0, stop_together
from mileage.errors import UserError
def refuse_on_rank0():
    if env.is_main():
        raise UserError("rank 0 refused the file")
    return "rank 1 went on"
try:
    report["stopped"] = stop_together(refuse_on_rank0)
except UserError as exc:
    report["stopped"] = f"UserError: {exc}"
report["rank0_said"] = on_rank0(lambda: f"rank {env.rank()}")  # rank 0's answer, on every rank
try:
    on_rank0(refuse_on_rank0)
except UserError as exc:
    report["rank0_refused"] = str(exc)
with open(f"{out}.{env.rank()}", "w") as f:
    json.dump(report, f)
# no rank tears its gloo connections down while the other may still read the last broadcast
# (once, under the full suite's load, rank 1 aborted here: "terminate called without an
# active exception")
dist.barrier()
dist.destroy_process_group()
"""


def test_rank_0_alone_loads_and_every_rank_gets_exactly_its_values(builtin_model, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(PROBE))
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         str(probe), str(builtin_model), str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"report.{rank}").read_text()) for rank in (0, 1)]
    assert [r["built_on_meta"] for r in reports] == [False, True]
    for report in reports:
        assert report["params_differ"] == [] and report["reference_differs"] == []
        assert report["buffers_differ"] == [] and report["copy_differs"] == []
        assert report["tied"] == [True, True]
        assert report["stopped"] == "UserError: rank 0 refused the file"
        assert report["rank0_said"] == "rank 0"
        assert report["rank0_refused"] == "rank 0 refused the file"
