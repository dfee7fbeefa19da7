"""LoRA adapters over replicas: the client's registry (`ReplicaLoRAs`) and each replica's copy
(`ReplicaAdapters`).

`add_lora` turns the source into something another process can read (`portable_source`: a folder
travels as its absolute path, a PeftModel as its adapter's config and state dict), puts it in Ray's
object store once, and registers it on every live replica, so a bad adapter is refused there with
the engine's own ValueError (and registered nowhere). Every request naming the adapter carries a
`ShippedLoRA`: its name, the registration it stands for and a reference to its source. A replica
that does not hold that registration (Ray restarted it, or it was down when the adapter was added)
reads the source from the object store before running the request, so replicas started later get
every adapter registered before. The client answers unknown names itself, as one engine would.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayTaskError

from paged_backend.model.lora import LoRARequest, LoRASpec, portable_source

from .errors import NoLiveReplicaError, first_line
from .router import Router


@dataclass(frozen=True, slots=True)
class ShippedLoRA:
    """An adapter as a request carries it to a replica."""

    name: str
    token: str  # one registration of the name: a replica holding another one replaces it
    source: ray.ObjectRef  # its portable source in the object store (read only by a replica lacking it)

    @property
    def prefix_salt(self) -> str:
        """What sets its prompts apart in the router's prefix table, as the adapter does in the engines'."""
        return f"lora:{self.name}:{self.token}"


class ReplicaLoRAs:
    """The adapters a replicated engine serves, by name. Safe from any thread: adds and removes are
    serialised; lookups read the current mapping without waiting for them."""

    def __init__(self, replicas: Sequence[ActorHandle], router: Router, enabled: bool, timeout_s: float) -> None:
        self.replicas = replicas
        self.router = router
        self.enabled = enabled
        self.timeout_s = timeout_s
        self.adapters: dict[str, ShippedLoRA] = {}
        self.changing = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def add(self, name: str, source: Any) -> None:
        """Register `name` on every live replica; ValueError (the replica's) if it does not fit, and then
        no replica keeps it."""
        self.require_enabled()
        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRA adapter needs a non-empty name, got {name!r}")
        portable = portable_source(source)
        with self.changing:
            if name in self.adapters:
                raise ValueError(f"a LoRA adapter named {name!r} is already registered; remove_lora it first")
            shipped = ShippedLoRA(name, uuid.uuid4().hex, ray.put(portable))
            done, refusal = self.broadcast(lambda r: r.add_lora.remote(shipped, shipped.source))
            if refusal is not None:
                self.broadcast(lambda r: r.remove_lora.remote(name, shipped.token), done)
                raise refusal
            self.adapters[name] = shipped

    def remove(self, name: str) -> None:
        """Forget `name` here and on every live replica; requests running with it finish with it."""
        with self.changing:
            shipped = self.adapters.pop(name, None)
            if shipped is None:
                raise ValueError(f"no LoRA adapter named {name!r}; known: {self.names()}")
            self.broadcast(lambda r: r.remove_lora.remote(name, shipped.token))

    def resolve(self, spec: LoRASpec | None) -> ShippedLoRA | None:
        """What a request naming `spec` carries (None: the base model); ValueError naming the known
        adapters. A `LoRARequest` with a path registers that folder under its name on first use."""
        if spec is None:
            return None
        self.require_enabled()
        if isinstance(spec, LoRARequest):
            if spec.path is not None and spec.name not in self.adapters:
                try:
                    self.add(spec.name, spec.path)
                except ValueError:
                    if spec.name not in self.adapters:  # not a race with another caller's add: a real refusal
                        raise
            spec = spec.name
        if not isinstance(spec, str):  # a ValueError, as the engine's: the server answers it with a 400
            raise ValueError(f"lora must be an adapter name or a LoRARequest, got {type(spec).__name__}")  # noqa: TRY004
        shipped = self.adapters.get(spec)
        if shipped is None:
            raise ValueError(f"unknown LoRA adapter {spec!r}; known adapters: {self.names() or 'none'}")
        return shipped

    def require_enabled(self) -> None:
        if not self.enabled:
            raise ValueError("LoRA adapters need replicas built with enable_lora=True")

    def broadcast(self, call, indices: Sequence[int] | None = None) -> tuple[list[int], Exception | None]:
        """Make `call(replica)` on the live replicas (or on `indices`); (those that did it, the first
        refusal). A dead replica is written off; a restarting one is skipped (it reads the adapter when
        a request names it)."""
        if indices is None:
            indices = [i for i, up in enumerate(self.router.alive) if up]
            if not indices:
                raise NoLiveReplicaError(self.router.describe_failures(()))
        refs = {i: call(self.replicas[i]) for i in indices}
        done: list[int] = []
        refusal: Exception | None = None
        for index, ref in refs.items():
            try:
                ray.get(ref, timeout=self.timeout_s)
                done.append(index)
            except RayTaskError as exc:  # the replica's engine refused it: every replica would
                refusal = refusal or as_refusal(exc)
            except ActorDiedError as exc:
                self.router.mark_dead(index, first_line(exc))
            except RayActorError:
                pass
            except GetTimeoutError:
                refusal = refusal or TimeoutError(f"replica {index} did not answer within {self.timeout_s} s")
        return done, refusal


def as_refusal(exc: RayTaskError) -> Exception:
    """The replica's own ValueError / TypeError (the engine's message), else the Ray error itself."""
    cause = exc.cause
    if isinstance(cause, (ValueError, TypeError)):
        return type(cause)(*cause.args)
    return exc


class ReplicaAdapters:
    """A replica's side: which registration of each name its engine holds, and reading one it lacks."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.tokens: dict[str, str] = {}
        self.lock = threading.Lock()

    def register(self, shipped: ShippedLoRA, source: Any) -> None:
        with self.lock:
            if self.tokens.get(shipped.name) == shipped.token:
                return
            if shipped.name in self.llm.list_loras():  # another registration of the name
                self.llm.remove_lora(shipped.name)
                self.tokens.pop(shipped.name, None)
            self.llm.add_lora(shipped.name, source)
            self.tokens[shipped.name] = shipped.token

    def remove(self, name: str, token: str) -> None:
        with self.lock:
            if self.tokens.get(name) == token:
                self.llm.remove_lora(name)
                del self.tokens[name]

    async def ensure(self, shipped: ShippedLoRA | None) -> str | None:
        """The adapter name to run a request with, registering it first if this replica lacks it."""
        if shipped is None:
            return None
        if self.tokens.get(shipped.name) != shipped.token:
            source = await shipped.source
            await asyncio.to_thread(self.register, shipped, source)
        return shipped.name
