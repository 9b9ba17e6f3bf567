"""Every Redis key gpupool uses, named in one place.

Layout (docs/DESIGN.md §3): keys of one queue share the hash tag ``{q:NAME}``, so a queue, its jobs and
the Lua scripts that touch them live in one Redis Cluster slot; pool-wide keys carry ``{pool}``.
A job id is ``QUEUE.SUFFIX``, so the id alone names its queue and therefore all of its keys.

Per queue (``gp:{q:NAME}:…``):
  stream        Redis Stream of entries ``job=<id>`` in enqueue order; consumer group ``workers``. An
                entry stays in the group's pending list while its job runs and is deleted when the
                job ends.
  retry         (`front`) ZSET id -> enqueue seq: the front of the queue, claimed before any entry
                of the stream: jobs reclaimed, handed back, or retried after a failure. The key
                keeps its first name, so a pool upgraded in place keeps the jobs waiting there.
  backoff       ZSET id -> when (Redis time, ms) a failed job with retries left may go back to the
                front (retry_backoff, complete.lua); the reaper's pass (reclaim.lua) moves it
                then. Its entry stays pending, as a front job's.
  parked        ZSET id -> GPUs needed * 2**32 + enqueue seq: queued jobs passed over by workers too
                small for them; a claimer looks only at those it can hold, and takes the oldest of
                them and the front's head first.
  prio          ZSET id -> (100 - priority) * 2**32 + enqueue seq: the queued jobs enqueued with a
                priority, claimed after the front and before the stream, the highest first; each
                also has its stream entry until a claim takes it from here and deletes it.
  capped        ZSET id -> seq: queued jobs held aside while their user is at a cap (claim.lua),
                with capped:USER (the same, per user) and capped_users (each user holding jobs,
                scored no later than their oldest held job's seq); back at the front, by seq,
                once the user is below the caps. What a user runs is counted from `leases` at
                each claim: no counter to drift. capped_front (ZSET id -> seq): those held from
                the front in a fair-share queue, which go before the priorities once their user
                is below the caps, as the front does.
  fairshare     HASH (fair-share queues, config fairshare_queues): 'half_life' (ms) its claims decay
                use by, each user's use ('u:USER', GPU-ms, as of 't:USER', ms; charged as each
                attempt ends, _lib.lua) and weight ('w:USER', from the tokens file; 1 if absent).
                Its waiting jobs are held in the users' lines (capped:USER) as claims read them.
  reservation   HASH: the queue's head job waiting for GPUs ('job') and the worker it reserved
                ('worker') until when ('until', ms: a lease, renewed by that worker's claims), and
                when it could start there at the earliest ('at', ms; -1 unknown): claim.lua's
                backfill starts only jobs that cannot delay it there.
  waiting       ZSET id -> seq: queued jobs held out of the queue (no stream entry yet) while
                they wait for other jobs to end (--after, daemon/after.py: what for is on the
                job's record, 'after', written by its enqueue) or for a place in their array's
                window; ready.lua, or an array's `admit` (_lib.lua), lets them in.
  depends       ZSET id -> seq: those of `waiting` whose dependencies were not all found met yet:
                what the server's sweep judges (server/dependencies.py). Their records hold what
                they wait for ('after') and those found met so far ('after_met', ready.lua).
  array:ID      ZSET job id -> place: the jobs of array QUEUE@ID (poolctl enqueue --array/--sweep),
                for commands that take the array's id for all its jobs, written by the enqueue
                scripts; with
  array:ID:active  SET: its jobs let into the queue, queued or running: at most its window's N
                (the records' 'window'),
  array:ID:next ZSET id -> place: its jobs held for a place in the window, let in lowest place
                first as places free (the records' 'array_pos'), and
  array:ID:left how many of its jobs have not ended: the array's keys are kept while any has not,
                then for the retention (_lib.lua, arrays).
  dependents:ID SET of the ids of jobs waiting for job ID to end (in ID's queue, whatever theirs):
                how the server finds them when ID's terminal event comes; kept while ID lives,
                then for the retention. A hint: the server's sweep judges every held job anyway.
  wake          capped Stream of ``w=1`` entries, one per job put at the front: workers block on it
                (XREAD) beside the stream, since a ZSET cannot wake them.
  unended       HASH user -> how many of the user's jobs in the queue have not ended (queued or
                running): kept by the scripts that add and end jobs (_lib.lua), exact, and read by
                the enqueue scripts to keep a user within user_max_queued_jobs.
  leases        ZSET id -> lease deadline (Redis server time, ms) of every running attempt.
  jobs          ZSET id -> enqueue seq: index of the queue's jobs for listing.
  ended         ZSET id -> end time (ms) of finished jobs: past retention, a job leaves `jobs` and
                `ended` as later ones finish, so the index stays the size of the retention window.
  claims:WORKER the worker's claim memo (its newest request number and the jobs it got), for one
                lease: a claim sent again after its reply was lost answers the same jobs.
  seq           counter giving each job its enqueue sequence number.
  events        capped Stream of terminal transitions ``job=<id> state=<state>``; `wait` reads it.
  job:ID        HASH: the job record (state, attempt, worker, timestamps, spec, outcome).
  job:ID:attempts  LIST of JSON objects, one per attempt (worker, lease id, start, end, how it ended):
                the attempts the pool knows ran, which a checkpoint restore trusts (worker/checkpoints.py).
  job:ID:log    Stream of the job's output chunks, bounded in bytes (head and tail kept, log.lua).
  job:ID:channel:S  HASH: channel S into running job ID (poolctl exec, forward): its kind, argv,
                stdin, port, user, worker and when it was opened, written by the server
                (server/channels.py), which keeps it from expiring while the channel is open
                and moves its `alive_until` (epoch seconds) ahead every few seconds: a worker
                ends a channel whose record has gone or whose `alive_until` has passed; the
                server deletes it and both Streams at the channel's end; `taken` once a worker serves it
                (only one does: the server may tell it twice). With job:ID:channel:S:in, a
                Stream of what the server relays to the worker (the client's input,
                acknowledgements, a kill), and job:ID:channel:S:out, one of what the worker
                relays back (output, credit, the exit): each entry a map (docs/PROTOCOL.md's
                channel, in Redis: worker/execs.py), each XADD capped, each key expiring
                CHANNEL_IDLE after its last write.
  outbox        ZSET 'ID/TARGET' -> when it is due (Redis server time, ms): job ends to notify
                (TARGET `job`: the job's --notify URL; `pool`: notify_url), put there by the
                script that ends the job, for the targets its record names ('notify', written
                at enqueue); a server that takes one on makes it due a hold later, and takes it
                out once delivered or given up (queue/outbox.py); at most 100 000 per queue.
                Its attempts so far are counted on the record ('notify_tries:TARGET').
  outbox_dropped  counter of the ends the outbox's cap pushed out, until a server reports them.
  acct:DAY      LIST of the accounting records of the queue's jobs that ended on day DAY (days
                since the epoch, Redis time), one per job, in the order they ended: written by the
                script that ends the job (lib/account.lua, which gives the record's fields), so
                exactly once; the list expires accounting_retention_days after its day ends, long
                after the jobs' own records (queue/accounting.py reads them).
  idem:KEY      the job id an idempotency key (``len(user):user:key``) was first used for; it expires
                with the job's record, `job_retention` after the job ends.
  batch:ID      the ids an enqueue_many call gave, for ten minutes, so that the call sent again
                answers them rather than adding its jobs twice.
  batch:ID:refused  set, for ten minutes, by an enqueue_many call refused as over its user's
                jobs not ended: the later calls of the same batch (ID: the batch's) refuse too.
  primary       HASH: the redis-server that holds this queue as the pool knows it (its run id), and
                since when (primary_age.lua): per queue, since on a Cluster each shard has its own.
  replicated    (Cluster only) a key a durable batch touches before its WAIT (scripts.py).
Pool-wide (``gp:{pool}:…``):
  queues        SET of queue names that ever had a job.
  workers       HASH worker id -> registration (msgpack): host, pid, slots, GPUs, queues, state.
  stored:USER   HASH day number (days since the epoch, Redis time) -> bytes the user submitted that
                day, in every queue: the days within the retention are what the user may still
                hold in Redis, kept within user_max_stored_bytes by the enqueues (lua/store.lua).
  workers:seen  ZSET worker id -> time of its last heartbeat (Redis server time, ms); a worker
                silent for longer than its registered healthy period is shown as dead.
Pub/sub channels (not keys: no slot, so they work the same on Redis Cluster):
  gp:worker:ID  a nudge to worker ID to heartbeat now (a job of its was cancelled); best effort,
                the next regular heartbeat brings the same news. A message `channel:S:JOB` is
                no nudge but news of channel S into its job JOB (channel_message).
"""

from __future__ import annotations

from daemon.job import queue_of

PREFIX = "gp"
GROUP = "workers"
RECLAIMED_CONSUMER = "reclaimed"


def queue_prefix(queue: str) -> str:
    """The prefix every key of `queue` starts with; scripts derive job keys from it."""
    return f"{PREFIX}:{{q:{queue}}}:"


def stream(queue: str) -> str:
    return queue_prefix(queue) + "stream"


def front(queue: str) -> str:
    """The front of a queue: jobs reclaimed, handed back or retried, served before any job not yet
    started (claim/places.lua). Its key says 'retry', as it did before it took more than retries:
    a pool upgraded in place keeps the jobs waiting there."""
    return queue_prefix(queue) + "retry"


def backoff(queue: str) -> str:
    return queue_prefix(queue) + "backoff"


def leases(queue: str) -> str:
    return queue_prefix(queue) + "leases"


def unended(queue: str) -> str:
    return queue_prefix(queue) + "unended"


def jobs(queue: str) -> str:
    return queue_prefix(queue) + "jobs"


def ended(queue: str) -> str:
    return queue_prefix(queue) + "ended"


def parked(queue: str) -> str:
    return queue_prefix(queue) + "parked"


def capped(queue: str) -> str:
    return queue_prefix(queue) + "capped"


def capped_users(queue: str) -> str:
    return queue_prefix(queue) + "capped_users"


def capped_front(queue: str) -> str:
    return queue_prefix(queue) + "capped_front"


def waiting(queue: str) -> str:
    return queue_prefix(queue) + "waiting"


def array(array_id: str) -> str:
    queue, _, name = array_id.partition("@")
    return queue_prefix(queue) + "array:" + name


def array_active(array_id: str) -> str:
    return array(array_id) + ":active"


def array_next(array_id: str) -> str:
    return array(array_id) + ":next"


def array_left(array_id: str) -> str:
    return array(array_id) + ":left"


def depends(queue: str) -> str:
    return queue_prefix(queue) + "depends"


def dependents(job_id: str) -> str:
    return queue_prefix(queue_of(job_id)) + "dependents:" + job_id


def reservation(queue: str) -> str:
    return queue_prefix(queue) + "reservation"


def fairshare(queue: str) -> str:
    return queue_prefix(queue) + "fairshare"


def priority(queue: str) -> str:
    return queue_prefix(queue) + "prio"


def wake(queue: str) -> str:
    return queue_prefix(queue) + "wake"


def claims(queue: str, worker: str) -> str:
    return queue_prefix(queue) + "claims:" + worker


def batch(queue: str, batch_id: str) -> str:
    return queue_prefix(queue) + "batch:" + batch_id


def batch_refused(queue: str, batch_id: str) -> str:
    return queue_prefix(queue) + "batch:" + batch_id + ":refused"


def seq(queue: str) -> str:
    return queue_prefix(queue) + "seq"


def events(queue: str) -> str:
    return queue_prefix(queue) + "events"


def primary(queue: str) -> str:
    return queue_prefix(queue) + "primary"


def job(job_id: str) -> str:
    return queue_prefix(queue_of(job_id)) + "job:" + job_id


def attempts(job_id: str) -> str:
    return job(job_id) + ":attempts"


def log(job_id: str) -> str:
    return job(job_id) + ":log"


def channel(job_id: str, session: str) -> str:
    return job(job_id) + ":channel:" + session


def channel_in(job_id: str, session: str) -> str:
    return channel(job_id, session) + ":in"


def channel_out(job_id: str, session: str) -> str:
    return channel(job_id, session) + ":out"


def accounting(queue: str, day: int) -> str:
    """The accounting records of `queue`'s jobs that ended on `day` (days since the epoch)."""
    return f"{queue_prefix(queue)}acct:{day}"


def outbox(queue: str) -> str:
    return queue_prefix(queue) + "outbox"


def outbox_dropped(queue: str) -> str:
    return queue_prefix(queue) + "outbox_dropped"


def idempotency(queue: str, user: str, key: str) -> str:
    """The key of `user`'s idempotency key: the user's name goes first with its length, so no pair
    of (user, key) can name another's (``a:b`` + ``c`` and ``a`` + ``b:c`` differ)."""
    return f"{queue_prefix(queue)}idem:{len(user)}:{user}:{key}"


POOL_PREFIX = f"{PREFIX}:{{pool}}:"
QUEUES = POOL_PREFIX + "queues"
WORKERS = POOL_PREFIX + "workers"
WORKERS_SEEN = POOL_PREFIX + "workers:seen"


def stored(user: str) -> str:
    return f"{POOL_PREFIX}stored:{user}"


def worker_channel(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


CHANNEL_MESSAGE = "channel:"


def channel_message(job_id: str, session: str) -> str:
    """What the server publishes on a worker's channel to tell it of channel `session` into its
    job `job_id` (the session is hex, so the first colon after the prefix ends it)."""
    return f"{CHANNEL_MESSAGE}{session}:{job_id}"


# A channel nobody listens on: a durable batch publishes to it before its WAIT (scripts.py), a
# write that always reaches the replication stream, so the WAIT covers every write before it.
REPLICATION_MARK = f"{PREFIX}:replicated"


def replication_mark(key: str) -> str:
    """On a Redis Cluster, where PUBLISH is not replicated: the key a durable batch touches
    before its WAIT instead, in the slot of `key` (its hash tag's), so on the batch's node."""
    tag = key[key.index("{") : key.index("}") + 1]
    return f"{PREFIX}:{tag}:replicated"
