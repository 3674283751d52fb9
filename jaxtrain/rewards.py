r"""Verifiable rewards for GRPO: the reward functions a config names, and the worker pool that calls them.

A reward is `f(completion, **fields) -> float`: the completion first, positionally, then the prompt record's fields
(`prompt` plus whatever the prompts JSONL row carries, e.g. `answer`) by name. It declares the fields it needs
(`def exact_match(completion, answer)`) or takes **fields for all of them. The config names rewards in one string,
comma-separated "module:function[@weight]" entries (weight 1 if omitted; the module is a dotted name importable
from sys.path, not a file path): "jaxtrain.rewards:math_equal,jaxtrain.rewards:format_regex@0.2". A parametrised
reward is one line in the user's module, e.g. `boxed = rewards.regex_reward(r".*\\boxed\{.+\}")`, named
"mymodule:boxed". `check_config` checks the entries before the run (ConfigError naming `grpo.rewards[i]`).
`RewardPool` makes every call in a worker process under a per-call timeout: a call that raises, returns no finite
number or times out (its worker is killed and replaced) scores 0, is counted, and is logged once per (function,
prompt id). Workers are `python -c` subprocesses that live across calls: not multiprocessing's fork (JAX is
multithreaded) nor its spawn (which re-imports the trainer's entry module in every worker).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import signal
import socket
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection, wait

import numpy as np

from jaxtrain.errors import ConfigError
from jaxtrain.fields import Group

DEFAULT_TIMEOUT_S = 10.0  # math-verify's own defaults were 5 s to parse plus 5 s to compare
DEFAULT_WORKERS = min(8, os.cpu_count() or 1)
START_TIMEOUT_S = 120.0  # a worker's imports (math-verify pulls in sympy: about 1 s)
# Keys for the `grpo` config group (checked by `check_group`): `rewards` as above, and the pool's settings.
CONFIG = dict(rewards="jaxtrain.rewards:math_equal", reward_timeout_s=DEFAULT_TIMEOUT_S,
              reward_workers=DEFAULT_WORKERS)


# ===== Built-in rewards ==============================================================================================

def math_equal(completion: str, answer) -> float:
    """1.0 if math-verify judges the completion's final answer equal to `answer`, else 0.0. The completion goes
    through math-verify's default extraction (LaTeX, then plain expressions: a \\boxed{} first, else an anchor such
    as "answer:" or "####", else the last expression); `answer` too, read as `_gold_text` says. Its signal-based
    timeouts are off: they raise outside a main thread, and RewardPool's per-call timeout bounds the call instead.
    Raises ValueError on an `answer` math-verify cannot parse (bad data: counted and logged, not silently 0)."""
    from math_verify import parse, verify

    gold = parse(_gold_text(answer), parsing_timeout=None)
    if not gold:
        raise ValueError(f"math-verify cannot parse the answer {str(answer)[:80]!r}")
    return float(verify(gold, parse(completion, parsing_timeout=None), timeout_seconds=None))


def _gold_text(answer) -> str:
    """The reference answer as math-verify should read it. GSM8K's solutions end "#### 18": the answer follows.
    A bare answer ("\\frac12", "5\\sqrt{2}") is boxed: math-verify reads undelimited LaTeX as plain text, and
    takes the "5" of "5\\sqrt{2}". A solution with its own delimiters ($, \\(, \\[, \\boxed) is left as it is."""
    text = str(answer).rpartition("####")[2].strip() if "####" in str(answer) else str(answer).strip()
    return text if any(d in text for d in ("$", "\\(", "\\[", "\\boxed")) else f"\\boxed{{{text}}}"


# Modules a reward imports lazily -> what to pip install: `check` requires them, workers import them at start-up
# (so that the import does not count against the first call's timeout).
math_equal.requires = {"math_verify": "jaxtrain[rewards]"}

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def exact_match(completion: str, answer) -> float:
    """1.0 if the completion's answer equals str(answer), both stripped of surrounding whitespace, else 0.0. The
    completion's answer is the text of its last <answer>...</answer> (the format `format_regex` rewards) if it has
    one, else the whole completion."""
    tagged = _ANSWER_TAG.findall(completion)
    return float((tagged[-1] if tagged else completion).strip() == str(answer).strip())


# DeepSeek-R1's (and open-r1's format reward's) layout: reasoning in <think>, then the answer in <answer>.
R1_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"


def regex_reward(pattern: str, flags: int = re.DOTALL):
    """A reward: 1.0 if the whole completion, stripped of surrounding whitespace, matches `pattern` (re.fullmatch,
    `flags`; by default `.` matches newlines too), else 0.0. The pattern compiles now: a bad one fails at import."""
    compiled = re.compile(pattern, flags)

    def reward(completion: str) -> float:
        return float(compiled.fullmatch(completion.strip()) is not None)

    reward.__qualname__ = reward.__name__ = f"regex_reward({pattern!r})"
    return reward


format_regex = regex_reward(R1_FORMAT)


# ===== Config: names to checked functions ============================================================================

@dataclasses.dataclass(frozen=True)
class Reward:
    """One checked entry. `takes`: the fields passed by name (None: all of them, for **fields); `required`: those
    without a default."""
    spec: str  # "module:function"
    weight: float
    fn: object
    takes: tuple[str, ...] | None
    required: tuple[str, ...]
    completion: str  # the first parameter's name: a record field of that name is not passed

    @property
    def name(self) -> str:
        return self.spec.partition(":")[2]

    def fields(self, record: dict) -> dict:
        """The record's fields this function takes."""
        if self.takes is None:
            return {k: v for k, v in record.items() if k != self.completion}
        return {k: record[k] for k in self.takes if k in record}


def entries(value, field: str = "grpo.rewards") -> list[str]:
    """The config value (a comma-separated string, or a list of entries from a Python config) -> its entries."""
    if isinstance(value, str):
        items = [s.strip() for s in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        items = [s.strip() for s in value]
    else:
        raise ConfigError(field, f"must be a string of module:function[@weight] entries, got {value!r}")
    if items in ([], [""]):
        raise ConfigError(field, "names no reward; give module:function[@weight] entries, comma-separated")
    for i, item in enumerate(items):
        if not item:
            raise ConfigError(f"{field}[{i}]", f"empty entry in {value!r}")
    return items


def check_config(value, field_names=None, field: str = "grpo.rewards") -> list[Reward]:
    """Every entry of the config value, checked by `check` (ConfigError naming `field[i]`). `field_names`: the
    prompt file's fields (None: not known yet, so not checked)."""
    return [check(item, field_names, f"{field}[{i}]") for i, item in enumerate(entries(value, field))]


def check_group(d, group: str = "grpo", field_names=None) -> list[Reward]:
    """The CONFIG keys of a config group: the pool's settings, then its rewards (`check_config`)."""
    g = Group(d, group)
    g.number("reward_timeout_s", lo=0, lo_open=True)
    g.positive_int("reward_workers")
    return check_config(d["rewards"], field_names, g.field("rewards"))


def check(entry: str, field_names=None, field: str = "grpo.rewards") -> Reward:
    """"module:function[@weight]" -> its Reward, or ConfigError(field, reason): the module does not import, has no
    such function, the function is not callable, its signature does not take (completion, **fields), or (with the
    prompt file's `field_names`) it requires a field the prompts do not have."""
    spec, at, weight_text = entry.strip().partition("@")
    module, _, name = spec.partition(":")
    if not re.fullmatch(r"[A-Za-z_][\w.]*", module) or not re.fullmatch(r"[A-Za-z_][\w.]*", name):
        raise ConfigError(field, f"{entry!r}: expected module:function[@weight], with a dotted module name")
    weight = 1.0
    if at:
        try:
            weight = float(weight_text)
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight):
            raise ConfigError(field, f"{entry!r}: the weight {weight_text!r} is not a finite number")
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and (module == e.name or module.startswith(e.name + ".")):
            raise ConfigError(field, f"{spec}: no module named {module!r} on sys.path (a dotted module name, "
                              f"not a file path)") from None
        raise ConfigError(field, f"{spec}: importing {module} failed: {_summary(e)}") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed as it imported: one line, not a traceback
        raise ConfigError(field, f"{spec}: importing {module} failed: {_summary(e)}") from None
    try:
        fn = _load(spec)
    except AttributeError:
        raise ConfigError(field, f"{spec}: module {module} has no function {name!r}") from None
    if not callable(fn):
        raise ConfigError(field, f"{spec} is a {type(fn).__name__}, not a function")
    for mod, install in getattr(fn, "requires", {}).items():
        if importlib.util.find_spec(mod) is None:
            raise ConfigError(field, f"{spec} needs {mod}, which is not installed: pip install '{install}'")
    takes, required, completion = _signature(fn, spec, field)
    if field_names is not None:
        missing = [p for p in required if p not in field_names]
        if missing:
            raise ConfigError(field, f"{spec} requires the field {missing[0]!r}, which the prompts lack (they have "
                              f"{', '.join(sorted(field_names))})")
    return Reward(spec, weight, fn, takes, required, completion)


def _signature(fn, spec: str, field: str):
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise ConfigError(field, f"{spec}: cannot read its signature; wrap it in a Python function") from None
    P = inspect.Parameter
    if not params or params[0].kind not in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.VAR_POSITIONAL):
        raise ConfigError(field, f"{spec}: must take the completion as its first positional argument: "
                          f"f(completion, **fields)")
    first, rest = params[0], params[1:]  # first may be *args: the completion is args[0]
    for p in rest:
        if p.kind == P.POSITIONAL_ONLY and p.default is P.empty:
            raise ConfigError(field, f"{spec}: its parameter {p.name!r} is positional-only; fields are passed by "
                              f"name: f(completion, **fields)")
    named = [p for p in rest if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    required = tuple(p.name for p in named if p.default is P.empty)
    takes = None if any(p.kind == P.VAR_KEYWORD for p in rest) else tuple(p.name for p in named)
    return takes, required, first.name


def _load(spec: str):
    module, _, name = spec.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _summary(e: BaseException) -> str:
    """An exception in one line of at most 200 characters."""
    text = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    return line if len(line) <= 200 else line[:197] + "..."


# ===== The worker pool ===============================================================================================

@dataclasses.dataclass(frozen=True)
class Scores:
    """One `RewardPool.score` call's results, in row order. A failed call scores 0 in `per_function`."""
    total: np.ndarray  # [N] float32: sum over functions of weight * per_function
    per_function: np.ndarray  # [N, F] float32, columns in the pool's order (`RewardPool.names`)
    raised: np.ndarray  # [F] int64: calls that raised, returned no finite number, or whose worker died
    timed_out: np.ndarray  # [F] int64: calls killed at the per-call timeout
    failures: dict  # name -> raised + timed out, per function


class RewardPool:
    """`workers` processes scoring completions with `rewards` (a config value for `check_config`, or its Rewards),
    each call under `timeout_s`. Workers start now, so that their imports overlap the trainer's start-up, and live
    until `close()` (or the end of a `with` block). `log(line)` reports a failure once per (function, prompt id);
    default: stderr. `names`: the functions' names for metrics (the module too where two share a name);
    `raised` / `timed_out`: the counts over the pool's life, per function."""

    def __init__(self, rewards, timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = DEFAULT_WORKERS, log=None):
        if isinstance(rewards, (list, tuple)) and rewards and all(isinstance(r, Reward) for r in rewards):
            self.rewards = list(rewards)
        else:
            self.rewards = check_config(rewards)
        if not timeout_s > 0 or not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"need timeout_s > 0 and workers >= 1, got {timeout_s!r} and {workers!r}")
        self.timeout_s, self.log = float(timeout_s), log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.weights = np.array([r.weight for r in self.rewards], np.float32)
        self.raised = np.zeros(len(self.rewards), np.int64)
        self.timed_out = np.zeros(len(self.rewards), np.int64)
        self._logged: set = set()
        self._specs = [r.spec for r in self.rewards]
        short = [r.name for r in self.rewards]
        self.names = [n if short.count(n) == 1 else s.replace(":", ".") for n, s in zip(short, self._specs)]
        self._requires = sorted({m for r in self.rewards for m in getattr(r.fn, "requires", {})})
        self._procs: list = []  # shared with the finalizer, which kills what is left at exit
        self._workers = [self._start() for _ in range(workers)]
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _start(self) -> _Worker:
        worker = _Worker(self._specs, self._requires)
        self._procs.append(worker.proc)
        return worker

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._procs.remove(worker.proc)
        self._workers[self._workers.index(worker)] = self._start()

    def score(self, completions, records, ids) -> Scores:
        """Scores[N]: every reward of every completion; `records[i]` is completion i's prompt record (its fields)
        and `ids[i]` its prompt id (for the failure log). Blocks until every call returned, failed or timed out."""
        n, f = len(completions), len(self.rewards)
        if not len(records) == len(ids) == n:
            raise ValueError(f"{n} completions, {len(records)} records and {len(ids)} ids: need one of each per row")
        if self._workers is None:
            raise RuntimeError("the reward pool is closed")
        values = np.zeros((n, f), np.float32)
        raised, timed_out = np.zeros(f, np.int64), np.zeros(f, np.int64)

        def failed(row, j, counts, what):
            counts[j] += 1
            prompt = ids[row].item() if isinstance(ids[row], np.generic) else ids[row]
            if (j, prompt) not in self._logged:
                self._logged.add((j, prompt))
                self.log(f"reward {self._specs[j]} {what} on prompt {prompt!r}: scored 0 (logged once per prompt)")

        todo = collections.deque((row, j) for row in range(n) for j in range(f))
        try:
            while True:
                for w in self._workers:
                    while w.state == "idle" and todo:
                        row, j = todo.popleft()
                        if not w.call(row, j, completions[row], self.rewards[j].fields(records[row]), self.timeout_s):
                            todo.appendleft((row, j))  # it died while idle: the call never ran
                            self._replace(w)
                            break
                waiting = [w for w in self._workers if w.state != "idle"]
                if not todo and not any(w.state == "busy" for w in waiting):
                    break
                ready = wait([w.conn for w in waiting], max(0.0, min(w.deadline for w in waiting) - time.monotonic()))
                for w in waiting:
                    if w.conn in ready:
                        task, (ok, value) = w.task, w.receive()
                        if task is None and not ok:  # it never started: the same would happen to its replacement
                            raise RuntimeError(f"a reward worker failed to start: {value}")
                        if task is not None and ok:
                            values[task] = value
                        elif task is not None:
                            failed(*task, raised, f"failed ({value})")
                        if w.state == "dead":
                            self._replace(w)
                    elif w.deadline <= time.monotonic():
                        if w.state == "starting":
                            raise RuntimeError(f"a reward worker did not start within {START_TIMEOUT_S:g} s")
                        row, j = w.task
                        failed(row, j, timed_out, f"timed out after {self.timeout_s:g} s")
                        self._replace(w)
        finally:  # an exception (Ctrl-C) left calls in flight: their results must not reach the next score
            for w in list(self._workers):
                if w.state in ("busy", "dead"):
                    self._replace(w)
        self.raised += raised
        self.timed_out += timed_out
        return Scores(values @ self.weights, values, raised, timed_out,
                      {name: int(r + t) for name, r, t in zip(self.names, raised, timed_out)})

    def close(self) -> None:
        """Stops the workers (an idle one exits on its own; a busy one is killed). Idempotent."""
        if self._workers is None:
            return
        for w in self._workers:
            if w.state == "busy":
                w.kill()
            else:
                w.stop()
        for w in self._workers:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.kill()
            w.conn.close()
        self._procs.clear()
        self._workers = None


# The worker's first lines: it reads the parent's sys.path before importing anything of ours or the user's.
_BOOT = ("import sys\nfrom multiprocessing.connection import Connection\nc = Connection(int(sys.argv[1]))\n"
         "sys.path[:] = c.recv()\nfrom jaxtrain.rewards import _serve\n_serve(c)\n")


class _Worker:
    """One worker process and the parent's end of its socket. state: starting -> idle <-> busy, or dead."""

    def __init__(self, specs, requires):
        ours, theirs = socket.socketpair()
        with theirs:
            # stdout and stderr are the trainer's: a reward's prints land in its log.
            self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        self.conn = Connection(ours.detach())
        self.conn.send(list(sys.path))
        self.conn.send((specs, requires))
        self.state, self.task, self.deadline = "starting", None, time.monotonic() + START_TIMEOUT_S

    def call(self, row, j, completion, fields, timeout_s) -> bool:
        try:
            self.conn.send((j, completion, fields))
        except OSError:
            self.state = "dead"
            return False
        self.state, self.task, self.deadline = "busy", (row, j), time.monotonic() + timeout_s
        return True

    def receive(self):
        """The next message, (ok, value or why): the start-up's outcome or the call's; (False, why) if it died."""
        try:
            (ok, value), died = self.conn.recv(), False
        except (EOFError, OSError):
            ok, value, died = False, f"its worker process died (exit code {self.proc.wait()})", True
        # A call that failed leaves its worker idle; a start that failed, or a death, leaves it dead.
        self.state = "dead" if died or (self.state == "starting" and not ok) else "idle"
        self.task = None
        return ok, value

    def stop(self):
        try:
            self.conn.send(None)
        except OSError:
            pass

    def kill(self):
        self.proc.kill()  # SIGKILL: a hung reward may be in C code, or ignore SIGTERM
        self.proc.wait()
        self.conn.close()
        self.state = "dead"


def _kill_all(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _serve(conn) -> None:
    """The worker's loop: import the rewards, then answer (index, completion, fields) with (True, value) or
    (False, one-line reason), until None or the parent's end closes."""
    # Ctrl-C and SIGTERM reach the whole process group; the trainer handles them and closes the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    specs, requires = conn.recv()
    try:
        fns = [_load(spec) for spec in specs]
        for mod in requires:
            importlib.import_module(mod)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send((False, _summary(e)))
        return
    if "math_verify" in sys.modules:  # its warning that its own timeouts are off: this pool times every call
        import logging

        logging.getLogger("math_verify").setLevel(logging.ERROR)
    conn.send((True, None))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the trainer is gone
            return
        if message is None:
            return
        j, completion, fields = message
        try:
            value = fns[j](completion, **fields)
            if not isinstance(value, numbers.Real):
                raise TypeError(f"returned {type(value).__name__}, not a number")
            if not math.isfinite(value := float(value)):
                raise ValueError(f"returned {value}")
            reply = (True, value)
        except BaseException as e:  # noqa: BLE001 - SystemExit too: one call's failure, scored 0 by the parent
            reply = (False, _summary(e))
        conn.send(reply)
