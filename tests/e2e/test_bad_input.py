"""Bad input, run as a user runs it: one `error: <field or path>: <reason>` line on stderr (no traceback), the
documented exit code, and nothing the user had is changed. Each case is a finding of issue 28."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import init_params, tree_digest
from jaxtrain import train

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each case is a process that imports jax

CONFIG_FILES = {
    "syntax_error": ("def get_config(:\n", "SyntaxError"),
    "get_config_raises": ("def get_config():\n    raise RuntimeError('boom')\n", "get_config() raised RuntimeError: boom"),
    "wrong_type": ("def get_config():\n    return 3\n", "get_config() returned int, not a ConfigDict"),
    "no_get_config": ("x = 1\n", "no get_config() function"),
}


def jaxtrain(*args, timeout=300, **popen):
    return subprocess.run([sys.executable, "-m", "jaxtrain", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False, **popen)


def assert_one_line(proc, rc: int, *needles):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == rc, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for needle in needles:
        assert str(needle) in lines[0], lines[0]
    return lines[0]


def tiny_args(config):
    """The tiny config as command-line overrides of configs/tiny.py."""
    return [f"--config.workdir={config.workdir}", f"--config.data.dir={config.data.dir}",
            f"--config.train.steps={config.train.steps}"]


@pytest.fixture(scope="module")
def trained(tiny_config, tmp_path_factory):
    """A 12-step tiny run stopped at 10 (checkpoints at 5 and 10), to copy. 12 steps: the schedule of the reruns
    below that train on to 12, so that they find its compiled step in the compilation cache."""
    config = tiny_config(tmp_path_factory.mktemp("trained") / "run", **{"train.steps": 12, "train.stop_at": 10})
    train.run(config, print_fn=lambda *a, **k: None)
    return config


def copy_of(trained, tmp_path) -> Path:
    workdir = tmp_path / "run"
    shutil.copytree(trained.workdir, workdir)
    return workdir


@pytest.mark.parametrize("case", [*CONFIG_FILES, "directory", "missing"])
@pytest.mark.parametrize("command", ["train", "sweep"])
def test_a_config_file_that_does_not_load_is_one_line_naming_it(command, case, tmp_path):
    path = tmp_path / "cfg.py"
    if case in CONFIG_FILES:
        path.write_text(CONFIG_FILES[case][0])
    elif case == "directory":
        path = tmp_path
    extra = ["--sweep", "configs/sweeps/lr_grid.py", "--sweep_dir", tmp_path / "sweep"] if command == "sweep" else []
    proc = jaxtrain(command, "--config", path, f"--config.workdir={tmp_path / 'run'}", *extra)
    reason = CONFIG_FILES.get(case, (None, {"directory": "is a directory", "missing": "file not found"}.get(case)))[1]
    assert_one_line(proc, 2, "--config", path, reason)
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("case", ["checkpoints_is_a_file", "local_dir_is_a_file", "local_dir_is_the_checkpoints"])
def test_checkpoint_paths_are_checked_before_the_workdir_exists(case, tiny_config, tmp_path):
    config = tiny_config(tmp_path / "run")
    (tmp_path / "a_file").write_text("mine\n")
    args = tiny_args(config)
    if case == "checkpoints_is_a_file":
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "checkpoints").write_text("mine\n")
        field = "checkpoints"
    else:
        local = tmp_path / "a_file" if case == "local_dir_is_a_file" else tmp_path / "run" / "checkpoints"
        args += [f"--config.checkpoint.local_dir={local}", "--config.checkpoint.local_every_steps=2"]
        field = "checkpoint.local_dir"
    before = tree_digest(tmp_path)
    assert_one_line(jaxtrain("train", "--config", "configs/tiny.py", *args), 2, field)
    assert tree_digest(tmp_path) == before
    assert (tmp_path / "run").exists() == (case == "checkpoints_is_a_file")


@pytest.mark.parametrize("case", ["workdir_is_a_file", "parent_is_a_file"])
def test_a_workdir_path_through_a_file_is_named(case, tiny_config, tmp_path):
    (tmp_path / "a_file").write_text("mine\n")
    config = tiny_config(tmp_path / "a_file" if case == "workdir_is_a_file" else tmp_path / "a_file" / "run")
    proc = jaxtrain("train", "--config", "configs/tiny.py", *tiny_args(config))
    assert_one_line(proc, 2, "workdir", f"{tmp_path / 'a_file'} is a file")
    assert sorted(os.listdir(tmp_path)) == ["a_file"] and (tmp_path / "a_file").read_text() == "mine\n"


def test_a_workdir_that_cannot_be_written_is_named(tiny_config, tmp_path):
    """A directory without write permission, or for root (whom no permission bit stops) sysfs, which refuses any
    new directory: one line naming the workdir, and nothing created."""
    parent = Path("/sys") if os.geteuid() == 0 else tmp_path / "read_only"
    if parent != Path("/sys"):
        parent.mkdir()
        parent.chmod(0o500)
    config = tiny_config(parent / "jaxtrain_test_run")
    proc = jaxtrain("train", "--config", "configs/tiny.py", *tiny_args(config))
    assert_one_line(proc, 2, f"workdir: {parent / 'jaxtrain_test_run'}: cannot write")
    assert not (parent / "jaxtrain_test_run").exists()


def test_supervise_over_a_run_with_a_bad_config_stops_at_its_one_line(tmp_path):
    """The supervisor used to crash writing supervisor.json into a workdir its child never created."""
    workdir = tmp_path / "run"
    proc = jaxtrain("supervise", "--workdir", workdir, "--", sys.executable, "-m", "jaxtrain.main", "--config",
                    "configs/tiny.py", f"--config.workdir={workdir}", "--config.optim.lr=-1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == ["error: optim.lr: must be > 0, got -1.0"]
    assert "attempt 1 exited 2: bad config or input" in proc.stdout
    assert json.loads((workdir / "supervisor.json").read_text())["exit_code"] == 2


def test_a_damaged_config_json_is_named_and_the_workdir_kept(trained, tmp_path):
    workdir = copy_of(trained, tmp_path)
    (workdir / "config.json").write_text("garbage{")
    before = tree_digest(workdir)
    proc = jaxtrain("train", "--config", "configs/tiny.py", *tiny_args(trained), f"--config.workdir={workdir}",
                    "--config.train.steps=12")
    assert_one_line(proc, 2, workdir / "config.json", "unreadable")
    assert tree_digest(workdir) == before
    assert_one_line(jaxtrain("generate", "--workdir", workdir, "--prompt", "In"), 2, workdir / "config.json")


def test_garbage_in_goodput_jsonl_is_skipped_and_the_run_finishes(trained, tmp_path):
    """Lines that are JSON but not goodput records used to crash the run after training, with no summary.json."""
    workdir = copy_of(trained, tmp_path)
    with open(workdir / "goodput.jsonl", "a") as f:
        f.write('42\n[]\n{}\n"x"\n{"event": "step", "step": "7", "t": 1}\n{"event": "start", "step": 1}\ngarbage{\n')
    proc = jaxtrain("train", "--config", "configs/tiny.py", *tiny_args(trained), f"--config.workdir={workdir}",
                    "--config.train.steps=12")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["step"] == 12 and len(summary["goodput"]["attempts"]) == 2


def test_a_resume_on_other_documents_is_refused_unless_meant(trained, tmp_path):
    """A data dir prepared again with other content (here: its train shards in another order) used to resume
    silently at the saved token offset into different documents (issue 53). With data.allow_changed it resumes
    and says so."""
    workdir, data = copy_of(trained, tmp_path), tmp_path / "data"
    shutil.copytree(trained.data.dir, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["splits"]["train"].reverse()
    (data / "manifest.json").write_text(json.dumps(manifest))
    before = tree_digest(workdir)
    args = ["train", "--config", "configs/tiny.py", *tiny_args(trained), f"--config.workdir={workdir}",
            "--config.train.steps=12", f"--config.data.dir={data}"]
    assert_one_line(jaxtrain(*args), 2, "data.dir: the train data", "holds other documents", "allow_changed")
    assert tree_digest(workdir) == before
    proc = jaxtrain(*args, "--config.data.allow_changed=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data.allow_changed: the train data" in proc.stdout and "resumed from checkpoint at step 10" in proc.stdout
    assert json.loads((workdir / "summary.json").read_text())["step"] == 12


def test_every_checkpoint_damaged_is_one_line_and_nothing_deleted(trained, tmp_path):
    """Orbax's suspended reads of a failed restore used to print their tracebacks after our line."""
    workdir = copy_of(trained, tmp_path)
    for shard in (workdir / "checkpoints").glob("*/state/ocdbt.process_0/d/*"):
        damaged = bytearray(shard.read_bytes())
        damaged[::50] = bytes(b ^ 0xFF for b in damaged[::50])
        shard.write_bytes(damaged)
    proc = jaxtrain("train", "--config", "configs/tiny.py", *tiny_args(trained), f"--config.workdir={workdir}",
                    "--config.train.steps=12")
    assert_one_line(proc, 4, "none of the 2 checkpoints could be restored", "moved aside, not deleted")
    assert sorted(p.name.split(".")[0] for p in (workdir / "checkpoints").glob("*.corrupt-*")) == ["10", "5"]


def test_a_damaged_data_shard_is_named_with_the_fix(tiny_config, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_config().data.dir, data)
    manifest = json.loads((data / "manifest.json").read_text())
    shard = data / manifest["splits"]["train"][1]["file"]
    damaged = bytearray(shard.read_bytes())
    for i in range(1000, len(damaged), 997):
        damaged[i] ^= 0xFF
    shard.write_bytes(damaged)
    config = tiny_config(tmp_path / "run")
    proc = jaxtrain("train", "--config", "configs/tiny.py", *tiny_args(config), f"--config.data.dir={data}")
    assert_one_line(proc, 2, shard, "damaged", "prepare")
    assert not (tmp_path / "run").exists()


def test_peft_adapters_jaxtrain_cannot_compute_are_one_line_before_the_workdir(tmp_path):
    """An rsLoRA adapter (issue 53): PEFT scales it by alpha / sqrt(r); trained with alpha / r it was another model,
    silently. The run exits 2 naming the field, and nothing is created or changed."""
    from jaxtrain.models import hf, lora  # noqa: PLC0415
    from jaxtrain.models.config import ModelConfig  # noqa: PLC0415

    sizes = dict(vocab_size=512, d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8, d_ff=64,
                 tie_embeddings=False)
    cfg = ModelConfig(**sizes, lora_rank=4, lora_alpha=8.0)
    params = init_params(cfg)
    hf.export(lora.split(params)[1], ModelConfig(**sizes), tmp_path / "base")
    adapters = hf.export_adapters(params, cfg, tmp_path / "adapters")
    config = json.loads((adapters / hf.ADAPTER_CONFIG).read_text())
    (adapters / hf.ADAPTER_CONFIG).write_text(json.dumps({**config, "use_rslora": True}))
    before = tree_digest(tmp_path)
    proc = jaxtrain("train", "--config", "configs/tiny.py", f"--config.workdir={tmp_path / 'run'}",
                    "--config.model.tie_embeddings=False", "--config.model.lora_rank=4", "--config.model.lora_alpha=8.0",
                    f"--config.model.init_from={tmp_path / 'base'}", f"--config.model.init_adapters={adapters}")
    assert_one_line(proc, 2, "model.init_adapters", "use_rslora is True")
    assert not (tmp_path / "run").exists() and tree_digest(tmp_path) == before


def test_generate_without_a_checkpoint_is_one_line(trained, tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    shutil.copy(Path(trained.workdir) / "config.json", workdir)
    assert_one_line(jaxtrain("generate", "--workdir", workdir, "--prompt", "In"), 2, "no checkpoint")


def test_generate_refuses_more_samples_than_memory_holds(trained):
    """A billion samples used to end in an allocation traceback: their K/V cache is checked against the device."""
    proc = jaxtrain("generate", "--workdir", trained.workdir, "--prompt", "In", "--num_samples", 10**9)
    assert_one_line(proc, 2, "--num_samples: 1000000000 samples", "GiB for their K/V cache")


def test_outputs_under_a_file_are_refused_and_nothing_is_written(trained, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("mine\n")
    assert_one_line(jaxtrain("hf", "export", "--workdir", trained.workdir, "--output", blocker / "hf"), 2,
                    "--output", blocker)
    assert_one_line(jaxtrain("report", trained.workdir, "--output", blocker / "report"), 2, "--output", blocker)
    assert_one_line(jaxtrain("sweep", "--config", "configs/tiny.py", "--sweep", "configs/sweeps/lr_grid.py",
                             "--sweep_dir", blocker, *tiny_args(trained)[1:]), 2, "--sweep_dir", blocker)
    assert_one_line(jaxtrain("prepare", "--input", "README.md", "--format", "txt", "--output", blocker / "data"), 2,
                    "--output", blocker)
    assert_one_line(jaxtrain("plan", "--config", "configs/tiny.py", "--json", blocker / "plan.json"), 2, "--json",
                    blocker)
    assert blocker.read_text() == "mine\n" and sorted(os.listdir(tmp_path)) == ["a_file"]


def test_bucket_urls_where_a_local_path_is_needed_are_one_line_and_nothing_is_written(tiny_config, tmp_path):
    """Run from tmp_path: pathlib would have turned gs://bucket/x into a local dir "gs:/bucket/x" there."""
    def run(*args):
        return subprocess.run([sys.executable, "-m", "jaxtrain", *map(str, args)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300, check=False)

    assert_one_line(run("prepare", "--output", "hdfs://bucket/kjv"), 2, "--output", "hdfs://bucket/kjv", "scheme")
    tiny, data = f"{REPO}/configs/tiny.py", tiny_config().data.dir
    assert_one_line(run("train", "--config", tiny, "--config.workdir=gs://bucket/run", f"--config.data.dir={data}"),
                    2, "workdir", "gs://bucket/run", "checkpoint.dir")
    assert_one_line(run("train", "--config", tiny, f"--config.workdir={tmp_path}/run", "--config.data.dir=hdfs://b/d"),
                    2, "hdfs://b/d", "scheme")
    assert_one_line(run("train", "--config", tiny, f"--config.workdir={tmp_path}/run", f"--config.data.dir={data}",
                        "--config.checkpoint.dir=az://b/ckpt"), 2, "checkpoint.dir", "az://b/ckpt")
    assert os.listdir(tmp_path) == []


def test_prepare_recurses_on_double_star_and_a_failed_prepare_leaves_nothing(tmp_path):
    (tmp_path / "in" / "sub").mkdir(parents=True)
    (tmp_path / "in" / "a.txt").write_text("one document\n")
    (tmp_path / "in" / "sub" / "b.txt").write_text("another document\n")
    out = tmp_path / "out"
    # Two documents, both held out: bad input, and no work dir or lock file is left beside the output.
    proc = jaxtrain("prepare", "--input", f"{tmp_path}/in/**", "--output", out, "--vocab_size", 300)
    assert_one_line(proc, 2, "no documents left for training after 2 held-out ones")
    assert sorted(os.listdir(tmp_path)) == ["in"]
    proc = jaxtrain("prepare", "--input", f"{tmp_path}/in/**", "--output", out, "--vocab_size", 300,
                    "--heldout_docs", 1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["in", "out"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(Path(s["path"]).name for s in manifest["sources"]) == ["a.txt", "b.txt"]


def test_a_chat_template_that_fails_on_every_record_is_its_message_in_one_line(tmp_path):
    """`prepare --chat` with a template that raises on every conversation: exit 2 with the template's own message
    and line, not "no documents left", and no output dir."""
    from data.test_chat_data import WORDS, _conversations
    from helpers import chat_tokenizer_dir

    hf = chat_tokenizer_dir(tmp_path / "hf", WORDS)
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(c) for c in _conversations(8)) + "\n")
    (tmp_path / "t.jinja").write_text("{% for m in messages %}\n{{ raise_exception('roles must alternate') }}"
                                      "{% endfor %}")
    before = sorted(os.listdir(tmp_path))
    proc = jaxtrain("prepare", "--input", tmp_path / "c.jsonl", "--chat", "--chat_template", tmp_path / "t.jinja",
                    "--tokenizer", hf, "--output", tmp_path / "out", "--heldout_docs", 1)
    assert_one_line(proc, 2, "the chat template failed on all 8 records", "line 2: roles must alternate")
    assert sorted(os.listdir(tmp_path)) == before


def test_ctrl_c_saves_nothing_new_says_what_was_saved_and_a_rerun_resumes(tiny_config, tmp_path):
    config = tiny_config(tmp_path / "run")
    # SIGINT's default disposition in the child, whatever this process has: a suite started as a background job
    # (`nohup make test &`) has it ignored, and the child would inherit that (docs/reliability.md).
    proc = subprocess.Popen([sys.executable, "-m", "jaxtrain", "train", "--config", "configs/tiny.py",
                             *tiny_args(config), "--config.train.steps=100000", "--config.log.every_steps=100"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while not (tmp_path / "run" / "checkpoints" / "10").is_dir() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    proc.stderr = stderr
    line = assert_one_line(proc, 130, "interrupted at step")
    saved = int(line.split("the newest checkpoint is step ")[1].split(";")[0])
    assert saved >= 10 and (tmp_path / "run" / "checkpoints" / str(saved)).is_dir()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["attempts"][-1]["status"] == "interrupted"
    # stop_at, not steps: the same schedule, so the rerun finds its compiled step in the compilation cache.
    rerun = jaxtrain("train", "--config", "configs/tiny.py", *tiny_args(config), "--config.train.steps=100000",
                     f"--config.train.stop_at={saved + 2}")
    assert rerun.returncode == 0 and f"resumed from checkpoint at step {saved}" in rerun.stdout, rerun.stderr[-2000:]
