"""The run's Ray actors by name (``teacher-0``, ``student-1``, ...): started, called, and
when a call fails, the worker that truly died found and named.

When a teacher's process dies, the first call to fail is usually a student's (it waits on
the teacher's replies), so the failed call does not name the dead worker. `Actors.get`
therefore pings every worker when a call fails: a dead actor's ping fails at once with
`RayActorError`, a live one answers (or is still busy), so the message names the dead one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .errors import WorkerDied, WorkerFailed

PING_SECONDS = 10.0  # a live worker busy longer than this is taken for alive


@dataclass(frozen=True)
class Call:
    """A remote call in flight: the worker's name and the result's object ref."""
    worker: str
    ref: Any


class Actors:
    """Named Ray actors of one run. ``last_checkpoint()`` gives the newest good checkpoint
    for the message of a death."""

    def __init__(self, ray, last_checkpoint: Callable[[], Optional[str]]):
        self.ray, self.last_checkpoint = ray, last_checkpoint
        self.handles: dict[str, Any] = {}  # actor name -> handle
        self.roles: dict[str, tuple[str, str]] = {}  # worker name -> (its fused actor's name, its role there)

    def start(self, role: str, cls: type, count: int, options: dict, arguments: Callable[[int], tuple],
              placed: Optional[Callable[[int], dict]] = None) -> list[str]:
        """``count`` actors of ``cls`` named ``role-rank``, built with ``arguments(rank)``, with
        the Ray ``options`` (and ``placed(rank)``'s: a placement group slot); their names.
        ``cls.RAY_CLASS_OPTIONS``, if any, are the class's own ``ray.remote`` options (those that
        ``.options()`` refuses, such as ``concurrency_groups``)."""
        remote = self.ray.remote(**dict(getattr(cls, "RAY_CLASS_OPTIONS", {}), max_restarts=0))(cls)
        names = [f"{role}-{rank}" for rank in range(count)]
        for rank, name in enumerate(names):
            extra = placed(rank) if placed is not None else {}
            self.handles[name] = remote.options(**options, **extra).remote(*arguments(rank))
        return names

    def start_fused(self, roles: list[tuple[str, type]], count: int, options: dict,
                    arguments: Callable[[str, int], tuple], placed: Optional[Callable[[int], dict]] = None
                    ) -> dict[str, list[str]]:
        """``count`` `fused.FusedWorker` actors, the one of rank ``r`` holding a worker of each
        ``(role, cls)``, built with ``arguments(role, r)``; the workers keep their names
        (``role-r``: `call`, `get` and the messages of a death use them). Returns each role's
        worker names."""
        from .fused import FusedWorker

        remote = self.ray.remote(max_restarts=0)(FusedWorker)
        names = {role: [f"{role}-{rank}" for rank in range(count)] for role, _ in roles}
        for rank in range(count):
            actor = "+".join(names[role][rank] for role, _ in roles)
            extra = placed(rank) if placed is not None else {}
            self.handles[actor] = remote.options(**options, **extra).remote(
                [(role, cls, arguments(role, rank)) for role, cls in roles])
            self.roles.update({names[role][rank]: (actor, role) for role, _ in roles})
        return names

    def call(self, worker: str, method: str, *args) -> Call:
        if worker in self.roles:
            actor, role = self.roles[worker]
            return Call(worker, self.handles[actor].call.remote(role, method, *args))
        return Call(worker, getattr(self.handles[worker], method).remote(*args))

    def get(self, calls: list[Call], when: str) -> list:
        """The results of ``calls``; if one fails, WorkerDied naming the dead worker(s), or
        WorkerFailed naming the worker that raised. ``when``: "at step 12", "during setup"."""
        try:
            return self.ray.get([call.ref for call in calls])
        except self.ray.exceptions.RayError as error:
            raise self.diagnose(calls, when) from error

    def wait_each(self, calls: list[Call], when: str):
        """Yields (index, result) of ``calls`` as each finishes (failures as in `get`)."""
        position = {call.ref: index for index, call in enumerate(calls)}
        pending = list(position)
        while pending:
            ready, pending = self.ray.wait(pending, num_returns=1)
            index = position[ready[0]]
            yield index, self.get([calls[index]], when)[0]

    def dead(self) -> dict[str, Exception]:
        """The workers whose process is gone (or that failed to start), with Ray's error (a
        fused actor by its name, ``teacher-0+student-0``: both workers of its process)."""
        pings = {name: handle.ping.remote() for name, handle in self.handles.items()}
        ready, _ = self.ray.wait(list(pings.values()), num_returns=len(pings), timeout=PING_SECONDS)
        found = {}
        for name, ref in pings.items():
            if ref in ready:
                try:
                    self.ray.get(ref)
                except self.ray.exceptions.RayActorError as error:
                    found[name] = error
        return found

    def diagnose(self, calls: list[Call], when: str) -> Exception:
        """The error to raise for a failed call among ``calls``."""
        dead = self.dead()
        started = {name: error for name, error in dead.items() if error.actor_init_failed}
        if started:
            name, error = next(iter(started.items()))
            return WorkerFailed(f"{_workers([name])} failed to start: {_last_line(str(error))}")
        if dead:
            return WorkerDied(f"{_workers(list(dead))} died {when}; last good checkpoint: "
                              f"{self.last_checkpoint() or 'none'}")
        for call in calls:
            try:
                self.ray.get(call.ref, timeout=0)
            except self.ray.exceptions.RayTaskError as error:
                cause = error.cause if getattr(error, "cause", None) is not None else error
                message = str(cause).strip().splitlines()
                return WorkerFailed(f"worker {call.worker} failed {when}: {cause.__class__.__name__}: "
                                    f"{message[0] if message else ''}")
            except Exception:  # noqa: BLE001 - not finished, or not this call's failure
                continue
        return WorkerFailed(f"a worker call failed {when} and every worker is alive")

    def kill_all(self) -> None:
        for handle in self.handles.values():
            self.ray.kill(handle, no_restart=True)


def _workers(actors: list[str]) -> str:
    """"worker teacher-0" or "workers teacher-0, student-0" for actor names (a fused actor's
    name joins its workers' with "+")."""
    workers = [worker for actor in actors for worker in actor.split("+")]
    return f"worker{'s' if len(workers) > 1 else ''} {', '.join(workers)}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
