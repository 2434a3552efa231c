"""The job's store on an etcd cluster: keys in etcd (v3 API) behind the calls of a c10d `Store`.

`mecefo-launch --store etcd` hands every process the address `etcd://HOST:PORT[,HOST:PORT...]/JOB`
instead of the TCPStore's `HOST:PORT`; `keys.connect` gives an `EtcdStore` for it. Every key of the
job lives under `/mecefo/JOB/`, so one etcd cluster serves many jobs.

`EtcdStore` answers the control plane's calls (`set`, `get`, `add`, `compare_set`, `check`,
`multi_get`, `append`, `delete_key`, `wait`) as a TCPStore does, without importing torch (the agent
and the coordinator never do). `torch_store` wraps one in a real c10d store (a Python subclass of
`torch.distributed.Store`) for a rank: its per-generation gloo rendezvous on a `PrefixStore` works
unchanged.

- etcd has no increment: `add` and `append` are a read, then a transaction on that key's
  revision, retried when another writer came first. The transaction also writes a key unique to
  the call (`/mecefo-ops/JOB/...`, on a short lease): a request resent because its answer was lost
  finds that key and returns what the first one wrote, so no add counts twice.
- Requests go through `etcd3gw` (pinned, imported lazily) to one endpoint at a time; an endpoint
  that does not answer, or a member that has lost its leader, sends the request to the next one
  until the operation's deadline. Past it, `EtcdUnavailable` (a `StoreError`: a `RuntimeError`, as
  torch's `DistStoreError`) names the endpoints: a lost quorum looks exactly like that.
- A blocking `get` or `wait` polls (5 ms, growing to 50 ms) until its timeout.
- Leases (`grant`, `keepalive`, `revoke`), `create` (a key that must not exist) and `txn_put` (puts
  that happen only if given keys hold given values) serve the node leases, the coordinator's
  election and its fenced generations (`election.py`).
"""

from __future__ import annotations

import base64
import datetime
import functools
import itertools
import time
import uuid
from collections.abc import Iterable

from megatron_mecefo.control.store_errors import StoreError, StoreTimeout

SCHEME = "etcd://"
ROOT = "/mecefo/"
OPS_ROOT = "/mecefo-ops/"
"""Where `add`/`append` mark each call as done (outside the job's keys: `num_keys` ignores them)."""
OPS_LEASE_S = 120
"""Those marks expire with a lease of this TTL (a new lease every half of it)."""
REQUEST_TIMEOUT_S = 2.0
"""One HTTP request to one member; a lost leader makes etcd itself answer after ~1-5 s."""
MAX_TXN_OPS = 128
"""etcd's default `--max-txn-ops`: a `multi_get` of more keys (the coordinator reads every node's
report at once) is cut into transactions of this many reads (each one consistent, not all)."""
_UNAVAILABLE = ("no leader", "request timed out", "leader changed", "not capable", "unhealthy")


UNAVAILABLE_TEXT = "etcd unreachable"
"""How `EtcdUnavailable`'s text starts (it may reach a handler re-raised by torch's C++)."""


class EtcdUnavailable(StoreError):
    """No endpoint of the cluster served a request in time (members down, or quorum lost)."""


def is_etcd(address: str) -> bool:
    return address.startswith(SCHEME)


def parse(address: str) -> tuple[list[tuple[str, int]], str]:
    """`etcd://h:p,h:p/JOB` -> ([(h, p), ...], JOB); raises ValueError on a malformed address."""
    if not is_etcd(address):
        raise ValueError(f"an etcd address starts with {SCHEME}, got {address!r}")
    hosts, _, job = address[len(SCHEME) :].partition("/")
    endpoints = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd endpoint must be HOST:PORT, got {item!r} in {address!r}")
        endpoints.append((host, int(port)))
    if not job or "/" in job:
        raise ValueError(f"etcd address needs one job name after the endpoints: {address!r}")
    return endpoints, job


def address(endpoints: Iterable[tuple[str, int]] | Iterable[str], job: str) -> str:
    """The address string of `endpoints` (pairs or "host:port") and a job name."""
    items = [e if isinstance(e, str) else f"{e[0]}:{e[1]}" for e in endpoints]
    return f"{SCHEME}{','.join(items)}/{job}"


def _b64(data: bytes | str) -> str:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _to_bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class EtcdClient:
    """etcd's v3 JSON gateway over `etcd3gw`, with failover across endpoints."""

    def __init__(self, endpoints: list[tuple[str, int]], timeout_s: float):
        from etcd3gw.client import Etcd3Client  # lazily: the tcp store does not need it

        self.endpoints = endpoints
        self.timeout_s = timeout_s
        per_request = min(REQUEST_TIMEOUT_S, max(0.2, timeout_s))
        self._clients = [
            Etcd3Client(host=h, port=p, timeout=per_request, api_path="/v3/") for h, p in endpoints
        ]
        self._current = 0
        self.requests = 0
        """Requests sent (for the control-plane benchmark)."""

    def call(self, path: str, payload: dict, timeout_s: float | None = None) -> dict:
        """POST `payload` to `path` on a member that answers; raises EtcdUnavailable past the
        deadline (the store's timeout, or `timeout_s`)."""
        from etcd3gw import exceptions as ex

        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        last = "no request sent"
        pause = 0.02
        while True:
            client = self._clients[self._current]
            self.requests += 1
            try:
                return client.post(client.get_url(path), json=payload)
            except (ex.ConnectionFailedError, ex.ConnectionTimeoutError) as exc:
                last = f"{client.host}:{client.port}: {_first_line(exc)}"
            except ex.Etcd3Exception as exc:
                text = _first_line(exc)
                if not any(word in text for word in _UNAVAILABLE):
                    raise
                last = f"{client.host}:{client.port}: {text}"
            self._current = (self._current + 1) % len(self._clients)
            if time.monotonic() >= deadline:
                hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
                raise EtcdUnavailable(
                    f"{UNAVAILABLE_TEXT}: no member of {hosts} served a request for "
                    f"{self.timeout_s if timeout_s is None else timeout_s:.1f} s, quorum lost? "
                    f"(last: {last})"
                )
            if self._current == 0:  # every member tried once: back off a little
                time.sleep(pause)
                pause = min(0.5, pause * 2)

    # ---------------------------------------------------------------- kv
    def range(
        self, key: str, *, prefix: bool = False, count_only: bool = False, keys_only: bool = False
    ) -> dict:
        payload: dict = {"key": _b64(key)}
        if prefix:
            payload["range_end"] = _b64(_prefix_end(key))
        if count_only:
            payload["count_only"] = True
        if keys_only:
            payload["keys_only"] = True
        return self.call("/kv/range", payload)

    def txn(self, compare: list[dict], success: list[dict], failure: list[dict]) -> dict:
        return self.call("/kv/txn", {"compare": compare, "success": success, "failure": failure})

    def status(self, timeout_s: float) -> dict:
        return self.call("/maintenance/status", {}, timeout_s=timeout_s)


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(a) for a in exc.args) if exc.args else type(exc).__name__
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _prefix_end(key: str) -> bytes:
    raw = bytearray(key.encode())
    raw[-1] += 1
    return bytes(raw)


def _put(key: str, value: bytes, lease: int | None = None) -> dict:
    req: dict = {"key": _b64(key), "value": _b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def _get(key: str) -> dict:
    return {"request_range": {"key": _b64(key)}}


def _value_of(response: dict) -> bytes | None:
    kvs = response.get("response_range", response).get("kvs") or []
    return _unb64(kvs[0].get("value")) if kvs else None


class EtcdStore:
    """The job's store on etcd (see the module docstring). One per thread, like a TCPStore
    client."""

    def __init__(self, address: str, timeout_s: float):
        endpoints, job = parse(address)
        self.address = address
        self.job = job
        self.root = f"{ROOT}{job}/"
        self.client = EtcdClient(endpoints, timeout_s)
        self._ops = f"{OPS_ROOT}{job}/{uuid.uuid4().hex[:12]}-"
        self._op_count = itertools.count()
        self._op_lease: tuple[int, float] | None = None  # (lease, when granted)
        self._timeout_s = timeout_s

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self._timeout_s)

    def _k(self, key: str) -> str:
        return self.root + key

    # ---------------------------------------------------------------- c10d Store
    def set(self, key: str, value) -> None:
        self.put(key, value)

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def check(self, keys: list[str]) -> bool:
        return all(v is not None for v in self._read(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Waits, like a TCPStore, until every key exists (up to the store's timeout)."""
        found = self._poll(keys, lambda values: all(v is not None for v in values))
        return [v for v in found]  # type: ignore[misc]

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = None if timeout is None else timeout.total_seconds()
        self._poll(keys, lambda values: all(v is not None for v in values), limit)

    def add(self, key: str, amount: int) -> int:
        def bump(old: bytes | None) -> bytes:
            return str((int(old) if old else 0) + int(amount)).encode()

        return int(self._update(key, bump))

    def append(self, key: str, value) -> None:
        self._update(key, lambda old: (old or b"") + _to_bytes(value))

    def compare_set(self, key: str, expected, desired) -> bytes:
        """As a TCPStore: set `desired` if the value is `expected` (or the key is absent and
        `expected` empty); returns the value now held (`expected` for an absent key otherwise)."""
        k, exp, want = self._k(key), _to_bytes(expected), _to_bytes(desired)
        cond = (
            {"key": _b64(k), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            if not exp
            else {"key": _b64(k), "target": "VALUE", "result": "EQUAL", "value": _b64(exp)}
        )
        res = self.client.txn([cond], [_put(k, want)], [_get(k)])
        if res.get("succeeded"):
            return want
        current = _value_of(res["responses"][0]) if res.get("responses") else None
        return exp if current is None else current

    def delete_key(self, key: str) -> bool:
        res = self.client.call("/kv/deleterange", {"key": _b64(self._k(key))})
        return int(res.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        return self.count_prefix("")

    def values_with_prefix(self, prefix: str) -> list[bytes]:
        """The values of every key that starts with `prefix`."""
        return [
            _unb64(kv.get("value"))
            for kv in self.client.range(self._k(prefix), prefix=True).get("kvs") or []
        ]

    def keys_with_prefix(self, prefix: str) -> list[str]:
        """The rest of every key that starts with `prefix` (one request, no values)."""
        kvs = self.client.range(self._k(prefix), prefix=True, keys_only=True).get("kvs") or []
        cut = len(self._k(prefix))
        return [_unb64(kv["key"]).decode()[cut:] for kv in kvs]

    def count_prefix(self, prefix: str) -> int:
        """How many keys start with `prefix`."""
        res = self.client.range(self._k(prefix), prefix=True, count_only=True)
        return int(res.get("count", 0))

    # ---------------------------------------------------------------- etcd's own
    def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; its id."""
        return int(self.client.call("/lease/grant", {"TTL": int(ttl_s)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew `lease`; its remaining TTL in seconds, or -1 if it has expired."""
        res = self.client.call("/lease/keepalive", {"ID": str(lease)})
        return int(res.get("result", res).get("TTL", -1))

    def revoke(self, lease: int) -> None:
        self.client.call("/kv/lease/revoke", {"ID": str(lease)})

    def put(self, key: str, value, lease: int | None = None) -> None:
        self.client.call("/kv/put", _put(self._k(key), _to_bytes(value), lease)["request_put"])

    def create(self, key: str, value, lease: int | None = None) -> bytes | None:
        """Set `key` only if it does not exist; None on success, else the value it holds."""
        k = self._k(key)
        cond = {"key": _b64(k), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        res = self.client.txn([cond], [_put(k, _to_bytes(value), lease)], [_get(k)])
        if res.get("succeeded"):
            return None
        current = _value_of(res["responses"][0]) if res.get("responses") else None
        return b"" if current is None else current

    def txn_put(self, conditions: dict[str, str], puts: dict[str, str]) -> bool:
        """Write every key of `puts` in one transaction, only if each key of `conditions` holds
        its value; whether it did."""
        compare = [
            {"key": _b64(self._k(k)), "target": "VALUE", "result": "EQUAL", "value": _b64(v)}
            for k, v in conditions.items()
        ]
        success = [_put(self._k(k), _to_bytes(v)) for k, v in puts.items()]
        return bool(self.client.txn(compare, success, []).get("succeeded"))

    # ---------------------------------------------------------------- helpers
    def _read(self, keys: list[str]) -> list[bytes | None]:
        if len(keys) == 1:
            res = self.client.range(self._k(keys[0]))
            return [_value_of(res)]
        values: list[bytes | None] = []
        for at in range(0, len(keys), MAX_TXN_OPS):  # etcd refuses a longer transaction
            chunk = keys[at : at + MAX_TXN_OPS]
            res = self.client.txn([], [_get(self._k(k)) for k in chunk], [])
            values += [_value_of(r) for r in res.get("responses", [])]
        return values

    def _poll(self, keys: list[str], done, limit_s: float | None = None) -> list[bytes | None]:
        limit = self._timeout_s if limit_s is None else limit_s
        deadline = time.monotonic() + limit
        pause = 0.005
        while True:
            values = self._read(keys)
            if done(values):
                return values
            if time.monotonic() >= deadline:
                missing = [k for k, v in zip(keys, values) if v is None]
                raise StoreTimeout(
                    f"wait timeout after {limit:.1f} s for key(s) {missing} in etcd {self.root}"
                )
            time.sleep(pause)
            pause = min(0.05, pause * 1.5)

    def _update(self, key: str, change) -> bytes:
        """Read-modify-write of one key on its revision; retried when another writer won. The
        transaction also sets this call's mark: when a lost answer made the client resend it and
        the first send had been applied, the mark says so, with the value it wrote."""
        k = self._k(key)
        mark = f"{self._ops}{next(self._op_count)}"
        while True:
            kvs = self.client.range(k).get("kvs") or []
            old = _unb64(kvs[0].get("value")) if kvs else None
            rev = kvs[0]["mod_revision"] if kvs else "0"
            cond = (
                {"key": _b64(k), "target": "MOD", "result": "EQUAL", "mod_revision": str(rev)}
                if kvs
                else {"key": _b64(k), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            )
            new = change(old)
            res = self.client.txn(
                [cond], [_put(k, new), _put(mark, new, self._lease())], [_get(mark)]
            )
            if res.get("succeeded"):
                return new
            done = _value_of(res["responses"][0]) if res.get("responses") else None
            if done is not None:  # this call was applied before: never apply it twice
                return done

    def _lease(self) -> int:
        """The lease the marks of `_update` expire with (renewed by a new grant, not kept alive)."""
        now = time.monotonic()
        if self._op_lease is None or now - self._op_lease[1] > OPS_LEASE_S / 2:
            self._op_lease = (self.grant(OPS_LEASE_S), now)
        return self._op_lease[0]


_KEEP_ALIVE: list = []
"""Every store `torch_store` made: a c10d object that holds one (a `PrefixStore`, a process group)
holds only its C++ half, and once the Python half is collected each call fails ("Not
implemented"). A job makes a few per generation, so keeping all is cheap."""


def torch_store(store: EtcdStore):
    """`store` as a c10d `Store` (for a `PrefixStore`, a gloo rendezvous): the c10d calls and
    every other attribute go to `store`. Imports torch."""
    wrapped = _torch_store_class()(store)
    _KEEP_ALIVE.append(wrapped)
    return wrapped


@functools.cache
def _torch_store_class():
    """The c10d `Store` subclass behind `torch_store`, made once (it needs torch)."""
    import torch.distributed as dist

    class TorchEtcdStore(dist.Store):
        def __init__(self, inner: EtcdStore):
            super().__init__()
            self.inner = inner
            dist.Store.set_timeout(self, inner.timeout)

        def __getattr__(self, name):  # only for what this class does not define
            return getattr(self.__dict__["inner"], name)

        def set(self, key, value):
            self.inner.set(key, value)

        def get(self, key):
            return self.inner.get(key)

        def check(self, keys):
            return self.inner.check(keys)

        def multi_get(self, keys):
            return self.inner.multi_get(keys)

        def wait(self, keys, timeout=None):
            self.inner.wait(keys, timeout)

        def add(self, key, amount):
            return self.inner.add(key, amount)

        def append(self, key, value):
            self.inner.append(key, value)

        def compare_set(self, key, expected, desired):
            return self.inner.compare_set(key, expected, desired)

        def delete_key(self, key):
            return self.inner.delete_key(key)

        def num_keys(self):
            return self.inner.num_keys()

        def set_timeout(self, timeout):
            dist.Store.set_timeout(self, timeout)
            self.inner.set_timeout(timeout)

    return TorchEtcdStore
