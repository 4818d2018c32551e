"""
The worker engine: the supervisor (worker), its lanes, producer, slots,
completer, heartbeat, listener and maintenance services, and what they share.
"""
