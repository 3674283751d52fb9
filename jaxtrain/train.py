"""The training run, top to bottom: checks -> trainer -> workdir -> state -> compiled step -> hooks -> loop -> summary.

`run(config)` is what `jaxtrain train` (jaxtrain.main) and notebooks call; it returns a summary dict. Each phase
is a function of its own below, in the order `run` calls them, so that `run` reads as the table of contents.
Everything that can be wrong with the input is found before anything compiles or the workdir is touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import checkpoint as ckpt_lib
from jaxtrain import compat, compile_cache, errors, faults, memory, objectives, rewards, rollouts, storage
from jaxtrain import config as config_lib
from jaxtrain import hooks as hooks_lib
from jaxtrain import workdir as workdir_lib
from jaxtrain.data import corpus, layout, pipeline
from jaxtrain.errors import ConfigError, HFError
from jaxtrain.models import hf, lora, sampling, transformer
from jaxtrain.observe import goodput, tracking
from jaxtrain.observe import metrics as metrics_lib
from jaxtrain.parallel import distributed
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import pipeline as pipeline_parallel
from jaxtrain.trainer import build_trainer, global_batch, make_checkpointer


_RUNS_IN_PROCESS = [0]  # a later train.run in the same process (a notebook, sweep trials) has no process start


def run(config, print_fn=print, writers=()) -> dict:
    """Trains `config` to `train.steps` (or `train.stop_at`), resuming from its workdir's checkpoints.

    `writers`: extra `metrics.MetricWriter`s (process 0 only) that receive every record metrics.jsonl gets,
    e.g. a sweep's pruning callback; an exception one raises ends the run (committed checkpoints stay)."""
    t_start, entry_t = time.perf_counter(), time.time()
    phases = goodput.Phases()  # where this (re)start's time goes, for goodput.jsonl's "phases" record
    _RUNS_IN_PROCESS[0] += 1
    first_in_process = _RUNS_IN_PROCESS[0] == 1
    compat.install()  # the dependency workarounds a run needs (jaxtrain/compat), before jax starts its backend
    config = following_init_from(config)
    resolved, data = check_inputs(config, phases)
    is_main = jax.process_index() == 0
    say = print_fn if is_main else (lambda *a, **k: None)
    trainer = build_trainer(config, resolved)  # abstract: nothing allocated or compiled yet
    describe(config, trainer, resolved, say)

    with workdir_lib.Workdir(config.workdir, is_main=is_main) as wd:
        checkpointer = make_checkpointer(config, wd.path, print_fn=say, run_id=wd.run_id(create=False))
        latest = resumable_step(config, wd, checkpointer)
        if latest >= config.train.steps:
            say(f"run already finished: checkpoint at step {latest} >= train.steps={config.train.steps}; "
                "nothing to do")
            checkpointer.close()
            return {"finished": True, "step": latest, "resumed": True}
        train_iter, eval_data = data_iterators(config, data, trainer)
        start, state = restore_or_init(config, trainer, checkpointer, latest, train_iter, say, phases)
        if not latest:  # every check of the input has passed: what this run's checkpoints will be made with
            wd.record_config(tracking.redact(config.to_dict()))
        checkpointer.run_id = wd.run_id(create=True)  # what this run's checkpoints record as theirs
        writer = metric_writer(config, wd.path, writers, is_main)
        train_step, compiled_from = compile_step(config, trainer, data.dir, resolved.objective, say, t_start, phases)
        hooks = make_hooks(config, trainer, wd.path, start, checkpointer, train_iter, eval_data, writer,
                           train_step, resolved.objective, say, is_main)
        loop = Loop(trainer, train_step, train_iter, checkpointer, hooks, lambda: fresh_state(config, trainer),
                    say, step=start)
        record = run_record(config, wd.path, start, t_start) if is_main else None
        if is_main:
            record_phases(wd.path, start, phases, time.perf_counter() - t_start, entry_t if first_in_process else None,
                          compiled_from, checkpointer.restored_from if start else None)
        try:
            state = train_loop(config, loop, state)
        finally:  # on an error: no new save (the state may be half-donated); pending saves still complete
            finish(loop, writer, record, config.train.steps)
        return summarize(config, trainer, state, start, loop.step, hooks.eval, data, wd.path, say, is_main,
                         t_start)


# ===== Input checks: everything the config names, before anything compiles or touches the workdir ===============

@dataclasses.dataclass(frozen=True)
class Data:
    """The run's data dir (prepared, or reused as it is) and its tokenizer."""
    dir: str
    tokenizer: object


def following_init_from(config):
    """`config`, or with `model.init_from` a copy of it whose architecture fields left at their defaults take the
    Hugging Face directory's values: a fine-tuning config need not repeat them. A field set to another value
    must equal the directory's, as before (ConfigError naming it, from check_inputs)."""
    if not config.model.init_from:
        return config
    try:
        theirs = hf.read_config(config.model.init_from)
    except HFError as e:
        raise ConfigError("model.init_from", str(e)) from None
    defaults = config_lib.base_config().model
    config = config.copy_and_resolve_references()
    with config.unlocked():
        for field in theirs:  # what `jaxtrain hf overrides` prints: the architecture and the family's defaults
            if field in config.model and config.model[field] == defaults[field] != theirs[field]:
                try:
                    config.model[field] = theirs[field]
                except TypeError:  # ml_collections keeps a field's type
                    raise ConfigError(f"model.{field}", f"the Hugging Face checkpoint {config.model.init_from} has "
                                      f"{theirs[field]!r}, which this field cannot hold") from None
    return config


def check_inputs(config, phases: goodput.Phases | None = None) -> tuple[config_lib.Resolved, Data]:
    """Starts the hosts, validates the config and checks every input it names (data dirs, Hugging Face
    weights and adapters, checkpoint paths, the step's memory), preparing the default corpus if it is
    missing. ConfigError (exit 2) names the first bad field or path; the workdir is not touched."""
    config_lib.validate_distributed(config)
    try:
        with phases.time("distributed_init") if phases else contextlib.nullcontext():
            distributed.initialize(**config.distributed)
    except ValueError as e:  # a partial cluster environment, named by its variable
        field, _, reason = str(e).partition(": ")
        raise ConfigError(field if reason else "distributed", reason or field) from None
    resolved = config_lib.validate(config, jax.device_count(), jax.process_count())
    memory.check_fits(config, jax.device_count(), memory.device_bytes(jax.local_devices()))
    try:  # the devices must form as many slices or nodes as the dcn sizes say
        mesh_lib.granules(jax.devices(), math.prod(resolved.dcn.values()))
    except ValueError as e:
        raise ConfigError(*str(e).split(": ", 1)) from None
    if config.model.init_from:  # the checkpoint's config.json only: its weights are read at init, after compiling
        hf.check_init_from(config.model.init_from, resolved.model)
    if config.model.init_adapters:
        hf.check_init_adapters(config.model.init_adapters, resolved.model)
    data = check_data(config, resolved)
    ckpt_lib.check_paths(ckpt_lib.directory(config.checkpoint, config.workdir), config.checkpoint.local_dir,
                         "checkpoint.dir" if config.checkpoint.dir else "workdir")
    return resolved, data


def check_data(config, resolved: config_lib.Resolved) -> Data:
    """The data dir (the default corpus prepared there if it is not yet) and every dir the config names: each
    holds what the objective trains on, its tokenizer fits the model, and chat data fits a row."""
    ddir = layout.default_dir(config.data)
    pipeline.check_data_dir(config.data)
    if not storage.is_url(ddir) and not layout.prepared_from_sources(ddir):  # else used as it is
        corpus.prepare_default_corpus(ddir, config.data.vocab_size, config.data.heldout_docs)
    tok = layout.load_tokenizer(ddir)  # exit 2 if it is not the shards' tokenizer
    if tok.vocab_size > config.model.vocab_size:
        raise ConfigError("model.vocab_size", f"{config.model.vocab_size} is smaller than the vocab "
                          f"({tok.vocab_size}) of the tokenizer in {ddir}")
    pipeline.check_extra_dirs(ddir, config.data.mixture, config.eval.sets)
    pipeline.check_conversations_fit(ddir, config.train.seq_len)
    pipeline.check_data_kind(ddir, resolved.objective.name, resolved.objective.data, objectives.by_data(),
                             config.data.mixture, config.eval.sets)
    if resolved.objective.data == "prompts":  # the rows rollouts fill, and the rewards they are scored by
        rollouts.check(config, ddir)
    if config.model.init_from:
        hf.check_tokenizer(config.model.init_from, layout.local_tokenizer_dir(ddir) if storage.is_url(ddir) else ddir)
    return Data(ddir, tok)


def describe(config, trainer, resolved: config_lib.Resolved, say) -> None:
    """One line on the mesh, the model and the devices (and one on the pipeline's schedule)."""
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.abstract_state["params"]))
    hybrid = f" (dcn {resolved.dcn})" if math.prod(resolved.dcn.values()) > 1 else ""
    axes = {a: n for a, n in trainer.mesh.shape.items() if n > 1} or {"data": 1}  # size-1 axes are noise
    say(f"mesh {axes}{hybrid} rules {config.mesh.rules!r} | model {n_params / 1e6:.2f}M params, "
        f"{trainer.model_cfg.dtype} compute | devices {jax.device_count()} x {jax.devices()[0].device_kind} | "
        f"processes {jax.process_count()}")
    if config.pipeline.stages > 1:
        p = config.pipeline
        say(f"pipeline {p.stages} stages x {p.microbatches} microbatches, {p.schedule} schedule"
            f"{f' x {p.repeats} repeats' if p.repeats > 1 else ''} | bubble "
            f"{pipeline_parallel.bubble_fraction(p.stages, p.microbatches, p.repeats, p.schedule):.1%} of each step "
            f"idle")


# ===== Workdir and state ===========================================================================================

def resumable_step(config, wd, checkpointer) -> int:
    """The newest checkpoint's step (0: none), once misplaced step dirs are set aside and the checkpoints are
    known to have been made with settings this config keeps (config.check_resumable)."""
    checkpointer.set_aside_misplaced()  # a step dir holding another step's checkpoint (moved, swapped, copied)
    latest = checkpointer.latest_step() or 0
    saved = wd.saved_config()
    if latest and saved is not None:  # what the checkpoints were made with (without one, nothing binds)
        config_lib.check_resumable(saved, config, str(wd.path))
    return latest


def data_iterators(config, data: Data, trainer):
    """(the train iterator, reported metric -> its eval batches: data.dir's held-out split, then each of
    eval.sets). One data position for all processes: see jaxtrain/data/pipeline.py. An RL objective's
    iterator is its rollouts of the current weights (jaxtrain.rollouts), which also evaluates by generating."""
    t, ddir = config.train, data.dir
    if pipeline.data_kind(ddir) == "prompts":
        pool = rewards.RewardPool(config.grpo.rewards, timeout_s=config.grpo.reward_timeout_s,
                                  workers=config.grpo.reward_workers)
        source = rollouts.RolloutSource(config, trainer, ddir, data.tokenizer, pool)
        return source, {"rollouts": source}  # its generation evals on the held-out prompts
    hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())
    train_iter = pipeline.train_iterator(ddir, seq_len=t.seq_len, global_batch=t.batch_size, seed=t.seed,
                                         mixture=config.data.mixture, num_workers=config.data.num_workers, **hosts)
    shape = dict(seq_len=t.seq_len, global_batch=t.batch_size, num_batches=config.eval.batches, **hosts)
    eval_data = {"eval_loss": pipeline.eval_batches(ddir, **shape)}
    for name, batches in pipeline.eval_set_batches(ddir, config.eval.sets, **shape).items():
        eval_data[f"eval_loss/{name}"] = batches
    return train_iter, eval_data


def fresh_state(config, trainer):
    """The state at step 0: from the seed, or from model.init_from's weights (and init_adapters' adapters)."""
    if not config.model.init_from:
        return trainer.init()
    try:
        params = hf.load_params(config.model.init_from, trainer.model_cfg)
    except HFError as e:  # a tensor missing or unreadable: the config passed, the weights did not
        raise ConfigError("model.init_from", str(e)) from None
    if config.model.init_adapters:  # PEFT adapters continue training over that base
        try:
            adapters = hf.import_adapters(config.model.init_adapters, trainer.model_cfg)
        except HFError as e:
            raise ConfigError("model.init_adapters", str(e)) from None
        dtype = np.dtype(trainer.model_cfg.param_dtype)
        params = lora.join(jax.tree.map(lambda a: a.astype(dtype), adapters), params)
    return trainer.init_from_host(params)


def restore_or_init(config, trainer, checkpointer, latest: int, train_iter, say,
                    phases: goodput.Phases | None = None):
    """(start step, state): the newest checkpoint that verifies, with the data position it saved, or a fresh
    state at step 0. `phases` times the restore and the data iterator's."""
    timed = phases.time if phases else lambda name: contextlib.nullcontext()
    restored = None
    if latest:
        with timed("restore"):
            restored = checkpointer.restore_latest(trainer.abstract_state)
            jax.block_until_ready(restored and restored[1])
    if restored:
        start, state, data_state = restored
        with timed("data_restore"):
            changed = train_iter.set_state(data_state, allow_changed=config.data.allow_changed)
        if changed:
            say(f"data.allow_changed: {changed}; going on from the same position in it")
        say(f"resumed from checkpoint at step {start}")
        if train_iter.get_state()["order"] == pipeline.LEGACY_ORDER:
            say("data: this checkpoint's position predates the block order; it keeps its materialised "
                "per-epoch permutation (8-24 bytes per document in host memory), a new workdir gets the block "
                "order (docs/data.md)")
        return start, state
    if config.model.init_from:
        say(f"initialized from the Hugging Face checkpoint {config.model.init_from}"
            + (f" with the adapters of {config.model.init_adapters}" if config.model.init_adapters else ""))
    return 0, fresh_state(config, trainer)


# ===== Writers, the compiled step and the hooks =================================================================

def metric_writer(config, workdir, writers, is_main: bool):
    """Process 0's writers (metrics.jsonl, TensorBoard, the configured trackers, `writers`); a no-op elsewhere."""
    if not is_main:
        return metrics_lib.MetricWriter()
    writer = metrics_lib.MultiWriter([metrics_lib.JsonlWriter(workdir / "metrics.jsonl"),
                                      metrics_lib.TensorBoardWriter(workdir / "tensorboard"),
                                      *metrics_lib.tracker_writers(config.log, workdir), *writers])
    writer.write_hparams(tracking.redact(config.to_dict()))
    return writer


def compile_step(config, trainer, ddir: str, objective, say, t_start: float, phases: goodput.Phases | None = None):
    """(the train step compiled ahead of time for the data's batches, so the first step is a step, not a
    compile; "cache", "untraced", "compiled" or None: where the executable came from, see compile_cache.source)."""
    t = time.perf_counter()
    before = compile_cache.counts()
    keys = pipeline.batch_keys(ddir) if objective.data != "prompts" else (
        "tokens", "positions", "segment_ids", *objective.batch_keys)
    abstract_batch = {k: jax.ShapeDtypeStruct((config.train.batch_size, config.train.seq_len),
                                              jnp.float32 if k in objective.float_keys else jnp.int32,
                                              sharding=trainer.batch_sharding)
                      for k in keys}
    # The config and the resolved model decide the traced step besides the code and its arguments.
    key = (config.to_json_best_effort(sort_keys=True), repr(trainer.model_cfg))
    train_step = compile_cache.compile(trainer.train_step, trainer.abstract_state, abstract_batch, key=key)
    compiled_from = compile_cache.source(before, compile_cache.counts())
    if phases:
        phases.seconds["compile"] = time.perf_counter() - t
    say(f"compiled train step in {time.perf_counter() - t:.1f}s (startup {time.perf_counter() - t_start:.1f}s"
        f"{'; from the compile cache' if compiled_from in ('cache', 'untraced') else ''}"
        f"{', untraced' if compiled_from == 'untraced' else ''})")
    return train_step, compiled_from


def record_phases(workdir, start: int, phases: goodput.Phases, run_s: float, entry_t: float | None,
                  compiled_from: str | None, restored_from: dict | None) -> None:
    """goodput.jsonl's "phases" record of this start (process 0): the phases timed in `run` (`run_s` so far),
    the rest of `run` as setup, and those before it (goodput.start_phases) if `entry_t`, the unix time `run`
    began, is the process's first."""
    path = workdir / "goodput.jsonl"
    seconds = {**(goodput.start_phases(entry_t, path) if entry_t is not None else {}), **phases.seconds}
    seconds["setup"] = max(0.0, run_s - sum(phases.seconds.values()))
    goodput.GoodputRecorder(path).phases(
        start, {k: seconds[k] for k in goodput.PHASES if k in seconds}, compile=compiled_from,
        restore_tier=restored_from["tier"] if restored_from else None)


def evaluate(trainer, state, eval_data: dict) -> dict:
    """{"eval_loss": ..., "eval_loss/<set>": ...} for eval_data's batches, plus the held-out split's other
    metrics (DPO's: "eval_dpo/accuracy", ...)."""
    out = {}
    for metric, batches in eval_data.items():
        if isinstance(batches, rollouts.RolloutSource):
            out.update(batches.evaluate(state["params"], int(jax.device_get(state["step"]))))
            continue
        means = trainer.eval_metrics(state["params"], batches, state.get("reference"))
        out[metric] = means.pop("loss")
        if metric == "eval_loss":
            out.update({f"eval_{k}": v for k, v in means.items()})
    return out


def make_hooks(config, trainer, workdir, start: int, checkpointer, train_iter, eval_data, writer, train_step,
               objective, say, is_main: bool) -> hooks_lib.RunHooks:
    """hooks.build with what only the run knows: the model's FLOPs and the device's peak (for MFU), how to
    evaluate, and the objective's metrics for the progress line."""
    peak, peak_source = metrics_lib.peak_flops(dtype=trainer.model_cfg.dtype)
    flops_per_token = transformer.train_flops_per_token(trainer.model_cfg, config.train.seq_len)
    say(f"peak {peak / 1e9:,.0f} GFLOP/s ({peak_source}); {flops_per_token / 1e6:.1f} MFLOP per token")
    progress = {name: (m.scale, m.progress) for name, m in objective.metrics.items() if m.progress}
    return hooks_lib.build(config, workdir=workdir, start_step=start, checkpointer=checkpointer,
                           data_iterator=train_iter, evaluate=lambda state: evaluate(trainer, state, eval_data),
                           writer=writer, flops_per_token=flops_per_token, peak_flops=peak,
                           hlo_text=train_step.as_text, progress=progress, print_fn=say, is_main=is_main)


def run_record(config, workdir, start: int, t_start: float) -> tracking.RunRecord:
    """run.json (process 0): what ran, where, with which code; `finish` writes how it ended."""
    record = tracking.RunRecord(workdir, config.to_dict(), processes=jax.process_count(), seed=config.train.seed,
                                devices={"platform": jax.devices()[0].platform, "count": jax.device_count(),
                                         "kind": jax.devices()[0].device_kind})
    record.start(start, started_unix=time.time() - (time.perf_counter() - t_start))
    return record


# ===== The loop ===================================================================================================

@dataclasses.dataclass
class Loop:
    """What the loop runs: the compiled step, the data it feeds, the checkpoints and hooks it tells. `fresh_state()`
    is the state a rollback with no checkpoint returns to; `step` is the last step done, kept as the loop goes."""
    trainer: object
    train_step: object
    train_iter: object
    checkpointer: ckpt_lib.Checkpointer
    hooks: hooks_lib.RunHooks
    fresh_state: object
    say: object
    step: int = 0


def train_loop(config, loop: Loop, state):
    """The state after training steps loop.step+1.. to train.stop_at or train.steps, the hooks after each, and
    their end; an eval first at step 0 (eval.at_start). Ctrl-C raises errors.Interrupted, naming the step a rerun
    resumes from, once any save in flight has completed."""
    t = config.train
    if loop.step == 0 and config.eval.at_start:
        loop.hooks.eval.run(0, state)
    last = min(t.stop_at or t.steps, t.steps)
    loop.say(f"training steps {loop.step + 1}..{last} of {t.steps}, {t.batch_size} x {t.seq_len} tokens per step")
    # The first step of an invocation waits for every process to restore and compile: it gets the time
    # jax.distributed gives processes to meet, if that is longer.
    loop.hooks.watchdog.start(first_step_s=config.distributed.timeout_s if jax.process_count() > 1 else None)
    interrupt = faults.InterruptBetweenSteps()
    try:
        state = steps(loop, state, last, interrupt)
        for hook in loop.hooks.all:
            hook.end(loop.step, state)
    except KeyboardInterrupt:
        # A save in flight completes (the interrupt may even have hit inside one): the directories then say
        # what a rerun resumes from.
        with contextlib.suppress(Exception):
            loop.checkpointer.wait()
        raise errors.Interrupted(loop.step, loop.checkpointer.latest_step(reread=True) or 0) from None
    finally:
        interrupt.close()
    return state


def steps(loop: Loop, state, last: int, interrupt):
    """The state after steps loop.step+1..last, at most two in flight, with the rollback to the newest good
    checkpoint (or the fresh state) when the non-finite guard asks for one."""
    previous = None
    while loop.step < last:
        first = loop.step + 1  # after a rollback: the step after the restored checkpoint
        try:
            for step in range(first, last + 1):
                loop.step = step
                if isinstance(loop.train_iter, rollouts.RolloutSource):  # rollouts wait for the weights they
                    jax.block_until_ready(state["params"])  # sample with: that wait is the step's, not data's
                t = time.perf_counter()
                local, host_metrics = next_batch(loop.train_iter, state, step)
                loop.hooks.clock.data_wait_s += time.perf_counter() - t
                batch = global_batch(local, loop.trainer.batch_sharding)
                with loop.hooks.clock.waiting():  # for the device and the peers (a synchronous dispatch waits here)
                    state, metrics = loop.train_step(state, batch)
                    # At most two steps in flight: enough to overlap host work with the device, and it bounds the
                    # queue (hundreds of queued collectives time out XLA's CPU rendezvous on fake devices).
                    jax.block_until_ready(previous)
                metrics = {**metrics, **host_metrics}
                previous = metrics
                for hook in loop.hooks.all:
                    hook(step, state, metrics, local)
                interrupt.check()
            loop.hooks.nan_guard.check()  # the last step's flag, before anything is saved at the end
        except hooks_lib.Rollback as rollback:
            # Back to the newest good checkpoint (or the init), with the data after the bad step.
            data_state = loop.train_iter.get_state()
            loop.hooks.checkpoint.wait()  # a save still in flight is the newest good checkpoint
            restored = loop.checkpointer.restore_latest(loop.trainer.abstract_state)
            loop.step, state = restored[:2] if restored else (0, loop.fresh_state())
            loop.train_iter.set_state(data_state)
            for hook in loop.hooks.all:
                hook.rewind(loop.step)
            loop.say(f"{rollback}: rolled back to step {loop.step}, skipping the batches up to step {rollback.step}")
    return state


def next_batch(source, state, step: int) -> tuple[dict, dict]:
    """(the step's process-local batch, host metrics): the data's next, or an RL objective's rollouts of the
    current weights, sampled before the step takes (donates) them."""
    if isinstance(source, rollouts.RolloutSource):
        return source.batch(state["params"], step)
    return next(source), {}


def finish(loop: Loop, writer, record, total_steps: int) -> None:
    """The loop's teardown, whatever ended it: the watchdog and signal handlers stop, the writers and the data
    iterator close, pending saves complete, and run.json records the end. A failed save surfacing here is raised
    unless another error is already in flight (that one is the one to report)."""
    loop.hooks.close()
    writer.close()
    loop.train_iter.close()  # its prefetch thread or data.num_workers processes
    error = sys.exc_info()[1]
    close_error = None
    try:
        loop.checkpointer.close()
    except ckpt_lib.CheckpointError as e:
        close_error = e
    if record:
        failure = error or close_error
        record.end(tracking.status_of(failure, loop.step >= total_steps), loop.step, failure)
    if close_error and not error:
        raise close_error


# ===== Summary ====================================================================================================

def summarize(config, trainer, state, start: int, step: int, eval_hook, data: Data, workdir, say, is_main: bool,
              t_start: float) -> dict:
    """The end of a run: a sample of text (sample.max_new_tokens), the goodput over every invocation, and the
    summary (summary.json on process 0; returned, with the final state under "state" for notebooks and tests)."""
    text = ""
    if config.sample.max_new_tokens:
        ids = sampling.sample(trainer.graphdef, state["params"], data.tokenizer.encode(config.sample.prompt),
                               window=config.train.seq_len, max_new_tokens=config.sample.max_new_tokens,
                               temperature=config.sample.temperature, top_k=config.sample.top_k,
                               seed=config.train.seed, stop_id=data.tokenizer.eos_id)
        text = config.sample.prompt + data.tokenizer.decode(ids)
        say(f"sample: {text}")
    evals = eval_hook.history
    # One digest of every array in the state (sharding-independent): equal digests = bit-identical runs.
    state_checksum = hashlib.sha256(json.dumps(ckpt_lib.checksums(state), sort_keys=True).encode()).hexdigest()[:16]
    summary = {"finished": step >= config.train.steps, "step": step, "resumed": bool(start), "eval": evals,
               "eval_sets": eval_hook.set_history, "wall_s": time.perf_counter() - t_start, "data_dir": data.dir,
               "sample": text, "state_checksum": state_checksum}
    if is_main:
        records = goodput.read_records(workdir / "goodput.jsonl")
        if records:  # over every invocation of this workdir, from the first one's start
            summary["goodput"] = goodput.goodput(records, time.time() - records[0]["t"])
            say(f"goodput {100 * summary['goodput']['goodput']:.1f}% over {len(summary['goodput']['attempts'])} "
                f"attempt(s), {summary['goodput']['steps_lost']} step(s) recomputed")
        (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    # Not part of summary.json. The stacked layers are in the order the run kept them (a circular pipeline's:
    # stage-major); pipeline_parallel.reorder_layers(params, order, None) gives the model's.
    summary["state"] = state
    say(f"done: {step} steps in {summary['wall_s']:.0f}s" +
        (f", eval_loss {evals[0][1]:.3f} -> {evals[-1][1]:.3f}" if evals else ""))
    return summary
