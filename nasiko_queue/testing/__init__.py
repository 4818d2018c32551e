"""
Testing support: helpers that play the application's part, and a model of docs/rules.md.

* `nasiko_queue.testing` (this module): create agents, connectors, build rows
  and jobs the way the original's enqueue points do; `QueueModel`, the
  executable form of docs/rules.md §5–§7. No dependency beyond the library's own.
* `nasiko_queue.testing.machine`: the Hypothesis state machine that drives the
  real engine against the model (needs ``hypothesis``: ``pip install
  nasiko-queue[test]``).
* `nasiko_queue.testing.plain_model` and `nasiko_queue.testing.plain_machine`:
  the same for plain jobs (`PlainModel`: states, attempts, priority and run_at
  order, backoff, unique keys, cancel, the rescue; and its state machine).
* `nasiko_queue.testing.limits_machine`: limits across replicas (issue #23):
  each claim of a limited queue takes exactly what its concurrency, rate and
  serial keys admit, through retries, dead letters, cancels, give-backs and the
  rescue of a dead worker's jobs (`run_limits_state_machine`).
* `nasiko_queue.testing.runner`: what both machines share (binding to a database
  and the test's trio loop, the settings profiles, `expect_failure` for a run that
  must fail); `nasiko_queue.testing.mutants`: planting a bug for such a run
  (`plant_sql`, `swap`).

.. versionadded:: 0.1.0
"""

from .fixtures import KINDS as KINDS
from .fixtures import Enqueued as Enqueued
from .fixtures import Sql as Sql
from .fixtures import enqueue_with_target as enqueue_with_target
from .fixtures import insert_agent as insert_agent
from .fixtures import insert_agent_build as insert_agent_build
from .fixtures import insert_connector as insert_connector
from .fixtures import insert_connector_build as insert_connector_build
from .fixtures import make_payload as make_payload
from .fixtures import set_build_status as set_build_status
from .model import CLASSIC_OUTCOMES as CLASSIC_OUTCOMES
from .model import Outcome as Outcome
from .model import QueueModel as QueueModel
