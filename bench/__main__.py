"""`python -m bench` (make bench): run every benchmark in turn."""

from bench import protocol_rtt, queue_rates

queue_rates.main([])
protocol_rtt.main([])
