"""Issue 49: the bytes the server relays through channels (`poolctl exec`) count against their
user, one token bucket per user across all of the user's channels, so one user's fast output
cannot take the server from everyone else; another user's relays are not slowed by it."""

from daemon.server.relay_budget import RelayBudget


def test_a_user_past_the_burst_waits_as_the_rate_says_whatever_the_channels() -> None:
    """Issue 49, per-user limits on the relay: a burst at once, then the rate; the waits of many
    channels of one user add up (the credit goes below zero), and every byte is counted."""
    budget = RelayBudget(rate=1000, burst=500)
    assert budget.delay("alice", 500, now=0.0) == 0.0  # the burst
    assert budget.delay("alice", 1000, now=0.0) == 1.0  # a second's worth, in a second
    assert budget.delay("alice", 1000, now=0.0) == 2.0  # another channel of hers: after that one
    assert budget.delay("bob", 500, now=0.0) == 0.0  # bob's share is his own
    assert budget.delay("alice", 100, now=2.0) == 0.1  # 2 s later: the debt paid, 100 more to go
    assert budget.delay("alice", 100, now=60.0) == 0.0  # a minute idle: the burst again, no more
    assert budget.delay("alice", 500, now=60.0) == 0.1
    assert budget.relayed == {"alice": 3200, "bob": 500}
