"""Ledger diff on hand-made ledgers, the ledger file format, and the swimlane view (no engines)."""

from __future__ import annotations

import os
import threading

import pandas as pd
import pytest

from workbench.analysis.collectives import (
    OPEN,
    any_timed_out,
    describe,
    diagnose,
    first_divergence,
    is_hang,
    last_calls,
    ledger_table,
    read_ledger,
)
from workbench.errors import RankFailure
from workbench.rank.ledger import Ledger
from workbench.viz import swimlane


def call(rank, seq, op="all_reduce", dtype="float32", numel=4, group="0", state="completed", src=None, **kw):
    size = {"float32": 4, "bfloat16": 2, "int64": 8}[dtype]
    return {"rank": rank, "session": "s", "attempt": 0, "step": "x", "group": group, "group_ranks": [0, 1],
            "seq": seq, "op": op, "dtypes": [dtype], "shapes": [[numel]], "numel": numel, "bytes": numel * size,
            "src": src, "state": state, "t_start": float(seq) + rank / 10, **kw}


def both(*ops):
    return [call(r, i + 1, **o) for r in (0, 1) for i, o in enumerate(ops)]


def test_equal_ledgers_have_no_divergence():
    df = ledger_table(both({}, {"op": "broadcast", "src": 0}, {"op": "all_gather_into_tensor", "numel": 8}))
    assert first_divergence(df) is None
    assert len(df) == 6 and set(df["state"]) == {"completed"}


def test_extra_call_is_named_with_the_rank_that_made_it():
    # rank 0: bc fp32 (extra), bc bf16, all_reduce; rank 1: bc bf16, all_reduce -- the headline's shape.
    rows = [call(0, 1, op="broadcast", src=0, numel=64, via="_broadcast_coalesced", bucket=0, bucket_tensors=2),
            call(0, 2, op="broadcast", src=0, dtype="bfloat16", numel=1000, via="_broadcast_coalesced", bucket=1),
            call(0, 3),
            call(1, 1, op="broadcast", src=0, dtype="bfloat16", numel=1064, via="_broadcast_coalesced", bucket=0),
            call(1, 2)]
    div = first_divergence(ledger_table(rows))
    assert div is not None and div.kind == "extra"
    assert (div.rank, div.seq, div.group) == (0, 1, "0")
    assert div.call["dtypes"] == "float32" and div.call["op"] == "broadcast"
    assert "rank 0 issued an extra broadcast #1 float32 [64] 256 B" in div.message
    assert "2 tensors" in div.message


def test_trailing_call_one_rank_made_is_extra():
    df = ledger_table([*both({}, {}), call(0, 3, op="barrier", state=OPEN)])
    div = first_divergence(df)
    assert div.kind == "extra" and div.ranks == [0] and div.seq == 3
    assert "never issued a call #3" in div.message


def test_dtype_mismatch():
    rows = [*both({}), call(0, 2, dtype="float32", numel=8), call(1, 2, dtype="bfloat16", numel=8)]
    div = first_divergence(ledger_table(rows))
    assert div.kind == "dtype" and div.seq == 2 and div.ranks == [1]
    assert "different dtypes" in div.message


def test_the_same_call_retyped_is_a_dtype_mismatch_not_an_extra_call_and_keeps_its_labels():
    """The stale conversion cache: the receiver's cached spec says bf16 [8], the owner sends fp32 [8], and the
    owner goes on to more calls than the receiver (which died). Same op, same count: a retyped call."""
    stale = "conversion task for `bias` receives per the spec cached at sync 1: bfloat16 [8]"
    rows = [*both({"op": "broadcast", "src": 1, "dtype": "bfloat16", "numel": 8}),
            call(0, 2, op="broadcast", src=1, dtype="bfloat16", numel=8, label=stale),
            call(1, 2, op="broadcast", src=1, numel=8, label="the owner sends its current float32 [8]"),
            call(1, 3, op="broadcast", src=1, dtype="bfloat16", numel=8)]
    div = first_divergence(ledger_table(rows))
    assert div.kind == "dtype" and div.seq == 2
    assert f"[{stale}]" in div.message and "[the owner sends its current float32 [8]]" in div.message


def test_size_mismatch():
    rows = [*both({}), call(0, 2, op="broadcast", src=0, numel=64), call(1, 2, op="broadcast", src=0, numel=32)]
    div = first_divergence(ledger_table(rows))
    assert div.kind == "size" and div.seq == 2 and div.ranks == [1]


def test_op_mismatch_the_eval_hang():
    rows = both(*[{"op": "all_gather_into_tensor", "numel": 100}] * 3)
    rows += [call(0, 4, state=OPEN), call(1, 4, op="all_gather_into_tensor", numel=100, state=OPEN)]
    df = ledger_table(rows)
    div = first_divergence(df)
    assert div.kind == "op" and div.seq == 4
    hang = diagnose("evaluate", df, {0: RankFailure(0, "timeout", "Timeout", "t"),
                                      1: RankFailure(1, "timeout", "Timeout", "t")}, [0, 1], deadline_s=3)
    assert hang.stuck[0].startswith("all_reduce #4") and hang.stuck[1].startswith("all_gather_into_tensor #4")
    assert hang.finished == [] and "within its 3s deadline" in hang.message and hang.caught_by == "step deadline"
    assert list(last_calls(df)["seq"]) == [4, 4]


def test_hang_names_the_earliest_open_call_when_calls_queue_behind_it():
    # NCCL: rank 1 queued two more all-gathers behind the one that cannot pair.
    rows = [*both({}), call(0, 2, state=OPEN),
            *[call(1, k, op="all_gather_into_tensor", numel=64, state=OPEN) for k in (2, 3, 4)]]
    hang = diagnose("evaluate", ledger_table(rows), {}, [0, 1])
    assert hang.stuck[1].startswith("all_gather_into_tensor #2")
    assert "2 more queued behind it" in hang.ranks.set_index("rank").loc[1, "status"]


def test_hang_diagnosis_tells_stuck_from_finished_and_dead():
    rows = [*both({}), call(0, 2, state=OPEN)]
    df = ledger_table(rows)
    assert is_hang({0: RankFailure(0, "timeout", "Timeout", "t")}, df)
    assert not is_hang({}, ledger_table(both({})))
    hang = diagnose("s", df, {0: RankFailure(0, "timeout", "Timeout", "t")}, [0, 1])
    assert list(hang.stuck) == [0] and hang.finished == [1]
    dead = diagnose("s", df, {1: RankFailure(1, "died", "EngineDied", "gone")}, [0, 1])
    assert dead.dead == [1]


def test_a_rank_that_returned_with_an_error_while_its_call_stays_open_hung():
    """NCCL: the step returns at once, then the probe's wait for the stuck stream gives up (an
    error, not a deadline miss). The open call in the ledger makes it a hang all the same."""
    df = ledger_table([*both({}), call(0, 2, state=OPEN)])
    assert not is_hang({}, df)  # still running, no error: not yet
    assert is_hang({}, df, errored={0})
    assert not is_hang({}, ledger_table(both({})), errored={0})  # an error with nothing open is no hang
    hang = diagnose("s", df, {}, [0, 1])
    assert list(hang.stuck) == [0] and hang.finished == [1]


def test_strict_mode_mismatch_counts_as_caught():
    msg = "RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: ..."
    df = ledger_table([call(0, 1, state="failed", error=msg), call(1, 1, op="broadcast", src=0, state="failed",
                                                                     error=msg)])
    assert is_hang({}, df)
    hang = diagnose("wrap", df, {}, [0, 1])
    assert hang.caught_by.startswith("strict mode") and hang.finished == [0, 1] and hang.divergence.kind == "op"
    assert "caught a collective mismatch" in hang.message


def test_without_a_failed_rank_only_a_timed_out_or_strict_row_can_make_a_hang():
    """A clean step skips building its ledger table: ``any_timed_out`` on raw rows must agree with
    ``is_hang`` whenever no rank failed or errored."""
    strict = "RuntimeError: Detected mismatch between collectives on ranks."
    cases = [both({}), both({}, {"op": "broadcast", "src": 0}), [call(0, 1, state=OPEN), call(1, 1)],
             [call(0, 1, state="timed out"), call(1, 1)], [call(0, 1, state="failed", error=strict), call(1, 1)],
             [call(0, 1, state="failed", error="RuntimeError: something else"), call(1, 1)]]
    seen = [any_timed_out(rows) for rows in cases]
    assert seen == [is_hang({}, ledger_table(rows)) for rows in cases] == [False, False, False, True, True, False]


def test_groups_are_aligned_separately():
    rows = [*both({"group": "0"}), call(0, 1, group="1"), call(1, 1, group="1", dtype="int64")]
    div = first_divergence(ledger_table(rows))
    assert div.group == "1" and div.kind == "dtype"


def test_ledger_file_is_readable_line_by_line_while_open(tmp_path):
    book = Ledger(str(tmp_path), rank=0, session="s", attempt=0)
    book.write({"ev": "start", "rank": 0, "session": "s", "attempt": 0, "group": "0", "seq": 1, "op": "all_reduce",
                "dtypes": ["float32"], "shapes": [[2]], "numel": 2, "bytes": 8, "t": 1.0})
    with open(tmp_path / "rank0.jsonl", "a") as f:
        f.write('{"ev": "start", "rank": 0, "se')  # a record still being written
    df = read_ledger(str(tmp_path))  # the writer has not closed the file: a stuck rank
    assert len(df) == 1 and df.loc[0, "state"] == OPEN and df.loc[0, "op"] == "all_reduce"
    book.close()


def test_ledger_writes_are_whole_lines_under_threads(tmp_path):
    book = Ledger(str(tmp_path), rank=1)

    def writer(k):
        for i in range(200):
            book.write({"ev": "start", "rank": 1, "group": str(k), "seq": i + 1, "op": "x" * 50, "t": 0.0})

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    book.close()
    assert len(read_ledger(str(tmp_path))) == 800


def test_describe_and_swimlane_mark_the_divergence_and_hung_calls():
    rows = [*both({}), call(0, 2, state=OPEN), call(1, 2, op="all_gather_into_tensor", numel=64, state=OPEN)]
    df = ledger_table(rows)
    assert describe(df.iloc[0]).startswith("all_reduce #1 float32 [4] 16 B")
    fig = swimlane(df)
    names = [t.name for t in fig.data]
    assert "hung (still inside)" in names and "all_gather_into_tensor" in names
    assert len(fig.layout.shapes) == 1 and fig.layout.shapes[0].x0 == pytest.approx(1.5)
    assert "first divergence: op" in fig.layout.annotations[0].text
    assert len(swimlane(ledger_table([])).data) == 0


def test_ledger_table_is_parquet_safe(tmp_path):
    df = ledger_table(both({}, {"op": "broadcast", "src": 0}))
    df.to_parquet(tmp_path / "l.parquet")
    back = pd.read_parquet(tmp_path / "l.parquet")
    assert first_divergence(back) is None and len(back) == 4


def test_a_frame_names_its_failed_ranks_without_building_its_events_table():
    from workbench.analysis.frames import Frame

    values = {r: {"tensors": [], "outputs": [], "elapsed": 0.1, "notes": [], "error": None} for r in (0, 1, 2)}
    values[1]["error"] = {"error": "ValueError", "message": "bad", "traceback": ""}
    values[2]["error"] = {"kind": "skipped", "error": "Skipped", "message": "earlier", "traceback": ""}
    frame = Frame.build("s", 0, "sc", None, values, {0: RankFailure(0, "timeout", "Timeout", "late")})
    assert frame.ranks_with("error") == {1} and frame.ranks_with("skipped") == {2}
    assert frame.ranks_with("timeout") == {0} and isinstance(frame._tables["events"], list)  # still raw
    assert len(frame.events) == 3 and frame.ranks_with("error") == {1}  # the same once the table exists


def test_pairing_compares_what_travels_between_each_pair_not_the_arguments():
    # DTensor's distribute_tensor: rank 0 scatters two [64, 64] chunks, rank 1 passes no scatter list
    src = call(0, 1, op="scatter", numel=8192, src=0, send={"1": "float32:4096"}, recv={})
    dst = call(1, 1, op="scatter", numel=0, src=0, send={}, recv={"0": "float32:4096"})
    dst.update(dtypes=[], shapes=[])
    assert first_divergence(ledger_table([src, dst])) is None
    # rows that do not say what travels (Flight Recorder, older bundles) compare the arguments, as before
    old = [{k: v for k, v in r.items() if k not in ("send", "recv")} for r in (src, dst)]
    assert first_divergence(ledger_table(old)).kind == "dtype"
    short = dict(dst, recv={"0": "float32:2048"})  # rank 1 posts half of what rank 0 sends it
    div = first_divergence(ledger_table([src, short]))
    assert div.kind == "size" and div.seq == 1
    # all_to_all_single with uneven splits: each pair agrees, though no two ranks pass alike sizes
    a = call(0, 1, op="all_to_all_single", numel=4, send={"1": "float32:3"}, recv={"1": "float32:2"})
    b = call(1, 1, op="all_to_all_single", numel=4, send={"0": "float32:2"}, recv={"0": "float32:3"})
    assert first_divergence(ledger_table([a, b])) is None
    assert first_divergence(ledger_table([a, dict(b, recv={"0": "int32:3"})])).kind == "dtype"


def test_a_row_issued_by_a_library_names_the_users_line_and_the_librarys_beside_it():
    c = call(0, 1, op="broadcast", src=0, user_frame="/w/my.py:40 load",
             library_frame="/v/lib/python3.11/site-packages/accelerate/utils/fsdp_utils.py:522 load_full")
    assert describe(c).endswith("at w/my.py:40 load (in accelerate/utils/fsdp_utils.py:522 load_full)")
    scrubbed = dict(c, library_frame="<site-packages>/accelerate/utils/fsdp_utils.py:522 load_full")
    assert describe(scrubbed).endswith("at w/my.py:40 load (in accelerate/utils/fsdp_utils.py:522 load_full)")
    assert describe(dict(c, library_frame=None)).endswith("at w/my.py:40 load")
    assert describe(dict(c, user_frame=None)).endswith("at accelerate/utils/fsdp_utils.py:522 load_full")


FSDP2_CALL = "<site-packages>/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:89 __call__"


def test_a_row_torch_itself_issued_names_torchs_line_beside_the_users():
    """FSDP's all-gather, DDP's reducer and its buffer broadcast, DTensor, the state-dict loaders: torch's own
    modules issue the call; a row recorded before the ledger named them (a recorded bundle, a Flight Recorder
    import) still has the issuing frame as its ``caller``."""
    user = "/w/train.py:42 step"
    fsdp = call(0, 9, op="all_gather_into_tensor", user_frame=user, caller=FSDP2_CALL, library_frame="")
    assert describe(fsdp).endswith(
        "at w/train.py:42 step (in torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:89 __call__)")
    ddp = call(0, 4, user_frame=user, caller="/v/lib/python3.11/site-packages/torch/autograd/graph.py:979 "
                                             "_engine_run_backward")
    assert describe(ddp).endswith("at w/train.py:42 step (in torch/autograd/graph.py:979 _engine_run_backward)")
    ddp_forward = call(0, 5, op="broadcast", src=0, user_frame=user,
                       caller="/v/lib/python3.11/site-packages/torch/nn/parallel/distributed.py:1775 _pre_forward")
    assert describe(ddp_forward).endswith("(in torch/nn/parallel/distributed.py:1775 _pre_forward)")
    # the user's own call, and torch's plumbing that is no module of its own: the user's line alone
    assert describe(call(0, 1, user_frame=user, caller=user)).endswith("at w/train.py:42 step")
    funcol = "/v/lib/python3.11/site-packages/torch/_library/autograd.py:41 forward_no_grad"
    assert describe(call(0, 1, user_frame=user, caller=funcol)).endswith("at w/train.py:42 step")


def test_the_library_line_is_the_innermost_module_that_issued_the_call():
    """The ledger's rule, on a Flight Recorder entry's frames (innermost first): a third-party library that called
    torch.distributed itself, else torch's own distributed module, else autograd (a call C++ issued in backward);
    never a library that only ran a module (transformers' layer with FSDP2's hooks inside)."""
    from workbench.rank import ledger, ledger_fr

    torch_dir = ledger._TORCH_DIR
    site = os.path.dirname(torch_dir)

    def at(path, line, name):
        return {"filename": path, "line": line, "name": name}

    user = at("/w/train.py", 42, "step")
    fsdp = at(f"{torch_dir}/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 364, "foreach_all_gather")
    module = at(f"{torch_dir}/nn/modules/module.py", 1784, "_call_impl")
    llama = at(f"{site}/transformers/models/llama/modeling_llama.py", 300, "forward")
    accel = at(f"{site}/accelerate/utils/fsdp_utils.py", 522, "fsdp2_load_full_state_dict")
    scatter = at(f"{torch_dir}/distributed/tensor/_collective_utils.py", 151, "mesh_scatter")
    graph = at(f"{torch_dir}/autograd/graph.py", 979, "_engine_run_backward")
    tensor = at(f"{torch_dir}/_tensor.py", 630, "backward")

    def lib(*frames):
        return ledger_fr.frames({"frames": list(frames)})[3]

    assert lib(fsdp, module, llama, module, user) == f"{fsdp['filename']}:364 foreach_all_gather"
    assert lib(scatter, accel, user) == f"{accel['filename']}:522 fsdp2_load_full_state_dict"
    assert lib(graph, tensor, user) == f"{graph['filename']}:979 _engine_run_backward"
    assert lib(user) == ""


def test_an_exception_is_a_cause_unless_a_collective_raised_it():
    from workbench.analysis import cause

    tb = ('Traceback (most recent call last):\n  File "/w/workbench/rank/remote.py", line 63, in run_step\n'
          '  File "/w/my.py", line 40, in load\n'
          '  File "/v/lib/python3.11/site-packages/accelerate/utils/fsdp_utils.py", line 494, in infer\n'
          '  File "/v/lib/python3.11/site-packages/torch/nn/modules/module.py", line 728, in get_submodule\n'
          "AttributeError: no attribute `sidecar`\n")
    assert cause.raised_at(tb) == "w/my.py:40 load (in accelerate/utils/fsdp_utils.py:494 infer)"
    assert not cause.is_symptom(tb, "no attribute `sidecar`")
    timeout = tb.replace("torch/nn/modules/module.py", "torch/distributed/distributed_c10d.py")
    assert cause.is_symptom(timeout, "")
    assert cause.is_symptom(tb, "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv")


def test_a_root_reads_as_the_users_global_rank_with_the_group_rank_beside_it():
    from workbench.analysis.collectives import describe

    rows = ledger_table([call(2, 1, op="broadcast", group="2", group_ranks=[1, 2], src=2, group_src=1),
                         call(0, 1, op="broadcast", src=0, group_src=0), call(1, 1, op="broadcast", src=1)])
    said = {int(r["rank"]): describe(r) for _, r in rows.iterrows()}
    assert said[2].startswith("broadcast #1 float32 [4] 16 B src=2 (group rank 1)"), said
    assert said[0].startswith("broadcast #1 float32 [4] 16 B src=0") and "group rank" not in said[0]  # one value
    assert said[1] == "broadcast #1 float32 [4] 16 B src=1"  # older rows: no group_src, read as before


def test_an_argument_c10d_refuses_is_the_raising_ranks_cause():
    from workbench.analysis import cause

    tb = ('Traceback (most recent call last):\n  File "/w/my.py", line 18, in exchange\n'
          '  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 1134, in get_group_rank\n')
    msg = "Global rank 1 is not part of group <torch.distributed.distributed_c10d.ProcessGroup object at 0x7f6f9>"
    assert not cause.is_symptom(tb, msg, "ValueError")  # refused before anything went out: the cause
    assert cause.is_symptom(tb, "Connection closed by peer [127.0.0.1]:29572", "RuntimeError")
    assert cause.is_symptom(tb, "Group 'x' is not registered, please create group first", "ValueError")
    assert not cause.is_symptom(tb, "ProcessGroupGloo::broadcast: invalid root rank: 3", "RuntimeError")
    assert cause.is_symptom(tb, "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                                "8000ms for recv operation to complete", "RuntimeError")
    e = {"rank": 3, "error": "ValueError", "message": msg, "traceback": tb}
    assert cause.told([{**e, "rank": 0}, e], "exchange") == [
        "ranks 0,3 raised ValueError at w/my.py:18 exchange in step `exchange`: Global rank 1 is not part of group "
        "<ProcessGroup>"]
