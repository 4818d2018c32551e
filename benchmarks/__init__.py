"""
The benchmark runner behind ``nasiko-queue bench`` (issue #5).

`runner.run_benchmarks(dsn, sizes)` runs every workload against one migrated
database and returns a JSON-ready dict; `report` renders it as a table and a
plot. Absolute figures on a shared machine are noise: every engine figure is
also given as a ratio to the bare-asyncpg ceilings measured in the same run.
"""
