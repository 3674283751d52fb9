"""`prepare --runner`: the shard jobs on an Apache Beam pipeline instead of local worker processes.

Each job is the same pure function of its plan (prepare._build_shard), so the shards, their indexes and the
manifest are byte-identical to the multiprocess path's. A worker writes its shard and its `.done.json`
record into the work dir; the driver reads the records back once the pipeline has finished, as a resumed run
does. So the work dir, and the inputs, must be paths every Beam worker can open: DirectRunner here, or Flink
and Spark workers over a shared file system. `pip install 'jaxtrain[beam]'`.
"""

from __future__ import annotations

import shlex

from jaxtrain.errors import DataError


def pipeline(runner: str, options: str = ""):
    """A Beam pipeline on `runner` with extra pipeline `options` ("--flag=value ..."); DataError if Beam is
    missing or refuses them (prepare calls this first, before any work)."""
    try:  # its import-time warning about GCP clients is filtered by the prepare command (jaxtrain.compat.beam)
        import apache_beam as beam
        from apache_beam.options.pipeline_options import PipelineOptions
    except ImportError:
        raise DataError(f"--runner {runner}: needs Apache Beam (pip install 'jaxtrain[beam]')") from None
    try:
        return beam.Pipeline(options=PipelineOptions([f"--runner={runner}", *shlex.split(options)]))
    except (ValueError, SystemExit) as e:  # an unknown runner, or options Beam's own parser refuses
        raise DataError(f"--runner {runner} --beam_options {options!r}: {e}") from None


def run(jobs: list, build, runner: str, options: str = "") -> None:
    """Runs build(job) for every job on Beam's `runner`."""
    import apache_beam as beam

    with pipeline(runner, options) as p:
        # Reshuffle: each shard its own work item, not one bundle for all of them.
        _ = p | "shards" >> beam.Create(jobs) | beam.Reshuffle() | "build" >> beam.Map(build)
