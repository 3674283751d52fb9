"""`jaxtrain plan --config configs/X.py [--devices N] [--backend cpu|gpu|tpu] [--device_kind KIND]
[--compiler auto|cpu|gpu] [--peak_tflops T] [--mfu F] [--json PATH] [--hlo PATH] [--config.a.b=v ...]`

The command: it compiles the train step for N devices without training and prints the report (docs/planning.md).
N fake CPU devices need `XLA_FLAGS=--xla_force_host_platform_device_count=N` before jax is imported, so this
module imports nothing that imports jax: `--devices` is read from the raw arguments and the environment set
first, then absl parses the flags (the config file imports jax) and the planner runs.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
from pathlib import Path

from jaxtrain import errors, files
from jaxtrain.errors import ConfigError, PlanError
from jaxtrain.main import flag_value
from jaxtrain.tools import common
from jaxtrain.tools.plan import topology as gpu_topology
from jaxtrain.tools.plan.planner import plan
from jaxtrain.tools.plan.report import format_report


# Fake CPU devices one host simulates: each has its own runtime state, and past a few thousand jax takes minutes
# and gigabytes just to start them. Described GPUs (--compiler gpu) cost nothing until compiled.
MAX_FAKE_DEVICES = 4096


def _prescan_devices(argv: list[str]) -> int | None:
    """--devices before absl parses the flags (which imports jax through the config file)."""
    value = flag_value(argv, "devices")
    if value is not None:
        try:
            n = int(value)
        except ValueError:
            raise PlanError(f"devices: must be an integer >= 1, got {value!r}") from None
        if n < 1:
            raise PlanError(f"devices: must be an integer >= 1, got {n}")
        if n > MAX_FAKE_DEVICES and flag_value(argv, "compiler") != "gpu":
            raise PlanError(f"devices: {n} fake CPU devices is more than one host can simulate (at most "
                            f"{MAX_FAKE_DEVICES}); plan a slice of the mesh, or use --compiler gpu")
        return n
    return None


# What the CUDA plugin's C++ code logs on a host with no driver, before absl's logging is set up (so no setting
# silences it): the compile for described GPUs works all the same.
PLUGIN_NOISE = ("cudart_stub.cc", "All log messages before absl::InitializeLog() is called")


def _drop_plugin_noise() -> None:
    """Routes fd 2 through a `grep -v` of PLUGIN_NOISE for the rest of the process. A child process filters, so
    that what a crash writes last still gets through; at exit fd 2 is restored and the child drained."""
    import atexit  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    grep = shutil.which("grep")
    if grep is None:
        return
    sys.stderr.flush()
    original = os.dup(2)
    patterns = [arg for line in PLUGIN_NOISE for arg in ("-e", line)]
    child = subprocess.Popen([grep, "-v", "--line-buffered", "-F", *patterns], stdin=subprocess.PIPE,
                             stdout=original, stderr=original)
    os.dup2(child.stdin.fileno(), 2)
    child.stdin.close()  # fd 2 is now the pipe's only write end

    def restore():
        sys.stderr.flush()
        os.dup2(original, 2)  # closes that write end: the child forwards what is left and exits
        child.wait(timeout=30)

    atexit.register(restore)


def _force_host_devices(n: int) -> None:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _plan(config, devices: int | None, FLAGS) -> int:  # noqa: N803 - absl's flag values
    if config is None:
        raise ConfigError("--config", "required (e.g. --config configs/bench_cpu.py)")
    from jaxtrain.parallel import mesh as mesh_lib  # noqa: PLC0415

    for flag in ("json", "hlo"):  # before the compile, which can take minutes
        if FLAGS[flag].value:
            if Path(FLAGS[flag].value).is_dir():
                raise ConfigError(f"--{flag}", f"{FLAGS[flag].value}: is a directory; give the file to write")
            files.make_dir(Path(FLAGS[flag].value).parent, f"--{flag}")
    n = devices
    if n is None:
        sizes = [config.mesh[a] for a in mesh_lib.AXES]
        n = math.prod(sizes) if all(isinstance(x, int) and x > 0 for x in sizes) else 1
        _force_host_devices(n)  # jax is imported, but its CPU backend has not started yet
    import jax  # noqa: PLC0415
    backend = FLAGS.backend or {"cuda": "gpu", "rocm": "gpu"}.get(jax.default_backend(), jax.default_backend())
    compiler = FLAGS.compiler
    if compiler == "auto":
        compiler = "gpu" if backend == "gpu" and gpu_topology.available() else "cpu"
    result = plan(config, n, backend, device_kind=FLAGS.device_kind, mfu=FLAGS.mfu,
                  peak_flops=FLAGS.peak_tflops * 1e12 if FLAGS.peak_tflops else None, hlo_path=FLAGS.hlo,
                  compiler=compiler, force=FLAGS.force)
    print(format_report(result))
    if FLAGS.json:
        Path(FLAGS.json).write_text(json.dumps(result, indent=1, default=str))
        print(f"json: {FLAGS.json}")
    return 0


def main(argv: list[str] | None = None) -> None:
    """`jaxtrain plan ...`: `argv` without the program name (default: sys.argv[1:]); exits."""
    argv = ["jaxtrain plan", *(sys.argv[1:] if argv is None else argv)]
    try:
        devices = _prescan_devices(argv)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(errors.EXIT_BAD_INPUT)
    if devices is not None:
        _force_host_devices(devices)  # before jax is imported (the config file imports it)
    if flag_value(argv, "compiler") == "gpu":
        gpu_topology.use_bundled()  # before jax starts its backends, which is when it loads plugins
    if "gpu" in (flag_value(argv, "compiler"), flag_value(argv, "backend")):
        _drop_plugin_noise()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # a GPU host: don't grab its memory
    # A CPU host with the CUDA plugin (for --compiler gpu) has no driver: skip jax's check of its CUDA libraries.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

    from absl import app, flags, logging  # noqa: PLC0415

    from jaxtrain import main as main_cli  # noqa: PLC0415 (defines --config)

    flags.DEFINE_integer("devices", None, "Devices to plan for (fake CPU devices). Default: the mesh's "
                         "product when no axis is -1, else 1.")
    flags.DEFINE_string("backend", None, "Target platform for dtypes and peak: cpu, gpu or tpu "
                        "(default: this machine's).")
    flags.DEFINE_string("device_kind", None, "Target device for the peak FLOP/s and memory, e.g. H100, "
                        "'TPU v5p' (default: H100 on gpu, TPU v5p on tpu, the measured machine on cpu).")
    flags.DEFINE_enum("compiler", "auto", ["auto", "cpu", "gpu"], "Which XLA compiles the step: cpu (fake CPU "
                      "devices), gpu (XLA:GPU for described GPUs of --device_kind, no GPU needed: the CUDA PJRT plugin "
                      "must be installed, BUILD.md), auto (gpu for --backend gpu when the plugin is installed).")
    flags.DEFINE_float("peak_tflops", None, "Peak TFLOP/s per device, overriding --device_kind's.")
    flags.DEFINE_float("mfu", 0.5, "Model FLOPs utilisation for the ideal step time.")
    flags.DEFINE_string("json", None, "Also write the figures as JSON to this path.")
    flags.DEFINE_string("hlo", None, "Also write the compiled HLO text to this path.")
    flags.DEFINE_boolean("force", False, "Compile even when the step cannot fit the target devices' memory "
                         "(the floor a run checks: docs/planning.md).")
    FLAGS = flags.FLAGS

    def run(argv_rest):
        del argv_rest
        if not FLAGS["verbosity"].present:
            logging.set_verbosity(logging.WARNING)
        sys.exit(common.run(lambda _: _plan(main_cli.CONFIG_FLAG.value, devices, FLAGS)))

    app.run(run, argv=argv, flags_parser=functools.partial(main_cli.parse_flags, doc=__doc__,
                                                           modules=(__name__, main_cli.__name__)))
