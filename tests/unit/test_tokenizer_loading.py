"""The embedded model's converted tokenizer is loaded as ``AutoTokenizer`` loads it, without importing
``AutoTokenizer`` (whose module imports torch, which the HTTP frontend does not otherwise need); processes starting
together convert it once."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from transformers import AutoTokenizer

from scheduler.server_args import ServerArgs
from sglang_constrained.tokenizer.loading import (
    conversion_cache_dir,
    conversion_lock,
    embedded_model_path,
    load_tokenizer,
)
from tests.fresh_interpreter import REPO_ROOT, run_python_in

TEXTS = ["Hello world", ' ör <|im_start|>user\n{"a": 1}\t', "\u00a0  trailing  "]


def test_the_converted_tokenizer_is_what_autotokenizer_loads(server_args: ServerArgs) -> None:
    ours = load_tokenizer(embedded_model_path(), server_args.model.cache_path)
    theirs = AutoTokenizer.from_pretrained(
        conversion_cache_dir(embedded_model_path(), server_args.model.cache_path, "tokenizer")
    )
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert ours.all_special_tokens == theirs.all_special_tokens and ours.eos_token_id == theirs.eos_token_id
    assert ours.chat_template == theirs.chat_template
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "user", "content": TEXTS[1]}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_loading_it_imports_no_torch(server_args: ServerArgs) -> None:
    load_tokenizer(embedded_model_path(), server_args.model.cache_path)  # converted, if no test has yet
    script = textwrap.dedent(
        """
        import sys
        from scheduler.server_args import ModelArgs
        from sglang_constrained.tokenizer.loading import embedded_model_path, load_tokenizer
        load_tokenizer(embedded_model_path(), ModelArgs().cache_path)
        print("torch" in sys.modules)
        """
    )
    assert run_python_in(REPO_ROOT, "-c", script).stdout.split() == ["False"]


def test_a_process_finding_a_conversion_under_way_waits_for_it_and_loads_its_result(
    server_args: ServerArgs, tmp_path: Path
) -> None:
    """While this test holds the conversion's lock, a new process waits on it (the kernel lists it as blocked);
    once the converted folder is in place and the lock released, it loads that folder without converting (the
    GGUF reader never imported) and gets the same tokenizer."""
    expected = load_tokenizer(embedded_model_path(), server_args.model.cache_path)  # converted, if no test has yet
    converted = conversion_cache_dir(embedded_model_path(), server_args.model.cache_path, "tokenizer")
    target = conversion_cache_dir(embedded_model_path(), tmp_path, "tokenizer")
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from sglang_constrained.tokenizer.loading import embedded_model_path, load_tokenizer
        tokenizer = load_tokenizer(embedded_model_path(), Path(sys.argv[1]))
        print("gguf" in sys.modules, len(tokenizer))
        """
    )
    with conversion_lock(target):
        waiting = subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT
        )
        deadline = time.monotonic() + 120
        while not blocked_on_a_lock(waiting.pid):
            assert waiting.poll() is None and time.monotonic() < deadline, "the process did not wait for the lock"
            time.sleep(0.05)
        shutil.copytree(converted, target)
    stdout, _ = waiting.communicate(timeout=120)
    assert waiting.returncode == 0
    assert stdout.split() == ["False", str(len(expected))]


def blocked_on_a_lock(pid: int) -> bool:
    """Whether ``pid`` waits for a file lock (``/proc/locks`` lists a waiter with ``->``)."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[1] == "->" and fields[5] == str(pid):
            return True
    return False
