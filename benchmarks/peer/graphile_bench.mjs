// The peer's side of benchmarks/peer_graphile.py (issue #25): graphile-worker
// measured with the same workloads as the engine, one mode per process.
//
//   node graphile_bench.mjs '{"mode": "drain", "dsn": "...", "jobs": 5000, ...}'
//
// It imports graphile-worker from the directory named by GRAPHILE_WORKER_DIR
// (an `npm install --prefix` cache outside the repository) and prints one JSON
// object on its last stdout line. Times are process.hrtime (CLOCK_MONOTONIC on
// Linux, the clock of Python's time.perf_counter). Jobs do nothing; a job counts
// as done once graphile-worker has deleted its row (what "done" means there).

import { createRequire } from "node:module";
import path from "node:path";
import readline from "node:readline";

const dir = process.env.GRAPHILE_WORKER_DIR;
if (!dir) throw new Error("GRAPHILE_WORKER_DIR is not set");
const require = createRequire(path.join(dir, "package.json"));
const gw = await import(require.resolve("graphile-worker"));

const args = JSON.parse(process.argv[2]);
const now = () => Number(process.hrtime.bigint()) / 1e9;
const quiet = new gw.Logger(() => () => {});
const TASK = "bench_noop";
const specs = (n, from = 0) =>
  Array.from({ length: n }, (_, i) => ({ identifier: TASK, payload: { n: from + i } }));

// "Tuned": a local queue of 100 jobs per fetch and completions batched
// (flushed on the next tick), the settings the issue names as graphile's best.
const TUNED = { worker: { localQueue: { size: 100 }, completeJobBatchDelay: 0 } };

function line(obj) {
  process.stdout.write(JSON.stringify(obj) + "\n");
}

async function utils() {
  const u = await gw.makeWorkerUtils({ connectionString: args.dsn, logger: quiet });
  await u.withPgClient((c) => c.query("SELECT 1")); // connect before any clock starts
  return u;
}

async function left(u) {
  const r = await u.withPgClient((c) =>
    c.query("SELECT count(*)::int AS n FROM graphile_worker._private_jobs"));
  return r.rows[0].n;
}

// A runner whose task calls onJob(payload); resolves once it is started.
function runner(concurrency, tuned, onJob) {
  return gw.run({
    connectionString: args.dsn,
    concurrency,
    noHandleSignals: true,
    logger: quiet,
    taskList: { [TASK]: async (payload) => { onJob(payload); } },
    ...(tuned ? { preset: TUNED } : {}),
  });
}

function countTo(n) {
  let done = 0;
  let resolve;
  const all = new Promise((r) => { resolve = r; });
  return { all, tick: () => { done += 1; if (done === n) resolve(); } };
}

async function waitEmpty(u) {
  while ((await left(u)) > 0) await new Promise((r) => setTimeout(r, 2));
}

const modes = {
  async migrate() {
    await gw.runMigrations({ connectionString: args.dsn, logger: quiet });
    return {};
  },

  // N jobs queued up front (not timed), then a runner drains them.
  async drain() {
    const u = await utils();
    await u.addJobs(specs(args.jobs));
    const c = countTo(args.jobs);
    const t0 = now();
    const r = await runner(args.concurrency, args.tuned, c.tick);
    await c.all;
    await waitEmpty(u); // completions may still be on their way (batched)
    const elapsed = now() - t0;
    await r.stop();
    await u.release();
    return { jobs: args.jobs, jobs_per_s: args.jobs / elapsed };
  },

  // addJob per call (its own transaction), or every job in one addJobs call.
  async enqueue() {
    const u = await utils();
    const all = specs(args.jobs);
    const t0 = now();
    if (args.batch) await u.addJobs(all);
    else for (const s of all) await u.addJob(s.identifier, s.payload);
    const elapsed = now() - t0;
    if ((await left(u)) !== args.jobs) throw new Error("enqueue: jobs missing");
    await u.release();
    return { jobs: args.jobs, jobs_per_s: args.jobs / elapsed };
  },

  // An idle runner at concurrency 1 (defaults); prints {"ready": true}, then the
  // start time of each job by its payload's n once `jobs` have run.
  async wake_worker() {
    const starts = {};
    const c = countTo(args.jobs);
    const r = await runner(1, false, (p) => { starts[p.n] = now(); c.tick(); });
    await new Promise((res) => setTimeout(res, 200));
    line({ ready: true });
    await c.all;
    await r.stop();
    return { starts };
  },

  // Another process: one addJob every 1/rate s; [before the call, after it returned].
  async wake_enqueue() {
    const u = await utils();
    const times = [];
    let next = now();
    for (let i = 0; i < args.jobs; i++) {
      const wait = next - now();
      if (wait > 0) await new Promise((res) => setTimeout(res, wait * 1e3));
      next += 1 / args.rate;
      const t = now();
      await u.addJob(TASK, { n: i });
      times.push([t, now()]);
    }
    await u.release();
    return { times };
  },

  // Jobs enqueued (addJobs, `chunk` at a time) while a runner at the defaults
  // runs them. Handshake on stdin so that the caller reads the server's WAL
  // position and its backends' CPU right before and right after:
  // prints {"ready"}, waits for a line; runs; prints {"done"}, waits for a line.
  async cost() {
    const rl = readline.createInterface({ input: process.stdin });
    const lines = rl[Symbol.asyncIterator]();
    const u = await utils();
    const c = countTo(args.jobs);
    const r = await runner(args.concurrency, false, c.tick);
    await new Promise((res) => setTimeout(res, 200));
    line({ ready: true });
    await lines.next();
    const t0 = now();
    for (let i = 0; i < args.jobs; i += args.chunk) {
      await u.addJobs(specs(Math.min(args.chunk, args.jobs - i), i));
    }
    await c.all;
    await waitEmpty(u);
    const elapsed = now() - t0;
    line({ done: true, jobs_per_s: args.jobs / elapsed });
    await lines.next();
    await r.stop();
    await u.release();
    rl.close();
    return {};
  },
};

const mode = modes[args.mode];
if (!mode) throw new Error(`unknown mode ${args.mode}`);
line(await mode());
process.exit(0);
