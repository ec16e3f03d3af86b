"""The worker side's one retry policy: capped exponential backoff with full
jitter, Retry-After as a floor, reset on success. Randomness is injected."""

import pytest

from workers.backoff import Backoff, retry_after_of


def delays(backoff: Backoff, n: int, retry_after: float | None = None) -> list[float]:
    return [round(backoff.failed(retry_after), 6) for _ in range(n)]


def test_the_ceiling_doubles_per_failure_in_a_row_up_to_the_cap():
    assert delays(Backoff(base=0.5, cap=20.0, rand=lambda: 1.0), 8) == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 20.0, 20.0]


def test_the_wait_is_uniform_below_the_ceiling_full_jitter():
    assert delays(Backoff(base=0.5, cap=20.0, rand=lambda: 0.25), 4) == [0.125, 0.25, 0.5, 1.0]
    assert delays(Backoff(base=0.5, cap=20.0, rand=lambda: 0.0), 3) == [0.0, 0.0, 0.0]


def test_a_success_starts_again_from_the_base():
    backoff = Backoff(base=0.5, cap=20.0, rand=lambda: 1.0)
    delays(backoff, 5)
    backoff.succeeded()
    assert delays(backoff, 2) == [0.5, 1.0]


def test_retry_after_is_the_shortest_wait_spread_over_half_as_much_again():
    assert delays(Backoff(base=0.5, cap=20.0, rand=lambda: 0.0), 2, retry_after=1.0) == [1.0, 1.0]
    assert delays(Backoff(base=0.5, cap=20.0, rand=lambda: 0.5), 1, retry_after=1.0) == [1.25]
    # Once the backoff itself is longer, it wins.
    assert delays(Backoff(base=0.5, cap=20.0, rand=lambda: 1.0), 4, retry_after=1.0) == [1.5, 1.5, 2.0, 4.0]


def test_a_retry_after_above_the_cap_counts_as_the_cap():
    assert delays(Backoff(base=0.5, cap=20.0, rand=lambda: 0.0), 1, retry_after=3600.0) == [20.0]


def test_a_long_outage_does_not_overflow_the_ceiling():
    backoff = Backoff(base=0.5, cap=20.0, rand=lambda: 1.0)
    backoff.failures = 5000  # about a day of failures at the cap
    assert backoff.failed() == 20.0


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("1", 1.0), (" 2 ", 2.0), ("0.5", 0.5), (None, None), ("", None), ("soon", None), ("-1", None),
     ("nan", None), ("inf", None), ("Wed, 21 Oct 2015 07:28:00 GMT", None)],
)
def test_retry_after_is_read_as_delta_seconds_only(header, seconds):
    # An HTTP date would mean comparing this machine's clock with the control plane's.
    assert retry_after_of(header) == seconds


def test_a_long_retry_after_is_cut_at_the_cap_even_spread():
    assert delays(Backoff(base=0.5, cap=20.0, rand=lambda: 0.99), 2, retry_after=300.0) == [20.0, 20.0]
