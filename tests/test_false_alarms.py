"""Right code reads clean on real transformers architectures (issue 51's false-alarm proof, its cheapest cases).

One torchrun job (2 CPU ranks, gloo) of ``benchmarks/false_alarms.py``'s worker: a tiny ``LlamaForCausalLM``
wrapped with FSDP2 (``fully_shard`` per decoder layer and the root) and with DDP, two optimizer steps on each
rank's own batch, ``cap.point`` after the wrap and after each step; each capture's diagnosis is clean though the
logits and losses differ across ranks. A control in the same job (rank 1's ``lm_head`` changed after DDP's
broadcast) shows the same reading still names a real divergence. The full table: ``python
benchmarks/false_alarms.py`` (docs/performance.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import workbench as wb

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import false_alarms  # noqa: E402  (benchmarks/false_alarms.py: the worker and the verdict)

pytestmark = pytest.mark.slow  # one torchrun job of three captures: ~25 s on a 2-core box


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("false-alarms") / "job"
    run = false_alarms.run_job(out, ["llama-fsdp2", "llama-ddp", "llama-ddp-broken"])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


@pytest.mark.parametrize("case", ["llama-fsdp2", "llama-ddp"])
def test_a_llama_step_on_per_rank_batches_reads_clean(job, case):
    rec = wb.load(job / case).bug
    assert rec.steps == ["wrap", "step0", "step1"]
    o = rec.outputs
    assert o.groupby(["step", "name"])["fingerprint"].nunique().min() == 2  # the ranks' logits and loss differ
    assert false_alarms.verdict(job / case) == ("clean", ""), rec.diagnose().sentence


def test_the_same_reading_names_a_replica_changed_after_the_wrap(job):
    v, sentence = false_alarms.verdict(job / "llama-ddp-broken")
    assert v == "FALSE ALARM"  # here a true one: the control's divergence is named, exactly that tensor
    assert sentence.startswith("`lm_head.weight` on rank 1 differs from step `wrap` on"), sentence
