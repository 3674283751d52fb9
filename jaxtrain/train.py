"""The training run, top to bottom: config -> data -> mesh -> state -> compiled step -> loop -> sample.

`run(config)` is what `python -m jaxtrain.main` and notebooks call. It returns a summary dict.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain import checkpoint as ckpt_lib
from jaxtrain import config as config_lib
from jaxtrain import errors, faults, host_memory, storage
from jaxtrain import hooks as hooks_lib
from jaxtrain import workdir as workdir_lib
from jaxtrain.data import layout, pipeline, prepare
from jaxtrain.errors import ConfigError, HFError
from jaxtrain.models import hf, lora, sampling, transformer
from jaxtrain.observe import goodput, tracking
from jaxtrain.observe import metrics as metrics_lib
from jaxtrain.observe import profiling
from jaxtrain.parallel import distributed
from jaxtrain.parallel import mesh as mesh_lib
from jaxtrain.parallel import pipeline as pipeline_parallel
from jaxtrain.trainer import build_trainer, global_batch, make_checkpointer


def evaluate(trainer, state, eval_data: dict) -> dict:
    """{"eval_loss": ..., "eval_loss/<set>": ...} for eval_data's batches, plus the held-out split's other
    metrics (DPO's: "eval_dpo/accuracy", ...)."""
    out = {}
    for metric, batches in eval_data.items():
        means = trainer.eval_metrics(state["params"], batches, state.get("reference"))
        out[metric] = means.pop("loss")
        if metric == "eval_loss":
            out.update({f"eval_{k}": v for k, v in means.items()})
    return out


def run(config, print_fn=print, writers=()) -> dict:
    """Trains `config` to `train.steps` (or `train.stop_at`), resuming from its workdir's checkpoints.

    `writers`: extra `metrics.MetricWriter`s (process 0 only) that receive every record metrics.jsonl gets,
    e.g. a sweep's pruning callback; an exception one raises ends the run (committed checkpoints stay)."""
    t_start = time.perf_counter()
    # ===== Config and hosts: validated before anything compiles or touches the workdir ================
    host_memory.keep_freed_memory()  # CPU runs; before jax starts its backend (jaxtrain/host_memory.py)
    config_lib.validate_distributed(config)
    try:
        distributed.initialize(**config.distributed)
    except ValueError as e:  # a partial cluster environment, named by its variable
        field, _, reason = str(e).partition(": ")
        raise ConfigError(field if reason else "distributed", reason or field) from None
    facts = config_lib.validate(config, jax.device_count(), jax.process_count())
    config_lib.check_backend(config, jax.default_backend())
    config_lib.check_fits(config, jax.device_count(), host_memory.device_bytes(jax.local_devices()))
    mesh_shape, rules, dcn = facts["mesh_shape"], facts["rules"], facts["dcn"]
    try:  # the devices must form as many slices or nodes as the dcn sizes say
        mesh_lib.granules(jax.devices(), math.prod(dcn.values()))
    except ValueError as e:
        raise ConfigError(*str(e).split(": ", 1)) from None
    train_cfg = config.train
    is_main = jax.process_index() == 0
    say = print_fn if is_main else (lambda *a, **k: None)

    # ===== Data: prepared (or reused) before the workdir is created ====================================
    ddir = layout.default_dir(config.data)
    if not storage.is_url(ddir) and not layout.prepared_from_sources(ddir):  # else used as it is
        prepare.prepare_default_corpus(ddir, config.data.vocab_size, config.data.heldout_docs)
    tok = layout.load_tokenizer(ddir)  # exit 2 if it is not the shards' tokenizer
    if tok.vocab_size > config.model.vocab_size:
        raise ConfigError("model.vocab_size", f"{config.model.vocab_size} is smaller than the vocab "
                          f"({tok.vocab_size}) of the tokenizer in {ddir}")
    pipeline.check_extra_dirs(ddir, config.data.mixture, config.eval.sets)  # exit 2 before the workdir exists
    pipeline.check_conversations_fit(ddir, train_cfg.seq_len)
    pipeline.check_objective(ddir, train_cfg.objective, config.data.mixture, config.eval.sets)
    if config.model.init_from:
        hf.check_tokenizer(config.model.init_from, layout.local_tokenizer_dir(ddir) if storage.is_url(ddir) else ddir)
    ckpt_lib.check_paths(ckpt_lib.directory(config.checkpoint, config.workdir), config.checkpoint.local_dir,
                         "checkpoint.dir" if config.checkpoint.dir else "workdir")

    # ===== Workdir: one run at a time (jaxtrain/workdir.py); a finished run is left exactly as it is =======
    with workdir_lib.Workdir(config.workdir, is_main=is_main) as wd:
        workdir = wd.path
        checkpointer = make_checkpointer(config, workdir, print_fn=say, run_id=wd.run_id(create=False))
        checkpointer.set_aside_misplaced()  # a step dir holding another step's checkpoint (moved, swapped, copied)
        latest = checkpointer.latest_step() or 0
        saved = wd.saved_config()
        if latest and saved is not None:  # what the checkpoints were made with (without one, nothing binds)
            config_lib.check_resumable(saved, config, str(workdir))
        if latest >= train_cfg.steps:
            say(f"run already finished: checkpoint at step {latest} >= train.steps={train_cfg.steps}; nothing to do")
            checkpointer.close()
            return {"finished": True, "step": latest, "resumed": True}

        # ===== Mesh, model, optimizer, jitted steps =======================================================
        trainer = build_trainer(config, mesh_shape, rules, dcn=dcn)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.abstract_state["params"]))
        hybrid = f" (dcn {dcn})" if math.prod(dcn.values()) > 1 else ""
        axes = {a: n for a, n in trainer.mesh.shape.items() if n > 1} or {"data": 1}  # size-1 axes are noise
        say(f"mesh {axes}{hybrid} rules {config.mesh.rules!r} | model {n_params / 1e6:.2f}M params, "
            f"{trainer.model_cfg.dtype} compute | devices {jax.device_count()} x {jax.devices()[0].device_kind} | "
            f"processes {jax.process_count()}")
        if config.pipeline.stages > 1:
            p = config.pipeline
            say(f"pipeline {p.stages} stages x {p.microbatches} microbatches, {p.schedule} schedule"
                f"{f' x {p.repeats} repeats' if p.schedule == 'circular' else ''} | bubble "
                f"{pipeline_parallel.bubble_fraction(p.stages, p.microbatches, p.repeats):.1%} of each step idle")

        # ===== Data iterators (one position for all processes: see jaxtrain/data/pipeline.py) ==============
        hosts = dict(process_index=jax.process_index(), process_count=jax.process_count())
        train_iter = pipeline.train_iterator(ddir, seq_len=train_cfg.seq_len, global_batch=train_cfg.batch_size,
                                             seed=train_cfg.seed, mixture=config.data.mixture,
                                             num_workers=config.data.num_workers, **hosts)
        # Reported metric -> its eval batches: data.dir's held-out split, then each of eval.sets.
        eval_shape = dict(seq_len=train_cfg.seq_len, global_batch=train_cfg.batch_size, num_batches=config.eval.batches,
                          **hosts)
        eval_data = {"eval_loss": pipeline.eval_batches(ddir, **eval_shape)}
        for name, batches in pipeline.eval_set_batches(ddir, config.eval.sets, **eval_shape).items():
            eval_data[f"eval_loss/{name}"] = batches

        # ===== State: the newest checkpoint that verifies, or a fresh init =================================
        def fresh_state():  # from the seed, or from model.init_from's weights
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

        restored = checkpointer.restore_latest(trainer.abstract_state) if latest else None
        if restored:
            start, state, data_state = restored
            train_iter.set_state(data_state)
            say(f"resumed from checkpoint at step {start}")
            if train_iter.get_state()["order"] == pipeline.LEGACY_ORDER:
                say("data: this checkpoint's position predates the block order; it keeps its materialised "
                    "per-epoch permutation (8-24 bytes per document in host memory), a new workdir gets the block "
                    "order (docs/data.md)")
        else:
            start, state = 0, fresh_state()
            if config.model.init_from:
                say(f"initialized from the Hugging Face checkpoint {config.model.init_from}"
                    + (f" with the adapters of {config.model.init_adapters}" if config.model.init_adapters else ""))
        if not latest:  # every check of the input has passed: what this run's checkpoints will be made with
            wd.record_config(tracking.redact(config.to_dict()))
        checkpointer.run_id = wd.run_id(create=True)  # what this run's checkpoints record as theirs

        # ===== Metric writers ==============================================================================
        if is_main:
            writer = metrics_lib.MultiWriter([metrics_lib.JsonlWriter(workdir / "metrics.jsonl"),
                                              metrics_lib.TensorBoardWriter(workdir / "tensorboard"),
                                              *metrics_lib.tracker_writers(config.log, workdir), *writers])
            writer.write_hparams(tracking.redact(config.to_dict()))
        else:
            writer = metrics_lib.MetricWriter()

        # ===== Compile the train step ahead of time (the first step is then a step, not a compile) =======
        t = time.perf_counter()
        abstract_batch = {k: jax.ShapeDtypeStruct((train_cfg.batch_size, train_cfg.seq_len), jnp.int32,
                                                  sharding=trainer.batch_sharding)
                          for k in pipeline.batch_keys(ddir)}
        train_step = trainer.train_step.lower(trainer.abstract_state, abstract_batch).compile()
        say(f"compiled train step in {time.perf_counter() - t:.1f}s (startup {time.perf_counter() - t_start:.1f}s)")

        # ===== Hooks =======================================================================================
        watchdog = faults.Watchdog(config.faults.step_timeout_s)
        clock = hooks_lib.Clock(on_pause=watchdog.paused)
        peak, peak_source = metrics_lib.peak_flops(dtype=trainer.model_cfg.dtype)
        flops_per_token = transformer.train_flops_per_token(trainer.model_cfg, train_cfg.seq_len)
        say(f"peak {peak / 1e9:,.0f} GFLOP/s ({peak_source}); {flops_per_token / 1e6:.1f} MFLOP per token")
        recorder = goodput.GoodputRecorder(workdir / "goodput.jsonl") if is_main else None

        def on_checkpoint(step):
            nan_guard.checkpoint_committed()
            if recorder:
                recorder.checkpoint(step)

        nan_guard = hooks_lib.NonFiniteGuard(config.faults.nan_policy, print_fn=say)
        log_hook = hooks_lib.LogHook(every=config.log.every_steps, total_steps=train_cfg.steps, start_step=start,
                                     tokens_per_step=train_cfg.batch_size * train_cfg.seq_len,
                                     flops_per_token=flops_per_token, peak_flops=peak, writer=writer, clock=clock,
                                     print_fn=say)
        eval_hook = hooks_lib.EvalHook(every=config.eval.every_steps, total_steps=train_cfg.steps,
                                       evaluate=lambda state: evaluate(trainer, state, eval_data),
                                       writer=writer, clock=clock, print_fn=say,
                                       # A resumed run's summary keeps the evals before it (from process 0's log).
                                       earlier=metrics_lib.earlier_evals(workdir, start) if is_main and start else ())
        ckpt_hook = hooks_lib.CheckpointHook(checkpointer=checkpointer, data_iterator=train_iter, clock=clock,
                                             start_step=start, on_write_error=config.checkpoint.on_write_error,
                                             print_fn=say, on_commit=on_checkpoint)
        preemption = faults.PreemptionGuard(grace_s=config.faults.preempt_grace_s)
        hooks = [nan_guard, log_hook, eval_hook, ckpt_hook,
                 hooks_lib.PreemptionHook(preemption, ckpt_hook, print_fn=say), hooks_lib.WatchdogHook(watchdog)]
        if is_main:
            hooks.append(hooks_lib.GoodputHook(recorder, every=config.log.every_steps, clock=clock, start_step=start))
        if profiled := profiling.parse_steps(config.log.profile_steps):
            hooks.append(hooks_lib.ProfileHook(*profiled, workdir / "profile", start_step=start, print_fn=say,
                                               hlo_text=train_step.as_text if is_main else None))
        if config.log.fingerprints:
            hooks.append(hooks_lib.FingerprintHook(workdir / f"data_fingerprints.{jax.process_index()}.jsonl",
                                                   pipeline.tokens_per_batch_fingerprint))

        # ===== Train =======================================================================================
        if start == 0 and config.eval.at_start:
            eval_hook.run(0, state)
        last = min(train_cfg.stop_at or train_cfg.steps, train_cfg.steps)
        say(f"training steps {start + 1}..{last} of {train_cfg.steps}, "
            f"{train_cfg.batch_size} x {train_cfg.seq_len} tokens per step")
        step, previous = start, None
        record = None
        if is_main:  # run.json: what ran, where, with which code; its end is written whatever happens next
            record = tracking.RunRecord(workdir, config.to_dict(), processes=jax.process_count(), seed=train_cfg.seed,
                                        devices={"platform": jax.devices()[0].platform, "count": jax.device_count(),
                                                 "kind": jax.devices()[0].device_kind})
            record.start(start, started_unix=time.time() - (time.perf_counter() - t_start))
        watchdog.start()
        interrupt = faults.InterruptBetweenSteps()
        try:
            while step < last:
                first = step + 1  # after a rollback: the step after the restored checkpoint
                try:
                    for step in range(first, last + 1):
                        t = time.perf_counter()
                        local = next(train_iter)
                        clock.data_wait_s += time.perf_counter() - t
                        state, metrics = train_step(state, global_batch(local, trainer.batch_sharding))
                        # At most two steps in flight: enough to overlap host work with the device, and it bounds
                        # the queue (hundreds of queued collectives time out XLA's CPU rendezvous on fake devices).
                        jax.block_until_ready(previous)
                        previous = metrics
                        for hook in hooks:
                            hook(step, state, metrics, local)
                        interrupt.check()
                    nan_guard.check()  # the last step's flag, before anything is saved at the end
                except hooks_lib.Rollback as rollback:
                    # Back to the newest good checkpoint (or the init), with the data after the bad step.
                    data_state = train_iter.get_state()
                    ckpt_hook.wait()  # a save still in flight is the newest good checkpoint
                    restored = checkpointer.restore_latest(trainer.abstract_state)
                    step, state = restored[:2] if restored else (0, fresh_state())
                    train_iter.set_state(data_state)
                    for hook in hooks:
                        hook.rewind(step)
                    say(f"{rollback}: rolled back to step {step}, skipping the batches up to step {rollback.step}")
            for hook in hooks:
                hook.end(step, state)
        except KeyboardInterrupt:
            # A save in flight completes (the interrupt may even have hit inside one): the directories then say
            # what a rerun resumes from.
            with contextlib.suppress(Exception):
                checkpointer.wait()
            raise errors.Interrupted(step, checkpointer.latest_step(reread=True) or 0) from None
        finally:  # on an error: no new save (the state may be half-donated); pending saves still complete
            interrupt.close()
            watchdog.stop()
            preemption.close()
            writer.close()
            train_iter.close()  # its prefetch thread or data.num_workers processes
            error = sys.exc_info()[1]
            close_error = None
            try:
                checkpointer.close()
            except ckpt_lib.CheckpointError as e:
                close_error = e
            if record:
                failure = error or close_error
                record.end(tracking.status_of(failure, step >= train_cfg.steps), step, failure)
            if close_error and not error:  # otherwise the error already in flight is the one to report
                raise close_error

        # ===== Sample ======================================================================================
        text = ""
        if config.sample.max_new_tokens:
            ids = sampling.sample(trainer.graphdef, state["params"], tok.encode(config.sample.prompt),
                                   window=train_cfg.seq_len, max_new_tokens=config.sample.max_new_tokens,
                                   temperature=config.sample.temperature, top_k=config.sample.top_k,
                                   seed=train_cfg.seed, stop_id=tok.eos_id)
            text = config.sample.prompt + tok.decode(ids)
            say(f"sample: {text}")

        evals = eval_hook.history
        # One digest of every array in the state (sharding-independent): equal digests = bit-identical runs.
        state_checksum = hashlib.sha256(json.dumps(ckpt_lib.checksums(state), sort_keys=True).encode()).hexdigest()[:16]
        summary = {"finished": step >= train_cfg.steps, "step": step, "resumed": bool(start), "eval": evals,
                   "eval_sets": eval_hook.set_history,
                   "wall_s": time.perf_counter() - t_start, "data_dir": ddir, "sample": text,
                   "state_checksum": state_checksum}
        if is_main:
            records = goodput.read_records(workdir / "goodput.jsonl")
            if records:  # over every invocation of this workdir, from the first one's start
                summary["goodput"] = goodput.goodput(records, time.time() - records[0]["t"])
                say(f"goodput {100 * summary['goodput']['goodput']:.1f}% over {len(summary['goodput']['attempts'])} "
                    f"attempt(s), {summary['goodput']['steps_lost']} step(s) recomputed")
            (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
        # For notebooks and tests; not part of summary.json. The stacked layers are in the order the run kept them
        # (a circular pipeline's: stage-major); pipeline_parallel.reorder_layers(params, order, None) gives the model's.
        summary["state"] = state
        say(f"done: {step} steps in {summary['wall_s']:.0f}s" +
            (f", eval_loss {evals[0][1]:.3f} -> {evals[-1][1]:.3f}" if evals else ""))
        return summary
