"""
Administration: job listings, retry/discard/cancel, one job's view, retention
and the queue's status.
"""
