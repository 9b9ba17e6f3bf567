"""`python -m bench` (make bench): run every benchmark in turn."""

from bench import queue_rates

queue_rates.main([])
