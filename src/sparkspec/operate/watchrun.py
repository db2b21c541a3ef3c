"""The watchdog's loop (``sparkspec watchdog``): it reads the unit's state, /metrics and the probes,
feeds :class:`sparkspec.operate.watchdog.Watch`, and restarts the unit, under the deploy lock, when
it says so.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sparkspec import outputs
from sparkspec.errors import UserError
from sparkspec.jsonfile import loads_bounded
from sparkspec.operate import canary, memfit, scrape
from sparkspec.operate.watchdog import Config, Counters, Restarts, UnitState, Watch, parse_show
from sparkspec.validate import read_regular

PREFIX = "sparkspec watchdog:"
KEY_ENV = scrape.KEY_ENV
MAX_METRICS = scrape.MAX_METRICS  # bytes of one /metrics read
SHOW = "ActiveState,ActiveEnterTimestampMonotonic,InvocationID"
SETTLE_READS, SETTLE_S = 10, 0.5   # /metrics reads until a canary answer's tokens are counted


def say(text: str) -> None:
    print(f"{PREFIX} {text}", flush=True)


class Runner:
    """One watchdog: :meth:`step` is one round (tests pass their times), :meth:`run` the loop."""

    def __init__(self, cfg: Config, unit: str, url: str, api_key: str | None = None,
                 systemctl: scrape.Systemctl = scrape.systemctl) -> None:
        self.cfg, self.unit, self.url, self.api_key, self.systemctl = \
            cfg, unit, url.rstrip("/"), api_key, systemctl
        self.watch = Watch(cfg)
        self.restarts = Restarts(cfg, self._load_state())
        # of a /health or /metrics read: the probe's timeout, but never under 5 s (a loaded
        # host answers late)
        self.deadline = min(max(cfg.probe_timeout_s, 5.0), scrape.DEADLINE_S)
        self.http = scrape.client(self.deadline)
        self.note_last: str | None = None
        self.streak = canary.Streak(cfg.canary.streak) if cfg.canary else None
        self.canary_due = 0.0
        # a lock that cannot be made is one line now, not at the first restart
        self._open_lock().close()
        if cfg.canary is not None:   # the canary's series exist from the start, streak 0
            self._export(cfg.canary, time.time(), False)

    # --- the files --------------------------------------------------------------------------------
    def _open_lock(self) -> _Lock:
        try:
            Path(self.cfg.lock).parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            # root's alone (as deploy_lock.py makes it): flock works on a read-only descriptor,
            # so a lock others could open is one they could hold, and the watchdog would wait on
            # them for ever
            fd = os.open(self.cfg.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                         0o600)
            os.fchmod(fd, 0o600)
        except OSError as exc:
            raise UserError(f"{self.cfg.lock}: cannot open the deploy lock ({exc.strerror}); "
                            "fix 'lock' in the config") from None
        return _Lock(fd)

    def _load_state(self) -> list[float]:
        path = self.cfg.state
        if not os.path.lexists(path):
            return []
        try:
            doc = loads_bounded(read_regular(path, "watchdog state", 1 << 20))
            times = doc["restarts"] if isinstance(doc, dict) else None
            if not isinstance(times, list) or not all(
                    isinstance(t, int | float) and not isinstance(t, bool) for t in times):
                raise ValueError("'restarts' is not a list of times")
            return [float(t) for t in times]
        except (UserError, ValueError, KeyError) as exc:
            say(f"{path}: unreadable state ({exc}); counting restarts from none")
            return []

    def _save_state(self) -> None:
        body = json.dumps({"unit": self.unit, "restarts": self.restarts.times}, indent=2) + "\n"
        try:
            Path(self.cfg.state).parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            outputs.write_atomic(self.cfg.state, body.encode(), mode=0o644,
                                 flag="'state' in the config")
        except (OSError, UserError) as exc:
            say(f"{self.cfg.state}: cannot record the restart ({exc}); the cap counts from memory "
                "only")

    def note(self, text: str | None) -> None:
        """Say a state once (not every round); None forgets it so the next one is said again."""
        if text is not None and text != self.note_last:
            say(text)
        self.note_last = text

    # --- one round --------------------------------------------------------------------------------
    def step(self, now: float, wall: float) -> int | None:
        """One round at ``now`` (time.monotonic()) and ``wall`` (time.time()): the exit code when
        the watchdog stops (the cap), else None."""
        # a deploy in progress? released at once: no read happens under the lock
        if not self._lock_free():
            self._deploying()
            return None
        unit = parse_show(self.systemctl(["show", self.unit, "-p", SHOW]))
        skip = self.watch.gate(now, unit)
        if skip is not None:
            self.note(f"{self.unit} {skip}: not checking")
            return None
        reason = self._check(now) or self._canary(now, wall)
        if reason is None:
            return None
        return self._restart(reason, unit, now, wall)

    def _deploying(self) -> None:
        self.watch.reset()
        self.note(f"deploy in progress ({self.cfg.lock} is held): not checking {self.unit}")

    def _counters(self) -> Counters | None:
        try:
            sample, _ = scrape.read_metrics(self.http, self.url, self.api_key, MAX_METRICS,
                                            self.deadline)
        except UserError as exc:
            self.note(f"cannot read {self.url}/metrics ({exc}); stall and acceptance checks wait "
                      "for it")
            return None
        return Counters(sample.generation_tokens, sample.running, sample.draft_tokens,
                        sample.accepted_tokens, sample.prompt_tokens, sample.waiting,
                        sample.kv_usage)

    def _check(self, now: float) -> str | None:
        counters = self._counters()
        reason = None
        if counters is not None:
            self.note(f"watching {self.unit}")
            reason = self.watch.feed_stall(now, counters) \
                or self.watch.feed_acceptance(now, counters)
        if reason is None and self.watch.probe_due(now):
            health = scrape.healthy(self.http, self.url, self.deadline)
            error = self.probe() if health else None
            if error is not None:   # read again: what the server did while the probe waited
                counters = self._counters()
            reason = self.watch.feed_probe(now, health, error, counters)
            if error is not None and self.watch.excused is not None:
                self.note(f"a probe failed ({error}) but {self.unit} is busy "
                          f"({self.watch.excused}): not counted")
        return reason

    def _canary(self, now: float, wall: float) -> str | None:
        """Ask the canary when it is due and the server idle; record the first clean answer per
        start key, compare later ones; the reason to restart at the streak (where enabled)."""
        cfg = self.cfg.canary
        if cfg is None or self.streak is None or now < self.canary_due:
            return None
        before = self._counters()
        if before is None or before.running > 0 or before.waiting > 0:
            return None   # busy (or unread): asked at the next idle round
        self.canary_due = now + cfg.interval_s
        try:
            key, digest = canary.key_of(cfg)
            status, body = scrape.fetch(self.http, "POST", self.url + "/v1/chat/completions",
                                        self.api_key, scrape.SMALL_BODY,
                                        max(self.cfg.probe_timeout_s, 60.0),
                                        canary.request(self.cfg.model, cfg))
            if status != 200:
                raise UserError(f"HTTP {status}")
            answer, tokens = canary.answer_of(body)
        except UserError as exc:
            self.note(f"canary: not asked or not answered ({exc}); asking again in "
                      f"{cfg.interval_s:g} s")
            return None
        after = self._counters()
        for _ in range(SETTLE_READS):   # vLLM's counters can lag its answer by a step
            if after is None or after.generation - before.generation >= tokens:
                break
            time.sleep(SETTLE_S)
            after = self._counters()
        # clean: nothing but the canary generated meanwhile, nothing runs now, and no deploy
        # began (its record may name a new start key)
        if after is None or after.generation - before.generation != tokens \
                or after.running > 0 or after.waiting > 0 or not self._lock_free():
            self.note("canary: other requests or a deploy ran beside it; not counted")
            return None
        record = canary.load_record(cfg, digest)
        if record is None:
            try:
                canary.save_record(cfg, digest, key, answer)
            except (OSError, UserError) as exc:
                self.note(f"canary: cannot record its answer ({exc}); asking again later")
                return None
            say(f"canary: recorded the answer of {memfit.describe(key)}: {answer[:60]!r}")
        elif self.streak.feed(answer, record["answer"]):
            self._export(cfg, wall, True)
            why = (f"canary answer changed: {self.streak.count} answers in a row differ from the "
                   f"one recorded {record.get('recorded', '')} ({answer[:60]!r}, recorded "
                   f"{record['answer'][:60]!r})")
            if not cfg.restart:
                say(f"{why}; alerting only (restart off)")
            return why if cfg.restart else None
        elif self.streak.count:
            say(f"canary: answer {self.streak.count} of {self.streak.limit} in a row differs "
                f"from the recorded one: {answer[:60]!r}")
        self._export(cfg, wall, True)
        return None

    def _lock_free(self) -> bool:
        lock = self._open_lock()
        try:
            return lock.take()
        finally:
            lock.close()

    def _export(self, cfg: canary.CanaryConfig, wall: float, recorded: bool) -> None:
        if cfg.textfile_dir is None or self.streak is None:
            return
        try:
            outputs.write_atomic(f"{cfg.textfile_dir}/sparkspec-canary-{self.unit}.prom",
                                 canary.textfile(self.unit, self.streak, wall, recorded),
                                 mode=0o644, flag="'canary.textfile_dir' in the config")
        except (OSError, UserError) as exc:
            self.note(f"canary: cannot write its figures to {cfg.textfile_dir} ({exc}); the "
                      "alert needs the monitoring role's textfile folder")

    def probe(self) -> str | None:
        """A one-token completion within ``probe_timeout_s`` overall: None when it answered, else
        why not (a 4xx, the probe's own fault, is said and not counted)."""
        body = {"model": self.cfg.model, "prompt": "ping", "max_tokens": 1, "temperature": 0}
        url = self.url + "/v1/completions"
        try:
            status, _ = scrape.fetch(self.http, "POST", url, self.api_key, scrape.SMALL_BODY,
                                     self.cfg.probe_timeout_s, body)
        except UserError as exc:
            return str(exc).removeprefix(f"{url}: ")
        if 400 <= status < 500:
            self.note(f"the probe completion answers HTTP {status}: check 'model' in the config "
                      f"and the API key (--api-key-file or ${KEY_ENV}); probes are not counted "
                      "until it answers")
            return None
        return None if status < 400 else f"HTTP {status}"

    def _restart(self, reason: str, seen: UnitState, now: float, wall: float) -> int | None:
        """Under the deploy lock: read the unit's state again, then restart (or stop at the cap)."""
        lock = self._open_lock()
        try:
            if not lock.take():
                self._deploying()
                return None
            unit = parse_show(self.systemctl(["show", self.unit, "-p", SHOW]))
            if unit.invocation != seen.invocation or unit.active != "active":
                self.watch.reset()
                self.note(f"{self.unit} changed while it was checked (now {unit.active}, "
                          f"invocation {unit.invocation[:12] or '-'}): not restarting; checking "
                          "again")
                return None
            return self._restart_locked(reason, now, wall)
        finally:
            lock.close()

    def _restart_locked(self, reason: str, now: float, wall: float) -> int | None:
        cfg = self.cfg
        if self.restarts.capped(wall):
            say(f"{reason}; but {self.unit} was restarted {len(self.restarts.recent(wall))} times "
                f"in {cfg.restart_window_s:g} s (cap {cfg.max_restarts}): leaving {self.unit} as "
                f"it is and stopping; fix the cause and `systemctl restart {self.unit}-watchdog`")
            return 0
        self.restarts.record(wall)
        self._save_state()
        say(f"restarting {self.unit}: {reason} (restart {len(self.restarts.recent(wall))} of at "
            f"most {cfg.max_restarts} in {cfg.restart_window_s:g} s)")
        try:
            self.systemctl(["restart", self.unit])
        except UserError as exc:
            say(f"restarting {self.unit} failed: {exc}")
        self.watch.reset()
        self.watch.restarted_at = now
        if self.streak is not None and self.cfg.canary is not None:
            self.streak.count = 0   # a fresh engine, a fresh streak
            self._export(self.cfg.canary, wall, True)
        self.note_last = None
        return None

    # --- the loop ---------------------------------------------------------------------------------
    def run(self, clock: Callable[[], float] = time.monotonic,
            wall: Callable[[], float] = time.time) -> int:
        """Round after round until the cap stops it (0) or SIGTERM, SIGINT or SIGHUP do (0)."""
        stop = threading.Event()
        stopped: list[str] = []

        def on_signal(signum: int, _frame: object) -> None:
            stopped.append(signal.Signals(signum).name)
            stop.set()

        stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        before = {sig: signal.signal(sig, on_signal) for sig in stops}
        try:
            say(f"watching {self.unit} at {self.url}: grace {self.cfg.grace_s:g} s, every "
                f"{self.cfg.interval_s:g} s, cap {self.cfg.max_restarts} restarts in "
                f"{self.cfg.restart_window_s:g} s, lock {self.cfg.lock}")
            while not stop.is_set():
                begin = clock()
                code = self.step(begin, wall())
                if code is not None:
                    return code
                stop.wait(max(0.0, begin + self.cfg.interval_s - clock()))
            say(f"stopped by {stopped[0] if stopped else 'a signal'}")
            return 0
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
            self.http.close()


class _Lock:
    """The deploy lock's descriptor: :meth:`take` without waiting; :meth:`close` releases it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def take(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        os.close(self.fd)
