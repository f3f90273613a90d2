"""The embedded model's converted tokenizer is loaded as ``AutoTokenizer`` loads it, without importing
``AutoTokenizer`` (whose module imports torch, which the HTTP frontend does not otherwise need)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from transformers import AutoTokenizer

from scheduler.server_args import ServerArgs
from sglang_constrained.tokenizer_loading import conversion_cache_dir, embedded_model_path, load_tokenizer

TEXTS = ["Hello world", ' ör <|im_start|>user\n{"a": 1}\t', "\u00a0  trailing  "]
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_converted_tokenizer_is_what_autotokenizer_loads(server_args: ServerArgs) -> None:
    ours = load_tokenizer(embedded_model_path(), server_args.cache_path)
    theirs = AutoTokenizer.from_pretrained(
        conversion_cache_dir(embedded_model_path(), server_args.cache_path, "tokenizer")
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
    load_tokenizer(embedded_model_path(), server_args.cache_path)  # converted, if no test has yet
    script = textwrap.dedent(
        """
        import sys
        from scheduler.server_args import ServerArgs
        from sglang_constrained.tokenizer_loading import embedded_model_path, load_tokenizer
        load_tokenizer(embedded_model_path(), ServerArgs().cache_path)
        print("torch" in sys.modules)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
