"""
nasiko-queue: a durable job queue for long, crash-prone jobs, on PostgreSQL and trio.

General layout (each module is named for what it holds):

* ``config``      the defaults of docs/rules.md §3 and `QueueConfig`
* ``payloads``    the build job payload types and their one wire converter
* ``job_args``    plain jobs: `JobArgs`, `JobOptions`, `Unique`, `Backoff`
* ``secrets``     sealing of secret payload fields at rest
* ``database``    asyncpg through trio-asyncio, one bridge crossing per operation
* ``sql/queries.sql``  every statement, by name
* ``migrate``     the migrator for ``migrations/``
* ``queue``       `Queue.enqueue`
* ``jobs``        the claim and every other transition of a build job row
* ``plain_jobs``  the same for a queue of plain jobs (``nasiko_queue_jobs``)
* ``terminalize`` driving a failed job's target to a terminal state
* ``worker``      the supervisor: wake channel, timers, drains, its lanes
* ``lane``        one source of jobs in a worker: producer, completer, slots
* ``producer``, ``completer``, ``slots``  the parts of a lane
* ``job_executor``, ``plain_executor``  each lane's steps for one job
* ``heartbeat``, ``maintenance``, ``listener``  the worker's services
* ``schedules``   cron schedules: `Schedule`, the `Scheduler`
* ``executors``   the registry of executors and what they receive
* ``cli``         the ``nasiko-queue`` command; ``demo`` its demo
* ``embedded``    a private PostgreSQL for the demo and the tests
* ``testing``     helpers for users' test suites
"""

from .config import QueueConfig as QueueConfig
from .database import Database as Database
from .database import DatabaseConfig as DatabaseConfig
from .database import Transaction as Transaction
from .database import open_database as open_database
from .errors import ConfigurationError as ConfigurationError
from .errors import InvalidPayload as InvalidPayload
from .errors import MigrationError as MigrationError
from .errors import NasikoQueueError as NasikoQueueError
from .errors import PayloadTooLarge as PayloadTooLarge
from .errors import SecretDecryptError as SecretDecryptError
from .errors import SecretsNotConfigured as SecretsNotConfigured
from .executors import Executors as Executors
from .executors import JobContext as JobContext
from .executors import PlainJobContext as PlainJobContext
from .job_args import Backoff as Backoff
from .job_args import JobArgs as JobArgs
from .job_args import JobOptions as JobOptions
from .job_args import Unique as Unique
from .job_errors import JobError as JobError
from .job_errors import job_errors as job_errors
from .jobs import JobStatus as JobStatus
from .migrate import migrate as migrate
from .payloads import BUILTIN_PAYLOAD_TYPES as BUILTIN_PAYLOAD_TYPES
from .payloads import Clone as Clone
from .payloads import GithubClone as GithubClone
from .payloads import GithubSource as GithubSource
from .payloads import McpServerUpload as McpServerUpload
from .payloads import Payload as Payload
from .payloads import PayloadCodec as PayloadCodec
from .payloads import Rollback as Rollback
from .payloads import StandaloneBuild as StandaloneBuild
from .payloads import Target as Target
from .payloads import Update as Update
from .payloads import Upload as Upload
from .payloads import ZipSource as ZipSource
from .queue import CancelResult as CancelResult
from .queue import Queue as Queue
from .schedules import Schedule as Schedule
from .schedules import Scheduler as Scheduler
from .schedules import SchedulerConfig as SchedulerConfig
from .secrets import Secret as Secret
from .secrets import SecretBox as SecretBox
from .worker import Worker as Worker

__version__ = "0.1.0"
