"""A drafter whose disk fills up: on a real 6 MiB tmpfs, mounted in a private mount
namespace (``unshare``) that a sleeping holder process keeps alive, so that the
drafter can be killed and restarted on the same full disk (``nsenter``)."""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from drafter_service.store import LMDBNGramStore, StoreConfig
from specdec.v1 import drafter_pb2 as pb
from specdec.v1 import drafter_pb2_grpc

from processes import ServiceProcess

TABLE_A, TABLE_B, TABLE_C = "00112233445566aa", "00112233445566bb", "00112233445566cc"
DISK = "6m"


class SmallDisk:
    """A tmpfs of ``DISK`` at ``mount_point`` inside the holder's mount namespace;
    ``path`` is the same folder as this process reaches it (/proc/PID/root)."""

    def __init__(self, mount_point: Path) -> None:
        self.mount_point = mount_point
        self.holder = subprocess.Popen(
            [
                "unshare",
                "--mount",
                "--map-root-user",
                "sh",
                "-c",
                f'mount -t tmpfs -o size={DISK} tmpfs "$0" && echo mounted && exec sleep 600',
                str(mount_point),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if self.holder.stdout.readline().strip() != "mounted":
            self.holder.kill()
            reason = self.holder.communicate()[1].strip()
            pytest.skip(f"no private tmpfs here (unprivileged user and mount namespaces are off): {reason}")
        self.path = Path(f"/proc/{self.holder.pid}/root") / str(mount_point).lstrip("/")
        self.enter = ("nsenter", f"--target={self.holder.pid}", "--user", "--mount")

    def fill(self, leave_bytes: int = 0) -> None:
        """Write a filler file until at most ``leave_bytes`` are free."""
        with open(self.path / "filler", "ab") as filler:
            chunk = b"\0" * 65536
            while self.free_bytes() > leave_bytes:
                try:
                    filler.write(chunk[: max(4096, min(len(chunk), self.free_bytes() - leave_bytes))])
                    filler.flush()
                except OSError:  # ENOSPC: full
                    break

    def empty(self) -> None:
        (self.path / "filler").unlink()

    def free_bytes(self) -> int:
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


@pytest.fixture
def disk(tmp_path):
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    disk = SmallDisk(mount_point)
    yield disk
    disk.close()


def observe(stub, vocabulary: str, observe_id: str, tokens: list[int]):
    return stub.Observe(
        pb.ObserveRequest(vocabulary=vocabulary, observe_id=observe_id, sequences=[pb.TokenSequence(tokens=tokens)]),
        timeout=30,
    )


def draft_after(stub, vocabulary: str, session: str, context: list[int]) -> list[int]:
    """Open a session on ``context`` and return the draft it gets (global table only: no repeats inside)."""
    response = stub.Propose(
        pb.ProposeRequest(
            vocabulary=vocabulary, sequences=[pb.SequenceUpdate(session_id=session, open=True, new_tokens=context, num_draft_tokens=4)]
        ),
        timeout=30,
    )
    return list(response.drafts[0].tokens)


def start(disk: SmallDisk) -> ServiceProcess:
    drafter = ServiceProcess(
        "drafter_service",
        "--port",
        "0",
        "--db",
        str(disk.mount_point / "db"),
        "--metrics-port",
        "-1",
        "--min-free-bytes",
        "1MiB",
        "--max-bytes",
        str(16 << 20),
        prefix=disk.enter,
    )
    drafter.wait_until_serving("", 30)
    return drafter


def test_a_full_disk_refuses_writes_keeps_drafting_survives_restarts_and_recovers(disk):
    rng = random.Random(3)
    remembered = [rng.randrange(100, 30_000) for _ in range(64)]
    drafter = start(disk)
    try:
        stub = drafter_pb2_grpc.DrafterStub(drafter.channel)
        assert observe(stub, TABLE_A, "before", remembered).applied_sequences == 1

        disk.fill()
        # A new vocabulary's table would be created on a full disk (LMDB's lock file is
        # written through a map: SIGBUS). Refused instead, and nothing is left behind.
        with pytest.raises(grpc.RpcError) as refused:
            observe(stub, TABLE_B, "new-table", remembered)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--min-free-bytes 1MiB" in refused.value.details()
        assert not (disk.path / "db" / TABLE_B).exists()
        # Writes to the existing table: refused, retryable. Drafts: still served.
        with pytest.raises(grpc.RpcError) as refused:
            observe(stub, TABLE_A, "while-full", [1, 2, 3, 4])
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert draft_after(stub, TABLE_A, "s1", remembered[:10]) == remembered[10:14]
        assert drafter.process.poll() is None

        # kill -9 on the full disk, and a half-made table as an older drafter left
        # after its SIGBUS (a sparse lock file, no data): the restart removes it and serves.
        drafter.kill()
        half_made = disk.path / "db" / TABLE_C
        half_made.mkdir()
        with open(half_made / "lock.mdb", "wb") as lock_file:
            lock_file.truncate(32896)
        drafter = start(disk)
        stub = drafter_pb2_grpc.DrafterStub(drafter.channel)
        assert not half_made.exists()
        assert draft_after(stub, TABLE_A, "s2", remembered[20:30]) == remembered[30:34]

        # Space comes back: within a janitor round, writes are taken again.
        disk.empty()
        deadline = time.monotonic() + 15
        while True:
            try:
                assert observe(stub, TABLE_A, "while-full", [1, 2, 3, 4]).applied_sequences == 1
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "writes never resumed after space was freed"
                time.sleep(0.5)
        assert observe(stub, TABLE_B, "new-table", remembered).applied_sequences == 1

        # Above --min-free-bytes, but a commit bigger than what is left: LMDB's write
        # fails mid-commit (EIO). Refused as disk-full, not INTERNAL; nothing half-written.
        big = [rng.randrange(100, 30_000) for _ in range(8_000)]
        disk.fill(leave_bytes=(1 << 20) + (1 << 17))  # ~1.1 MiB: above --min-free-bytes, below the commit's ~2.4 MB
        with pytest.raises(grpc.RpcError) as refused:
            observe(stub, TABLE_A, "big", big)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        assert draft_after(stub, TABLE_A, "s3", remembered[40:50]) == remembered[50:54]
        disk.empty()
        deadline = time.monotonic() + 15
        while True:  # the client's retry, under the same id
            try:
                assert observe(stub, TABLE_A, "big", big).applied_sequences == 1
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "writes never resumed after space was freed"
                time.sleep(0.5)
        assert drafter.terminate() == 0
    finally:
        drafter.stop()
    # Everything acknowledged is in the tables, readable after a clean stop.
    db = disk.path / "db"
    assert sorted(entry.name for entry in db.iterdir() if entry.is_dir()) == [TABLE_A, TABLE_B]
    with LMDBNGramStore(StoreConfig(path=str(db / TABLE_A), namespace=bytes.fromhex(TABLE_A), max_bytes=16 << 20)) as table:
        assert table.best(tuple(remembered[:4]))[0] == remembered[4]
        assert table.best((1, 2, 3))[0] == 4
        assert table.best(tuple(big[100:104]))[0] == big[104]
