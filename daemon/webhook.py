"""What a job-end notification is (`poolctl enqueue --notify URL`, config `notify_url`): the URLs it
may go to, the record it carries, and how it is signed (which addresses a user's hook may reach:
webhook_targets.py).

One module for the three, because the job model (a spec's `notify`), the configuration
(`notify_url`), the server's sender (server/notifier.py) and every receiver (docs/OPERATIONS.md shows
the check) must agree on them. No I/O here: poolctl checks a URL with it before connecting.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any
from urllib.parse import urlsplit

MAX_URL = 2048  # bytes of a notification URL: more is a mistake, not an address
SIGNATURE_HEADER = "X-Gpupool-Signature"  # "v1=" + hex HMAC-SHA256 of "TIMESTAMP." + the body
TIMESTAMP_HEADER = "X-Gpupool-Timestamp"  # Unix seconds when the POST was signed
SIGNATURE_VERSION = "v1"
MAX_AGE = 300  # seconds a receiver accepts a signed POST for: later it is a replay
USER_KEY_LABEL = b"gpupool-webhook"  # what a user's token signs to make their hooks' key
EVENT_HEADER = "X-Gpupool-Event"
DELIVERY_HEADER = "X-Gpupool-Delivery"  # JOB/TARGET: the same on each retry, for a receiver to dedupe
EVENT = "job.ended"
# Where an end goes: the job's own --notify URL, and the pool's notify_url (the delivery header's
# TARGET, and the outbox's; queue/outbox.py).
TARGET_JOB = "job"
TARGET_POOL = "pool"
EXAMPLE = "https://hooks.example.com/gpupool"


def check_url(url: object) -> str:
    """`url` if it is an http:// or https:// URL with a host; ValueError saying what is expected
    otherwise (the caller names the option or field)."""
    if not isinstance(url, str):
        raise ValueError(f"expected an http:// or https:// URL, e.g. {EXAMPLE}")
    if len(url) > MAX_URL or any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise ValueError(f"expected a URL of at most {MAX_URL} characters without spaces or control codes")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (a port out of range or not a number raises here)
    except ValueError:
        raise ValueError(f"expected an http:// or https:// URL with a valid port, e.g. {EXAMPLE}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL with a host, e.g. {EXAMPLE}")
    return url


def shown(url: str) -> str:
    """The URL as logs may show it: scheme, host and port only (its path or query may hold a token,
    as a chat service's webhook URL does)."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}/…"


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """The signature header's value for `body` sent at `timestamp` (Unix seconds): "v1=" + hex
    HMAC-SHA256, keyed by `secret`, of the timestamp, a dot, and the body. The timestamp is signed
    with the body so that a receiver can refuse an old POST sent again (verify)."""
    signed = str(timestamp).encode() + b"." + body
    return f"{SIGNATURE_VERSION}=" + hmac.new(secret, signed, hashlib.sha256).hexdigest()


def verify(secret: bytes, body: bytes, timestamp: str, signature: str, now: float) -> bool:
    """Whether `signature` is `body`'s at `timestamp` (the headers' values) under `secret`, compared
    in constant time, and the timestamp within MAX_AGE of `now`: what a receiver in Python does
    (docs/OPERATIONS.md §12); a receiver also keeps the deliveries it has had in that time."""
    if not timestamp.isdigit() or abs(now - int(timestamp)) > MAX_AGE:
        return False
    return hmac.compare_digest(sign(secret, int(timestamp), body), signature)


def user_key(token: bytes) -> bytes:
    """The key a user's own hooks (`--notify`) are signed with: hex HMAC-SHA256 of USER_KEY_LABEL
    keyed by the user's token. The user can make it from the token they hold; it is not the
    pool's notify_secret, so a user never learns how the pool's receiver checks its POSTs, and
    one user's key says nothing of another's."""
    return hmac.new(token, USER_KEY_LABEL, hashlib.sha256).hexdigest().encode()


def end_record(job: dict[str, Any]) -> dict[str, Any]:
    """The body of a notification: what a receiver needs of a job that ended, from its record as
    the protocol answers it (JobInfo.to_dict), with what its GPUs did (`gpu_usage`) and whether
    it left them idle (`idle_gpu`). Neither its environment nor its result: they may hold
    secrets, and the pool-wide URL is not the job owner's."""
    spec = job["spec"]
    return {
        "event": EVENT,
        "id": job["id"],
        "name": spec["name"],
        "user": spec["user"],
        "queue": spec["queue"],
        "state": job["state"],
        "exit_code": job["exit_code"],
        "detail": job["detail"],
        "enqueued_at": job["enqueued_at"],
        "started_at": job["started_at"],
        "ended_at": job["ended_at"],
        "attempts": job["attempt"],
        "worker": job["worker"],
        "gpu_usage": job.get("gpu_usage"),
        "idle_gpu": job.get("idle_gpu"),
    }
