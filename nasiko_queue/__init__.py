"""
nasiko-queue: a durable job queue for long, crash-prone jobs, on PostgreSQL and trio.

Layout (each package and module is named for what it holds):

* ``queue``, ``executors``, ``config``, ``errors``, ``secrets``, ``job_errors``:
  what an application uses: `Queue.enqueue`, the executor registry and what
  executors receive, `QueueConfig`, the exceptions, sealing of secret payload
  fields, the kept errors of crashed attempts
* ``engine/``   the worker: ``worker`` (the supervisor), ``lane`` (one source of
  jobs, its drain loop), ``producer`` (the claim), ``slots``, ``completer``,
  ``state`` (what the parts share), ``heartbeat``, ``listener``, ``maintenance``
  (rescue, stuck sweep), ``retry``, ``contracts`` (the claimed job and the store
  protocols), ``thread`` (the worker in a thread of a non-trio application)
* ``builds/``   build jobs, the original's port: ``payloads`` (the seven types and
  their wire converter), ``store`` (every transition of a ``build_jobs`` row),
  ``executor`` (a build job's steps), ``terminalize`` (a failed job's target)
* ``plain/``    plain jobs: ``args`` (`JobArgs`, `JobOptions`, `Unique`,
  `Backoff`), ``store``, ``executor``, ``schedules`` (cron), ``limits`` (limits
  across replicas: `Rate`, `QueueLimit`, `PartitionMode`)
* ``admin/``    listings and the dead letters (``jobs``), one job's view
  (``view``), ``retention``, the queue's ``status``
* ``db/``       asyncpg through trio-asyncio (``database``), the engine's own
  connections, ``queries.sql`` (every statement, by name) and its loader
  (``statements``), ``migrate``, the ``embedded`` PostgreSQL
* ``aio``, ``sync``: enqueue (and cancel, await results) from an asyncio
  application over asyncpg, or over any DB-API connection, through the SQL
  function of migration 0019; neither needs trio running
* ``workflows/`` durable workflows: ``definition`` (`Workflow`, its steps),
  ``runs`` (start, signal, cancel, retry, a run's view), ``executor`` (the step
  executors); the rules themselves are SQL (migration 0018)
* ``cli/``      the ``nasiko-queue`` command, a module per command group
* ``web/``      the [http] extra: health, metrics, the dashboard
* ``testing/``  helpers for users' test suites: fixtures, the models and the
  Hypothesis state machines, their runner and mutant planter
"""

from .builds.payloads import BUILTIN_PAYLOAD_TYPES as BUILTIN_PAYLOAD_TYPES
from .builds.payloads import Clone as Clone
from .builds.payloads import GithubClone as GithubClone
from .builds.payloads import GithubSource as GithubSource
from .builds.payloads import McpServerUpload as McpServerUpload
from .builds.payloads import Payload as Payload
from .builds.payloads import PayloadCodec as PayloadCodec
from .builds.payloads import Rollback as Rollback
from .builds.payloads import StandaloneBuild as StandaloneBuild
from .builds.payloads import Target as Target
from .builds.payloads import Update as Update
from .builds.payloads import Upload as Upload
from .builds.payloads import ZipSource as ZipSource
from .config import QueueConfig as QueueConfig
from .db.database import Database as Database
from .db.database import DatabaseConfig as DatabaseConfig
from .db.database import Transaction as Transaction
from .db.database import open_database as open_database
from .db.embedded import local_database as local_database
from .db.migrate import migrate as migrate
from .engine.contracts import JobStatus as JobStatus
from .engine.signals import EXIT_HARD_STOP as EXIT_HARD_STOP
from .engine.signals import run_worker as run_worker
from .engine.state import WorkerStats as WorkerStats
from .engine.thread import WorkerThread as WorkerThread
from .engine.thread import start_worker_thread as start_worker_thread
from .engine.worker import Worker as Worker
from .errors import ConfigurationError as ConfigurationError
from .errors import InvalidPayload as InvalidPayload
from .errors import JobFailed as JobFailed
from .errors import MigrationError as MigrationError
from .errors import NasikoQueueError as NasikoQueueError
from .errors import NoSuchJob as NoSuchJob
from .errors import NoSuchRun as NoSuchRun
from .errors import PayloadTooLarge as PayloadTooLarge
from .errors import ResultTimeout as ResultTimeout
from .errors import RunFailed as RunFailed
from .errors import SecretDecryptError as SecretDecryptError
from .errors import SecretsNotConfigured as SecretsNotConfigured
from .executors import Executors as Executors
from .executors import JobContext as JobContext
from .executors import PlainJobContext as PlainJobContext
from .job_errors import JobError as JobError
from .job_errors import job_errors as job_errors
from .plain.args import Backoff as Backoff
from .plain.args import Job as Job
from .plain.args import JobArgs as JobArgs
from .plain.args import JobOptions as JobOptions
from .plain.args import Unique as Unique
from .plain.limits import PartitionMode as PartitionMode
from .plain.limits import QueueLimit as QueueLimit
from .plain.limits import Rate as Rate
from .plain.results import Results as Results
from .plain.schedules import Schedule as Schedule
from .plain.schedules import Scheduler as Scheduler
from .plain.schedules import SchedulerConfig as SchedulerConfig
from .queue import CancelResult as CancelResult
from .queue import Queue as Queue
from .secrets import Secret as Secret
from .secrets import SecretBox as SecretBox
from .secrets import generate_master_key as generate_master_key
from .workflows.definition import Step as Step
from .workflows.definition import StepContext as StepContext
from .workflows.definition import Workflow as Workflow
from .workflows.executor import StartWorkflow as StartWorkflow
from .workflows.runs import RunView as RunView
from .workflows.runs import SignalResult as SignalResult
from .workflows.runs import StepView as StepView

__version__ = "0.1.0"
