"""A newcomer's bad inputs and start-up costs (issue 18): every case gives a one-line error or the
right result, with the documented exit status, no traceback and no hang.

Start-up is checked by what a command imports (never by wall-clock time): commands that do not
touch a model import neither torch nor transformers, and `samctl --help` imports no command.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from samctl.index import store as store_module
from samctl.index.load import load_datastore
from samctl.cli import main
from tests.conftest import save_hub_style_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXT = "The quick brown fox jumps over the lazy dog.\ndef reverse(items):\n    return items[::-1]\n"


def samctl(*args: str, timeout: float = 120, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("SAMCTL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "samctl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env, input=stdin)


def one_line_error(proc: subprocess.CompletedProcess, status: int = 2) -> str:
    assert proc.returncode == status, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("samctl: error: "), proc.stderr
    return lines[0]


def _main(args, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(args)
        raise SystemExit(0)
    out, err = capsys.readouterr()
    return info.value.code, out, err


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("SAMCTL_DEBUG", raising=False)


@pytest.fixture
def small_store(tmp_path) -> Path:
    (tmp_path / "a.txt").write_text(TEXT)
    store = tmp_path / "s.sam"
    code = main_status(["build", str(tmp_path / "a.txt"), "-o", str(store), "--tokenizer", "bytes", "-q"])
    assert code == 0
    return store


def main_status(args) -> int:
    try:
        main(args)
    except SystemExit as done:
        return int(done.code or 0)
    return 0


# ---------------------------------------------------------------------------------------------
# start-up: what each command imports


def _modules_after(args: list[str]) -> set[str]:
    """The top-level modules (and samctl.commands.*) loaded by running `samctl args` in a fresh process."""
    probe = ("import sys\nfrom samctl.cli import main\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "names = {m.split('.')[0] for m in sys.modules} | {m for m in sys.modules if m.startswith('samctl.commands.')}\n"
             "sys.stderr.write('MODULES ' + ' '.join(sorted(names)) + '\\n')\n")
    proc = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    line = next(line for line in proc.stderr.splitlines() if line.startswith("MODULES "))
    return set(line.split()[1:])


def test_help_lists_commands_without_importing_them():
    loaded = _modules_after(["--help"])
    assert not {m for m in loaded if m.startswith("samctl.commands.")}
    assert not loaded & {"torch", "transformers", "numba", "tokenizers"}


def test_light_commands_import_no_model_libraries(small_store):
    for args in (["build", "--help"], ["info", str(small_store)], ["query", "--help"]):
        loaded = _modules_after(args)
        assert not loaded & {"torch", "transformers", "numba"}, args
    loaded = _modules_after(["query", str(small_store), "--text", "quick brown"])
    assert not loaded & {"torch", "transformers"}


def test_build_and_query_with_a_hub_tokenizer_folder_skip_transformers(tmp_path):
    """SmolLM2's Hub folder names GPT2Tokenizer with add_prefix_space: `tokenizers` reads it exactly,
    so neither build nor query pays for torch (issue 42, item 7); `--ids` needs no transformers even
    where `--text` does, and says why its text columns are empty."""
    save_hub_style_tokenizer(tmp_path / "hub")
    save_hub_style_tokenizer(tmp_path / "prefix", add_prefix_space=True)  # transformers rewrites this one
    (tmp_path / "a.txt").write_text(TEXT)
    stores = {name: tmp_path / f"{name}.sam" for name in ("hub", "prefix")}
    build = ["build", str(tmp_path / "a.txt"), "-o", str(stores["hub"]), "--tokenizer", str(tmp_path / "hub"), "-q"]
    assert not _modules_after(build) & {"torch", "transformers"}
    for args in (["--text", "quick brown"], ["--ids", "1,2"]):
        assert not _modules_after(["query", str(stores["hub"]), *args]) & {"torch", "transformers"}, args
    assert main_status(["build", str(tmp_path / "a.txt"), "-o", str(stores["prefix"]), "-q",
                        "--tokenizer", str(tmp_path / "prefix")]) == 0
    assert not _modules_after(["query", str(stores["prefix"]), "--ids", "1,2"]) & {"torch", "transformers"}
    proc = samctl("query", str(stores["prefix"]), "--ids", "1,2", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["matched_text"] is None
    assert "query with --text to see text" in proc.stderr


def test_query_with_the_embedded_tokenizer_skips_transformers(tmp_path):
    from samctl.tokenizer import DEFAULT_MODEL_DIR

    if not DEFAULT_MODEL_DIR.is_dir():
        pytest.skip("the embedded default model is not installed")
    (tmp_path / "a.txt").write_text(TEXT)
    store = tmp_path / "s.sam"
    assert samctl("build", str(tmp_path / "a.txt"), "-o", str(store), "-q").returncode == 0
    loaded = _modules_after(["query", str(store), "--text", "quick brown"])
    assert not loaded & {"torch", "transformers"}


def test_registry_summaries_match_the_commands():
    from samctl.commands import COMMANDS, load_command

    for name, text in COMMANDS:
        command = load_command(name)
        assert command is not None and command.name == name
        assert (command.help or "").strip().splitlines()[0] == text, name


# ---------------------------------------------------------------------------------------------
# usage errors: one line, exit status 2


def test_usage_errors_are_one_line(tmp_path, small_store):
    cases = [
        (["build", str(small_store), "-o", str(tmp_path)], "is a directory"),
        (["query", str(small_store), "unexpected"], "unexpected extra argument"),
        (["build", str(small_store), "-o", str(tmp_path / "x.sam"), "--kind", "nope"], "'nope' is not one of"),
        (["nope"], "No such command"),
    ]
    for args, message in cases:
        line = one_line_error(samctl(*args))
        assert message in line and "--help" in line, line
    # A directory is a store only with a manifest (a sharded store): the error says what to pass.
    for args in (["info", str(tmp_path)], ["query", str(tmp_path), "--text", "x"]):
        line = one_line_error(samctl(*args))
        assert "directory without manifest.json" in line and "--shards" in line, line


# ---------------------------------------------------------------------------------------------
# build: folders with special files, replacing outputs, temporary files


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_and_dangling_link_in_a_folder_are_skipped(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXT)
    os.mkfifo(folder / "pipe.txt")  # nobody writes: opening it to read would block for ever
    (folder / "gone.txt").symlink_to(tmp_path / "missing.txt")
    proc = samctl("build", str(folder), "-o", str(tmp_path / "s.sam"), "--tokenizer", "bytes", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "skipped 2 file(s)" in proc.stderr and "Traceback" not in proc.stderr
    assert "dangling symbolic link" in proc.stderr or "FIFO" in proc.stderr
    assert load_datastore(tmp_path / "s.sam").meta.corpus.documents == 1


def test_output_that_is_not_a_store_needs_force(tmp_path, small_store, capsys):
    (tmp_path / "a.txt").write_text(TEXT)
    notes = tmp_path / "notes.txt"
    notes.write_text("precious")
    args = ["build", str(tmp_path / "a.txt"), "-o", str(notes), "--tokenizer", "bytes", "-q"]
    code, _out, err = _main(args, capsys)
    assert code == 2 and err.count("\n") == 1 and "--force" in err
    assert notes.read_text() == "precious"
    code, _out, _err = _main([*args, "--force"], capsys)
    assert code == 0 and load_datastore(notes).meta.corpus.documents == 1
    # an existing store is replaced without --force
    code, _out, _err = _main(["build", str(tmp_path / "a.txt"), "-o", str(small_store), "--tokenizer", "bytes", "-q"],
                             capsys)
    assert code == 0


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporary_files_of_dead_writers_are_removed(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text(TEXT)
    out = tmp_path / "s.sam"
    stale = tmp_path / f"s.sam.tmp{_dead_pid()}.k9x2"
    live = tmp_path / f"s.sam.tmp{os.getppid()}.a1b2"  # our parent runs: its file stays
    other = tmp_path / f"other.sam.tmp{_dead_pid()}.zz"  # another output's: not ours to judge
    for path in (stale, live, other):
        path.write_bytes(b"partial")
    names = []
    real_replace = os.replace

    def spy(src, dst):
        names.append(os.path.basename(src))
        real_replace(src, dst)

    monkeypatch.setattr(store_module.os, "replace", spy)
    assert main_status(["build", str(tmp_path / "a.txt"), "-o", str(out), "--tokenizer", "bytes", "-q"]) == 0
    assert not stale.exists() and live.exists() and other.exists()
    assert names and names[0].startswith(f"s.sam.tmp{os.getpid()}.")


def test_killed_writer_leaves_a_pid_named_file_that_the_next_build_removes(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT * 50)
    writer = ("import os, signal, sys\nfrom samctl.index import store\n"
              "real = store._write_blobs\n"
              "def die(*args, **kwargs):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
              "store._write_blobs = die\n"
              "from samctl.cli import main\nmain(sys.argv[1:])\n")
    args = [str(tmp_path / "a.txt"), "-o", str(tmp_path / "s.sam"), "--tokenizer", "bytes", "-q"]
    killed = subprocess.run([sys.executable, "-c", writer, "build", *args], cwd=ROOT, capture_output=True, timeout=120)
    assert killed.returncode == -9
    left = [p.name for p in tmp_path.iterdir() if ".tmp" in p.name]
    assert len(left) == 1 and left[0].startswith("s.sam.tmp")
    assert samctl("build", *args).returncode == 0
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


# ---------------------------------------------------------------------------------------------
# the shipped question file and README's examples


def test_shipped_question_file_is_spec_bench_format():
    questions = ROOT / "samctl" / "data" / "questions" / "specbench_sample.jsonl"
    records = [json.loads(line) for line in questions.read_text(encoding="utf-8").splitlines()]
    assert len(records) >= 8 and len({r["category"] for r in records}) >= 4
    for record in records:
        assert isinstance(record["question_id"], int) and isinstance(record["category"], str)
        assert isinstance(record["turns"], list) and all(isinstance(t, str) and t for t in record["turns"])
    # bench reads it when --questions is left out: found inside the package, wherever it is installed
    from samctl.commands.bench import SAMPLE_QUESTIONS, bench

    assert SAMPLE_QUESTIONS == questions.resolve()
    assert next(p for p in bench.params if p.name == "questions_path").default == str(SAMPLE_QUESTIONS)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "samctl bench --limit 1 --out runs/cpu" in readme and "samctl bench --limit 1 --out runs/cpu" in bench.help


# ---------------------------------------------------------------------------------------------
# bad sizes, ports and a full disk end in one line (issue 42, item 14)


@pytest.mark.parametrize("args, message", [
    (["generate", "--prompt", "x", "--max-nodes", "4000000000000"], "--max-nodes must be at most 1024, got 4000000000000"),
    (["generate", "--prompt", "x", "--max-new-tokens", "4000000000000"], "--max-new-tokens must be in [1, "),
    (["generate", "--prompt", "x", "--method", "rest", "--rest-nodes", "99999"], "--rest-nodes must be at most"),
    (["generate", "--prompt", "x", "--method", "lookahead", "--la-window", "99999"], "--la-window must be at most"),
    (["generate", "--prompt", "x", "--method", "sd", "--gamma", "99999"], "--gamma must be in [1, "),
    (["generate", "--prompt", "x", "--method", "specdec++", "--bounds", "2", "99999"], "--bounds (MIN, MAX) need"),
    (["generate", "--prompt", "x", "--threads", "99999999"], "--threads must be at most"),
    (["generate", "--prompt", "x", "--method", "sam", "--sam-alpha", "nan"], "--sam-alpha must be a finite number > 0"),
    (["generate", "--prompt", "x", "--method", "sam", "--max-draft", "0"], "--max-draft must be >= 1, got 0"),
    (["generate", "--prompt", "x", "--method", "pld", "--pld-tokens", "0"], "--pld-tokens must be >= 1, got 0"),
    (["generate", "--prompt", "x", "--method", "recycle", "--recycle-nodes", "0"], "--recycle-nodes must be >= 1"),
    (["generate", "--prompt", "x", "--method", "rest", "--rest-depth", "0"], "--rest-depth must be >= 1, got 0"),
    (["generate", "--prompt", "x", "--compare-runs", "99999999"], "--compare-runs must be at most 1000"),
    (["serve", "--port", "99999"], "'--port': 99999 is not in the range 0<=x<=65535"),
    (["serve", "--port", "-1"], "is not in the range 0<=x<=65535"),
    (["serve", "--batch-size", "99999"], "--batch-size must be at most 4096"),
    (["build", "a.txt", "-o", "x.sam", "--kind", "ngram", "--max-n", "99999"], "--max-n must be at most 16"),
    (["build", "a.txt", "-o", "x.sam", "--shards", "99999999"], "--shards must be at most"),
])
def test_sizes_and_ports_beyond_any_use_are_one_line_errors(args, message, capsys):
    code, _, err = _main(args, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("samctl: error: ") and message in err, err


def test_the_python_api_refuses_a_huge_setting_by_its_name():
    from samctl.config import SessionConfig
    from samctl.index.errors import ConfigError

    with pytest.raises(ConfigError, match=r"max_nodes= must be at most 1024"):
        SessionConfig(settings={"max_nodes": 4_000_000_000_000})


def test_each_setting_is_bounds_checked_in_declaration_order():
    from samctl.decode.configs import LookaheadConfig
    from samctl.index.errors import ConfigError

    # --la-ngram (declared first) is below its min and --la-window above its max: ngram is named
    with pytest.raises(ConfigError, match=r"^la_ngram= must be >= 2, got 1$"):
        LookaheadConfig(ngram=1, window=99999)
    with pytest.raises(ConfigError, match=r"^la_window= must be at most 256, got 99999"):
        LookaheadConfig(ngram=3, window=99999)


class _FullDisk:
    """A text file on a disk that fills after `room` lines: the next write lands half, then ENOSPC."""

    def __init__(self, real, room: int) -> None:
        self.real, self.room = real, room

    def write(self, text: str) -> int:
        import errno

        if self.room <= 0:
            self.real.write(text[: len(text) // 2])
            self.real.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= 1
        return self.real.write(text)

    def flush(self) -> None:
        self.real.flush()

    def close(self) -> None:
        self.real.close()


def test_a_full_disk_keeps_the_lines_written_and_resume_finishes(model_dir, tmp_path, monkeypatch, capsys):
    import samctl.commands.generate as generate_module

    records = [json.dumps({"id": f"r{i}", "prompt": f"def f{i}(x):"}) for i in range(5)]
    (tmp_path / "in.jsonl").write_text("\n".join(records) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
            "--max-new-tokens", "4", "--quiet", "--threads", "1"]
    with monkeypatch.context() as patch:
        patch.setattr(generate_module, "open", lambda *a, **k: _FullDisk(open(*a, **k), room=2), raising=False)
        code, _, err = _main(args, capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert "No space left on device (errno 28)" in err and "2 complete line(s)" in err and "--resume" in err, err
    kept = out.read_text()
    assert kept.count("\n") == 2 and not kept.endswith("\n")  # two whole lines, then the torn one
    code, _, err = _main([*args, "--resume"], capsys)
    assert code == 0, err
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [f"r{i}" for i in range(5)]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_standard_output_on_a_full_device_is_one_line(model_dir, tmp_path):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt": "def f(x):"}) + "\n")
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "samctl", "generate", "--model", str(model_dir), "--input",
                               str(tmp_path / "in.jsonl"), "--max-new-tokens", "2", "--quiet", "--threads", "1"],
                              cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "cannot write to standard output: No space left on device (errno 28)" in proc.stderr


def test_batch_output_in_a_missing_folder_is_refused_before_the_model_loads(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    code, _, err = _main(["generate", "--input", str(tmp_path / "in.jsonl"), "--output",
                          str(tmp_path / "missing" / "out.jsonl")], capsys)
    assert code == 2 and err.count("\n") == 1 and "folder" in err and "does not exist" in err, err


def test_memory_save_that_could_not_be_written_is_refused_before_generating(model_dir, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a store")
    base = ["generate", "--model", str(model_dir), "--prompt", "def f(x):", "--max-new-tokens", "4", "--threads", "1"]
    for path, message in ((tmp_path / "missing" / "m.sam", "does not exist"),
                          (tmp_path / "notes.txt", "exists and is not a samctl store")):
        code, out, err = _main([*base, "--memory-save", str(path)], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
    assert (tmp_path / "notes.txt").read_text() == "not a store"
    store = tmp_path / "s.sam"
    assert main_status(["build", str(tmp_path / "notes.txt"), "-o", str(store), "--tokenizer", str(model_dir), "-q"]) == 0
    before = store.read_bytes()
    code, out, err = _main([*base, "--sam", str(store), "--memory-save", str(store)], capsys)
    assert code == 2 and out == "" and "is what --sam reads" in err and store.read_bytes() == before, err
    code, out, err = _main([*base, "--method", "pld", "--memory-save", str(tmp_path / "m.sam")], capsys)
    assert code == 2 and out == "" and "keeps no memory" in err and not (tmp_path / "m.sam").exists(), err


@pytest.mark.parametrize("args, missing", [
    (["train", "eagle", "--out", "h"], "--model"), (["train", "eagle", "--model", "m"], "--out"),
    (["train", "sdsat", "--out", "t"], "--model"), (["train", "acc-head", "--out", "h", "--prompts", "p"], "--target")])
def test_a_trainers_required_option_is_required(args, missing, capsys):
    code, _, err = _main(args, capsys)  # click >= 8.3 ran on with None where a default of None was passed
    assert code == 2 and err.count("\n") == 1 and f"Missing option '{missing}'" in err, err


def test_a_batch_output_that_is_its_input_is_refused(tmp_path, capsys):
    batch = tmp_path / "in.jsonl"
    batch.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    code, _, err = _main(["generate", "--input", str(batch), "--output", str(tmp_path / "." / "in.jsonl")], capsys)
    assert code == 2 and err.count("\n") == 1 and "is what --input reads" in err, err
    assert batch.read_text() == json.dumps({"id": "a", "prompt": "x"}) + "\n"  # it was emptied, and exit 0
