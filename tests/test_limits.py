"""``PerCaller``: the places each caller holds at once, which the drafter's ``Admission``
and the verifier's ``CallerLimit`` count with."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from specdec.limits import PerCaller


def test_the_limit_refuses_one_callers_place_past_it_and_not_anothers():
    places = PerCaller(2)
    assert [places.take("a") for _ in range(3)] == [True, True, False]  # a's third at once
    assert places.take("b")  # b's first: a's places are a's
    assert (places.in_flight("a"), places.in_flight("b"), places.in_flight("c")) == (2, 1, 0)


def test_a_place_given_back_can_be_taken_again():
    places = PerCaller(1)
    assert places.take("a") and not places.take("a")
    places.give_back("a")
    assert places.in_flight("a") == 0
    assert places.take("a")


def test_giving_back_a_place_not_held_is_an_error_not_a_credit():
    places = PerCaller(1)
    places.take("a")
    places.give_back("a")
    # Below zero, a would then hold two places under a limit of one.
    with pytest.raises(ValueError, match="a gives back a place it does not hold"):
        places.give_back("a")
    assert places.take("a") and not places.take("a")


def test_a_held_place_is_given_back_once_however_often_its_function_is_called():
    places = PerCaller(2)
    first, second = places.hold("a"), places.hold("a")
    assert first is not None and second is not None
    assert places.hold("a") is None  # at the limit
    first()
    first()  # again: still one place back, not two
    assert places.in_flight("a") == 1
    assert places.hold("a") is not None and places.hold("a") is None


def test_concurrent_callers_never_hold_more_than_the_limit():
    # Threads switch every microsecond, not every 5 ms: a take whose check and count
    # a switch can fall between is caught there.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    limit, threads_per_caller, rounds = 3, 8, 300
    places = PerCaller(limit)
    holding = {"a": 0, "b": 0}  # places each caller's threads hold, as they count them
    most_held = {"a": 0, "b": 0}
    counting = threading.Lock()
    start = threading.Barrier(2 * threads_per_caller)

    def work(caller: str) -> None:
        start.wait()
        for _ in range(rounds):
            if not places.take(caller):
                continue
            with counting:
                holding[caller] += 1
                most_held[caller] = max(most_held[caller], holding[caller])
            time.sleep(0)  # hold the place while other threads run
            with counting:
                holding[caller] -= 1
            places.give_back(caller)

    threads = [threading.Thread(target=work, args=(caller,)) for caller in "ab" for _ in range(threads_per_caller)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch_interval)
    assert most_held == {"a": limit, "b": limit}  # each reached the limit, neither passed it
    assert (places.in_flight("a"), places.in_flight("b")) == (0, 0)  # every place came back
