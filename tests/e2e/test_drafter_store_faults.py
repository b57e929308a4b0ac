"""The drafter as a process on a --db holding a table with damaged pages: the damaged one is
quarantined before health says SERVING, the sound one serves, and the offline check agrees."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import drafter_pb2 as pb
from specdec.v1 import drafter_pb2_grpc as rpc

from processes import ServiceProcess

DAMAGED = "00112233445566aa"
SOUND = "ffeeddccbbaa9988"
PAGE = 4096
SERVING_TIMEOUT_S = 60


def table_tokens(vocabulary: str) -> list[int]:
    rng = random.Random(vocabulary)
    return [rng.randrange(1000) for _ in range(5000)]


def make_table(db: Path, vocabulary: str) -> None:
    """A compacted table (``backup``): no free pages, so every page past the two metas is in use."""
    from drafter_service.store import LMDBNGramStore, StoreConfig

    staging = db.parent / f"staging-{vocabulary}"
    with LMDBNGramStore(StoreConfig(path=str(staging), namespace=bytes.fromhex(vocabulary))) as store:
        store.apply([("o1", table_tokens(vocabulary))])
        store.backup(db / vocabulary)
    shutil.rmtree(staging)


def garbage_pages(data: Path, count: int = 20, seed: int = 1) -> None:
    rng = random.Random(seed)
    with open(data, "r+b") as handle:
        for page in rng.sample(range(2, data.stat().st_size // PAGE), count):
            handle.seek(page * PAGE)
            handle.write(rng.randbytes(PAGE))


def check(db: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "drafter_service.check", "--db", str(db)], capture_output=True, text=True, timeout=60)


def propose(stub, session: str, tokens: list[int], k: int, vocabulary: str) -> list[int]:
    request = pb.ProposeRequest(
        vocabulary=vocabulary, sequences=[pb.SequenceUpdate(session_id=session, new_tokens=tokens, open=True, num_draft_tokens=k)]
    )
    return list(stub.Propose(request, timeout=10).drafts[0].tokens)


def observe(stub, observe_id: str, tokens: list[int], vocabulary: str) -> pb.ObserveResponse:
    request = pb.ObserveRequest(vocabulary=vocabulary, observe_id=observe_id, sequences=[pb.TokenSequence(tokens=tokens)])
    return stub.Observe(request, timeout=10)


def test_a_table_with_damaged_pages_is_quarantined_before_serving_and_the_sound_one_serves(tmp_path):
    db = tmp_path / "db"
    make_table(db, DAMAGED)
    make_table(db, SOUND)
    garbage_pages(db / DAMAGED / "data.mdb")
    before = check(db)
    assert before.returncode == 1 and f"{DAMAGED}: PROBLEM: " in before.stdout and f"{SOUND}: ok" in before.stdout

    drafter = ServiceProcess("drafter_service", "--port", "0", "--db", str(db), env={**os.environ, "SPECDEC_DRAFTER_METRICS_PORT": "0"})
    try:
        drafter.wait_until_serving("specdec.v1.Drafter", SERVING_TIMEOUT_S)
        stub = rpc.DrafterStub(drafter.channel)
        grpc.channel_ready_future(drafter.channel).result(timeout=SERVING_TIMEOUT_S)
        # The sound table drafts what it learned before the restart, and learns more.
        sound = table_tokens(SOUND)
        assert propose(stub, "s1", sound[:4], 2, SOUND) == sound[4:6]
        assert observe(stub, "o2", [7001, 7002, 7003, 7004, 7005, 7006], SOUND).applied_sequences == 1
        assert propose(stub, "s2", [7001, 7002, 7003, 7004], 2, SOUND) == [7005, 7006]
        # Health says so: the drafter serves, the damaged table's own name does not, the sound one's does.
        health = health_pb2_grpc.HealthStub(drafter.channel)

        def status(service: str) -> int:
            return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        assert (status("specdec.v1.Drafter"), status(f"specdec.v1.Drafter/{SOUND}")) == (serving, serving)
        assert status(f"specdec.v1.Drafter/{DAMAGED}") == not_serving
        # The damaged vocabulary starts over: nothing to draft from, and its next write makes a fresh table.
        damaged = table_tokens(DAMAGED)
        assert propose(stub, "d1", damaged[:4], 2, DAMAGED) == []
        assert observe(stub, "o2", [8001, 8002, 8003, 8004, 8005], DAMAGED).applied_sequences == 1
        assert status(f"specdec.v1.Drafter/{DAMAGED}") == serving  # a fresh table serves
        log = drafter.log()
    finally:
        drafter.stop()
    problem = before.stdout.split(f"{DAMAGED}: PROBLEM: ")[1].splitlines()[0]
    # The start-up walk's verdict is the check's, word for word.
    assert f"table {DAMAGED} cannot be served ({problem}); moved aside to {DAMAGED}.quarantined-" in log
    (aside,) = [path for path in db.iterdir() if ".quarantined-" in path.name]
    assert aside.name.startswith(f"{DAMAGED}.quarantined-") and (aside / "data.mdb").exists()
    after = check(db)
    assert after.returncode == 0, after.stdout
    assert f"{aside.name}: quarantined by the drafter" in after.stdout and f"{DAMAGED}: ok" in after.stdout
