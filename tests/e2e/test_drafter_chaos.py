"""Chaos: a verifier's drafter client keeps 16 long sessions proposing while the drafter
process is killed with SIGKILL and restarted every few seconds."""

from __future__ import annotations

import random
import time

from drafter_service.store import LMDBNGramStore, StoreConfig
from verifier_service.core.drafting import DraftRequest
from verifier_service.serving.drafter_client import DrafterClientConfig, RemoteDrafter

from processes import ServiceProcess, free_port

VOCABULARY = "00112233445566aa"
SEQUENCES = 16
CONTEXT_TOKENS = 3000
ROUNDS = 4  # kill -9 and restart this many times
UP_S = 3.0  # how long each drafter lives
STEP_S = 0.05  # a decode step's pace
MEMORY_BOUND_MB = 600  # a drafter holding 16 sessions of ~3K tokens: ~100-200 MB


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_sessions_survive_kill_9_restarts_and_every_acknowledged_observation_is_kept(tmp_path):
    rng = random.Random(11)
    port, db = free_port(), tmp_path / "db"
    # Each context repeats its own first 200 tokens, so a live drafter always has
    # a context draft to give: a step without drafts while it is up is a failure to recover.
    contexts = []
    for _ in range(SEQUENCES):
        head = [rng.randrange(1000, 40_000) for _ in range(200)]
        contexts.append(head + [rng.randrange(1000, 40_000) for _ in range(CONTEXT_TOKENS - 400)] + head)
    args = ("drafter_service", "--port", str(port), "--db", str(db), "--metrics-port", "-1")
    drafter = ServiceProcess(*args)
    drafter.wait_until_serving("", 30)
    client = RemoteDrafter(DrafterClientConfig(target=f"127.0.0.1:{port}", vocabulary=VOCABULARY, timeout_s=0.1))
    observed, peak_mb, up_periods_with_drafts = [], 0.0, 0
    try:
        for round_ in range(ROUNDS + 1):
            drafted_this_period = False
            until = time.monotonic() + UP_S
            step = 0
            while time.monotonic() < until:
                step += 1
                requests = [DraftRequest(f"r{round_}-s{i}", context + [7] * step, 4) for i, context in enumerate(contexts)]
                drafts = client.propose(requests)  # never raises: empty drafts while the drafter is away
                drafted_this_period |= any(draft.tokens for draft in drafts)
                peak_mb = max(peak_mb, rss_mb(drafter.process.pid))
                time.sleep(STEP_S)
            up_periods_with_drafts += drafted_this_period
            # Finished sequences, observed in the background (retried until acknowledged).
            finished = [(f"r{round_}-s{i}", context[:500] + [round_, i]) for i, context in enumerate(contexts[:4])]
            client.close(finished)
            observed += [tokens for _, tokens in finished]
            time.sleep(0.3)  # some observations land, some are in flight at the kill
            if round_ < ROUNDS:
                drafter.kill()
                time.sleep(0.5)
                drafter = ServiceProcess(*args)
                drafter.wait_until_serving("", 30)
        deadline = time.monotonic() + 30
        while client.pending_observations and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.pending_observations == 0, "observations never acknowledged"
        assert client.dropped_observations == 0
    finally:
        client.stop(timeout_s=2)
        drafter.kill()
    print(f"drafter peak RSS over the chaos run: {peak_mb:.0f} MB")
    assert up_periods_with_drafts == ROUNDS + 1  # drafts came back after every restart
    assert peak_mb < MEMORY_BOUND_MB
    # Acknowledged means stored: every observed sequence's n-grams are in the table.
    with LMDBNGramStore(StoreConfig(path=str(db / VOCABULARY), namespace=bytes.fromhex(VOCABULARY))) as store:
        for tokens in observed:
            assert store.continuations(tuple(tokens[-5:-1])) == {tokens[-1]: 1}
            assert tokens[-2] in store.continuations(tuple(tokens[-6:-2]))
