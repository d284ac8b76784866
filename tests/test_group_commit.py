"""The receiving MCA's group commit (rqp_agents.receiver.GroupCommit) over a real window file:
one commit at a time, keys recorded meanwhile in the next, answers only after their fsync, and
a failed fsync reported once so that the agent stops (a restart reopens the window)."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from rqp.storage.dedup import DedupError, DedupWindow
from rqp_agents.receiver import GroupCommit


def test_keys_recorded_while_a_commit_runs_go_in_the_next_and_all_become_durable(tmp_path,
                                                                                  monkeypatch):
    path = tmp_path / "receiver.dedup"
    fsyncs = []
    real_fsync = os.fsync

    def counting_fsync(fd):
        fsyncs.append(fd)
        real_fsync(fd)

    async def run() -> None:
        window = DedupWindow(path)  # (made and fsynced before counting)
        monkeypatch.setattr(os, "fsync", counting_fsync)
        broken = []
        commits = GroupCommit(window, broken.append)
        assert commits.durable() is None  # nothing recorded: nothing to wait for
        window.record(1)
        first = commits.durable()
        window.record(2)
        second = commits.durable()
        window.record(3)
        assert commits.durable() is second  # the next commit takes 2 and 3 together
        if not first.done():
            assert second is not first
        await asyncio.wait([first, second])
        assert first.exception() is None and second.exception() is None
        assert commits.durable() is None and broken == []
        await commits.drain()
        monkeypatch.setattr(os, "fsync", real_fsync)
        window.close()

    asyncio.run(run())
    assert 1 <= len(fsyncs) <= 2  # one or two commits for three keys (not three)
    with DedupWindow(path) as again:  # every key made it to the file
        assert all(again.seen(k) for k in (1, 2, 3))


def test_a_failed_fsync_fails_the_answers_waiting_for_it_and_is_reported_once(tmp_path,
                                                                               monkeypatch):
    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    async def run() -> list:
        window = DedupWindow(tmp_path / "receiver.dedup")
        broken = []
        commits = GroupCommit(window, broken.append)
        monkeypatch.setattr(os, "fsync", failing_fsync)
        window.record(7)
        waiting = commits.durable()
        window.record(8)
        after = commits.durable()
        await asyncio.wait([x for x in (waiting, after) if x is not None])
        assert isinstance(waiting.exception(), DedupError)
        assert "fsync failed" in str(waiting.exception())
        if after is not waiting:
            assert isinstance(after.exception(), DedupError)
        with pytest.raises(DedupError, match="earlier fsync failed"):
            window.record(9)
            commits.durable()  # no commit can succeed any more: the agent must stop
        await commits.drain()
        window.close(commit=False)
        return broken

    broken = asyncio.run(run())
    assert len(broken) == 1 and "fsync failed" in str(broken[0])
