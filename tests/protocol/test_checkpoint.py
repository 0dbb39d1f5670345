"""The guard of ``fedudp/protocol/checkpoint.py`` (docs/architecture.md#checkpoints-and-stops).

A checkpoint reads back bit for bit; the newest ``keep`` are kept; ``every`` sets the cadence;
another run's, a damaged or a truncated checkpoint is reported and the previous one used; a
write is atomic (temporary file, fsync, rename, folder fsync), so a crash leaves the previous
checkpoint or the new one. End-to-end resume (SIGKILL, SIGINT, every method) is
tests/test_faults.py's.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from fedudp.protocol import checkpoint
from fedudp.protocol.checkpoint import CheckpointError, Checkpointer


def bits(t: torch.Tensor) -> bytes:
    """A tensor's raw bytes (NaN payloads, -0.0 and subnormals included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def same(a, b) -> bool:
    """Equal in type and value, tensors bit for bit (dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bits(a) == bits(b)
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


def names(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


def reporter():
    seen: list[str] = []
    return seen, seen.append


def a_state(seed: int = 0) -> dict:
    """A round loop's state as the billboard and transport give it (plain types, tensors)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(257, generator=g)
    u[:5] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45])  # subnormal
    rng = np.random.default_rng(seed)
    rng.random(3)
    return {
        "billboard": {
            "u": u,
            "entries": [
                {
                    "round": 1,
                    "event": "GaussianDpEvent(noise_multiplier=1.1)",
                    "noise_multiplier": 1.1,
                    "noise_std": None,
                    "sampling_rate": 0.5,
                    "epsilon": 0.25,
                    "epsilon_rdp": float("inf"),
                }
            ],
            "plan": {
                "avg": torch.randn(3, 4, generator=g, dtype=torch.float64),
                "phase_starts": [1, 4],
                "halted": False,
                "at": None,
            },
        },
        "transport": {
            "personal": torch.randint(-(2**62), 2**62, (4, 3), generator=g),
            "mask": torch.rand(9, generator=g) > 0.5,
            "half": torch.randn(6, generator=g).to(torch.bfloat16),
            "owners_saved": [],
            "pair": (2, "x"),
        },
        "rng": {
            "torch": torch.Generator().manual_seed(seed + 1).get_state(),
            "numpy": rng.bit_generator.state,
        },
        "array": torch.from_numpy(np.arange(12, dtype=np.int32).reshape(3, 4)),
        "history": json.dumps([{"round": 1, "accuracy_mean": 0.5}]),
    }


# -- the bytes ------------------------------------------------------------------------------------
# (moved from tests/test_faults.py)
def test_checkpoint_bytes_are_checked():
    good = checkpoint.dump({"x": torch.arange(3)})
    assert torch.equal(checkpoint.load_bytes(good)["x"], torch.arange(3))
    for bad, why in [
        (b"", "empty file"),
        (b"PK\x03\x04" + good[20:], "bad magic"),
        (good[:-1], "checksum"),
        (good[:-1] + bytes([good[-1] ^ 1]), "checksum"),
    ]:
        with pytest.raises(checkpoint.CheckpointError, match=why):
            checkpoint.load_bytes(bad)


def test_dump_layout_is_magic_digest_payload():
    import hashlib

    data = checkpoint.dump({"x": 1})
    assert data.startswith(checkpoint.MAGIC)
    head = len(checkpoint.MAGIC)
    assert data[head : head + 32] == hashlib.sha256(data[head + 32 :]).digest()
    # a digest cut short is a truncation, not an index error
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint.load_bytes(data[: head + 10])


_CALLED: list = []


def _side_effect(x):
    _CALLED.append(x)
    return x


class _Evil:
    def __reduce__(self):
        return (_side_effect, ("unpickled code ran",))


def test_payloads_that_are_not_plain_dicts_are_refused_without_running_code():
    with pytest.raises(CheckpointError, match="not a checkpoint dict"):
        checkpoint.load_bytes(checkpoint.dump([1, 2]))  # checksum fine, not a dict
    with pytest.raises(CheckpointError, match="unreadable payload"):
        checkpoint.load_bytes(checkpoint.dump({"x": _Evil()}))  # weights_only refuses it
    assert _CALLED == []
    # a raw numpy array is no plain type either: the checkpoint is unusable, never misread
    with pytest.raises(CheckpointError, match="unreadable payload"):
        checkpoint.load_bytes(checkpoint.dump({"x": np.arange(3)}))


def test_plain_makes_numpy_scalars_python_and_loadable():
    x = {
        "a": np.float64(1.5),
        3: (np.int64(2), [np.float32(0.5), np.bool_(True)]),
        "t": torch.ones(2),
        "s": "keep",
    }
    p = checkpoint.plain(x)
    assert p["a"] == 1.5 and type(p["a"]) is float
    assert p["3"] == [2, [0.5, True]] and type(p["3"][0]) is int and type(p["3"][1][1]) is bool
    assert p["t"] is x["t"] and p["s"] == "keep"  # tensors and str untouched
    assert same(checkpoint.load_bytes(checkpoint.dump(p)), p)


def test_load_file_turns_os_errors_into_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError):
        checkpoint.load_file(tmp_path / "ckpt-000001.pt")  # missing
    (tmp_path / "ckpt-000002.pt").mkdir()
    with pytest.raises(CheckpointError):
        checkpoint.load_file(tmp_path / "ckpt-000002.pt")  # a folder


# -- a checkpoint reads back as written -----------------------------------------------------------
def test_checkpoint_after_round_r_reads_back_bit_for_bit(tmp_path):
    state = a_state()
    state["round"] = 99  # overridden: the round saved is the one given
    keys = set(state)
    ck = Checkpointer(tmp_path, every=1, keep=2, identity="run-A")
    path = ck.save(3, state)
    assert path == tmp_path / "ckpt-000003.pt" and names(tmp_path) == {"ckpt-000003.pt"}
    assert set(state) == keys and state["round"] == 99  # the caller's dict is not mutated
    loaded = Checkpointer(tmp_path, identity="run-A").load_latest()
    assert loaded["round"] == 3 and loaded["identity"] == "run-A"
    want = {**a_state(), "round": 3, "identity": "run-A"}
    assert same(loaded, want)
    assert same(checkpoint.load_file(path), want)
    # the saved random streams continue exactly where they stopped
    g = torch.Generator()
    g.set_state(loaded["rng"]["torch"])
    assert torch.equal(
        torch.rand(5, generator=g), torch.rand(5, generator=torch.Generator().manual_seed(1))
    )
    r = np.random.default_rng()
    r.bit_generator.state = loaded["rng"]["numpy"]
    ref = np.random.default_rng(0)
    ref.random(3)
    assert np.array_equal(r.random(4), ref.random(4))
    assert np.array_equal(loaded["array"].numpy(), np.arange(12, dtype=np.int32).reshape(3, 4))


def test_load_latest_sets_resumed_and_takes_the_newest(tmp_path):
    ck = Checkpointer(tmp_path, every=1, keep=5, identity="A")
    for r in (1, 2, 3):
        ck.save(r, {"u": torch.full((2,), float(r))})
    fresh = Checkpointer(tmp_path, identity="A")
    assert fresh.resumed is None
    got = fresh.load_latest()
    assert got["round"] == 3 and torch.equal(got["u"], torch.full((2,), 3.0))
    assert fresh.resumed is got
    assert Checkpointer(tmp_path / "nowhere", identity="A").load_latest() is None


# -- keep and every -------------------------------------------------------------------------------
@pytest.mark.parametrize("keep,kept", [(0, [7]), (1, [7]), (2, [7, 5]), (3, [7, 5, 4])])
def test_keep_rotation_keeps_only_the_newest(tmp_path, keep, kept):
    (tmp_path / "config.yaml").write_text("x")
    (tmp_path / "metrics.jsonl").write_text("")
    ck = Checkpointer(tmp_path, every=1, keep=keep, identity="A")
    for r in (1, 2, 3, 4, 5, 7):
        ck.owners_dir(r).mkdir()
        checkpoint.atomic_write(
            checkpoint.owner_file(ck.owners_dir(r), 0), checkpoint.dump({"r": r})
        )
        if r == 7:
            ck.owners_dir(6).mkdir()  # round 6 abandoned: owners wrote, no checkpoint
        ck.save(r, {"r": r})
    assert checkpoint.rounds_on_disk(tmp_path) == kept
    want = (
        {"config.yaml", "metrics.jsonl"}
        | {f"ckpt-{r:06d}.pt" for r in kept}
        | {f"ckpt-{r:06d}.owners" for r in kept}
    )
    assert names(tmp_path) == want  # older ones and round 6's owners removed
    assert Checkpointer(tmp_path, identity="A").load_latest()["r"] == 7


def test_every_sets_the_cadence(tmp_path):
    assert [r for r in range(1, 11) if Checkpointer(tmp_path, every=3).due(r)] == [3, 6, 9]
    assert [r for r in range(1, 6) if Checkpointer(tmp_path, every=1).due(r)] == [1, 2, 3, 4, 5]
    assert not any(Checkpointer(tmp_path, every=0).due(r) for r in range(1, 20))
    ck = Checkpointer(tmp_path, every=4, keep=10, identity="A")
    for r in range(1, 11):  # the round loop's rule
        if ck.due(r):
            ck.save(r, {})
    assert checkpoint.rounds_on_disk(tmp_path) == [8, 4]


def test_rounds_on_disk_and_remove_all_touch_checkpoints_only(tmp_path):
    assert checkpoint.rounds_on_disk(tmp_path / "missing") == []
    checkpoint.remove_all(tmp_path / "missing")  # no folder: nothing to do, no error
    for name in (
        "ckpt-000007.pt",
        "ckpt-1234567.pt",
        "ckpt-000003.pt",
        "ckpt-12.pt",
        "ckpt-000009.pt.tmp",
        ".ckpt-000011.pt.tmp42",
        "xckpt-000010.pt",
        "summary.json",
    ):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "ckpt-000003.owners").mkdir()
    (tmp_path / "ckpt-000003.owners" / "owner-0.pt").write_bytes(b"")
    (tmp_path / "owners.csv").write_text("")
    assert checkpoint.rounds_on_disk(tmp_path) == [1234567, 7, 3]
    checkpoint.remove_all(tmp_path)
    assert names(tmp_path) == {
        "ckpt-12.pt",
        "ckpt-000009.pt.tmp",
        ".ckpt-000011.pt.tmp42",
        "xckpt-000010.pt",
        "summary.json",
        "owners.csv",
    }
    assert checkpoint.ckpt_path(tmp_path, 5).name == "ckpt-000005.pt"
    assert (
        checkpoint.owner_file(checkpoint.owners_dir(tmp_path, 5), 2)
        == tmp_path / "ckpt-000005.owners" / "owner-2.pt"
    )


# -- what is refused ------------------------------------------------------------------------------
def test_another_runs_checkpoint_is_refused(tmp_path):
    a = Checkpointer(tmp_path, every=1, keep=5, identity='{"seed": 0}')
    a.save(1, {"u": torch.zeros(2)})
    a.save(2, {"u": torch.ones(2)})
    seen, report = reporter()
    b = Checkpointer(tmp_path, identity='{"seed": 1}', report=report)
    assert b.load_latest() is None and b.resumed is None
    assert len(seen) == 2
    for r, msg in zip((2, 1), seen):
        assert str(checkpoint.ckpt_path(tmp_path, r)) in msg
        assert "written by a run of another configuration" in msg
    # the other run's newest is skipped, this run's older one used
    checkpoint.atomic_write(
        checkpoint.ckpt_path(tmp_path, 1),
        checkpoint.dump({"round": 1, "identity": '{"seed": 1}', "u": torch.zeros(2)}),
    )
    seen.clear()
    assert b.load_latest()["round"] == 1 and len(seen) == 1 and "ckpt-000002.pt" in seen[0]


def test_same_identity_decides_the_match_when_given(tmp_path):
    Checkpointer(tmp_path, keep=5, identity="old-form").save(1, {})
    asked: list = []
    ok = Checkpointer(
        tmp_path,
        identity="new-form",
        report=lambda m: None,
        same_identity=lambda theirs: asked.append(theirs) or theirs == "old-form",
    )
    assert ok.load_latest()["round"] == 1 and asked == ["old-form"]
    no = Checkpointer(
        tmp_path, identity="new-form", report=lambda m: None, same_identity=lambda theirs: False
    )
    assert no.load_latest() is None
    # a checkpoint without a string identity is never handed to same_identity
    checkpoint.atomic_write(
        checkpoint.ckpt_path(tmp_path, 2), checkpoint.dump({"round": 2, "identity": None})
    )
    asked.clear()
    assert ok.load_latest()["round"] == 1 and asked == ["old-form"]


@pytest.mark.parametrize(
    "damage,why",
    [
        (lambda b: b[:-7], "checksum mismatch"),
        (lambda b: b[: len(b) // 2], "checksum mismatch"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 0x10]), "checksum mismatch"),
        (lambda b: b"", "empty file"),
        (lambda b: b"\0" * len(b), "bad magic"),
    ],
)
def test_damaged_newest_falls_back_to_the_previous(tmp_path, damage, why):
    ck = Checkpointer(tmp_path, every=1, keep=3, identity="A")
    for r in (1, 2, 3):
        ck.save(r, {"u": torch.full((64,), float(r))})
    newest = checkpoint.ckpt_path(tmp_path, 3)
    newest.write_bytes(damage(newest.read_bytes()))
    seen, report = reporter()
    got = Checkpointer(tmp_path, identity="A", report=report).load_latest()
    assert got["round"] == 2 and torch.equal(got["u"], torch.full((64,), 2.0))
    assert len(seen) == 1 and str(newest) in seen[0] and why in seen[0]
    assert "trying the previous one" in seen[0]


def test_every_checkpoint_unusable_gives_none_and_names_each(tmp_path):
    ck = Checkpointer(tmp_path, every=1, keep=3, identity="A")
    for r in (1, 2):
        ck.save(r, {})
        p = checkpoint.ckpt_path(tmp_path, r)
        p.write_bytes(p.read_bytes()[:-1])
    seen, report = reporter()
    assert Checkpointer(tmp_path, identity="A", report=report).load_latest() is None
    assert [str(checkpoint.ckpt_path(tmp_path, r)) in m for r, m in zip((2, 1), seen)] == [
        True,
        True,
    ]


def test_a_checkpoint_renamed_to_another_round_is_refused(tmp_path):
    ck = Checkpointer(tmp_path, every=1, keep=3, identity="A")
    ck.save(4, {})
    checkpoint.ckpt_path(tmp_path, 5).write_bytes(checkpoint.ckpt_path(tmp_path, 4).read_bytes())
    seen, report = reporter()
    assert Checkpointer(tmp_path, identity="A", report=report).load_latest()["round"] == 4
    assert len(seen) == 1 and "holds round 4, named 5" in seen[0]


def test_verify_state_can_refuse_a_checkpoint(tmp_path):
    ck = Checkpointer(tmp_path, every=1, keep=3, identity="A")
    ck.save(1, {"dim": 3})
    ck.save(2, {"dim": 4})

    def verify(state):
        if state["dim"] != 3:
            raise CheckpointError(f"shared parameters of dimension {state['dim']}, expected 3")

    seen, report = reporter()
    assert (
        Checkpointer(tmp_path, identity="A", report=report, verify_state=verify).load_latest()[
            "round"
        ]
        == 1
    )
    assert len(seen) == 1 and "dimension 4" in seen[0]


# (moved from tests/test_faults.py)
def test_a_flower_checkpoint_with_a_damaged_owner_file_falls_back(tmp_path):
    """engine=flower: a checkpoint is usable only with every owner's own state file intact."""
    seen: list[str] = []
    ck = checkpoint.Checkpointer(
        tmp_path, every=1, keep=2, identity="x", report=lambda m: seen.append(m)
    )
    for r in (1, 2):
        d = ck.owners_dir(r)
        d.mkdir()
        for j in (0, 1):
            checkpoint.atomic_write(
                checkpoint.owner_file(d, j),
                checkpoint.dump({"personal": {"w": torch.full((2,), float(r))}}),
            )
        ck.save(r, {"transport": {"owners_saved": [0, 1]}})
    bad = checkpoint.owner_file(ck.owners_dir(2), 1)
    bad.write_bytes(bad.read_bytes()[:-3])
    assert ck.load_latest()["round"] == 1
    assert len(seen) == 1 and "owner 1's state" in seen[0] and str(bad) in seen[0]


def test_a_flower_checkpoint_with_a_missing_owner_file_falls_back(tmp_path):
    seen, report = reporter()
    ck = Checkpointer(tmp_path, every=1, keep=2, identity="x", report=report)
    for r in (1, 2):
        ck.owners_dir(r).mkdir()
        for j in (0, 1) if r == 1 else (0,):  # round 2: owner 1 never wrote its file
            checkpoint.atomic_write(
                checkpoint.owner_file(ck.owners_dir(r), j), checkpoint.dump({"j": j})
            )
        ck.save(r, {"transport": {"owners_saved": [0, 1]}})
    assert ck.load_latest()["round"] == 1
    assert len(seen) == 1 and "owner 1's state" in seen[0]


# -- atomic writes --------------------------------------------------------------------------------
def test_write_goes_through_a_synced_temporary_file_renamed_over_the_final_name(
    tmp_path, monkeypatch
):
    ck = Checkpointer(tmp_path, every=1, keep=2, identity="A")
    ck.save(1, {"u": torch.zeros(8)})
    final = checkpoint.ckpt_path(tmp_path, 2)
    new = checkpoint.dump({"round": 2, "identity": "A", "u": torch.ones(8)})
    log: list = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(src, dst):
        src, dst = type(final)(src), type(final)(dst)
        log.append("replace")
        assert dst == final and src.parent == final.parent and src.name.startswith(".")
        assert src.read_bytes() == new  # the whole checkpoint is there before it is named
        assert not final.exists()  # the final name never holds a partial file
        return real_replace(src, dst)

    def fsync(fd):
        log.append("fsync")
        return real_fsync(fd)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "fsync", fsync)
    checkpoint.atomic_write(final, new)
    monkeypatch.undo()
    assert log == ["fsync", "replace", "fsync"]  # file synced, renamed, folder synced
    assert final.read_bytes() == new
    assert names(tmp_path) == {"ckpt-000001.pt", "ckpt-000002.pt"}  # no temporary file left


def test_a_crash_before_the_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path, every=1, keep=2, identity="A")
    ck.save(1, {"u": torch.zeros(8)})
    ck.save(2, {"u": torch.ones(8)})
    old = checkpoint.ckpt_path(tmp_path, 2).read_bytes()

    def crash(src, dst):
        raise OSError("power lost")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power lost"):
        ck.save(3, {"u": torch.full((8,), 3.0)})  # new name never appears
    with pytest.raises(OSError, match="power lost"):
        checkpoint.atomic_write(checkpoint.ckpt_path(tmp_path, 2), b"a rewrite of the same name")
    monkeypatch.undo()
    assert checkpoint.rounds_on_disk(tmp_path) == [2, 1]
    assert checkpoint.ckpt_path(tmp_path, 2).read_bytes() == old  # the old bytes, intact
    got = Checkpointer(tmp_path, identity="A", report=pytest.fail).load_latest()
    assert got["round"] == 2 and torch.equal(got["u"], torch.ones(8))
    # what the crash left is a hidden temporary file, which no reader takes for a checkpoint
    assert {n for n in names(tmp_path) if not n.startswith("ckpt-")} and all(
        n.startswith(".ckpt-") for n in names(tmp_path) if not n.startswith("ckpt-")
    )


def test_a_kill_mid_write_leaves_the_previous_checkpoint(tmp_path):
    """As tests/kill_run.py's ``mid_checkpoint``: half the bytes in the temporary file, then death."""
    ck = Checkpointer(tmp_path, every=1, keep=2, identity="A")
    ck.save(1, {"u": torch.zeros(8)})
    data = checkpoint.dump({"round": 2, "identity": "A", "u": torch.ones(8)})
    final = checkpoint.ckpt_path(tmp_path, 2)
    (tmp_path / f".{final.name}.tmp{os.getpid()}").write_bytes(data[: len(data) // 2])
    assert checkpoint.rounds_on_disk(tmp_path) == [1]
    assert Checkpointer(tmp_path, identity="A", report=pytest.fail).load_latest()["round"] == 1
    ck.save(2, {"u": torch.ones(8)})  # the next write of that round still works
    assert Checkpointer(tmp_path, identity="A").load_latest()["round"] == 2


def test_owner_state_in_block_files_reads_back_for_any_blocking(tmp_path):
    """A node of several owners writes one ``owners-<a>-<b>.pt`` (one atomic write, not one per
    owner); a resume with other blocks (or one owner per node) reads each owner's row."""
    d = tmp_path / "o"
    d.mkdir()
    w = torch.arange(5 * 3, dtype=torch.float64).reshape(5, 3)
    checkpoint.atomic_write(
        checkpoint.block_file(d, 0, 2), checkpoint.dump({"personal": {"w": w[0:3]}})
    )
    checkpoint.atomic_write(
        checkpoint.block_file(d, 3, 4), checkpoint.dump({"personal": {"w": w[3:5]}})
    )
    assert sorted(checkpoint.owner_state_files(d)) == [0, 1, 2, 3, 4]
    assert torch.equal(checkpoint.load_owners_personal(d, [1, 2, 3])["w"], w[1:4])
    assert torch.equal(checkpoint.load_owners_personal(d, [4])["w"], w[4:5])
    with pytest.raises(checkpoint.CheckpointError, match="owner 7"):
        checkpoint.load_owners_personal(d, [7])


def test_a_damaged_block_file_fails_the_checkpoint_naming_an_owner(tmp_path):
    seen, report = reporter()
    ck = Checkpointer(tmp_path, every=1, keep=2, identity="x", report=report)
    for r in (1, 2):
        ck.owners_dir(r).mkdir()
        checkpoint.atomic_write(
            checkpoint.block_file(ck.owners_dir(r), 0, 1),
            checkpoint.dump({"personal": {"w": torch.zeros(2, 2)}}),
        )
        ck.save(r, {"transport": {"owners_saved": [0, 1]}})
    bad = checkpoint.block_file(ck.owners_dir(2), 0, 1)
    bad.write_bytes(bad.read_bytes()[:-3])
    assert ck.load_latest()["round"] == 1
    assert len(seen) == 1 and "owner 0's state" in seen[0] and str(bad) in seen[0]
