"""The training runs loaded in this process, and where each one's state lives now.

Trainer slots are a cache: a run is hot (in a slot), warm (its exported state in host memory,
pinned when the engine is on an accelerator) or cold (written under `<data dir>/paged/`, in
the checkpoint format plus its pending gradient). Any operation on a run that is not hot pages
it in first (`get`, on the engine worker thread, before the op's batch runs); a slot is made by
sending the least recently used hot run that has no queued or in-flight work to the warm tier
(one whose work is queued only if every other hot run is busy; never one of the batch being
run), and past `warm_bytes` the least recently used warm runs go cold. Paging is exact, bit
for bit: a run's weights, moments, step, hyper-parameters and pending gradient come back as
they left (`TrainEngine.export_slot`). So the number of runs is bounded by disk, not by slots,
and creating one never fails for lack of a slot.

A trainer that cannot page (the sharded ones keep hard slots) keeps the old rule: a run per
slot, and creation past them fails saying so.

A model's row in the store outlives the process; its state does not, so after a restart (or its
session's end) the model is known but not live, and every op on it fails with that reason.
Written and read on the engine worker thread only."""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.adapters.checkpoint import CheckpointError
from lorafleet.fsio import ensure_private_dir
from lorafleet.interfaces import SlotPager, Trainer
from lorafleet.model.banks import BankError
from lorafleet.model.paging import PagingCounters, Recency, Tier
from lorafleet.server.errors import ServerFault, UserError
from lorafleet.server.state.paths import run_dir_name
from lorafleet.server.state.store import ModelRow, Store
from lorafleet.train.slot_state import SlotState

log = logging.getLogger(__name__)

PAGED_DIR = "paged"  # under the data dir: cold runs; wiped at start-up (runs do not survive one)


@dataclass
class LiveModel:
    """A run as an operation sees it: resident, in trainer slot `slot`, for this operation."""

    model_id: str
    tenant: str
    session_id: str
    slot: int
    base_model: str
    optimizer: str = "adamw"  # its optimizer family, fixed at creation (adapters.hparams)


@dataclass
class _Run:
    model_id: str
    tenant: str
    session_id: str
    base_model: str
    optimizer: str
    slot: int | None = None  # hot
    warm: SlotState | None = None
    cold: Path | None = None
    held: int = 0  # bytes its state takes in its tier
    hot_since: float | None = None  # monotonic: when its slot time was last counted

    @property
    def tier(self) -> Tier:
        if self.slot is not None:
            return "hot"
        return "warm" if self.warm is not None else "cold"

    def view(self) -> LiveModel:
        assert self.slot is not None
        return LiveModel(
            self.model_id, self.tenant, self.session_id, self.slot, self.base_model, self.optimizer
        )


class LiveModels:
    def __init__(
        self,
        store: Store,
        trainer: Trainer,
        max_adapters: int,
        *,
        paged_dir: Path | None = None,
        warm_bytes: int = 0,
        has_work: Callable[[str], bool] | None = None,
        max_resident: Callable[[str], int | None] | None = None,
    ):
        """`paged_dir`: where cold runs go (wiped now); None, or a trainer without a pager
        (`Trainer.pager` None: it cannot page), keeps hard slots. `has_work(model_id)`:
        whether the scheduler holds queued or running work for it (such runs are evicted
        last); None: no run ever has work waiting.
        `max_resident(tenant)`: the tenant's `resident_runs` quota (None: unlimited): a run of
        a tenant at its quota takes the slot of that tenant's own least recently used run."""
        if warm_bytes < 0:
            raise ValueError(f"warm_bytes must be >= 0, got {warm_bytes!r}")
        self.store = store
        self.trainer = trainer
        self.max_adapters = max_adapters  # named in the error when every slot is taken
        self.warm_bytes = warm_bytes
        self._has_work = has_work
        self._max_resident = max_resident
        # the trainer declares whether its slots are a cache (`Trainer.pager`)
        self._pager: SlotPager | None = trainer.pager if paged_dir is not None else None
        self._paged_dir: Path | None = None
        if self._pager is not None and paged_dir is not None:
            if paged_dir.exists():
                shutil.rmtree(paged_dir)
            self._paged_dir = ensure_private_dir(paged_dir)
        self._runs: dict[str, _Run] = {}
        self._recency: Recency[str] = Recency()
        self._pinned: set[str] = set()
        self.counters = PagingCounters()
        self.cold_write_failures = 0
        # resident adapter-seconds not yet collected by metering: (tenant, model_id) -> s
        self._slot_seconds: dict[tuple[str, str], float] = {}
        self._slot_lock = threading.Lock()  # the engine thread moves runs, metering collects

    def __len__(self) -> int:
        return len(self._runs)

    @property
    def pages(self) -> bool:
        """Whether slots are a cache here (else each run holds a slot for life)."""
        return self._pager is not None

    # ------------------------------------------------------------------ lookups
    def _run(self, model_id: str | None) -> _Run:
        run = self._runs.get(model_id or "")
        if run is None:
            raise UserError(
                f"model {model_id!r} is not loaded any more (its session finished or the server restarted)"
            )
        return run

    def get(self, model_id: str | None) -> LiveModel:
        """The run, resident: paged in first if it is warm or cold (which may page out another
        run, never one `hold` protects)."""
        run = self._run(model_id)
        self._recency.touch(run.model_id)
        if run.slot is not None:
            self.counters.hit()
            return run.view()
        self.counters.miss()
        self._page_in(run)
        return run.view()

    def tiers(self) -> dict[str, int]:
        """How many runs each tier holds now."""
        counts = {"hot": 0, "warm": 0, "cold": 0}
        for run in list(self._runs.values()):  # stats read it from another thread
            counts[run.tier] += 1
        return counts

    def run_tiers(self, tenant: str) -> dict[str, Tier]:
        """The tier of each of `tenant`'s live runs (the console's run list; read from
        another thread, so over a copy)."""
        return {r.model_id: r.tier for r in list(self._runs.values()) if r.tenant == tenant}

    def resident_seconds(self) -> list[tuple[str, str, float]]:
        """(tenant, model_id, seconds) each run held a trainer slot since the last call: what
        metering counts as resident adapter-seconds. Exact, not sampled: a run's slot time is
        counted as it leaves the slot (page-out, unload) and, for runs still in one, up to now,
        so a run paged in and out between two calls is counted, and one paged in just before
        a call is counted only since. Called from the metering thread."""
        now = time.monotonic()
        with self._slot_lock:
            spent, self._slot_seconds = self._slot_seconds, {}
            for run in list(self._runs.values()):
                if run.hot_since is not None:
                    key = (run.tenant, run.model_id)
                    spent[key] = spent.get(key, 0.0) + now - run.hot_since
                    run.hot_since = now
        return [(tenant, model_id, s) for (tenant, model_id), s in spent.items() if s > 0]

    def _slot_taken(self, run: _Run) -> None:
        with self._slot_lock:
            run.hot_since = time.monotonic()

    def _slot_left(self, run: _Run) -> None:
        with self._slot_lock:
            if run.hot_since is not None:
                key = (run.tenant, run.model_id)
                spent = time.monotonic() - run.hot_since
                self._slot_seconds[key] = self._slot_seconds.get(key, 0.0) + spent
                run.hot_since = None

    def paging(self) -> dict[str, Any]:
        return {
            **self.counters.as_dict(),
            "runs": self.tiers(),
            "warm_bytes_limit": self.warm_bytes,
            "cold_write_failures": self.cold_write_failures,
        }

    @contextlib.contextmanager
    def hold(self, model_ids: Iterable[str | None]) -> Iterator[None]:
        """Keeps these runs resident while a batch pages in the others (a batch never needs
        more runs than there are slots: the scheduler takes at most that many per round)."""
        added = {m for m in model_ids if m is not None} - self._pinned
        self._pinned |= added
        try:
            yield
        finally:
            self._pinned -= added

    # ------------------------------------------------------------------ slots
    def require_free_slot(self, tenant: str | None = None) -> None:
        """Makes a slot free for a new run (of `tenant`): pages one out when slots are a cache,
        else refuses."""
        if self._pager is not None and tenant is not None and self._at_quota(tenant):
            return
        if self.trainer.bank.free_slots():
            return
        if self._pager is None:
            raise UserError(
                f"all {self.max_adapters} training adapter slots of this server are in use; close another "
                "ServiceClient (its models are unloaded) or ask the operator to raise --max-adapters"
            )
        self._evict_one()

    def _at_quota(self, tenant: str) -> bool:
        """If `tenant` holds as many slots as its `resident_runs` quota allows, pages out its own
        least recently used run (idle first) and returns True. A tenant whose every resident run
        is in the running batch keeps them (the batch needs them); False then, as when under
        its quota."""
        limit = self._max_resident(tenant) if self._max_resident is not None else None
        if limit is None:
            return False
        mine = [m for m, r in self._runs.items() if r.slot is not None and r.tenant == tenant]
        if len(mine) < limit:
            return False
        return self._evict_one(among=mine, required=False)

    def _evict_one(self, among: list[str] | None = None, *, required: bool = True) -> bool:
        """Pages out the least recently used hot run (of `among`, if given) that no batch
        holds, idle runs first; True if one left. None left and `required`: ServerFault."""
        candidates = among if among is not None else list(self._runs)
        hot = [m for m in candidates if self._runs[m].slot is not None and m not in self._pinned]
        idle = [m for m in hot if self._has_work is None or not self._has_work(m)]
        victim = self._recency.oldest(idle) or self._recency.oldest(hot)
        if victim is None:
            if not required:
                return False
            raise ServerFault(
                f"every one of the {self.max_adapters} training adapter slots holds a run of the "
                "batch being run; the batch is larger than the scheduler allows (a bug); retry"
            )
        self._page_out(self._runs[victim])
        self._enforce_warm_bound()
        return True

    def _page_out(self, run: _Run) -> None:
        """Hot -> warm: the run's whole state to host memory, its slot freed."""
        assert self._pager is not None and run.slot is not None
        state = self._pager.export_slot(run.slot)
        self.trainer.free_adapter(run.slot)
        self._slot_left(run)
        self.counters.moved("hot", "warm", released=run.held, held=state.nbytes)
        run.slot, run.warm, run.held = None, state, state.nbytes

    def _enforce_warm_bound(self) -> None:
        """Past `warm_bytes`, the least recently used warm runs go cold (to disk). A run whose
        write fails stays warm (logged and counted); the bound is enforced again next time. A
        run being paged in (held) is on its way out of the tier and counts for nothing."""
        while True:
            warm = [
                m for m, r in self._runs.items() if r.warm is not None and m not in self._pinned
            ]
            if sum(self._runs[m].held for m in warm) <= self.warm_bytes:
                return
            victim = self._recency.oldest(warm)
            if victim is None:
                return
            if not self._go_cold(self._runs[victim]):
                return

    def _go_cold(self, run: _Run) -> bool:
        assert self._pager is not None and self._paged_dir is not None and run.warm is not None
        dest = self._paged_dir / run_dir_name(run.model_id)
        try:
            written = self._pager.write_slot(run.warm, dest)
        except (OSError, CheckpointError) as exc:
            self.cold_write_failures += 1
            log.warning(
                "run %s stays in host memory: writing it to disk failed (%s: %s)",
                run.model_id,
                type(exc).__name__,
                exc,
            )
            return False
        self.counters.moved("warm", "cold", released=run.held, held=written)
        run.warm, run.cold, run.held = None, dest, written
        return True

    def _page_in(self, run: _Run) -> None:
        """Warm or cold -> hot. The state is read before any other run is moved, so a state
        that cannot be read back changes nothing (that one use fails, with a server error)."""
        assert self._pager is not None
        source = run.tier
        if run.warm is not None:
            state = run.warm
        else:
            assert run.cold is not None
            try:
                state = self._pager.read_slot(run.cold)
            except (OSError, CheckpointError) as exc:
                raise ServerFault(
                    f"model {run.model_id!r}: its paged-out state could not be read back from "
                    f"disk ({type(exc).__name__}); nothing was changed"
                ) from exc
        with self.hold([run.model_id]):
            if not self._at_quota(run.tenant) and not self.trainer.bank.free_slots():
                self._evict_one()
        try:
            slot = self._pager.import_slot(state)
        except (BankError, ValueError) as exc:
            raise ServerFault(
                f"model {run.model_id!r}: its paged-out state does not fit a trainer slot "
                f"({type(exc).__name__}); it was kept where it is"
            ) from exc
        if run.cold is not None:
            shutil.rmtree(run.cold)
        held = self._slot_bytes(run.optimizer)
        self.counters.moved(source, "hot", released=run.held, held=held)
        run.slot, run.warm, run.cold, run.held = slot, None, None, held
        self._slot_taken(run)

    # ------------------------------------------------------------------ lifecycle
    def add(
        self,
        model_id: str,
        tenant: str,
        session_id: str,
        base_model: str,
        slot: int,
        lora: dict[str, Any],
        user_metadata: dict | None,
        optimizer: str = "adamw",
    ) -> None:
        """Records a model whose adapter now sits in `slot`: its row, then its live entry."""
        now = time.time()
        self.store.models.add(
            ModelRow(
                model_id=model_id,
                tenant=tenant,
                session_id=session_id,
                base_model=base_model,
                lora_rank=int(lora["rank"]),
                lora=lora,
                user_metadata=user_metadata,
                created_at=now,
                last_request_time=now,
                status="active",
            )
        )
        run = _Run(model_id, tenant, session_id, base_model, optimizer, slot=slot)
        run.held = self._slot_bytes(optimizer)
        self._slot_taken(run)
        self._runs[model_id] = run
        self._recency.touch(model_id)
        self.counters.added("hot", run.held)

    def _slot_bytes(self, optimizer: str) -> int:
        """What a hot run takes of the trainer: its fp32 weights, gradient and moment rows."""
        moments = 1 if optimizer == "dimuon" else 2
        return (2 + moments) * self.trainer.bank.row_size * 4

    def unload(self, model_ids: list[str]) -> None:
        """Frees the models' slots, host memory and disk; the caller fails what they still have
        queued."""
        for model_id in model_ids:
            run = self._runs.pop(model_id, None)
            if run is not None:
                self._recency.forget(model_id)
                self.counters.removed(run.tier, run.held)
                if run.slot is not None:
                    self.trainer.free_adapter(run.slot)
                    self._slot_left(run)
                if run.cold is not None:
                    shutil.rmtree(run.cold)
            self.store.models.set_status(model_id, "unloaded")
