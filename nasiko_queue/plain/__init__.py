"""
Plain jobs: their argument types, store, executor pipeline and cron schedules.
"""
